"""sqlstore.py: creation, group commit through the writer, what records mean for the state, the
in-doubt bookkeeping, a damaged or foreign database, and the lock (this process and another)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from asyncrawl import ConfigError, LockedError, StorageError
from asyncrawl.lockfile import LOCK
from asyncrawl.records import Commit, Counts, Record
from asyncrawl.sqlproc import IntentLog, pending_records
from asyncrawl.sqlstore import DB, PAGE_SIZE, _cell, _cut, _packed
from asyncrawl.store import open_store, read_store
from asyncrawl.writer import ProcessWriter, Writer

from .conftest import as_schema_2, as_schema_3, as_schema_4, db_rows, live_processes, outcomes_of, sends_of

TS = 1_700_000_000.0  # 2023-11-14 UTC
JOB = {"method": "GET", "url": "https://api.example.com/v1/notes/{id}", "params": {}}

RECORDS = [
    Record("run", ts=TS, extra={"version": "t", "pid": 1, "job": JOB}),
    Record("ok", "a", status=200, data={"title": "Ünïcode ☃", "n": 1}, paid=1, tries=1, ts=TS),
    Record("failed", "b", status=404, error="HTTP 404", permanent=True, tries=1, ts=TS),
    Record("failed", "c", status=503, error="HTTP 503", tries=5, ts=TS),
    Record("ok", "d/ü", status=200, raw=b'{"x": [1, "two", null]}', paid=1, tries=2,
           ts=TS + 86_400),
]


async def committed(state: Path, *batches: Sequence[Record]) -> None:
    store = await open_store(state)
    try:
        for batch in batches:
            store.commit(batch)
    finally:
        await store.close()


async def test_a_close_cancelled_while_queued_behind_the_application_s_threads_still_closes(
        tmp_path: Path) -> None:
    """An application's blocking jobs fill the loop's default executor; the run's store is
    closed (its last step) and the closing task is cancelled meanwhile: the close still runs
    once a thread is free, then the cancellation is raised. It was dropped from the executor's
    queue: the state stayed locked by this process (every later run of it refused, "another
    run in this process"), its writing process alive, its files open."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from asyncrawl.lockfile import lock_holder

    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)  # (the application's jobs take its thread)
    loop.set_default_executor(executor)
    state = tmp_path / "state"
    store = await open_store(state)
    assert store.process is not None
    child = store.process.pid
    gate = threading.Event()
    busy = loop.run_in_executor(None, gate.wait, 60)
    closing = asyncio.create_task(store.close())
    for _ in range(3):
        await asyncio.sleep(0)  # (its close queued behind the application's job)
    closing.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await busy
    assert lock_holder(state) is None  # released: the close ran
    assert child not in live_processes()
    await (await open_store(state)).close()  # a later run of this process opens it
    executor.shutdown()


async def test_open_creates_a_private_database(tmp_path: Path) -> None:
    state = tmp_path / "deep" / "state"
    store = await open_store(state)
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / DB).stat().st_mode) == 0o600
        assert (state / LOCK).read_text().strip() == str(os.getpid())
        assert store.snapshot().counts == Counts()
        assert db_rows(state, "PRAGMA journal_mode") == [("wal",)]
    finally:
        await store.close()
    assert read_store(state).snapshot().runs == 0


async def test_open_on_a_file_is_a_config_error(tmp_path: Path) -> None:
    """A state directory that cannot be where it is asked to be is a usage error (exit 2),
    not a failing store (exit 5, which a retrying wrapper reruns)."""
    (tmp_path / "state").write_text("x")
    with pytest.raises(ConfigError, match="is a file here, not a directory"):
        await open_store(tmp_path / "state")
    with pytest.raises(ConfigError, match="cannot create the state directory"):
        await open_store(tmp_path / "state" / "below")  # (ENOTDIR)
    with pytest.raises(ConfigError, match="cannot create the state directory"):
        await open_store(tmp_path / ("x" * 5000))  # (ENAMETOOLONG)


