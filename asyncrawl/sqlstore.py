"""[5] The state store of a state directory: one SQLite database, ``state.db`` (a ``store.Store``).

Layout of a state directory::

    state.db, state.db-wal, state.db-shm   the database (WAL mode)
    intents.log                            a run's ``sent`` intents, durable before the
                                           database has them (``sqlproc``)
    lock                                   flock()ed by the run that owns the directory
    live.json                              the running job's last progress snapshot

Durability: WAL with ``synchronous = FULL``: a committed transaction survives a crash and a
power loss. A run's writes go through one process of their own (``sqlproc``: the run's writer,
``writer.ProcessWriter``, hands it the batches from the event loop; it makes the ``sent``
intents durable in ``intents.log`` first); each of its group commits is one transaction, so one
fsync of the WAL, and records the number of its last batch ('applied' in ``meta``). Readers
(``status``, ``export``, the run's own lookups) read consistent snapshots while it writes.

Tables (``records.py`` says what each record means)::

    items(id, state, status, error, pass, tries, paid, fetched_at, data, sent_run, sends, doubt,
          payload, pieces, answered, unusable)
        one row per ID the job has sent or settled: ``state`` NULL (not settled yet), ok,
        failed, perm, unavailable; ``payload`` the first row of ``payloads`` holding the ok
        payload and ``pieces`` in how many (NULL: one, written by schema 3; ``data``: where
        schema 2 and before kept it, in the row); ``sent_run`` the run whose ``sent``
        intent has no outcome yet; ``sends`` the requests ever sent for it, ``paid`` those
        answered 2xx (billable) and ``answered`` those answered otherwise (schema 5): the
        rest got no answer the state knows of (in doubt, unanswered, in flight);
        ``unusable`` its paid answers that could not be used (schema 5);
        ``doubt`` NULL or 0 to 3: in doubt (a run cut off) or unanswered, and whether
        fetched ok since (``records.NOT_IN_DOUBT``)
    payloads(id, data)                      ok payloads as JSON (UTF-8, a blob that the
                                            ``results`` view casts to text), appended, in
                                            pieces that fill its pages (``_cut``)
    runs(run, started, pid, version, job, ended, error, halt_reason, halt_status, halt_message)
    ledger(day, endpoint, sent, billable)   calls by UTC date and endpoint, as recorded
    key_ledger(day, key, sent, billable)    calls by UTC date and API key fingerprint
                                            (``[request] keys``; never the key)
    tally(state, n)                         IDs by state, kept by triggers: counts in O(1)
    meta(key, value)                        the job's identity ("job"); its IDs file ("source":
                                            path, size, mtime, inode, lines; or "mixed") and
                                            how far the runs have covered it ("frontier");
                                            "imported_journal"

and the view for users, ``results(id, outcome, status, error, fetched_at, data)``.

A run dedups its IDs in a temporary table of its own connection (``admit``), so memory does not
grow with the list. A state directory made by the journal of earlier releases
(``journal.jsonl``) is imported on first open, in one transaction, and the file is kept as
``journal.jsonl.imported``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sqlite3
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import orjson

from .config import endpoint_of
from .errors import ConfigError, StorageError
from .journal import JOURNAL, scan
from .live import LIVE
from .lockfile import LOCK, fsync_dir, lock_holder, lock_state_dir
from .records import (
    COUNTED,
    EXPORT_STATES,
    NOT_IN_DOUBT,
    OUTCOME_KINDS,
    UNANSWERED_CALL,
    Bought,
    Counts,
    Record,
    Snapshot,
    call_rows,
    in_order_parts,
    state_of,
    utc_day,
)
from .sqlproc import INTENTS, ZYGOTE, IntentLog, WriterProcess, Zygote, pending_records, serve
from .types import Halt

log = logging.getLogger("asyncrawl")
T = TypeVar("T")
P = ParamSpec("P")

DB = "state.db"
# the files of a state directory (what an export must not replace): the database, its WAL and
# index, the intent log, the lock, the live figures, an earlier release's journal
STATE_FILES = frozenset({DB, f"{DB}-wal", f"{DB}-shm", INTENTS, LOCK, LIVE, JOURNAL,
                         f"{JOURNAL}.imported"})
SCHEMA_VERSION = 5  # 2: key_ledger; 3: payloads; 4: payloads in pieces; 5: answered, unusable
ROW_COST = 32  # bytes of the file a payload's extra row must save (``_cut``)


def _payload_sql(i: str, p: str) -> str:
    """The expression of an item's payload: ``{p}.data`` (its one row of ``payloads``, joined
    on ``{i}.payload``), or its pieces, concatenated in order, or ``{i}.data`` (schema 2)."""
    return (f"CASE WHEN {i}.pieces > 1 THEN (SELECT group_concat(data, '') FROM (SELECT data "
            f"FROM payloads WHERE id BETWEEN {i}.payload AND {i}.payload + {i}.pieces - 1 "
            f"ORDER BY id)) ELSE coalesce({p}.data, {i}.data) END")


RESULTS_VIEW = f"""
CREATE VIEW results AS
    SELECT i.id, CASE i.state WHEN 'perm' THEN 'failed' ELSE i.state END AS outcome, i.status,
           i.error, i.fetched_at, CAST({_payload_sql("i", "p")} AS TEXT) AS data
    FROM items i LEFT JOIN payloads p ON p.id = i.payload WHERE i.state IS NOT NULL;
