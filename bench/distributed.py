"""Several processes on one job (the PostgreSQL store): scaling, the job-wide rate, the merge.

What it measures
----------------
Against the mock API in a process of its own (``--latency`` s per answer, no faults), each
scenario a new job in the PostgreSQL database ``--pg``:

* **scaling**: 1, 2 and 4 ``asyncrawl run`` processes (``--concurrency`` each, the rate set out
  of the way), all given the same IDs file (each merges it: the merge is idempotent); the
  aggregate throughput is ``--ids`` / the wall time from the first start to the last exit,
  and the ratio to one process. Latency-bound by design: one process's ceiling is
  concurrency / latency.
* **rate-bound**: 4 processes, the job's rate ``--rate`` (each takes a quarter), concurrency
  64 each so that the rate binds: judged from the mock's log, the most requests started in
  any 1-s window (bound: rate x 1.05 + burst) and the mean rate while all work (target: at
  least 95 % of the rate).
* **quota**: the server allows ``--quota`` requests per second (429 + Retry-After beyond), the
  job is configured for 3 x that: 1 and 4 processes, the accepted rate and the share of 429s
  (each process adapts its share of the rate to what the server accepts, and a pause the
  server asks for holds every process).
* **merge**: a file of ``--merge-ids`` shuffled IDs merged into a new job as a run does
  (``jobwide.merge``: the file read, its blocks added), then taken in (``PgStore.take_in``:
  every block expanded into item rows, which the claims do a block at a time while the job
  is fetched), then merged again (a rerun): IDs per second of each.

Usage::

    .venv/bin/python bench/distributed.py [--pg URL] [--ids 4000] [--latency 0.1]
        [--concurrency 16] [--rate 400] [--merge-ids 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from asyncrawl.testing import MockProcess  # noqa: E402

ASYNCRAWL = [sys.executable, "-m", "asyncrawl"]


def config(work: Path, url: str, pg: str, job: str, ids: Path, concurrency: int,
           rate: float, burst: int) -> Path:
    path = work / f"{job}-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(
        f'[source]\nids = "{ids}"\n[request]\nurl = "{url}"\ntimeout = 30\n'
        f"[limits]\nconcurrency = {concurrency}\nrate = {rate}\nburst = {burst}\n"
        f'[passes]\ncooldown = 0\n[state]\nurl = "{pg}"\njob = "{job}"\n')
    return path


def drop_job(pg: str, job: str) -> None:
    """Delete a bench job's rows: a database left holding millions of them slows every later
    merge (the primary key grows), so that figures would depend on what ran before."""
    import psycopg

    from asyncrawl.pgstore import JOB_TABLES

    with psycopg.connect(pg) as db:
        for table in JOB_TABLES:
            db.execute(f"DELETE FROM {table} WHERE job = %s", (job,))


def crawl(work: Path, url: str, pg: str, ids: Path, processes: int, concurrency: int,
          rate: float, burst: int) -> tuple[float, list[int]]:
    """Run ``processes`` processes on a new job; (wall seconds, exit codes)."""
    job = f"bench-{uuid.uuid4().hex[:10]}"
    cfgs = [config(work, url, pg, job, ids, concurrency, rate, burst) for _ in range(processes)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*ASYNCRAWL, "run", "-c", str(c), "--no-progress"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c in cfgs]
    errs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - t0
    drop_job(pg, job)
    for p, err in zip(procs, errs, strict=True):
        if p.returncode != 0:
            print(f"  exit {p.returncode}: {err.strip()[-800:]}", file=sys.stderr)
    return wall, [p.returncode for p in procs]


def window_max(starts: list[float], width: float = 1.0) -> int:
    """The most events in any window of ``width`` seconds."""
    best, j = 0, 0
    for i, t in enumerate(starts):
        while starts[j] < t - width:
            j += 1
        best = max(best, i - j + 1)
    return best


async def merge_rates(pg: str, n: int, work: Path) -> dict[str, float]:
    """IDs per second of what a process given a file of ``n`` shuffled new IDs does: the
    merge (reading the file and adding its blocks to the job: the run's ``jobwide.merge``),
    the take-in of every block (paid a block at a time by the claims while the job is
    fetched), and the same file merged again (a rerun, or a second process given it)."""
    import random

    from asyncrawl.jobwide import merge
    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record
    from asyncrawl.source import IdsFile

    ids = [f"item-{i:09d}" for i in range(n)]
    random.Random(7).shuffle(ids)
    path = work / "merge-ids.txt"
    path.write_text("".join(f"{i}\n" for i in ids))
    del ids
    job = f"bench-merge-{uuid.uuid4().hex[:10]}"
    store = await PgStore.open(pg, job)
    rates: dict[str, float] = {}
    try:
        store.commit([Record("run", extra={"version": "bench", "pid": os.getpid(), "job": None})])
        for what in ("merge", "take in", "merge again"):
            t0 = time.perf_counter()
            if what == "take in":
                assert await store.take_in() == n
            else:
                given, _ = await merge(store, IdsFile(str(path)))
                assert given == n
            rates[what] = n / (time.perf_counter() - t0)
        return rates
    finally:
        await store.close()
        drop_job(pg, job)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--pg", default=os.environ.get(
        "ASYNCRAWL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--ids", type=int, default=4000)
    p.add_argument("--latency", type=float, default=0.1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=400.0)
    p.add_argument("--merge-ids", type=int, default=1_000_000)
    p.add_argument("--quota", type=float, default=200.0)
    p.add_argument("--scenarios", default="merge,scaling,rate,quota,outage",
                   help="which to run, comma-separated")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="asyncrawl-distributed-"))
    ids = work / "ids.txt"
    ids.write_text("".join(f"d{i}\n" for i in range(args.ids)))

    todo = set(args.scenarios.split(","))
    if "merge" in todo:
        rates = asyncio.run(merge_rates(args.pg, args.merge_ids, work))
        print(f"merge of {args.merge_ids:,} shuffled IDs from a file: " + ", ".join(
            f"{what} {rate:,.0f} IDs/s" for what, rate in rates.items()))
    if "scaling" in todo:
        scaling(args, work, ids)
    if "rate" in todo:
        rate_bound(args, work, ids)
    if "quota" in todo:
        quota(args, work, ids)
    if "outage" in todo:
        outage(args, work, ids)
    return 0


def scaling(args: argparse.Namespace, work: Path, ids: Path) -> None:
    with MockProcess(work / "scale.log", "--no-auth", "--faults", "none",
                     "--latency", str(args.latency)) as mock:
        base = None
        print(f"\nscaling: {args.ids:,} IDs, latency {args.latency} s, concurrency "
              f"{args.concurrency} each (one process's ceiling "
              f"{args.concurrency / args.latency:,.0f}/s)")
        for n in (1, 2, 4):
            wall, codes = crawl(work, mock.item_url, args.pg, ids, n, args.concurrency,
                                1e6, 100_000)
            rate = args.ids / wall
            base = base or rate
            print(f"  {n} process{'es' if n > 1 else '  '}: {rate:7,.0f} req/s  "
                  f"{rate / base:4.2f} x one  (exit {codes})")



class Wire:
    """The requests as they reach the server's socket (``tcpdump`` on loopback: each TCP
    segment to ``port`` whose payload begins with ``GET``), judged by the kernel's clock: a
    stall of the mock (it logs a start when its handler runs) shows in its log as a burst of
    the senders, not here. Needs tcpdump and the right to capture; else ``times`` is None."""

    def __init__(self, work: Path, port: int) -> None:
        self.path = work / f"wire-{port}.txt"
        self.proc: subprocess.Popen[bytes] | None = None
        if shutil.which("tcpdump") is None:
            return
        with self.path.open("wb") as out:
            self.proc = subprocess.Popen(
                ["tcpdump", "-i", "lo", "-tt", "-n", "-B", "16384",
                 f"tcp dst port {port} and tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x47455420"],
                stdout=out, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None  # "listening on lo" once it captures
        if not any(b"listening" in self.proc.stderr.readline() for _ in range(3)):
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def times(self) -> list[float] | None:
        """Stop the capture: the GET segments' times, sorted (None: no capture)."""
        if self.proc is None:
            return None
        time.sleep(0.5)  # the last segments reach the capture's buffer
        self.proc.terminate()
        self.proc.wait()
        return sorted(float(line.split()[0]) for line in self.path.read_text().splitlines()
                      if line[:1].isdigit())


