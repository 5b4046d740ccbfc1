"""[5] The state store of a job shared by many processes: PostgreSQL (a ``store.Store``).

``[state] url = "postgresql://user@host/db"`` and ``[state] job = "notes"``: one database holds
many jobs; any number of ``asyncrawl run`` processes, on any number of machines, work on one
job together. The job-queue pattern of pgqueuer and procrastinate:

* **merge**: a process given IDs adds them to the job in **blocks** of ``BLOCK`` IDs, a row
  each (``asyncrawl_blocks``: the IDs as one array, keyed by a digest of them), while
  fetching already runs. A block the job already has (the same file merged again, by this
  run or another) adds nothing. A block is durable and the job's the moment its row is
  committed: rows of 10,000 IDs go in at millions of IDs a second, where a row per ID, with
  the unique key that makes the merge idempotent, goes in at ~150,000 a second here;
* **take in**: a claim that finds too few open IDs expands the job's oldest block into item
  rows first (one ``INSERT … SELECT unnest(ids)``, in key order: plain while every ID taken
  in so far was new, ``ON CONFLICT DO NOTHING`` from the first that was not, such as an ID
  that another block or an earlier file had), so the per-ID cost is paid a block at a time,
  by whichever run needs IDs, while the job is being fetched;
* **claim**: a process takes a batch of open IDs with ``SELECT … FOR UPDATE SKIP LOCKED`` and
  holds them under a **lease** (``lease_until``, on the database's clock, so hosts' clocks do
  not matter); its heartbeat extends the leases of what it holds; a dead process's leases run
  out and its IDs are claimed again; if its ``sent`` intent had been committed, the ID is
  reported in doubt (possibly billed), exactly as on one machine (``doubt``:
  ``records.NOT_IN_DOUBT``);
* **job-wide signals**, read by every heartbeat (every ``HEARTBEAT`` s): a fatal halt
  (401/402) published by one process stops all of them; a pause (429 with Retry-After) holds
  all of them; each process takes ``1 / processes at work`` of the job's rate and burst (an
  idle one, waiting for work and holding none, is not counted).

Durability: each group commit is one transaction (PostgreSQL's ``synchronous_commit = on``: a
committed transaction is on disk). Tables (created on first use, in the connection's schema)::

    asyncrawl_jobs(job, identity, generation, halt_gen, halt, pause_until, rate_cut,
                   rate_cut_at, rate_cut_run, breaker_run, breaker_until, budget_gen,
                   budget_taken)
    asyncrawl_runs(run, job, generation, host, pid, version, started, heartbeat, merging,
                   ended, error, halt_reason, halt_status, halt_message, live)
    asyncrawl_items(job, id, state, status, error, pass, tries, paid, fetched_at, data,
                    generation, lease_owner, lease_until, sent_run, sends, doubt, answered,
                    unusable)
    asyncrawl_blocks(job, digest, seq, n, ids)                  IDs merged, a block a row;
                                                                 ``ids`` NULL once taken in
    asyncrawl_ledger(job, day, endpoint, run, sent, billable)   (a row per run: no two runs'
                                                                 commits wait for one row)
    asyncrawl_key_ledger(job, day, key, run, sent, billable)    the same per API key
                                                                 fingerprint ([request] keys)

A job's *generation* counts the times it was started with no process working on it: pass 1
of a generation takes the IDs without an outcome and those that failed in an earlier
generation; pass 2 takes what failed in this one, once no pass-1 work is left anywhere.

psycopg 3 (``pip install 'asyncrawl[postgres]'``): libpq's own connection handling (the URL,
``PG*`` environment variables, ``~/.pgpass``), COPY and arrays; its blocking calls run off the
event loop (the writer's thread, or ``asyncio.to_thread``), as the SQLite store's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

from .config import _userinfo, endpoint_of
from .errors import (
    ConfigError,
    RunEndedError,
    StorageError,
    password_params,
    require_extra,
    without_credentials,
)
from .records import (
    COUNTED,
    EXPORT_STATES,
    I_NOT_IN_DOUBT,
    NOT_IN_DOUBT,
    OUTCOME_KINDS,
    UNANSWERED_CALL,
    Bought,
    Counts,
    Record,
    Snapshot,
    call_rows,
    in_order_parts,
    utc_day,
)
from .tasks import in_thread
from .types import Halt

log = logging.getLogger("asyncrawl")
T = TypeVar("T")

LEASE = 30.0  # seconds a claim holds its IDs without a heartbeat
IDLE_IN_TRANSACTION = 10.0  # seconds before the server ends a run's transaction left idle
HEARTBEAT = 0.3  # seconds between heartbeats: leases, liveness, halts, pauses
# A connection whose server went silent (a network cut that drops packets, a host gone) fails
# in ~20 s instead of waiting for TCP to give up (~15 min sending, never when idle): probes
# after 5 s idle, every 2 s, 3 unanswered; data unacknowledged for 20 s (libpq's parameters)
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
             "keepalives_count": 3, "tcp_user_timeout": 20_000}
# columns added to tables of earlier releases (ALTER TABLE ... ADD COLUMN IF NOT EXISTS)
LATER_COLUMNS = (
    "asyncrawl_jobs.rate_cut", "asyncrawl_jobs.rate_cut_at", "asyncrawl_jobs.rate_cut_run",
    "asyncrawl_jobs.breaker_run", "asyncrawl_jobs.breaker_until", "asyncrawl_jobs.budget_gen",
    "asyncrawl_jobs.budget_taken", "asyncrawl_runs.live", "asyncrawl_runs.idle",
    "asyncrawl_items.answered", "asyncrawl_items.unusable")
RECENT_CUT = 60.0  # a run takes a cut of the job's rate published up to this long before it began
BREAKER_HOLD = 1.0  # seconds an open breaker holds the other runs, renewed at each heartbeat
ROLLED_BACK = frozenset({"40001", "40P01"})  # serialization failure, deadlock detected
COMMIT_TRIES = 3  # a commit that PostgreSQL rolls back (deadlock, serialization) is redone
LIVE = 3.0  # a run whose heartbeat is older than this is not counted as working
# The IDs of each pass of a generation: pass 1 those without an outcome and those that failed in
# an earlier generation; pass 2 those that failed in pass 1 of this one.
_PASS = {
    1: "(state IS NULL OR (state IN ('failed', 'perm') AND generation < %(gen)s))",
    2: "(state IN ('failed', 'perm') AND generation = %(gen)s AND pass = 1)",
}
# every table that holds a job's rows (a job is deleted from each, by its ``job`` column)
JOB_TABLES = ("asyncrawl_items", "asyncrawl_blocks", "asyncrawl_runs", "asyncrawl_ledger",
              "asyncrawl_key_ledger", "asyncrawl_jobs")
NOW = "extract(epoch from clock_timestamp())::float8"
# an item's ``sent_run`` is not a live run: it ended, or its heartbeat is older than ``LIVE``
_DEAD_RUN = (f"sent_run NOT IN (SELECT run FROM asyncrawl_runs WHERE job = %(job)s AND ended "
             f"IS NULL AND heartbeat > {NOW} - %(live)s)")
OPEN = "(state IS NULL OR state IN ('failed', 'perm'))"  # rows of the asyncrawl_items_open index
BLOCK = 10_000  # IDs in a block of a merge: a row of asyncrawl_blocks, taken in at once
TAKE_IN_FOR = 1.0  # seconds a claim may spend taking in blocks before it answers
SCHEMA_LOCK_WAIT = 10.0  # seconds the tables' upgrade waits for the runs that use them
# a claimed ID: (id, state, status, error, tries, its paid answers that could not be used)
Claimed = tuple[str, str | None, int | None, str | None, int, int]

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS asyncrawl_jobs (
    job text PRIMARY KEY, identity jsonb, generation integer NOT NULL DEFAULT 0,
    halt_gen integer, halt jsonb, pause_until double precision
);
ALTER TABLE asyncrawl_jobs ADD COLUMN IF NOT EXISTS rate_cut double precision,
    ADD COLUMN IF NOT EXISTS rate_cut_at double precision,
    ADD COLUMN IF NOT EXISTS rate_cut_run bigint,
    ADD COLUMN IF NOT EXISTS breaker_run bigint,
    ADD COLUMN IF NOT EXISTS breaker_until double precision,
    ADD COLUMN IF NOT EXISTS budget_gen integer,
    ADD COLUMN IF NOT EXISTS budget_taken bigint;
CREATE TABLE IF NOT EXISTS asyncrawl_runs (
    run bigserial PRIMARY KEY, job text NOT NULL, generation integer NOT NULL, host text,
    pid integer, version text, started double precision NOT NULL DEFAULT {NOW},
    heartbeat double precision NOT NULL DEFAULT {NOW}, merging boolean NOT NULL DEFAULT false,
    ended double precision, error text, halt_reason text, halt_status integer, halt_message text
);
ALTER TABLE asyncrawl_runs ADD COLUMN IF NOT EXISTS live jsonb,
    ADD COLUMN IF NOT EXISTS idle boolean NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS asyncrawl_runs_job ON asyncrawl_runs (job, ended);
CREATE TABLE IF NOT EXISTS asyncrawl_items (
    job text NOT NULL, id text NOT NULL, state text, status integer, error text,
    pass integer, tries integer, paid integer NOT NULL DEFAULT 0, fetched_at double precision,
    data bytea, generation integer NOT NULL DEFAULT 0, lease_owner bigint,
    lease_until double precision, sent_run bigint, sends integer NOT NULL DEFAULT 0,
    doubt integer, PRIMARY KEY (job, id)
);
DO $$ BEGIN  -- (an ID never cut off nor unanswered had an answer to each call but an open one)
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema =
                   current_schema() AND table_name = 'asyncrawl_items'
                   AND column_name = 'answered') THEN
        ALTER TABLE asyncrawl_items ADD COLUMN answered integer NOT NULL DEFAULT 0,
            ADD COLUMN unusable integer NOT NULL DEFAULT 0;
        UPDATE asyncrawl_items SET answered = sends - paid - (sent_run IS NOT NULL)::int
            WHERE doubt IS NULL AND sends > paid + (sent_run IS NOT NULL)::int;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS asyncrawl_items_open ON asyncrawl_items (job, lease_until)
    WHERE state IS NULL OR state IN ('failed', 'perm');
CREATE INDEX IF NOT EXISTS asyncrawl_items_state ON asyncrawl_items (job, state)
    WHERE state IS NOT NULL;
CREATE INDEX IF NOT EXISTS asyncrawl_items_doubt ON asyncrawl_items (job, doubt)
    WHERE doubt IS NOT NULL;
CREATE TABLE IF NOT EXISTS asyncrawl_blocks (
    job text NOT NULL, digest bytea NOT NULL, seq bigserial, n integer NOT NULL, ids text[],
    PRIMARY KEY (job, digest)
);
CREATE INDEX IF NOT EXISTS asyncrawl_blocks_open ON asyncrawl_blocks (job, seq)
    WHERE ids IS NOT NULL;
CREATE TABLE IF NOT EXISTS asyncrawl_ledger (
    job text NOT NULL, day text NOT NULL, endpoint text NOT NULL, run bigint NOT NULL,
    sent bigint NOT NULL DEFAULT 0, billable bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (job, day, endpoint, run)
);
CREATE TABLE IF NOT EXISTS asyncrawl_key_ledger (
    job text NOT NULL, day text NOT NULL, key text NOT NULL, run bigint NOT NULL,
    sent bigint NOT NULL DEFAULT 0, billable bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (job, day, key, run)
);
CREATE OR REPLACE VIEW asyncrawl_results AS
    SELECT job, id, CASE state WHEN 'perm' THEN 'failed' ELSE state END AS outcome, status,
           error, fetched_at, convert_from(data, 'UTF8') AS data
    FROM asyncrawl_items WHERE state IS NOT NULL;
"""

