"""[2] What waits to be tried: the bounded ID queue, and the parking heap of IDs waiting for
their next try.

The producer and the parking feeder put ``Item``\\ s on the ``IdQueue``; the workers take them.
A worker never sleeps through a backoff: an ID that must wait is *parked* (``Parking``), and the
feeder puts it back on the queue when it is due, while the worker takes the next ID at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Item:
    """One ID travelling through a pass."""

    id: str
    tries: int = 0
    paid: int = 0
    unusable: int = 0  # paid (2xx) answers with no usable body (did not parse, cut short, too
    #                    large: ``Attempt.unusable``), in every pass and run so far
    suspect: bool = False  # failed in an earlier run: its failures are no sign of an outage
    # in pass 2, answered a skip in pass 1 (a 404): a 5xx or no answer now is a sign of one
    witness: bool = False
    sent: bool = False  # a request for it left in this pass (even if the try was not charged)
    covered: bool = False  # its intent was durable once in this pass (the IDs file's frontier)
    block: int = -1  # the block of the IDs file it was read in (pass 1 of a file), else -1
    paid_by: dict[str, int] | None = None  # paid answers by API key fingerprint ([request] keys)


class IdQueue:
    """The FIFO between the producer (bounded) and the parking feeder (not) and the workers.

    ``put`` waits while the queue holds ``maxsize`` items: the producer reads the IDs list no
    faster than the workers take them. A putter that found the queue full is woken once the
    queue has drained to half, not at every ``get``: it then refills it in one go instead of
    waking up (a task switch) once per ID. ``push`` never waits: an ID due for its retry is
    already in memory, and must not queue up behind a producer that refills the queue first.
    A getter is woken per item. Only the event loop's thread may use it."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 2:
            raise ValueError("maxsize must be at least 2")
        self.maxsize = maxsize
        self._low = maxsize // 2
        self._items: deque[Item] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: list[asyncio.Future[None]] = []

    def __repr__(self) -> str:
        return (f"<IdQueue size={len(self._items)}/{self.maxsize} getters={len(self._getters)} "
                f"putters={len(self._putters)}>")

    def qsize(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def items(self) -> list[Item]:
        """The queued items, in order (for the end-of-pass bookkeeping)."""
        return list(self._items)

    async def put(self, item: Item) -> None:
        while len(self._items) >= self.maxsize:
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            try:
                await fut
            except BaseException:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._putters.remove(fut)
                raise
        self.push(item)

    def push(self, item: Item) -> None:
        """Add ``item`` now, past the bound (a due retry)."""
        self._items.append(item)
        self._wake_getter()

    async def get(self) -> Item:
        items = self._items
        while not items:
            fut = asyncio.get_running_loop().create_future()
            self._getters.append(fut)
            try:
                await fut
            except BaseException:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._getters.remove(fut)
                if items and not fut.cancelled():  # woken, then cancelled: pass the wake-up on
                    self._wake_getter()
                raise
        return self._pop()

    def get_nowait(self) -> Item | None:
        """The next item, or ``None`` if there is none now (``get`` without a coroutine, for
        the common case of a queue the producer keeps full)."""
        return self._pop() if self._items else None

    def _pop(self) -> Item:
        items = self._items
        item = items.popleft()
        if self._putters and len(items) <= self._low:
            putters, self._putters = self._putters, []
            for fut in putters:
                if not fut.done():
                    fut.set_result(None)
        return item

    def _wake_getter(self) -> None:
        getters = self._getters
        while getters:
            fut = getters.popleft()
            if not fut.done():
                fut.set_result(None)
                return


class Parking:
    """A delay heap of IDs waiting for their next try; ``run`` feeds due ones to the queue."""

    def __init__(self, queue: IdQueue) -> None:
        self._queue = queue
        self._heap: list[tuple[float, int, Item]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __len__(self) -> int:
        return len(self._heap)

    def items(self) -> list[Item]:
        """The parked IDs (for the end-of-pass bookkeeping)."""
        return [item for _, _, item in self._heap]

    def __repr__(self) -> str:
        nxt = self._heap[0][0] - self._loop.time() if self._heap else None
        return f"<Parking parked={len(self._heap)} next_due_in={nxt}>"

    def park(self, item: Item, delay: float) -> None:
        heapq.heappush(self._heap, (self._loop.time() + delay, next(self._seq), item))
        self._wake.set()

    async def run(self) -> None:
        while True:
            if not self._heap:
                self._wake.clear()
                await self._wake.wait()
                continue
            due = self._heap[0][0] - self._loop.time()
            if due > 0:
                self._wake.clear()
                # Wake early if an earlier ID gets parked. (asyncio.timeout, not wait_for: on
                # 3.11 wait_for can swallow a cancellation that races with its timeout.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due):
                        await self._wake.wait()
                continue
            _, _, item = heapq.heappop(self._heap)
            self._queue.push(item)