def rate_bound(args: argparse.Namespace, work: Path, ids: Path) -> None:
    log = work / "rate.log"
    with MockProcess(log, "--no-auth", "--faults", "none", "--latency", "0.02") as mock:
        burst = 10
        wire = Wire(work, int(mock.item_url.split(":")[2].split("/")[0]))
        _wall, codes = crawl(work, mock.item_url, args.pg, ids, 4, 64, args.rate, burst)
        sent = wire.times()
        entries = mock.settled_log()
    starts = sorted(e.t for e in entries if e.event == "start")
    worst = window_max(starts)
    steady = [t for t in starts if starts[0] + 1.0 <= t <= starts[-1] - 1.0]
    mean = len(steady) / (steady[-1] - steady[0]) if len(steady) > 1 else 0.0
    print(f"\nrate-bound: 4 processes, job rate {args.rate:g}/s, burst {burst}, concurrency 64 "
          f"each (exit {codes})")
    print(f"  most starts in any 1-s window: {worst} (bound {args.rate * 1.05 + burst:.0f})")
    if sent is not None:
        print(f"  the same on the wire (tcpdump, {len(sent):,} GETs): {window_max(sent)}")
    print(f"  mean rate after the first and before the last second: {mean:,.1f}/s "
          f"({mean / args.rate:.1%} of the rate; target >= 95 %)")



