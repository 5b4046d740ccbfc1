"""Shared fixtures: a fast config against the in-process mock API, and CLI/subprocess helpers.

Everything talks to real servers over loopback; nothing mocks aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrawl import Config, Crawler
from asyncrawl.records import Record
from asyncrawl.store import open_store
from asyncrawl.testing import MockAPI, MockProcess

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-5f2b"


def fast_config(api: MockAPI, state: Path, **kw: Any) -> Config:
    """A config that retries quickly, for tests."""
    defaults: dict[str, Any] = dict(
        url=api.item_url, state_dir=str(state), headers={"X-Api-Key": KEY}, rate=2000.0,
        concurrency=8, max_tries=3, backoff_base=0.01, backoff_max=0.05, cooldown=0.0,
        retry_after_max=2.0, timeout=5.0, grace=2.0)
    defaults.update(kw)
    return Config(**defaults)


@pytest.fixture
async def api() -> AsyncIterator[MockAPI]:
    async with MockAPI(api_key=KEY) as a:
        yield a


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asyncrawl ARGS`` to completion."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "asyncrawl", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=timeout, input=stdin)


@pytest.fixture
def mock_process(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``mock_process(*args)`` starts a mock API process; all are stopped at the end."""
    procs: list[MockProcess] = []

    def start(*args: str) -> MockProcess:
        p = MockProcess(tmp_path / f"mock-{len(procs)}.log", *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def write_ids(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")
    return path


def write_config(path: Path, url: str, state: Path, ids: Path, **sections: dict[str, Any]) -> Path:
    """A config.toml for CLI tests; ``sections`` add or override keys per section."""
    body: dict[str, dict[str, Any]] = {
        "source": {"ids": str(ids)},
        "request": {"url": url, "timeout": 5},
        "request.headers": {"X-Api-Key": "${ASYNCRAWL_TEST_KEY}"},
        "limits": {"concurrency": 8, "rate": 2000},
        "retry": {"max_tries": 3, "backoff_base": 0.01, "backoff_max": 0.05, "retry_after_max": 2},
        "passes": {"cooldown": 0},
        "state": {"dir": str(state)},
        "run": {"grace": 2, "progress_interval": 0.5},
    }
    for name, values in sections.items():
        body.setdefault(name.replace("__", "."), {}).update(values)
    lines = []
    for section, values in body.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {_toml(v)}")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


# -- reading a state directory as a user would: the SQLite database and its ``results`` view ----


def settled_state(state: Path, records: list[Record]) -> Path:
    """A state directory holding ``records``, written by the store as a run writes them (for
    ``status`` and ``export``, which need no crawl): after the ``run`` record of a job."""
    job = {"method": "GET", "url": "https://api.example.com/v1/notes/{id}", "params": {}}

    async def go() -> None:
        store = await open_store(state)
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": job})])
            store.commit(records)
        finally:
            await store.close()

    asyncio.run(go())
    return state


def live_processes(pgrp: int | None = None) -> set[int]:
    """The processes that have not ended (zombies that nobody reaps here count as ended), of
    process group ``pgrp`` where given (``/proc``)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state not in "ZX" and (pgrp is None or int(group) == pgrp):
            out.add(int(stat.parent.name))
    return out


def db_rows(state: Path, query: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``query`` on the state database, read-only (a run may be going)."""
    import sqlite3

    path = state / "state.db"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(query, params).fetchall()
    finally:
        db.close()


async def cut_off_after(crawler: Crawler, ids: list[str], api: MockAPI, answers: int) -> Any:
    """Run ``crawler`` on ``ids`` until the mock has given ``answers`` answers and requests are
    in flight (it answers a wave of them at once: a stop just after one cuts nothing off),
    then stop it twice (the grace period cut short: those requests are cut off); the run's
    summary."""
    import asyncio

    run = asyncio.create_task(crawler.run(ids))
    deadline = asyncio.get_running_loop().time() + 30
    while sum(api.counts().values()) < answers or not in_flight(api):
        assert asyncio.get_running_loop().time() < deadline and not run.done()
        await asyncio.sleep(0.005)
    crawler.stop()
    crawler.stop()
    return await run


def in_flight(api: MockAPI) -> int:
    """Requests the mock has begun and not answered yet."""
    return sum(1 if e.event == "start" else -1 for e in api.log)


def answered_2xx(api: MockAPI, item: str) -> int:
    """The paid (2xx) answers the mock gave ``item``."""
    return sum(1 for e in api.log if e.event == "end" and e.id == item
               and 200 <= (e.status or 0) < 300)


async def stop_once_paid(crawler: Crawler, ids: list[str], api: MockAPI, item: str) -> None:
    """Run ``crawler`` on ``ids`` until the mock has answered ``item`` 2xx, then stop it (as
    SIGINT does) and wait for the run's end."""
    import asyncio

    run = asyncio.create_task(crawler.run(ids))
    deadline = asyncio.get_running_loop().time() + 30
    while answered_2xx(api, item) < 1:
        assert asyncio.get_running_loop().time() < deadline and not run.done()
        await asyncio.sleep(0.01)
    crawler.stop()
    await run


def outcomes_of(state: Path) -> dict[str, str]:
    """ID -> outcome (ok | failed | unavailable) of every settled ID."""
    return dict(db_rows(state, "SELECT id, outcome FROM results"))  # type: ignore[arg-type]


def sends_of(state: Path) -> dict[str, int]:
    """ID -> requests recorded sent for it (each one's ``sent`` intent was durable first)."""
    return dict(db_rows(state, "SELECT id, sends FROM items WHERE sends > 0"))  # type: ignore[arg-type]


def _rewrite(db_path: Path, script: str) -> None:
    """Run ``script`` on a state database, in one transaction."""
    import sqlite3

    db = sqlite3.connect(db_path, isolation_level=None)
    try:
        db.executescript(f"BEGIN IMMEDIATE;{script}COMMIT;")
    finally:
        db.close()


def as_schema_4(db_path: Path) -> None:
    """Make a state database of this release one of schema 4 (no ``answered`` nor ``unusable``
    count), as the release before 5 left it."""
    _rewrite(db_path, "ALTER TABLE items DROP COLUMN answered; ALTER TABLE items DROP COLUMN "
                      "unusable; PRAGMA user_version = 4;")


def as_schema_3(db_path: Path) -> None:
    """Make a state database of this release one of schema 3 (each payload one row of
    ``payloads``, never in pieces), as the release before 4 left it."""
    as_schema_4(db_path)
    _rewrite(db_path, """
        UPDATE items SET data = (SELECT CAST(group_concat(data, '') AS BLOB) FROM (
            SELECT data FROM payloads WHERE id BETWEEN items.payload
            AND items.payload + coalesce(items.pieces, 1) - 1 ORDER BY id))
            WHERE payload IS NOT NULL;
        DELETE FROM payloads;
        INSERT INTO payloads (id, data) SELECT rowid, data FROM items WHERE payload IS NOT NULL;
        UPDATE items SET payload = rowid, data = NULL WHERE payload IS NOT NULL;
        DROP VIEW results;
        ALTER TABLE items DROP COLUMN pieces;
        CREATE VIEW results AS
            SELECT i.id, CASE i.state WHEN 'perm' THEN 'failed' ELSE i.state END AS outcome,
                   i.status, i.error, i.fetched_at, CAST(coalesce(p.data, i.data) AS TEXT) AS data
            FROM items i LEFT JOIN payloads p ON p.id = i.payload WHERE i.state IS NOT NULL;
        PRAGMA user_version = 3;""")


def as_schema_2(db_path: Path) -> None:
    """Make a state database of this release one of schema 2 (payloads in the item rows, no
    ``payloads`` table), as the release before 3 left it."""
    as_schema_3(db_path)
    _rewrite(db_path, """
        UPDATE items SET data = (SELECT p.data FROM payloads p WHERE p.id = items.payload)
            WHERE payload IS NOT NULL;
        DROP VIEW results;
        ALTER TABLE items DROP COLUMN payload;
        DROP TABLE payloads;
        CREATE VIEW results AS
            SELECT id, CASE state WHEN 'perm' THEN 'failed' ELSE state END AS outcome,
                   status, error, fetched_at, CAST(data AS TEXT) AS data
            FROM items WHERE state IS NOT NULL;
        PRAGMA user_version = 2;""")


@pytest.fixture(params=["aiohttp", "http1"])
async def both_clients(request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """Runs a test once with aiohttp's client and once with asyncrawl's own (``http1``):
    every ``Fetcher`` the test makes sends through it as a run's own fetcher would, and is
    closed when the test ends."""
    from asyncrawl.fetch import Fetcher

    made: list[Fetcher] = []
    if request.param == "http1":
        init = Fetcher.__init__

        def lean_init(self: Fetcher, *args: Any, **kw: Any) -> None:
            kw.setdefault("lean", True)
            init(self, *args, **kw)
            made.append(self)

        monkeypatch.setattr(Fetcher, "__init__", lean_init)
    yield request.param
    for fetcher in made:
        fetcher.close()


@contextlib.contextmanager
def asyncrawl_log() -> Iterator[list[str]]:
    """Messages of the ``asyncrawl`` logger (whatever a CLI test did to its propagation)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("asyncrawl")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