# An outcome: ok is final (the first ok is the ID's result; later ones add only their bill);
# it ends the ID's lease and its open "sent" intent. A failure in pass 1 leaves the ID to cool
# down (``lease_until``, leased to nobody: no claim takes it before), so that pass 2 never
# takes a failure before its cool-down, even one of a run that joined the job late.
UPSERT_OUTCOME = f"""
INSERT INTO asyncrawl_items AS i
    (job, id, state, status, error, pass, tries, paid, fetched_at, data, generation)
SELECT %(job)s, v.*, %(gen)s FROM unnest(%(id)s::text[], %(state)s::text[], %(status)s::int[],
    %(error)s::text[], %(pass)s::int[], %(tries)s::int[], %(paid)s::int[],
    %(ts)s::float8[], %(data)s::bytea[]) AS v
ON CONFLICT (job, id) DO UPDATE SET
    state = CASE WHEN i.state = 'ok' THEN 'ok' ELSE excluded.state END,
    status = CASE WHEN i.state = 'ok' THEN i.status ELSE excluded.status END,
    error = CASE WHEN i.state = 'ok' THEN i.error ELSE excluded.error END,
    pass = CASE WHEN i.state = 'ok' THEN i.pass ELSE excluded.pass END,
    tries = CASE WHEN i.state = 'ok' THEN i.tries ELSE excluded.tries END,
    fetched_at = CASE WHEN i.state = 'ok' THEN i.fetched_at ELSE excluded.fetched_at END,
    data = CASE WHEN i.state = 'ok' THEN i.data ELSE excluded.data END,
    generation = excluded.generation,
    paid = i.paid + excluded.paid,
    sent_run = CASE WHEN i.lease_owner IS DISTINCT FROM %(run)s AND i.lease_owner IS NOT NULL
                    THEN i.sent_run END,
    lease_owner = CASE WHEN i.lease_owner = %(run)s THEN NULL ELSE i.lease_owner END,
    lease_until = CASE WHEN i.lease_owner = %(run)s THEN
        CASE WHEN excluded.state IN ('failed', 'perm') AND excluded.pass = 1
                  AND i.state IS DISTINCT FROM 'ok' THEN {NOW} + %(cool)s END
        ELSE i.lease_until END,
    doubt = CASE WHEN i.doubt = 0 AND excluded.state = 'ok' AND i.sent_run IS NULL
                      AND i.sends = 1 THEN NULL
                 WHEN i.doubt IN (0, 2) AND excluded.state = 'ok' THEN i.doubt + 1
                 ELSE i.doubt END
"""
# (An ID in doubt because another run took it over while this run's request was out, whose
# answer now comes in, before any other request for it left: that answer is to the one request
# ever sent for it, so it was paid once, not possibly twice. It counted as billed twice.)
# An intent is fenced by the lease: it is written (and the request may leave) only while the
# ID is open (no ok, not unavailable) and this run's (leased to it, or leased to nobody and not
# cooling down: then the intent takes the lease). A run that stalled past its lease while
# another claimed the ID is refused: the ID is the other's to send (``RETURNING`` names those
# written; the rest were refused). The intent extends the lease, so that no claim takes the ID
# while its request is out. An intent over another run's open intent (kept as a safeguard)
# puts the ID in doubt.
UPSERT_SENT = f"""
INSERT INTO asyncrawl_items AS i (job, id, sent_run, sends, lease_owner, lease_until)
SELECT %(job)s, v.id, %(run)s, 1, %(run)s, {NOW} + %(lease)s
FROM unnest(%(id)s::text[]) AS v(id)
ON CONFLICT (job, id) DO UPDATE SET sent_run = excluded.sent_run, sends = i.sends + 1,
    lease_owner = excluded.lease_owner,
    lease_until = greatest(i.lease_until, excluded.lease_until),
    doubt = CASE WHEN i.sent_run <> excluded.sent_run AND {I_NOT_IN_DOUBT}
                 THEN 0 ELSE i.doubt END
WHERE (i.state IS NULL OR i.state IN ('failed', 'perm'))
    AND (i.lease_owner = %(run)s
         OR (i.lease_owner IS NULL AND (i.lease_until IS NULL OR i.lease_until < {NOW})))
RETURNING i.id
"""

# The take-in of a block (see ``PgStore._take_in``): the job's oldest block not taken in that no
# other run is taking in, its IDs inserted in key order, the block marked taken in; (blocks
# found, IDs new to the job).
TAKE_IN = """
WITH b AS (SELECT digest, ids FROM asyncrawl_blocks WHERE job = %(job)s AND ids IS NOT NULL
           ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED),
     added AS (INSERT INTO asyncrawl_items (job, id, generation)
               SELECT %(job)s, x, %(gen)s FROM b, unnest(b.ids) AS x ORDER BY x {conflict}
               RETURNING 1),
     taken AS (UPDATE asyncrawl_blocks SET ids = NULL
               WHERE job = %(job)s AND digest IN (SELECT digest FROM b) RETURNING 1)
SELECT (SELECT count(*) FROM taken), (SELECT count(*) FROM added)
"""


def _add_calls(table: str, what: str) -> str:
    """Add a batch's calls of this run to ``table`` (by endpoint, or by key)."""
    return (f"INSERT INTO {table} (job, day, {what}, run, sent, billable) "
            f"VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (job, day, {what}, run) DO UPDATE "
            f"SET sent = {table}.sent + excluded.sent, "
            f"billable = {table}.billable + excluded.billable")


ADD_LEDGER = _add_calls("asyncrawl_ledger", "endpoint")
ADD_KEY_LEDGER = _add_calls("asyncrawl_key_ledger", "key")


def _psycopg() -> Any:
    return require_extra("psycopg", "postgres", "a postgresql:// state")


class NoJob(ConfigError):
    """The database answers and holds no such job (the other ``ConfigError``s of a reader: a
    URL it cannot read, a server that refuses it)."""


def safe_url(url: str) -> str:
    """The URL without its password (for messages): of its userinfo, and a ``password=``
    parameter's."""
    head, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at:
        url = f"{head}{sep}{userinfo.split(':', 1)[0]}@{host}"
    return without_credentials(url)


def _scrubbed(text: str, url: str) -> str:
    """libpq's message without the password of ``url``: it quotes the URI it refuses, or the
    token of it that it cannot read (a password with a stray ``%``)."""
    forms = {form for password in (*_userinfo(url), *password_params(url))
             for form in (password, unquote(password)) if len(form) >= 3}
    text = without_credentials(text)
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, "***")
    return text


