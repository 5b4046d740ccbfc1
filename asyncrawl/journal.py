"""[5] The journal: the state store of a state directory (``store.Store``), as append-only records
with group commit + fsync, torn-tail repair, and the lock that keeps two runs off one directory.

Layout of a state directory::

    journal.jsonl   one record (``records.Record.encode``) per line; the first line is the header
    lock            flock()ed by the run that owns the directory (holds its pid)

What the records mean is defined in ``records.py``; ``State.apply`` is where one becomes state,
on replay and on commit alike.

*In doubt* are the IDs whose request may have been billed without a result being recorded: in a
run that crashed, every ``sent`` ID with no outcome record after it; in a run that ended, the
IDs its ``end`` record lists. A later ``ok`` for such an ID makes it "possibly billed twice".

Only the writer's thread (``writer.Writer``) appends, through ``commit``: a batch is written in
one go and fsynced once (group commit); only then is it *committed* and applied to the state. A
crash can only tear the last write: on open, a tail of invalid lines is cut off (``repair``); an
invalid line *followed by* a valid record is damage, reported with its offset.

The journal replays every record into memory on open (a dict of ID states); the database store
of the next release answers the same interface from indexes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .errors import ConfigError, JournalCorrupt, LockedError, StorageError
from .records import OUTCOME_KINDS, SETTLED, Counts, Record, Snapshot, next_state, utc_day
from .types import Halt

__all__ = ["HEADER", "JOURNAL", "LOCK", "OUTCOME_KINDS", "Journal", "Record", "State",
           "good_length", "load_state", "lock_holder", "scan"]

FORMAT_VERSION = 1
JOURNAL = "journal.jsonl"
LOCK = "lock"
HEADER = orjson.dumps({"asyncrawl_journal": FORMAT_VERSION}) + b"\n"


def scan(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(offset, record)`` for every complete record; stop quietly at a torn tail.

    Raises ``JournalCorrupt`` for a bad header, or for an invalid line followed by a valid one.
    """
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    except OSError as e:
        raise StorageError(f"cannot read journal: {e.strerror}", path=path) from None
    with f:
        first = f.readline()
        if not first:
            return
        try:
            header = orjson.loads(first)
        except orjson.JSONDecodeError:
            header = None
        if not first.endswith(b"\n") and header is None:
            return  # torn while writing the header: nothing was recorded yet
        if not isinstance(header, dict) or "asyncrawl_journal" not in header:
            raise JournalCorrupt("not an asyncrawl journal (bad header)", path=path, offset=0)
        if header["asyncrawl_journal"] != FORMAT_VERSION:
            raise StorageError(
                f"journal format {header['asyncrawl_journal']} was written by an incompatible "
                f"asyncrawl version (this one reads format {FORMAT_VERSION}); use a new state "
                "directory or the matching asyncrawl version", path=path)
        offset = len(first)
        bad_at: int | None = None
        for line in f:
            rec = None
            if line.endswith(b"\n"):
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    rec = None
            if isinstance(rec, dict) and "k" in rec:
                if bad_at is not None:
                    raise JournalCorrupt("damaged record inside the journal", path=path,
                                         offset=bad_at)
                yield offset, rec
            elif bad_at is None:
                bad_at = offset
            offset += len(line)


def good_length(path: Path, last: int | None = None) -> int:
    """Bytes of the journal up to the end of its last complete record (the header included).
    ``last``: the offset of that record, if a ``scan`` already found it."""
    end = 0
    if last is None:
        for offset, _ in scan(path):
            end = offset
    else:
        end = last
    if end == 0:
        if not path.exists() or path.stat().st_size == 0:
            return 0
        with path.open("rb") as f:
            first = f.readline()
        return len(first) if first.endswith(b"\n") else 0
    with path.open("rb") as f:
        f.seek(end)
        return end + len(f.readline())