async def test_writer_group_commits_and_reports_after_the_commit(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = await open_store(state)
    seen_at_commit: list[dict[str, str]] = []
    batches: list[list[Record]] = []

    def on_commit(batch: list[Record]) -> None:
        seen_at_commit.append(outcomes_of(state))  # another connection already sees it
        batches.append(batch)

    errors: list[StorageError] = []
    w = Writer(store, on_commit=on_commit, on_error=errors.append)
    for r in RECORDS:
        w.put(r)
    w.close()
    await w.run()
    await store.close()
    assert errors == []
    assert batches == [RECORDS]  # everything queued before the writer ran: one commit
    assert (w.commits, w.written) == (1, len(RECORDS))
    assert seen_at_commit == [{"a": "ok", "b": "failed", "c": "failed", "d/ü": "ok"}]

    snap = read_store(state).snapshot()
    assert snap.runs == 1 and snap.job == JOB
    assert snap.counts == Counts(ok=2, failed=2, unavailable=0)
    assert snap.billable_by_day == {"2023-11-14": 1, "2023-11-15": 1}
    assert snap.ledger == (("2023-11-14", "api.example.com/v1/notes/{id}", 1),
                           ("2023-11-15", "api.example.com/v1/notes/{id}", 1))
    ok = {r.id: r.payload for r in read_store(state).records("ok")}
    assert ok == {"a": {"title": "Ünïcode ☃", "n": 1}, "d/ü": {"x": [1, "two", None]}}
    failed = {r.id: (r.status, r.permanent) for r in read_store(state).records("failed")}
    assert failed == {"b": (404, True), "c": (503, False)}


async def test_ok_is_final_and_later_bills_still_count(tmp_path: Path) -> None:
    state = tmp_path / "state"
    await committed(state, RECORDS[:2], [
        Record("failed", "a", status=503, error="HTTP 503", ts=TS),  # after ok: ignored ...
        Record("ok", "a", status=200, data={"second": True}, paid=1, ts=TS),  # ... a 2nd payload too
        Record("failed", "b", status=503, error="HTTP 503", ts=TS),
        Record("unavailable", "b", status=404, error="HTTP 404", permanent=True, ts=TS),
        Record("billed", "z", paid=2, ts=TS),  # an unsettled ID's bill
    ])
    assert outcomes_of(state) == {"a": "ok", "b": "unavailable"}
    assert next(read_store(state).records("ok")).payload == {"title": "Ünïcode ☃", "n": 1}
    snap = read_store(state).snapshot()
    assert snap.counts == Counts(ok=1, failed=0, unavailable=1)  # the tally follows every change
    assert snap.billable == 1 + 1 + 2
    assert db_rows(state, "SELECT paid FROM items WHERE id = 'a'") == [(2,)]


async def test_intents_keep_every_id_exactly_as_it_is(tmp_path: Path) -> None:
    """A batch's intents go in as one JSON array: every ID comes back as it was, in order, a
    duplicate counted twice; one holding a NUL (which json_each of SQLite before 3.45 cuts the
    string at) too."""
    state = tmp_path / "state"
    odd = ["plain", 'q"uote', "back\\slash", "\u2028line", "tab\tx", "🐍 snake", "123", "null",
           "\\u0041", "x" * 1024]
    await committed(state, [Record.sent(item) for item in [*odd, "plain"]])
    await committed(state, [Record.sent(item) for item in ["a\x00b", "c"]])
    assert db_rows(state, "SELECT id, sends FROM items ORDER BY rowid") == [
        *((item, 2 if item == "plain" else 1) for item in odd), ("a\x00b", 1), ("c", 1)]


async def test_payloads_are_stored_apart_once_per_id(tmp_path: Path) -> None:
    """Each ok payload is a row of ``payloads``, the item's row holds its number; a second ok
    of an ID (in the same batch or a later one) stores nothing, so no payload row is left
    that no item holds; the ``results`` view and exports read it back."""
    state = tmp_path / "state"
    await committed(state, RECORDS, [
        Record("ok", "a", status=200, data={"second": True}, paid=1, ts=TS),
        Record("ok", "e", status=200, data={"e": 1}, paid=1, ts=TS),
        Record("ok", "e", status=200, data={"e": 2}, paid=1, ts=TS),
    ])
    assert db_rows(state, "SELECT count(*), count(DISTINCT payload) FROM items WHERE "
                          "payload IS NOT NULL AND payload IN (SELECT id FROM payloads)") \
        == [(3, 3)]
    assert db_rows(state, "SELECT count(*) FROM payloads") == [(3,)]  # a, d/ü, e: none orphaned
    assert db_rows(state, "SELECT data FROM results WHERE id = 'e'") == [('{"e":1}',)]
    ok = {r.id: r.payload for r in read_store(state).records("ok")}
    assert ok == {"a": {"title": "Ünïcode ☃", "n": 1}, "d/ü": {"x": [1, "two", None]},
                  "e": {"e": 1}}


BIG = ('{"t":"' + "é☃x" * 700 + '"}').encode()  # 4.2 KB: pieces that cut characters in two


async def test_a_large_payload_is_stored_in_pieces_and_read_back_whole(tmp_path: Path) -> None:
    """A payload that would leave much of its page unused (here 4.2 KB: a page of 8 KiB
    holds one) takes consecutive rows of ``payloads`` as ``_cut`` cuts it (a cut may fall
    inside a character); the ``results`` view, the exports and the payloads after it read
    each one whole; one that fills its pages well stays one row, one over two pages is a
    head filling whole overflow pages and its tail."""
    assert len(_cut(len(BIG), PAGE_SIZE)) > 1 and _cut(995, PAGE_SIZE) == (995,)
    huge = b'"' + b"y" * (3 * PAGE_SIZE - 2) + b'"'
    state = tmp_path / "state"
    await committed(state, RECORDS, [
        Record("ok", "big", status=200, raw=BIG, paid=1, ts=TS),
        Record("ok", "after", status=200, data={"n": 2}, paid=1, ts=TS),
        Record("ok", "huge", status=200, raw=huge, paid=1, ts=TS),
    ])
    sizes = db_rows(state, "SELECT length(data) FROM payloads WHERE id BETWEEN (SELECT payload "
                           "FROM items WHERE id = 'big') AND (SELECT payload + pieces - 1 FROM "
                           "items WHERE id = 'big') ORDER BY id")
    assert tuple(n for n, in sizes) == _cut(len(BIG), PAGE_SIZE)
    assert db_rows(state, "SELECT id, pieces FROM items WHERE id IN ('after', 'huge') ORDER BY id") \
        == [("after", 1), ("huge", len(_cut(len(huge), PAGE_SIZE)))]
    assert db_rows(state, "SELECT data FROM results WHERE id = 'big'") == [(BIG.decode(),)]
    ok = {r.id: r.raw for r in read_store(state).records("ok")}
    assert ok["big"] == BIG and ok["after"] == b'{"n":2}' and ok["huge"] == huge
    assert ok["a"] == b'{"title":"\xc3\x9cn\xc3\xafcode \xe2\x98\x83","n":1}'
    assert list(read_store(state).payloads()) == list(ok.items())  # export jsonl's stream


@pytest.mark.parametrize("number", [2, 3, 4])  # row numbers from 128 to 268 M
def test_payload_cuts_cover_the_payload_and_fill_the_pages(number: int) -> None:
    """``_cut`` covers each payload exactly, in at most 16 rows, and, laid out as SQLite lays
    out rows (``_cell``, row numbers of ``number`` bytes) and a crawl appends them
    (``_packed``), they take at most 10 % more of the file than the payload, + 10 B."""
    for size in [*range(1, 20_000, 7), *range(20_000, 120_000, 61)]:
        cut = _cut(size, PAGE_SIZE, number)
        assert sum(cut) == size and min(cut) > 0 and len(cut) <= 16, (size, cut)
        cells = [_cell(n, PAGE_SIZE, number) for n in cut]
        taken = (sum(overflow for overflow, _ in cells) * PAGE_SIZE
                 + _packed([cell for _, cell in cells], PAGE_SIZE, 64))
        assert taken <= 1.1 * size + 10, (size, cut, taken)


@pytest.mark.parametrize(("size", "first"), [(3_000, 1), (13_000, 1), (21_136, 1),
                                             (4_081, 2_097_152), (8_161, 2_097_152)])
async def test_payload_pieces_fill_the_pages_of_a_real_database(tmp_path: Path, size: int,
                                                                first: int) -> None:
    """What ``_cut`` predicts holds in the file: 300 payloads (in one row each, a 3,000-B
    payload left a third of every page unused, a 13,000-B one and a 21,136-B one a quarter
    of theirs) take at most 10 % more pages than their bytes; also where the payloads' row
    numbers take 4 bytes (from 2,097,152 on), which fit one row fewer in a page."""
    state = tmp_path / "state"
    body = b'"' + b"z" * (size - 2) + b'"'
    names = [f"item-{i:05d}" for i in range(300)]
    await committed(state, RECORDS[:1])
    if first > 1:  # a job that has stored that many payload rows before
        db = sqlite3.connect(state / DB)
        db.execute("INSERT INTO payloads (id, data) VALUES (?, x'00')", (first - 1,))
        db.commit()
        db.close()
    await committed(state, RECORDS[:1], [Record.sent(x) for x in names],
                    [Record("ok", x, status=200, raw=body, paid=1, ts=TS) for x in names])
    assert db_rows(state, "SELECT min(payload) FROM items") == [(first,)]
    db = sqlite3.connect(state / DB)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, = db.execute("SELECT count(*) FROM dbstat WHERE name = 'payloads'").fetchone()
    finally:
        db.close()
    assert pages * PAGE_SIZE <= 1.1 * size * len(names), pages


async def test_a_reader_opened_before_an_upgrade_reads_payloads_whole(tmp_path: Path) -> None:
    """``status``/``export`` opened on a state of schema 3 while a run upgrades it and writes
    payloads in pieces: each query reads the version it is written for in its own snapshot,
    so no payload comes back as its first piece alone."""
    state = tmp_path / "state"
    await committed(state, RECORDS)
    as_schema_3(state / DB)
    reader = read_store(state)
    await committed(state, [Record("run", ts=TS, extra={"version": "t", "pid": 2, "job": JOB}),
                            Record("ok", "big", status=200, raw=BIG, paid=1, ts=TS)])
    assert db_rows(state, "PRAGMA user_version") == [(5,)]
    assert dict(reader.payloads())["big"] == BIG
    assert {r.id: r.raw for r in reader.records("ok")}["big"] == BIG


async def test_a_run_s_own_store_commits_while_its_payloads_are_read(tmp_path: Path) -> None:
    """``records``/``payloads`` of a store opened for a run take no read transaction of their
    own on the writer's connection: a commit in the middle of reading them goes through."""
    state = tmp_path / "state"
    store = await open_store(state)
    try:
        store.commit(RECORDS)
        reading = store.payloads()
        assert next(reading)[0] == "a"
        store.commit([Record("ok", "e", status=200, data={"e": 1}, paid=1, ts=TS)])
        assert "d/ü" in [item for item, _ in reading]  # (it may see "e": one connection)
        assert {r.id for r in store.records("ok")} == {"a", "d/ü", "e"}
        store.commit([Record("ok", "f", status=200, data={"f": 1}, paid=1, ts=TS)])
    finally:
        await store.close()


async def test_a_database_of_schema_2_is_read_and_upgraded(tmp_path: Path) -> None:
    """A state of the release before (payloads in the item rows): read as it is, upgraded by
    the next run's open (its payloads stay where they are), new payloads stored apart."""
    state = tmp_path / "state"
    await committed(state, RECORDS)
    as_schema_2(state / DB)
    assert next(read_store(state).records("ok")).payload == {"title": "Ünïcode ☃", "n": 1}
    assert [(item, orjson.loads(raw)) for item, raw in read_store(state).payloads()] == [
        ("a", {"title": "Ünïcode ☃", "n": 1}), ("d/ü", {"x": [1, "two", None]})]
    await committed(state, [Record("run", ts=TS, extra={"version": "t", "pid": 2, "job": JOB}),
                            Record("ok", "e", status=200, data={"e": 1}, paid=1, ts=TS)])
    assert db_rows(state, "PRAGMA user_version") == [(5,)]
    ok = {r.id: r.payload for r in read_store(state).records("ok")}
    assert ok == {"a": {"title": "Ünïcode ☃", "n": 1}, "d/ü": {"x": [1, "two", None]},
                  "e": {"e": 1}}
    assert db_rows(state, "SELECT id, data FROM results WHERE outcome = 'ok' ORDER BY id") == [
        ("a", '{"title":"Ünïcode ☃","n":1}'), ("d/ü", '{"x": [1, "two", null]}'),
        ("e", '{"e":1}')]


async def test_a_schema_5_database_without_its_unusable_count_is_completed(
        tmp_path: Path) -> None:
    """Schema 5 as a development tree made it for a while (006720b, before ``unusable``):
    every run on it stopped with exit 5 (no such column: i.unusable)."""
    from .conftest import _rewrite

    state = tmp_path / "state"
    await committed(state, RECORDS)
    _rewrite(state / DB, "ALTER TABLE items DROP COLUMN unusable;")
    store = await open_store(state)
    try:
        assert await store.unusable(["a", "d/ü"]) == {}
        await store.admit(["a", "z"])
    finally:
        await store.close()
    assert "unusable" in [row[1] for row in db_rows(state, "PRAGMA table_info(items)")]
    assert db_rows(state, "PRAGMA user_version") == [(5,)]


async def test_a_state_database_given_as_the_state_directory_is_named_as_such(
        tmp_path: Path) -> None:
    """``--state notes/state.db`` (the file the README's queries open): ``status`` said no run
    had used it, and a dry run that nothing was done yet."""
    state = tmp_path / "state"
    await committed(state, RECORDS)
    for missing_ok in (False, True):
        with pytest.raises(ConfigError, match=f"is a file here.*the state directory is {state}"):
            read_store(state / DB, missing_ok=missing_ok)


def test_a_state_on_a_read_only_mount_without_its_wal_index_is_read(tmp_path: Path) -> None:
    """``state.db-shm`` is deleted by the last client to close the database (sqlite3's shell,
    say); on a read-only mount it cannot be made again, and status and export failed (exit 5,
    SQLITE_CANTOPEN) on a state whose file holds everything. A mount namespace of its own
    (``unshare -m``) for the read-only tmpfs."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m): a read-only mount cannot be made")
    state = tmp_path / "state"
    asyncio.run(committed(state, RECORDS))
    db = sqlite3.connect(state / DB)  # (a read-write client: its close removes -wal and -shm)
    db.execute("SELECT count(*) FROM results").fetchone()
    db.close()
    assert not (state / f"{DB}-shm").exists()
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (f"mount -t tmpfs none {ro} && cp -r {state} {ro}/ && mount -o remount,ro {ro} && "
              f"{sys.executable} -m asyncrawl export --state {ro}/state --format ids")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                          text=True, cwd=tmp_path)
    if "mount:" in done.stderr:
        pytest.skip(f"no read-only mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == sorted(r.id for r in RECORDS if r.kind == "ok")


async def test_where_no_writing_process_can_start_the_run_writes_in_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An application that embeds asyncrawl where ``sys.executable`` runs no Python: the store
    says so and writes in the run's own process, as durably."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    state = tmp_path / "state"
    store = await open_store(state)
    assert store.process is None  # type: ignore[attr-defined]
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("a")])
    store.commit([Record("ok", "a", status=200, data=1, paid=1, ts=TS)])
    await store.close()
    assert "writes the state database in its own process" in caplog.text
    assert read_store(state).snapshot().counts.ok == 1 and sends_of(state) == {"a": 1}


def _die(store: Any) -> None:
    """As if the run's process died: its SQLite writing process sees the pipe end and exits,
    and the state directory's lock goes with the two."""
    if getattr(store, "process", None) is not None:
        store.process.close()
        store.process = None
    os.close(store._lock_fd)
    store._lock_fd = -1


async def test_intents_only_the_log_holds_are_in_doubt_and_applied_at_the_next_open(
        tmp_path: Path) -> None:
    """A run's ``sent`` intents are durable once in ``intents.log``; where its writing process
    ended before applying them (a crash, a storage error), the readers count them in doubt,
    and the next open applies those beyond the database's 'applied' batch, once."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("a")])
    store.commit([Record("ok", "a", status=200, data=1, paid=1, ts=TS)])
    applied = db_rows(state, "SELECT value FROM meta WHERE key = 'applied'")[0][0]
    _die(store)
    await store.close()
    log = state / "intents.log"  # b: applied already (an older batch); c and d: not yet; the
    log.write_bytes(  # tail torn by the crash, never acked
        orjson.dumps([int(applied), "b", TS, None]) + b"\n"
        + orjson.dumps([int(applied) + 1, "c", TS, "k1"]) + b"\n"
        + orjson.dumps([int(applied) + 2, "d", TS, None]) + b"\n" + b'[99, "e", 1')
    assert dict(read_store(state).in_doubt()) == {"c": False, "d": False}
    snap = read_store(state).snapshot()
    assert (snap.in_doubt, snap.in_flight, snap.sent) == (2, 0, 3)

    store = await open_store(state)  # applied to the crashed run, then closed as in doubt
    assert log.stat().st_size == 0
    assert sends_of(state) == {"a": 1, "c": 1, "d": 1}
    assert dict(read_store(state).in_doubt()) == {"c": False, "d": False}
    assert db_rows(state, "SELECT key, sent FROM key_ledger") == [("k1", 1)]
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("c")])
    store.commit([Record("ok", "c", status=200, data=1, paid=1, ts=TS)])
    await store.close()
    assert sends_of(state) == {"a": 1, "c": 2, "d": 1}
    store = await open_store(state)  # nothing applied twice
    await store.close()
    assert sends_of(state) == {"a": 1, "c": 2, "d": 1}
    assert dict(read_store(state).in_doubt()) == {"c": True, "d": False}


async def test_an_unanswered_id_whose_intent_a_crash_leaves_open_is_in_doubt_instead(
        tmp_path: Path) -> None:
    """``unanswered`` (a timeout after the connect, a dropped connection) lists an ID apart
    from the in-doubt list, which keeps its meaning: sent when a run was cut off. An
    unanswered ID whose retry was out at a crash is in doubt, not listed twice."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("a"), Record.sent("b")])
    store.commit([Record.unanswered("a"), Record.unanswered("b"), Record.sent("a"),
                  Record.sent("b")])
    store.commit([Record("ok", "b", status=200, data=1, paid=1, ts=TS)])
    _die(store)  # a's second request out
    await store.close()
    assert dict(read_store(state).in_doubt()) == {"a": False}
    assert dict(read_store(state).unanswered()) == {"b": True}
    snap = read_store(state).snapshot()
    assert (snap.in_doubt, snap.unanswered, snap.unanswered_refetched) == (1, 0, 1)
    store = await open_store(state)
    await store.close()
    assert db_rows(state, "SELECT id, doubt FROM items ORDER BY id") == [("a", 0), ("b", 3)]
    assert dict(read_store(state).in_doubt()) == {"a": False}


async def test_an_unanswered_id_whose_next_intent_only_the_log_holds_is_in_doubt_only(
        tmp_path: Path) -> None:
    """An unanswered ID whose retry's intent is in ``intents.log`` alone (the writing process
    ended before applying it) is in doubt, and not listed as unanswered as well."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("a")])
    store.commit([Record.unanswered("a"),
                  Record("failed", "a", status=None, error="timeout", tries=1, ts=TS)])
    applied = int(db_rows(state, "SELECT value FROM meta WHERE key = 'applied'")[0][0])
    _die(store)
    await store.close()
    (state / "intents.log").write_bytes(orjson.dumps([applied + 1, "a", TS, None]) + b"\n")
    assert (dict(read_store(state).in_doubt()), dict(read_store(state).unanswered())) == (
        {"a": False}, {})
    snap = read_store(state).snapshot()
    assert (snap.in_doubt, snap.unanswered, snap.unsure_calls, snap.sent) == (1, 0, 2, 2)


async def test_a_run_only_the_log_holds_is_applied_as_a_run_of_its_own(tmp_path: Path) -> None:
    """The ``run`` record is durable in ``intents.log`` like the intents that follow it (a run's
    first requests do not wait for the database): where the writing process died before
    applying it, the next open applies the run first, and its intents belong to it."""
    state = tmp_path / "state"
    await committed(state, [RECORDS[0]])
    applied = int(db_rows(state, "SELECT value FROM meta WHERE key = 'applied'")[0][0])
    logged = IntentLog(state)  # as the writing process appends them, beyond what was applied
    logged.append([(applied + 1, [Record("run", ts=TS, extra={"job": JOB, "pid": 4242})])])
    logged.append([(applied + 2, [Record("run", ts=TS + 1, extra={"job": JOB, "pid": 5151})]),
                   (applied + 3, [Record.sent("x", key="k1"), Record.sent("y")])])
    logged.close()
    assert dict(read_store(state).in_doubt()) == {"x": False, "y": False}

    store = await open_store(state)
    await store.close()
    runs = db_rows(state, "SELECT run, pid FROM runs ORDER BY run")
    assert [pid for _, pid in runs][-2:] == [4242, 5151]
    assert db_rows(state, "SELECT id, sent_run FROM items WHERE id IN ('x', 'y') ORDER BY id") \
        == [("x", None), ("y", None)]  # closed: in doubt, from the last run
    assert dict(read_store(state).in_doubt()) == {"x": False, "y": False}
    assert db_rows(state, "SELECT key, sent FROM key_ledger") == [("k1", 1)]


async def test_an_unusable_paid_answer_is_durable_with_the_intents(tmp_path: Path) -> None:
    """A paid answer that could not be used is logged like an intent: in a batch the writing
    process logged and did not apply (a kill -9), it was lost, and a rerun bought the ID once
    more than paid_retries allows."""
    state = tmp_path / "state"
    store = await open_store(state)
    w = ProcessWriter(store.process, on_commit=lambda b: None,  # type: ignore[attr-defined]
                      on_error=lambda e: None)
    task = asyncio.create_task(w.run())
    blocker = sqlite3.connect(state / DB, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # (nothing is applied meanwhile: only logged)
    try:
        assert await asyncio.wait_for(w.commit(Record("run", ts=TS, extra={"job": JOB})),
                                      30) is Commit.DURABLE
        assert await asyncio.wait_for(w.commit(Record.sent("x")), 30) is Commit.DURABLE
        w.put(Record.unusable("x"))
        assert await asyncio.wait_for(w.commit(Record.sent("y")), 30) is Commit.DURABLE
        assert [(rec.kind, rec.id) for _, rec in pending_records(state, 0)][-3:] == [
            ("sent", "x"), ("unusable", "x"), ("sent", "y")]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    w.close()
    await task
    await store.close()
    assert db_rows(state, "SELECT id, unusable FROM items ORDER BY id") == [("x", 1), ("y", 0)]


async def test_intents_count_once_logged_and_the_rest_once_applied(tmp_path: Path) -> None:
    """The writing process answers for a batch's ``sent`` intents and ``run`` record once they
    are in ``intents.log``, before it has applied the batch (here it cannot: another
    connection holds the database's write lock), and for the rest once applied; the run's
    process writes from its event loop, and at close everything is applied and the log
    emptied."""
    state = tmp_path / "state"
    store = await open_store(state)
    batches: list[list[tuple[str, str | None]]] = []
    errors: list[StorageError] = []
    w = ProcessWriter(store.process,  # type: ignore[attr-defined]
                      on_commit=lambda b: batches.append([(r.kind, r.id) for r in b]),
                      on_error=errors.append)
    task = asyncio.create_task(w.run())
    blocker = sqlite3.connect(state / DB, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        run = w.commit(Record("run", ts=TS, extra={"job": JOB}))
        intent = w.commit(Record.sent("a", key="k1"))
        assert await asyncio.wait_for(run, 30) is Commit.DURABLE
        assert await asyncio.wait_for(intent, 30) is Commit.DURABLE
        w.put(Record("ok", "a", status=200, data=1, paid=1, ts=TS))
        mark = w.commit(Record("mark", extra={"frontier": {"line": 1}}, ts=TS))
        assert [rec.id for _, rec in pending_records(state, 0)] == [None, "a"]
        assert sends_of(state) == {} and not mark.done()  # logged, not applied
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await asyncio.wait_for(mark, 30) is Commit.DURABLE
    w.close()
    await task
    await store.close()
    assert errors == []
    assert batches == [[("run", None), ("sent", "a")], [("ok", "a"), ("mark", None)]]
    assert (w.commits, w.written) == (2, 4)
    assert sends_of(state) == {"a": 1} and outcomes_of(state) == {"a": "ok"}
    assert (state / "intents.log").stat().st_size == 0  # all applied: the log emptied


async def test_the_writing_process_gone_is_a_storage_error(tmp_path: Path) -> None:
    """The writing process killed mid-run: what it had not answered for, and everything
    after, is not durable, and the run hears it once, as a storage error."""
    state = tmp_path / "state"
    store = await open_store(state)
    errors: list[StorageError] = []
    w = ProcessWriter(store.process, on_commit=lambda b: None,  # type: ignore[attr-defined]
                      on_error=errors.append)
    task = asyncio.create_task(w.run())
    assert await w.commit(Record("run", ts=TS, extra={"job": JOB})) is Commit.DURABLE
    store.process._proc.kill()  # type: ignore[attr-defined]
    assert await asyncio.wait_for(w.commit(Record.sent("a")), 30) is Commit.FAILED
    assert await w.commit(Record.sent("b")) is Commit.FAILED
    w.close()
    await task
    await store.close()
    assert len(errors) == 1 and "state writer process ended unexpectedly" in str(errors[0])


async def test_in_doubt_after_a_crash_after_an_end_and_after_a_refetch(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run = Record("run", ts=TS, extra={"job": JOB})
    store = await open_store(state)
    store.commit([run, Record.sent("x"), Record.sent("y"), Record.sent("z")])
    store.commit([Record("ok", "x", status=200, data=1, paid=1, ts=TS)])
    snap = store.snapshot()  # our own run is going: y and z are in flight, not in doubt
    assert (snap.in_flight, snap.in_doubt) == (2, 0)
    _die(store)  # the process dies: its lock goes, nothing more is written
    snap = read_store(state).snapshot()
    assert (snap.in_flight, snap.in_doubt, snap.sent) == (0, 2, 3)
    assert dict(read_store(state).in_doubt()) == {"y": False, "z": False}
    await store.close()

    store = await open_store(state)  # the next run closes the crashed one
    store.commit([run, Record.sent("y")])
    store.commit([Record("ok", "y", status=200, data=1, paid=1, ts=TS),
                  Record.sent("w"), Record("end", ts=TS, extra={"in_doubt": ["w"]})])
    await store.close()
    assert dict(read_store(state).in_doubt()) == {"y": True, "z": False, "w": False}
    snap = read_store(state).snapshot()
    assert (snap.in_doubt, snap.billed_twice, snap.in_flight) == (2, 1, 0)
    assert sends_of(state) == {"x": 1, "y": 2, "z": 1, "w": 1}


async def test_a_crashed_run_s_id_whose_calls_were_all_answered_is_not_in_doubt(
        tmp_path: Path) -> None:
    """An ID answered 503 and waiting for its retry when the run was killed: every call of it
    had its answer, none billed, yet it was listed in doubt ("possibly billed"), and billed
    twice once fetched again (a kill -9 of 50 in flight: 85 in doubt, 33 of them so)."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("waits"),
                  Record.sent("out"), Record.answered("waits")])
    _die(store)
    await store.close()
    assert dict(read_store(state).in_doubt()) == {"out": False}
    assert read_store(state).snapshot().in_doubt == 1
    store = await open_store(state)  # the next run closes the crashed one's intents
    store.commit([Record("run", ts=TS, extra={"job": JOB})])
    await store.close()
    assert dict(read_store(state).in_doubt()) == {"out": False}
    assert read_store(state).snapshot().in_doubt == 1