"""
# what a database of an earlier version needs, from the writer's first open ({from: script})
MIGRATIONS = {1: """
CREATE TABLE key_ledger (
    day TEXT NOT NULL, key TEXT NOT NULL, sent INTEGER NOT NULL DEFAULT 0,
    billable INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, key)
) WITHOUT ROWID;
""", 2: """
ALTER TABLE items ADD COLUMN payload INTEGER;
CREATE TABLE payloads (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
DROP VIEW results;
CREATE VIEW results AS
    SELECT i.id, CASE i.state WHEN 'perm' THEN 'failed' ELSE i.state END AS outcome, i.status,
           i.error, i.fetched_at, CAST(coalesce(p.data, i.data) AS TEXT) AS data
    FROM items i LEFT JOIN payloads p ON p.id = i.payload WHERE i.state IS NOT NULL;
""", 3: """
ALTER TABLE items ADD COLUMN pieces INTEGER;
DROP VIEW results;
""" + RESULTS_VIEW, 4: """
ALTER TABLE items ADD COLUMN answered INTEGER NOT NULL DEFAULT 0;
ALTER TABLE items ADD COLUMN unusable INTEGER NOT NULL DEFAULT 0;
UPDATE items SET answered = sends - paid - (sent_run IS NOT NULL)
    WHERE doubt IS NULL AND sends > paid + (sent_run IS NOT NULL);
"""}  # (5: an ID never cut off nor unanswered had an answer to each call but an open one)
CHUNK = 900  # IDs per block read (``unsettled``)
# the records that count something of an ID, and the statement that counts one
_COUNTED = {kind: f"UPDATE items SET {kind} = {kind} + 1 WHERE id = ?" for kind in COUNTED}
PAGE_SIZE = 8192  # ~7 results of 1 KB a page: 4 KB pages hold 3 and waste a quarter
OPEN = "(state IS NULL OR state IN ('failed', 'perm'))"  # rows of the items_open index

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
CREATE TABLE items (
    id TEXT NOT NULL UNIQUE,
    state TEXT,
    status INTEGER,
    error TEXT,
    pass INTEGER,
    tries INTEGER,
    paid INTEGER NOT NULL DEFAULT 0,
    fetched_at REAL,
    data BLOB,
    sent_run INTEGER,
    sends INTEGER NOT NULL DEFAULT 0,
    doubt INTEGER,
    payload INTEGER,
    pieces INTEGER,
    answered INTEGER NOT NULL DEFAULT 0,
    unusable INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE payloads (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE INDEX items_open ON items (sent_run) WHERE state IS NULL OR state IN ('failed', 'perm');
CREATE INDEX items_doubt ON items (doubt) WHERE doubt IS NOT NULL;
CREATE TABLE runs (
    run INTEGER PRIMARY KEY, started REAL, pid INTEGER, version TEXT, job TEXT, ended REAL,
    error TEXT, halt_reason TEXT, halt_status INTEGER, halt_message TEXT
);
CREATE TABLE ledger (
    day TEXT NOT NULL, endpoint TEXT NOT NULL, sent INTEGER NOT NULL DEFAULT 0,
    billable INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, endpoint)
) WITHOUT ROWID;
CREATE TABLE key_ledger (
    day TEXT NOT NULL, key TEXT NOT NULL, sent INTEGER NOT NULL DEFAULT 0,
    billable INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, key)
) WITHOUT ROWID;
CREATE TABLE tally (state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO tally VALUES ('ok', 0), ('failed', 0), ('perm', 0), ('unavailable', 0);
CREATE TRIGGER items_insert AFTER INSERT ON items WHEN NEW.state IS NOT NULL BEGIN
    UPDATE tally SET n = n + 1 WHERE state = NEW.state;
END;
CREATE TRIGGER items_update AFTER UPDATE OF state ON items
WHEN OLD.state IS NOT NEW.state BEGIN
    UPDATE tally SET n = n - 1 WHERE state = OLD.state;
    UPDATE tally SET n = n + 1 WHERE state = NEW.state;
END;
""" + RESULTS_VIEW

# An outcome record: ok is final (the first ok record is the ID's result; later ones add
# only their bill), and it ends the ID's open "sent" intent.
UPSERT_OUTCOME = """
INSERT INTO items (id, state, status, error, pass, tries, paid, fetched_at, payload, pieces)
VALUES {values}
ON CONFLICT (id) DO UPDATE SET
    state = iif(state = 'ok', 'ok', excluded.state),
    status = iif(state = 'ok', status, excluded.status),
    error = iif(state = 'ok', error, excluded.error),
    pass = iif(state = 'ok', pass, excluded.pass),
    tries = iif(state = 'ok', tries, excluded.tries),
    fetched_at = iif(state = 'ok', fetched_at, excluded.fetched_at),
    payload = iif(state = 'ok', payload, excluded.payload),
    pieces = iif(state = 'ok', pieces, excluded.pieces),
    paid = paid + excluded.paid,
    sent_run = NULL,
    doubt = iif(doubt IN (0, 2) AND excluded.state = 'ok', doubt + 1, doubt)
"""
# A batch's intents: its IDs as one JSON array (one parameter, not three a row), or, where an
# ID holds a NUL (which json_each of SQLite before 3.45 cuts the string at), as rows.
UPSERT_SENT = """
INSERT INTO items (id, sent_run, sends) SELECT value, ?, 1 FROM json_each(?) WHERE true
ON CONFLICT (id) DO UPDATE SET sent_run = excluded.sent_run, sends = sends + 1
"""
UPSERT_SENT_ROWS = """
INSERT INTO items (id, sent_run, sends) VALUES {values}
ON CONFLICT (id) DO UPDATE SET sent_run = excluded.sent_run, sends = sends + 1
"""


def _add_calls(table: str, what: str) -> str:
    """Add a batch's calls to ``table`` (``ledger`` by endpoint, ``key_ledger`` by key)."""
    return (f"INSERT INTO {table} (day, {what}, sent, billable) VALUES {{values}} "
            f"ON CONFLICT (day, {what}) DO UPDATE SET sent = sent + excluded.sent, "
            "billable = billable + excluded.billable")


ADD_LEDGER = _add_calls("ledger", "endpoint")
ADD_KEY_LEDGER = _add_calls("key_ledger", "key")


async def _off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``asyncio.to_thread``, asyncio imported on the first call: ``status`` and ``export``,
    which read the store without an event loop, start ~20 ms sooner without it."""
    import asyncio

    return await asyncio.to_thread(fn, *args, **kwargs)


def _storage_error(e: sqlite3.Error, path: Path, doing: str) -> StorageError:
    """An SQLite error in an operator's words (disk full, I/O error, damaged database)."""
    text = str(e)
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    if code in (11, 26) or "malformed" in text:  # SQLITE_CORRUPT, SQLITE_NOTADB
        return StorageError(
            f"the state database is damaged ({text}); nothing was changed. Keep a copy of the "
            "state directory, then recover it with `sqlite3 state.db .recover | sqlite3 "
            "new.db`, or start the job in a new state directory", path=path)
    name = getattr(e, "sqlite_errorname", None)
    return StorageError(f"cannot {doing}: {text}{f' ({name})' if name else ''}", path=path)


class SqliteStore:
    """The SQLite store of one state directory. ``SqliteStore.open`` opens it for a run (locked),
    ``SqliteStore.reader`` read-only (no lock: a run may be going)."""

    def __init__(self, state_dir: Path, db: sqlite3.Connection, *, lock_fd: int = -1) -> None:
        self.state_dir = state_dir
        self.location = str(state_dir)
        self.path = state_dir / DB
        self._db = db  # the writer's connection (a run), or the reader's
        self._file = -1  # (a writer's descriptor of state.db: is it still linked? ``_check_file``)
        self._lock_fd = lock_fd
        self._reader: sqlite3.Connection | None = None  # a run's lookups and dedup
        self._run: int | None = None
        self._endpoint = ""
        self._dead = False
        self._frontier_ok = False  # the run reads the job's one IDs file: keep its frontier
        # (days since the epoch, UTC date, its start and end) of the last record applied
        self._day: tuple[int, str, float, float] = (-1, "", 0.0, -1.0)
        self._next_payload: int | None = None  # the number of the next payload row written
        # a run's: the process that writes (sqlproc), which ``writer.ProcessWriter`` feeds
        self.process: WriterProcess | None = None
        with self._reading():
            self._version = db.execute("PRAGMA user_version").fetchone()[0]
            self._page = db.execute("PRAGMA page_size").fetchone()[0]
        self.job: dict[str, Any] | None = self._meta_json("job")

    def __repr__(self) -> str:
        return f"<SqliteStore {self.path} locked={self._lock_fd >= 0} run={self._run}>"

    # -- opening -------------------------------------------------------------------------------

    @staticmethod
    def exists(state_dir: str | os.PathLike[str]) -> bool:
        d = Path(state_dir)
        return (d / DB).exists() or (d / "journal.jsonl").exists()

    @classmethod
    async def open(cls, state_dir: str | os.PathLike[str]) -> SqliteStore:
        """Create or open the store: lock it, import an old journal, close a crashed run.

        Cancelled meanwhile, it waits for the thread that opens it (which cannot be stopped:
        a few ms) and closes what that opened, then lets the cancellation through: the lock
        and the writing process are not left behind, where every later run of the process
        would find the state locked by the process itself."""
        import asyncio

        # (a future of the executor's, not a task: a loop's shutdown that cancels every task
        # does not cancel it, and the thread cannot be stopped anyway)
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, cls._open_sync, Path(state_dir), ZYGOTE.get())
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            while not opening.done():  # (cancelled again: still wait for the thread)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([opening])
            if opening.exception() is None:  # (else it did not open: nothing is held)
                with contextlib.suppress(Exception):  # (the cancellation is what is raised)
                    await opening.result().close()
            raise

    @classmethod
    def _open_sync(cls, d: Path, zygote: Zygote | None = None) -> SqliteStore:
        lock_fd = lock_state_dir(d)
        try:
            _import_journal(d)
            if not (d / DB).exists():
                _create(d / DB)
            db = _connect(d / DB)
            store = None
            try:
                _ensure_schema(db, d / DB)
                store = cls(d, db, lock_fd=lock_fd)
                seq = store._apply_logged_intents()
                store._close_crashed_run()
                store._reader = _connect(d / DB)
                store._reader.execute("CREATE TEMP TABLE seen (id TEXT PRIMARY KEY) WITHOUT ROWID")
                store._start_writing_process(lock_fd, seq, zygote)
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as e:
            os.close(lock_fd)
            raise _storage_error(e, d / DB, "open the state database") from None
        except OSError as e:
            os.close(lock_fd)
            raise StorageError(f"cannot create the state database: {e.strerror}",
                               path=d / DB) from None
        except BaseException:
            os.close(lock_fd)
            raise
        return store

    @classmethod
    def reader(cls, state_dir: str | os.PathLike[str]) -> SqliteStore:
        """Read-only and unlocked. ``ConfigError`` if no run ever used the directory. The
        journal of an earlier release, not imported yet, is read into a temporary database."""
        d = Path(state_dir)
        if (d / JOURNAL).exists() and not (d / DB).exists():
            return cls._legacy_reader(d)
        if not (d / DB).exists():
            what = "does not exist" if not d.exists() else "holds no asyncrawl state"
            raise ConfigError(f"{d} {what}: nothing has run with this state directory (check "
                              "--state, or [state] dir in the config)")
        try:
            try:
                db = _read_only(d / DB)
            except sqlite3.Error as e:
                # WAL's index (state.db-shm) is gone (the last client to close deletes it, as
                # sqlite3's shell does) and cannot be made again here (a read-only mount or
                # directory): with no WAL content left, nothing writes the database, whose
                # file alone holds it all, and it is read as the unchanging file it is
                wal = d / f"{DB}-wal"
                if e.sqlite_errorcode not in _NO_INDEX or (wal.exists() and wal.stat().st_size):
                    raise
                db = _read_only(d / DB, immutable=True)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            empty = version == 0 and not db.execute("SELECT 1 FROM sqlite_master").fetchone()
        except (sqlite3.Error, OSError) as e:
            if isinstance(e, OSError):
                raise StorageError(f"cannot read the state directory: {e.strerror}",
                                   path=d) from None
            raise _storage_error(e, d / DB, "read the state database") from None
        if empty:  # (a run that died as it made the database)
            db.close()
            raise ConfigError(f"{d} holds no asyncrawl state yet: its first run stopped before "
                              "it wrote any (run it again)")
        _check_version(version, d / DB)
        return cls(d, db)

    @classmethod
    def _legacy_reader(cls, d: Path) -> SqliteStore:
        fd, tmp = tempfile.mkstemp(prefix="asyncrawl-journal-", suffix=".db")
        os.close(fd)
        try:
            _build_from_journal(d / JOURNAL, Path(tmp))
            db = sqlite3.connect(tmp, check_same_thread=False)
        finally:
            os.unlink(tmp)  # the open connection keeps reading it
        return cls(d, db)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """SQLite's errors while reading, in an operator's words (``StorageError``)."""
        try:
            yield
        except sqlite3.Error as e:
            raise _storage_error(e, self.path, "read the state database") from None

    def _meta_json(self, key: str) -> Any:
        with self._reading():
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return orjson.loads(row[0]) if row and row[0] is not None else None

    def _start_writing_process(self, lock_fd: int, seq: int, zygote: Zygote | None) -> None:
        """The process that writes for this run (``sqlproc``; its batches are numbered on
        from ``seq``; ``zygote`` becomes it where given), once the intent log is emptied (all
        of it is applied by now); where it cannot start (no Python to run it: an embedding
        application), this process writes."""
        intents = IntentLog(self.state_dir)
        try:
            if intents.size:
                intents.cut()
        finally:
            intents.close()
        try:
            self.process = WriterProcess(self.state_dir, lock_fd, seq,
                                         zygote if zygote and zygote.serves(self.path) else None)
        except StorageError as e:
            level = logging.INFO if getattr(sys, "frozen", False) else logging.WARNING
            log.log(level, "%s; the run writes the state database in its own process", e)

    def _apply_logged_intents(self) -> int:
        """The records of ``intents.log`` that the last run's writing process did not apply
        (it died first, or the machine did): applied now, in one transaction, which also
        records the highest batch number seen (the log is emptied when this run opens it).
        Intents before any ``run`` record of the log belong to the last run the database
        has. Returns the number of the last batch applied."""
        db = self._db
        applied = int(self._meta_json("applied") or 0)
        logged = list(pending_records(self.state_dir, applied))
        if logged:
            db.execute("BEGIN IMMEDIATE")
            try:
                self._run = db.execute("SELECT coalesce(max(run), 0) FROM runs").fetchone()[0]
                job = self._meta_json("job")
                self._endpoint = endpoint_of(job["url"]) if job else ""
                self._apply([rec for _, rec in logged])
                db.execute("INSERT OR REPLACE INTO meta VALUES ('applied', ?)",
                           (str(logged[-1][0]),))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            log.warning("applied %s records of the last run from %s (its writing process "
                        "ended before it had)", f"{len(logged):,}", INTENTS)
            self._run, self._endpoint = None, ""
        return max(applied, logged[-1][0] if logged else 0)

    def _close_crashed_run(self) -> None:
        """If the last run ended without its ``end`` record, what it had sent without an outcome
        is in doubt (possibly billed)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        _close_open_intents(db)
        db.execute("COMMIT")

    # -- the Store interface: a run's reads ----------------------------------------------------

    async def claim_identity(self, identity: dict[str, Any]) -> dict[str, Any] | None:
        """The job's identity (the directory's lock keeps a second run out: nothing to claim;
        the run's own record sets it)."""
        return self.job

    async def lookup(self, ids: Sequence[str]) -> dict[str, str]:
        return await _off_loop(self._lookup, list(ids))

    def _lookup(self, ids: list[str]) -> dict[str, str]:
        with self._reading():
            return _states(self._reader or self._db, ids)

    async def unusable(self, ids: Sequence[str]) -> dict[str, Bought]:
        return await _off_loop(self._unusable, list(ids))

    def _unusable(self, ids: list[str]) -> dict[str, Bought]:
        if self._version < 5:  # (no count kept)
            return {}
        with self._reading():
            return {row[0]: Bought(*row[1:]) for row in (self._reader or self._db).execute(
                "SELECT id, unusable, status, error, coalesce(tries, 0) FROM items WHERE "
                "unusable > 0 AND id IN (SELECT value FROM json_each(?))",
                (orjson.dumps(ids).decode(),))}

    async def admit(self, ids: Sequence[str]) -> tuple[list[tuple[str, str | None, int]], int]:
        """Of a chunk of this run's IDs, those it has not seen before, in order, with their
        state and their paid answers that could not be used; and how many were duplicates."""
        return await _off_loop(self._admit, list(ids))

    def _admit(self, ids: list[str]) -> tuple[list[tuple[str, str | None, int]], int]:
        db = self._reader
        assert db is not None, "admit() needs a store opened for a run"
        chunk = orjson.dumps(ids).decode()
        with self._reading():  # (the new ones and their states as one JSON object: one step
            #                     of SQLite, not one a row, each giving the GIL back and
            #                     taking it again)
            new: dict[str, str | list[Any] | None] = orjson.loads(db.execute(
                "SELECT json_group_object(j.value, CASE WHEN i.unusable > 0 THEN "
                "json_array(i.state, i.unusable) ELSE i.state END) FROM json_each(?) j "
                "LEFT JOIN items i ON i.id = j.value AND (i.state IS NOT NULL OR i.unusable > 0) "
                "WHERE j.value NOT IN (SELECT id FROM seen)", (chunk,)).fetchone()[0])
            db.execute("INSERT INTO seen (id) SELECT value FROM json_each(?) WHERE true "
                       "ON CONFLICT DO NOTHING", (chunk,))
        fresh, dups, taken = [], 0, set()
        for item in ids:
            if item in new and item not in taken:
                taken.add(item)
                fresh.append(item)
            else:
                dups += 1
        return [(item, *_state_and_bought(new[item])) for item in fresh], dups

    async def run_counts(self, *, whole: bool = False) -> Counts:
        """This run's IDs (every one ``admit`` took) by their state now; ``whole``: every ID
        of the job (a run that read its one IDs file on from the frontier) plus those."""
        return await _off_loop(self._run_counts, whole)

    def _run_counts(self, whole: bool) -> Counts:
        db = self._reader
        assert db is not None
        with self._reading():
            if whole:  # the tally, the open rows (an index), and what has no row yet
                rows = db.execute(
                    "SELECT state, n FROM tally UNION ALL "
                    f"SELECT NULL, count(*) FROM items WHERE {OPEN} AND state IS NULL UNION ALL "
                    "SELECT NULL, count(*) FROM temp.seen AS s WHERE NOT EXISTS "
                    "(SELECT 1 FROM items AS i WHERE i.id = s.id)").fetchall()
            else:
                rows = db.execute("SELECT i.state, count(*) FROM temp.seen AS s LEFT JOIN "
                                  "items AS i ON i.id = s.id GROUP BY i.state").fetchall()
        by: Counter[str | None] = Counter()
        for state, n in rows:
            by[state] += n
        return Counts(ok=by.get("ok", 0), failed=by.get("failed", 0) + by.get("perm", 0),
                      unavailable=by.get("unavailable", 0), pending=by.get(None, 0))

    def resume_point(self, source: dict[str, Any]) -> dict[str, int] | None:
        """Where a run of ``source`` may read on, if every run of the job read that very file,
        unchanged: the frontier ``{offset, line, unique, dups}``; else ``None``."""
        was = self._meta_json("source")
        if not _same_file(was, source):
            return None
        frontier: dict[str, int] | None = self._meta_json("frontier")
        return frontier

    def source_lines(self, source: dict[str, Any]) -> int | None:
        """The number of IDs of ``source`` as counted (and checked) when a run first read it,
        if it is the job's one IDs file and unchanged since."""
        was = self._meta_json("source")
        return was.get("lines") if _same_file(was, source) else None

    async def failures(self, after: str = "") -> list[tuple[str, bool, int | None, str | None,
                                                           int, int]]:
        """Of this run's IDs (every one ``admit`` took), those failed now, in order of their
        IDs past ``after``, ``CHUNK`` at most: ``(id, permanent, status, error, tries,
        unusable)`` (pass 2's IDs, read from the state: memory does not grow with them)."""
        return await _off_loop(self._failures, after)

    def _failures(self, after: str) -> list[tuple[str, bool, int | None, str | None, int, int]]:
        db = self._reader
        assert db is not None, "failures() needs a store opened for a run"
        with self._reading():
            return [(item, state == "perm", status, error, tries or 0, unusable or 0)
                    for item, state, status, error, tries, unusable in db.execute(
                        "SELECT s.id, i.state, i.status, i.error, i.tries, i.unusable FROM "
                        "temp.seen AS s JOIN items AS i ON i.id = s.id WHERE s.id > ? AND "
                        "i.state IN ('failed', 'perm') ORDER BY s.id LIMIT ?", (after, CHUNK))]

    def unsettled(self) -> Iterator[list[str]]:
        """The IDs the state holds unsettled (failed, or sent without a result), from the
        ``items_open`` index, a block at a time."""
        with self._reading():
            cur = (self._reader or self._db).execute(f"SELECT id FROM items WHERE {OPEN}")
            while rows := cur.fetchmany(CHUNK):
                yield [row[0] for row in rows]

    # -- the Store interface: writing --------------------------------------------------------

    def commit(self, records: Sequence[Record]) -> frozenset[str]:
        """One transaction for the batch: durable (WAL fsync) when this returns. One process
        owns the state: no intent is refused. (A run with a writing process hands its
        batches to it from the event loop instead: ``writer.ProcessWriter``; this waits for
        its answer.)"""
        if self.process is not None:
            self.process.commit(records)
        else:
            self.apply_batch(records)
        return frozenset()

    def _check_file(self) -> None:
        """Raise if state.db has been deleted (its state directory removed mid-run: the run
        wrote on into the deleted file, paid for every ID and said done). An fstat a batch
        (~1 µs); a directory moved or renamed is still the same file."""
        if self._file < 0:
            try:
                self._file = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # (the writer's connection has it open: deleted since)
                pass
            except OSError:
                return  # (the commit says what is wrong)
        if self._file < 0 or os.fstat(self._file).st_nlink == 0:
            self._dead = True
            raise StorageError(
                "the state database was deleted while the run went on (its state directory "
                "removed?): what the run recorded went with it, and nothing more is written",
                path=self.path)

    def apply_batch(self, records: Sequence[Record], seq: int | None = None) -> None:
        """Apply the batch in one transaction (in the writing process: with ``seq``, the
        number of its last batch, recorded as 'applied')."""
        if self._dead:
            raise StorageError("the state database failed earlier; nothing more is written",
                               path=self.path)
        self._check_file()
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                self._apply(records)
                if seq is not None:
                    db.execute("INSERT OR REPLACE INTO meta VALUES ('applied', ?)", (str(seq),))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            self._dead = True
            raise _storage_error(e, self.path, "write the state database") from None

    def _apply(self, records: Sequence[Record]) -> None:
        """The one place where records become state. Within a run, an ID's ``sent`` record
        always precedes its outcome in an earlier batch (the intent is committed before the
        request leaves), so a run's records are applied grouped by kind, one statement per
        group; ``halt`` and ``end`` after the rest, and a ``run`` record (an imported journal
        holds many) after everything before it; a batch where an intent follows its ID's
        outcome (across passes) is applied in parts (``records.in_order_parts``)."""
        for part in in_order_parts(records):
            self._apply_grouped(part)

    def _apply_grouped(self, records: Sequence[Record]) -> None:
        groups = _Groups(self._day[1])
        day = self._day  # (days since the epoch, its UTC date, when it starts, when it ends)
        for rec in records:
            kind, ts = rec.kind, rec.ts
            if not day[2] <= ts < day[3]:  # another UTC date (computed once a day)
                days = int(ts // 86400)
                day = self._day = (days, utc_day(ts), days * 86400.0, (days + 1) * 86400.0)
                groups.count_calls(self._endpoint, day[1])
            if kind == "sent":
                groups.sent.append(rec.id)
                groups.calls += 1
                if rec.key is not None:
                    groups.keys[(day[1], rec.key, "sent")] += 1
            elif kind in OUTCOME_KINDS:
                groups.outcomes.append((rec.id, state_of(kind, rec.permanent), rec.status,
                                        rec.error, rec.pass_no, rec.tries, rec.paid, ts,
                                        rec.stored_payload() if kind == "ok" else None))
            elif kind == "billed":
                groups.billed.append((rec.paid, rec.id))
            elif kind in _COUNTED:  # answered, unusable
                groups.counted[kind].append((rec.id,))
            elif kind == "run":
                self._flush(groups)
                groups = _Groups(day[1])
                self._start_run(rec)
            elif kind == "unsent":  # (after its intent, before a later one: in order)
                self._flush(groups)
                groups = _Groups(day[1])
                self._unsend(rec)
            else:
                groups.last.append(rec)
            if rec.paid:
                groups.billable += rec.paid
                if rec.key is not None or rec.extra:
                    for key, n in rec.paid_keys().items():
                        groups.keys[(day[1], key, "billable")] += n
        self._flush(groups)

    def _flush(self, g: _Groups) -> None:
        """One statement per group (multi-row VALUES, or the intents' IDs as a JSON array):
        SQLite does the rows in one call that runs without the GIL, instead of giving it back
        and taking it again for every row."""
        g.count_calls(self._endpoint, g.day)
        if g.sent:
            ids = orjson.dumps(g.sent).decode()
            if "\\u0000" not in ids:
                self._db.execute(UPSERT_SENT, (self._run, ids))
            else:
                _many(self._db, UPSERT_SENT_ROWS, [(item, self._run, 1) for item in g.sent])
        if g.outcomes:
            _many(self._db, UPSERT_OUTCOME, self._store_payloads(g.outcomes))
        if g.billed:
            self._db.executemany("UPDATE items SET paid = paid + ? WHERE id = ?", g.billed)
        for kind, rows in g.counted.items():
            if rows:
                self._db.executemany(_COUNTED[kind], rows)
        if g.ledger:
            _many(self._db, ADD_LEDGER, call_rows(g.ledger))
        if g.keys:
            _many(self._db, ADD_KEY_LEDGER, call_rows(g.keys))
        for rec in g.last:
            self._end_run(rec)

    def _store_payloads(self, outcomes: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The outcome rows, each ok payload stored apart: rows of ``payloads`` (appended,
        so its pages fill to the brim, where a payload written into its item's row, which
        the intent made small, split pages and left them half empty: 202 bytes an ID beyond
        a 995-byte payload, now about half that), in pieces that fill the pages
        (``_cut``), and the item row holding the number of the first and how many.
        Only an ID's first ok keeps its payload: none is stored for one the ID already has."""
        db = self._db
        want = [row[0] for row in outcomes if row[8] is not None]
        if not want:
            return [(*row[:8], None, None) for row in outcomes]
        done = {item for item, state in _states(db, want).items() if state == "ok"}
        if self._next_payload is None:
            self._next_payload = db.execute(
                "SELECT coalesce(max(id), 0) + 1 FROM payloads").fetchone()[0]
        n = self._next_payload
        rows: list[tuple[Any, ...]] = []
        stored: list[tuple[int, bytes]] = []
        page = self._page
        number = _varint_len(n + 16 * len(outcomes))  # the most this batch's row numbers take
        for row in outcomes:
            data = row[8]
            if data is None or row[0] in done:
                rows.append((*row[:8], None, None))
                continue
            done.add(row[0])
            cut = _cut(len(data), page, number)
            at = 0
            for piece in cut:  # (one piece: data[0:len] is data itself, not a copy)
                stored.append((n, data[at:at + piece]))
                at += piece
                n += 1
            rows.append((*row[:8], n - len(cut), len(cut)))
        if stored:
            _many(db, "INSERT INTO payloads (id, data) VALUES {values}", stored)
        self._next_payload = n
        return rows

    def _start_run(self, rec: Record) -> None:
        _close_open_intents(self._db)  # (a no-op but in an imported journal's crashed runs)
        extra = rec.extra or {}
        self._note_source(extra.get("source"))
        job = extra.get("job")
        cur = self._db.execute(
            "INSERT INTO runs (started, pid, version, job) VALUES (?, ?, ?, ?)",
            (rec.ts, extra.get("pid"), extra.get("version"),
             orjson.dumps(job).decode() if job is not None else None))
        self._run = cur.lastrowid
        if job is not None:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('job', ?)",
                             (orjson.dumps(job).decode(),))
            self._endpoint = endpoint_of(job["url"])

    def _note_source(self, source: dict[str, Any] | None) -> None:
        """Keep the IDs file every run of the job has read, while it is one and the same file,
        unchanged; anything else (another file, a changed one, IDs from a library iterable)
        makes it "mixed", which ends the shortcut of reading on from a frontier for good."""
        was = self._meta_json("source")
        self._frontier_ok = was != "mixed" and source is not None and (
            was is None or _same_file(was, source))
        if was == "mixed":
            return
        if not self._frontier_ok:
            self._db.execute("DELETE FROM meta WHERE key = 'frontier'")
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('source', ?)",
                         (orjson.dumps(source if self._frontier_ok else "mixed").decode(),))

    def _unsend(self, rec: Record) -> None:
        """An intent of this run whose request did not leave: its call is taken back (the
        item's ``sends``, the ledgers' ``sent`` of the intent's day), and it is no longer
        open, unless an earlier request for the ID left in this run (``permanent``)."""
        db = self._db
        if db.execute("UPDATE items SET sends = sends - 1, sent_run = iif(?, sent_run, NULL) "
                      "WHERE id = ? AND sent_run = ? AND sends > 0",
                      (rec.permanent, rec.id, self._run)).rowcount:
            day = utc_day(rec.ts)
            db.execute("UPDATE ledger SET sent = sent - 1 WHERE day = ? AND endpoint = ? AND "
                       "sent > 0", (day, self._endpoint))
            if rec.key is not None:
                db.execute("UPDATE key_ledger SET sent = sent - 1 WHERE day = ? AND key = ? "
                           "AND sent > 0", (day, rec.key))

    def _end_run(self, rec: Record) -> None:
        db = self._db
        if rec.kind == "mark":
            if not self._frontier_ok:
                return
            db.execute("INSERT OR REPLACE INTO meta VALUES ('frontier', ?)",
                       (orjson.dumps((rec.extra or {})["frontier"]).decode(),))
        elif rec.kind == "unanswered":  # (after the ID's outcome, if the batch holds it)
            db.execute("UPDATE items SET doubt = iif(state = 'ok', 3, 2) WHERE id = ? AND "
                       "doubt IS NULL", (rec.id,))
        elif rec.kind == "halt":
            db.execute("UPDATE runs SET halt_reason = ?, halt_status = ?, halt_message = ? "
                       "WHERE run = ?", ((rec.extra or {}).get("reason"), rec.status, rec.error,
                                         self._run))
        elif rec.kind == "end":
            extra = rec.extra or {}
            db.executemany(f"UPDATE items SET doubt = 0 WHERE id = ? AND {NOT_IN_DOUBT}",
                           [(item,) for item in extra.get("in_doubt", ())])
            db.execute(f"UPDATE items SET sent_run = NULL WHERE {OPEN} AND sent_run IS NOT NULL")
            db.execute("UPDATE runs SET ended = ?, error = ? WHERE run = ?",
                       (rec.ts, extra.get("error"), self._run))

    # -- the Store interface: figures and streams ---------------------------------------------

    def snapshot(self) -> Snapshot:
        db = self._db
        running = lock_holder(self.state_dir) if self._lock_fd < 0 else os.getpid()
        with self._reading():
            tally = dict(db.execute("SELECT state, n FROM tally"))
            ledger = []
            sent = 0
            for day, endpoint, n_sent, n_billable in db.execute(
                    "SELECT day, endpoint, sent, billable FROM ledger ORDER BY day, endpoint"):
                sent += n_sent
                if n_billable:
                    ledger.append((day, endpoint, n_billable))
            keys = ()
            if self._version >= 2:
                keys = tuple(db.execute("SELECT day, key, sent, billable FROM key_ledger "
                                        "ORDER BY day, key"))
            doubt: dict[int, int] = {}  # IDs by doubt
            unsure = 0  # (their calls with no answer known)
            lost = "max(sends - paid - answered, 0)" if self._version >= 5 else \
                "max(sends - paid, 0)"  # (schema 4 and before: any call not billed)
            for value, n, calls in db.execute(f"SELECT doubt, count(*), sum({lost}) FROM items "
                                              "WHERE doubt IS NOT NULL GROUP BY doubt"):
                doubt[value], unsure = n, unsure + (calls or 0)
            # the calls of the open intents not in doubt: in flight, or answered and to be
            # tried again (schema 4 and before: one each)
            calls_open = f"coalesce(sum(min({lost}, 1)) FILTER (WHERE doubt IS NULL), 0)" \
                if self._version >= 5 else "count(*) FILTER (WHERE doubt IS NULL)"
            open_doubt = f"count(*) FILTER (WHERE {UNANSWERED_CALL})" if self._version >= 5 \
                else "count(*)"  # (of a crashed run's: in doubt)
            open_sent, open_unanswered, open_lost, open_doubtful = db.execute(
                f"SELECT count(*), count(*) FILTER (WHERE doubt = 2), {calls_open}, {open_doubt} "
                f"FROM items WHERE {OPEN} AND sent_run IS NOT NULL AND {NOT_IN_DOUBT}").fetchone()
            runs, = db.execute("SELECT count(*) FROM runs").fetchone()
            ids = self._unapplied_intents()
            unapplied, logged_unanswered = len(ids), 0
            if ids:  # (an unanswered ID whose next intent the log alone holds)
                logged_unanswered = db.execute(
                    "SELECT count(*) FROM items WHERE doubt = 2 AND sent_run IS NULL AND id IN "
                    "(SELECT value FROM json_each(?))", (orjson.dumps(ids).decode(),)).fetchone()[0]
            last = db.execute("SELECT halt_reason, halt_status, halt_message, ended FROM runs "
                              "ORDER BY run DESC LIMIT 1").fetchone()
        halt = Halt(last[0], last[1], last[2] or "") if last and last[0] else None
        counts = Counts(ok=tally.get("ok", 0), failed=tally.get("failed", 0) + tally.get("perm", 0),
                        unavailable=tally.get("unavailable", 0))
        open_sent += unapplied
        crashed = running is None  # (its open intents: in doubt, unanswered or not)
        return Snapshot(counts=counts, sent=sent + unapplied,
                        in_doubt=doubt.get(0, 0) + (open_doubtful + unapplied if crashed else 0),
                        billed_twice=doubt.get(1, 0),
                        in_flight=open_sent if not crashed else 0, runs=runs, halt=halt,
                        job=self.job, running=running, ledger=tuple(ledger), keys=keys,
                        unanswered=doubt.get(2, 0) - (open_unanswered + logged_unanswered
                                                      if crashed else 0),
                        unanswered_refetched=doubt.get(3, 0),
                        unsure_calls=unsure + open_lost + unapplied,
                        cut_short=bool(last) and last[3] is None and crashed)

    @contextlib.contextmanager
    def _with_payloads(self, columns: str, where: str,
                       params: Sequence[Any] = ()) -> Iterator[sqlite3.Cursor]:
        """``SELECT {columns}, <the payload> FROM items i ... WHERE {where} ORDER BY i.rowid``,
        in one read transaction with the schema version it is written for: a payload is in
        ``payloads``, in one row or in pieces, or in its item's row in a database of schema 2
        or before, upgraded or not, and a run may upgrade the database while this reader is
        open (a query of the version before would read the first piece of a payload alone)."""
        db = self._db
        with self._reading():
            # (a run's own store: its writer upgraded the database, and writes on it)
            own = self._lock_fd < 0 and not db.in_transaction
            if own:
                db.execute("BEGIN")
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0] if own \
                    else self._version
                data = (f"CAST({_payload_sql('i', 'p')} AS BLOB)" if version >= 4 else
                        "coalesce(p.data, i.data)" if version >= 3 else "i.data")
                join = "LEFT JOIN payloads p ON p.id = i.payload" if version >= 3 else ""
                yield db.execute(f"SELECT {columns}, {data} FROM items i {join} WHERE {where} "
                                 "ORDER BY i.rowid", params)
            finally:
                if own:
                    with contextlib.suppress(sqlite3.ProgrammingError):  # closed since
                        db.execute("COMMIT")

    def records(self, outcome: str) -> Iterator[Record]:
        want = EXPORT_STATES[outcome]
        with self._with_payloads(
                "i.id, i.state, i.status, i.error, i.pass, i.tries, i.paid, i.fetched_at",
                f"i.state IN ({','.join('?' * len(want))})", want) as rows:
            make = tuple.__new__  # (Record's keyword constructor costs more than the row)
            for item, state, status, error, pass_no, tries, paid, ts, data in rows:
                yield make(Record, ("failed" if state == "perm" else state, item, status, error,
                                    state == "perm", None, pass_no or 1, tries or 0, paid,
                                    ts or 0.0, None, data, None))

    def ids(self, outcome: str) -> Iterator[list[str]]:
        """The IDs of ``records(outcome)``, in the same order, a block at a time."""
        want = EXPORT_STATES[outcome]
        with self._reading():
            cur = self._db.execute(f"SELECT id FROM items WHERE state IN ({','.join('?' * len(want))}) "
                                   "ORDER BY rowid", want)
            while rows := cur.fetchmany(4096):
                yield [row[0] for row in rows]

    def payloads(self) -> Iterator[tuple[str, bytes | None]]:
        with self._with_payloads("i.id", "i.state = 'ok'") as rows:
            yield from rows

    def _held(self) -> bool:
        """Whether a run holds the state directory (this store's, or another process's)."""
        return self._lock_fd >= 0 or lock_holder(self.state_dir) is not None

    def in_doubt(self) -> Iterator[tuple[str, bool]]:
        running = self._held()
        query = "SELECT id, doubt FROM items WHERE doubt IN (0, 1)"
        if not running:  # a crashed run's open intents, not yet closed by a new run
            query += f" OR ({self._crashed_open})"
        with self._reading():
            for item, doubt in self._db.execute(query + " ORDER BY rowid"):
                yield item, doubt == 1
            if not running:
                for item in self._unapplied_intents():
                    yield item, False

    def unanswered(self) -> Iterator[tuple[str, bool]]:
        running = self._held()
        query = "SELECT id, doubt FROM items WHERE doubt IN (2, 3)"
        if not running:  # (a crashed run's open intents are in doubt instead)
            query += f" AND NOT ({self._crashed_open})"
        with self._reading():
            cut = set() if running else set(self._unapplied_intents())  # (in doubt instead)
            for item, doubt in self._db.execute(query + " ORDER BY rowid"):
                if item not in cut:
                    yield item, doubt == 3

    @property
    def _crashed_open(self) -> str:
        """A crashed run's open intents that are in doubt (before schema 5: all)."""
        return f"{OPEN} AND sent_run IS NOT NULL" + (
            f" AND {UNANSWERED_CALL}" if self._version >= 5 else "")

    def _unapplied_intents(self) -> list[str]:
        """The IDs whose ``sent`` intent ``intents.log`` holds beyond what the database has
        applied (the run's writing process ended first: a storage error, or a crash; the
        next run applies them), that the database does not list as open or in doubt already:
        sent, no outcome kept."""
        applied = int(self._meta_json("applied") or 0)
        ids = list(dict.fromkeys(str(rec.id) for _, rec in pending_records(self.state_dir,
                                                                             applied)
                                 if rec.kind == "sent"))
        if not ids:
            return []
        known = set(orjson.loads(self._db.execute(
            "SELECT json_group_array(id) FROM items WHERE id IN (SELECT value FROM json_each(?)) "
            f"AND (state IN ('ok', 'unavailable') OR ({self._crashed_open}) OR doubt IN (0, 1))",
            (orjson.dumps(ids).decode(),)).fetchone()[0]))
        return [item for item in ids if item not in known]

    async def close(self) -> None:
        """Close the store (its writing process applies what it holds and exits; the lock is
        released), to the end even if cancelled meanwhile (``tasks.in_thread``)."""
        from .tasks import in_thread

        await in_thread(self.close_sync)

    def close_sync(self) -> None:
        """``close``, blocking (in a thread)."""
        proc, self.process = self.process, None
        if proc is not None:  # (it applies what it holds, empties the log and exits)
            proc.close()
        for db in (self._reader, self._db):
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
        self._reader = None
        if self._file >= 0:
            os.close(self._file)
            self._file = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1


