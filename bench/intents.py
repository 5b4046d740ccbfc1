"""How long a request waits for its ``sent`` intent, and what the writer's thread does meanwhile.

Runs ``asyncrawl run`` in this process (asyncio's loop, a fresh state, durability and in-doubt
on) against the bundled mock API in a process of its own, with ``--latency`` seconds added to
every answer and the rate out of the way, and times, by wrapping the functions in place:

* ``intent``: from a worker's ``commit(sent)`` (``writer.ProcessWriter``, the SQLite store's,
  or ``writer.Writer``) to its future being resolved: the time a request waits before it may
  leave;
* ``queue wait``: from that call until its batch goes down the pipe to the writing process
  (``sqlproc.WriterProcess.send``), or until the writer's thread starts the transaction
  holding it (``Writer``);
* ``round trip`` (the writing process): from a batch's send until the event loop reads the
  child's ``logged`` answer for it (the intent log's write included); and, request by
  request, its batch's round trip and the rest (``after it``: from that answer being read
  until the request's future resolves: the event loop's pass that read it, and the next);
* ``Writer`` only (a store written in the run's own process): the store's transactions, by
  what they hold (intents only, ``ok`` results only, both), with their wall time, the writer
  thread's CPU in them, and records per transaction;
* ``attempt``: the request itself (``Fetcher.attempt``), for scale;
* how busy the event loop's thread was (its CPU time over the run's wall time): below ~100 %
  at the stack's limit, the rest is the loop waiting, for intents among other things.

Usage::

    .venv/bin/python bench/intents.py [--ids 20000] [--latency 0.1] [--concurrency 100] [--nginx]

``--nginx``: against ``throughput.py``'s nginx instead (static answers: the stack's limit).

A probe, not a throughput figure (the wrappers cost a little): compare its numbers between
trees, not with ``latency.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1000 if values else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=20_000)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--nginx", action="store_true",
                    help="against throughput.py's nginx (the stack's limit) instead of the mock API")
    args = ap.parse_args()

    from latency import write_job

    import asyncrawl.cli
    from asyncrawl import fetch, sqlproc, sqlstore, writer
    from asyncrawl.testing import MockProcess

    intent: list[float] = []
    queued: dict[int, float] = {}
    waits: list[float] = []
    attempts: list[float] = []
    commits: list[tuple[str, float, float, int]] = []  # (what, wall, thread CPU, records)

    trips: list[float] = []
    sent_at: dict[int, float] = {}  # batch number -> when it went down the pipe
    batch_of: dict[int, tuple[int, float]] = {}  # id(intent) -> (its batch's number, sent when)
    read_at: dict[int, float] = {}  # batch number -> when its ``logged`` answer was read
    req_trip: list[float] = []  # a request's share: its batch's round trip
    after: list[float] = []  # a request's share: from that answer to its future's callbacks

    def timed(commit: Any) -> Any:
        def timed_commit(self: Any, rec: Any) -> Any:
            fut = commit(self, rec)
            t = time.perf_counter()
            queued[id(rec)] = t
            key = id(rec)

            def done(_f: Any) -> None:
                now = time.perf_counter()
                intent.append(now - t)
                seq, sent = batch_of.pop(key, (None, 0.0))
                if seq in read_at:
                    req_trip.append(read_at[seq] - sent)
                    after.append(now - read_at[seq])

            fut.add_done_callback(done)
            return fut
        return timed_commit

    send = sqlproc.WriterProcess.send

    def timed_send(self: Any, records: Any) -> int:
        t = time.perf_counter()
        records = list(records)
        for rec in records:
            born = queued.pop(id(rec), None)
            if born is not None:
                waits.append(t - born)
        seq = send(self, records)
        sent_at[seq] = t
        for rec in records:
            if rec.kind == "sent":
                batch_of[id(rec)] = (seq, t)
        return seq

    answer = writer.ProcessWriter._answer

    def timed_answer(self: Any, got: Any) -> None:
        if got is not None and got[0] == sqlproc.LOG:
            t = time.perf_counter()
            for seq in [s for s in sent_at if s <= got[1]]:
                trips.append(t - sent_at.pop(seq))
                read_at[seq] = t
        answer(self, got)

    store_commit = sqlstore.SqliteStore.commit

    def timed_store_commit(self: Any, records: Any) -> None:
        t, cpu = time.perf_counter(), time.thread_time()
        for rec in records:
            born = queued.pop(id(rec), None)
            if born is not None:
                waits.append(t - born)
        store_commit(self, records)
        kinds = {r.kind for r in records}
        what = ("intents and results" if {"sent", "ok"} <= kinds else
                "intents" if "sent" in kinds else "results" if "ok" in kinds else "other")
        commits.append((what, time.perf_counter() - t, time.thread_time() - cpu, len(records)))

    attempt = fetch.Fetcher.attempt

    async def timed_attempt(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return await attempt(self, *a, **k)
        finally:
            attempts.append(time.perf_counter() - t)

    writer.Writer.commit = timed(writer.Writer.commit)  # type: ignore[method-assign]
    writer.ProcessWriter.commit = timed(writer.ProcessWriter.commit)  # type: ignore[method-assign]
    writer.ProcessWriter._answer = timed_answer  # type: ignore[method-assign]
    sqlproc.WriterProcess.send = timed_send  # type: ignore[method-assign]
    sqlstore.SqliteStore.commit = timed_store_commit  # type: ignore[method-assign]
    fetch.Fetcher.attempt = timed_attempt  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory(prefix="intents-") as tmp, contextlib.ExitStack() as stack:
        if args.nginx:
            from throughput import nginx_server

            server = stack.enter_context(nginx_server(Path(tmp)))
            url = server.base
        else:
            api = stack.enter_context(MockProcess(
                Path(tmp) / "mock.log", "--no-auth", "--faults", "none", "--latency",
                str(args.latency)))
            url = api.url
        cfg = write_job(Path(tmp), url, args.ids, args.concurrency)
        os.environ["ASYNCRAWL_LOOP"] = "asyncio"
        t0, loop_cpu = time.perf_counter(), time.thread_time()
        code = asyncrawl.cli.main(["run", "-c", str(cfg), "--no-progress"])
        elapsed, loop_cpu = time.perf_counter() - t0, time.thread_time() - loop_cpu
    if code != 0:
        raise SystemExit(f"asyncrawl run exited {code}")
    server = "nginx (the stack's limit)" if args.nginx else f"latency {args.latency * 1000:g} ms"
    print(f"{args.ids:,} IDs, {server}, concurrency "
          f"{args.concurrency}: {args.ids / elapsed:,.0f} req/s ({elapsed:.1f} s); the event "
          f"loop's thread busy {loop_cpu / elapsed:.0%} ({loop_cpu / args.ids * 1e6:.0f} us CPU a request)")
    for name, xs in (("intent (request waits)", intent), ("  of it: queue wait", waits),
                     ("batch round trip", trips), ("  a request's: round trip", req_trip),
                     ("  a request's: after it", after), ("attempt (the request)", attempts)):
        if not xs:
            continue
        print(f"{name:<26} p50 {pct(xs, 0.5):7.2f} ms  p90 {pct(xs, 0.9):7.2f} ms")
    if not commits:  # (the writing process's store: its transactions are not in this process)
        return 0
    busy = sum(c[1] for c in commits)
    print(f"transactions: {len(commits):,}, writer busy in them {busy:.1f} s "
          f"({busy / elapsed:.0%} of the run)")
    for what in ("intents", "results", "intents and results", "other"):
        sel = [c for c in commits if c[0] == what]
        if sel:
            print(f"  {what:<20} {len(sel):6,}  wall p50 {pct([c[1] for c in sel], 0.5):5.2f} ms"
                  f"  CPU p50 {pct([c[2] for c in sel], 0.5):5.2f} ms"
                  f"  records/txn {sum(c[3] for c in sel) / len(sel):5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
