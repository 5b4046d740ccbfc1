"""One run of a job: its two passes, the tasks of each, and its counters. ``Crawler.run`` makes a
fresh ``Run`` every time and calls ``execute``.

::

    source ─► producer ─► IdQueue ─► N × Worker.run ─► Writer ─► Store (durable)
                             ▲             │
                             └─ Parking ◄──┘ (IDs waiting for their next try)

``execute`` starts the writer, then runs pass 1 and, after the cool-down, pass 2 over what
failed. Each pass starts its producer, parking feeder and workers and ends by ``_shutdown``,
which cancels and awaits every one of them: no task outlives its pass, and the writer and the
progress ticker do not outlive the run.

A *halt* (fatal response, budget, storage error, ``request_stop`` from a signal, a cancelled
``run()``, an API that cannot be reached at all) sets the ``Stop`` switch: no request starts
after that, requests in flight get ``grace`` seconds (a second stop cuts it short), and what
they bring back is recorded. Counts only change when the writer reports a record durable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal as signal_mod
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ._version import __version__
from .alerts import send_alerts
from .config import Config, key_fingerprint
from .errors import StorageError
from .fetch import INCURABLE, REFUSING, Attempt, Classifier, Fetcher, Outcome, Request, keep_reads_off_mmap
from .governor import Breaker, Budget, Governor
from .idqueue import IdQueue, Item, Parking
from .jobwide import Heartbeat, claimed, merge
from .live import Gauges, Meter, Tally, tick
from .pgstore import PgStore
from .records import Commit, Counts, Record, settled
from .source import IdsFile, file_identity
from .sqlstore import SqliteStore
from .stop import Stop
from .store import Store
from .tasks import finish
from .types import ErrorKind, Halt, Progress, Result, Summary, ids_left
from .worker import Ledger, Worker, billed_record, budget_halt, outcome_record
from .writer import AnyWriter, ProcessWriter, Writer

log = logging.getLogger("asyncrawl")

INCURABLE_AFTER = 3  # attempts, all failing alike before any answer, that stop the run
REFUSED_AFTER = 20  # answers, all refusing alike (``fetch.REFUSING``) before any other, that halt it
LOCAL_GIVE_UP = 60.0  # seconds of tries that all found no file for a socket that stop the run
LOCAL_GAP = 5.0  # seconds without a try that start that count again

# IDs to fetch, the block of the IDs file they were read in (-1: not a file, or from the state),
# and, for a block's last chunk, where the file's block ends: {offset, line, unique, dups}
Chunk = tuple[list[str], int, dict[str, int] | None]


@dataclass(frozen=True, slots=True)
class Hooks:
    """The application's hooks, as ``Crawler`` was given them (see its docstring)."""

    request_for: Callable[[str], Request] | None = None
    classify: Classifier | None = None
    on_result: Callable[[Result], None] | None = None
    on_failure: Callable[[Result], None] | None = None
    on_progress: Callable[[Progress], None] | None = None
    on_halt: Callable[[Halt, Summary], None] | None = None
    on_attempt: Callable[[str, int | None, str | None], None] | None = None
    progress_every: float = 1.0


