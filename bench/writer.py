"""The state writer's cost per ID: CPU (and wall) time of ``Store.commit`` in a crawl's pattern.

What it measures
----------------
A fresh store gets ``--ids`` IDs through its own write path, as a crawl at the stack's limit
commits them (``writer.Writer`` at concurrency 64): a batch of ``--intents`` ``sent`` intents,
and after every third such batch one batch of the ``ok`` results of those IDs (~1 KB payloads
by default). The report gives the writer thread's CPU time per ID (``time.thread_time``: the
Python and SQLite work and the system calls, without waiting for the disk) and the wall time,
and the intents' share of the CPU. ``--pragma`` runs SQL on the writer's connection first
(e.g. ``"PRAGMA synchronous = NORMAL"`` or ``"DROP TRIGGER items_update"``, to size a part);
``--no-intents`` commits the results alone. ``--pg URL`` measures the PostgreSQL store instead
(a new job of that database; the IDs merged and taken in first, outside the timed part).

Usage::

    .venv/bin/python bench/writer.py [--ids 40000] [--payload-bytes 995] [--intents 56]
        [--pragma SQL] [--no-intents] [--pg postgresql://postgres@127.0.0.1/test] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from asyncrawl.records import Record  # noqa: E402


async def open_store(args: argparse.Namespace, work: Path, ids: list[str]) -> Any:
    if args.pg:
        from asyncrawl.pgstore import PgStore

        store = await PgStore.open(args.pg, f"bench-writer-{uuid.uuid4().hex[:8]}")
        store.commit([Record("run", extra={"version": "bench", "pid": 1, "job": None})])
        await store.merge(ids)
        while await store.take_in():
            pass
        return store
    from asyncrawl.sqlstore import SqliteStore

    store = await SqliteStore.open(Path(tempfile.mkdtemp(dir=work)))
    for sql in args.pragma:
        store._db.execute(sql)
    store.commit([Record("run", extra={"job": {"method": "GET", "url": "http://x/{id}"}})])
    return store


async def measure(args: argparse.Namespace, work: Path) -> tuple[float, float, float]:
    """(CPU µs an ID, of it the intents', wall µs an ID)."""
    ids = [str(100_000 + i) for i in range(args.ids)]
    body = b'{"v":"' + b"x" * max(0, args.payload_bytes - 8) + b'"}'
    store = await open_store(args, work, ids)
    cpu = intents = wall = 0.0

    def commit(records: list[Record]) -> None:
        nonlocal cpu, intents, wall
        t, w = time.thread_time(), time.perf_counter()
        store.commit(records)
        took = time.thread_time() - t
        cpu += took
        wall += time.perf_counter() - w
        if records[0].kind == "sent":
            intents += took

    pending: list[str] = []
    try:
        for i in range(0, len(ids), args.intents):
            part = ids[i:i + args.intents]
            if not args.no_intents:
                commit([Record.sent(x) for x in part])
            pending += part
            if len(pending) >= 3 * args.intents or i + args.intents >= len(ids):
                commit([Record.outcome("ok", x, 200, None, False, None, 1, 1, 1, body)
                        for x in pending])
                pending = []
    finally:
        await store.close()
    n = len(ids)
    return cpu / n * 1e6, intents / n * 1e6, wall / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=int, default=40_000)
    p.add_argument("--payload-bytes", type=int, default=995)
    p.add_argument("--intents", type=int, default=56, help="intents a batch (64 workers: ~56)")
    p.add_argument("--pragma", action="append", default=[], metavar="SQL",
                   help="SQL run on the writer's connection first (SQLite; repeatable)")
    p.add_argument("--no-intents", action="store_true", help="commit the results alone")
    p.add_argument("--pg", metavar="URL", help="measure the PostgreSQL store of this database")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="asyncrawl-writer-"))
    try:
        for _ in range(args.runs):
            cpu, intents, wall = asyncio.run(measure(args, work))
            print(f"{cpu:6.1f} µs CPU an ID (intents {intents:.1f}), {wall:6.1f} µs wall an ID "
                  f"({args.ids:,} IDs, {args.payload_bytes:,} B payloads, "
                  f"{'PostgreSQL' if args.pg else 'SQLite'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
