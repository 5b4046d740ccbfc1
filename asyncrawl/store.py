"""[5] The state store's interface: every read and write of a job's state goes through a
``Store``. The implementation for a state directory is SQLite (``sqlstore.py``);
``open_store`` and ``read_store`` pick it.

A job shared by many processes lives in PostgreSQL instead (``pgstore.py``: a URL as the
location, and the job's name); its runs do not ``admit`` their own IDs but ``merge`` them into
the job and ``claim`` batches under a lease (``jobwide.py``).

A store is batch-oriented, so that a database can implement it with one statement per chunk
and one transaction per group commit; nothing in the interface loads every ID into memory:

=========================  ==========================================================================
``open_store(location)``   open for a run: create it if needed, take the job's lock (else
                           ``LockedError``), repair what a crash left (apply what the intent
                           log holds beyond what was applied, close the crashed run's open
                           intents: its requests in doubt)
``read_store(location)``   open read-only without the lock, for ``status`` / ``export`` /
                           ``--dry-run`` while a run may be going (``ConfigError`` if there is none)
``job``                    the job's identity (method, url, params) as its last run recorded it
``claim_identity(ident)``  the job's identity, ``ident`` recorded if it had none, in one step
                           (two first runs of a shared job cannot both take it for theirs)
``lookup(ids)``            the state (``ok`` | ``failed`` | ``perm`` | ``unavailable``) of those of
                           a chunk of IDs that have one (awaitable: a database answers off the loop)
``unusable(ids)``          of a chunk of IDs, those with paid answers that could not be used (not
                           parsed, cut short, too large): their count, status, error and tries
                           (what ``paid_retries`` allows a later run)
``admit(ids)``             a run's dedup: of a chunk of the run's IDs, those it has not seen yet
                           (in order, with their state and their count of unusable paid
                           answers) and how many were duplicates
``run_counts(whole=)``     the IDs ``admit`` took, by their state now (the run's summary;
                           ``whole``: a shared job's, all of its IDs)
``resume_point(source)``   where a run of an unchanged IDs file may read on (``None``: from the
                           start), ``unsettled()`` the IDs held unsettled before that point,
                           ``source_lines(source)`` the file's ID count as checked before
``commit(records)``        append a batch and make it durable (one fsync or transaction), then let
                           it count; blocking, called only by the run's writer (``Writer``'s
                           thread; ``ProcessWriter`` hands batches to ``process``). Returns
                           the IDs whose ``sent`` intent it refused (another process of a
                           shared job holds them now; never on one machine). Raises
                           ``StorageError``; after one, the store takes no more writes.
                           A store whose writes a process of its own makes has it as
                           ``process`` (SQLite's, ``sqlproc.WriterProcess``): the run's
                           writer feeds it from the event loop (``writer.ProcessWriter``)
``snapshot()``             the figures of ``status`` (``records.Snapshot``), from indexes
``records(outcome)``       stream the records to export: ``ok`` (each ID's result, once),
                           ``failed`` or ``unavailable`` (each such ID's latest outcome record)
``ids(outcome)``           the IDs of ``records(outcome)``, a block (list) at a time
``payloads()``             stream ``(id, payload)`` for the ``ok`` IDs, the payload as stored (JSON,
                           UTF-8 bytes; None where the ok record kept none), in
                           ``records("ok")``'s order
``in_doubt()``             stream ``(id, refetched)`` for the IDs sent when a run was cut off,
                           no result kept
``unanswered()``           stream ``(id, refetched)`` for the IDs with a request that got no
                           answer (a timeout after the connect, a dropped connection), not in
                           doubt
``close()``                release the lock and the files (awaitable)
=========================  ==========================================================================

Records and their meaning are defined once, in ``records.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, overload

from .config import is_url
from .errors import ConfigError
from .records import Bought, Counts, Record, Snapshot
from .sqlstore import DB, STATE_FILES, SqliteStore

if TYPE_CHECKING:
    from .sqlproc import WriterProcess


class Store(Protocol):
    """A job's durable state. See the module's docstring for each member's contract."""

    location: str
    job: dict[str, Any] | None
    @property
    def process(self) -> WriterProcess | None:
        """The process that writes for the run (SQLite's, ``sqlproc``), which the run's
        writer feeds from the event loop; ``None``: the writer's thread commits (PostgreSQL)."""

    async def claim_identity(self, identity: dict[str, Any]) -> dict[str, Any] | None: ...

    async def lookup(self, ids: Sequence[str]) -> dict[str, str]: ...

    async def admit(self, ids: Sequence[str]) -> tuple[list[tuple[str, str | None, int]], int]: ...

    async def unusable(self, ids: Sequence[str]) -> dict[str, Bought]: ...

    async def run_counts(self, *, whole: bool = False) -> Counts: ...

    def resume_point(self, source: dict[str, Any]) -> dict[str, int] | None: ...

    def unsettled(self) -> Iterator[list[str]]: ...

    def source_lines(self, source: dict[str, Any]) -> int | None: ...

    def commit(self, records: Sequence[Record]) -> frozenset[str]: ...

    def snapshot(self) -> Snapshot: ...

    def records(self, outcome: str) -> Iterator[Record]: ...

    def ids(self, outcome: str) -> Iterator[list[str]]: ...

    def payloads(self) -> Iterator[tuple[str, bytes | None]]: ...

    def in_doubt(self) -> Iterator[tuple[str, bool]]: ...

    def unanswered(self) -> Iterator[tuple[str, bool]]: ...

    async def close(self) -> None: ...


async def open_store(location: str | os.PathLike[str], job: str = "default", *,
                     lease: float = 30.0, cooldown: float = 0.0) -> Store:
    """The store at ``location`` (a state directory, or a PostgreSQL URL and the ``job``'s
    name), opened for a run (a state directory: locked). A shared job's ``lease`` and
    ``cooldown`` (seconds before a failure of pass 1 may be taken by pass 2)."""
    if is_url(location):
        from .pgstore import PgStore  # (only here: the commands of a state directory start
        #                               faster without it, and it imports asyncio)

        return await PgStore.open(str(location), job, lease, cooldown)
    return await SqliteStore.open(location)


@overload
def read_store(location: str | os.PathLike[str], *, job: str = ...) -> Store: ...
@overload
def read_store(location: str | os.PathLike[str], *, missing_ok: bool, job: str = ...
               ) -> Store | None: ...


def read_store(location: str | os.PathLike[str], *, missing_ok: bool = False,
               job: str = "default") -> Store | None:
    """The store at ``location``, read-only and unlocked (a run may be going). Where no run
    ever wrote: ``None`` if ``missing_ok``, else ``ConfigError`` (a wrong ``--state``)."""
    if is_url(location):
        from .pgstore import NoJob, PgStore

        try:
            return PgStore.reader(str(location), job)
        except NoJob:  # (not a refused connection: a dry run would say nothing was done)
            if missing_ok:
                return None
            raise
    not_a_dir(Path(location))
    if missing_ok and not SqliteStore.exists(location):
        return None
    return SqliteStore.reader(location)


def not_a_dir(d: Path) -> None:
    """``ConfigError`` where the state directory given is a file (``--state notes/state.db``,
    say: the database the README's examples query), which would read as no state at all."""
    if d.exists() and not d.is_dir():
        hint = f"; the state directory is {d.parent}" if d.name == DB else ""
        raise ConfigError(f"the state directory (--state, [state] dir) is a file here, not a "
                          f"directory{hint}", path=d)


__all__ = ["STATE_FILES", "Store", "not_a_dir", "open_store", "read_store"]
