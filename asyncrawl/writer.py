"""[4] The single writer: group-commits queued records to the store and reports them once durable.

Everything a run records (``sent`` intents, outcomes, the run's own records) passes through one
``Writer``; its thread is the only one that writes to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from .errors import StorageError
from .records import Record
from .store import Store


class Writer:
    """The single writer: group-commits queued records and reports them once durable.

    Records are queued by ``put`` (or ``commit``, to wait until one is durable). The writer's
    own thread takes everything queued since its last write and hands it to ``store.commit``
    (one transaction: group commit; two when ``ok`` results would hold back the intents that
    requests wait for, see ``_intents_first``), then hands each committed part back to the
    event loop, which resolves the ``commit`` futures and calls ``on_commit(records)``, in
    commit order. fsync never blocks the
    loop, and a commit costs the loop one wake-up, not a round trip per step. A batch that no
    ``commit`` waits for first lingers up to ``linger`` seconds for more (until a ``commit``
    arrives), so that results alone do not wake the thread for every record. On a storage error
    ``on_error(exc)`` is called once and nothing is written after it.
    """

    def __init__(
        self,
        store: Store,
        *,
        on_commit: Callable[[list[Record]], None],
        on_error: Callable[[StorageError], None],
        batch_limit: int = 1024,
        linger: float = 0.002,
    ) -> None:
        self.store = store
        self.on_commit = on_commit
        self.on_error = on_error
        self.batch_limit = batch_limit
        self.linger = linger  # seconds a batch no one waits for may wait for company
        self._lingering = False
        self._hurry = threading.Event()  # a commit() arrived while the thread lingers
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bug: BaseException | None = None  # raised by on_commit: re-raised by ``run``
        self._thread: threading.Thread | None = None
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
        """Run the writer's thread until ``close``, and return once it has stopped. If this is
        cancelled, the writer still commits what is queued, then stops."""
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(target=self._main, args=(done,), name="asyncrawl-writer",
                                  daemon=True)
        self._thread = thread
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

    async def join(self) -> None:
        """Wait until the writer's thread has stopped: before the store is closed, even when
        ``run`` was cancelled before the thread finished."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join)

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
                for part in _intents_first(batch):
                    self._post(self._done, part, *self._write(part))
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
        """Commit the batch to the store, unless an earlier batch failed: (durable, error)."""
        if self.failed is not None:
            return False, None
        try:
            self.store.commit([rec for rec, _ in batch])
            return True, None
        except StorageError as e:
            error = e
        except Exception as e:  # a bug: stop writing, as for a storage error
            error = StorageError(f"state writer failed: {type(e).__name__}: {e}",
                                 path=self.store.location)
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
_BARRIERS = frozenset({"run", "mark", "halt", "end"})  # records about everything before them


def _intents_first(batch: list[_Entry]) -> list[list[_Entry]]:
    """The transactions a batch is committed in: one, or two when records somebody waits for
    (the ``sent`` intents that hold requests back) share it with ``ok`` results nobody waits
    for. Then the others go first, in a small transaction, so that the requests leave without
    waiting for the payloads to be written, and the ``ok`` records follow in a second one.
    That order is as good as the queue's: an ``ok`` is an ID's last record in a run, so no
    record after it in the queue is about its ID, and a batch holding a record about
    everything before it (run, mark, halt, end) is not split."""
    deferred = [e for e in batch if e[0].kind == "ok" and e[1] is None]
    if not deferred or len(deferred) == len(batch) or all(e[1] is None for e in batch) \
            or any(e[0].kind in _BARRIERS for e in batch):
        return [batch] if batch else []
    return [[e for e in batch if e[0].kind != "ok" or e[1] is not None], deferred]


def _resolve(fut: asyncio.Future[None], value: None) -> None:
    if not fut.done():
        fut.set_result(value)
