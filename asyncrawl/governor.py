"""[2] The one place that decides "may I send a request now", for the whole job.

``Governor.acquire`` lets a request start when all of these agree, in this order:

1. **Pause** — a ``Retry-After`` on a 429/503 holds *every* worker until the stated time.
2. **Breaker** (``Breaker``) — during an upstream outage nothing is sent but one probe at a time,
   at growing intervals; the first probe that is not a retryable failure closes it.
3. **Adaptive rate** (``RateController``) — paces requests at the effective rate, which drops
   when the server limits us and climbs back while it does not.
4. **Token bucket** — aiolimiter at the configured ``rate`` with ``burst``: the hard ceiling.

and separately ``Budget`` (billable calls this run) and ``RetryBudget`` (retries may be at most
a share of traffic). The three policy classes are plain objects driven by an explicit ``now``, so
their logic is tested on a fake clock; ``Governor`` wires them to the event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass

from aiolimiter import AsyncLimiter


class RateController:
    """The effective request rate: multiplicative decrease, additive increase, with memory.

    NOTE: the algorithm is AIMD (as in TCP congestion control) with two refinements, because
    plain AIMD saws between half the quota and the quota (75% average use) and every overshoot
    costs a job-wide ``Retry-After`` pause:

    * **Decrease to the measured quota.** On a rate-limit answer to a request sent *after* the
      last decrease (older answers describe the old rate), the server's quota is estimated as
      ``q = sent_rate × accepted_share`` over the last second, and the rate becomes
      ``min(0.95 × rate, 0.95 × q)`` (never below 10% of the rate, against a noisy window).
    * **Slow near the ceiling.** The rate climbs by 5% per clean second while it is below 90% of
      the last estimated quota, or above 105% of it (the quota was raised), and by only 0.25%
      per second in between — so overshoots, and their pauses, are rare once converged.

    Never above ``max_rate``; never below ``min_rate``.
    """

    __slots__ = ("_last_cut", "_last_raise", "_responses", "_sent", "ceiling", "cuts",
                 "max_rate", "min_rate", "rate")

    def __init__(self, *, max_rate: float, min_rate: float | None = None, now: float = 0.0) -> None:
        self.max_rate = max_rate
        self.min_rate = min_rate if min_rate is not None else min(max_rate, 0.1)
        self.rate = max_rate
        self.ceiling: float | None = None
        self.cuts = 0
        self._last_cut = -math.inf
        self._last_raise = now
        self._sent: deque[float] = deque()
        self._responses: deque[tuple[float, bool]] = deque()

    def __repr__(self) -> str:
        return f"<RateController rate={self.rate:.2f}/{self.max_rate:g} ceiling={self.ceiling}>"

    @property
    def limited(self) -> bool:
        """True while the effective rate is below the configured one."""
        return self.rate < self.max_rate

    def on_send(self, now: float) -> None:
        self._sent.append(now)
        while self._sent and self._sent[0] < now - 1.0:
            self._sent.popleft()
        self._maybe_raise(now)

    def on_response(self, now: float, sent_at: float, limited: bool) -> None:
        """Record an answer; ``limited``: the server said "too many requests"."""
        self._responses.append((now, limited))
        while self._responses and self._responses[0][0] < now - 1.0:
            self._responses.popleft()
        if limited and sent_at >= self._last_cut:
            self._cut(now)
        elif not limited:
            self._maybe_raise(now)

    def _cut(self, now: float) -> None:
        while self._sent and self._sent[0] < now - 1.0:
            self._sent.popleft()
        # Requests per second over the last second, or over less at the very start of a run.
        span = max(now - self._sent[0], 0.05) if len(self._sent) > 1 else 1.0
        sent_rate = min(self.rate, max(len(self._sent) / min(span, 1.0), 1.0))
        total = len(self._responses)
        accepted = sum(1 for _, lim in self._responses if not lim)
        quota = sent_rate * accepted / total if total else sent_rate / 2
        self.ceiling = max(quota, self.min_rate)
        new = min(0.95 * self.rate, 0.95 * quota)
        self.rate = max(self.min_rate, 0.1 * self.rate, new)
        self._last_cut = self._last_raise = now
        self.cuts += 1

    def _maybe_raise(self, now: float) -> None:
        if self.rate >= self.max_rate:
            self._last_raise = now
            return
        elapsed = now - self._last_raise
        if elapsed < 1.0:
            return
        c = self.ceiling
        near = c is not None and 0.9 * c <= self.rate <= 1.05 * c
        growth = 0.0025 if near else 0.05
        self.rate = min(self.max_rate, self.rate * (1 + growth) ** elapsed)
        self._last_raise = now


class Breaker:
    """Stops the job during an upstream outage, and probes until the upstream is back.

    Opens when, within ``window`` seconds, at least ``min_failures`` retryable failures (5xx,
    timeouts, connection errors: not 429s) from at least ``min_ids`` distinct IDs make up at
    least ``ratio`` of the answers. While open, ``gate`` allows one probe at a time, the first
    after ``probe_initial`` seconds, then at doubling intervals up to ``probe_max``. The first
    probe that is not a retryable failure closes it.
    """

    __slots__ = ("_events", "_interval", "_next_probe", "_probe_out", "min_failures", "min_ids",
                 "open", "opened", "probe_initial", "probe_max", "ratio", "window")

    def __init__(self, *, window: float = 2.0, min_failures: int = 8, min_ids: int = 5,
                 ratio: float = 0.8, probe_initial: float = 0.5, probe_max: float = 10.0) -> None:
        self.window = window
        self.min_failures = min_failures
        self.min_ids = min_ids
        self.ratio = ratio
        self.probe_initial = probe_initial
        self.probe_max = probe_max
        self.open = False
        self.opened = 0
        self._events: deque[tuple[float, str, bool]] = deque()
        self._interval = probe_initial
        self._next_probe = 0.0
        self._probe_out = False

    def __repr__(self) -> str:
        state = f"open next_probe={self._next_probe:.1f}" if self.open else "closed"
        return f"<Breaker {state} opened={self.opened}>"

    def gate(self, now: float) -> float | None:
        """``None``: send normally. ``0``: send, as the probe. ``> 0``: wait that long first."""
        if not self.open:
            return None
        if self._probe_out:
            return self._interval
        if now >= self._next_probe:
            self._probe_out = True
            return 0.0
        return self._next_probe - now

    def on_response(self, now: float, item_id: str, failed: bool, probe: bool) -> None:
        if self.open:
            if probe:
                self._probe_out = False
                if failed:
                    self._interval = min(self._interval * 2, self.probe_max)
                    self._next_probe = now + self._interval
                else:
                    self.open = False
                    self._events.clear()
            return
        ev = self._events
        ev.append((now, item_id, failed))
        while ev and ev[0][0] < now - self.window:
            ev.popleft()
        if not failed:
            return
        failures = [i for _, i, f in ev if f]
        if (len(failures) >= self.min_failures and len(set(failures)) >= self.min_ids
                and len(failures) >= self.ratio * len(ev)):
            self.open = True
            self.opened += 1
            self._interval = self.probe_initial
            self._next_probe = now + self._interval
            self._probe_out = False


class RetryBudget:
    """Retries may use at most ``ratio`` of traffic, plus a floor of ``floor`` retries per second.

    A token bucket: every first try earns ``ratio`` tokens, time earns ``floor`` per second, a
    retry spends one. Retries after a 429 are not counted here (the rate controller and the
    pause deal with those), nor are retries of IDs caught in an outage (the breaker does).
    """

    __slots__ = ("_last", "capacity", "floor", "ratio", "spent", "tokens", "waiting")

    def __init__(self, *, ratio: float = 0.1, floor: float = 1.0, capacity: float = 100.0,
                 now: float = 0.0) -> None:
        self.ratio = ratio
        self.floor = floor
        self.capacity = max(capacity, 1.0)
        self.tokens = min(self.capacity, 10.0)
        self.spent = 0
        self.waiting = 0
        self._last = now

    def __repr__(self) -> str:
        return f"<RetryBudget tokens={self.tokens:.1f}/{self.capacity:g} spent={self.spent}>"

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.floor)
        self._last = now

    def on_first_try(self) -> None:
        self.tokens = min(self.capacity, self.tokens + self.ratio)

    def spend(self, now: float) -> float:
        """Take a token for one retry: ``0`` if granted, else the seconds until one may be."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.spent += 1
            return 0.0
        return (1.0 - self.tokens) / self.floor if self.floor > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Ticket:
    """Handed out by ``Governor.acquire``; given back with the answer."""

    sent_at: float
    probe: bool


