"""Throughput of asyncrawl against a bare aiohttp loop, same concurrency, same local server.

What it measures
----------------
Requests per second of two clients fetching ``/items/{id}`` for the same ``--requests`` IDs from
the same local nginx (one worker, static ~1 KB JSON body, keep-alive), with ``--concurrency``
requests in flight:

* ``baseline``  -- the cheapest reasonable aiohttp client: an ``asyncio.Queue`` of IDs, N tasks,
  one ``ClientSession`` (``TCPConnector(limit=N)``); each task GETs, ``await resp.read()``,
  ``orjson.loads`` -- nothing else.
* ``cli``       -- asyncrawl as its users run it: ``asyncrawl run -c bench.toml`` (in the worker
  process, through ``asyncrawl.cli.main``), the IDs in a file, the rate limit set out of the way
  (rate 1e6/s, burst 1e5) but durability on: every result is committed (group commit, fsync)
  into a fresh state directory on the normal disk. This includes what the command does around
  the crawl (reading and checking the IDs file, progress lines, its garbage-collector policy).
  It sends through asyncrawl's own HTTP client (``asyncrawl/http1.py``), as a plain install does.
* ``cli-aiohttp`` -- the same with ``ASYNCRAWL_HTTP=aiohttp``: aiohttp's client sends.
* ``library``   -- the same crawl through the library API, ``Crawler(Config(...)).run(ids)``, in an
  application that leaves Python's garbage collector at its defaults.

All run in the default asyncio event loop, each run in a fresh Python subprocess, alternating
(baseline, cli, library, baseline, ...) for ``--rounds`` rounds. The timed section covers
session/crawler setup, all requests, and teardown (for asyncrawl: the final fsync); interpreter
start-up, imports (``preimport``: what ``asyncrawl run`` would import on its first call too;
the package byte-compiled first, ``compile_package``) and writing the input files are excluded.

How to read the result
----------------------
``ratio = median(cli req/s) / median(baseline req/s)``, the figure for asyncrawl; ``library ratio``
is the same for ``library``. 1.0 means asyncrawl costs nothing over a bare aiohttp loop; 0.8 means
it reaches 80 % of its throughput. The two differ mainly by the garbage collector: the CLI raises
the young-generation threshold for its process (``asyncrawl.cli.tune_gc``), the library leaves
that to the application. Each ratio is also given per round (a kind's run over the baseline's
run of the same round: median and range), which a change of the VM's speed between rounds
disturbs less than the ratio of medians. The ratio is the figure to
compare across machines; absolute req/s depend on the CPU. The client is CPU-bound (the machine
this was written on has 2 cores), so the report also gives each worker's CPU time and CPU per
request ("cpu us/req"): the library's overhead shows up there directly. "nginx cpu" is the nginx
worker's CPU share during the run; if it approaches 100 % the server is the bottleneck and the
ratio is meaningless (a warning is printed).

Usage::

    .venv/bin/python bench/throughput.py [--requests 20000] [--concurrency 64] [--rounds 3] [--json]
        [--intent-cost] [--against TREE]

``--against TREE`` adds ``cli@ref`` and ``library@ref``: the same kinds run from another checkout
(``TREE/.venv``), alternating with the others in every round, so that a change is judged
against the same baseline runs: ``git worktree add /tmp/before HEAD~1`` (plus its venv) and
``--against /tmp/before``. The other tree's kinds run its own copy of this script: one from
before 0f5f52f (2026-12-02) times the import of asyncrawl's HTTP stack (~25 ms with compiled
modules, ~1 % of a 20,000-request run) unless its worker gets the same ``preimport``.

``--intent-cost`` adds a kind, ``no-intent``: the ``library`` crawl with the durable "sent" record
(written before each request, for the in-doubt report) switched off in the worker process, and
prints ``1 - median(library) / median(no-intent)``, what that record costs.

Needs nginx (Debian: ``apt-get install -y nginx-light``); exits 2 with that hint when missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
KINDS = ("baseline", "cli", "cli-aiohttp", "library")
NO_INTENT = "no-intent"  # asyncrawl without the durable "sent" record (``--intent-cost``)
NO_INTENT_CLI = "cli-no-intent"  # the same for ``asyncrawl run``
FREE_STORE_CLI = "cli-free-store"  # ``asyncrawl run`` whose store drops sent/ok (``--store-cost``)
# with the fast extra (``--fast``): ``asyncrawl run`` on uvloop's loop; the bare aiohttp loop on
# uvloop's loop
FAST = ("cli-uvloop", "baseline-uvloop")
NGINX_HINT = "nginx not found. Install it with:  apt-get update && apt-get install -y nginx-light"
NGINX_BUSY_WARN = 0.80  # nginx worker CPU share above which the server may be the bottleneck


# --------------------------------------------------------------------------------------------
# Workers (run in a subprocess: ``throughput.py --worker KIND --url URL ...``)
# --------------------------------------------------------------------------------------------


async def run_baseline(base: str, n: int, concurrency: int) -> int:
    """Bare aiohttp: queue of IDs, N tasks, one session; GET, read, parse. Returns #200s."""
    import aiohttp
    import orjson

    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(str(i))
    ok = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok
        while True:
            try:
                item_id = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            async with session.get(f"{base}/items/{item_id}") as resp:
                body = await resp.read()
                orjson.loads(body)
                ok += resp.status == 200

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ok


