"""Where ``asyncrawl run`` spends its CPU per request: a py-spy flame graph and the top ten costs.

Runs the ``cli`` kind of ``bench/throughput.py`` (``asyncrawl run``, durability and in-doubt
on, the CLI's GC policy, the same local nginx serving ~1 KB JSON) under ``py-spy record``
twice: once for the flame graph (``--output``, SVG), once in py-spy's raw (collapsed stack)
format, from which it prints the top ten costs of the event loop's thread by *self* time
(the function on top of the stack) and by *inclusive* time for the pipeline's own stages,
each as a share of that thread's samples and in microseconds per request (share × the
thread's CPU per request, measured in the same run).

Usage::

    .venv/bin/python bench/profile.py [--requests 40000] [--concurrency 64]
        [--output bench/flame.svg] [--loop asyncio|uvloop]

Needs py-spy (``pip install 'asyncrawl[bench]'``) and nginx (``apt-get install -y
nginx-light``). py-spy samples at 200 Hz without slowing the process down much, but it is a
profile, not a timing: the throughput figures come from ``bench/throughput.py``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from throughput import nginx_server  # noqa: E402

STAGES = {  # inclusive time of the pipeline's own functions, by the name py-spy shows
    "fetch: Fetcher._attempt (request, read, classify)": "_attempt (asyncrawl/fetch.py",
    "worker: Worker.run (the loop around an attempt)": "run (asyncrawl/worker.py",
    "governor: Governor (ready, acquire, on_response)": "(asyncrawl/governor.py",
    "writer: ProcessWriter (on the event loop)": "asyncrawl/writer.py",
    "store: the loop's writes down the pipe to the writing process": "send (asyncrawl/sqlproc.py",
    "store: the loop's reads of its answers": "_readable (asyncrawl/sqlproc.py",
    "store: the writing process (sqlstore.serve_writes), all of it": "serve_writes (asyncrawl/",
    "store: the run's dedup in SQLite (admit, off the loop)": "_admit (asyncrawl/sqlstore.py",
    "http1: asyncrawl's client, all of it (with aiohttp's parser under it)": "(asyncrawl/http1.py",
    "aiohttp: ClientSession._request": "_request (aiohttp/client.py",
    "aiohttp: response parsing (data_received)": "data_received (aiohttp/client_proto.py",
    "asyncio: event loop internals (_run_once)": "_run_once (asyncio/base_events.py",
}


def record(args: argparse.Namespace, base: str, fmt: str, out: Path, work: Path) -> None:
    state = Path(tempfile.mkdtemp(prefix="state-", dir=work))
    env = {**os.environ}
    if args.loop:
        env["ASYNCRAWL_LOOP"] = args.loop
    cmd = [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
           "--rate", "200", "--format", fmt, "--output", str(out), "--threads",
           "--subprocesses",  # (the SQLite store's writing process)
           *(["--idle"] if args.idle else []), "--",
           sys.executable, str(BENCH / "throughput.py"), "--worker", args.kind, "--url", base,
           "--requests", str(args.requests), "--concurrency", str(args.concurrency),
           "--state-dir", str(state / "state")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"py-spy failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    shutil.rmtree(state, ignore_errors=True)
    return None


def main_thread(stacks: dict[str, int]) -> dict[str, int]:
    """The event loop's thread: the main thread of the profiled process (not of the writing
    process forked from it, whose stacks begin with both processes), in stacks that run the
    loop (``Runner.run``, ``run_until_complete``, ``_run_once``; uvloop's are not Python
    frames)."""
    loop = {}
    for stack, n in stacks.items():
        frames = stack.split(";")
        if len(frames) < 2 or frames[1].startswith("process "):
            continue
        pid = frames[0].removeprefix("process ").partition(":")[0]
        main = frames[1].startswith(f"thread ({pid})") if frames[1].startswith("thread (") \
            else "Thread._bootstrap" not in stack  # (recorded without ``--threads``)
        if main and ("Runner.run (" in stack or "run_until_complete" in stack
                     or "_run_once" in stack):
            loop[stack] = n
    return loop


def _function(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)``: a function's lines together."""
    head, sep, tail = frame.rpartition(":")
    return head + ")" if sep and tail.rstrip(")").isdigit() else frame


def report(raw: Path, requests: int) -> str:
    stacks: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            stacks[stack] = stacks.get(stack, 0) + int(n)
    loop = main_thread(stacks)
    total = sum(stacks.values())
    loop_total = sum(loop.values()) or 1
    self_time: collections.Counter[str] = collections.Counter()
    for stack, n in loop.items():
        self_time[_function(stack.split(";")[-1])] += n
    lines = [f"samples: {total:,} in all, {loop_total:,} in the event loop's thread "
             f"({loop_total / max(total, 1):.0%})", "",
             "top ten by self time, event loop's thread (share of its samples):"]
    for frame, n in self_time.most_common(10):
        lines.append(f"  {n / loop_total:6.1%}  {frame}")
    lines += ["", "pipeline stages, inclusive (share of the event loop thread's samples; the "
              "store's share is of all samples):"]
    for name, needle in STAGES.items():
        pool = stacks if name.startswith("store") else loop
        n = sum(c for s, c in pool.items() if needle in s)
        base = total if name.startswith("store") else loop_total
        lines.append(f"  {n / max(base, 1):6.1%}  {name}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output", default=str(BENCH / "flame.svg"))
    ap.add_argument("--kind", default="cli", help="the throughput.py worker to profile")
    ap.add_argument("--idle", action="store_true", help="sample idle threads too (shows waits)")
    ap.add_argument("--raw", help="keep py-spy's collapsed stacks in this file")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        work = Path(tmp)
        (work / "nginx").mkdir()
        with nginx_server(work / "nginx") as server:
            record(args, server.base, "flamegraph", Path(args.output), work)
            raw = Path(args.raw) if args.raw else work / "raw.txt"
            record(args, server.base, "raw", raw, work)
            print(f"flame graph: {args.output}")
            print(report(raw, args.requests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
