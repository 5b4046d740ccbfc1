"""[4] The single writer: group-commits queued records to the store and reports them once durable.

Everything a run records (``sent`` intents, outcomes, the run's own records) passes through one
writer, the only one that writes to the store: ``Writer``, whose thread commits to a store
that writes in the run's own process (PostgreSQL; SQLite where no writing process can start),
or ``ProcessWriter``, which hands batches to a store's writing process (SQLite's, ``sqlproc``)
from the event loop itself, with no thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .errors import StorageError
from .records import Commit, Record
from .store import Store

log = logging.getLogger("asyncrawl")

# Records queued and not yet reported past which a worker starts no new request until the
# store has caught up (to half of it): what a crash can lose of what was answered stays within
# ``concurrency`` plus this, however slow the store (SPEC §5), instead of growing with the time
# a slow disk or a starved writing process falls behind (bench/README.md, stop 45).
BACKLOG = 1024
# ... or past this many bytes of payloads queued (1,024 answers of 8 MiB, max_body_bytes,
# held 8 GiB in memory while a store fell behind)
BACKLOG_BYTES = 64 << 20
STALL_CHECK = 5.0  # seconds between two looks at whether the store answers (``_check_stall``)
# ... or once the oldest result sent to the writing process has waited this long to be applied
# (a database another program holds locked: the ``sent`` intents still went to the intent
# log, every request went on, and what it bought was lost at a crash, to be bought again)
APPLY_LAG = 2.0


class _Reporting:
    """What both writers keep of what they report: ``on_commit`` for each durable part,
    ``on_error`` once, their counts, a bug of ``on_commit`` to raise in ``run``, and the
    backlog (records queued and not yet reported durable or failed) that ``behind`` and
    ``caught_up`` gate new requests on."""

    def __init__(self, on_commit: Callable[[list[Record]], None],
                 on_error: Callable[[StorageError], None]) -> None:
        self.on_commit = on_commit
        self.on_error = on_error
        self.failed: StorageError | None = None
        self.commits = 0
        self.applied = 0  # commits of the store itself (not an intent log's): what a stall stops
        self.written = 0
        self.backlog = 0  # records queued, not yet reported (the event loop's thread counts)
        self.backlog_limit = BACKLOG
        self.backlog_bytes = 0  # the bytes of their payloads (``raw``)
        self.bytes_limit = BACKLOG_BYTES
        self._waiting: list[asyncio.Future[None]] = []  # ``caught_up`` callers
        self._bug: BaseException | None = None  # raised by on_commit: re-raised by ``run``
        self._commits_seen = 0  # (``_check_stall``: the commits at its last look, and how
        self._still = 0  # many looks in a row have seen them not move while records waited)
        self.stall_hint = "a slow commit, a hung disk, or a database that holds its locks"

    @property
    def stalled(self) -> bool:
        """Whether the store has answered nothing while records waited for it, two looks of
        ``_check_stall`` in a row (``STALL_CHECK`` s apart: what it warns of), and still
        nothing since the last look, with records still waiting (it may have answered
        since: the next look would say so)."""
        return self._still >= 2 and self.applied == self._commits_seen and self.backlog > 0

    def behind(self) -> bool:
        """Whether the store is so far behind that no new request should start. Never once
        the writer has failed: ``caught_up`` would not wait then, and a worker that asked
        again would spin without ever letting the loop report the failure (the thread's
        writer marks itself failed before the loop hears of it); it hears of it from its
        next ``commit`` instead."""
        return self.failed is None and (self.backlog >= self.backlog_limit
                                        or self.backlog_bytes >= self.bytes_limit
                                        or self._lagging())

    def _lagging(self) -> bool:
        """Whether what was handed to the store waits too long to be applied (``APPLY_LAG``)."""
        return False

    async def caught_up(self) -> None:
        """Wait until the backlog is down to half the limit (or the writer failed: nothing
        more is written, and the caller hears of it from its next ``commit``)."""
        while not self._caught_up():
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            await fut

    def _caught_up(self) -> bool:
        return (self.backlog <= self.backlog_limit // 2
                and self.backlog_bytes <= self.bytes_limit // 2
                and not self._lagging()) or self.failed is not None

    def _queued(self, record: Record) -> None:
        self.backlog += 1
        if record.raw is not None:
            self.backlog_bytes += len(record.raw)

    def _reported(self, entries: list[_Entry]) -> None:
        """``entries`` (queued records) were reported (durable or failed): off the backlog."""
        self.backlog -= len(entries)
        self.backlog_bytes -= sum(len(rec.raw) for rec, _ in entries if rec.raw is not None)
        if self._waiting and self._caught_up():
            waiting, self._waiting = self._waiting, []
            for fut in waiting:
                if not fut.done():
                    fut.set_result(None)

    def _check_stall(self) -> None:
        """Every ``STALL_CHECK`` seconds: say when the store has answered nothing for that long
        (twice in a row) while records wait for it, which stops the run (no request counts,
        and soon none starts) with no other sign; and when it answers again."""
        seen, stalled = self._commits_seen, self._still >= 2  # (the store's own commits:
        # an intent log that takes the ``sent`` records while the database is locked is no
        # sign that the results are written)
        self._still = self._still + 1 if self.applied == seen and self.backlog else 0
        self._commits_seen = self.applied
        if self._still == 2:
            log.warning("the state store has not answered for %.0f s (%s): no request counts, "
                        "and no new one starts, until it does (a stop waits for it too, but a "
                        "second signal to `asyncrawl run` ends it; `kill -9` of the run is "
                        "safe: what is committed is kept)",
                        STALL_CHECK * self._still, self.stall_hint)
        elif stalled and not self._still and self.applied > seen and self.failed is None:
            log.warning("the state store answers again")

    def _count(self, records: list[Record]) -> None:
        """``records`` are durable (their futures resolved): count them, tell ``on_commit``."""
        self.commits += 1
        self.written += len(records)
        try:
            self.on_commit(records)
        except BaseException as e:  # a bug in the caller's bookkeeping: surface it in run()
            self._bug = self._bug or e


class Writer(_Reporting):
    """The single writer: group-commits queued records and reports them once durable.

    Records are queued by ``put`` (or ``commit``, to wait until one is durable). The writer's
    own thread takes everything queued since its last write and hands it to ``store.commit``
    (one transaction: group commit), then hands each committed part back to the event loop,
    which resolves the ``commit`` futures and calls ``on_commit(records)``, in commit order
    (without the ``sent`` intents the store refused: another process of the job holds the ID).
    fsync never blocks the loop, and a commit costs the loop one wake-up, not a round trip per
    step. The ``ok`` results that nobody waits for are held back up to ``hold`` seconds (at
    most ``hold_limit`` of them) and committed together, so that the ``sent`` intents, which
    requests wait for, go in small transactions of their own instead of waiting behind the
    payloads (``_hold_back``). A batch that no ``commit`` waits for lingers up to ``linger``
    seconds for more (until a ``commit`` arrives), so that results alone do not wake the thread
    for every record. On a storage error ``on_error(exc)`` is called once and nothing is
    written after it.
    """

    def __init__(
        self,
        store: Store,
        *,
        on_commit: Callable[[list[Record]], None],
        on_error: Callable[[StorageError], None],
        batch_limit: int = 1024,
        linger: float = 0.002,
        hold: float = 0.02,
        hold_limit: int = 256,
    ) -> None:
        super().__init__(on_commit, on_error)
        self.store = store
        self.batch_limit = batch_limit
        self.linger = linger  # seconds a batch no one waits for may wait for company
        self.hold = hold  # seconds ok results may be held back behind intents (_hold_back)
        self.hold_limit = min(hold_limit, batch_limit)
        # wakes the thread from a nap (a commit() or close()): a lock held while no wake-up is
        # pending, released to ring it (a C call; threading.Event.set costs the loop ~6 us)
        self._bell = threading.Lock()
        self._bell.acquire()
        self._napping = False  # the thread naps (or is about to): a commit() must wake it
        self._asked = 0  # records queued by commit() (the loop's thread counts them)
        self._taken = 0  # ... and taken by the writer's thread (which counts these)
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return (f"<Writer queued={self._queue.qsize()} commits={self.commits} "
                f"written={self.written} failed={self.failed is not None}>")

    def put(self, record: Record) -> None:
        """Queue a record (never blocks; the writer batches what accumulates)."""
        self._queued(record)
        self._queue.put((record, None))

    def commit(self, record: Record) -> asyncio.Future[Commit]:
        """Queue a record; the future says when it is durable (``Commit.DURABLE``), or that it
        cannot be (``FAILED``), or that the store refused it (``REFUSED``: a ``sent`` intent)."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self.failed is not None:
            fut.set_result(Commit.FAILED)
        else:
            self._queued(record)
            self._queue.put((record, fut))
            self._asked += 1
            if self._napping:  # (only when needed: the thread is woken, the GIL asked for)
                self._ring()
        return fut

    def close(self) -> None:
        """Ask the writer to commit what is queued (and held back) and stop."""
        self._queue.put(None)
        self._ring()

    def _ring(self) -> None:
        """Wake the writer's thread from its nap, or cut its next one short. (Only the event
        loop's thread rings, and the writer's only takes the lock: no race between the two
        calls.)"""
        if self._bell.locked():  # (else rung already)
            self._bell.release()

    async def run(self) -> None:
        """Run the writer's thread until ``close``, and return once it has stopped. If this is
        cancelled, the writer still commits what is queued, then stops."""
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(target=self._main, args=(done,), name="asyncrawl-writer",
                                  daemon=True)
        self._thread = thread
        thread.start()
        await _wait_out(done, self.close, self._check_stall)
        if self._bug is not None:
            raise self._bug

    async def join(self) -> None:
        """Wait until the writer's thread has stopped: before the store is closed, even when
        ``run`` was cancelled before the thread finished."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join)

    # -- the writer's thread -------------------------------------------------------------------

    def _main(self, done: asyncio.Future[None]) -> None:
        q = self._queue
        held: list[_Entry] = []  # ok results held back, oldest first (see _hold_back)
        due = 0.0  # when the oldest of them is to be committed
        try:
            stop = False
            while not stop:
                batch, held = held, []
                carried = bool(batch)
                if carried:  # wait for company until they are due, or a commit() arrives
                    wait = due - time.monotonic()
                    if wait > 0 and len(batch) < self.hold_limit:
                        self._nap(wait)  # (records put() meanwhile do not wake it)
                    with contextlib.suppress(queue.Empty):
                        stop = self._take(batch, q.get_nowait())
                else:
                    stop = self._take(batch, q.get())
                    if not stop and len(batch) < self.batch_limit \
                            and all(fut is None for _, fut in batch) and self._linger():
                        # Nobody waits for these: more gathered meanwhile, rather than a
                        # wake-up (and the GIL taken from the event loop) for every record.
                        stop = self._take(batch, q.get_nowait())
                now, later = _hold_back(batch)
                if later and not stop and len(later) < self.hold_limit:
                    if not carried:
                        due = time.monotonic() + self.hold
                    if time.monotonic() < due:
                        held, later = later, []
                for part in (now, later):
                    if part:
                        self._write(part)
        finally:
            self._post(_resolve, done, None)

    def _take(self, batch: list[_Entry], entry: _Entry | None) -> bool:
        """Add ``entry`` and what else is queued (up to the batch limit) to ``batch``; ``True``
        once ``close`` was reached."""
        while entry is not None:
            batch.append(entry)
            if entry[1] is not None:
                self._taken += 1
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
        self._nap(self.linger)
        return not self._queue.empty()

    def _nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if a ``commit`` (or ``close``) arrives."""
        self._bell.acquire(blocking=False)  # (a ring from before this nap: not for it)
        self._napping = True
        if self._asked == self._taken:  # (a commit() queued before the flag was up is seen here)
            self._bell.acquire(timeout=seconds)
        self._napping = False

    def _write(self, batch: list[_Entry]) -> None:
        """Commit the batch to the store, unless an earlier batch failed, and report it back
        to the loop (``_done``). The first error is the one reported; nothing is written after
        it."""
        if self.failed is not None:
            self._post(self._done, batch, False, None, _NONE)
            return
        try:
            self._post(self._done, batch, True, None,
                       self.store.commit([rec for rec, _ in batch]))
            return
        except StorageError as e:
            error = e
        except Exception as e:  # a bug: stop writing, as for a storage error
            error = StorageError(f"state writer failed: {type(e).__name__}: {e}",
                                 path=self.store.location)
        self.failed = error
        self._post(self._done, batch, False, error, _NONE)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop ----------------------------------------------------------------

    def _done(self, batch: list[_Entry], durable: bool, error: StorageError | None,
              refused: frozenset[str]) -> None:
        if error is not None:
            self.on_error(error)
        self._reported(batch)
        if refused:  # (a shared job, after this process stalled past its leases: rare)
            kept = []
            for rec, fut in batch:
                if rec.kind == "sent" and rec.id in refused:
                    if fut is not None and not fut.done():
                        fut.set_result(Commit.REFUSED)
                else:
                    kept.append((rec, fut))
            batch = kept
        _answer(batch, Commit.DURABLE if durable else Commit.FAILED)
        if durable:
            self._count([e[0] for e in batch])
            self.applied += 1


