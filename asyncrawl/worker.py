"""[3] The worker loop: take an ID, wait for the governor, make one attempt, decide what follows.

A worker never sleeps through a backoff: an ID that must wait for its next try is *parked* in a
delay heap (``Parking``) whose feeder puts it back on the queue when it is due, and the worker
takes the next ID at once. What an attempt leads to (``Worker.handle``)::

    OK     -> settle "ok"
    FATAL  -> set the job's halt (no new request starts anywhere), the ID stays unsettled
    SKIP   -> settle "failed" (permanent) in pass 1, "unavailable" in pass 2
    RETRY  -> park for retry_delay(...) while tries < max_tries, else settle like SKIP (not permanent);
              a paid (2xx) answer that did not parse: settle once bought more than paid_retries times
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .config import Config
from .fetch import Attempt, Fetcher, Outcome
from .governor import Budget, Governor
from .retry import retry_delay


@dataclass(slots=True)
class Item:
    """One ID travelling through a pass."""

    id: str
    tries: int = 0
    paid: int = 0
    unusable: int = 0  # paid (2xx) answers whose body did not parse, in every pass so far
    suspect: bool = False  # failed in an earlier run: its failures are no sign of an outage
    sent: bool = False  # sent at least once in this pass (even if the try was not charged)


class IdQueue(asyncio.Queue[Item]):
    """The bounded queue between the producer and the workers.

    An ``asyncio.Queue`` whose producer, once it found the queue full, is woken when the queue
    has drained to half rather than at every ``get``: it then refills it in one go, instead of
    waking up (a task switch) once per ID. Waiting getters are woken as usual."""

    def _wakeup_next(self, waiters: Any) -> None:  # asyncio.Queue's hook for both kinds
        if waiters is self._putters and self.qsize() > self.maxsize // 2:  # type: ignore[attr-defined]
            return
        super()._wakeup_next(waiters)  # type: ignore[misc]


class Parking:
    """A delay heap of IDs waiting for their next try; ``run`` feeds due ones to the queue."""

    def __init__(self, queue: asyncio.Queue[Item]) -> None:
        self._queue = queue
        self._heap: list[tuple[float, int, Item]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __len__(self) -> int:
        return len(self._heap)

    def items(self) -> list[Item]:
        """The parked IDs (for the crawler's bookkeeping at the end of a pass)."""
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
            await self._queue.put(item)


class Settle(Protocol):
    def __call__(self, item: Item, kind: str, attempt: Attempt, *, permanent: bool) -> None: ...


class Worker:
    """Shared state of the worker tasks of one pass; ``run`` is one worker's loop."""

    def __init__(
        self,
        *,
        config: Config,
        queue: asyncio.Queue[Item],
        parking: Parking,
        governor: Governor,
        budget: Budget,
        fetcher: Fetcher,
        halted: asyncio.Event,
        settle: Settle,
        halt: Callable[[str, Attempt | None], None],
        intent: Callable[[str], Awaitable[bool]],
        pass_no: int,
    ) -> None:
        self.config = config
        self.queue = queue
        self.parking = parking
        self.governor = governor
        self.budget = budget
        self.fetcher = fetcher
        self.halted = halted
        self.settle = settle
        self.halt = halt
        self.intent = intent
        self.pass_no = pass_no
        self.in_flight = 0
        self.flying: set[str] = set()  # IDs whose request is out; left here if cut off
        self.held: dict[int, Item] = {}  # items a worker has taken and not yet passed on
        self.idle = asyncio.Event()
        self.idle.set()
        self.requests = 0
        self.retries = 0
        self.unsent = 0  # IDs of this pass not tried yet (queued, or held before their first send),
        # not counting suspect ones: what the breaker is there to protect

    def __repr__(self) -> str:
        return (f"<Worker pass={self.pass_no} queued={self.queue.qsize()} "
                f"parked={len(self.parking)} in_flight={self.in_flight}>")

    async def run(self) -> None:
        gov, budget, fetcher, halted = self.governor, self.budget, self.fetcher, self.halted
        limited_budget = budget.limit is not None
        first_pass = self.pass_no == 1
        retry_after_max = self.config.retry_after_max
        held, flying = self.held, self.flying
        while not halted.is_set():
            item = await self.queue.get()
            held[id(item)] = item
            ticket = await gov.acquire()
            if limited_budget and not await budget.reserve():
                self.halt("budget", None)
                return
            # Durably note that the request is about to leave, so that after a crash the ID is
            # known to be in doubt (possibly billed). Group-committed with other records.
            if halted.is_set() or not await self.intent(item.id) or halted.is_set():
                budget.release(False)  # no await between the last check and the send
                return
            self.in_flight += 1
            if not item.sent and not item.suspect:
                item.sent = True
                self.unsent -= 1
            flying.add(item.id)
            self.idle.clear()
            self.requests += 1
            attempt = await fetcher.attempt(item.id)  # never raises but CancelledError
            del held[id(item)]  # no await from here on: it is parked or handled below
            flying.discard(item.id)
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
            budget.release(attempt.billable)
            first_try = item.tries == 0
            item.tries += 1
            item.paid += attempt.billable
            retry = attempt.outcome is Outcome.RETRY
            limited = retry and attempt.status == 429
            # a retryable failure of the upstream; a paid (2xx) answer that did not parse is not
            # one: the server answered, and billed it
            down = retry and not limited and not attempt.billable
            retry_after = attempt.retry_after
            if retry_after is not None:
                retry_after = min(retry_after, retry_after_max)
            # Only first tries in pass 1 of IDs with no failure behind them tell an outage from
            # bad IDs (pass 2, and a rerun's leftovers from earlier runs, are mostly bad IDs).
            gov.on_response(ticket, item.id, limited=limited, failed=down,
                            retry_after=retry_after,
                            evidence=first_try and first_pass and not item.suspect)
            if down and gov.breaker_open and not ticket.probe:
                # An upstream outage, not this ID's fault: no try charged; it waits at the gate.
                # (A failed probe is charged, so an ID that is bad by itself cannot probe forever.)
                item.tries -= 1
                self.parking.park(item, 0.0)
                continue
            self.handle(item, attempt)
            if budget.exhausted:
                self.halt("budget", None)

    def unsettled(self) -> list[Item]:
        """Items this pass still holds (parked, queued, in a worker's hand): after its end,
        the ones that were answered 2xx without being settled need their bill recorded."""
        queued = list(self.queue._queue)  # type: ignore[attr-defined]  # the pass is over
        return [*self.parking.items(), *queued, *self.held.values()]

    def handle(self, item: Item, attempt: Attempt) -> None:
        outcome = attempt.outcome
        final = "unavailable" if self.pass_no > 1 else "failed"
        if outcome is Outcome.OK:
            self.settle(item, "ok", attempt, permanent=False)
        elif outcome is Outcome.FATAL:
            self.halt("fatal", attempt)
        elif outcome is Outcome.SKIP:
            self.settle(item, final, attempt, permanent=True)
        else:  # RETRY
            cfg = self.config
            item.unusable += attempt.billable
            if attempt.billable and item.unusable > cfg.paid_retries:
                # a paid answer that does not parse is bought again at most paid_retries times
                self.settle(item, final, attempt._replace(error=f"{attempt.error}; bought "
                            f"{item.unusable} times, not again ([retry] paid_retries)"),
                            permanent=False)
            elif item.tries < cfg.max_tries:
                self.retries += 1
                self.parking.park(item, retry_delay(
                    item.tries, attempt.retry_after, base=cfg.backoff_base, cap=cfg.backoff_max,
                    retry_after_max=cfg.retry_after_max, jitter=cfg.jitter))
            else:
                self.settle(item, final, attempt, permanent=False)