@dataclass(frozen=True, slots=True)
class JobSignal:
    """What a heartbeat learns of the job: a halt published since this run started, a pause
    (seconds left), how many runs are at work on it now (this one included; idle runs not),
    the latest cut of the job's rate by another run, and whether another run's breaker holds
    the job."""

    halt: Halt | None
    pause_for: float
    live: int
    rate_cut: tuple[float, float] | None = None  # another run's cut: (job-wide rate, when)
    hold_for: float = 0.0  # another run's breaker is open: seconds to hold new requests


class PgStore:
    """One job in a PostgreSQL database. ``PgStore.open`` for a run, ``PgStore.reader`` for
    ``status`` / ``export``."""

    shared = True  # many processes work on the job: the run claims its IDs from the store
    process = None  # (no writing process: the run's writer commits from its thread)

    def __init__(self, url: str, job: str, conns: dict[str, Any], lease: float = LEASE,
                 cooldown: float = 0.0) -> None:
        self.url = url
        self.lease = lease
        self.cooldown = cooldown  # seconds a failure of pass 1 waits before pass 2 may take it
        self.job_name = job
        self.location = f"{safe_url(url)} (job {job!r})"
        self._conns = conns  # "writer" (the writer's thread), "work" (claims), "control"
        self._run: int | None = None
        self._gen = 0
        self._take_in_plain = True  # every ID taken in so far was new to the job (see _take_in)
        self.taking_in = False  # the last claim stopped with blocks left to take in
        self._started = 0.0
        self._endpoint = ""
        self._dead = False
        self._day = (-1, "")
        self._refused: set[str] = set()  # IDs whose intent the commit under way refused
        self._locks = {name: threading.Lock() for name in conns}
        self._for_run = "writer" in conns  # (a run's connections, not a reader's)
        self._answered_kept = False  # (``_has_answered``)
        self._stale: set[str] = set()  # connections lost and not made again yet
        # a transaction's ID, and its status once its connection was lost (PostgreSQL 13+;
        # before: the txid_* functions)
        if conns and next(iter(conns.values())).info.server_version < 130000:
            self._xact_id, self._xact_status = ("SELECT txid_current()::text",
                                                "SELECT txid_status(%s::bigint)")
        else:
            self._xact_id, self._xact_status = ("SELECT pg_current_xact_id()::text",
                                                "SELECT pg_xact_status(%s::xid8)")
        self.job: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"<PgStore {self.location} run={self._run} gen={self._gen}>"

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    async def open(cls, url: str, job: str, lease: float = LEASE, cooldown: float = 0.0
                   ) -> PgStore:
        """Connect for a run and create the tables if needed (the run is registered by its
        ``run`` record). ``lease``: seconds a claim holds its IDs without a heartbeat;
        ``cooldown``: seconds before a failure of pass 1 may be claimed for pass 2."""
        return await asyncio.to_thread(cls._open_sync, url, job, True, lease, cooldown)

    @classmethod
    def reader(cls, url: str, job: str) -> PgStore:
        """Connect read-only (``ConfigError`` if the job does not exist)."""
        store = cls._open_sync(url, job, False)
        if store.job is None and not store._job_exists():
            with contextlib.suppress(Exception):
                store._close_sync()
            raise NoJob(f"no job {job!r} in {safe_url(url)}: nothing has run with it (check "
                              "--job / [state] job, and --state / [state] url)")
        return store

    @classmethod
    def _open_sync(cls, url: str, job: str, for_run: bool, lease: float = LEASE,
                   cooldown: float = 0.0) -> PgStore:
        psycopg = _psycopg()
        names = ("writer", "work", "control") if for_run else ("control", "work")
        conns: dict[str, Any] = {}
        try:
            for name in names:
                conns[name] = _connect(url, name, for_run)
            store = cls(url, job, conns, lease, cooldown)
            if for_run:
                store._ensure_schema()
            elif not store._schema_exists(columns=False):
                raise NoJob(f"no job {job!r} in {safe_url(url)}: no asyncrawl tables "
                                  "there (check --state / [state] url)")
            store.job = store._identity()
        except psycopg.Error as e:
            for c in conns.values():
                with contextlib.suppress(Exception):
                    c.close()
            malformed = _MALFORMED.search(str(e))
            if malformed:  # no rerun cures these (exit 2, not 5)
                raise ConfigError(f"{safe_url(url)} is no PostgreSQL URL libpq can read: "
                                  f"{_scrubbed(malformed.group(1), url)} (check --state / "
                                  "[state] url)") from None
            refusal = _refused(e)
            if refusal:  # a wrong name in the URL
                raise ConfigError(f"the PostgreSQL server at {safe_url(url)} refused the "
                                  f"connection: {_scrubbed(refusal, url)} (check the user, "
                                  "password and "
                                  "database in --state / [state] url)") from None
            raise _storage_error(e, url, "connect to the state database", run=for_run) from None
        return store

    def _schema_exists(self, *, columns: bool = True) -> bool:
        """Whether the tables, views and indexes are there (``columns``: and the columns that
        later releases added; a reader of an older schema does not need them)."""
        db = self._conns["control"]
        if columns and db.execute(
                "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
                "current_schema() AND table_name || '.' || column_name = ANY(%s)",
                (list(LATER_COLUMNS),)).fetchone()[0] != len(LATER_COLUMNS):
            return False
        names = ["asyncrawl_jobs", "asyncrawl_runs", "asyncrawl_items", "asyncrawl_ledger",
                 "asyncrawl_items_open", "asyncrawl_items_state", "asyncrawl_items_doubt",
                 "asyncrawl_runs_job", "asyncrawl_results"]
        if columns:  # added later: a reader of an older job does without
            names += ["asyncrawl_key_ledger", "asyncrawl_blocks", "asyncrawl_blocks_open"]
        row = self._conns["control"].execute(
            "SELECT bool_and(to_regclass(n) IS NOT NULL) FROM unnest(%s::text[]) AS n",
            (names,)).fetchone()
        return bool(row and row[0])

    def _ensure_schema(self) -> None:
        """Create what is missing. Only then: ``CREATE INDEX IF NOT EXISTS`` takes a lock that
        blocks writers even when the index exists, so it must not run at every open."""
        if self._schema_exists():
            return
        db = self._conns["control"]
        try:
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(hashtext('asyncrawl schema'))")
                # (an ALTER waits for every transaction on its table, and every statement on
                # it then waits behind the ALTER: runs of an earlier release would stall)
                db.execute(f"SET LOCAL lock_timeout = '{SCHEMA_LOCK_WAIT:g}s'")
                db.execute(SCHEMA)
        except _psycopg().errors.LockNotAvailable:
            raise StorageError(
                f"cannot upgrade the asyncrawl tables in {safe_url(self.url)}: they were busy "
                f"for {SCHEMA_LOCK_WAIT:g} s (a run of an earlier asyncrawl release on a job "
                "there?); rerun once it has ended") from None

    async def claim_identity(self, identity: dict[str, Any]) -> dict[str, Any] | None:
        """The job's identity as recorded, and ``identity`` recorded if there was none, in one
        statement: of two first runs with different configs, the second sees the first's."""
        return await asyncio.to_thread(self._claim_identity, identity)

    def _claim_identity(self, identity: dict[str, Any]) -> dict[str, Any] | None:
        with self._db("control", "read the job") as db:
            before = db.execute(
                "WITH old AS (SELECT identity FROM asyncrawl_jobs WHERE job = %s), "
                "ins AS (INSERT INTO asyncrawl_jobs (job, identity) VALUES (%s, %s) "
                "ON CONFLICT (job) DO UPDATE SET identity = excluded.identity "
                "WHERE asyncrawl_jobs.identity IS NULL RETURNING 1) "
                "SELECT (SELECT identity FROM old), (SELECT count(*) FROM ins)",
                (self.job_name, self.job_name, _jsonb(identity))).fetchone()
        old, inserted = before
        if inserted:
            return None  # this run's identity is the job's now
        # not inserted: the job has an identity; the CTE's snapshot may predate a concurrent
        # claim, so read it again
        with self._db("control", "read the job") as db:
            row = db.execute("SELECT identity FROM asyncrawl_jobs WHERE job = %s",
                             (self.job_name,)).fetchone()
        return row[0] if row else old

    def _identity(self) -> dict[str, Any] | None:
        row = self._conns["control"].execute(
            "SELECT identity FROM asyncrawl_jobs WHERE job = %s", (self.job_name,)).fetchone()
        return row[0] if row else None

    def _runs_alive(self, db: Any, within: float) -> int:
        """Runs of the job not ended whose last heartbeat is at most ``within`` s old."""
        return int(db.execute(f"SELECT count(*) FROM asyncrawl_runs WHERE job = %s AND ended IS "
                              f"NULL AND heartbeat > {NOW} - %s",
                              (self.job_name, within)).fetchone()[0])

    def _job_exists(self) -> bool:
        return self._conns["control"].execute(
            "SELECT 1 FROM asyncrawl_jobs WHERE job = %s", (self.job_name,)).fetchone() is not None

    @contextlib.contextmanager
    def _db(self, name: str, doing: str) -> Iterator[Any]:
        """A connection, used by one thread at a time; psycopg's errors as ``StorageError``.
        One the server closed (``IDLE_IN_TRANSACTION``: the process was stopped inside a
        transaction; or the server went away) is opened again first: what failed with it
        failed, what comes after goes on."""
        psycopg = _psycopg()
        with self._locks[name]:
            try:
                yield self._open(name)
            except psycopg.Error as e:
                self._lost_with(name, e)
                raise _storage_error(e, self.url, doing) from None

    def _reconnect(self, name: str) -> None:
        self._stale.add(name)  # (until a new connection is made: a failed connect is retried)
        with contextlib.suppress(Exception):
            self._conns[name].close()
        self._conns[name] = _connect(self.url, name, self._for_run)
        self._stale.discard(name)

    def _open(self, name: str) -> Any:
        """Connection ``name``, made again first if it was lost (``_lost``)."""
        if self._lost(name):
            self._reconnect(name)
        return self._conns[name]

    def _lost(self, name: str) -> bool:
        """The connection was lost (closed by the server, or not made again yet)."""
        return self._conns[name].broken or name in self._stale

    def _lost_with(self, name: str, e: Exception) -> bool:
        """Whether connection ``name`` was lost, ``e`` the error it gave. psycopg does not
        always mark a connection broken when the server has closed it (a statement sent down
        a socket the server closed after ``IDLE_IN_TRANSACTION``: "connection socket
        closed"): an error that says so (the server went away, or ended the session: 25P03, a
        transaction left idle past ``IDLE_IN_TRANSACTION``) marks it to be made again before
        its next use."""
        if _went_away(e) or getattr(e, "sqlstate", None) == "25P03":
            self._stale.add(name)
        return self._lost(name)

    # -- the shared job: runs, merges, claims, heartbeats --------------------------------------

    def _start_run(self, rec: Record) -> None:
        """Register the run (in the writer's transaction), and start a new generation of the
        job if no other run is working on it."""
        db = self._conns["writer"]
        extra = rec.extra or {}
        job = extra.get("job")
        db.execute("INSERT INTO asyncrawl_jobs (job, identity) VALUES (%s, %s) "
                   "ON CONFLICT (job) DO NOTHING", (self.job_name, _jsonb(job)))
        db.execute("SELECT 1 FROM asyncrawl_jobs WHERE job = %s FOR UPDATE", (self.job_name,))
        # A new generation only when no run has sent a heartbeat for a lease's time: a run
        # that merely stalled for a few seconds (a pause, a slow database) is still at work.
        working = self._runs_alive(db, self.lease)
        if not working:
            db.execute("UPDATE asyncrawl_jobs SET generation = generation + 1, pause_until = NULL "
                       "WHERE job = %s", (self.job_name,))
            # the intents of runs that died: in doubt (possibly billed)
            db.execute(f"UPDATE asyncrawl_items SET doubt = 0 WHERE job = %s AND {OPEN} "
                       f"AND sent_run IS NOT NULL AND {NOT_IN_DOUBT} AND {UNANSWERED_CALL}",
                       (self.job_name,))
            db.execute(f"UPDATE asyncrawl_items SET sent_run = NULL, lease_owner = NULL, "
                       f"lease_until = NULL WHERE job = %s AND (sent_run IS NOT NULL OR "
                       f"lease_owner IS NOT NULL) AND {OPEN} AND (lease_until IS NULL OR "
                       f"lease_until < {NOW})", (self.job_name,))
            # the cool-downs of the last generation's failures end: its pass 1 takes them now
            db.execute("UPDATE asyncrawl_items SET lease_until = NULL WHERE job = %s AND "
                       "lease_owner IS NULL AND lease_until IS NOT NULL AND state IN "
                       "('failed', 'perm')", (self.job_name,))
            db.execute("UPDATE asyncrawl_runs SET ended = heartbeat, error = 'died' "
                       "WHERE job = %s AND ended IS NULL", (self.job_name,))
        if job is not None and not working:  # (a run joining runs at work with --reuse-state
            # and another config leaves the job's as it is: a run of theirs, restarted, is not
            # refused as another job's)
            db.execute("UPDATE asyncrawl_jobs SET identity = %s WHERE job = %s",
                       (_jsonb(job), self.job_name))
        self._gen = db.execute("SELECT generation FROM asyncrawl_jobs WHERE job = %s",
                               (self.job_name,)).fetchone()[0]
        if extra.get("recheck"):  # the IDs confirmed unavailable in an earlier generation are
            db.execute("UPDATE asyncrawl_items SET state = 'failed' WHERE job = %s AND "  # failed
                       "state = 'unavailable' AND generation < %s",  # again: its pass 1's
                       (self.job_name, self._gen))
        # merging from the start: no other run takes the job for done between this run's
        # registration and its first IDs (its merge clears the flag when it is through)
        run, started = db.execute(
            "INSERT INTO asyncrawl_runs (job, generation, host, pid, version, merging) "
            "VALUES (%s, %s, %s, %s, %s, true) RETURNING run, started",
            (self.job_name, self._gen, socket.gethostname(), extra.get("pid"),
             extra.get("version"))).fetchone()
        self._run, self._started = run, started
        self._endpoint = endpoint_of((job or {}).get("url", ""))
        self.job = job

    async def merge(self, ids: Sequence[str]) -> int:
        """Add a chunk of IDs to the job, in blocks of ``BLOCK``; how many IDs were in blocks
        the job did not have (an ID already in the job is left as it is when its block is
        taken in, so this counts such IDs too)."""
        return await asyncio.to_thread(self._merge, list(ids))

    def _merge(self, ids: list[str]) -> int:
        """One transaction: the chunk's blocks that the job does not have yet, a row each (the
        IDs as one array, sent in binary: no per-ID statement, no per-ID index entry)."""
        blocks = [ids[i:i + BLOCK] for i in range(0, len(ids), BLOCK)]
        # in the digests' order: two runs merging the same blocks (a file, in another order)
        # lock them in one order, never in a cycle
        rows = sorted((self.job_name, _digest(block), len(block), block) for block in blocks)
        with self._db("work", "add IDs to the job") as db, db.transaction():
            added = 0
            for row in rows:  # (a statement each, not executemany's pipeline: the server's
                # idle-in-transaction timeout does not run while a pipeline is open)
                got = db.execute("INSERT INTO asyncrawl_blocks (job, digest, n, ids) "
                                 "VALUES (%s, %b, %b, %b) ON CONFLICT DO NOTHING RETURNING n",
                                 row).fetchone()
                added += got[0] if got else 0
            return added

    async def take_in(self) -> int:
        """Take in every block of the job not taken in yet (what claims do, a block at a time,
        when they find too few open IDs); how many IDs were new to the job."""
        def go() -> int:
            added = 0
            with self._db("work", "add IDs to the job") as db:
                while (n := self._take_in(db)) is not None:
                    added += n
            return added
        return await asyncio.to_thread(go)

    def _take_in(self, db: Any) -> int | None:
        """Expand the job's oldest block not yet taken in (and not being taken in by another
        run) into item rows: how many IDs were new to the job (``None``: no block to take in).

        One statement (``TAKE_IN``), committed by itself: a process that stops in the middle
        (SIGSTOP, a host gone) holds no block locked in an open transaction. While every ID
        taken in so far was new, a plain ``INSERT``: ~1.4 × as fast as ``ON CONFLICT DO
        NOTHING``, whose speculative insertion probes the primary key twice a row. The first ID
        the job already has (a rerun's file merged in other blocks, an ID in two blocks or
        twice in one) fails that statement as a whole, and this block and every later one go
        in with ``ON CONFLICT DO NOTHING``. Rows go in key order: two runs taking in blocks
        that share IDs wait for each other in one order, never in a cycle."""
        args = {"job": self.job_name, "gen": self._gen}
        row = None
        if self._take_in_plain:
            try:
                row = db.execute(TAKE_IN.format(conflict=""), args).fetchone()
            except _psycopg().errors.UniqueViolation:
                self._take_in_plain = False
        if row is None:
            row = db.execute(TAKE_IN.format(conflict="ON CONFLICT DO NOTHING"), args).fetchone()
        blocks, added = row
        return int(added) if blocks else None

    async def set_merging(self, merging: bool) -> None:
        """Say whether this run is still adding IDs (the job's pass 1 waits for every merge)."""
        def go() -> None:
            with self._db("control", "update the run") as db:
                db.execute("UPDATE asyncrawl_runs SET merging = %s WHERE run = %s",
                           (merging, self._run))
        await asyncio.to_thread(go)

    async def claim(self, pass_no: int, n: int) -> list[Claimed]:
        """Lease up to ``n`` IDs of the pass that nobody holds: ``(id, state, status, error,
        tries, unusable)``. An ID whose ``sent`` intent was committed by a run that is gone is in doubt
        from now on (possibly billed)."""
        return await asyncio.to_thread(self._claim, pass_no, n)

    def _claim(self, pass_no: int, n: int) -> list[Claimed]:
        """Claim up to ``n``; in pass 1, while that is not ``n``, take in a block of the job
        and claim the rest, for up to ``TAKE_IN_FOR`` seconds (blocks of IDs the job has
        settled already, a rerun's edited file, may take long: ``taking_in`` says the claim
        stopped with blocks left, to be asked again at once). A block another run is taking
        in is left to it: ``pass_left`` says there is work, and the run asks again."""
        self.taking_in = False
        with self._db("work", "claim IDs") as db:
            rows = self._claim_open(db, pass_no, n)
            until = time.monotonic() + TAKE_IN_FOR
            while pass_no == 1 and len(rows) < n:
                added = self._try_take_in(db)
                if added is None:
                    break
                more = self._claim_open(db, pass_no, n - len(rows))
                rows += more
                if added and not more:  # taken by other runs meanwhile, or this run ended
                    break
                if len(rows) < n and time.monotonic() >= until:
                    self.taking_in = True
                    break
        return rows

    def _try_take_in(self, db: Any) -> int | None:
        """``_take_in``; ``None`` if PostgreSQL rolled it back (a deadlock with another run:
        the block stays to be taken in at a later claim)."""
        try:
            return self._take_in(db)
        except _psycopg().Error as e:
            if e.sqlstate not in ROLLED_BACK:
                raise
            log.warning("taking IDs into the job was rolled back (SQLSTATE %s); it is done again "
                        "at a later claim", e.sqlstate)
            return None

    def _claim_open(self, db: Any, pass_no: int, n: int) -> list[Claimed]:
        """Lease up to ``n`` of the pass's item rows that nobody holds."""
        rows = db.execute(f"""
            UPDATE asyncrawl_items AS i SET lease_owner = %(run)s,
                lease_until = {NOW} + %(lease)s,
                doubt = CASE WHEN i.sent_run IS NOT NULL AND {I_NOT_IN_DOUBT}
                                  AND i.{UNANSWERED_CALL} THEN 0 ELSE i.doubt END,
                sent_run = NULL
            FROM (SELECT id FROM asyncrawl_items
                  WHERE job = %(job)s AND {_PASS[pass_no]}
                    AND (lease_until IS NULL OR lease_until < {NOW})
                    -- (a claim still on its way when its run ended takes nothing: it
                    -- waits for an end being committed, which waits for a claim first)
                    AND EXISTS (SELECT 1 FROM asyncrawl_runs
                                WHERE run = %(run)s AND ended IS NULL FOR SHARE)
                  LIMIT %(n)s FOR UPDATE SKIP LOCKED) AS c
            WHERE i.job = %(job)s AND i.id = c.id
            RETURNING i.id, i.state, i.status, i.error, coalesce(i.tries, 0), i.unusable""",
            {"run": self._run, "lease": self.lease, "job": self.job_name, "gen": self._gen,
             "n": n}).fetchall()
        return [tuple(r) for r in rows]

    async def pass_left(self, pass_no: int) -> bool:
        """Whether the pass has work anywhere but in this run's hands: IDs another run holds
        or may claim, a block of pass 1 not taken in yet, or a run still adding IDs."""
        return await asyncio.to_thread(self._pass_left, pass_no)

    def _pass_left(self, pass_no: int) -> bool:
        with self._db("work", "read the job") as db:
            row = db.execute(f"""
                SELECT EXISTS (SELECT 1 FROM asyncrawl_items WHERE job = %(job)s
                               AND {_PASS[pass_no]} AND lease_owner IS DISTINCT FROM %(run)s)
                    OR (%(pass)s = 1 AND EXISTS (SELECT 1 FROM asyncrawl_blocks
                                                 WHERE job = %(job)s AND ids IS NOT NULL))
                    OR EXISTS (SELECT 1 FROM asyncrawl_runs WHERE job = %(job)s
                               AND ended IS NULL AND merging AND heartbeat > {NOW} - %(live)s
                               AND run <> %(run)s)""",
                {"job": self.job_name, "gen": self._gen, "run": self._run, "pass": pass_no,
                 "live": LIVE}).fetchone()
        return bool(row[0])

    async def heartbeat(self, idle: bool = False) -> JobSignal:
        """Extend this run's leases and liveness, and say whether it is idle (it waits for work
        and holds none: it sends nothing, so it takes no share of the job's rate); read the
        job's halt, pause and the runs at work."""
        return await asyncio.to_thread(self._heartbeat, idle)

    def _heartbeat(self, idle: bool = False) -> JobSignal:
        with self._db("control", "send the heartbeat") as db:
            # Only leases half run out (the rows this run holds are not rewritten at every
            # beat), and only rows nobody has locked: a row the writer is settling at this
            # moment loses its lease anyway, and the heartbeat never waits for (or deadlocks
            # with) the writer's transaction.
            db.execute(f"""
                UPDATE asyncrawl_items AS i SET lease_until = {NOW} + %(lease)s
                FROM (SELECT id FROM asyncrawl_items WHERE job = %(job)s
                      AND lease_owner = %(run)s AND {OPEN} AND lease_until < {NOW} + %(half)s
                      FOR UPDATE SKIP LOCKED) AS held
                WHERE i.job = %(job)s AND i.id = held.id""",
                {"lease": self.lease, "job": self.job_name, "run": self._run,
                 "half": self.lease / 2})
            ended = db.execute(f"UPDATE asyncrawl_runs SET heartbeat = {NOW}, idle = %s "
                               "WHERE run = %s RETURNING ended", (idle, self._run)).fetchone()
            if ended is not None and ended[0] is not None:
                # held up past its lease while no other run was at work, it was taken for
                # dead by the next one: its claims come back empty, the job's halts are of
                # a generation that is not its own; it would wait for ever, or send outside
                # the job's share of the rate
                raise RunEndedError("this process was held up past its lease (a stopped VM, a "
                                   "long pause) and the job went on without it: its run was "
                                   "ended as dead; rerun to resume", path=safe_url(self.url))
            # the runs at work share the job's rate: an idle one (it waits, holds nothing) is
            # not counted, but by itself (if it is given work, it re-joins: ``Heartbeat``)
            (halt_gen, halt, pause_until, now, live, cut, cut_at, cut_run, breaker_run,
             breaker_until) = db.execute(f"""
                SELECT j.halt_gen, j.halt, j.pause_until, {NOW},
                       (SELECT count(*) FROM asyncrawl_runs r WHERE r.job = j.job
                        AND r.ended IS NULL AND r.heartbeat > {NOW} - %s
                        AND (NOT r.idle OR r.run = %s)),
                       j.rate_cut, j.rate_cut_at, j.rate_cut_run, j.breaker_run, j.breaker_until
                FROM asyncrawl_jobs j WHERE j.job = %s""",
                (LIVE, self._run, self.job_name)).fetchone()
        h = None
        if halt_gen == self._gen and halt and halt.get("run") != self._run \
                and halt.get("at", 0.0) >= self._started:
            h = Halt(halt.get("reason", "fatal"), halt.get("status"), halt.get("message", ""))
        rate_cut = None
        if cut is not None and cut_run != self._run and cut_at >= self._started - RECENT_CUT:
            rate_cut = (float(cut), float(cut_at))
        hold = 0.0
        if breaker_run is not None and breaker_run != self._run:
            hold = max(0.0, (breaker_until or 0.0) - now)
        return JobSignal(h, max(0.0, (pause_until or 0.0) - now), max(1, int(live)), rate_cut,
                         hold)

    async def publish_halt(self, halt: Halt) -> bool:
        """Halt every run of this generation of the job (they see it at their next
        heartbeat); ``False`` if another run's halt was published first (its alerts go). A
        halt published before this run started (which its heartbeat ignores: it was meant
        for the runs of that time) is replaced. Asking again gives the same answer (a call
        cut short by a cancellation is made again: its answer must not change)."""
        def go() -> bool:
            with self._db("control", "publish the halt") as db:
                cur = db.execute(
                    f"UPDATE asyncrawl_jobs SET halt_gen = %s, halt = %s || jsonb_build_object("
                    f"'at', {NOW}) WHERE job = %s AND (halt_gen IS DISTINCT FROM %s "
                    "OR coalesce((halt->>'at')::float8, 0) < %s)",
                    (self._gen, _jsonb({"reason": halt.reason, "status": halt.status,
                                        "message": halt.message, "run": self._run}),
                     self.job_name, self._gen, self._started))
                if cur.rowcount == 1:
                    return True
                row = db.execute("SELECT (halt->>'run')::bigint FROM asyncrawl_jobs "
                                 "WHERE job = %s", (self.job_name,)).fetchone()
                return row is not None and row[0] == self._run
        return await asyncio.to_thread(go)

    async def publish_pause(self, seconds: float) -> None:
        """Hold every run's new requests for ``seconds`` (extends, never shortens, a pause)."""
        def go() -> None:
            with self._db("control", "publish the pause") as db:
                db.execute(f"UPDATE asyncrawl_jobs SET pause_until = greatest(coalesce("
                           f"pause_until, 0), {NOW} + %s) WHERE job = %s",
                           (seconds, self.job_name))
        await asyncio.to_thread(go)

    async def publish_rate_cut(self, rate: float) -> None:
        """This run's adaptive rate cut the job's to ``rate`` (req/s, all runs together): every
        run takes its share of it at its next heartbeat."""
        def go() -> None:
            with self._db("control", "publish the rate") as db:
                db.execute(f"UPDATE asyncrawl_jobs SET rate_cut = %s, rate_cut_at = {NOW}, "
                           "rate_cut_run = %s WHERE job = %s", (rate, self._run, self.job_name))
        await asyncio.to_thread(go)

    async def grant_budget(self, want: int, limit: int) -> int:
        """Up to ``want`` billable calls for this run out of the job's budget of ``limit``
        per generation (``--max-requests`` of a shared job); how many it got."""
        def grant(db: Any) -> int:
            taken, gen = db.execute("SELECT budget_taken, budget_gen FROM asyncrawl_jobs "
                                    "WHERE job = %s FOR UPDATE", (self.job_name,)).fetchone()
            taken = (taken or 0) if gen == self._gen else 0
            got = max(0, min(want, limit - taken))
            db.execute("UPDATE asyncrawl_jobs SET budget_taken = %s, budget_gen = %s "
                       "WHERE job = %s", (taken + got, self._gen, self.job_name))
            return got
        return await asyncio.to_thread(self._transaction, "control",
                                       "take from the job's budget", grant)

    async def return_budget(self, unspent: int) -> None:
        """Give back what this run was granted and did not spend."""
        def go() -> None:
            with self._db("control", "give back to the job's budget") as db:
                db.execute("UPDATE asyncrawl_jobs SET budget_taken = greatest(0, budget_taken - "
                           "%s) WHERE job = %s AND budget_gen = %s",
                           (unspent, self.job_name, self._gen))
        if unspent > 0:
            await asyncio.to_thread(go)

    async def publish_live(self, progress: dict[str, Any]) -> None:
        """This run's progress, for ``status`` (a view, like a state directory's live.json)."""
        def go() -> None:
            with self._db("control", "publish the progress") as db:
                db.execute("UPDATE asyncrawl_runs SET live = %s WHERE run = %s",
                           (_jsonb(progress), self._run))
        await asyncio.to_thread(go)

    def live(self) -> list[dict[str, Any]]:
        """The progress of each run working on the job now (heartbeat within ``LIVE`` s)."""
        with self._db("control", "read the job") as db:
            if not db.execute("SELECT count(*) FROM information_schema.columns WHERE "
                              "table_schema = current_schema() AND table_name = "
                              "'asyncrawl_runs' AND column_name = 'live'").fetchone()[0]:
                return []  # a job of an earlier release
            rows = db.execute(f"SELECT run, host, pid, live FROM asyncrawl_runs WHERE job = %s "
                              f"AND ended IS NULL AND heartbeat > {NOW} - %s ORDER BY run",
                              (self.job_name, LIVE)).fetchall()
        return [{"run": run, "host": host, "pid": pid, **(live or {})}
                for run, host, pid, live in rows]

    async def publish_breaker(self, hold: float | None) -> None:
        """This run's breaker is open: the other runs hold their new requests for ``hold``
        seconds (renewed at every heartbeat while it stays open), while this run probes; a
        breaker another run holds is left alone. ``None``: it closed."""
        def go() -> None:
            with self._db("control", "publish the breaker") as db:
                if hold is None:
                    db.execute("UPDATE asyncrawl_jobs SET breaker_run = NULL WHERE job = %s "
                               "AND breaker_run = %s", (self.job_name, self._run))
                    return
                db.execute(f"UPDATE asyncrawl_jobs SET breaker_run = %s, breaker_until = {NOW} "
                           f"+ %s WHERE job = %s AND (breaker_run IS NULL OR breaker_run = %s "
                           f"OR breaker_until < {NOW})",
                           (self._run, hold, self.job_name, self._run))
        await asyncio.to_thread(go)

    # -- the Store interface: a run's reads ----------------------------------------------------

    async def lookup(self, ids: Sequence[str]) -> dict[str, str]:
        def go() -> dict[str, str]:
            with self._db("work", "read the job") as db:
                rows = db.execute("SELECT id, state FROM asyncrawl_items WHERE job = %s AND "
                                  "id = ANY(%s) AND state IS NOT NULL",
                                  (self.job_name, list(ids))).fetchall()
            return {r[0]: r[1] for r in rows}
        return await asyncio.to_thread(go)

    async def unusable(self, ids: Sequence[str]) -> dict[str, Bought]:
        def go() -> dict[str, Bought]:
            with self._db("work", "read the job") as db:
                if not self._has_answered(db):  # (a job of an earlier release: none counted)
                    return {}
                return {r[0]: Bought(*r[1:]) for r in db.execute(
                    "SELECT id, unusable, status, error, coalesce(tries, 0) FROM "
                    "asyncrawl_items WHERE job = %s AND id = ANY(%s) AND unusable > 0",
                    (self.job_name, list(ids)))}
        return await asyncio.to_thread(go)

    async def admit(self, ids: Sequence[str]) -> tuple[list[tuple[str, str | None, int]], int]:
        """(Not used for a shared job: its runs ``merge`` and ``claim``.)"""
        raise NotImplementedError("a shared job's IDs are merged and claimed")

    async def run_counts(self, *, whole: bool = False) -> Counts:
        """The job's IDs by state (a shared job's summary is the job's); pending includes the
        IDs of blocks not taken in yet that the job does not have otherwise."""
        def go() -> Counts:
            with self._db("work", "read the job") as db:  # (one statement: one snapshot)
                by = Counter[str]()
                for state, n in db.execute(
                        "SELECT coalesce(state, 'pending'), count(*) FROM asyncrawl_items "
                        "WHERE job = %(job)s GROUP BY 1 UNION ALL "
                        "SELECT 'pending', count(DISTINCT x) FROM asyncrawl_blocks b, "
                        "unnest(b.ids) AS x WHERE b.job = %(job)s AND b.ids IS NOT NULL AND "
                        "NOT EXISTS (SELECT 1 FROM asyncrawl_items i WHERE i.job = %(job)s "
                        "AND i.id = x)", {"job": self.job_name}):
                    by[state] += n
            return Counts(ok=by.get("ok", 0), failed=by.get("failed", 0) + by.get("perm", 0),
                          unavailable=by.get("unavailable", 0), pending=by.get("pending", 0))
        return await asyncio.to_thread(go)

    def resume_point(self, source: dict[str, Any]) -> dict[str, int] | None:
        return None  # a shared job merges what it is given

    def unsettled(self) -> Iterator[list[str]]:
        return iter(())

    def source_lines(self, source: dict[str, Any]) -> int | None:
        return None

    # -- the Store interface: the writer's commit ----------------------------------------------

    def commit(self, records: Sequence[Record]) -> frozenset[str]:
        """One transaction for the batch: durable when this returns. Returns the IDs whose
        ``sent`` intent was refused (see ``UPSERT_SENT``)."""
        if self._dead:
            raise StorageError("the state database failed earlier; nothing more is written",
                               path=safe_url(self.url))

        def write(db: Any) -> frozenset[str]:
            self._refused = set()
            self._apply(records)
            return frozenset(self._refused)

        try:
            return self._transaction("writer", "write the state database", write)
        except StorageError:
            self._dead = True
            raise

    def _transaction(self, name: str, doing: str, work: Callable[[Any], T]) -> T:
        """``work(db)`` in one transaction on connection ``name``, and its result once committed.
        Done again where PostgreSQL rolled it back (a deadlock or a serialization failure; not
        40003, "statement completion unknown") or where the connection was lost before its
        COMMIT was sent (the server ended it because this process stopped inside it, a paused
        VM or SIGSTOP: ``IDLE_IN_TRANSACTION``; or the server went away and is back): nothing of
        it was committed. Where the connection was lost with the COMMIT under way, the server
        says whether it took effect (``_took_effect``): done, or done again, never twice."""
        psycopg = _psycopg()
        for attempt in range(1, COMMIT_TRIES + 1):
            with self._locks[name]:
                xid, committing = None, False
                try:
                    db = self._open(name)
                    with db.transaction():
                        xid = db.execute(self._xact_id).fetchone()[0]
                        result = work(db)
                        committing = True  # (the block's end sends COMMIT)
                    return result
                except psycopg.Error as e:
                    error, lost = e, self._lost_with(name, e)
            # (the lock given back: another thread's heartbeat need not wait for the answer)
            took = self._took_effect(xid) if lost and committing else False
            if took:
                log.warning("the connection to the state database was lost while a commit "
                            "was under way; the server says it took effect")
                return result
            if took is None:
                raise StorageError(
                    f"cannot {doing}: the connection to the PostgreSQL server was lost while "
                    f"it committed, and the server cannot say whether the commit took effect "
                    f"({type(error).__name__}); rerun to resume", path=safe_url(self.url))
            if not (error.sqlstate in ROLLED_BACK or lost) or attempt == COMMIT_TRIES:
                raise _storage_error(error, self.url, doing) from None
            log.warning("the state database %s (%s, SQLSTATE %s); writing it again",
                        "lost a transaction: this process was held up inside it, or the "
                        "connection broke" if lost else "rolled a commit back",
                        type(error).__name__, error.sqlstate)
            time.sleep(0.05 * attempt)
        raise AssertionError("unreachable")

    def _took_effect(self, xid: str | None) -> bool | None:
        """Whether the transaction ``xid``, whose connection was lost with its COMMIT under way,
        committed; asked on a connection of its own, again and again (a server restarting
        refuses connections for a while) until ``IDLE_IN_TRANSACTION`` + 5 s have passed, when
        the server has ended a session left idle in a transaction (``None``: unknown)."""
        if xid is None:
            return None
        psycopg = _psycopg()
        deadline = time.monotonic() + IDLE_IN_TRANSACTION + 5
        while True:
            status = None
            with contextlib.suppress(psycopg.Error), _connect(self.url, "status", False) as db:
                status = db.execute(self._xact_status, (xid,)).fetchone()[0]
            if status in ("committed", "aborted") or time.monotonic() >= deadline:
                return {"committed": True, "aborted": False}.get(status or "")
            time.sleep(0.1)

    def _apply(self, records: Sequence[Record]) -> None:
        for part in in_order_parts(records):  # (see records.in_order_parts)
            self._apply_grouped(part)

    def _apply_grouped(self, records: Sequence[Record]) -> None:
        db = self._conns["writer"]
        sent: list[str] = []
        calls: list[tuple[str | None, str, str | None]] = []  # the intents: (id, day, key)
        outcomes: list[Record] = []
        counted: dict[str, list[str]] = {kind: [] for kind in COUNTED}  # an ID once a call
        ledger: Counter[tuple[str, str, str]] = Counter()  # (day, endpoint, what)
        keys: Counter[tuple[str, str, str]] = Counter()  # (day, key fingerprint, what)
        for rec in records:
            kind = rec.kind
            days = int(rec.ts // 86400)
            if days != self._day[0]:
                self._day = (days, utc_day(rec.ts))
            day = self._day[1]
            if kind == "sent":
                sent.append(rec.id or "")
                calls.append((rec.id, day, rec.key))
            elif kind in OUTCOME_KINDS:
                outcomes.append(rec)
            elif kind == "billed":
                db.execute("UPDATE asyncrawl_items SET paid = paid + %s WHERE job = %s AND id = %s",
                           (rec.paid, self.job_name, rec.id))
            elif kind == "run":
                self._start_run(rec)
            elif kind in counted:  # answered, unusable
                counted[kind].append(rec.id or "")
            elif kind == "unanswered":  # (its outcome, if in this batch, is flushed later)
                db.execute("UPDATE asyncrawl_items SET doubt = CASE WHEN state = 'ok' THEN 3 "
                           "ELSE 2 END WHERE job = %s AND id = %s AND doubt IS NULL",
                           (self.job_name, rec.id))
            elif kind == "halt":
                db.execute("UPDATE asyncrawl_runs SET halt_reason = %s, halt_status = %s, "
                           "halt_message = %s WHERE run = %s",
                           ((rec.extra or {}).get("reason"), rec.status, rec.error, self._run))
            elif kind == "end":
                self._end_run(rec, sent, outcomes)
                sent, outcomes = [], []
            elif kind == "unsent":  # an intent whose request did not leave: taken back
                self._flush(sent, outcomes)  # (after its intent, before a later one)
                sent, outcomes = [], []
                if db.execute("UPDATE asyncrawl_items SET sends = sends - 1, sent_run = "
                              "CASE WHEN %s THEN sent_run END WHERE job = %s AND id = %s "
                              "AND sent_run = %s AND sends > 0",
                              (rec.permanent, self.job_name, rec.id, self._run)).rowcount:
                    ledger[(day, self._endpoint, "sent")] -= 1
                    if rec.key is not None:
                        keys[(day, rec.key, "sent")] -= 1
            if rec.paid:
                ledger[(day, self._endpoint, "billable")] += rec.paid
                for key, n in rec.paid_keys().items():
                    keys[(day, key, "billable")] += n
        self._flush(sent, outcomes)
        for column, ids in counted.items():  # (after the intents: an ID's row is there)
            if ids:
                db.execute(f"UPDATE asyncrawl_items i SET {column} = i.{column} + a.n FROM "
                           "(SELECT id, count(*) AS n FROM unnest(%s::text[]) AS id GROUP BY "
                           "id) a WHERE i.job = %s AND i.id = a.id", (ids, self.job_name))
        for item_id, day, fp in calls:  # the intents written (refused ones are not sent)
            if item_id not in self._refused:
                ledger[(day, self._endpoint, "sent")] += 1
                if fp is not None:
                    keys[(day, fp, "sent")] += 1
        for sql, counts in ((ADD_LEDGER, ledger), (ADD_KEY_LEDGER, keys)):
            for day, what, n_sent, n_billable in call_rows(counts):
                db.execute(sql, (self.job_name, day, what, self._run, n_sent, n_billable))

    def _flush(self, sent: list[str], outcomes: list[Record]) -> None:
        db = self._conns["writer"]
        for part in _distinct(sent, lambda x: x):
            written = db.execute(UPSERT_SENT, {"job": self.job_name, "run": self._run,
                                               "id": part, "lease": self.lease}).fetchall()
            if len(written) < len(part):
                self._refused.update(set(part).difference(r[0] for r in written))
        for group in _distinct(outcomes, lambda r: r.id):
            db.execute(UPSERT_OUTCOME, {
                "job": self.job_name, "gen": self._gen, "run": self._run,
                "cool": self.cooldown,
                "id": [r.id for r in group], "state": [r.state for r in group],
                "status": [r.status for r in group], "error": [r.error for r in group],
                "pass": [r.pass_no for r in group], "tries": [r.tries for r in group],
                "paid": [r.paid for r in group], "ts": [r.ts for r in group],
                "data": [r.stored_payload() if r.kind == "ok" else None for r in group]})

    def _end_run(self, rec: Record, sent: list[str], outcomes: list[Record]) -> None:
        """The run's end: what was cut off in flight is in doubt; what it held and did not
        send goes back to the job at once."""
        self._flush(sent, outcomes)
        db = self._conns["writer"]
        extra = rec.extra or {}
        cut = list(extra.get("in_doubt", ()))
        if cut:
            db.execute("UPDATE asyncrawl_items SET doubt = 0 WHERE job = %s AND id = ANY(%s) "
                       f"AND {NOT_IN_DOUBT}", (self.job_name, cut))
        # ended first: a claim of this run still under way (its run row locked FOR SHARE) is
        # waited for, so its leases are among those cleared next; a later one takes nothing
        db.execute(f"UPDATE asyncrawl_runs SET ended = {NOW}, error = %s, merging = false "
                   "WHERE run = %s", (extra.get("error"), self._run))
        db.execute("UPDATE asyncrawl_items SET lease_owner = NULL, lease_until = NULL, "
                   "sent_run = NULL WHERE job = %s AND lease_owner = %s",
                   (self.job_name, self._run))

    # -- the Store interface: figures and streams ---------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._db("control", "read the job") as db:
            by = dict(db.execute("SELECT state, count(*) FROM asyncrawl_items WHERE job = %s "
                                 "AND state IS NOT NULL GROUP BY state",
                                 (self.job_name,)).fetchall())
            ledger, sent = [], 0
            for day, endpoint, n_sent, n_billable in db.execute(
                    "SELECT day, endpoint, sum(sent), sum(billable) FROM asyncrawl_ledger "
                    "WHERE job = %s GROUP BY 1, 2 ORDER BY 1, 2", (self.job_name,)):
                sent += n_sent
                if n_billable:
                    ledger.append((day, endpoint, int(n_billable)))
            keys: tuple[tuple[str, str, int, int], ...] = ()
            if db.execute("SELECT to_regclass('asyncrawl_key_ledger')").fetchone()[0]:
                keys = tuple((day, key, int(a), int(b)) for day, key, a, b in db.execute(
                    "SELECT day, key, sum(sent), sum(billable) FROM asyncrawl_key_ledger "
                    "WHERE job = %s GROUP BY 1, 2 ORDER BY 1, 2", (self.job_name,)))
            doubt: dict[int, int] = {}  # IDs by doubt
            unsure = 0  # (their calls with no answer known)
            # (a job of an earlier release, not run since: any call not billed; one an open ID)
            has = self._has_answered(db)
            lost = "greatest(sends - paid - answered, 0)" if has else "greatest(sends - paid, 0)"
            calls_open = f"sum(least({lost}, 1))" if has else "count(*)"
            for value, n, calls in db.execute(
                    f"SELECT doubt, count(*), sum({lost}) FROM asyncrawl_items "
                    "WHERE job = %s AND doubt IS NOT NULL GROUP BY doubt", (self.job_name,)):
                doubt[value], unsure = n, unsure + int(calls or 0)
            live = self._runs_alive(db, LIVE)
            # the calls of the open intents not in doubt: in flight (a live run's), or answered
            # and to be tried again; a dead run's are in doubt, whatever the other runs do
            open_doubt = (f"count(*) FILTER (WHERE {UNANSWERED_CALL} AND {_DEAD_RUN})" if has
                          else f"count(*) FILTER (WHERE {_DEAD_RUN})")
            open_sent, open_unanswered, open_lost, open_doubtful = db.execute(
                f"SELECT count(*) FILTER (WHERE NOT {_DEAD_RUN}), count(*) FILTER (WHERE "
                f"doubt = 2 AND {_DEAD_RUN}), coalesce({calls_open} FILTER (WHERE doubt IS "
                f"NULL), 0), {open_doubt} FROM asyncrawl_items WHERE job = %(job)s AND {OPEN} "
                f"AND sent_run IS NOT NULL AND {NOT_IN_DOUBT}",
                {"job": self.job_name, "live": LIVE}).fetchone()
            runs = db.execute("SELECT count(*) FROM asyncrawl_runs WHERE job = %s",
                              (self.job_name,)).fetchone()[0]
            # the job's halt is the one of the run that ended last: a process stopped by a
            # signal while the others finished the job has not halted it (a job-wide halt
            # ends every run with it)
            last = db.execute("SELECT halt_reason, halt_status, halt_message FROM asyncrawl_runs "
                              "WHERE job = %s AND ended IS NOT NULL ORDER BY ended DESC, run DESC "
                              "LIMIT 1", (self.job_name,)).fetchone()
        halt = Halt(last[0], last[1], last[2] or "") if last and last[0] else None
        counts = Counts(ok=by.get("ok", 0), failed=by.get("failed", 0) + by.get("perm", 0),
                        unavailable=by.get("unavailable", 0))
        return Snapshot(counts=counts, sent=int(sent),
                        in_doubt=doubt.get(0, 0) + open_doubtful,
                        billed_twice=doubt.get(1, 0), in_flight=open_sent,
                        runs=runs, halt=halt, job=self.job, running=live or None,
                        ledger=tuple(ledger), keys=keys,
                        unanswered=doubt.get(2, 0) - open_unanswered,
                        unanswered_refetched=doubt.get(3, 0),
                        unsure_calls=unsure + int(open_lost))

    def _dead_open(self, db: Any) -> str:
        """A dead run's open intents that are in doubt (a job of an earlier release: all):
        those of a run that has ended or has not sent its heartbeat for ``LIVE`` s, whatever
        the job's other runs do (a job-wide "any run live" left a killed run's out of the
        list while another went on, until its leases ran out). Takes ``%(job)s`` and
        ``%(live)s``."""
        return f"{OPEN} AND sent_run IS NOT NULL AND {_DEAD_RUN}" + (
            f" AND {UNANSWERED_CALL}" if self._has_answered(db) else "")

    def _has_answered(self, db: Any) -> bool:
        """Whether the job's items table has the ``answered`` column (a reader of a database
        no run of this release has opened does without; a run's store made it). Asked of the
        database until it says yes: then it stays so."""
        if not self._answered_kept:
            self._answered_kept = self._for_run or bool(db.execute(
                "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
                "current_schema() AND table_name = 'asyncrawl_items' AND column_name = 'answered'"
            ).fetchone()[0])
        return self._answered_kept

    def records(self, outcome: str) -> Iterator[Record]:
        want = list(EXPORT_STATES[outcome])
        with self._db("control", "read the job") as db, db.transaction(), \
                db.cursor(name="export") as cur:
            cur.execute("SELECT id, state, status, error, pass, tries, paid, fetched_at, data "
                        "FROM asyncrawl_items WHERE job = %s AND state = ANY(%s) ORDER BY id",
                        (self.job_name, want))
            for item, state, status, error, pass_no, tries, paid, ts, data in cur:
                yield tuple.__new__(Record, (
                    "failed" if state == "perm" else state, item, status, error,
                    state == "perm", None, pass_no or 1, tries or 0, paid, ts or 0.0, None,
                    bytes(data) if data is not None else None, None))

    def payloads(self) -> Iterator[tuple[str, bytes | None]]:
        with self._db("control", "read the job") as db, db.transaction(), \
                db.cursor(name="export_payloads") as cur:
            cur.execute("SELECT id, data FROM asyncrawl_items WHERE job = %s AND state = 'ok' "
                        "ORDER BY id", (self.job_name,))
            for item, data in cur:
                yield item, bytes(data) if data is not None else None

    def ids(self, outcome: str) -> Iterator[list[str]]:
        want = list(EXPORT_STATES[outcome])
        with self._db("control", "read the job") as db, db.transaction(), \
                db.cursor(name="export_ids") as cur:
            cur.execute("SELECT id FROM asyncrawl_items WHERE job = %s AND state = ANY(%s) "
                        "ORDER BY id", (self.job_name, want))
            while rows := cur.fetchmany(4096):
                yield [row[0] for row in rows]

    def in_doubt(self) -> Iterator[tuple[str, bool]]:
        with self._db("control", "read the job") as db:
            rows = db.execute("SELECT id, doubt FROM asyncrawl_items WHERE job = %(job)s AND "
                              f"(doubt IN (0, 1) OR ({self._dead_open(db)})) ORDER BY id",
                              {"job": self.job_name, "live": LIVE}).fetchall()
        for item, doubt in rows:
            yield item, doubt == 1

    def unanswered(self) -> Iterator[tuple[str, bool]]:
        with self._db("control", "read the job") as db:
            # (a dead run's open intents are in doubt instead)
            rows = db.execute("SELECT id, doubt FROM asyncrawl_items WHERE job = %(job)s AND "
                              f"doubt IN (2, 3) AND NOT ({self._dead_open(db)}) ORDER BY id",
                              {"job": self.job_name, "live": LIVE}).fetchall()
        for item, doubt in rows:
            yield item, doubt == 3

    async def close(self) -> None:
        await in_thread(self._close_sync)  # (to its end, even if cancelled meanwhile)

    def _close_sync(self) -> None:
        """Close each connection once no thread uses it (a merge or claim that a cancelled
        task left running in its thread finishes first)."""
        for name, c in self._conns.items():
            with self._locks[name], contextlib.suppress(Exception):
                c.close()

    def __del__(self) -> None:  # a reader that ``status`` / ``export`` dropped: its connections
        self._close_sync()


def _connect(url: str, name: str, run: bool) -> Any:
    """A connection of a run or of a reader. A run's sessions end when left inside a
    transaction for ``IDLE_IN_TRANSACTION`` s (none of its transactions waits between its
    statements): a process stopped there (a paused VM, SIGSTOP) would otherwise keep the row
    locks of its transaction, and every other process of the job would wait for those IDs
    (or, for the job's row, with their heartbeats) for as long as it stays stopped. Named
    ``asyncrawl <name> <pid>`` in ``pg_stat_activity``: which process of which machine's is
    which (with ``client_addr``)."""
    db = _psycopg().connect(url, autocommit=True, connect_timeout=10,
                            application_name=f"asyncrawl {name} {os.getpid()}", **KEEPALIVE)
    if run:
        db.execute("SET idle_in_transaction_session_timeout = "
                   f"{int(IDLE_IN_TRANSACTION * 1000)}")
    return db


# what a server that answered says when the URL names a database or user it does not have,
# or credentials it does not take (libpq gives no SQLSTATE for a failed connect: its text)
_REFUSALS = re.compile(r'FATAL:\s+((?:database|role) "[^"]*" does not exist|password '
                       r"authentication failed for user \"[^\"]*\"|no pg_hba\.conf entry[^\n]*)")


# what libpq says of a URL it cannot read, before it connects
_MALFORMED = re.compile(r"(invalid (?:port number|\w+ value|URI query parameter|connection "
                        r"option|percent-encoded token|integer value)[^\n]*|end of string "
                        r"reached[^\n]*|missing \"=\" after[^\n]*|unterminated quoted "
                        r"string[^\n]*)")


def _refused(e: Exception) -> str | None:
    """The server's refusal of a connect that names a wrong database, user or password."""
    m = _REFUSALS.search(str(e))
    return m.group(1) if m else None


def _went_away(e: Exception) -> bool:
    """Whether a psycopg error says the server is unreachable or went away."""
    state = getattr(e, "sqlstate", None)  # None: no answer; 08…: connection; 57P…: shutdown
    return isinstance(e, _psycopg().OperationalError) and (
        state is None or state[:2] == "08" or state[:3] == "57P")


def _storage_error(e: Exception, url: str, doing: str, *, run: bool = True) -> StorageError:
    """A psycopg error in an operator's words (``run``: a run's, which a rerun resumes)."""
    text = _scrubbed(str(e).strip().splitlines()[0], url) if str(e).strip() else \
        type(e).__name__
    if _went_away(e):
        then = "nothing committed is lost, rerun to resume" if run else "try again once it is back"
        return StorageError(f"cannot {doing}: the PostgreSQL server is unreachable or went away "
                            f"({text}); {then}", path=safe_url(url))
    return StorageError(f"cannot {doing}: {text}", path=safe_url(url))


def _jsonb(value: Any) -> Any:
    from psycopg.types.json import Jsonb

    return Jsonb(value) if value is not None else None


def _digest(block: list[str]) -> bytes:
    """A block's key: the same IDs in the same order, merged again, add nothing."""
    return hashlib.sha256("\n".join(block).encode("utf-8", "surrogatepass")).digest()


def _distinct(rows: list[Any], key: Any) -> Iterator[list[Any]]:
    """``rows`` in consecutive groups without a repeated key (one statement may not change a
    row twice), in order."""
    group: list[Any] = []
    seen: set[Any] = set()
    for row in rows:
        k = key(row)
        if k in seen:
            yield group
            group, seen = [], set()
        group.append(row)
        seen.add(k)
    if group:
        yield group


__all__ = ["PgStore", "safe_url"]