class Process(Protocol):
    """A store's writing process, seen from the event loop (``sqlproc.WriterProcess``)."""

    logged: frozenset[str]  # the kinds of record it makes durable first, on their own

    @property
    def pid(self) -> int: ...

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_answer: Callable[[tuple[str, int, str | None] | None], None]) -> None: ...

    def detach(self) -> None: ...

    def send(self, records: Iterable[Record]) -> int: ...

    def gone(self) -> StorageError: ...


class ProcessWriter(_Reporting):
    """The single writer of a store whose writes a process of its own makes (``Process``): the
    same calls as ``Writer``, all on the event loop, and no thread.

    What is queued in one pass of the loop goes down the pipe as one batch at the end of it
    (group commit, and one system call). The process answers twice for a batch: once the
    records of the kinds it makes durable first (``sent`` intents, which requests wait for)
    are (``logged``), then once it has committed all of it (``applied``); each part is
    reported (``commit`` futures resolved, ``on_commit(records)``) when its answer comes, in
    the order sent. Its first error is reported once (``on_error``); nothing counts after
    it."""

    def __init__(self, proc: Process, *, on_commit: Callable[[list[Record]], None],
                 on_error: Callable[[StorageError], None]) -> None:
        super().__init__(on_commit, on_error)
        self.proc = proc
        self.stall_hint = (f"its writing process, pid {proc.pid}: stopped? a hung disk? a very "
                           "slow commit?")
        self._logged = proc.logged
        self._batch: list[_Entry] = []  # queued since the last batch went
        self._due = False  # a call to _flush is scheduled
        self._loop: asyncio.AbstractEventLoop | None = None  # once ``run`` has started
        # batches sent: their logged part until it is, all of them until applied
        self._to_log: collections.deque[tuple[int, list[_Entry]]] = collections.deque()
        # (and when each was sent: ``_lagging``)
        self._to_apply: collections.deque[tuple[int, list[_Entry], float]] = collections.deque()
        self._closed = False
        self._idle: asyncio.Future[None] | None = None  # closed, and everything answered

    def __repr__(self) -> str:
        return (f"<ProcessWriter queued={len(self._batch)} unanswered={len(self._to_apply)} "
                f"commits={self.commits} written={self.written} "
                f"failed={self.failed is not None}>")

    def put(self, record: Record) -> None:
        """Queue a record (never blocks)."""
        self._queued(record)
        self._batch.append((record, None))
        if not self._due and self._loop is not None:
            self._due = True
            self._loop.call_soon(self._flush)

    def commit(self, record: Record) -> asyncio.Future[Commit]:
        """Queue a record; the future says when it is durable (``Commit.DURABLE``), or that it
        cannot be (``FAILED``)."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self.failed is not None:
            fut.set_result(Commit.FAILED)
            return fut
        self._queued(record)
        self._batch.append((record, fut))
        if not self._due and self._loop is not None:
            self._due = True
            self._loop.call_soon(self._flush)
        return fut

    def close(self) -> None:
        """Send what is queued; ``run`` returns once everything sent is answered for."""
        self._closed = True
        self._flush()

    async def run(self) -> None:
        """Hand batches to the process until ``close``, and return once it has answered for
        all of them. If this is cancelled, what is queued is still sent and waited for."""
        loop = self._loop = asyncio.get_running_loop()
        idle = self._idle = loop.create_future()
        self.proc.attach(loop, self._answer)
        try:
            self._flush()
            await _wait_out(idle, self.close, self._check_stall)
        finally:
            self.proc.detach()
        if self._bug is not None:
            raise self._bug

    async def join(self) -> None:
        """(No thread to wait for: ``run`` has returned once nothing is left to answer.)"""

    def _flush(self) -> None:
        self._due = False
        if self._loop is None:  # (``run`` has not started: it sends what is queued)
            return
        batch, self._batch = self._batch, []
        if batch and self.failed is not None:
            _answer(batch, Commit.FAILED)
            self._reported(batch)
        elif batch:
            try:
                seq = self.proc.send(rec for rec, _ in batch)
            except Exception as e:  # (a callback's: raised, it would leave the batch's waiters
                self._batch = batch + self._batch  # unanswered, and the run waiting for ever)
                self._fail(e if isinstance(e, StorageError) else StorageError(
                    f"cannot hand records to the writing process: {e.__class__.__name__}: {e}"))
                return
            logged = [e for e in batch if e[0].kind in self._logged]
            if logged:
                self._to_log.append((seq, logged))
                batch = [e for e in batch if e[0].kind not in self._logged]
            self._to_apply.append((seq, batch, time.monotonic()))
        self._check_idle()

    def _answer(self, answer: tuple[str, int, str | None] | None) -> None:
        """An answer of the process (``None``: it has gone)."""
        if answer is None:
            self._fail(self.proc.gone())
            return
        what, seq, error = answer
        if error is not None:
            self._fail(StorageError(error))  # (the message names the path)
            return
        # (it answers "logged" for a batch before "applied")
        pending: collections.deque[Any] = self._to_log if what == "logged" else self._to_apply
        while pending and pending[0][0] <= seq:
            self._durable(pending.popleft()[1])
        if what != "logged":
            self.applied += 1  # (one apply: one commit of the database)
            self._reported([])  # (waiters held by ``_lagging`` alone: no entries to report)
        self._check_idle()

    def _lagging(self) -> bool:
        return bool(self._to_apply) and time.monotonic() - self._to_apply[0][2] > APPLY_LAG

    def _durable(self, entries: list[_Entry]) -> None:
        if not entries:
            return
        _answer(entries, Commit.DURABLE)
        self._reported(entries)
        self._count([e[0] for e in entries])

    def _fail(self, error: StorageError) -> None:
        """Nothing sent and not yet answered for, nor anything after it, is durable."""
        if self.failed is None:
            self.failed = error
            self.on_error(error)
        while self._to_log:
            _answer(self._to_log.popleft()[1], Commit.FAILED)
        while self._to_apply:
            _answer(self._to_apply.popleft()[1], Commit.FAILED)
        batch, self._batch = self._batch, []
        _answer(batch, Commit.FAILED)
        self.backlog = self.backlog_bytes = 0  # (all of it, queued or sent: none is durable)
        self._reported([])
        self._check_idle()

    def _check_idle(self) -> None:
        idle = self._idle
        if self._closed and idle is not None and not idle.done() and not (
                self._batch or self._to_apply or self._to_log):
            idle.set_result(None)


async def _wait_out(done: asyncio.Future[None], close: Callable[[], None],
                    look: Callable[[], None]) -> None:
    """Wait until ``done``, calling ``look`` every ``STALL_CHECK`` seconds; if this is cancelled
    first, ``close`` the writer and still wait (what is queued is committed), then let the
    cancellation through."""
    try:
        while not done.done():
            await asyncio.wait([done], timeout=STALL_CHECK)  # (a timeout cancels nothing)
            look()
    finally:
        if not done.done():  # cancelled
            close()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(done)


def _answer(entries: list[_Entry], result: Commit) -> None:
    """Resolve the ``commit`` futures of ``entries`` (those not resolved yet)."""
    for _, fut in entries:
        if fut is not None and not fut.done():
            fut.set_result(result)


_Entry = tuple[Record, "asyncio.Future[Commit] | None"]
AnyWriter = Writer | ProcessWriter
_NONE: frozenset[str] = frozenset()
# records about everything before them (``sync``: only that it is durable)
_BARRIERS = frozenset({"run", "mark", "halt", "end", "sync"})


def _hold_back(batch: list[_Entry]) -> tuple[list[_Entry], list[_Entry]]:
    """What of a batch to commit now, and the ``ok`` results that nobody waits for, which may
    be held back (up to ``hold`` seconds, ``hold_limit`` records) so that the ``sent`` intents
    that requests wait for are committed in small transactions of their own instead of waiting
    behind the payloads. That order is as good as the queue's: an ``ok`` is an ID's last record
    in a run, so no record after it in the queue is about its ID, and a batch holding a record
    about everything before it (run, mark, halt, end) is committed whole, held results first."""
    if any(e[0].kind in _BARRIERS for e in batch):
        return batch, []
    later = [e for e in batch if e[1] is None and e[0].kind == "ok"]
    if not later:
        return batch, []
    return [e for e in batch if e[1] is not None or e[0].kind != "ok"], later


def _resolve(fut: asyncio.Future[None], value: None) -> None:
    if not fut.done():
        fut.set_result(value)