class Governor:
    """Pause + breaker + adaptive rate + token bucket, on the event loop's clock."""

    def __init__(self, *, rate: float, burst: int, adaptive: bool = True,
                 breaker: Breaker | None = None, retry_budget: RetryBudget | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self.rate = rate
        self.burst = burst
        self.limiter = AsyncLimiter(burst, burst / rate)
        self.controller = RateController(max_rate=rate, now=now) if adaptive else None
        self.breaker = breaker
        self.retry_budget = retry_budget
        self.paused_until = 0.0
        self._next_slot = 0.0  # pacing at the effective rate, when it is below the configured one

    def __repr__(self) -> str:
        return (f"<Governor rate={self.effective_rate:.1f}/{self.rate:g}/s burst={self.burst} "
                f"paused_for={self.paused_for:.1f}s {self.breaker!r} {self.retry_budget!r}>")

    @property
    def effective_rate(self) -> float:
        return self.controller.rate if self.controller else self.rate

    @property
    def paused_for(self) -> float:
        return max(0.0, self.paused_until - self._loop.time())

    @property
    def breaker_open(self) -> bool:
        return self.breaker is not None and self.breaker.open

    def pause(self, seconds: float) -> None:
        """Hold every new request for ``seconds`` (extends, never shortens, a pause)."""
        self.paused_until = max(self.paused_until, self._loop.time() + seconds)

    async def acquire(self) -> Ticket:
        """Wait until a request may start."""
        loop = self._loop
        probe = False
        while True:
            while (wait := self.paused_until - loop.time()) > 0:
                await asyncio.sleep(wait)
            if self.breaker is not None:
                gate = self.breaker.gate(loop.time())
                if gate is not None and gate > 0:
                    await asyncio.sleep(min(gate, 0.25))  # re-check: it may close meanwhile
                    continue
                probe = gate == 0
            c = self.controller
            if c is not None and c.limited:
                now = loop.time()
                slot = max(self._next_slot, now)
                self._next_slot = slot + 1.0 / c.rate
                if slot > now:
                    await asyncio.sleep(slot - now)
            await self.limiter.acquire()
            if self.paused_until > loop.time() and not probe:
                continue  # a pause began while we waited: wait for it, then queue again
            now = loop.time()
            if c is not None:
                c.on_send(now)
            return Ticket(now, probe)

    def on_response(self, ticket: Ticket, item_id: str, *, limited: bool, failed: bool,
                    retry_after: float | None) -> None:
        """Feed an answer back. ``limited``: a 429; ``failed``: another retryable failure."""
        now = self._loop.time()
        if retry_after is not None and (limited or failed):
            self.pause(retry_after)
        if self.controller is not None:
            self.controller.on_response(now, ticket.sent_at, limited)
        if self.breaker is not None and not limited:
            self.breaker.on_response(now, item_id, failed, ticket.probe)
        elif self.breaker is not None and ticket.probe:
            self.breaker.on_response(now, item_id, True, True)


class Budget:
    """At most ``limit`` billable answers this run (``None``: no limit)."""

    __slots__ = ("_changed", "billed", "limit", "reserved")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.billed = 0
        self.reserved = 0
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Budget billed={self.billed} reserved={self.reserved} limit={self.limit}>"

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.billed >= self.limit

    async def reserve(self) -> bool:
        """Reserve a slot for one request; ``False`` once the budget is spent."""
        if self.limit is None:
            return True
        while True:
            if self.billed >= self.limit:
                return False
            if self.billed + self.reserved < self.limit:
                self.reserved += 1
                return True
            await self._changed.wait()  # every slot is in flight: wait for one to come back

    def release(self, billable: bool) -> None:
        """Return a reserved slot with whether its answer was billable."""
        if self.limit is None:
            self.billed += billable
            return
        self.reserved -= 1
        self.billed += billable
        self._changed.set()
        self._changed = asyncio.Event()
