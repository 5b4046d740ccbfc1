"""asyncrawl's own cost per request on the event loop: the crawl without HTTP.

What it measures
----------------
``asyncrawl run --no-progress`` (through ``asyncrawl.cli.main``: its GC policy and progress
ticker included, on asyncio's loop as ``throughput.py``'s cli kind) over ``--ids`` IDs from a
file, at concurrency 64, the rate out of the way (as ``throughput.py``: 1e6/s, so the governor
always has a token at once), with the one HTTP attempt of each request replaced
by an instant one: it yields to the loop once, as a request does, and returns a parsed 1-KB
``200`` answer (``fetch.Fetcher._attempt`` patched in the worker process). What is left is what
asyncrawl adds to a bare aiohttp loop: the queue, the governor, the ``sent`` intent and its
wake-up, the verdict, the outcome record, the writer's reports, the tally and the hooks.

By default the store is free too (its commit drops ``sent`` and ``ok`` records, as
``throughput.py --store-cost``), so that the figure is the loop's work and not SQLite's;
``--real-store`` keeps the store (a tree from before the SQLite store has no free store).
Reported per request: the event loop thread's CPU (``time.thread_time``), the whole process's
CPU and the wall time; the median of ``--rounds`` runs, each a fresh subprocess (the figures
include the command's fixed start and end: use tens of thousands of IDs). ``--against TREE``
runs the same from another checkout (its ``asyncrawl`` package first on ``sys.path``),
alternating with this tree's runs, and prints the ratio of the medians: judge a change by that
ratio, not by absolute figures.

This is not a substitute for ``throughput.py`` (aiohttp and the socket calls are most of a
request's CPU): it sizes the part that is asyncrawl's, where ``throughput.py``'s noise
(±10-20 % between identical runs on a small VM) hides changes of a few microseconds.

Usage::

    .venv/bin/python bench/overhead.py [--ids 40000] [--rounds 5] [--real-store] [--against TREE]
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
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))  # (throughput's free store)
BODY = b'{"id": 1, "name": "' + b"x" * 960 + b'", "tags": [1, 2, 3]}'


def patch(free: bool) -> None:
    """In this (worker) process: the instant attempt, and the free store unless ``free`` is off
    (``throughput.free_store``, the same as its cli-free-store kind)."""
    import orjson

    from asyncrawl import fetch

    async def instant(self: Any, item_id: str, *rest: Any) -> Any:
        await asyncio.sleep(0)  # a request yields to the loop at least once
        return fetch.Attempt(fetch.Outcome.OK, 200, orjson.loads(BODY), None, None, True, BODY)

    fetch.Fetcher._attempt = instant  # type: ignore[method-assign]
    if free:
        from throughput import free_store

        free_store()


def worker(args: argparse.Namespace) -> None:
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    import asyncrawl.cli
    import asyncrawl.crawler  # imported outside the timed part (the command imports them
    import asyncrawl.store  # lazily)

    patch(not args.real_store)
    work = Path(tempfile.mkdtemp(prefix="overhead-", dir=args.work))
    ids = work / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in range(args.ids)))
    cfg = work / "c.toml"
    cfg.write_text(f'[source]\nids = "{ids}"\n[request]\nurl = "http://127.0.0.1:9/items/{{id}}"\n'
                   "[limits]\nconcurrency = 64\nrate = 1000000.0\nburst = 100000\n"
                   "[retry]\nmax_tries = 3\n[passes]\ncooldown = 0.0\n"
                   f'[state]\ndir = "{work / "state"}"\n')
    os.environ["ASYNCRAWL_LOOP"] = "asyncio"
    t0, cpu0, loop0 = time.perf_counter(), time.process_time(), time.thread_time()
    code = asyncrawl.cli.main(["run", "-c", str(cfg), "--no-progress"])
    wall, cpu, loop = (time.perf_counter() - t0, time.process_time() - cpu0,
                       time.thread_time() - loop0)
    n = args.ids
    print(json.dumps({"code": code, "loop_us": loop / n * 1e6, "cpu_us": cpu / n * 1e6,
                      "wall_us": wall / n * 1e6}))


def run_one(tree: Path, args: argparse.Namespace, work: str) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree),
           "--ids", str(args.ids), "--work", work] + (["--real-store"] if args.real_store else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    res = json.loads(lines[-1])
    if res["code"] != (0 if args.real_store else 6):  # 6: a free store kept no ok
        raise SystemExit(f"asyncrawl run exited {res['code']}:\n{proc.stderr}")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=int, default=40000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--real-store", action="store_true", help="keep the SQLite store's writes")
    p.add_argument("--against", metavar="TREE", help="another checkout, run alternately")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=str(REPO_ROOT), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    trees = {"this": REPO_ROOT} | ({"against": Path(args.against).resolve()} if args.against
                                   else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    base = REPO_ROOT / "bench/.work"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as work:
        for rnd in range(1, args.rounds + 1):
            for name, tree in trees.items():
                res = run_one(tree, args, work)
                runs[name].append(res)
                print(f"round {rnd} {name:8} loop {res['loop_us']:6.1f} us/req  process "
                      f"{res['cpu_us']:6.1f}  wall {res['wall_us']:6.1f}", file=sys.stderr)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("loop_us", "cpu_us", "wall_us")}
           for name, rs in runs.items()}
    store = "real store" if args.real_store else "free store"
    for name, m in med.items():
        print(f"median {name:8} ({store}): loop thread {m['loop_us']:.1f} us CPU a request, "
              f"process {m['cpu_us']:.1f}, wall {m['wall_us']:.1f}")
    if "against" in med:
        a, b = med["this"], med["against"]
        print(f"this / against: loop CPU {a['loop_us'] / b['loop_us']:.3f}, process CPU "
              f"{a['cpu_us'] / b['cpu_us']:.3f}, wall {a['wall_us'] / b['wall_us']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
