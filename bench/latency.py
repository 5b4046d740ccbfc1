"""Latency-bound throughput: a slow API, many requests in flight, the rate out of the way.

What it measures
----------------
Against the bundled mock API in a process of its own (``--latency`` seconds added to every
answer, no faults, no key), ``--ids`` IDs with ``--concurrency`` requests in flight:

* ``baseline``: a bare aiohttp loop (``bench/throughput.py``'s: a queue, N tasks, one session);
* ``cli``: ``asyncrawl run`` on asyncio's loop, as a plain install runs it (asyncrawl's own HTTP
  client, ``asyncrawl/http1.py``; durability and in-doubt on, a fresh state);
* ``cli-aiohttp``: the same with aiohttp's client (``ASYNCRAWL_HTTP=aiohttp``);
* ``cli-uvloop``: the ``fast`` extra: ``cli`` on uvloop's loop (when the extra is installed);
* with ``--intent-cost``, ``cli-no-intent``: ``cli`` with the durable ``sent`` record resolved at
  once, unwritten (``throughput.skip_intents``); with ``--store-cost``, ``cli-free-store``:
  ``cli`` whose ``sent`` and ``ok`` records never reach the store (``throughput.free_store``:
  no intent wait, no SQLite, no writing process's work). What the intents, and the store, cost
  a latency-bound crawl: ``1 - median(cli) / median(kind)``.

The ideal is ``concurrency / latency`` requests per second (1,000 at 100 ms and 100 in flight):
each figure is given as a share of it. The timed section is the crawl (for ``cli``: the whole
``asyncrawl.cli.main`` call, imports excluded as they are for the baseline: the package is
byte-compiled first and what ``run`` imports is imported before the clock starts), alternating
kinds for ``--rounds`` rounds; the median is quoted. Beside it, the rate between the first
request the mock saw and its last answer (from the mock's log): the crawl's pace without its
start and end. And a request's cycle in that stretch (``concurrency`` over that rate) cut in two
from the same log: the mock's own time (its handler's start to its end: the latency, and its
timer's lateness) and the rest, the client's side (the answer's way back and its handling, the
next request's start and its way to the handler: what the client's loop adds, plus the
transport both ways).

Usage::

    .venv/bin/python bench/latency.py [--ids 10000] [--latency 0.1] [--concurrency 100]
        [--rounds 3] [--fsync-delay MS] [--intent-cost] [--store-cost]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))  # (throughput's helpers, slowdisk)


def write_job(work: Path, url: str, n: int, concurrency: int) -> Path:
    """The crawl's IDs file and config in ``work`` (state in ``work/state``, the rate out of
    the way): the config's path."""
    ids = work / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in range(n)))
    cfg = work / "latency.toml"
    cfg.write_text(f'[source]\nids = "{ids}"\n[request]\nurl = "{url}/items/{{id}}"\n'
                   f"[limits]\nconcurrency = {concurrency}\nrate = 1000000\nburst = 100000\n"
                   f'[passes]\ncooldown = 0\n[state]\ndir = "{work / "state"}"\n')
    return cfg


