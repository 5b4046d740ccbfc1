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

Only ``Writer`` (one thread) appends. It takes every record queued since its last write, writes
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
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from .errors import JournalCorrupt, LockedError, StorageError

FORMAT_VERSION = 1
JOURNAL = "journal.jsonl"
LOCK = "lock"
HEADER = orjson.dumps({"asyncrawl_journal": FORMAT_VERSION}) + b"\n"

OUTCOME_KINDS = ("ok", "failed", "unavailable")


class _RecordFields(NamedTuple):
    kind: str
    id: str | None
    status: int | None
    error: str | None
    permanent: bool
    data: Any
    pass_no: int
    tries: int
    paid: int
    ts: float
    extra: dict[str, Any] | None
    raw: bytes | None


class Record(_RecordFields):
    """One line of the journal (immutable; a tuple, because a run makes two per request).

    The payload of an ``ok`` record is ``raw``, the answer's body as received (written as is:
    it parsed as JSON and has no line break), or else ``data``, the parsed payload, which is
    serialised again. ``data`` may also ride along for the ``on_result`` hook."""

    __slots__ = ()

    def __new__(cls, kind: str, id: str | None = None, *, status: int | None = None,
                error: str | None = None, permanent: bool = False, data: Any = None,
                pass_no: int = 1, tries: int = 0, paid: int = 0, ts: float | None = None,
                extra: dict[str, Any] | None = None, raw: bytes | None = None) -> Record:
        return tuple.__new__(cls, (kind, id, status, error, permanent, data, pass_no, tries,
                                   paid, time.time() if ts is None else ts, extra, raw))

    @classmethod
    def outcome(cls, kind: str, id: str, status: int | None, error: str | None, permanent: bool,
                data: Any, pass_no: int, tries: int, paid: int, raw: bytes | None) -> Record:
        """An outcome record, made without keyword handling (two records per request)."""
        return tuple.__new__(cls, (kind, id, status, error, permanent, data, pass_no, tries,
                                   paid, time.time(), None, raw))

    @classmethod
    def sent(cls, id: str) -> Record:
        """The record that a request for ``id`` is about to leave."""
        return cls.outcome("sent", id, None, None, False, None, 1, 0, 0, None)

    def encode(self) -> bytes:
        kind = self.kind
        d: dict[str, Any] = {"k": kind}
        if self.id is not None:
            d["id"] = self.id
        if self.status is not None:
            d["s"] = self.status
        if kind in OUTCOME_KINDS:
            d["p"] = self.pass_no
            d["n"] = self.tries
            d["paid"] = self.paid
        elif kind == "billed":
            d["paid"] = self.paid
        if self.error is not None:
            d["e"] = self.error
        if self.permanent:
            d["perm"] = True
        d["ts"] = round(self.ts, 3)
        if self.extra:
            d.update(self.extra)
        if kind == "ok":
            raw = self.raw
            if raw is not None and b"\n" not in raw:  # valid JSON (it parsed): splice it in
                return orjson.dumps(d)[:-1] + b',"data":' + raw + b"}\n"
            d["data"] = self.data if raw is None else orjson.loads(raw)
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
    job: dict[str, Any] | None = None  # what the job fetches (the latest run that said)

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
            self._bill(rec)
        elif kind == "billed":
            self._bill(rec)
        elif kind == "run":
            if "job" in rec:
                self.job = rec["job"]
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

    def _bill(self, rec: dict[str, Any]) -> None:
        if rec.get("paid"):
            self.billable_by_day[time.strftime("%Y-%m-%d", time.gmtime(rec["ts"]))] += rec["paid"]

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

    def __init__(self, state_dir: Path, lock_fd: int, state: State, size: int = 0) -> None:
        self.state_dir = state_dir
        self.path = state_dir / JOURNAL
        self.state = state
        self._lock_fd = lock_fd
        self._fd = -1  # the append descriptor (``start_appending``)
        self._writer_thread: threading.Thread | None = None
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
        return cls(d, lock_fd, state, size)

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
        """Release the descriptor and the lock, once the writer's thread has stopped."""
        thread, self._writer_thread = self._writer_thread, None
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join)
        try:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1


