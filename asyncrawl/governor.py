"""[2] The one place that decides "may I send a request now", for the whole job.

Three things gate a request, checked in this order by ``Governor.acquire``:

1. a job-wide *pause* set by a ``Retry-After`` on a 429/503 (every worker holds off, not just the
   one that got it);
2. the shared token bucket (aiolimiter: ``rate`` requests per second with ``burst``);
3. the request budget (``Budget``): billable calls allowed this run (``--max-requests``,
   ``max_spend``). A slot is reserved before sending and released with the answer, so the
   budget is never overshot by requests in flight.
"""

from __future__ import annotations

import asyncio

from aiolimiter import AsyncLimiter


class Governor:
    """Token bucket plus job-wide pause."""

    __slots__ = ("_loop", "burst", "limiter", "paused_until", "rate")

    def __init__(self, *, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.limiter = AsyncLimiter(burst, burst / rate)
        self.paused_until = 0.0
        self._loop = asyncio.get_running_loop()

    def __repr__(self) -> str:
        paused = max(0.0, self.paused_until - self._loop.time())
        return f"<Governor rate={self.rate:g}/s burst={self.burst} paused_for={paused:.1f}s>"

    def pause(self, seconds: float) -> None:
        """Hold every new request for ``seconds`` (extends, never shortens, a pause)."""
        self.paused_until = max(self.paused_until, self._loop.time() + seconds)

    @property
    def paused_for(self) -> float:
        return max(0.0, self.paused_until - self._loop.time())

    async def acquire(self) -> None:
        """Wait until a request may start."""
        while (wait := self.paused_until - self._loop.time()) > 0:
            await asyncio.sleep(wait)
        await self.limiter.acquire()
        # A pause may have begun while we waited for a token.
        while (wait := self.paused_until - self._loop.time()) > 0:
            await asyncio.sleep(wait)


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
