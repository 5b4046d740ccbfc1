"""The PostgreSQL merge's ceiling by table layout: how fast 1,000,000 new IDs go into a table
shaped like ``asyncrawl_items``, by which indexes it has.

Each layout is a fresh table in a schema of its own (``asyncrawl_bench_merge``, dropped at the
end); the IDs (shuffled) go in as ``PgStore.merge`` sends them: chunks of 100,000, each COPYed
into a temporary table, then one ``INSERT … SELECT … ORDER BY id``. Layouts (comma-separated,
``:2`` for two connections in parallel): ``text-open`` (the store's: primary key ``(job text,
id)`` and the claim index), ``text-pk`` (no claim index), ``int-open`` / ``int-pk`` (``job`` an
integer), ``text-heap`` (no index at all), ``text-unlogged-heap``.

Usage::

    .venv/bin/python bench/pgmerge.py [--pg URL] [--ids 1000000] [--layouts text-open,text-heap]
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

import psycopg

SCHEMA = "asyncrawl_bench_merge"
CHUNK = 100_000


def create(db: psycopg.Connection, layout: str) -> None:
    db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    db.execute(f"CREATE SCHEMA {SCHEMA}")
    job = "integer" if layout.startswith("int") else "text"
    key = "" if "heap" in layout else ", PRIMARY KEY (job, id)"
    logged = "UNLOGGED" if "unlogged" in layout else ""
    db.execute(f"""CREATE {logged} TABLE {SCHEMA}.items (
        job {job} NOT NULL, id text NOT NULL, state text, status integer, error text,
        pass integer, tries integer, paid integer NOT NULL DEFAULT 0,
        fetched_at double precision, data bytea, generation integer NOT NULL DEFAULT 0,
        lease_owner bigint, lease_until double precision, sent_run bigint,
        sends integer NOT NULL DEFAULT 0, doubt integer{key})""")
    if layout.endswith("open"):
        db.execute(f"CREATE INDEX items_open ON {SCHEMA}.items (job, lease_until) "
                   "WHERE state IS NULL OR state IN ('failed', 'perm')")


def merge(pg: str, layout: str, ids: list[str], parts: int) -> float:
    """IDs per second into ``layout`` with ``parts`` connections."""
    with psycopg.connect(pg, autocommit=True) as db:
        create(db, layout)
    job: int | str = 7 if layout.startswith("int") else "bench-merge-0123456789"
    chunks = [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)]

    def worker(k: int) -> None:
        with psycopg.connect(pg, autocommit=True) as db:
            for chunk in chunks[k::parts]:
                with db.transaction():
                    db.execute("CREATE TEMP TABLE IF NOT EXISTS m (id text) "
                               "ON COMMIT DELETE ROWS")
                    with db.cursor().copy("COPY m (id) FROM STDIN") as copy:
                        copy.write(("\n".join(chunk) + "\n").encode())
                    db.execute(f"INSERT INTO {SCHEMA}.items (job, id, generation) "
                               "SELECT %s, id, 0 FROM m ORDER BY id", (job,))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(ids) / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--pg", default=os.environ.get(
        "ASYNCRAWL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--ids", type=int, default=1_000_000)
    p.add_argument("--layouts", default="text-open,text-pk,int-open,int-pk,text-open:2,"
                                        "int-open:2,text-heap,text-unlogged-heap")
    args = p.parse_args()
    ids = [f"item-{i:09d}" for i in range(args.ids)]
    random.Random(1).shuffle(ids)
    try:
        for spec in args.layouts.split(","):
            layout, _, parts = spec.partition(":")
            rate = merge(args.pg, layout, ids, int(parts or 1))
            print(f"{spec:22s} {rate:>10,.0f} IDs/s", flush=True)
    finally:
        with psycopg.connect(args.pg, autocommit=True) as db:
            db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