async def test_an_intent_after_its_id_s_outcome_in_one_batch_stays_open(tmp_path: Path) -> None:
    """Pass 1's ``failed`` is queued without a wait and pass 2's intent for the same ID can
    follow it into the same group commit (cool-down 0): the intent is the later record, so it
    is the one left open, and after a crash the ID is in doubt."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("x")])
    store.commit([Record("failed", "x", status=500, error="HTTP 500", tries=1, ts=TS),
                  Record.sent("x")])  # pass 2's request for x is out now
    assert db_rows(state, "SELECT state, sent_run IS NOT NULL FROM items") == [("failed", 1)]
    _die(store)  # the process dies with the request out
    await store.close()
    assert dict(read_store(state).in_doubt()) == {"x": False}
    assert sends_of(state) == {"x": 2}


async def test_an_intent_taken_back_keeps_an_earlier_request_of_its_id_in_doubt(
        tmp_path: Path) -> None:
    """``unsent``: the request of an intent did not leave, so its call is taken back; but
    where an earlier request for the ID left in this run unanswered for the state (a retry's
    earlier try, billed or cut off), the ID stays open, and in doubt after a crash."""
    state = tmp_path / "state"
    store = await open_store(state)
    again, alone = Record.sent("x"), Record.sent("y")
    store.commit([Record("run", ts=TS, extra={"job": JOB}), Record.sent("x"), alone])
    store.commit([again])  # x's second try: its intent is durable, then the job stops
    store.commit([again.unsent(True), alone.unsent(False)])
    _die(store)
    await store.close()
    snap = read_store(state).snapshot()
    assert dict(read_store(state).in_doubt()) == {"x": False}  # (x's first try left)
    assert snap.sent == 1 and sends_of(state) == {"x": 1}  # (y: none left)


async def test_a_run_dedups_its_ids_in_the_database_and_counts_them(tmp_path: Path) -> None:
    state = tmp_path / "state"
    await committed(state, [RECORDS[0], RECORDS[1], RECORDS[2]])  # a ok, b failed
    store = await open_store(state)
    try:
        fresh, dups = await store.admit(["a", "b", "n1", "a", "n2", "n1"])
        assert fresh == [("a", "ok", 0), ("b", "perm", 0), ("n1", None, 0), ("n2", None, 0)]
        assert dups == 2
        fresh, dups = await store.admit(["n2", "n3"])
        assert fresh == [("n3", None, 0)] and dups == 1
        assert await store.run_counts() == Counts(ok=1, failed=1, unavailable=0, pending=3)
    finally:
        await store.close()
    store = await open_store(state)  # a new run sees every ID afresh
    try:
        fresh, dups = await store.admit(["n1", "a"])
        assert [i for i, _, _ in fresh] == ["n1", "a"] and dups == 0
    finally:
        await store.close()


async def test_another_program_s_sqlite_file_or_an_empty_one_is_named_as_such(
        tmp_path: Path) -> None:
    """Both read as "schema version 0, written by an incompatible asyncrawl version"."""
    foreign, empty = tmp_path / "foreign", tmp_path / "empty"
    foreign.mkdir()
    empty.mkdir()
    db = sqlite3.connect(foreign / DB)
    db.execute("CREATE TABLE notes (x)")
    db.commit()
    db.close()
    (empty / DB).write_bytes(b"")
    for attempt in (lambda: open_store(foreign), lambda: _read_all(foreign)):
        with pytest.raises(StorageError, match="is not an asyncrawl state database"):
            await attempt()
    with pytest.raises(ConfigError, match="holds no asyncrawl state yet"):
        read_store(empty)
    store = await open_store(empty)  # (a run makes it)
    await store.close()
    assert db_rows(empty, "PRAGMA user_version") == [(5,)]


@pytest.mark.parametrize("damage", ["garbage", "zeroed page"])
async def test_a_damaged_database_is_a_clear_storage_error_and_left_alone(
        tmp_path: Path, damage: str) -> None:
    state = tmp_path / "state"
    await committed(state, [RECORDS[0], *(Record("ok", f"i{n}", data={"pad": "x" * 500}, ts=TS)
                                          for n in range(200))])
    path = state / DB
    data = bytearray(path.read_bytes())
    if damage == "garbage":
        data[:100] = b"\x07" * 100  # the header
    else:
        data[4096:8192] = bytes(4096)  # a page of the items table
    path.write_bytes(bytes(data))
    for attempt in (lambda: open_store(state), lambda: _read_all(state)):
        with pytest.raises(StorageError) as e:
            await attempt()
        assert str(path) in str(e.value)
        assert "damaged" in str(e.value) or "not a database" in str(e.value)
    assert path.read_bytes() == bytes(data)  # nothing "repaired" away


async def _read_all(state: Path) -> None:
    store = read_store(state)
    store.snapshot()
    list(store.records("ok"))


async def test_a_database_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    await committed(state, RECORDS[:2])
    db = sqlite3.connect(state / DB)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StorageError, match=r"schema version 99.*incompatible"):
        await open_store(state)
    with pytest.raises(StorageError, match="schema version 99"):
        read_store(state)


# -- the lock ------------------------------------------------------------------------------------


async def test_lock_in_this_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = await open_store(state)
    try:
        with pytest.raises(LockedError) as e:
            await open_store(state)
        assert f"pid {os.getpid()}" in str(e.value) and str(state) in str(e.value)
        assert e.value.exit_code == 2
    finally:
        await first.close()
    second = await open_store(state)
    await second.close()


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from asyncrawl.store import open_store

    async def main():
        s = await open_store(sys.argv[1])
        print("locked", flush=True)
        await asyncio.sleep(60)
        await s.close()

    asyncio.run(main())
""")


