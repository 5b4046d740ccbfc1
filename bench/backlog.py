"""What a slow store leaves uncommitted: the answered results a ``kill -9`` would cost.

What it measures
----------------
``asyncrawl run`` against the bundled mock API (no latency, no faults) with ``--ids`` IDs and
``--concurrency`` requests in flight, while every transaction of the state's writing process
takes ``--delay`` seconds longer (a slow volume, or a writing process short of CPU: the delay
is added to ``SqliteStore.apply_batch`` before the writing process is forked, so it inherits
it). The worker process watches the run's writer (``writer.ProcessWriter``) at every batch it
sends and reports the most ``ok`` results that were sent and not yet committed at once: what a
``kill -9`` at that moment would have the next run fetch (and pay for) again. SPEC §5 bounds it
by ``concurrency`` plus the writer's batch limit (``writer.BACKLOG``, 1,024 records).

Usage::

    .venv/bin/python bench/backlog.py [--ids 20000] [--concurrency 100] [--delays 0,0.02,0.1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def worker(url: str, n: int, concurrency: int, delay: float, work: Path) -> dict[str, float]:
    """One crawl in this (fresh) process (``latency.worker``'s ``cli``), its store slowed by
    ``delay`` a transaction."""
    from latency import worker as crawl

    from asyncrawl import sqlstore, writer

    apply = sqlstore.SqliteStore.apply_batch

    def slow(self: sqlstore.SqliteStore, records: list, seq: int | None = None) -> None:
        time.sleep(delay)
        apply(self, records, seq)

    sqlstore.SqliteStore.apply_batch = slow  # type: ignore[method-assign]
    peak = [0]
    flush = writer.ProcessWriter._flush

    def watched(self: writer.ProcessWriter) -> None:
        flush(self)
        waiting = sum(rec.kind == "ok" for _, batch in self._to_apply for rec, _ in batch)
        peak[0] = max(peak[0], waiting)

    writer.ProcessWriter._flush = watched  # type: ignore[method-assign]
    return {"rps": crawl("cli", url, n, concurrency, work), "peak": peak[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--delays", default="0,0.02,0.1",
                    help="seconds added to every transaction, comma-separated")
    ap.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.url, args.ids, args.concurrency, args.worker,
                                Path(args.work))))
        return 0
    from throughput import compile_package

    from asyncrawl.testing import MockProcess
    from asyncrawl.writer import BACKLOG

    compile_package()
    bound = args.concurrency + BACKLOG
    worst = 0
    with tempfile.TemporaryDirectory(prefix="backlog-") as tmp, \
            MockProcess(Path(tmp) / "mock.log", "--no-auth", "--faults", "none") as api:
        for delay in (float(d) for d in args.delays.split(",")):
            work = Path(tempfile.mkdtemp(dir=tmp))
            out = subprocess.run(
                [sys.executable, __file__, "--worker", str(delay), "--url", api.url, "--ids",
                 str(args.ids), "--concurrency", str(args.concurrency), "--work", str(work)],
                capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"delay {delay}: failed\n{out.stdout}\n{out.stderr}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            worst = max(worst, got["peak"])
            print(f"transactions {delay * 1000:5.0f} ms slower: {got['rps']:7.0f} req/s; at most "
                  f"{got['peak']:,} ok results answered and not yet committed at once "
                  f"(bound {bound:,})")
    print("PASS" if worst <= bound else "FAIL", f"(worst {worst:,}, bound {bound:,})")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