def bench_config(base: str, concurrency: int, state_dir: str) -> dict[str, Any]:
    """The crawl both asyncrawl kinds run: rate limit out of the way, durability on."""
    return {"url": base + "/items/{id}", "concurrency": concurrency, "rate": 1_000_000.0,
            "burst": 100_000, "state_dir": state_dir, "cooldown": 0.0, "max_tries": 3}


def cli_files(base: str, n: int, concurrency: int, state_dir: str) -> list[str]:
    """Write the IDs file and config.toml for ``asyncrawl run`` next to ``state_dir``; its
    arguments."""
    c = bench_config(base, concurrency, state_dir)
    work = Path(state_dir).parent
    ids = work / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in range(n)))
    cfg = work / "bench.toml"
    cfg.write_text(
        f'[source]\nids = "{ids}"\n[request]\nurl = "{c["url"]}"\n'
        f'[limits]\nconcurrency = {concurrency}\nrate = {c["rate"]}\nburst = {c["burst"]}\n'
        f'[retry]\nmax_tries = {c["max_tries"]}\n[passes]\ncooldown = {c["cooldown"]}\n'
        f'[state]\ndir = "{state_dir}"\n'
    )
    return ["run", "-c", str(cfg)]


def durable_ok(state_dir: str) -> int:
    """The IDs recorded ok in a state directory (read after the timed section)."""
    from asyncrawl.store import read_store

    return read_store(Path(state_dir)).snapshot().counts.ok


async def run_asyncrawl(base: str, n: int, concurrency: int, state_dir: str,
                        intent: bool = True) -> int:
    """asyncrawl through its public library API, durability on. Returns summary.ok.

    ``intent=False`` (for measuring its cost only) skips the durable "sent" record that each
    request otherwise waits for: the writer then only gets the results, as before that record
    existed."""
    from asyncrawl import Config, Crawler

    if not intent:
        skip_intents()
    ids = [str(i) for i in range(n)]
    cfg = Config(**bench_config(base, concurrency, state_dir))
    async with Crawler(cfg) as crawler:
        summary = await crawler.run(ids)
    return int(summary.ok)


def skip_intents() -> None:
    """In this worker process only: the durable "sent" record resolves at once, unwritten."""
    from asyncrawl.records import Record
    from asyncrawl.writer import ProcessWriter, Writer

    for cls in (Writer, ProcessWriter):
        def no_intent(self: Any, record: Record, commit: Any = cls.commit) -> Any:
            if record.kind != "sent":
                return commit(self, record)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(True)  # as if durable at once: nothing is written
            return fut

        cls.commit = no_intent  # type: ignore[method-assign]