def test_lock_held_by_another_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(state)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError) as e:
            asyncio.run(open_store(state))
        assert f"pid {proc.pid}" in str(e.value)
        assert read_store(state).snapshot().running == proc.pid
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    # the holder died without closing: the kernel released its flock
    asyncio.run(committed(state))
    assert (state / LOCK).read_text().strip() == str(os.getpid())


def test_a_run_killed_a_moment_ago_does_not_refuse_the_rerun(tmp_path: Path) -> None:
    """``kill -9``, then the same command again at once: a killed process keeps its lock until
    the system call it is in returns (an fsync on a busy disk), so the rerun waits for a
    holder that is exiting (a zombie, or SIGKILL pending) instead of exit 2."""
    from asyncrawl.lockfile import _dying

    state = tmp_path / "state"
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(state)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        assert not _dying(proc.pid)  # alive and well: a second run is refused
        proc.kill()  # not reaped yet: a zombie, or still exiting
        asyncio.run(committed(state))  # no LockedError
        assert _dying(proc.pid)  # a zombie until reaped
        proc.wait()
        proc.stdout.close()
    assert not _dying(proc.pid)  # gone


# -- the writer (generic over the store) ---------------------------------------------------------


class FailingStore:
    """A store whose commits fail from the ``fail_at``-th on (the writer's contract, alone)."""

    location = "/nowhere"
    job = None

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0
        self.kept: list[Record] = []

    def commit(self, records: Sequence[Record]) -> frozenset[str]:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise StorageError("cannot write the state database: disk I/O error", path=self.location)
        self.kept += records
        return frozenset()


