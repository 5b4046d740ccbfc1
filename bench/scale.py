"""State at scale: what the SQLite store costs at 100 k, 1 M and 10 M IDs.

For each size N it

1. **builds** a state of N IDs through the store's own write path: ``SqliteStore.commit`` from
   one thread, in batches of 1,024 records as the writer commits them, per ID a ``sent`` intent
   and an ``ok`` result with a JSON payload of about ``--payload-bytes`` for the first half of
   the IDs, then 64 intents without results (in flight when the job "crashed" half way).
   Reported: durable records/s, and the database's size per ID beyond its payload;
2. **resumes** it: ``asyncrawl run`` on the same IDs file against a local mock API (its own
   process, no faults) until the first request arrives, then stops it (SIGINT): seconds from
   the command's start to the first request the server sees, and the process's peak RSS;
3. **reruns** a complete job (every ID settled: a second state built the same way, all ok):
   wall time and peak RSS of ``asyncrawl run`` with nothing left to fetch;
4. ``asyncrawl status --json``: wall and peak RSS;
5. ``asyncrawl export --format jsonl`` and ``--format ids`` to /dev/null, and ``--format jsonl
   -o FILE`` (a file in the work directory, written atomically and fsynced: the disk's write
   rate counts too): records per second.

Peak RSS is the child's own (``wait4``). Usage::

    .venv/bin/python bench/scale.py [--sizes 100000,1000000,10000000] [--payload-bytes 1000]
        [--payload-spread 0]
        [--workdir DIR] [--keep]

The states are large (about N x (payload + 100 B), twice): the work directory must have room
(10 M IDs of 1 KB: ~25 GB). Absolute times depend on the disk and CPU; compare sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from asyncrawl.records import Record  # noqa: E402
from asyncrawl.source import file_identity  # noqa: E402
from asyncrawl.sqlstore import DB  # noqa: E402
from asyncrawl.store import open_store  # noqa: E402
from asyncrawl.testing import MockProcess, read_log  # noqa: E402

BATCH = 1024
KEY = "scale-key"
TIME = "/usr/bin/time"  # GNU time (Debian: apt-get install time)


@dataclass
class Row:
    n: int
    db_bytes: int = 0
    per_id_overhead: float = 0.0  # bytes per ID beyond the payload
    write_rate: float = 0.0  # durable records/s
    writer_rss_mb: float = 0.0  # peak RSS of the store's writing process, after the build
    first_request_s: float = 0.0
    resume_rss_mb: float = 0.0
    rerun_s: float = 0.0
    rerun_rss_mb: float = 0.0
    status_s: float = 0.0
    status_rss_mb: float = 0.0
    export_jsonl_rate: float = 0.0
    export_jsonl_file_rate: float = 0.0
    export_ids_rate: float = 0.0


def ids_of(n: int) -> list[str]:
    return [f"id{i:08d}" for i in range(n)]


def payload(item: str, size: int, spread: int = 0) -> bytes:
    """About ``size`` bytes of JSON for ``item``; ``spread``: its size drawn (by the ID's
    crc32) from ``size`` ± ``spread`` bytes, as real answers vary."""
    if spread:
        size += zlib.crc32(item.encode()) % (2 * spread + 1) - spread
    return orjson.dumps({"id": item, "title": f"Item {item}", "body": "x" * max(0, size - 60)})


async def build(state: Path, n: int, size: int, settled: int, ids_file: Path,
                spread: int = 0) -> tuple[float, int, int, float]:
    """The state of a job over ``ids_file`` whose first ``settled`` IDs are ok and the next 64
    in flight (sent, no result) when it crashed, as its crawl would have left it (the file's
    identity, and its frontier after the settled IDs); returns (durable records/s, records,
    payload bytes, the writing process's peak RSS in MB)."""
    store = await open_store(state)
    records = 0
    t0 = time.perf_counter()
    job = {"method": "GET", "url": "http://127.0.0.1:1/items/{id}", "params": {}}
    source = file_identity(str(ids_file)) | {"lines": n}
    line_bytes = len("id00000000\n")

    payload_bytes = 0

    def write() -> int:
        nonlocal payload_bytes
        count = 0
        store.commit([Record("run", extra={"version": "bench", "pid": 0, "job": job,
                                           "source": source})])
        batch: list[Record] = []
        for i in range(min(n, settled + 64)):
            item = f"id{i:08d}"
            batch.append(Record.sent(item))
            if i < settled:
                body = payload(item, size, spread)
                payload_bytes += len(body)
                batch.append(Record.outcome("ok", item, 200, None, False, None, 1, 1, 1, body))
            if len(batch) >= BATCH:
                store.commit(batch)
                count += len(batch)
                batch = []
        frontier = {"offset": settled * line_bytes, "line": settled, "unique": settled, "dups": 0}
        store.commit([*batch, Record("mark", extra={"frontier": frontier})])
        return count + len(batch) + 2

    records = await asyncio.to_thread(write)
    took = time.perf_counter() - t0
    proc = getattr(store, "process", None)  # (sqlproc.WriterProcess, where the store has one)
    rss = _peak_rss_mb(proc._proc.pid) if proc is not None else 0.0
    await store.close()  # crashed: no "end" record
    return records / took, records, payload_bytes, rss


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_child(args: list[str], *, until_first_request: Path | None = None,
              timeout: float = 3600) -> tuple[float, float, float | None]:
    """Run ``asyncrawl ARGS``; (wall s, peak RSS MB, s to the first request in the mock log).
    The peak RSS is measured by GNU time (``/usr/bin/time``): a child forked from this big
    process would report this process's size as its own high-water mark. A command that fails
    (a resume stopped at its first request exits 130) stops the bench with its stderr."""
    rss_file = Path(tempfile.mkstemp(prefix="rss-")[1])
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        # (run from the temp directory: the repository's example config.toml is not read)
        proc = subprocess.Popen([TIME, "-f", "%M", "-o", str(rss_file), sys.executable, "-m",
                                 "asyncrawl", *args], cwd=tempfile.gettempdir(),
                                stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "SCALE_KEY": KEY})
        first = None
        if until_first_request is not None:
            deadline = t0 + timeout
            while first is None and time.perf_counter() < deadline and proc.poll() is None:
                if until_first_request.exists() and until_first_request.stat().st_size:
                    first = time.perf_counter() - t0
                    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
                    for child in children.split():
                        os.kill(int(child), signal.SIGINT)  # the run under GNU time
                    break
                time.sleep(0.005)
        proc.wait(timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != (130 if until_first_request is not None else 0):
            err.seek(0)
            raise SystemExit(f"asyncrawl {' '.join(args)} exited {proc.returncode}:\n"
                             f"{err.read().decode(errors='replace')[-2000:]}")
    rss_kb = int(rss_file.read_text().split()[-1] or 0)
    rss_file.unlink()
    return wall, rss_kb / 1024, first


def measure(n: int, size: int, work: Path, *, resume_only: bool = False, spread: int = 0
            ) -> Row:
    row = Row(n)
    ids = ids_of(n)
    ids_file = work / f"ids-{n}.txt"
    ids_file.write_text("".join(f"{i}\n" for i in ids))
    half = work / f"half-{n}"
    rate, records, payload_bytes, row.writer_rss_mb = asyncio.run(
        build(half, n, size, n // 2, ids_file, spread))
    row.write_rate = rate
    row.db_bytes = sum(p.stat().st_size for p in half.glob(DB + "*"))
    row.per_id_overhead = (row.db_bytes - payload_bytes) / (n // 2)
    print(f"  {n:,} IDs: built {records:,} records at {rate:,.0f} durable records/s; "
          f"{row.db_bytes / 1e6:,.0f} MB ({row.per_id_overhead:,.0f} B/ID beyond the payload); "
          f"writing process peak RSS {row.writer_rss_mb:,.0f} MB",
          flush=True)

    with MockProcess(work / f"mock-{n}.log", "--api-key", KEY, "--faults", "none") as mock:
        cfg = work / f"scale-{n}.toml"
        cfg.write_text(f'[request]\nurl = "{mock.item_url}"\n[request.headers]\n'
                       f'X-Api-Key = "${{SCALE_KEY}}"\n[source]\nids = "{ids_file}"\n'
                       f'[state]\ndir = "{half}"\nreuse = true\n[limits]\nrate = 1000\n'
                       'concurrency = 16\n')
        _, rss, first = run_child(["run", "-c", str(cfg), "--no-progress"],
                                  until_first_request=mock.log_path)
        row.first_request_s, row.resume_rss_mb = first or float("nan"), rss
        print(f"  resume at 50 %: first request after {row.first_request_s:.2f} s, peak RSS "
              f"{rss:,.0f} MB", flush=True)
        assert read_log(mock.log_path), "no request reached the mock"

    if resume_only:
        shutil.rmtree(half, ignore_errors=True)
        return row
    full = work / f"full-{n}"
    asyncio.run(build(full, n, size, n, ids_file, spread))
    cfg_full = work / f"full-{n}.toml"
    cfg_full.write_text(f'[request]\nurl = "http://127.0.0.1:1/items/{{id}}"\n[source]\n'
                        f'ids = "{ids_file}"\n[state]\ndir = "{full}"\nreuse = true\n')
    row.rerun_s, row.rerun_rss_mb, _ = run_child(["run", "-c", str(cfg_full), "--no-progress"])
    print(f"  rerun, nothing left: {row.rerun_s:.1f} s, peak RSS {row.rerun_rss_mb:,.0f} MB",
          flush=True)
    row.status_s, row.status_rss_mb, _ = run_child(["status", "--state", str(full), "--json"])
    print(f"  status --json: {row.status_s:.2f} s, peak RSS {row.status_rss_mb:,.0f} MB",
          flush=True)
    for fmt, to_file in (("jsonl", False), ("jsonl", True), ("ids", False)):
        out = work / f"out.{fmt}"
        wall, _, _ = run_child(["export", "--state", str(full), "--format", fmt,
                                *(["-o", str(out)] if to_file else [])])
        rate = n / wall
        setattr(row, f"export_{fmt}{'_file' if to_file else ''}_rate", rate)
        out.unlink(missing_ok=True)
        print(f"  export --format {fmt}{f' -o {out.name}' if to_file else ' > /dev/null'}: "
              f"{wall:.1f} s = {rate:,.0f} records/s", flush=True)
    shutil.rmtree(full, ignore_errors=True)
    shutil.rmtree(half, ignore_errors=True)
    return row


def table(rows: list[Row]) -> str:
    head = ("| IDs | DB size | B/ID beyond payload | write (durable rec/s) | writer RSS "
            "| resume: first request "
            "| resume RSS | rerun, nothing left | rerun RSS | status | status RSS | export jsonl "
            "| export jsonl -o FILE | export ids |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(
            f"| {r.n:,} | {r.db_bytes / 1e6:,.0f} MB | {r.per_id_overhead:,.0f} | "
            f"{r.write_rate:,.0f} | {r.writer_rss_mb:,.0f} MB | {r.first_request_s:.2f} s | "
            f"{r.resume_rss_mb:,.0f} MB | "
            f"{r.rerun_s:.1f} s | {r.rerun_rss_mb:,.0f} MB | {r.status_s:.2f} s | "
            f"{r.status_rss_mb:,.0f} MB | {r.export_jsonl_rate:,.0f}/s | {r.export_jsonl_file_rate:,.0f}/s | "
            f"{r.export_ids_rate:,.0f}/s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100000,1000000,10000000")
    p.add_argument("--payload-bytes", type=int, default=1000)
    p.add_argument("--payload-spread", type=int, default=0,
                   help="payload sizes drawn from --payload-bytes +/- this many bytes")
    p.add_argument("--workdir", help="where the states go (default: a temp dir)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--resume-only", action="store_true", help="build and resume only")
    args = p.parse_args(argv)
    from throughput import compile_package

    compile_package()  # (the commands timed start as an installed asyncrawl's do)
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="asyncrawl-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in sizes:
            print(f"{n:,} IDs, payload {args.payload_bytes} B ± {args.payload_spread} "
                  f"(work dir {work})", flush=True)
            rows.append(measure(n, args.payload_bytes, work, resume_only=args.resume_only,
                                spread=args.payload_spread))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