def as_kind(kind: str) -> list[int] | None:
    """In this worker process, what ``kind`` changes of ``asyncrawl run``: the intents
    skipped (``no-intent``), the store skipped (``free-store``: returns ``free_store``'s
    count), and the loop and HTTP client: asyncio's and asyncrawl's (a plain install) unless
    the kind says otherwise: cli-aiohttp aiohttp's client, cli-uvloop the fast extra."""
    if kind == NO_INTENT_CLI:
        skip_intents()
    os.environ["ASYNCRAWL_LOOP"] = "uvloop" if kind == "cli-uvloop" else "asyncio"
    os.environ["ASYNCRAWL_HTTP"] = "aiohttp" if kind == "cli-aiohttp" else "auto"
    return free_store() if kind == FREE_STORE_CLI else None


def free_store() -> list[int]:
    """In this worker process only: the ``sent`` and ``ok`` records are durable the moment the
    run's writer sends its batch, and never reach the SQLite store (what the store costs a
    crawl: the writing process, the pipe; the writer's queue and reports unchanged).
    Returns the count of ``ok`` records dropped, kept up to date."""
    from asyncrawl.writer import ProcessWriter

    flush, dropped, free = ProcessWriter._flush, [0], ("sent", "ok")

    def free_flush(self: ProcessWriter) -> None:
        batch = self._batch
        if self._loop is not None and self.failed is None \
                and any(rec.kind in free for rec, _ in batch):
            self._batch = [e for e in batch if e[0].kind not in free]
            gone = [e for e in batch if e[0].kind in free]
            dropped[0] += sum(rec.kind == "ok" for rec, _ in gone)
            self._durable(gone)
        flush(self)

    ProcessWriter._flush = free_flush  # type: ignore[method-assign]
    return dropped


def preimport(kind: str) -> None:
    """Import, before the clock starts, what a kind's timed section would otherwise import:
    aiohttp and orjson for every kind, and for asyncrawl's what ``asyncrawl run`` imports on
    its first call (the command imports the HTTP stack only when it sends); uvloop for the
    uvloop kinds. The timed sections then hold the crawls alone, alike for every kind."""
    import aiohttp  # noqa: F401
    import orjson  # noqa: F401

    if not kind.startswith("baseline"):
        import logging.handlers  # noqa: F401
        import tomllib  # noqa: F401

        import asyncrawl.cli
        import asyncrawl.crawler  # noqa: F401
    if kind.endswith("uvloop"):
        import uvloop  # noqa: F401