async def test_writer_storage_error_stops_writing() -> None:
    store = FailingStore(fail_at=2)
    committed_: list[Record] = []
    errors: list[StorageError] = []
    w = Writer(store, on_commit=committed_.extend, on_error=errors.append)  # type: ignore[arg-type]
    task = asyncio.create_task(w.run())
    assert await w.commit(RECORDS[0]) is Commit.DURABLE
    assert await w.commit(RECORDS[1]) is Commit.FAILED  # its batch failed: not durable, and said so
    assert await w.commit(RECORDS[2]) is Commit.FAILED  # nothing is tried after a failure
    w.close()
    await task
    assert store.calls == 2 and len(errors) == 1 and w.failed is errors[0]
    assert committed_ == store.kept == [RECORDS[0]]


async def test_writer_lets_unwaited_records_gather_but_not_waited_ones(tmp_path: Path) -> None:
    """A batch nobody waits for lingers for company (fewer wake-ups of the writer's thread); a
    record somebody waits for cuts the lingering short."""
    store = await open_store(tmp_path / "state")
    batches: list[list[str | None]] = []
    w = Writer(store, on_commit=lambda b: batches.append([r.id for r in b]), on_error=print,
               linger=30)
    task = asyncio.create_task(w.run())
    w.put(Record("ok", "a", ts=TS))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not w._queue.empty():  # the thread took "a" and waits for company
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    w.put(Record("ok", "b", ts=TS))
    started = loop.time()
    assert await w.commit(Record("sent", "c", ts=TS)) is Commit.DURABLE
    assert loop.time() - started < 15  # not the 30 s linger: the commit woke the writer
    w.close()
    await task
    await store.close()
    # one wake-up for the three; the intent that a request waits for first, in a transaction
    # of its own, then the results nobody waits for
    assert batches == [["c"], ["a", "b"]]
    assert w.commits == 2


