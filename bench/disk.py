"""Disk bytes per ID of the SQLite store, by payload size and page size.

What it measures
----------------
For each payload size and page size, a fresh state directory gets ``--ids`` IDs through the
store's own write path (``SqliteStore.commit``: per batch of 64 IDs their ``sent`` intents, then
their ``ok`` results, as a crawl commits them), the WAL is checkpointed into ``state.db``, and
the report gives the file's size per ID beyond the payload, against the issue's allowance
(payload x 0.1 + 60 B). ``--page-sizes`` other than the store's own (``sqlstore.PAGE_SIZE``) are
set on the module before the database is created (an experiment; a state directory keeps the
page size it was created with).

Why it varies with the payload: SQLite keeps a row in its table's leaf page when it fits
(up to the page size less 35 bytes), so a page holds a whole number of rows and the rest of the
page is unused; of a row larger than that, SQLite keeps a part in the leaf page (from ~1 KB to
most of a page) and the rest in overflow pages of its own, all full but maybe the last. The
store cuts payloads into pieces so that its rows fill the pages (``sqlstore._cut``);
``--one-row`` stores each payload in one row, as schema 3 did, for comparison.

Usage::

    .venv/bin/python bench/disk.py [--ids 20000] [--payloads 300,1000,3000,...]
        [--page-sizes 4096,8192,16384] [--one-row]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from asyncrawl import sqlstore  # noqa: E402
from asyncrawl.records import Record  # noqa: E402
from asyncrawl.store import open_store  # noqa: E402

BATCH = 64
JOB = {"method": "GET", "url": "https://api.example.com/v1/items/{id}", "params": {}}


def payload(size: int) -> bytes:
    body = b'{"id":"x","title":"' + b"a" * max(0, size - 22) + b'"}'
    return body


async def overhead(ids: int, size: int, page: int, root: Path) -> float:
    """Bytes of ``state.db`` per ID beyond the payload, after a checkpoint."""
    sqlstore.PAGE_SIZE = page
    state = Path(tempfile.mkdtemp(dir=root)) / "state"
    raw = payload(size)
    store = await open_store(state)
    try:
        store.commit([Record("run", extra={"version": "bench", "pid": 0, "job": JOB})])
        names = [f"item-{i:09d}" for i in range(ids)]
        for i in range(0, ids, BATCH):
            chunk = names[i:i + BATCH]
            store.commit([Record.sent(x) for x in chunk])
            store.commit([Record.outcome("ok", x, 200, None, False, None, 1, 1, 1, raw)
                          for x in chunk])
    finally:
        await store.close()
    db = sqlite3.connect(state / sqlstore.DB)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    size_on_disk = (state / sqlstore.DB).stat().st_size
    shutil.rmtree(state.parent)
    return size_on_disk / ids - len(raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--ids", type=int, default=20_000, help="IDs per state (20000)")
    p.add_argument("--payloads",
                   default="300,600,900,1000,1500,1800,2500,3000,6000,7486,8200,9100,13000",
                   help="payload sizes in bytes (300,600,900,1000,1500,1800,2500,3000,6000,"
                        "7486,8200,9100,13000)")
    p.add_argument("--page-sizes", default=str(sqlstore.PAGE_SIZE),
                   help=f"SQLite page sizes ({sqlstore.PAGE_SIZE}, the store's)")
    p.add_argument("--one-row", action="store_true",
                   help="every payload in one row of payloads, as schema 3 stored them (an "
                        "experiment: the store cuts a payload into pieces, sqlstore._cut)")
    args = p.parse_args(argv)
    if args.one_row:
        sqlstore._cut = lambda size, page: (size,)  # type: ignore[assignment]
    sizes = [int(x) for x in args.payloads.split(",")]
    pages = [int(x) for x in args.page_sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="asyncrawl-disk-"))
    try:
        print(f"{'payload B':>10} {'page B':>7} {'B/ID beyond payload':>20} {'allowed':>8}")
        for size in sizes:
            for page in pages:
                over = asyncio.run(overhead(args.ids, size, page, root))
                print(f"{size:>10,} {page:>7,} {over:>20,.0f} {60 + 0.1 * size:>8,.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