def worker(kind: str, url: str, n: int, concurrency: int, work: Path) -> float:
    """One timed run in this (fresh) process: requests per second."""
    from throughput import preimport

    preimport(kind)  # (outside the timed section, alike for every kind)
    if kind == "baseline":
        from throughput import run_baseline

        t0 = time.perf_counter()
        ok = asyncio.run(run_baseline(url, n, concurrency))
        elapsed = time.perf_counter() - t0
    else:
        from throughput import as_kind

        import asyncrawl.cli

        dropped = as_kind(kind)
        cfg = write_job(work, url, n, concurrency)
        t0 = time.perf_counter()
        code = asyncrawl.cli.main(["run", "-c", str(cfg), "--no-progress"])
        elapsed = time.perf_counter() - t0
        from asyncrawl.store import read_store

        if dropped is not None:  # (exit 6: the store kept no ok to settle the IDs with)
            ok = dropped[0] if code == 6 else 0
        else:
            ok = read_store(work / "state").snapshot().counts.ok if code == 0 else 0
    if ok != n:
        raise SystemExit(f"{kind}: {ok} of {n} ok")
    return n / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=10_000)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--fsync-delay", type=float, default=0.0, metavar="MS",
                    help="make every fsync of the crawls take MS ms longer (a network volume; "
                         "bench/slowsync.c, needs a C compiler)")
    ap.add_argument("--intent-cost", action="store_true",
                    help="add cli-no-intent: cli with the durable sent record switched off")
    ap.add_argument("--store-cost", action="store_true",
                    help="add cli-free-store: cli whose sent and ok records skip the store")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps({"rps": worker(args.worker, args.url, args.ids, args.concurrency,
                                        Path(args.work))}))
        return 0
    from throughput import FREE_STORE_CLI, NO_INTENT_CLI, compile_package

    from asyncrawl.testing import MockProcess, read_log, requests_by_id

    compile_package()
    kinds = ["baseline", "cli", "cli-aiohttp"]
    try:
        import uvloop  # noqa: F401

        kinds += ["cli-uvloop"]
    except ImportError:
        print("the fast extra is not installed (pip install 'asyncrawl[fast]'): no cli-uvloop",
              file=sys.stderr)
    if args.intent_cost:
        kinds.append(NO_INTENT_CLI)
    if args.store_cost:
        kinds.append(FREE_STORE_CLI)
    ideal = args.concurrency / args.latency
    got: dict[str, list[float]] = {k: [] for k in kinds}
    body: dict[str, list[float]] = {k: [] for k in kinds}  # first request to last answer
    client: dict[str, list[float]] = {k: [] for k in kinds}  # ms of a cycle outside the mock
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp, \
            MockProcess(Path(tmp) / "mock.log", "--no-auth", "--faults", "none", "--latency",
                        str(args.latency)) as api:
        env = dict(os.environ)
        if args.fsync_delay:
            from slowdisk import preload

            env.update(preload(args.fsync_delay, Path(tmp)))
        for rnd in range(1, args.rounds + 1):
            for kind in kinds:
                work = Path(tempfile.mkdtemp(dir=tmp))
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", kind, "--url", api.url, "--ids",
                     str(args.ids), "--concurrency", str(args.concurrency), "--work", str(work)],
                    capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    raise SystemExit(f"{kind} failed:\n{out.stdout}\n{out.stderr}")
                rps = json.loads(out.stdout.strip().splitlines()[-1])["rps"]
                got[kind].append(rps)
                log = read_log(Path(tmp) / "mock.log")
                span = (max(e.t for e in log if e.event == "end")
                        - min(e.t for e in log if e.event == "start"))
                body[kind].append(args.ids / span)
                served = [end - start for reqs in requests_by_id(log).values()
                          for start, end, _ in reqs if end is not None]
                cycle = args.concurrency * span / args.ids * 1000
                server = statistics.mean(served) * 1000
                client[kind].append(cycle - server)
                print(f"  round {rnd} {kind:<14} {rps:7.0f} req/s  {rps / ideal:.1%} of ideal; "
                      f"first request to last answer {args.ids / span:7.0f} req/s; a cycle "
                      f"{cycle:.2f} ms: the mock {server:.2f}, the client's side "
                      f"{cycle - server:.2f}", file=sys.stderr)
                (Path(tmp) / "mock.log").write_text("")  # the log is not what is measured
    print(f"{args.ids} IDs, latency {args.latency * 1000:g} ms, concurrency {args.concurrency}: "
          f"ideal {ideal:,.0f} req/s")
    for kind in kinds:
        med = statistics.median(got[kind])
        print(f"median {kind:<14} {med:7.0f} req/s   {med / ideal:.1%} of ideal; first request "
              f"to last answer {statistics.median(body[kind]):7.0f} req/s; the client's side "
              f"of a cycle {statistics.median(client[kind]):.2f} ms")
    for kind, what in ((NO_INTENT_CLI, "the intents"), (FREE_STORE_CLI, "the store")):
        if kind in got:
            cost = 1 - statistics.median(got["cli"]) / statistics.median(got[kind])
            print(f"what {what} cost this crawl = 1 - median(cli) / median({kind}) = "
                  f"{cost:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