def _import_journal(d: Path) -> None:
    """A state directory of an earlier release: build ``state.db`` from its journal (next to it,
    renamed into place once complete: a crash or an error leaves no half-imported database),
    then keep the journal as ``journal.jsonl.imported``."""
    old = d / JOURNAL
    if not old.exists():
        return
    done = d / (JOURNAL + ".imported")
    if not (d / DB).exists():
        tmp = d / (DB + ".import")
        tmp.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))  # private, like the directory
        try:
            n = _build_from_journal(old, tmp)
            os.replace(tmp, d / DB)
            fsync_dir(d)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.warning("imported the journal %s (%s records) into the state database %s, once; "
                    "the journal is kept as %s", old, f"{n:,}", d / DB, done.name)
    elif not _imported(d / DB):
        raise StorageError(f"both {DB} and {JOURNAL} are here, and the database was not made "
                           f"from the journal: move one of them away", path=d)
    os.replace(old, done)
    fsync_dir(d)


def _create(path: Path) -> None:
    """A new, empty database at ``path``, schema included: made next to it and renamed into
    place, so that a reader never finds a database without its tables."""
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))  # private, like the directory
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        db.execute("PRAGMA journal_mode = DELETE")  # one file to rename (WAL from the first open)
        db.execute("PRAGMA synchronous = FULL")
        _ensure_schema(db, tmp)
    finally:
        db.close()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _imported(path: Path) -> bool:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT 1 FROM meta WHERE key = 'imported_journal'").fetchone() is not None
    finally:
        db.close()