def worker_main(args: argparse.Namespace) -> int:
    """Time one run and print its figures as one JSON line on stdout."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    preimport(args.worker)
    if not args.worker.startswith("baseline"):
        import asyncrawl.cli  # (the cli kind calls it; imported for both asyncrawl kinds)
    else:  # the allocator regime asyncrawl sets for its reads: the baseline does not pay
        from asyncrawl.fetch import keep_reads_off_mmap  # three system calls a read either

        keep_reads_off_mmap()

    async def timed() -> tuple[int, float, float]:
        cpu0, t0 = time.process_time(), time.perf_counter()
        if args.worker.startswith("baseline"):
            ok = await run_baseline(args.url, args.requests, args.concurrency)
        else:
            ok = await run_asyncrawl(args.url, args.requests, args.concurrency, args.state_dir,
                                     intent=args.worker != NO_INTENT)
        return ok, time.perf_counter() - t0, time.process_time() - cpu0

    dropped = as_kind(args.worker)
    if args.worker in ("cli", "cli-aiohttp", NO_INTENT_CLI, FREE_STORE_CLI, "cli-uvloop"):
        argv = cli_files(args.url, args.requests, args.concurrency, args.state_dir)
        cpu0, t0 = time.process_time(), time.perf_counter()
        code = asyncrawl.cli.main(argv)  # ``asyncrawl run``: it runs its own event loop
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if code != (0 if dropped is None else 6):  # (6: the store kept no ok to settle IDs)
            print(f"asyncrawl run exited {code}", file=sys.stderr)
        ok = durable_ok(args.state_dir) if dropped is None else dropped[0]
    elif args.worker == "baseline-uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            ok, elapsed, cpu = runner.run(timed())
    else:
        ok, elapsed, cpu = asyncio.run(timed())
    result = {"kind": args.worker, "ok": ok, "elapsed_s": elapsed, "cpu_s": cpu}
    sys.stdout.write(json.dumps(result) + "\n")
    if ok != args.requests:
        print(f"{args.worker}: only {ok} of {args.requests} requests ok", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------------------------


def json_body(target: int = 1024) -> str:
    """A compact JSON object of about ``target`` bytes, safe inside an nginx '...' string."""
    item: dict[str, Any] = {
        "id": 123456789,
        "type": "note",
        "title": "Quarterly inventory reconciliation notes",
        "tags": ["inventory", "finance", "q3", "warehouse-7"],
        "author": {"id": 4242, "name": "A. Example", "email": "a.example@example.com"},
        "created": "2024-05-17T09:31:27Z",
        "updated": "2024-06-02T14:05:51Z",
        "text": "",
    }
    filler = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. "
    base_len = len(json.dumps(item, separators=(",", ":")))
    item["text"] = (filler * 40)[: max(0, target - base_len)]
    body = json.dumps(item, separators=(",", ":"))
    assert not set(body) & set("'$\\;"), "body must be safe in an nginx quoted string"
    return body


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nginx_config(workdir: Path, port: int, body: str, nginx_v: str) -> str:
    # Keep every path nginx writes to inside workdir; temp paths only for compiled-in modules.
    temp_paths = [f"client_body_temp_path {workdir}/client_body;"]
    for module in ("proxy", "fastcgi", "uwsgi", "scgi"):
        if f"--without-http_{module}_module" not in nginx_v:
            temp_paths.append(f"{module}_temp_path {workdir}/{module};")
    temp = "\n    ".join(temp_paths)
    return f"""\
