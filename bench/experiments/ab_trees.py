"""Paired A/B of ``asyncrawl run`` (the cli kind of ``bench/throughput.py``) from this tree and
another checkout, with nothing else between them: the same nginx, alternating which tree goes
first in each pair, ``--pairs`` pairs. Prints each pair's elapsed and CPU seconds and the
median ratio this / other (below 1: this tree is faster). No bare-loop runs in between, so it
says nothing of the ratio to the bare loop (``throughput.py`` does); it answers only "did this
change move the run's time", with less of the drift that separates two kinds several runs
apart in ``throughput.py``'s rounds.

Usage::

    git worktree add /tmp/before HEAD~1 && ln -s "$PWD/.venv" /tmp/before/.venv
    .venv/bin/python bench/experiments/ab_trees.py --against /tmp/before [--requests 40000]
        [--pairs 10] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

from throughput import nginx_server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, metavar="TREE")
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=10)
    args = ap.parse_args()
    trees = {"this": BENCH.parent, "other": Path(args.against).resolve()}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    work = BENCH / ".work"
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp, nginx_server(Path(tmp)) as server:
        for i in range(args.pairs):
            for kind in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                state = tempfile.mkdtemp(dir=tmp)
                out = subprocess.run(
                    [sys.executable, str(trees[kind] / "bench" / "throughput.py"), "--worker",
                     "cli", "--url", server.base, "--requests", str(args.requests),
                     "--concurrency", str(args.concurrency), "--state-dir", f"{state}/state"],
                    capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                runs[kind].append((got["elapsed_s"], got["cpu_s"]))
            (te, tc), (oe, oc) = runs["this"][-1], runs["other"][-1]
            print(f"pair {i + 1}: this {te:.2f} s ({tc:.2f} s CPU), other {oe:.2f} s "
                  f"({oc:.2f} s CPU): {te / oe:.3f}", flush=True)
    elapsed = [a[0] / b[0] for a, b in zip(runs["this"], runs["other"], strict=True)]
    cpu = [a[1] / b[1] for a, b in zip(runs["this"], runs["other"], strict=True)]
    print(f"median this / other: elapsed {statistics.median(elapsed):.3f}, "
          f"CPU {statistics.median(cpu):.3f} ({sum(e < 1 for e in elapsed)} of "
          f"{len(elapsed)} pairs faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