def _writer(store: Any, kind: str) -> Writer | ProcessWriter:
    """The run's writer of ``kind``: feeding the store's writing process, or on a thread."""
    if kind == "process":
        return ProcessWriter(store.process, on_commit=lambda b: None, on_error=print)
    return Writer(store, on_commit=lambda b: None, on_error=print, linger=0.0, hold=0.0)


@pytest.mark.parametrize("kind", ["process", "thread"])
async def test_a_writer_behind_its_backlog_holds_new_requests_until_it_catches_up(
        tmp_path: Path, kind: str) -> None:
    """Records queued and not yet reported count as the writer's backlog; at its limit the
    writer is ``behind`` (the workers start no new request), and ``caught_up`` returns once
    the store has made it durable down to half the limit. A failed writer holds nobody."""
    state = tmp_path / "state"
    store = await open_store(state)
    w = _writer(store, kind)
    w.backlog_limit = 4
    w.put(Record("run", ts=TS, extra={"job": JOB}))
    for item in "abc":  # (the process writer sends nothing before it runs; the thread's
        w.put(Record.sent(item))  # writer is not started yet either)
    assert (w.backlog, w.behind()) == (4, True)
    waiter = asyncio.create_task(w.caught_up())
    await asyncio.sleep(0)
    assert not waiter.done()  # nothing is durable yet
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(waiter, 30)
    assert w.backlog <= 2 and not w.behind()
    w.put(Record("ok", "a", status=200, raw=b"{}", paid=1, ts=TS))
    w.close()
    await task
    await store.close()
    assert w.backlog == 0
    assert outcomes_of(state) == {"a": "ok"} and sends_of(state) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize("kind", ["process", "thread"])
async def test_a_writer_behind_by_its_payloads_bytes_holds_new_requests(
        tmp_path: Path, kind: str) -> None:
    """The backlog counted records only: 1,024 answers of 8 MiB (max_body_bytes) were held in
    memory, 8 GiB, while the store fell behind. Past ``bytes_limit`` of queued payloads the
    writer is ``behind`` too, and caught up at half of it."""
    state = tmp_path / "state"
    store = await open_store(state)
    w = _writer(store, kind)
    w.bytes_limit = 3000
    w.put(Record("run", ts=TS, extra={"job": JOB}))
    body = b'{"pad": "' + b"x" * 990 + b'"}'
    for item in "abc":
        w.put(Record("ok", item, status=200, raw=body, paid=1, ts=TS))
    assert w.backlog == 4 and w.backlog_bytes == 3 * len(body) and w.behind()
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(w.caught_up(), 30)
    assert w.backlog_bytes <= 1500 and not w.behind()
    w.close()
    await task
    await store.close()
    assert w.backlog == w.backlog_bytes == 0
    assert outcomes_of(state) == {"a": "ok", "b": "ok", "c": "ok"}