class Writer:
    """The single writer: group-commits queued records and reports them once durable.

    Records are queued by ``put`` (or ``commit``, to wait until one is durable). The writer's
    own thread takes everything queued since its last write, encodes it, writes it in one go and
    fsyncs once (group commit), then hands the batch back to the event loop, which resolves the
    ``commit`` futures and calls ``on_commit(records)``, in journal order. fsync never blocks the
    loop, and a commit costs the loop one wake-up, not a round trip per step. A batch that no
    ``commit`` waits for first lingers up to ``linger`` seconds for more (until a ``commit``
    arrives), so that results alone do not wake the thread for every record. On a storage error
    ``on_error(exc)`` is called once and nothing is written after it.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        on_commit: Callable[[list[Record]], None],
        on_error: Callable[[StorageError], None],
        batch_limit: int = 1024,
        linger: float = 0.002,
    ) -> None:
        self.journal = journal
        self.on_commit = on_commit
        self.on_error = on_error
        self.batch_limit = batch_limit
        self.linger = linger  # seconds a batch no one waits for may wait for company
        self._lingering = False
        self._hurry = threading.Event()  # a commit() arrived while the thread lingers
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bug: BaseException | None = None  # raised by on_commit: re-raised by ``run``
        self.failed: StorageError | None = None
        self.commits = 0
        self.written = 0

    def __repr__(self) -> str:
        return (f"<Writer queued={self._queue.qsize()} commits={self.commits} "
                f"written={self.written} failed={self.failed is not None}>")

    def put(self, record: Record) -> None:
        """Queue a record (never blocks; the writer batches what accumulates)."""
        self._queue.put((record, None))

    def commit(self, record: Record) -> asyncio.Future[bool]:
        """Queue a record; the future says when it is durable: ``True``, or ``False`` if it
        cannot be."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self.failed is not None:
            fut.set_result(False)
        else:
            self._queue.put((record, fut))
            if self._lingering:
                self._hurry.set()
        return fut

    def close(self) -> None:
        """Ask the writer to commit what is queued and stop."""
        self._queue.put(None)

    async def run(self) -> None:
        """Run the writer's thread until ``close``. If this is cancelled, the writer still commits
        what is queued, then stops; the journal's ``close`` waits for it."""
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(target=self._main, args=(done,), name="asyncrawl-writer",
                                  daemon=True)
        self.journal._writer_thread = thread
        thread.start()
        try:
            await asyncio.shield(done)
        finally:
            if not done.done():  # cancelled
                self.close()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(done)
        if self._bug is not None:
            raise self._bug

    # -- the writer's thread -------------------------------------------------------------------

    def _main(self, done: asyncio.Future[None]) -> None:
        q = self._queue
        try:
            stop = False
            while not stop:
                batch: list[_Entry] = []
                stop = self._take(batch, q.get())
                if not stop and len(batch) < self.batch_limit \
                        and all(fut is None for _, fut in batch) and self._linger():
                    # Nobody waits for these: more gathered meanwhile, rather than a wake-up
                    # (and the GIL taken from the event loop) for every record.
                    stop = self._take(batch, q.get_nowait())
                if batch:
                    self._post(self._done, batch, *self._write(batch))
        finally:
            self._post(_resolve, done, None)

    def _take(self, batch: list[_Entry], entry: _Entry | None) -> bool:
        """Add ``entry`` and what else is queued (up to the batch limit) to ``batch``; ``True``
        once ``close`` was reached."""
        while entry is not None:
            batch.append(entry)
            if len(batch) >= self.batch_limit:
                return False
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                return False
        return True

    def _linger(self) -> bool:
        """Wait up to ``linger`` seconds, less if a ``commit`` arrives; ``True`` if anything
        was queued meanwhile."""
        self._hurry.clear()
        self._lingering = True
        if self._queue.empty():  # (a commit() queued before the flag was up is seen here)
            self._hurry.wait(self.linger)
        self._lingering = False
        return not self._queue.empty()

    def _write(self, batch: list[_Entry]) -> tuple[bool, StorageError | None]:
        """Append the batch and fsync it, unless an earlier batch failed: (durable, error)."""
        if self.failed is not None:
            return False, None
        try:
            self.journal.append_sync(b"".join([rec.encode() for rec, _ in batch]))
            return True, None
        except StorageError as e:
            error = e
        except Exception as e:  # a bug: stop writing, as for a storage error
            error = StorageError(f"journal writer failed: {type(e).__name__}: {e}",
                                 path=self.journal.path)
        self.failed = error
        return False, error

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop ----------------------------------------------------------------

    def _done(self, batch: list[_Entry], durable: bool, error: StorageError | None) -> None:
        if error is not None:
            self.on_error(error)
        for _, fut in batch:
            if fut is not None and not fut.done():
                fut.set_result(durable)
        if durable:
            self.commits += 1
            self.written += len(batch)
            try:
                self.on_commit([e[0] for e in batch])
            except BaseException as e:  # a bug in the caller's bookkeeping: surface it in run()
                self._bug = self._bug or e


_Entry = tuple[Record, "asyncio.Future[bool] | None"]


def _resolve(fut: asyncio.Future[None], value: None) -> None:
    if not fut.done():
        fut.set_result(value)
