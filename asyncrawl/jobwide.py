"""A job shared by many processes (``pgstore.PgStore``): where a run's IDs come from, and how
the job's signals reach this run.

::

    IDs given ─► merge ─► the job's table ◄─ claim (leases) ─► IdQueue ─► workers ...
                                  ▲
                 heartbeat ───────┘  leases extended; the job's halt, pause and live runs

* ``merge`` adds the run's IDs (a file, or chunks) to the job, while fetching already runs.
* ``claimed`` is a pass's producer input: batches of IDs leased from the job, until no work of
  the pass is left anywhere (held by another run, claimable, or still being merged).
* ``heartbeat`` runs beside the passes: it keeps this run's leases, and brings the job into
  the run: a halt published by another run stops this one (exit 3, no second alert); a
  pause (429 with Retry-After) seen anywhere holds this run's requests too; this run takes
  ``1 / runs at work`` of the job's rate and burst (a run that waits for work and holds none
  is idle: not counted, so that the runs at work use the whole rate; given work again, it
  re-joins before it sends). This run's own fatal halt and pauses are
  published for the others. The adaptive rate and the breaker act job-wide too: a cut of
  any run's rate (a quota found) is published as the job's rate, and every run takes its
  share of it; while any run's breaker is open (an outage), that run probes and the others
  hold their new requests (``BREAKER_HOLD`` seconds, renewed at each of its heartbeats: if it
  dies, they go on by themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from .errors import RunEndedError, StorageError
from .governor import Governor
from .pgstore import BREAKER_HOLD, HEARTBEAT, LIVE, Claimed, PgStore
from .source import IdsFile
from .stop import Stop
from .types import Halt

log = logging.getLogger("asyncrawl")

JOB_WIDE = ("fatal",)  # halts that stop every run of the job
MERGE = 100_000  # IDs per merge transaction (after the first chunk)


async def merge(store: PgStore, source: IdsFile | AsyncIterator[list[str]]) -> tuple[int, int]:
    """Add every ID of ``source`` to the job: (IDs given, IDs in blocks the job did not have).

    A file's chunks are cut the same way each time (the first chunk alone, then ``MERGE`` IDs
    or more), so that the same file merged again is in the same blocks: the job has them. A
    library caller's chunks go in the same blocks, except that what has come is merged once
    the source has made it wait ``SLOW`` seconds (a queue fed over time is crawled as its
    IDs come). What the source raises is raised once the IDs before it are merged."""
    given = added = 0
    try:  # (the run is registered as merging)
        blocks = _blocks(source.chunks()) if isinstance(source, IdsFile) else _blocks(source, SLOW)
        async with contextlib.aclosing(blocks):
            async for block in blocks:
                added += await store.merge(block)
                given += len(block)
    finally:
        await store.set_merging(False)
    return given, added


SLOW = 0.2  # seconds a library caller's source may keep the IDs it gave from the job


async def _blocks(chunks: AsyncIterator[list[str]],
                  slow: float | None = None) -> AsyncGenerator[list[str], None]:
    """``chunks`` in blocks: the first chunk alone (fetching starts), then ``MERGE`` IDs or
    more; with ``slow``, also a block whose first ID came that long ago, as soon as the
    source makes it wait (a source that trickles IDs in never fills a block). What ``chunks``
    raises comes after the block of the IDs before it."""
    loop = asyncio.get_running_loop()
    block: list[str] = []
    since = 0.0  # when the block's first ID came
    given = 0
    it = aiter(chunks)
    ahead: asyncio.Future[list[str]] | None = None  # the next chunk, read while one waits
    try:
        while True:
            if ahead is None:
                ahead = asyncio.ensure_future(anext(it))
            if block and slow is not None:
                left = since + slow - loop.time()
                if left > 0:
                    await asyncio.wait((ahead,), timeout=left)
                if not ahead.done():  # the block is old enough: to the job now
                    given += len(block)
                    got, block = block, []
                    yield got
                    continue
            try:
                chunk = await ahead
            except StopAsyncIteration:
                break
            except Exception:
                if block:
                    yield block
                raise
            finally:
                if ahead.done():
                    ahead = None
            if not block:
                since = loop.time()
            block += chunk
            if len(block) >= (MERGE if given else 1):
                given += len(block)
                got, block = block, []
                yield got
        if block:
            yield block
    finally:
        if ahead is not None and not ahead.done():
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def claimed(store: PgStore, pass_no: int, stop: Stop, merging: Callable[[], bool],
                  batch_size: int, heartbeat: Heartbeat | None = None
                  ) -> AsyncIterator[list[Claimed]]:
    """Batches of ``(id, state, status, error, tries, unusable)`` leased from the job for the pass,
    until the pass has no work left anywhere. ``merging()``: this run still adds IDs.
    ``batch_size``: about what the run's queue holds, so that a run does not sit on IDs that
    other runs could be fetching. ``heartbeat``: told when the run waits for work (before it
    sends again, the caller calls ``Heartbeat.at_work``)."""
    try:
        while not stop.is_set():
            batch = await store.claim(pass_no, batch_size)
            if batch:
                yield batch
                continue
            if store.taking_in:  # blocks of IDs the job had, taken in: more are to be, at once
                continue
            if merging() or await store.pass_left(pass_no):
                if heartbeat is not None:
                    heartbeat.waiting = True
                await asyncio.sleep(HEARTBEAT)  # more may come, or another run's leases run out
                continue
            return
    finally:
        if heartbeat is not None:
            heartbeat.waiting = True  # nothing more to claim in this pass


class Heartbeat:
    """The run's side of the job's signals (see the module's docstring)."""

    def __init__(self, store: PgStore, stop: Stop, governor: Callable[[], Governor | None],
                 holding: Callable[[], bool] = lambda: False) -> None:
        self.store = store
        self.stop = stop
        self.governor = governor
        self.holding = holding  # the run's workers hold IDs (queued, in flight, parked)
        self.waiting = False  # the run's producer waits for work (claims find none)
        self.halted_elsewhere = False  # another run's halt came first: it sends the alerts
        self.live = 1
        self._published_idle = False
        self._beating = asyncio.Lock()  # one beat at a time: the last says whether it is idle
        self._published_halt = False
        self._published_pause = 0.0  # the loop's time until which our pause is published
        self._published_cuts = 0  # cuts of our adaptive rate published to the job
        self._seen_cut = 0.0  # when the last cut by another run we took was published
        self._breaker_published = False

    async def run(self) -> None:
        """Until cancelled, or the database fails (then the run stops: exit 5): at once if the
        job ended this run (taken for dead), else once no beat has gone through for ``LIVE``
        s (the other runs stop counting it then, and take its share of the rate: it must not
        send on beside them, nor miss the job's pauses and halts for longer). A beat that
        fails before (a connection the server ended: the next beat opens another) is tried
        again: one lost connection stopped a healthy run."""
        loop = asyncio.get_running_loop()
        patience = min(LIVE, self.store.lease)
        last = loop.time()  # of the last beat that went through
        failing = False
        while True:
            try:
                await self.beat(loop.time())
                last = loop.time()
                if failing:
                    failing = False
                    log.info("the job's heartbeat goes through again")
            except StorageError as e:
                if isinstance(e, RunEndedError) or loop.time() - last >= patience:
                    if not self.stop.is_set():
                        self.stop.set(Halt("storage", None, str(e)))
                    return
                if not failing:
                    failing = True
                    log.warning("the job's heartbeat failed (%s); trying again (this process "
                                "stops if none goes through for %gs)", e, patience)
            await asyncio.sleep(HEARTBEAT)

    async def publish(self) -> None:
        """Publish this run's job-wide halt, once (a halt that came from another run is not
        published again; if another run's was published first, that one sends the alerts)."""
        halt = self.stop.halt
        if halt is not None and halt.reason in JOB_WIDE and not self._published_halt \
                and not self.halted_elsewhere:
            # (marked published only once the answer is in: a publication cut short by the
            # heartbeat's cancellation is made again by ``_Shared.close``, and says the same)
            if not await self.store.publish_halt(halt):
                self.halted_elsewhere = True
            self._published_halt = True

    async def at_work(self) -> None:
        """The run has requests to send again: if it was published idle, the other runs took
        its share of the rate (and may have spent the job's burst), so it re-joins as a
        newcomer does (its buckets used up, then ``join``) before it sends."""
        self.waiting = False
        if self._published_idle:
            log.info("this process has work again: it takes its share of the job's rate back")
            gov = self.governor()
            if gov is not None:
                gov.rejoin()
            await self.join()

    async def beat(self, now: float) -> None:
        async with self._beating:
            await self._beat(now)

    async def _beat(self, now: float) -> None:
        store, stop, gov = self.store, self.stop, self.governor()
        await self.publish()
        if gov is not None and gov.paused_until > self._published_pause + 0.05:
            self._published_pause = gov.paused_until
            await store.publish_pause(gov.paused_until - now)
        if gov is not None and len(gov.lanes) == 1 and gov.cuts > self._published_cuts:
            # our adaptive rate found the quota: the job's rate is our share times the runs
            self._published_cuts = gov.cuts
            await store.publish_rate_cut(gov.effective_rate * gov.runs)
        if gov is not None and (gov.breaker_open or self._breaker_published):
            self._breaker_published = gov.breaker_open
            await store.publish_breaker(BREAKER_HOLD if gov.breaker_open else None)
        idle = self.waiting and not self.holding()
        self._published_idle = idle
        signal = await store.heartbeat(idle)
        if signal.halt is not None and not stop.is_set():
            self.halted_elsewhere = True
            stop.set(Halt(signal.halt.reason, signal.halt.status,
                          f"halted by another process of the job: {signal.halt.message}"))
        self.live = signal.live
        if gov is not None:
            if signal.pause_for > gov.paused_for + 0.05:
                gov.pause(signal.pause_for)
                self._published_pause = max(self._published_pause, gov.paused_until)
            if signal.live != gov.runs:
                if signal.live == 1:
                    log.info("this process is the only one at work on the job: it takes the "
                             "job's whole rate")
                else:
                    log.info("%d processes are at work on the job: this one takes 1/%d of its "
                             "rate", signal.live, signal.live)
                gov.share(signal.live)
            if signal.rate_cut is not None and signal.rate_cut[1] > self._seen_cut:
                self._seen_cut = signal.rate_cut[1]
                gov.adopt_rate(signal.rate_cut[0] / signal.live)
            if signal.hold_for > gov.paused_for + 0.05 and not gov.breaker_open:
                # another run's breaker is open: it probes, this one waits (not re-published:
                # a job-wide pause would hold the prober too)
                gov.pause(signal.hold_for)
                self._published_pause = max(self._published_pause, gov.paused_until)

    async def join(self) -> None:
        """Before the run's first request (and its first after it was idle): take its share
        of the job's rate, and give the runs already at work the time to take theirs (their
        next heartbeat), so that together they never go over the job's rate."""
        self.waiting = False
        loop = asyncio.get_running_loop()
        await self.beat(loop.time())
        if self.live > 1:
            await asyncio.sleep(2 * HEARTBEAT)
            await self.beat(loop.time())  # runs that joined meanwhile: a smaller share
