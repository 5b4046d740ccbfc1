"""The journal: append-only records in the state directory, group commit + fsync, torn-tail repair,
and the lock that keeps two runs off one state directory.

Layout of a state directory::

    journal.jsonl   one JSON object per line; the first line is the format header
    lock            flock()ed by the run that owns the directory (holds its pid)

Record kinds (``k``): ``run`` (a run started), ``sent`` (a request for the ID is about to be
sent: durable *before* the request leaves), ``ok`` / ``failed`` / ``unavailable`` (an ID's
outcome, with its payload or error), ``billed`` (2xx answers of an ID left unsettled at the end
of a pass, so the bill adds up), ``halt`` (why a run stopped early), ``end`` (a run ended,
with the IDs whose request was cut off in flight). The latest outcome record of an ID is its
state, except that ``ok`` is final.

*In doubt* are the IDs whose request may have been billed without a result being recorded: in a
run that crashed, every ``sent`` ID with no outcome record after it; in a run that ended, the
IDs its ``end`` record lists. A later ``ok`` for such an ID makes it "possibly billed twice".

Only ``Writer`` (one task) appends. It takes every record queued since its last write, writes
them in one go and fsyncs once (group commit); only then are they *committed* and reported to the
crawler. A crash can only tear the last write: on open, a tail of invalid lines is cut off
(``repair``); an invalid line *followed by* a valid record is damage, reported with its offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import orjson

from .errors import JournalCorrupt, LockedError, StorageError

FORMAT_VERSION = 1
JOURNAL = "journal.jsonl"
LOCK = "lock"
HEADER = orjson.dumps({"asyncrawl_journal": FORMAT_VERSION}) + b"\n"

OUTCOME_KINDS = ("ok", "failed", "unavailable")


@dataclass(frozen=True, slots=True)
class Record:
    """One line of the journal. ``data`` is the parsed payload of an ``ok`` record."""

    kind: str
    id: str | None = None
    status: int | None = None
    error: str | None = None
    permanent: bool = False
    data: Any = None
    pass_no: int = 1
    tries: int = 0
    paid: int = 0
    ts: float = field(default_factory=time.time)
    extra: dict[str, Any] | None = None

    def encode(self) -> bytes:
        d: dict[str, Any] = {"k": self.kind}
        if self.id is not None:
            d["id"] = self.id
        if self.status is not None:
            d["s"] = self.status
        if self.kind in OUTCOME_KINDS:
            d["p"] = self.pass_no
            d["n"] = self.tries
            d["paid"] = self.paid
        elif self.kind == "billed":
            d["paid"] = self.paid
        if self.error is not None:
            d["e"] = self.error
        if self.permanent:
            d["perm"] = True
        d["ts"] = round(self.ts, 3)
        if self.extra:
            d.update(self.extra)
        if self.kind == "ok":
            d["data"] = self.data
        return orjson.dumps(d) + b"\n"


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
    """What the journal says, replayed: each ID's latest outcome, the last run's halt, and the
    IDs in doubt (id -> whether it was re-fetched since: "possibly billed twice")."""

    outcome: dict[str, str] = field(default_factory=dict)  # id -> ok | failed | perm | unavailable
    halt: dict[str, Any] | None = None
    billable_by_day: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    in_doubt: dict[str, bool] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)  # sent, no outcome yet, in the open run
    run_open: bool = False

    def apply(self, rec: dict[str, Any]) -> None:
        kind = rec["k"]
        if kind == "sent":
            self.in_flight.add(rec["id"])
        elif kind in OUTCOME_KINDS:
            item = rec["id"]
            self.in_flight.discard(item)
            if self.outcome.get(item) != "ok":
                self.outcome[item] = "perm" if kind == "failed" and rec.get("perm") else kind
            if kind == "ok" and item in self.in_doubt:
                self.in_doubt[item] = True
            if rec.get("paid"):
                self.billable_by_day[time.strftime("%Y-%m-%d", time.gmtime(rec["ts"]))] += rec["paid"]
        elif kind == "billed":
            self.billable_by_day[time.strftime("%Y-%m-%d", time.gmtime(rec["ts"]))] += rec["paid"]
        elif kind == "run":
            self.close_run(crashed=True)
            self.runs += 1
            self.halt = None
            self.run_open = True
        elif kind == "halt":
            self.halt = rec
        elif kind == "end":
            for item in rec.get("in_doubt", ()):
                self.in_doubt.setdefault(item, False)
            self.in_flight.clear()
            self.run_open = False

    def close_run(self, *, crashed: bool) -> None:
        """The open run is over (``crashed``: without its ``end`` record)."""
        if self.run_open and crashed:
            for item in self.in_flight:
                self.in_doubt.setdefault(item, False)
        self.in_flight.clear()
        self.run_open = False

    def counts(self) -> dict[str, int]:
        c = Counter(self.outcome.values())
        return {"ok": c["ok"], "failed": c["failed"] + c["perm"], "unavailable": c["unavailable"]}

    def is_settled(self, item: str) -> bool:
        return self.outcome.get(item) in ("ok", "unavailable")


def load_state(state_dir: Path, *, running: bool = False) -> State:
    """Replay the journal read-only (a torn tail is ignored, not repaired). Unless a run is
    ``running`` now, an open last run is one that crashed: its in-flight IDs are in doubt."""
    st = State()
    for _, rec in scan(state_dir / JOURNAL):
        st.apply(rec)
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
    """The open, locked journal of one run. Use ``Journal.open``; close with ``close``."""

    def __init__(self, state_dir: Path, lock_fd: int, state: State, file: Any, size: int = 0) -> None:
        self.state_dir = state_dir
        self.path = state_dir / JOURNAL
        self.state = state
        self._lock_fd = lock_fd
        self._file = file
        self._durable = size  # the journal's length when its last fsync returned

    def __repr__(self) -> str:
        return f"<Journal {self.path} ids={len(self.state.outcome)}>"

    @classmethod
    async def open(cls, state_dir: str | os.PathLike[str]) -> Journal:
        """Create or open the state directory: lock it, repair a torn tail, replay the state."""
        d = Path(state_dir)
        return await asyncio.to_thread(cls._open_sync, d)

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
            last = 0
            for offset, rec in scan(path):
                state.apply(rec)
                last = offset
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
        return cls(d, lock_fd, state, None, size)

    async def start_appending(self) -> None:
        try:
            self._file = await aiofiles.open(self.path, "ab")
        except OSError as e:
            raise StorageError(f"cannot open journal: {e.strerror}", path=self.path) from None

    async def append(self, data: bytes) -> None:
        """Write ``data`` and fsync it. Raises ``StorageError``; after one, the journal is dead and
        what the failed call wrote is cut off again: after a failed write or fsync it is not known
        to be on disk, so a rerun must not take it for committed records."""
        if self._file is None:
            raise StorageError("journal is not open for appending", path=self.path)
        try:
            await self._file.write(data)
            await self._file.flush()
            await asyncio.to_thread(os.fsync, self._file.fileno())
        except OSError as e:
            await self._cut_uncommitted()
            raise StorageError(f"cannot write journal: {e.strerror or e}", path=self.path) from None
        self._durable += len(data)

    async def _cut_uncommitted(self) -> None:
        """Best effort after a failed append: close the file (its buffer may still be flushed,
        so only then) and truncate the journal to its length at the last successful fsync."""
        file, self._file = self._file, None
        with contextlib.suppress(OSError):
            await file.close()

        def cut() -> None:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                if os.fstat(fd).st_size > self._durable:
                    os.ftruncate(fd, self._durable)
                    os.fsync(fd)
            finally:
                os.close(fd)

        with contextlib.suppress(OSError):
            await asyncio.to_thread(cut)

    async def close(self) -> None:
        try:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    await self._file.close()
                self._file = None
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1


class Writer:
    """The single writer task: group-commits queued records and reports them once durable.

    ``on_commit(records)`` is called after the fsync that made them durable returned. On a
    storage error ``on_error(exc)`` is called once and nothing is written after it.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        on_commit: Callable[[list[Record]], None],
        on_error: Callable[[StorageError], None],
        batch_limit: int = 1024,
    ) -> None:
        self.journal = journal
        self.on_commit = on_commit
        self.on_error = on_error
        self.batch_limit = batch_limit
        self._queue: asyncio.Queue[tuple[Record, asyncio.Future[bool] | None] | None] = (
            asyncio.Queue())
        self.failed: StorageError | None = None
        self.commits = 0
        self.written = 0

    def __repr__(self) -> str:
        return (f"<Writer queued={self._queue.qsize()} commits={self.commits} "
                f"written={self.written} failed={self.failed is not None}>")

    def put(self, record: Record) -> None:
        """Queue a record (never blocks; the writer batches what accumulates)."""
        self._queue.put_nowait((record, None))

    async def commit(self, record: Record) -> bool:
        """Queue a record and wait until it is durable: ``True``, or ``False`` if it cannot be."""
        if self.failed is not None:
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((record, fut))
        return await fut

    def close(self) -> None:
        """Ask the writer to commit what is queued and stop."""
        self._queue.put_nowait(None)

    async def run(self) -> None:
        q = self._queue
        stop = False
        while not stop:
            first = await q.get()
            batch: list[Record] = []
            waiting: list[asyncio.Future[bool]] = []
            entry = first
            while True:
                if entry is None:
                    stop = True
                else:
                    batch.append(entry[0])
                    if entry[1] is not None:
                        waiting.append(entry[1])
                if len(batch) >= self.batch_limit or q.empty():
                    break
                entry = q.get_nowait()
            durable = False
            if batch and self.failed is None:
                try:
                    await self.journal.append(b"".join(r.encode() for r in batch))
                    durable = True
                except StorageError as e:
                    self.failed = e
                    self.on_error(e)
            for fut in waiting:
                if not fut.done():
                    fut.set_result(durable)
            if durable:
                self.commits += 1
                self.written += len(batch)
                self.on_commit(batch)
