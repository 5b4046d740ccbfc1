"""Memory over a long crawl: the RSS of ``asyncrawl run`` and of its writing process, sampled
while it fetches up to millions of IDs.

What it measures
----------------
For each of ``--sizes`` (numbers of IDs), ``asyncrawl run`` (the installed command, in a process
of its own, as users run it: its state in a fresh directory, durability and in-doubt on, the
rate out of the way) fetches that many IDs from ``throughput.py``'s nginx (static ~1 KB JSON
answers, keep-alive) with ``--concurrency`` requests in flight. Every ``--every`` seconds it
reads from ``/proc`` the resident set (``VmRSS``) of the run's process and of its children
(the SQLite store's writing process). It prints the samples and each process's high-water mark
(``VmHWM``, the highest read at any sample: a child gone before the last
keeps its own), then the run's peak at the largest size over its peak at
the smallest: a crawl whose memory grows with the number of IDs shows it there. Flat memory at
any list size is a promise of the package; issue 14 allowed the state's commands 1.2 × from
100 k to 10 M IDs, and this allows a crawl the same 1.2 × from 1 M to 10 M (below).

Below a million IDs the run's memory has not levelled off yet (on this machine the run's peak
was 55 MB at 100 k IDs, 78 MB at 1 M and 86 MB at 10 M: it grows in the first million, then
hardly), so the default sizes are 1 M and 10 M: ten times the IDs may cost at most 1.2 × the
memory. The end of a run shows in its last samples: its summary counts every ID of the run
in the state (``SqliteStore.run_counts``), which reads through the database's pages.

Usage::

    .venv/bin/python bench/memory.py [--sizes 1000000,10000000] [--concurrency 64] [--every 2]

Needs nginx (``apt-get install nginx-light``), as ``throughput.py`` does. Linux only
(``/proc``). 10,000,000 IDs take 10-12 minutes on this 2-core machine and write ~6 GB of
state into the temporary directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from throughput import cli_files, nginx_server  # noqa: E402

BOUND = 1.2  # the run's peak RSS at the largest size over at the smallest, at most


def status(pid: int, field: str) -> int | None:
    """A ``/proc/PID/status`` field in MB (``None`` once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


class Crawl(NamedTuple):
    samples: list[tuple[float, int, list[int]]]  # (s, the run's MB, its children's MB)
    peaks: tuple[int, list[int | None]]  # VmHWM: the run's, its children's
    elapsed: float


def crawl(n: int, concurrency: int, every: float) -> Crawl:
    """One ``asyncrawl run`` of ``n`` IDs, sampled: its samples, peaks and time."""
    command = Path(sys.executable).parent / "asyncrawl"
    if not command.exists():
        raise SystemExit(f"{command} not found: make .venv/bin/asyncrawl first")
    with tempfile.TemporaryDirectory(prefix="memory-") as tmp, nginx_server(Path(tmp)) as server:
        argv = cli_files(server.base, n, concurrency, str(Path(tmp) / "state"))
        t0 = time.monotonic()
        proc = subprocess.Popen([str(command), *argv, "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: list[tuple[float, int, list[int]]] = []  # (s, run's MB, its children's MB)
        run_peak: int | None = None
        kid_peaks: dict[int, int] = {}  # each child's highest VmHWM seen (kept once it is gone:
        while proc.poll() is None:  # a writer that exits before the last sample had no peak)
            time.sleep(every)
            kids = children(proc.pid)
            run = status(proc.pid, "VmRSS")
            if run is None:
                break
            samples.append((time.monotonic() - t0, run,
                            [mb for mb in (status(k, "VmRSS") for k in kids) if mb is not None]))
            run_peak = max(run_peak or 0, status(proc.pid, "VmHWM") or 0) or None
            for k in kids:
                hwm = status(k, "VmHWM")
                if hwm is not None:
                    kid_peaks[k] = max(kid_peaks.get(k, 0), hwm)
        _, err = proc.communicate()
        elapsed = time.monotonic() - t0
    if proc.returncode != 0 or not samples or run_peak is None:
        raise SystemExit(f"asyncrawl run exited {proc.returncode}:\n{err[-2000:]}")
    return Crawl(samples, (run_peak, list(kid_peaks.values())), elapsed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000000,10000000",
                    help="numbers of IDs, comma-separated, smallest first (1000000,10000000)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples (2)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    peak: dict[int, int] = {}
    for n in sizes:
        samples, (run_peak, kid_peaks), elapsed = crawl(n, args.concurrency, args.every)
        print(f"{n:,} IDs, concurrency {args.concurrency}: {elapsed:.0f} s "
              f"({n / elapsed:,.0f} req/s)")
        print("     s   run MB   writing process MB")
        step = max(1, len(samples) // 20)
        for t, run, kids in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
            print(f"  {t:4.0f}   {run:6}   {', '.join(map(str, kids)) or '-'}")
        print(f"  peak (VmHWM): run {run_peak} MB, writing process "
              f"{', '.join(str(p) for p in kid_peaks) or '-'} MB")
        peak[n] = run_peak
    if len(sizes) < 2:
        return 0
    ratio = peak[sizes[-1]] / peak[sizes[0]]
    verdict = "PASS" if ratio <= BOUND else "FAIL"
    print(f"the run's peak RSS at {sizes[-1]:,} IDs over at {sizes[0]:,}: {peak[sizes[-1]]} / "
          f"{peak[sizes[0]]} MB = {ratio:.2f} (<= {BOUND}): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