def _build_from_journal(journal: Path, path: Path) -> int:
    """Replay the journal at ``journal`` into a new database at ``path``, in one transaction;
    return the number of records. ``StorageError`` (``JournalCorrupt``) for a damaged journal."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        db.execute("PRAGMA journal_mode = DELETE")
        db.execute("PRAGMA synchronous = FULL")
        _ensure_schema(db, path)
        store = SqliteStore(journal.parent, db)
        n = 0
        batch: list[Record] = []
        db.execute("BEGIN IMMEDIATE")
        for _, obj in scan(journal):
            batch.append(Record.decode(obj))
            if len(batch) >= 10_000:
                store._apply(batch)
                n += len(batch)
                batch = []
        store._apply(batch)
        n += len(batch)
        _close_open_intents(db)  # a last run that crashed
        db.execute("INSERT OR REPLACE INTO meta VALUES ('imported_journal', ?)",
                   (orjson.dumps({"records": n, "from": str(journal)}).decode(),))
        db.execute("COMMIT")
    except sqlite3.Error as e:
        raise _storage_error(e, path, "import the journal") from None
    finally:
        db.close()
    return n


class _Groups:
    """A batch's records by kind, as statement parameters (see ``SqliteStore._apply``), and
    the calls of its current UTC date (``day``), counted in two integers rather than a
    ``Counter`` update a record, and added to the ledger's rows by ``count_calls``."""

    __slots__ = ("billable", "billed", "calls", "counted", "day", "keys", "last", "ledger",
                 "outcomes", "sent")

    def __init__(self, day: str) -> None:
        self.sent: list[str | None] = []  # the IDs of the intents
        self.outcomes: list[tuple[Any, ...]] = []
        self.billed: list[tuple[int, str | None]] = []
        self.counted: dict[str, list[tuple[str | None]]] = {kind: [] for kind in _COUNTED}
        self.ledger: Counter[tuple[str, str, str]] = Counter()
        self.keys: Counter[tuple[str, str, str]] = Counter()  # (day, key fingerprint, what)
        self.last: list[Record] = []  # halt, end
        self.day, self.calls, self.billable = day, 0, 0

    def count_calls(self, endpoint: str, next_day: str) -> None:
        """Add the calls counted for ``day`` to the ledger's rows (of ``endpoint``), and count
        ``next_day``'s from zero."""
        if self.calls:
            self.ledger[(self.day, endpoint, "sent")] += self.calls
        if self.billable:
            self.ledger[(self.day, endpoint, "billable")] += self.billable
        self.day, self.calls, self.billable = next_day, 0, 0