class Run:
    """One run's passes, tasks and counters."""

    def __init__(self, config: Config, hooks: Hooks, *, total: int | None) -> None:
        self.config = config
        self.hooks = hooks
        self.stop = Stop()
        self.tally = Tally()
        self.meter = Meter(self.tally, total=total, configured_rate=config.rate)
        self.pass_no = 1
        self.cooling = False
        self.governor: Governor | None = None
        self.hook_errors: dict[str, int] = {}  # failures of the observing hooks, by name
        self.cut_off: set[str] = set()  # requests cancelled in flight: possibly billed
        # IDs that come into a pass with a history: failed in an earlier run (their failures say
        # nothing about the upstream now), or already sold unusable answers (pass 2)
        self.history: dict[str, Item] = {}
        self._store: SqliteStore | None = None  # (a state directory's: pass 2 reads from it)
        self._workers: Worker | None = None
        self._writer: AnyWriter | None = None  # (``execute``'s: ``progress`` says if it stalled)
        self.resumed = False  # read an unchanged IDs file on from the state's frontier
        self._answered = False
        self._refusals = collections.Counter[int]()
        self._incurable = collections.Counter[ErrorKind]()
        self._unanswered_tries = 0  # attempts before any answer (``_observe``)
        self._incurable_error: dict[ErrorKind, str] = {}  # ... the last error of each kind
        self.retired_keys: list[str] = []  # fingerprints of the API keys refused (401/402)
        self._alerts: list[asyncio.Task[None]] = []  # alerts sent while the run goes on
        self._session: aiohttp.ClientSession | None = None
        self._lean = False  # (``execute``'s)
        self.budget: Budget | None = None
        self.escaped: BaseException | None = None  # (``_escape``)
        self._local_since: float | None = None  # (``_no_files``)
        self._local_said = False
        self._local_last = 0.0
        self._alerting: asyncio.Event | None = None  # set by a signal while a halt's alerts go

    def __repr__(self) -> str:
        halt = self.stop.halt
        return (f"<Run pass={self.pass_no} {self.tally!r} halt={halt and halt.reason} "
                f"{self._workers!r} {self.governor!r}>")

    # -- control -------------------------------------------------------------------------------

    def request_stop(self, reason: str = "signal", signum: int | None = None) -> None:
        """Stop like SIGINT: no new requests, in-flight ones get the grace period. A second
        call cuts the grace period short."""
        if self._alerting is not None:  # (the alerts of a halt: the operator wants out)
            self._alerting.set()
        if self.stop.is_set():
            self.stop.hurry.set()
            return
        name = signal_mod.Signals(signum).name if signum else (
            "Crawler.stop()" if reason == "signal" else reason)  # (the library's, no signal)
        self.stop.set(Halt(reason, None, f"stopped by {name}", signum))
        if signum:  # the operator hears at once that it was heard, and what happens next
            log.warning("%s: stopping; no new requests, those in flight get up to %gs to finish "
                        "(a second signal cuts that short)", name, self.config.grace)

    def _key_retired(self, lane: int, attempt: Attempt, left: int) -> None:
        """The API key of ``lane`` was refused (401/402): log it and alert, unless it was the
        last one (then the job halts, and the halt's alert says so)."""
        cfg = self.config
        fp = key_fingerprint(cfg.keys[lane])
        self.retired_keys.append(fp)
        message = cfg.redact(f"API key #{lane + 1} ({fp}) refused with "
                             f"{attempt.error or attempt.status}: retired, {left} of "
                             f"{len(cfg.keys)} keys left")
        log.warning("%s", message)
        if left and self._session is not None:
            halt = Halt("key_retired", attempt.status, message)
            t = self.tally
            summary = Summary(ok=t.ok, failed=t.failed, unavailable=t.unavailable, pending=0,
                              fetched=t.ok, skipped=t.skipped, duplicates=t.duplicates,
                              retries=t.retries, requests=t.requests, billable=t.billable,
                              halt=None, elapsed=time.monotonic() - self.meter.started,
                              state_dir=cfg.state_shown)
            self._alerts.append(asyncio.create_task(
                send_alerts(cfg, halt, summary, self._session, hurry=self.stop.hurry,
                            left=ids_left(summary, self.meter.total)[0]),
                name="asyncrawl-alert"))

    def _error_halt(self, exc: BaseException) -> Halt:
        """The halt of a run whose ID source or hook raised ``exc`` (redacted, then cut)."""
        return Halt("error", None, self.config.redact(f"{type(exc).__name__}: {exc}")[:500])

    def _escape(self, exc: BaseException) -> None:
        """A hook or the ID source raised ``exc``, a KeyboardInterrupt or SystemExit, in a
        task of the run: the run stops as on a halt (no new request; those in flight get the
        grace period and their answers are kept), then raises it. (Let out of its task, asyncio
        raises such an exception out of the event loop at once, past the graceful stop: the
        answers in flight, paid for, would be lost and bought again.)"""
        if self.escaped is None:
            self.escaped = exc
            self.stop.set(self._error_halt(exc))

    async def _contained(self, work: Awaitable[None]) -> None:
        """Await ``work`` (a task's coroutine that runs application code); a KeyboardInterrupt
        or SystemExit it raises ends it as ``_escape`` says."""
        try:
            await work
        except (KeyboardInterrupt, SystemExit) as e:
            self._escape(e)

    def _cancelled(self) -> None:
        if not self.stop.is_set():
            self.stop.set(Halt("cancelled", None, "the task running Crawler.run() was cancelled"))

    def progress(self) -> Progress:
        """A snapshot of the run's progress."""
        w, g = self._workers, self.governor
        return self.meter.progress(Gauges(
            pass_no=self.pass_no, requests=w.requests if w else 0, retries=w.retries if w else 0,
            in_flight=w.in_flight if w else 0, parked=len(w.parking) if w else 0,
            paused_for=g.paused_for if g else 0.0,
            effective_rate=g.effective_rate if g else self.config.rate,
            breaker_open=g.breaker_open if g else False, cooling_down=self.cooling,
            store_stalled=self._writer is not None and self._writer.stalled))

    # -- the run -------------------------------------------------------------------------------

    async def execute(self, store: Store, session: aiohttp.ClientSession,
                      source: IdsFile | AsyncIterator[list[str]], *,
                      lean: bool = False) -> Summary:
        """Fetch every unsettled ID of ``source`` (an IDs file, or chunks of IDs) into
        ``store``. ``lean``: the session is the run's own, and asyncrawl's own HTTP client
        may send instead (``http1``)."""
        cfg = self.config
        self._lean = lean
        keep_reads_off_mmap()
        shared = store if isinstance(store, PgStore) else None
        self._store = store if isinstance(store, SqliteStore) else None
        ident = None  # (before any task of the run exists: an error here leaves none behind)
        if isinstance(source, IdsFile) and shared is None:
            ident = await asyncio.to_thread(file_identity, source.path)
            ident["lines"] = source.lines if source.lines is not None else self.meter.total
        proc = store.process  # (SQLite's writing process)
        writer = (Writer(store, on_commit=self._on_commit, on_error=self._on_storage_error)
                  if proc is None else
                  ProcessWriter(proc, on_commit=self._on_commit, on_error=self._on_storage_error))
        self._writer = writer
        writer_task = asyncio.create_task(writer.run(), name="asyncrawl-writer")
        state_dir = None if shared else Path(cfg.state_dir)  # live.json, next to the state
        ticker = asyncio.create_task(self._contained(
            tick(self.progress, state_dir, self.hooks.on_progress, self.hooks.progress_every,
                 publish=shared.publish_live if shared is not None else None)),
            name="asyncrawl-progress")
        begin: dict[str, Any] = {"version": __version__, "pid": os.getpid(),
                                 "job": cfg.job_identity(), "source": ident}
        if cfg.recheck_unavailable:  # (a shared job's store makes them failed again: claimed)
            begin["recheck"] = True
            log.info("IDs confirmed unavailable by earlier runs are tried again "
                     "(recheck_unavailable)")
        start = Record("run", extra=begin)
        job: _Shared | None = None
        error: BaseException | None = None  # (or the run's cancellation)
        try:
            if shared is None:
                writer.put(start)
                await self._passes(self._first_pass_ids(source, store, ident, writer), session,
                                   writer)
            else:
                await writer.commit(start)  # the run is registered before it claims
                job = _Shared(shared, Heartbeat(
                    shared, self.stop, lambda: self.governor,
                    holding=lambda: self._workers is not None and self._workers.holds()))
                job.start(self._contained(self._merge(shared, source)))
                await self._passes(self._claimed(job, 1, writer), session, writer,
                                   second=lambda: self._claimed(job, 2, writer),
                                   second_left=lambda: shared.pass_left(2), shared=shared,
                                   again=lambda: self._claimed(job, 1, writer))
                job.raise_merge_error()
        except asyncio.CancelledError as e:
            self._cancelled()
            error = e
            raise
        except StorageError as e:  # (e.g. a shared job's database gone while the run reads it)
            self._on_storage_error(e)  # a halt like any other: summary, alerts, exit 5
        except BaseException as e:
            error = e
            raise
        finally:
            try:
                if job is not None:
                    await job.close()
                    if self.budget is not None:
                        with contextlib.suppress(StorageError):  # (lost: the job stops short)
                            await job.store.return_budget(self.budget.unspent)
                await self._close(writer, writer_task, ticker,
                                  None if isinstance(error, asyncio.CancelledError)
                                  else error or self.escaped)
            finally:  # the alerts sent meanwhile (they log their own failures)
                await asyncio.gather(*self._alerts, return_exceptions=True)
            self._hooks_failed()
            if error is not None:
                # a hook or the ID source raised, or the run was cancelled, and a 402 (say)
                # came in the grace period: the error is raised, and the operator still hears
                # of the halt (a second cancellation cuts this short)
                with contextlib.suppress(Exception):
                    await self._alert(await self._summary(store), session, job)
        summary = await self._summary(store)
        await self._alert(summary, session, job)
        if self.escaped is not None:  # (a hook's KeyboardInterrupt or SystemExit)
            raise self.escaped
        return summary

    async def _alert(self, summary: Summary, session: aiohttp.ClientSession,
                     job: _Shared | None) -> None:
        """The alerts and the ``on_halt`` hook of a halt the operator must act on (a fatal
        answer, the budget, the state store), unless another run of a shared job met it."""
        halt = self.stop.halt
        if halt is None or halt.reason not in ("fatal", "budget", "storage"):
            return
        if job is not None and job.heartbeat.halted_elsewhere:
            return  # the run that met the halt sends the alerts
        self._alerting = asyncio.Event()  # (a signal from now on cuts them short)
        try:
            await send_alerts(self.config, halt, summary, session,
                              left=ids_left(summary, self.meter.total)[0],
                              hurry=self._alerting)
        finally:
            self._alerting = None
        if self.hooks.on_halt is not None:
            try:  # (observes only: what it raises does not take the run's summary away)
                self.hooks.on_halt(halt, summary)
            except Exception:
                log.exception("on_halt hook failed")

    async def _passes(self, first: AsyncIterator[Chunk], session: aiohttp.ClientSession,
                      writer: AnyWriter,
                      second: Callable[[], AsyncIterator[Chunk]] | None = None,
                      second_left: Callable[[], Awaitable[bool]] | None = None,
                      shared: PgStore | None = None,
                      again: Callable[[], AsyncIterator[Chunk]] | None = None) -> None:
        """Pass 1, then, after the cool-down, pass 2 over what failed: this run's failures, or
        (``second``: a shared job's) the job's, if ``second_left()`` says there are any.
        ``shared``: the store of a shared job (its budget is the job's); ``again``: its
        pass 1 once more, while the job has IDs for it after a pass 2."""
        cfg, hooks = self.config, self.hooks
        self._session = session
        self.governor = Governor(
            rate=cfg.rate, burst=cfg.burst or 1, adaptive=cfg.adaptive,
            breaker=Breaker(probe_max=cfg.breaker_probe_max) if cfg.breaker else None,
            keys=len(cfg.keys) or 1)
        limit = cfg.request_budget
        # a shared job's budget is the job's: each run takes it from the job, a chunk at a time
        grant = (lambda n: shared.grant_budget(n, limit)) \
            if shared is not None and limit is not None else None
        budget = self.budget = Budget(limit, grant)
        fetcher = Fetcher(session, cfg, request_for=hooks.request_for, classify=hooks.classify,
                          observe=self._observe, lean=self._lean)
        try:
            failed = await self._pass(1, first, fetcher, budget, writer)
            self._never_answered()  # (before pass 2: its IDs stay failed, for a rerun)
            while await self._second_pass(failed, fetcher, budget, writer, second, second_left) \
                    and again is not None and shared is not None and await shared.pass_left(1):
                # a shared job given new IDs meanwhile (a process that joined late): this run
                # takes part in their pass 1 too, rather than end while the job has work
                log.info("the job has new IDs (merged by another process): this one fetches "
                         "them too")
                failed = await self._pass(1, again(), fetcher, budget, writer)
        finally:
            fetcher.close()

    def _never_answered(self) -> None:
        """Pass 1 went through its IDs, and each attempt failed as waiting cannot cure, with no
        answer (fewer than ``INCURABLE_AFTER`` of them: a short list, whose IDs ended failed,
        exit 6, then unavailable after pass 2, never to be tried again): the stop of the first
        requests, exit 2, saying what to fix; the IDs stay failed, and a rerun tries them."""
        tries = sum(self._incurable.values())
        if self._answered or not tries or tries < self._unanswered_tries or self.stop.is_set():
            return
        kind, n = self._incurable.most_common(1)[0]
        self._unreachable(kind, f"each of the {n}" if n == tries else f"{n} of the {tries}")

    def _unreachable(self, kind: ErrorKind, each: str, yet: str = "") -> None:
        """Stop the run (exit 2): no try has had an answer, ``each`` failing with ``kind``,
        an error waiting cannot cure, whose fix the message says."""
        self.stop.set(Halt("unreachable", None, self.config.redact(
            f"{self._incurable_error[kind]} on {each} requests, and no answer"
            f"{f' {yet}' if yet else ''}: {INCURABLE[kind]}")))

    async def _second_pass(self, failed: Ledger, fetcher: Fetcher, budget: Budget,
                           writer: AnyWriter, second: Callable[[], AsyncIterator[Chunk]] | None,
                           second_left: Callable[[], Awaitable[bool]] | None) -> bool:
        """After the cool-down, pass 2 over what failed (see ``_passes``), if anything did;
        whether the run goes on (it was not stopped)."""
        cfg = self.config
        if not cfg.second_pass or self.stop.is_set():
            return False
        if not failed.failed and (second_left is None or not await second_left()):
            return True
        if budget.exhausted:  # pass 2 could not send anything: no cool-down to wait out
            self.stop.set(budget_halt(budget))
            return False
        # (nor where each failure is settled without a request: a 404 not checked again, an
        # answer bought paid_retries times; the whole cool-down was waited out for nothing)
        if second is not None or failed.again:
            self.cooling = True
            await _wait_first(self.stop.event, timeout=cfg.cooldown)
            self.cooling = False
        if self.stop.is_set():
            return False
        # Pass 2 reads pass 1's failures from the state (a shared job's: the job's): this
        # run's must be there first (with no cool-down, the last of them could still be on
        # their way, and the pass found nothing to do).
        if await writer.commit(Record("sync")) is not Commit.DURABLE or self.stop.is_set():
            return False
        self.meter.pass2 = (self.tally.settled + self.tally.skipped, failed.failed)
        ids = second() if second is not None else self._second_pass_ids(writer)
        await self._pass(2, ids, fetcher, budget, writer)
        return not self.stop.is_set()

    async def _close(self, writer: AnyWriter, writer_task: asyncio.Task[None],
                     ticker: asyncio.Task[None], error: BaseException | None) -> None:
        """The run's last records (why it halted, what was cut off), then the writer and the
        ticker stop."""
        halt = self.stop.halt
        if halt is not None and halt.reason != "storage":
            writer.put(Record("halt", status=halt.status, error=halt.message,
                              extra={"reason": halt.reason}))
        end: dict[str, Any] = {"in_doubt": sorted(self.cut_off)}
        if error is not None:
            end["error"] = type(error).__name__
        writer.put(Record("end", extra=end))
        writer.close()
        try:
            await finish(writer_task)
        finally:
            try:  # the store is closed after this: never while the writer's thread writes
                await finish(asyncio.ensure_future(writer.join()))
            finally:
                ticker.cancel()
                await finish(ticker)

    async def _first_pass_ids(self, source: IdsFile | AsyncIterator[list[str]], store: Store,
                              ident: dict[str, Any] | None, writer: AnyWriter
                              ) -> AsyncIterator[Chunk]:
        """The source's IDs minus duplicates and what earlier runs settled (the store dedups:
        memory does not grow with the list). A file the state has seen unchanged is read on
        from its frontier, after what the state holds unsettled before it."""
        if not isinstance(source, IdsFile):
            # (closed with this generator: an async source is read by a task of its own,
            # which would read on from the application's iterator after the run: ``_produce``)
            async with _closed_after(source):
                async for chunk in source:
                    todo, _ = await self._admit(chunk, store, writer)
                    if todo:
                        yield todo, -1, None
            return
        assert ident is not None
        # (the state holds no unavailable IDs before the frontier: a recheck reads it all)
        start = None if self.config.recheck_unavailable else await asyncio.to_thread(
            store.resume_point, ident)
        unique, line, offset = 0, 0, 0
        if start is not None:
            self.resumed = True
            unique, line, offset = start["unique"], start["line"], start["offset"]
            log.info("%s is unchanged since the last run: reading it on from line %s (the state "
                     "holds everything before it)", source.path, f"{line + 1:,}")
            self.tally.duplicates += start["dups"]
            taken = 0
            held = await asyncio.to_thread(list, store.unsettled())
            for chunk in held:  # before the frontier: from the state, not the file
                todo, _ = await self._admit(chunk, store, writer)
                taken += len(todo)
                if todo:
                    yield todo, -1, None
            self.tally.skipped += max(0, unique - taken)
        block = 0
        # (up to the size the file had when the run began: lines added since are unchecked,
        # a bad one among them stopped the run with exit 2 after it had paid for calls)
        async for chunk, at in source.marked_chunks(offset, line, ident["size"]):
            todo, fresh = await self._admit(chunk, store, writer) if chunk else ([], 0)
            unique += fresh
            mark = None
            if at is not None:
                mark = {"offset": at[0], "line": at[1], "unique": unique,
                        "dups": self.tally.duplicates}
            yield todo, block, mark
            if mark is not None:
                block += 1

    async def _merge(self, store: PgStore, source: IdsFile | AsyncIterator[list[str]]) -> None:
        """Add the run's IDs to the shared job (while its IDs are claimed and fetched)."""
        try:
            given, added = await merge(store, source)
        except StorageError as e:
            self._on_storage_error(e)
            return
        except Exception as e:  # the ID source's: raised by ``execute`` once the run has stopped
            self.stop.set(self._error_halt(e))
            raise
        if not given:
            return  # (a process given no IDs works on the job's: nothing to say)
        known = f" ({given - added:,} in blocks the job had already)" if added < given else ""
        log.info("merged %s IDs into the job%s", f"{given:,}", known)

    async def _claimed(self, job: _Shared, pass_no: int, writer: AnyWriter) -> AsyncIterator[Chunk]:
        """A shared job's IDs for the pass, leased from the job: pass 1 what has no outcome
        (or failed in an earlier generation of the job), pass 2 what failed in pass 1 (a
        permanent failure, unless it is to be checked again, settled unavailable at once)."""
        cfg = self.config
        try:
            if pass_no == 1:
                await job.heartbeat.join()
            size = max(64, 2 * cfg.concurrency)  # as much as the pass's queue holds
            async for batch in claimed(job.store, pass_no, self.stop, job.merging, size,
                                       job.heartbeat):
                todo, earlier = [], []
                for item, state, status, error, tries, bought in batch:
                    if pass_no == 2 and state == "perm" and not cfg.recheck_permanent:
                        writer.put(_unavailable(item, tries, status, error, permanent=True))
                        continue
                    if state is not None or bought:  # failed in an earlier generation, or
                        earlier.append((item, state, bought))  # in pass 1; or cut off
                    todo.append(item)
                if earlier:
                    todo = await self._with_history(todo, earlier, store=job.store,
                                                    writer=writer, first=pass_no == 1)
                if todo:
                    await job.heartbeat.at_work()  # (re-joins first if it was idle)
                    yield todo, -1, None
        except StorageError as e:
            self._on_storage_error(e)

    async def _admit(self, chunk: list[str], store: Store, writer: AnyWriter
                     ) -> tuple[list[str], int]:
        """Of a chunk, the IDs to fetch (not seen before in this run, not settled), and how
        many were not seen before."""
        tally = self.tally
        fresh, duplicates = await store.admit(chunk)
        tally.duplicates += duplicates
        done = settled(self.config.recheck_unavailable)
        todo, earlier = [], []
        for item, was, bought in fresh:
            if was in done:
                tally.skipped += 1
                continue
            if was is not None or bought:  # failed in an earlier run, or cut off
                earlier.append((item, was, bought))
            todo.append(item)
        if earlier:
            todo = await self._with_history(todo, earlier, store=store, writer=writer,
                                            first=True)
        return todo, len(fresh)

    async def _with_history(self, todo: list[str], items: list[tuple[str, str | None, int]], *,
                            store: Store, writer: AnyWriter, first: bool) -> list[str]:
        """``items`` (id, state, its unusable paid answers), those of ``todo`` failed before
        (in an earlier run, or a shared job's pass 1) or cut off with paid answers that could
        not be used, go into the pass with their history: suspect in pass 1 (``first``) if
        they failed (their failures say nothing of an outage), and their unusable paid
        answers, which ``paid_retries`` counts across runs. Those already bought 1 +
        ``paid_retries`` times are settled unavailable without a call, as pass 2 settles them
        (unless a recheck of unavailable IDs asks for one more try in pass 1); ``todo`` less
        those is returned."""
        cap, recheck = self.config.paid_retries, first and self.config.recheck_unavailable
        over = [item for item, _, bought in items if bought > cap and not recheck]
        details = await store.unusable(over) if over else {}
        for item, state, bought in items:
            b = details.get(item)
            if b is not None:
                writer.put(_unavailable(item, b.tries, b.status, b.error, permanent=False))
            else:
                self.history[item] = Item(item, suspect=first and state is not None,
                                          unusable=bought)
        return [item for item in todo if item not in details] if details else todo

    def _not_again(self, permanent: bool, unusable: int) -> bool:
        """Whether pass 2 settles a pass-1 failure unavailable without a request: an unusable
        answer bought more than ``paid_retries`` times, or a permanent failure (a 404) that
        is not to be checked again (``recheck_permanent``)."""
        return unusable > self.config.paid_retries or (permanent
                                                       and not self.config.recheck_permanent)

    async def _second_pass_ids(self, writer: AnyWriter) -> AsyncIterator[Chunk]:
        """Pass 1's failures, read back from the state a chunk at a time, minus those not to
        try again: settled unavailable at once."""
        store = self._store
        assert store is not None
        after = ""
        while failures := await store.failures(after):
            after = failures[-1][0]
            chunk: list[str] = []
            for item, permanent, status, error, tries, unusable in failures:
                if self._not_again(permanent, unusable):
                    writer.put(_unavailable(item, tries, status, error, permanent=permanent))
                    continue
                if unusable or permanent:
                    self.history[item] = Item(item, unusable=unusable, witness=permanent)
                chunk.append(item)
            if chunk:
                yield chunk, -1, None

    async def _pass(self, pass_no: int, ids: AsyncIterator[Chunk], fetcher: Fetcher,
                    budget: Budget, writer: AnyWriter) -> Ledger:
        cfg, gov = self.config, self.governor
        assert gov is not None  # made by _passes, before the first pass
        self.pass_no = pass_no
        queue = IdQueue(maxsize=max(64, 2 * cfg.concurrency))
        parking = Parking(queue)
        ledger = Ledger(writer if pass_no == 1 else None,
                        again_if=lambda permanent, unusable: not self._not_again(permanent,
                                                                                  unusable))
        workers = self._workers = Worker(
            config=cfg, pass_no=pass_no, queue=queue, parking=parking, ledger=ledger,
            governor=gov, budget=budget, fetcher=fetcher, sink=writer, stop=self.stop,
            keep_data=self.hooks.on_result is not None, on_retire=self._key_retired)
        gov.unsent = ledger.unsent_left
        died = asyncio.Event()  # a task died: wake the pass so that the error surfaces
        errors: list[BaseException] = []  # ... or ended cancelled, though nothing cancelled it

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                if closing:  # (by ``_shutdown``)
                    return
                cut = RuntimeError(
                    f"{task.get_name()} ended cancelled, though the run did not cancel it")
                errors.append(cut)
                exc: BaseException | None = cut
            else:
                exc = task.exception()
            if exc is not None:
                # The job stops as on a halt (no new request; those in flight get the grace
                # period and their answers are kept), then the error is raised: an ID
                # source or a hook that raises must not cost the answers already paid for.
                self.stop.set(self._error_halt(exc))
                died.set()

        tasks = [asyncio.create_task(self._contained(self._produce(ids, queue, ledger)),
                                     name=f"asyncrawl-producer-{pass_no}"),
                 asyncio.create_task(parking.run(), name=f"asyncrawl-parking-{pass_no}"),
                 *(asyncio.create_task(self._contained(workers.run()),
                                       name=f"asyncrawl-worker-{pass_no}-{i}")
                   for i in range(cfg.concurrency))]
        closing = False
        for t in tasks:
            t.add_done_callback(done)
        try:
            await _wait_first(ledger.done, self.stop.event, died, timeout=None)
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            closing = True
            try:
                await self._shutdown(tasks, workers)
            finally:  # (cancelled again meanwhile: the workers have stopped all the same)
                self.tally.requests += workers.requests
                self.tally.retries += workers.retries
                self.tally.unanswered += workers.unanswered
                if workers.left > 1:
                    log.warning("%d IDs whose lease this process lost were left to other "
                                "processes of the job", workers.left)
                self._workers = None
                self.cut_off |= workers.flying
                for item in workers.unsettled():
                    if item.paid:  # billed answers (e.g. a 2xx that did not parse), unsettled
                        writer.put(billed_record(item))
        for t in tasks:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                raise exc
        if errors:
            raise errors[0]
        return ledger

    async def _produce(self, ids: AsyncIterator[Chunk], queue: IdQueue, ledger: Ledger) -> None:
        async with _closed_after(ids):
            # (closed when the pass stops too, cancelled or not: the source behind ``ids`` is
            # closed with it, the application's async iterator and its reading task included)
            await self._feed(ids, queue, ledger)

    async def _feed(self, ids: AsyncIterator[Chunk], queue: IdQueue, ledger: Ledger) -> None:
        stop, history = self.stop, self.history
        async for chunk, block, mark in ids:
            for item in chunk:
                if stop.is_set():
                    break
                it = history.pop(item) if item in history else Item(item, block=block)
                ledger.take(it)
                if queue.full():
                    await queue.put(it)
                else:
                    queue.push(it)  # (no coroutine an ID where none has to wait)
            if stop.is_set():
                break
            if mark is not None:
                ledger.block_read(block, mark)
        ledger.fed()

    async def _shutdown(self, tasks: list[asyncio.Task[None]], workers: Worker) -> None:
        """Stop the pass's tasks: in-flight requests get the grace period (cut short by a second
        stop, or by a cancellation of the run meanwhile, which is raised once every task of
        the pass has ended)."""
        producer, feeder, *rest = tasks
        producer.cancel()
        feeder.cancel()
        cancelled = False
        if self.stop.is_set() and workers.in_flight:
            try:
                await _wait_first(workers.idle, self.stop.hurry, timeout=self.config.grace)
            except asyncio.CancelledError:
                cancelled = True
        for t in rest:
            t.cancel()
        try:
            await finish(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    # -- what comes back -----------------------------------------------------------------------

    def _observe(self, item: str, attempt: Attempt, first: bool) -> None:
        """Every attempt: the hook, and an early stop when the job cannot work at all (a
        refused connection, a name that does not resolve, a certificate that does not verify,
        from the very first requests on: exit 2), or when the API refuses it (a 403 or 405 for
        each of the first ``REFUSED_AFTER`` requests: a halt like a 401's, exit 3, instead of
        every ID given up on as unavailable; only IDs' ``first`` tries count: a retry of an ID
        that failed before, in this run or an earlier one, is about that ID). Once anything
        else answered, the same errors are an outage, for the breaker, and the same answers
        are about their IDs. And a stop when this machine has found no file for a socket for
        a minute (``_no_files``)."""
        if self.hooks.on_attempt is not None:
            try:  # (it observes only: what it raises is logged, never the run's end)
                self.hooks.on_attempt(item, attempt.status, attempt.error)
            except (KeyboardInterrupt, SystemExit) as e:
                self._escape(e)
            except Exception:
                self._hook_failed("on_attempt", item)
        if attempt.kind is ErrorKind.LOCAL:
            self._no_files(attempt)
        elif self._local_since is not None:
            self._local_since = None
        if self._answered:
            return
        status = attempt.status
        if status is not None:
            refusal = REFUSING.get(status) if attempt.outcome is Outcome.SKIP else None
            if refusal is None:
                self._answered = True
                return
            if not first:
                return
            self._refusals[status] += 1
            if self._refusals[status] >= REFUSED_AFTER and not self.stop.is_set():
                self.stop.set(Halt("fatal", status, self.config.redact(
                    f"HTTP {status} for each of the first {self._refusals[status]} requests "
                    f"and no other answer yet: {refusal} (the IDs were not given up on: a "
                    f"rerun fetches them)")))
            return
        self._unanswered_tries += 1
        kind = attempt.kind
        if kind is None or kind not in INCURABLE:
            return
        self._incurable[kind] += 1
        self._incurable_error[kind] = attempt.error or ""
        if self._incurable[kind] >= INCURABLE_AFTER and not self.stop.is_set():
            self._unreachable(kind, f"each of the first {self._incurable[kind]}", "yet")

    def _no_files(self, attempt: Attempt) -> None:
        """A try this machine could not make (no file for a socket): it waits, uncharged, for
        connections to close; but when every try has met this for ``LOCAL_GIVE_UP`` seconds
        (files leaked, or taken by another part of the application), the run stops (exit 2)
        rather than go round for ever."""
        now = time.monotonic()
        if not self._local_said:  # once a run (an application heard nothing of it, and
            self._local_said = True  # crawled at a tenth of its concurrency)
            log.warning("%s; meanwhile fewer requests are in flight than concurrency = %s",
                        attempt.error, self.config.concurrency)
        if self._local_since is None or now - self._local_last > LOCAL_GAP:  # (tries held
            self._local_since = now  # meanwhile, by a pause say: the count starts again)
        self._local_last = now
        if now - self._local_since >= LOCAL_GIVE_UP and not self.stop.is_set():
            self.stop.set(Halt("unreachable", None, self.config.redact(
                f"{attempt.error}: every try for {LOCAL_GIVE_UP:g} s")))

    def _on_commit(self, records: list[Record]) -> None:
        """Called by the writer once ``records`` are durable: only now do they count."""
        t, hooks = self.tally, self.hooks
        on_result, on_failure = hooks.on_result, hooks.on_failure
        for rec in records:
            kind = rec.kind
            if kind == "sent":  # (half of what a crawl commits)
                continue
            t.billable += rec.paid  # outcome and "billed" records; the others carry 0
            if kind == "ok":
                t.ok += 1
            elif kind == "failed":
                t.failed += 1
            elif kind == "unavailable":
                t.unavailable += 1
            else:
                continue
            failure = kind != "ok"
            if on_result is None and not (failure and on_failure is not None):
                continue  # (no Result made where no hook takes it)
            result = rec.result()
            if on_result is not None:
                self._call(on_result, result, "on_result")
            if failure and on_failure is not None:
                self._call(on_failure, result, "on_failure")

    def _call(self, hook: Callable[[Result], None], result: Result, name: str) -> None:
        """An application's result hook: what it raises is logged, never the run's end; but a
        KeyboardInterrupt or SystemExit stops the run (``_escape``; the batch's other records
        still count, and reach the hooks)."""
        try:
            hook(result)
        except (KeyboardInterrupt, SystemExit) as e:
            self._escape(e)
        except Exception:
            self._hook_failed(name, result.id)

    def _hook_failed(self, name: str, item: str) -> None:
        """An observing hook raised (on_attempt, on_result, on_failure: the run goes on): its
        first failure is logged with its traceback, the later ones at debug level (one a
        request or result would flood the log: 41,000 lines for a full queue's ``QueueFull``
        in a run of 5,000 IDs) and counted at the run's end (``_hooks_failed``)."""
        n = self.hook_errors[name] = self.hook_errors.get(name, 0) + 1
        if n == 1:
            log.exception("%s hook failed for ID %r (its later failures in this run are logged "
                          "at debug level, and counted at its end)", name, item)
        else:
            log.debug("%s hook failed for ID %r", name, item, exc_info=True)

    def _hooks_failed(self) -> None:
        """At the run's end: how often each observing hook failed, where more than once."""
        for name, n in self.hook_errors.items():
            if n > 1:
                log.warning("%s hook failed %s times in this run (the first failure is logged "
                            "above, with its traceback)", name, f"{n:,}")

    def _on_storage_error(self, error: StorageError) -> None:
        self.stop.set(Halt("storage", None, str(error)))

    async def _summary(self, store: Store) -> Summary:
        """This run's IDs by their state now (IDs settled by earlier runs included); where the
        store cannot be read any more (a storage halt: a shared job's database gone), what
        this run recorded."""
        t = self.tally
        try:
            c = await store.run_counts(whole=self.resumed)
        except StorageError:
            if self.stop.halt is None or self.stop.halt.reason != "storage":
                raise
            c = Counts(ok=t.ok, failed=t.failed, unavailable=t.unavailable,
                       pending=self.meter.left() or 0)
        return Summary(ok=c.ok, failed=c.failed, unavailable=c.unavailable, pending=c.pending,
                       fetched=t.ok, skipped=t.skipped, duplicates=t.duplicates,
                       retries=t.retries, requests=t.requests, billable=t.billable,
                       halt=self.stop.halt, elapsed=time.monotonic() - self.meter.started,
                       state_dir=store.location, unanswered=t.unanswered,
                       cut_off=len(self.cut_off))


def _unavailable(item: str, tries: int, status: int | None, error: str | None, *,
                 permanent: bool) -> Record:
    """Pass 2's record for an ID not to be tried again: settled unavailable as it failed."""
    return outcome_record(Item(item, tries), Attempt(Outcome.SKIP, status, error=error),
                          "unavailable", permanent=permanent, pass_no=2, keep_data=False)


class _Shared:
    """A run's tasks for a shared job: the merge of its IDs and the heartbeat; owned by
    ``Run.execute``, which closes it before the run's last records."""

    def __init__(self, store: PgStore, heartbeat: Heartbeat) -> None:
        self.store = store
        self.heartbeat = heartbeat
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, merging: Any) -> None:
        self._tasks = [asyncio.create_task(merging, name="asyncrawl-merge"),
                       asyncio.create_task(self.heartbeat.run(), name="asyncrawl-heartbeat")]

    def merging(self) -> bool:
        return bool(self._tasks) and not self._tasks[0].done()

    def raise_merge_error(self) -> None:
        """Raise what the merge raised (the ID source's error), if it did."""
        merge = self._tasks[0] if self._tasks else None
        if merge is not None and merge.done() and not merge.cancelled() \
                and merge.exception() is not None:
            raise merge.exception()  # type: ignore[misc]

    async def close(self) -> None:
        """Stop both; publish this run's halt if the heartbeat has not yet."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(StorageError):
            await self.heartbeat.publish()


@contextlib.asynccontextmanager
async def _closed_after(it: AsyncIterator[Any]) -> AsyncIterator[None]:
    """Close ``it`` (an async generator's ``aclose``) when the block ends, however it ends:
    left suspended, a generator is closed only by the garbage collector, and what it holds
    meanwhile (a task reading an application's iterator, a file) lives on."""
    try:
        yield
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def _wait_first(*events: asyncio.Event, timeout: float | None) -> None:
    """Until one of ``events`` is set, or ``timeout`` seconds."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