@dataclass(slots=True)
class State:
    """What the journal says, replayed: each ID's state, the last run's halt, the ledger, and
    the IDs in doubt (id -> whether it was re-fetched since: "possibly billed twice")."""

    outcome: dict[str, str] = field(default_factory=dict)  # id -> ok | failed | perm | unavailable
    halt: Halt | None = None
    billable_by_day: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    runs: int = 0
    in_doubt: dict[str, bool] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)  # sent, no outcome yet, in the open run
    run_open: bool = False
    job: dict[str, Any] | None = None  # what the job fetches (the latest run that said)
    _day: tuple[int, str] = (-1, "")  # the last UTC day billed: (days since the epoch, date)

    def apply(self, rec: Record) -> None:
        """The one place where a record becomes state (replay and commit alike)."""
        kind = rec.kind
        if kind == "sent":
            self.sent += 1
            self.in_flight.add(rec.id)  # type: ignore[arg-type]
        elif kind in OUTCOME_KINDS:
            item: str = rec.id  # type: ignore[assignment]
            self.in_flight.discard(item)
            self.outcome[item] = next_state(self.outcome.get(item), kind, rec.permanent)
            if kind == "ok" and item in self.in_doubt:
                self.in_doubt[item] = True
            if rec.paid:
                self._bill(rec)
        elif kind == "billed":
            self._bill(rec)
        elif kind == "run":
            extra = rec.extra or {}
            if "job" in extra:
                self.job = extra["job"]
            self.close_run(crashed=True)
            self.runs += 1
            self.halt = None
            self.run_open = True
        elif kind == "halt":
            self.halt = rec.halt()
        elif kind == "end":
            for item in (rec.extra or {}).get("in_doubt", ()):
                self.in_doubt.setdefault(item, False)
            self.in_flight.clear()
            self.run_open = False

    def _bill(self, rec: Record) -> None:
        days = int(rec.ts // 86400)
        if days != self._day[0]:
            self._day = (days, utc_day(rec.ts))
        self.billable_by_day[self._day[1]] += rec.paid

    def close_run(self, *, crashed: bool) -> None:
        """The open run is over (``crashed``: without its ``end`` record)."""
        if self.run_open and crashed:
            for item in self.in_flight:
                self.in_doubt.setdefault(item, False)
        self.in_flight.clear()
        self.run_open = False

    def counts(self) -> dict[str, int]:
        return Counts.of(self.outcome.values()).as_dict()

    def is_settled(self, item: str) -> bool:
        return self.outcome.get(item) in SETTLED


def replay(path: Path, state: State) -> int:
    """Apply every complete record of the journal at ``path`` to ``state``; return the offset
    of the last one (0: none)."""
    last = 0
    apply, decode = state.apply, Record.decode
    for offset, obj in scan(path):
        apply(decode(obj))
        last = offset
    return last


def load_state(state_dir: Path, *, running: bool = False) -> State:
    """Replay the journal read-only (a torn tail is ignored, not repaired). Unless a run is
    ``running`` now, an open last run is one that crashed: its in-flight IDs are in doubt."""
    st = State()
    replay(state_dir / JOURNAL, st)
    if not running:
        st.close_run(crashed=True)
    return st


def lock_holder(state_dir: Path) -> int | None:
    """The pid of the run holding the state directory's lock, or ``None`` if none does."""
    try:
        fd = os.open(state_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            try:
                return int(os.pread(fd, 32, 0).decode().strip() or 0)
            except (OSError, ValueError):
                return 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """The journal of one state directory, a ``store.Store``. ``Journal.open`` opens it for a
    run (locked; ``start_appending`` before the first commit); ``Journal.reader`` opens it
    read-only (no lock: a run may be going). Close with ``close``."""

    def __init__(self, state_dir: Path, lock_fd: int, state: State | None, size: int = 0) -> None:
        self.state_dir = state_dir
        self.location = str(state_dir)
        self.path = state_dir / JOURNAL
        self._state = state
        self._lock_fd = lock_fd
        self._fd = -1  # the append descriptor (``start_appending``)
        self._durable = size  # the journal's length when its last fsync returned

    def __repr__(self) -> str:
        ids = len(self._state.outcome) if self._state is not None else "?"
        return f"<Journal {self.path} ids={ids} locked={self._lock_fd >= 0}>"

    @classmethod
    async def open(cls, state_dir: str | os.PathLike[str]) -> Journal:
        """Create or open the state directory: lock it, repair a torn tail, replay the state."""
        d = Path(state_dir)
        return await asyncio.to_thread(cls._open_sync, d)

    @staticmethod
    def exists(state_dir: str | os.PathLike[str]) -> bool:
        """Whether a run ever wrote a journal in ``state_dir``."""
        return (Path(state_dir) / JOURNAL).exists()

    @classmethod
    def reader(cls, state_dir: str | os.PathLike[str]) -> Journal:
        """The journal of ``state_dir`` read-only, without the lock; the state is replayed when
        first asked for (a torn tail is ignored, not repaired). ``ConfigError`` if no run ever
        used the directory: a wrong ``--state`` is a usage error, not a storage failure."""
        d = Path(state_dir)
        if not (d / JOURNAL).exists():
            what = "does not exist" if not d.exists() else "holds no asyncrawl state"
            raise ConfigError(f"{d} {what}: nothing has run with this state directory (check "
                              "--state, or [state] dir in the config)")
        return cls(d, -1, None)

    # -- the Store interface -------------------------------------------------------------------

    @property
    def state(self) -> State:
        """The replayed state (a reader replays on first use, as of that moment)."""
        if self._state is None:
            self._state = load_state(self.state_dir, running=lock_holder(self.state_dir) is not None)
        return self._state

    @property
    def job(self) -> dict[str, Any] | None:
        return self.state.job

    async def lookup(self, ids: Sequence[str]) -> dict[str, str]:
        outcome = self.state.outcome
        return {i: st for i in ids if (st := outcome.get(i)) is not None}

    def commit(self, records: Sequence[Record]) -> None:
        """Append ``records`` in one write and one fsync, then apply them to the state."""
        self.append_sync(b"".join([rec.encode() for rec in records]))
        apply = self.state.apply
        for rec in records:
            apply(rec)

    def snapshot(self) -> Snapshot:
        running = lock_holder(self.state_dir) if self._lock_fd < 0 else os.getpid()
        st = self.state
        twice = sum(st.in_doubt.values())
        return Snapshot(counts=Counts.of(st.outcome.values()),
                        billable_by_day=dict(sorted(st.billable_by_day.items())),
                        sent=st.sent, in_doubt=len(st.in_doubt) - twice, billed_twice=twice,
                        in_flight=len(st.in_flight) if running is not None else 0,
                        runs=st.runs, halt=st.halt, job=st.job, running=running)

    def records(self, outcome: str) -> Iterator[Record]:
        """Streams: an ``ok`` export holds the set of IDs exported, never the payloads; a failed
        or unavailable one holds one small record per such ID."""
        if outcome == "ok":  # ok is final: an ID's first ok record is its result
            exported: set[str] = set()
            for _, obj in scan(self.path):
                if obj["k"] == "ok" and obj["id"] not in exported:
                    exported.add(obj["id"])  # never two ok lines for one ID
                    yield Record.decode(obj)
            return
        want = {"failed": ("failed", "perm"), "unavailable": ("unavailable",)}[outcome]
        st = State()
        latest: dict[str, Record] = {}
        for _, obj in scan(self.path):
            rec = Record.decode(obj)
            st.apply(rec)
            if rec.kind in ("failed", "unavailable"):
                latest[rec.id] = rec  # type: ignore[index]
        for item, rec in latest.items():
            if st.outcome.get(item) in want:
                yield rec

    def in_doubt(self) -> Iterator[tuple[str, bool]]:
        yield from self.state.in_doubt.items()

    @classmethod
    def _open_sync(cls, d: Path) -> Journal:
        try:
            if not d.exists():
                d.mkdir(parents=True, mode=0o700)
                _fsync_dir(d.parent)
            elif not d.is_dir():
                raise StorageError("state path exists and is not a directory", path=d)
            lock_fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StorageError(f"cannot create state directory: {e.strerror}", path=d) from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = ""
            with contextlib.suppress(OSError, ValueError):
                pid = os.pread(lock_fd, 32, 0).decode().strip()
            os.close(lock_fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockedError(
                    f"another asyncrawl run{f' (pid {pid})' if pid else ''} is using the state "
                    f"directory {d}; wait for it to finish or stop it first") from None
            raise StorageError(f"cannot lock state directory: {e.strerror}", path=d) from None
        try:
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
            path = d / JOURNAL
            state = State()
            last = replay(path, state)
            state.close_run(crashed=True)
            created = not path.exists()
            keep = 0 if created else good_length(path, last)
            size = keep or len(HEADER)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                if not created and keep < os.fstat(fd).st_size:
                    os.ftruncate(fd, keep)  # repair: drop the torn tail of the last write
                    os.fsync(fd)
                if keep == 0:
                    os.ftruncate(fd, 0)
                    os.write(fd, HEADER)
                    os.fsync(fd)
                    _fsync_dir(d)
            finally:
                os.close(fd)
        except StorageError:
            os.close(lock_fd)
            raise
        except OSError as e:
            os.close(lock_fd)
            raise StorageError(f"cannot open journal: {e.strerror}", path=d / JOURNAL) from None
        return cls(d, lock_fd, state, size)

    # -- writing (the writer's thread) -------------------------------------------------------

    async def start_appending(self) -> None:
        await asyncio.to_thread(self._start_appending_sync)

    def _start_appending_sync(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise StorageError(f"cannot open journal: {e.strerror}", path=self.path) from None

    async def append(self, data: bytes) -> None:
        """``append_sync`` off the event loop."""
        await asyncio.to_thread(self.append_sync, data)

    def append_sync(self, data: bytes) -> None:
        """Write ``data`` and fsync it (blocking: the writer's thread calls this). Raises
        ``StorageError``; after one, the journal is dead and what the failed call wrote is cut off
        again: after a failed write or fsync it is not known to be on disk, so a rerun must not
        take it for committed records."""
        fd = self._fd
        if fd < 0:
            raise StorageError("journal is not open for appending", path=self.path)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            self._cut_uncommitted()
            raise StorageError(f"cannot write journal: {e.strerror or e}", path=self.path) from None
        self._durable += len(data)

    def _cut_uncommitted(self) -> None:
        """Best effort after a failed append: close the descriptor and truncate the journal to
        its length at the last successful fsync."""
        fd, self._fd = self._fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                if os.fstat(fd).st_size > self._durable:
                    os.ftruncate(fd, self._durable)
                    os.fsync(fd)
            finally:
                os.close(fd)

    async def close(self) -> None:
        """Release the descriptor and the lock (the writer has stopped: ``Writer.run`` returns
        only once its thread has)."""
        try:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1