ROWS_PER_STATEMENT = 256  # x at most 10 parameters: well below SQLite's limit of 32,766


@functools.lru_cache(maxsize=64)
def _sql(template: str, rows: int, width: int) -> str:
    row = "(" + ",".join("?" * width) + ")"
    return template.format(values=",".join([row] * rows))


def _many(db: sqlite3.Connection, template: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """Run ``template`` (``... VALUES {values} ...``) over ``rows``, many rows per statement."""
    width = len(rows[0])
    for i in range(0, len(rows), ROWS_PER_STATEMENT):
        part = rows[i:i + ROWS_PER_STATEMENT]
        db.execute(_sql(template, len(part), width), list(itertools.chain.from_iterable(part)))


@functools.lru_cache(maxsize=1 << 15)
def _cut(size: int, page: int, number: int = 3) -> tuple[int, ...]:
    """The sizes of the rows of ``payloads`` a payload of ``size`` bytes is stored in (row
    numbers of ``number`` bytes): of these, the one whose rows take the fewest bytes of the
    file, each row counted ``ROW_COST`` bytes more (a row costs the writer ~2 µs, and a
    reader as much again):

    * (under two pages) one row, or 2 to 16 pieces of one size, costed as ``_row_bytes``
      (``_even``); (from two pages on) one row;
    * a head that SQLite stores as its least part in the leaf page (~1 KB) and whole
      overflow pages, then the rest in pieces of one size no larger than that part, costed
      as a crawl appends them (``_packed``). (Not a head that fills a leaf page by itself:
      the next payload's head would not fit beside its tail, and each tail would keep a
      page to itself.)

    SQLite keeps a row whole in its leaf page while it fits, so a page holds a whole number
    of rows and the rest of it stays unused: a 3,000-B row two to a page left a quarter of
    each unused (1,192 bytes an ID beyond the payload); three pieces of 1,000 B leave 1 %."""
    best = (_even(size, page, number) if size < 2 * page else
            (_row_bytes(size, page, number) + ROW_COST, (size,)))
    most, least = _leaf_part(page)
    over = page - 4  # an overflow page's room
    head = least + (size + 5 - least) // over * over - 5  # a record of 5 header bytes + head
    if most < head + 5 and head < size:  # its rest: pieces no larger than its leaf part
        overflow, first = _cell(head, page, number)
        rest = size - head
        for n in range(-(-rest // least), -(-rest // least) + 4):
            step = -(-rest // n)
            cut = (head, *(step,) * (n - 1), rest - step * (n - 1))
            cells = [first, *(_cell(piece, page, number)[1] for piece in cut[1:])]
            cost = overflow * page + _packed(cells, page) + len(cut) * ROW_COST
            best = min(best, (cost, cut))
    return best[1]


def _packed(cells: list[int], page: int, payloads: int = 16) -> float:
    """Bytes of leaf pages a payload's cells take where a crawl appends payloads like it one
    after the other (SQLite starts a new page where the next cell does not fit)."""
    usable = page - 8
    pages, free = 1, usable
    for _ in range(payloads):
        for cell in cells:
            if cell > free:
                pages, free = pages + 1, usable
            free -= cell
    return (pages - free / usable) * page / payloads


@functools.lru_cache(maxsize=1 << 15)
def _even(size: int, page: int, number: int) -> tuple[float, tuple[int, ...]]:
    """Of one row and 2 to 16 pieces of one size, the cheapest for ``size`` bytes, and its
    cost (bytes of the file and ``ROW_COST`` a row)."""
    best: tuple[float, tuple[int, ...]] = (_row_bytes(size, page, number) + ROW_COST, (size,))
    for n in range(2, 17):
        step = -(-size // n)
        last = size - step * (n - 1)
        if last <= 0:
            break
        cost = ((n - 1) * _row_bytes(step, page, number) + _row_bytes(last, page, number)
                + n * ROW_COST)
        best = min(best, (cost, (step,) * (n - 1) + (last,)))
    return best


def _row_bytes(size: int, page: int, number: int) -> float:
    """Bytes of the file a row of ``payloads`` holding ``size`` bytes takes where every row is
    like it: its share of a leaf page and its overflow pages (``_cell``)."""
    overflow, cell = _cell(size, page, number)
    usable = page - 8  # a leaf page less its header
    return usable / (usable // cell) + overflow * page


def _cell(size: int, page: int, number: int) -> tuple[int, int]:
    """A row of ``payloads`` holding ``size`` bytes, its number taking ``number`` bytes, as
    SQLite lays it out: its overflow pages, and the bytes of its leaf page it takes (the cell:
    the record's length and the row's number, what of the record stays in the leaf page, the
    pointer to the first overflow page; and the page's pointer to the cell)."""
    record = size + 2 + _varint_len(2 * size + 12)  # header: its length, NULL (the row id), type
    most, least = _leaf_part(page)
    local, overflow = record, 0
    if record > most:
        local = least + (record - least) % (page - 4)
        if local > most:
            local = least
        overflow = -(-(record - local) // (page - 4))
    return overflow, _varint_len(record) + number + local + (4 if overflow else 0) + 2


def _leaf_part(page: int) -> tuple[int, int]:
    """The most of a record SQLite keeps whole in a table's leaf page, and the least it keeps
    there of one that overflows."""
    return page - 35, (page - 12) * 32 // 255 - 23


def _varint_len(n: int) -> int:
    """Bytes of SQLite's variable-length integer for ``n`` >= 0."""
    return next((k for k in range(1, 9) if n < 1 << 7 * k), 9)


def _states(db: sqlite3.Connection, ids: list[str]) -> dict[str, str]:
    """The state of each of ``ids`` that has one, as one JSON object: one step of SQLite (a
    row a step would give the GIL back and take it again for each, while the event loop
    needs it)."""
    if not ids:
        return {}
    found: dict[str, str] = orjson.loads(db.execute(
        "SELECT json_group_object(id, state) FROM items WHERE state IS NOT NULL "
        "AND id IN (SELECT value FROM json_each(?))", (orjson.dumps(ids).decode(),)).fetchone()[0])
    return found


def _state_and_bought(was: str | list[Any] | None) -> tuple[str | None, int]:
    """An ID's state and unusable paid answers, as ``_admit``'s query gives them (the state
    alone where it has none)."""
    if isinstance(was, list):
        return was[0], was[1]
    return was, 0


def _same_file(a: Any, b: dict[str, Any]) -> bool:
    keys: tuple[str, ...] = ("path", "size", "mtime_ns", "ctime_ns", "ino", "dev")
    if isinstance(a, dict) and "ctime_ns" not in a:  # (kept by a release before: no change
        keys = ("path", "size", "mtime_ns", "ino", "dev")  # time; not a change of the file)
    return isinstance(a, dict) and all(a.get(k) == b.get(k) for k in keys)


def _close_open_intents(db: sqlite3.Connection) -> None:
    """A crashed run's open intents: in doubt where a call has no answer known, closed."""
    db.execute(f"UPDATE items SET doubt = 0 WHERE {OPEN} AND sent_run IS NOT NULL AND "
               f"{NOT_IN_DOUBT} AND {UNANSWERED_CALL}")
    db.execute(f"UPDATE items SET sent_run = NULL WHERE {OPEN} AND sent_run IS NOT NULL")


def serve_writes(state_dir: Path, rfd: int, wfd: int) -> int:
    """The writing process's work for a run of ``state_dir`` (``sqlproc.serve``): apply the
    batches that ``rfd`` brings to ``state.db``, answer on ``wfd``; its exit code."""
    db = _connect(state_dir / DB)
    try:
        return serve(SqliteStore(state_dir, db).apply_batch, rfd, wfd, state_dir)
    finally:
        db.close()


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = FULL")  # a commit survives power loss: paid data
    db.execute("PRAGMA cache_size = -8000")  # 8 MB of page cache per connection (bounded RSS)
    return db


# what opening a WAL database read-only says where its index cannot be made
_NO_INDEX = (sqlite3.SQLITE_CANTOPEN, getattr(sqlite3, "SQLITE_READONLY_DIRECTORY", 1544))


def _read_only(path: Path, *, immutable: bool = False) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?mode=ro{'&immutable=1' if immutable else ''}", uri=True,
                         check_same_thread=False)
    try:
        db.execute("PRAGMA query_only = 1")
        db.execute("PRAGMA user_version").fetchone()
    except BaseException:
        db.close()
        raise
    return db


def _check_version(version: int, path: Path) -> None:
    if version == 0:  # (asyncrawl sets it with its first tables: an SQLite file of another's)
        raise StorageError("is not an asyncrawl state database (another program's SQLite "
                           "file?): give the state directory of an asyncrawl job, or a new "
                           "one", path=path)
    if version not in (SCHEMA_VERSION, *MIGRATIONS):
        raise StorageError(
            f"the state database has schema version {version}, written by an incompatible "
            f"asyncrawl version (this one uses {SCHEMA_VERSION}); use a new state directory or "
            "the matching asyncrawl version", path=path)


def _ensure_schema(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0 and not db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone():
        db.executescript("BEGIN IMMEDIATE;" + SCHEMA + f"PRAGMA user_version = {SCHEMA_VERSION};"
                         "COMMIT;")
        return
    _check_version(version, path)
    while version in MIGRATIONS:  # a database of an earlier release, brought up to date
        db.executescript(f"BEGIN IMMEDIATE;{MIGRATIONS[version]}"
                         f"PRAGMA user_version = {version + 1};COMMIT;")
        log.info("upgraded the state database %s from schema version %s to %s", path,
                 version, version + 1)
        version += 1
    # schema 5 as a development tree made it for a while (006720b): without items.unusable
    if not any(row[1] == "unusable" for row in db.execute("PRAGMA table_info(items)")):
        db.executescript("BEGIN IMMEDIATE;ALTER TABLE items ADD COLUMN unusable INTEGER NOT "
                         "NULL DEFAULT 0;COMMIT;")
        log.info("upgraded the state database %s: items.unusable added", path)


__all__ = ["DB", "STATE_FILES", "SqliteStore"]