def quota(args: argparse.Namespace, work: Path, ids: Path) -> None:
    print(f"\nquota: the server accepts {args.quota:g}/s, the job is set to {3 * args.quota:g}/s, "
          "concurrency 32 each")
    for n in (1, 4):
        with MockProcess(work / f"quota-{n}.log", "--no-auth", "--faults", "none", "--quota",
                         str(args.quota), "--latency", "0.02") as mock:
            _wall, codes = crawl(work, mock.item_url, args.pg, ids, n, 32, 3 * args.quota, 20)
            ends = [e for e in mock.settled_log() if e.event == "end"]
        ok = sorted(e.t for e in ends if e.status == 200)
        limited = sum(e.status == 429 for e in ends)
        print(f"  {n} process{'es' if n > 1 else '  '}: accepted {len(ok) / (ok[-1] - ok[0]):5.0f}/s "
              f"({len(ok) / (ok[-1] - ok[0]) / args.quota:.0%} of the quota), 429s "
              f"{limited / len(ends):.1%} of the answers (exit {codes})")


def outage(args: argparse.Namespace, work: Path, ids: Path) -> None:
    """4 processes; the upstream answers 503 to everything for 6 s from 2 s after the first
    request: the requests the job sends into the outage once its breaker is open (one
    process probes, the others hold), judged from the mock's log."""
    start, length = 2.0, 6.0
    print(f"\noutage: 4 processes, rate {args.rate:g}/s, concurrency 16 each; 503s from "
          f"{start:g} s for {length:g} s")
    with MockProcess(work / "outage.log", "--no-auth", "--faults", "none", "--latency", "0.02",
                     "--outage", f"{start},{length}") as mock:
        _wall, codes = crawl(work, mock.item_url, args.pg, ids, 4, 16, args.rate, 10)
        entries = mock.settled_log()
    starts = sorted(e.t for e in entries if e.event == "start")
    t0 = starts[0]
    into = [t for t in starts if t0 + start + 1.0 <= t < t0 + start + length]
    print(f"  requests started in the outage after its first second: {len(into)} "
          f"({len(into) / (length - 1.0):.1f}/s; the job's rate is {args.rate:g}/s) "
          f"(exit {codes})")


if __name__ == "__main__":
    raise SystemExit(main())