worker_processes 1;
daemon off;
master_process on;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    {temp}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location /items/ {{
            default_type application/json;
            return 200 '{body}';
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


def nginx_worker_pids(master_pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{master_pid}/task/{master_pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in children.split()]


def proc_cpu_seconds(pids: list[int]) -> float:
    """user+system CPU seconds of the given processes, from /proc (0.0 where unreadable)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


@dataclass
class Nginx:
    base: str
    master_pid: int
    worker_pids: list[int]

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.worker_pids)


@contextmanager
def nginx_server(workdir: Path) -> Iterator[Nginx]:
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if nginx is None:
        print(NGINX_HINT, file=sys.stderr)
        raise SystemExit(2)
    nginx_v = subprocess.run([nginx, "-V"], capture_output=True, text=True).stderr
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_config(workdir, port, json_body(), nginx_v))
    error_log = workdir / "error.log"
    cmd = [nginx, "-p", str(workdir), "-e", str(error_log), "-c", str(conf)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                log = error_log.read_text() if error_log.exists() else ""
                raise RuntimeError(f"nginx exited with {proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(base + "/items/0", timeout=1) as resp:
                    json.loads(resp.read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield Nginx(base, proc.pid, nginx_worker_pids(proc.pid))
    finally:
        proc.terminate()  # SIGTERM: fast shutdown
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    round: int
    kind: str
    requests: int
    elapsed_s: float
    rps: float
    cpu_s: float  # worker CPU (user+sys) inside the timed section
    cpu_total_s: float  # whole worker process incl. interpreter start-up (getrusage children)
    cpu_us_per_req: float
    client_cpu_share: float  # cpu_s / elapsed_s (1.0 = one core busy)
    nginx_cpu_share: float  # nginx worker CPU / elapsed (wall time of the whole subprocess)


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


REF = "@ref"  # suffix of the kinds run from the --against tree


def run_worker(kind: str, rnd: int, server: Nginx, args: argparse.Namespace, state_root: Path) -> Run:
    state_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-r{rnd}-", dir=state_root))
    python, script, cwd = sys.executable, str(Path(__file__).resolve()), REPO_ROOT
    if kind.endswith(REF):  # the same worker, from the other checkout (its venv, its package)
        tree = Path(args.against).resolve()
        python, script, cwd = str(tree / ".venv/bin/python"), str(tree / "bench/throughput.py"), tree
    cmd = [
        python, script,
        "--worker", kind.removesuffix(REF),
        "--url", server.base,
        "--requests", str(args.requests),
        "--concurrency", str(args.concurrency),
        "--state-dir", str(state_dir / "state"),
    ]  # fmt: skip
    cpu0, ngx0, t0 = children_cpu(), server.cpu_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall, ngx = time.perf_counter() - t0, server.cpu_seconds() - ngx0
    cpu_total = children_cpu() - cpu0
    shutil.rmtree(state_dir, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    res = json.loads(lines[-1])
    elapsed, cpu = float(res["elapsed_s"]), float(res["cpu_s"])
    return Run(
        round=rnd,
        kind=kind,
        requests=args.requests,
        elapsed_s=elapsed,
        rps=args.requests / elapsed,
        cpu_s=cpu,
        cpu_total_s=cpu_total,
        cpu_us_per_req=cpu / args.requests * 1e6,
        client_cpu_share=cpu / elapsed,
        # nginx CPU is sampled around the whole subprocess; start-up is idle time for nginx,
        # so divide by the timed section to get its share while requests were flowing.
        nginx_cpu_share=ngx / min(elapsed, wall),
    )


def compile_package(tree: Path = REPO_ROOT, python: str = sys.executable) -> None:
    """Byte-compile ``tree``'s package, as an installed one has it: an editable install in an
    environment with ``PYTHONDONTWRITEBYTECODE`` set (this machine's) would otherwise compile
    every module a run imports from its source, each time."""
    subprocess.run([python, "-m", "compileall", "-q", str(tree / "asyncrawl")], check=True,
                   stdout=subprocess.DEVNULL)


def asyncrawl_available() -> str | None:
    """None if ``from asyncrawl import Config, Crawler`` works in a worker, else the reason."""
    proc = subprocess.run(
        [sys.executable, "-c", "from asyncrawl import Config, Crawler"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or ["unknown error"])[-1]


def state_root() -> Path:
    """A directory for state dirs on a real disk (the store fsyncs; tmpfs would flatter it)."""
    tmp = Path(tempfile.gettempdir())
    fstype = ""
    try:
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fs, *_ = line.split()
            if (str(tmp) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
                best, fstype = mnt, fs
    except OSError:
        pass
    if fstype in ("tmpfs", "ramfs"):
        root = BENCH_DIR / ".work"
        root.mkdir(exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="throughput-", dir=root))
    return Path(tempfile.mkdtemp(prefix="asyncrawl-bench-"))


def print_table(runs: list[Run], out: TextIO) -> None:
    print(
        f"{'round':>5} {'kind':<9} {'req/s':>9} {'elapsed s':>9} {'cpu s':>7} "
        f"{'cpu us/req':>10} {'client cpu':>10} {'nginx cpu':>9} {'proc cpu s':>10}",
        file=out,
    )
    for r in runs:
        print(
            f"{r.round:>5} {r.kind:<11} {r.rps:>9.0f} {r.elapsed_s:>9.2f} {r.cpu_s:>7.2f} "
            f"{r.cpu_us_per_req:>10.0f} {r.client_cpu_share:>10.0%} {r.nginx_cpu_share:>9.0%} "
            f"{r.cpu_total_s:>10.2f}",
            file=out,
        )


def driver_main(args: argparse.Namespace) -> int:
    kinds = list(KINDS) if args.only is None else [args.only]
    if args.kinds:
        kinds = args.kinds.split(",")
    if args.intent_cost:
        kinds += [NO_INTENT, NO_INTENT_CLI]
    if args.store_cost:
        kinds += [FREE_STORE_CLI]
    if args.fast:
        kinds += list(FAST)
    if args.against:
        kinds += [k + REF for k in kinds if k in ("cli", "library")]
    skipped: str | None = None
    if set(kinds) - {"baseline"}:
        reason = asyncrawl_available()
        if reason is not None:
            skipped = f"asyncrawl not importable ({reason}); running the baseline only"
            print(f"NOTE: {skipped}", file=sys.stderr)
            kinds = [k for k in kinds if k == "baseline"]
            if not kinds:
                return 1

    compile_package()
    if args.against:
        tree = Path(args.against).resolve()
        compile_package(tree, str(tree / ".venv/bin/python"))
    root = state_root()
    runs: list[Run] = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="nginx-bench-") as nginx_dir,
            nginx_server(Path(nginx_dir)) as server,
        ):
            if args.fsync_delay:  # the workers' fsyncs only (nginx is already running)
                from slowdisk import preload

                os.environ.update(preload(args.fsync_delay, Path(nginx_dir)))
            print(
                f"nginx at {server.base} (workers {server.worker_pids}); "
                f"{args.requests} requests, concurrency {args.concurrency}, "
                f"{args.rounds} rounds, state under {root}",
                file=sys.stderr,
            )
            if args.warmup:
                warm = argparse.Namespace(**{**vars(args), "requests": args.warmup})
                for kind in kinds:
                    run_worker(kind, 0, server, warm, root)
            for rnd in range(1, args.rounds + 1):
                for kind in kinds:
                    run = run_worker(kind, rnd, server, args, root)
                    runs.append(run)
                    print(
                        f"  round {rnd} {kind:<11} {run.rps:8.0f} req/s  "
                        f"cpu {run.cpu_s:.2f} s  nginx {run.nginx_cpu_share:.0%}",
                        file=sys.stderr,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {kind: statistics.median(r.rps for r in runs if r.kind == kind) for kind in kinds}
    cpu_medians = {
        kind: statistics.median(r.cpu_us_per_req for r in runs if r.kind == kind) for kind in kinds
    }
    def ratio_of(kind: str) -> float | None:
        return medians[kind] / medians["baseline"] if {kind, "baseline"} <= medians.keys() else None

    def paired(kind: str) -> list[float]:
        """``kind``'s req/s over the baseline's in the same round, for each round: the VM's
        slow and fast phases last minutes, so a round's two runs share one far more often than
        the medians of all rounds do."""
        base = {r.round: r.rps for r in runs if r.kind == "baseline"}
        return [r.rps / base[r.round] for r in runs if r.kind == kind and r.round in base]

    ratio, library_ratio = ratio_of("cli"), ratio_of("library")
    nginx_max = max(r.nginx_cpu_share for r in runs)
    warnings = []
    if nginx_max > NGINX_BUSY_WARN:
        warnings.append(f"nginx worker reached {nginx_max:.0%} CPU: the server may be the bottleneck")
    if skipped:
        warnings.append(skipped)

    # Human-readable report on stdout; with --json it goes to stderr and stdout gets only JSON.
    out = sys.stderr if args.json else sys.stdout
    print_table(runs, out)
    print(file=out)
    for kind in kinds:
        print(
            f"median {kind:<11} {medians[kind]:9.0f} req/s   {cpu_medians[kind]:6.0f} us CPU/req",
            file=out,
        )
    rows = [("cli", ratio, "ratio"), ("library", library_ratio, "library ratio")]
    rows += [(k + REF, ratio_of(k + REF), f"{label} of --against")
             for k, _, label in list(rows) if k + REF in medians]
    rows += [(k, ratio_of(k), f"{k} ratio") for k in ("cli-aiohttp", *FAST) if k in medians]
    for kind, value, label in rows:
        if value is not None:
            cpu_ratio = cpu_medians[kind] / cpu_medians["baseline"]
            pairs = paired(kind)
            print(f"{label} = median({kind}) / median(baseline) = {value:.3f}   "
                  f"(CPU per request {cpu_ratio:.2f}x; per round: median "
                  f"{statistics.median(pairs):.3f}, {min(pairs):.3f}-{max(pairs):.3f})", file=out)
    if ratio is None and library_ratio is None:
        print("ratio = n/a (asyncrawl side not run)", file=out)
    intent_cost = None
    if {"library", NO_INTENT} <= medians.keys():
        intent_cost = 1 - medians["library"] / medians[NO_INTENT]
        if {"cli", NO_INTENT_CLI} <= medians.keys():
            print(f"intent cost (cli) = 1 - median(cli) / median({NO_INTENT_CLI}) = "
                  f"{1 - medians['cli'] / medians[NO_INTENT_CLI]:+.1%}")
        print(f"intent cost = 1 - median(library) / median({NO_INTENT}) = {intent_cost:+.1%} "
              "(negative: faster with it)", file=out)
    if {"cli", FREE_STORE_CLI} <= medians.keys():
        print(f"store cost (cli) = 1 - median(cli) / median({FREE_STORE_CLI}) = "
              f"{1 - medians['cli'] / medians[FREE_STORE_CLI]:+.1%}", file=out)
    for w in warnings:
        print(f"WARNING: {w}", file=out)

    if args.json:
        print(
            json.dumps(
                {
                    "requests": args.requests,
                    "concurrency": args.concurrency,
                    "rounds": args.rounds,
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "runs": [asdict(r) for r in runs],
                    "median_rps": medians,
                    "median_cpu_us_per_req": cpu_medians,
                    "ratio": ratio,
                    "library_ratio": library_ratio,
                    "paired_ratios": {k: paired(k) for k in kinds if k != "baseline"},
                    "intent_cost": intent_cost,
                    "nginx_max_cpu_share": nginx_max,
                    "warnings": warnings,
                }
            )
        )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=20_000, help="requests per run (20000)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (64)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side (3)")
    p.add_argument("--warmup", type=int, default=2_000, help="unreported warm-up requests (2000)")
    p.add_argument("--only", choices=KINDS, help="run one side only")
    p.add_argument("--kinds", help="the kinds to run, comma-separated (e.g. baseline,cli)")
    p.add_argument("--against", metavar="TREE",
                   help="also run the cli and library kinds from another checkout (with its own "
                        ".venv), in the same rounds: a before/after comparison on one baseline")
    p.add_argument("--intent-cost", action="store_true",
                   help=f"also run asyncrawl without its durable 'sent' record ({NO_INTENT}) "
                        "and print what the record costs")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with all figures on stdout (report goes to stderr)",
    )
    # internal: run one timed worker in this process
    p.add_argument("--store-cost", action="store_true",
                   help=f"also run asyncrawl run with a store that drops the sent and ok records "
                        f"({FREE_STORE_CLI}) and print what the store costs")
    p.add_argument("--worker", choices=(*KINDS, NO_INTENT, NO_INTENT_CLI, FREE_STORE_CLI, *FAST),
                   help=argparse.SUPPRESS)
    p.add_argument("--fast", action="store_true",
                   help="also run cli-uvloop and baseline-uvloop (needs "
                        "asyncrawl[fast])")
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--fsync-delay", type=float, default=0.0, metavar="MS",
                   help="make every fsync of the workers take MS ms longer (a network volume; "
                        "bench/slowsync.c, needs a C compiler)")
    p.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--requests, --concurrency and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