async def test_a_failed_writer_has_no_backlog_and_holds_nobody(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = await open_store(state)
    w = ProcessWriter(store.process, on_commit=lambda b: None,  # type: ignore[attr-defined]
                      on_error=lambda e: None)
    w.backlog_limit = 2
    task = asyncio.create_task(w.run())
    assert await w.commit(Record("run", ts=TS, extra={"job": JOB})) is Commit.DURABLE
    store.process._proc.kill()  # type: ignore[attr-defined]
    w.put(Record("ok", "a", status=200, raw=b"{}", paid=1, ts=TS))
    w.put(Record("ok", "b", status=200, raw=b"{}", paid=1, ts=TS))
    assert await asyncio.wait_for(w.commit(Record.sent("c")), 30) is Commit.FAILED
    await asyncio.wait_for(w.caught_up(), 30)  # (returns: nothing more will be written)
    assert w.backlog == 0 and not w.behind()
    w.close()
    await task
    await store.close()


async def test_a_thread_writer_that_failed_holds_nobody_before_the_loop_hears_of_it() -> None:
    """The thread's writer marks itself failed before the event loop hears of it (``on_error``,
    which stops the run). In between, a writer at its backlog limit is not ``behind``: a worker
    would otherwise ask ``caught_up`` (which does not wait for a failed writer) again and again
    without ever letting the loop run, and the run would hang at 100 % CPU."""
    errors: list[StorageError] = []
    w = Writer(FailingStore(fail_at=1), on_commit=lambda b: None,  # type: ignore[arg-type]
               on_error=errors.append, linger=0.0, hold=0.0)
    w.backlog_limit = 2
    task = asyncio.create_task(w.run())
    await asyncio.sleep(0)  # (the writer's thread starts)
    for rec in RECORDS[:3]:
        w.put(rec)
    w.close()
    assert w._thread is not None
    w._thread.join(30)  # (blocking the loop on purpose: it is not told of the failure yet)
    assert w.failed is not None and not errors and w.backlog >= w.backlog_limit
    assert not w.behind()
    await asyncio.wait_for(w.caught_up(), 30)
    await task
    assert len(errors) == 1 and w.backlog == 0


async def test_writer_holds_results_back_while_intents_go_alone(tmp_path: Path) -> None:
    """``ok`` results nobody waits for are held back (here for as long as the test runs) while
    the intents that requests wait for are committed one batch after another without them;
    a record about everything before it commits what was held first, in the same transaction;
    ``close`` commits what is held."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit(RECORDS[:1])  # the run
    batches: list[list[tuple[str, str | None]]] = []
    w = Writer(store, on_commit=lambda b: batches.append([(r.kind, r.id) for r in b]),
               on_error=print, linger=0, hold=3600)
    task = asyncio.create_task(w.run())
    w.put(Record("ok", "a", status=200, data={"n": 1}, paid=1, ts=TS))
    assert await w.commit(Record("sent", "b", ts=TS)) is Commit.DURABLE
    w.put(Record("ok", "b", status=200, data={"n": 2}, paid=1, ts=TS))
    assert await w.commit(Record("sent", "c", ts=TS)) is Commit.DURABLE  # not behind "a" and "b"
    assert await w.commit(Record("mark", extra={"pass": 1}, ts=TS)) is Commit.DURABLE
    w.put(Record("ok", "c", status=200, data={"n": 3}, paid=1, ts=TS))
    w.close()
    await task
    await store.close()
    assert batches == [[("sent", "b")], [("sent", "c")],
                       [("ok", "a"), ("ok", "b"), ("mark", None)], [("ok", "c")]]
    assert read_store(state).snapshot().counts.ok == 3


async def test_writer_commits_intents_before_results_unless_a_record_is_about_all(
        tmp_path: Path) -> None:
    """Intents that requests wait for are not held back by the results queued with them
    (they are durable in the intent log at once); the database applies the batch in the
    queue's order, and a batch with a record about everything before it (here ``end``) is
    applied after the rest."""
    state = tmp_path / "state"
    store = await open_store(state)
    store.commit(RECORDS[:1])  # the run
    batches: list[list[tuple[str, str | None]]] = []
    w = ProcessWriter(store.process,  # type: ignore[attr-defined]
                      on_commit=lambda b: batches.append([(r.kind, r.id) for r in b]),
                      on_error=print)
    w.put(Record("ok", "a", status=200, data={"n": 1}, paid=1, ts=TS))
    w.put(Record("failed", "b", status=503, error="HTTP 503", ts=TS))
    intent = w.commit(Record("sent", "b", ts=TS))
    w.put(Record("ok", "c", status=200, data={"n": 3}, paid=1, ts=TS))
    w.close()
    await w.run()
    assert await intent is Commit.DURABLE
    assert batches == [[("sent", "b")], [("ok", "a"), ("failed", "b"), ("ok", "c")]]
    assert db_rows(state, "SELECT state, sent_run IS NOT NULL FROM items WHERE id = 'b'") == [
        ("failed", 1)]  # the intent applied after the failure it came after
    batches.clear()
    w = ProcessWriter(store.process,  # type: ignore[attr-defined]
                      on_commit=lambda b: batches.append([(r.kind, r.id) for r in b]),
                      on_error=print)
    w.put(Record("ok", "d", status=200, data={"n": 4}, paid=1, ts=TS))
    intent = w.commit(Record("sent", "e", ts=TS))
    w.put(Record("end", extra={"in_doubt": ["e"]}, ts=TS))
    w.close()
    await w.run()
    assert await intent is Commit.DURABLE
    assert batches == [[("sent", "e")], [("ok", "d"), ("end", None)]]
    await store.close()
    in_doubt = dict(read_store(state).in_doubt())
    assert in_doubt == {"e": False}  # and nothing about "b": its intent came after its failure




def _forking(tmp_path: Path, body: str) -> Any:
    """Run ``body`` in a Python process of its own (one thread, as the CLI's is when it forks
    its zygote; pytest's may have others), with ``zygote_run`` at hand; its last line of
    output, as JSON."""
    script = textwrap.dedent("""
        import asyncio, json, os, signal, socket, sys, time
        from pathlib import Path
        from asyncrawl.records import Record
        from asyncrawl.sqlproc import ZYGOTE, Zygote
        from asyncrawl.sqlstore import serve_writes
        from asyncrawl.store import open_store

        def zygote_run(state, records, zygote, during=None):
            async def crawl():
                store = await open_store(state)
                try:
                    pid = store.process._proc.pid
                    store.commit(records)
                    if during is not None:
                        during(store)
                finally:
                    await store.close()
                return pid
            token = ZYGOTE.set(zygote)
            try:
                return asyncio.run(crawl())
            finally:
                ZYGOTE.reset(token)
                zygote.close()

        def fds_of(pid):
            out = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if int(fd) > 2:
                    try:
                        out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    except OSError:
                        pass
            return sorted(out)

        def poll(what, deadline=30.0):
            end = time.monotonic() + deadline
            while not what():
                assert time.monotonic() < end, what
                time.sleep(0.01)
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return orjson.loads(proc.stdout.splitlines()[-1])


def _poll(what: Any, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while not what():
        assert time.monotonic() < end, f"not within {deadline} s: {what}"
        time.sleep(0.01)


needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")


@needs_proc
def test_the_cli_forks_the_writing_process_ahead_and_it_keeps_nothing_of_ours(
        tmp_path: Path) -> None:
    """``sqlproc.Zygote``: forked before the run opens its state, it keeps none of the
    process's descriptors (a listening socket, an open log file) but its own socket, becomes the
    run's writing process when the store opens, and writes what the run commits."""
    got = _forking(tmp_path, """
        listener = socket.create_server(("127.0.0.1", 0))
        os.mkdir("state")
        kept = open("state/run.log", "w")  # (a log in the state directory: no reason to spawn)
        zygote = Zygote.start(serve_writes)
        poll(lambda: len(fds_of(zygote.process.pid)) == 1)  # (closed right after the fork)
        fds = fds_of(zygote.process.pid)
        writer = zygote_run(Path("state"), [
            Record("run", ts=1.0, extra={"job": {"method": "GET", "url": "http://x/{id}"}}),
            Record.sent("a"), Record("ok", "a", status=200, data=1, paid=1, ts=1.0)], zygote)
        print(json.dumps({"fds": fds, "forked": writer == zygote.process.pid,
                          "code": zygote.process.returncode}))
    """)
    assert len(got["fds"]) == 1 and got["fds"][0].startswith("socket:"), got
    assert got["forked"] and got["code"] == 0
    assert outcomes_of(tmp_path / "state") == {"a": "ok"}
    assert (tmp_path / "state" / "intents.log").stat().st_size == 0


@needs_proc
@pytest.mark.parametrize("linked", [False, True], ids=["state.db", "state.db-a-symlink"])
def test_a_state_open_at_the_fork_is_served_by_a_spawned_process(tmp_path: Path,
                                                                 linked: bool) -> None:
    """SQLite keeps a per-process record of each database file open; a zygote forked while
    this process had the state's database open would take that record as its own (locks on a
    descriptor it closed). It is not handed that state (nor where ``state.db`` is a link to
    the file open): the run spawns its writing process, and a reader that holds a snapshot
    meanwhile keeps it."""
    asyncio.run(committed(tmp_path / "state", RECORDS))
    opened = "state/state.db"
    if linked:
        (tmp_path / "real").mkdir()
        for name in os.listdir(tmp_path / "state"):
            if name.startswith(DB):
                os.rename(tmp_path / "state" / name, tmp_path / "real" / name)
        (tmp_path / "state" / DB).symlink_to(tmp_path / "real" / DB)
        opened = "real/state.db"
    got = _forking(tmp_path, f"""
        import sqlite3
        reader = sqlite3.connect({opened!r})
        reader.execute("BEGIN")
        before = reader.execute("SELECT count(*) FROM items").fetchone()[0]
        zygote = Zygote.start(serve_writes)
        writer = zygote_run(Path("state"), [Record("ok", f"n{{i}}", status=200, data=i, paid=1,
                                                   ts=1.0) for i in range(2000)], zygote)
        after = reader.execute("SELECT count(*) FROM items").fetchone()[0]
        reader.execute("COMMIT")
        now = reader.execute("SELECT count(*) FROM items").fetchone()[0]
        ok = reader.execute("PRAGMA integrity_check").fetchone()[0]
        print(json.dumps({{"forked": writer == zygote.process.pid,
                           "zygote": zygote.process.returncode,
                           "snapshot": [before, after], "now": now, "check": ok}}))
    """)
    assert not got["forked"] and got["zygote"] == 0
    assert got["snapshot"][0] == got["snapshot"][1] == 4
    assert got["now"] == 2004 and got["check"] == "ok"


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGUSR1])
@pytest.mark.parametrize("fd", [3, 4, 5, 6, 7])
def test_the_forked_process_writes_nothing_by_a_number_it_closed(
        tmp_path: Path, fd: int, sig: signal.Signals) -> None:
    """faulthandler on a descriptor of its own (as pytest sets it; and a report of SIGUSR1's,
    ``faulthandler.register``) and a ``sys.stderr`` on another: the forked writing process
    closes those numbers and reuses them for the state's files, so what would be written by
    them goes to its standard error instead, or nowhere (a fatal signal's report, SIGUSR1's
    stacks), not over the state's database or its lock."""
    got = _forking(tmp_path, f"""
        import faulthandler
        while (d := os.dup(2)) < {fd}:
            pass
        faulthandler.enable(file=d)
        faulthandler.register(signal.SIGUSR1, file=d)
        sys.stderr = open(os.dup(2), "w")
        zygote = Zygote.start(serve_writes)

        def crash(store):
            store.commit([Record.sent("b")])
            os.kill(store.process._proc.pid, {int(sig)})
            poll(lambda: store.process._proc.poll() is not None)

        try:
            zygote_run(Path("state"), [
                Record("run", ts=1.0, extra={{"job": {{"method": "GET", "url": "http://x/{{id}}"}}}}),
                Record.sent("a")], zygote, crash)
        except Exception:
            pass
        print(json.dumps({{"code": zygote.process.returncode}}))
    """)
    assert got["code"] == -sig
    for name in os.listdir(tmp_path / "state"):
        data = (tmp_path / "state" / name).read_bytes()
        assert b"Fatal Python error" not in data and b"most recent call first" not in data, name
    assert (tmp_path / "state" / DB).read_bytes()[:16] == b"SQLite format 3\x00"
    assert read_store(tmp_path / "state").snapshot().in_doubt == 2  # (a, b: sent, no end)


@needs_proc
def test_a_zygote_never_handed_a_run_ends_with_its_parent(tmp_path: Path) -> None:
    """Closed unused, it ends at once; its parent killed (-9) before handing it a run, it
    ends too: no process is left behind."""
    got = _forking(tmp_path, """
        zygote = Zygote.start(serve_writes)
        zygote.close()
        print(json.dumps({"code": zygote.process.returncode}))
    """)
    assert got["code"] == 0
    script = textwrap.dedent("""
        import os, signal
        from asyncrawl.sqlproc import Zygote
        from asyncrawl.sqlstore import serve_writes
        z = Zygote.start(serve_writes)
        print(z.process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == -9
    child = int(proc.stdout)
    _poll(lambda: child not in live_processes())


async def test_error_answers_of_an_id_in_doubt_are_not_calls_with_no_answer(
        tmp_path: Path) -> None:
    """An ID answered 500 twice, then cut off: one call with no answer known (each of its
    calls was, before ``answered`` records: schema 4, read as it is, says so still)."""
    state = tmp_path / "state"
    await committed(state, [RECORDS[0], Record.sent("x"), Record.answered("x")],
                    [Record.sent("x"), Record.answered("x"), Record.sent("x")],
                    [Record("end", extra={"in_doubt": ["x"]})])
    snap = read_store(state).snapshot()
    assert (snap.sent, snap.in_doubt, snap.unsure_calls) == (3, 1, 1)
    assert db_rows(state, "SELECT sends, paid, answered FROM items") == [(3, 0, 2)]
    await committed(state, [RECORDS[0], Record.sent("y"), Record.answered("y"),
                            Record.sent("y"), Record("ok", "y", status=200, data={}, paid=1)])
    as_schema_4(state / DB)
    assert read_store(state).snapshot().unsure_calls == 3  # (x's: y is not in doubt)
    await committed(state)  # (a run's open upgrades it)
    assert db_rows(state, "PRAGMA user_version") == [(5,)]
    # (an ID not in doubt had an answer to each call: y's error answer is known again)
    assert db_rows(state, "SELECT id, sends, answered FROM items ORDER BY id") == [
        ("x", 3, 0), ("y", 2, 1)]


def test_a_lock_held_after_its_run_ended_says_so(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's writing process (stopped, or on a hung disk) holds the lock after the run
    was killed: the message named the dead run as "another asyncrawl run ... using" it."""
    import fcntl

    from asyncrawl import lockfile

    monkeypatch.setattr(lockfile, "DYING_WAIT", 0.1)
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (state / lockfile.LOCK).write_text(f"{dead.pid}\n")
    held = os.open(state / lockfile.LOCK, os.O_RDWR)  # (the writing process's, inherited)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(LockedError, match=f"the run that took it \\(pid {dead.pid}\\) is "
                                              "no process here: it ended and its writing process"):
            lockfile.lock_state_dir(state)
    finally:
        os.close(held)


async def test_a_stalled_writing_process_is_said_and_so_is_its_return(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stopped writing process (or a hung disk) stopped the run with no sign but 0 req/s."""
    from asyncrawl import writer

    monkeypatch.setattr(writer, "STALL_CHECK", 0.05)
    state = tmp_path / "state"
    store = await open_store(state)
    w = ProcessWriter(store.process, on_commit=lambda b: None,  # type: ignore[attr-defined]
                      on_error=lambda e: None)
    task = asyncio.create_task(w.run())
    pid = store.process.pid  # type: ignore[attr-defined]
    try:
        assert await w.commit(Record("run", ts=TS, extra={"job": JOB})) is Commit.DURABLE
        os.kill(pid, signal.SIGSTOP)
        sent = w.commit(Record.sent("a"))
        deadline = asyncio.get_running_loop().time() + 30
        while "has not answered" not in caplog.text:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert f"pid {pid}: stopped?" in caplog.text and not sent.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await asyncio.wait_for(sent, 30) is Commit.DURABLE
    deadline = asyncio.get_running_loop().time() + 30
    while "answers again" not in caplog.text:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    w.close()
    await task
    await store.close()


def test_a_store_that_answers_again_is_not_stalled_before_the_next_look() -> None:
    """``stalled`` stayed true up to 5 s after the store answered again: a second signal
    then ended the run by ``os._exit``, dropping what was about to be committed."""
    from asyncrawl.writer import _Reporting

    w = _Reporting(on_commit=lambda b: None, on_error=lambda e: None)
    w.backlog = 3
    for _ in range(3):
        w._check_stall()
    assert w.stalled
    w._count([Record("run", ts=TS, extra={"job": JOB})])  # (it answers: an intent logged)
    assert w.stalled  # (no sign that the results are written: an intent log is not the store)
    w.applied += 1  # (it applies)
    assert not w.stalled


def test_an_ids_file_identity_kept_by_the_release_before_still_matches() -> None:
    """It had no change time: every job lost its read-on-from-the-frontier for good at the
    upgrade (its file taken for changed, the job's source "mixed")."""
    from asyncrawl.sqlstore import _same_file

    new = {"path": "/ids", "size": 9, "mtime_ns": 5, "ctime_ns": 7, "ino": 3, "dev": 1}
    old = {k: v for k, v in new.items() if k != "ctime_ns"}
    assert _same_file(old, new) and _same_file(new, dict(new))
    assert not _same_file(new, {**new, "ctime_ns": 8})  # (rewritten, its mtime set back)
    assert not _same_file(old, {**new, "mtime_ns": 6})
