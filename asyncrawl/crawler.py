"""Wires the pipeline together and owns every task's lifetime.

::

    source ─► producer ─► bounded Queue ─► N × Worker.run ─► Writer ─► journal (fsync)
                               ▲                 │
                               └── Parking ◄─────┘ (IDs waiting for their next try)

``Crawler.run`` opens (and locks) the journal, starts the writer, then runs pass 1 and, after the
cool-down, pass 2 over what failed. Each pass starts its producer, parking feeder and workers and
ends by ``_shutdown``, which cancels and awaits every one of them: no task outlives its pass.

A *halt* (fatal response, budget, storage error, ``stop()`` from a signal or a cancelled
``run()``) sets ``halted``: no request starts after that, requests in flight get ``grace``
seconds (a second ``stop()`` cuts it short), and what they bring back is recorded. Counts only
change when the writer reports a record durable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal as signal_mod
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from . import __version__
from .alerts import send_alerts
from .config import Config
from .errors import AsyncrawlError, JobMismatch, StorageError
from .fetch import (
    INCURABLE,
    RESEND_WARNING,
    Attempt,
    Classifier,
    Fetcher,
    Outcome,
    Request,
    incurable,
    new_session,
    resends_silently,
)
from .governor import Breaker, Budget, Governor
from .journal import Journal, Record, Writer
from .source import CHUNK_IDS, IdsFile, id_chunks, prescan_file
from .worker import IdQueue, Item, Parking, Worker

log = logging.getLogger("asyncrawl")


@dataclass(frozen=True, slots=True)
class Halt:
    """Why a run stopped before finishing. ``reason``: fatal, budget, storage, unreachable (an
    error that waiting cannot cure, from the first requests on), signal, cancelled."""

    reason: str
    status: int | None = None
    message: str = ""
    signal: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "status": self.status, "message": self.message}


@dataclass(frozen=True, slots=True)
class Result:
    """An ID's recorded outcome, handed to ``on_result`` once it is durable."""

    id: str
    outcome: str  # ok | failed | unavailable
    status: int | None
    data: Any
    error: str | None
    permanent: bool
    pass_no: int
    tries: int


@dataclass(frozen=True, slots=True)
class Progress:
    """A snapshot for progress displays (``on_progress``). ``total`` and ``done`` count the
    IDs of the current pass: in pass 2, the IDs that pass 1 left failed."""

    pass_no: int
    total: int | None
    done: int
    ok: int
    failed: int
    unavailable: int
    skipped: int
    retries: int
    requests: int
    in_flight: int
    parked: int
    rate: float
    paused_for: float
    elapsed: float
    eta: float | None
    cooling_down: bool = False
    effective_rate: float = 0.0  # the governor's current rate limit (req/s)
    configured_rate: float = 0.0
    breaker_open: bool = False


@dataclass(frozen=True, slots=True)
class Summary:
    """What a run ended with. ``ok``/``failed``/``unavailable``/``pending`` count this run's IDs
    by their state after the run (IDs settled by earlier runs included)."""

    ok: int
    failed: int
    unavailable: int
    pending: int
    fetched: int
    skipped: int
    duplicates: int
    retries: int
    requests: int
    billable: int
    halt: Halt | None
    elapsed: float
    state_dir: str

    @property
    def exit_code(self) -> int:
        """The CLI exit code this summary stands for (SPEC §6)."""
        if self.halt is not None:
            h = self.halt
            if h.reason == "fatal":
                return 3
            if h.reason == "budget":
                return 4
            if h.reason == "storage":
                return 5
            if h.reason == "unreachable":
                return 2
            if h.reason == "signal":
                return 128 + (h.signal or signal_mod.SIGINT)
            return 130
        if self.failed or self.pending:
            return 6
        return 0


class Crawler:
    """Fetch every ID once. Use as ``async with Crawler(config) as c: summary = await c.run(ids)``.

    Args:
        config: the job's configuration.
        session: an ``aiohttp.ClientSession`` to use; it is never closed by the crawler. Build
            it with :func:`asyncrawl.new_session` to keep the guarantee that every request
            that leaves has its ``sent`` record (a plain session resends a dropped GET once,
            silently: a warning says so).
        request_for: hook building the ``Request`` for an ID (default: the config's template).
        classify: hook overriding the outcome class of a response (return ``None`` to keep it).
        on_result: called with each ``Result`` once it is durable (e.g. to stream it onward).
        on_progress: called with a ``Progress`` snapshot every ``progress_every`` seconds.
        on_halt: called with the ``Halt`` and ``Summary`` when a run halts early.
        on_attempt: called with ``(id, status, error)`` for every attempt as it comes back
            (``error`` is None for a good one): every try counts, not only recorded IDs.
        total: the number of IDs, if known (for the ETA).
    """

    def __init__(
        self,
        config: Config,
        *,
        session: aiohttp.ClientSession | None = None,
        request_for: Callable[[str], Request] | None = None,
        classify: Classifier | None = None,
        on_result: Callable[[Result], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_halt: Callable[[Halt, Summary], None] | None = None,
        on_attempt: Callable[[str, int | None, str | None], None] | None = None,
        progress_every: float = 1.0,
        total: int | None = None,
    ) -> None:
        self.config = config
        self._session = session
        if session is not None and resends_silently(session):
            log.warning("%s", RESEND_WARNING)
        self._own_session: aiohttp.ClientSession | None = None
        self._request_for = request_for
        self._classify = classify
        self.on_result = on_result
        self.on_attempt = on_attempt
        self.on_progress = on_progress
        self.on_halt = on_halt
        self.progress_every = progress_every
        self.total = total
        self.halt: Halt | None = None
        self._reset()

    def _reset(self) -> None:
        self.halted = asyncio.Event()
        self._hurry = asyncio.Event()
        self._wake = asyncio.Event()
        self.halt = None
        self.pass_no = 1
        self.ok = self.failed = self.unavailable = 0
        self.skipped = self.duplicates = 0
        self.retries = self.requests = self.billable = 0
        self._outstanding = 0
        self._feeding = False
        self._failed: dict[str, tuple[bool, int | None, str | None, int, int]] = {}
        # IDs that come into a pass with a history: failed in an earlier run (their failures say
        # nothing about the upstream now), or already sold unusable answers (pass 2)
        self._history: dict[str, Item] = {}
        self._pass2 = (0, 0)  # (IDs done when pass 2 began, IDs in pass 2)
        self._workers: Worker | None = None
        self._governor: Governor | None = None
        self._journal: Journal | None = None
        self._writer: Writer | None = None
        self._started = time.monotonic()
        self._cooling = False
        self._cut_off: set[str] = set()
        self._rate_samples: list[tuple[float, int]] = []

    def __repr__(self) -> str:
        return (f"<Crawler pass={self.pass_no} ok={self.ok} failed={self.failed} "
                f"unavailable={self.unavailable} halt={self.halt and self.halt.reason} "
                f"{self._workers!r} {self._governor!r} {self._writer!r}>")

    async def __aenter__(self) -> Crawler:
        if self._session is None:
            self._own_session = self._new_session()
            self._session = self._own_session
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_session is not None:
            await self._own_session.close()
            self._session = self._own_session = None

    def _new_session(self) -> aiohttp.ClientSession:
        return new_session(self.config)

    # -- control -------------------------------------------------------------------------------

    def stop(self, reason: str = "signal", *, signum: int | None = None) -> None:
        """Stop the run like SIGINT: no new requests, in-flight ones get the grace period.
        A second call cuts the grace period short."""
        if self.halted.is_set():
            self._hurry.set()
            return
        name = signal_mod.Signals(signum).name if signum else reason
        self._set_halt(Halt(reason, None, f"stopped by {name}", signum))

    def _cancelled(self) -> None:
        if not self.halted.is_set():
            self._set_halt(Halt("cancelled", None, "the task running Crawler.run() was cancelled"))

    def _set_halt(self, halt: Halt) -> None:
        if self.halt is None:  # the first reason wins
            self.halt = halt
        self.halted.set()
        self._wake.set()

    def _on_halt(self, reason: str, attempt: Attempt | None) -> None:
        if reason == "fatal" and attempt is not None:
            self._set_halt(Halt("fatal", attempt.status, self.config.redact(
                f"fatal response {attempt.error or attempt.status}")))
        elif reason == "budget":
            self._set_halt(Halt("budget", None, f"request budget of {self._budget_limit} "
                                                "billable calls reached"))

    # -- the run -------------------------------------------------------------------------------

    async def run(self, ids: Iterable[str] | AsyncIterable[str] | None = None) -> Summary:
        """Fetch every unsettled ID of ``ids`` (default: the config's IDs file)."""
        self._reset()
        cfg = self.config
        ids_path = None
        if ids is None:
            if not cfg.ids or cfg.ids == "-":
                raise AsyncrawlError("no IDs: pass ids= or set [source] ids to a file")
            ids_path = cfg.ids
            total = await asyncio.to_thread(prescan_file, ids_path)
            self.total = total if self.total is None else self.total
        journal = await Journal.open(cfg.state_dir)
        try:
            _check_job(cfg, journal.state.job)
        except BaseException:
            await journal.close()
            raise
        self._journal = journal
        session = self._session
        own = None
        if session is None:
            session = own = self._new_session()
        try:
            await journal.start_appending()
            return await self._run(journal, session, ids, ids_path)
        finally:
            if own is not None:
                await own.close()
            await journal.close()

    async def _run(self, journal: Journal, session: aiohttp.ClientSession,
                   ids: Iterable[str] | AsyncIterable[str] | None, ids_path: str | None) -> Summary:
        cfg = self.config
        writer = self._writer = Writer(journal, on_commit=self._on_commit,
                                       on_error=self._on_storage_error)
        writer_task = asyncio.create_task(writer.run(), name="asyncrawl-writer")
        ticker = asyncio.create_task(self._tick(), name="asyncrawl-progress")
        self._governor = Governor(
            rate=cfg.rate, burst=cfg.burst or 1, adaptive=cfg.adaptive,
            breaker=Breaker(probe_max=cfg.breaker_probe_max) if cfg.breaker else None)
        self._budget_limit = cfg.request_budget
        budget = Budget(self._budget_limit)
        self._answered, self._incurable = False, collections.Counter[str]()
        fetcher = Fetcher(session, cfg, request_for=self._request_for, classify=self._classify,
                          observe=self._observe)
        seen: set[str] = set()
        source = (IdsFile(ids_path).chunks() if ids_path else ids.chunks()
                  if isinstance(ids, IdsFile) else id_chunks(ids or ()))
        writer.put(Record("run", extra={"version": __version__, "pid": os.getpid(),
                                        "job": cfg.job_identity()}))
        error: BaseException | None = None
        try:
            await self._pass(1, self._first_pass_ids(source, seen), fetcher, budget)
            if cfg.second_pass and self._failed and not self.halted.is_set():
                self._cooling = True
                await self._wait_first(self.halted, timeout=cfg.cooldown)
                self._cooling = False
                if not self.halted.is_set():
                    # pass 2's progress counts its own IDs: "[pass 2] 12/90", not 5,254/5,100
                    self._pass2 = (self.ok + self.failed + self.unavailable + self.skipped,
                                   len(self._failed))
                    await self._pass(2, self._second_pass_ids(), fetcher, budget)
        except asyncio.CancelledError:
            self._cancelled()
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            if self.halt is not None and self.halt.reason != "storage":
                writer.put(Record("halt", status=self.halt.status, error=self.halt.message,
                                  extra={"reason": self.halt.reason}))
            end: dict[str, Any] = {"in_doubt": sorted(self._cut_off)}
            if error is not None:
                end["error"] = type(error).__name__
            writer.put(Record("end", extra=end))
            writer.close()
            await _finish(writer_task)
            ticker.cancel()
            await _finish(ticker)
        summary = self._summary(journal, seen)
        if self.halt is not None and self.halt.reason in ("fatal", "budget", "storage"):
            await send_alerts(cfg, self.halt, summary, session)
            if self.on_halt is not None:
                self.on_halt(self.halt, summary)
        return summary

    async def _first_pass_ids(self, source: AsyncIterator[list[str]],
                              seen: set[str]) -> AsyncIterator[list[str]]:
        outcome = self._journal.state.outcome if self._journal else {}
        async for chunk in source:
            fresh = []
            for item in chunk:
                if item in seen:
                    self.duplicates += 1
                    continue
                seen.add(item)
                was = outcome.get(item)
                if was in ("ok", "unavailable"):
                    self.skipped += 1
                    continue
                if was in ("failed", "perm"):
                    self._history[item] = Item(item, suspect=True)
                fresh.append(item)
            if fresh:
                yield fresh

    async def _second_pass_ids(self) -> AsyncIterator[list[str]]:
        failed, self._failed = self._failed, {}
        chunk: list[str] = []
        for item, (permanent, status, error, tries, unusable) in failed.items():
            bought = unusable > self.config.paid_retries  # never buy an unusable answer again
            if bought or (permanent and not self.config.recheck_permanent):
                self._settle(Item(item, tries), "unavailable",
                             Attempt(Outcome.SKIP, status, error=error),
                             permanent=permanent, count_pass=False)
                continue
            if unusable:
                self._history[item] = Item(item, unusable=unusable)
            chunk.append(item)
            if len(chunk) >= CHUNK_IDS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    async def _pass(self, pass_no: int, ids: AsyncIterator[list[str]], fetcher: Fetcher,
                    budget: Budget) -> None:
        cfg = self.config
        self.pass_no = pass_no
        self._wake.clear()
        queue = IdQueue(maxsize=max(64, 2 * cfg.concurrency))
        parking = Parking(queue)
        workers = self._workers = Worker(
            config=cfg, queue=queue, parking=parking, governor=self._governor,  # type: ignore[arg-type]
            budget=budget, fetcher=fetcher, halted=self.halted, settle=self._settle,
            halt=self._on_halt, intent=self._intent, pass_no=pass_no)
        self._outstanding = 0
        self._feeding = True
        self._governor.unsent = lambda: self._feeding or workers.unsent > 0  # type: ignore[union-attr]
        producer = asyncio.create_task(self._produce(ids, queue), name=f"asyncrawl-producer-{pass_no}")
        feeder = asyncio.create_task(parking.run(), name=f"asyncrawl-parking-{pass_no}")
        tasks = [asyncio.create_task(workers.run(), name=f"asyncrawl-worker-{pass_no}-{i}")
                 for i in range(cfg.concurrency)]
        for t in (producer, feeder, *tasks):
            t.add_done_callback(self._task_done)
        try:
            await self._wake.wait()
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            await self._shutdown(producer, feeder, tasks, workers)
            self.requests += workers.requests
            self.retries += workers.retries
            self._workers = None
            self._cut_off |= workers.flying  # requests cancelled in flight: possibly billed
            for item in workers.unsettled():
                if item.paid:  # billed answers (e.g. a 2xx that did not parse) of an unsettled ID
                    self._writer.put(Record("billed", item.id, paid=item.paid))  # type: ignore[union-attr]
        for t in (producer, feeder, *tasks):
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    INCURABLE_AFTER = 3  # attempts, all failing alike before any answer, that stop the run

    def _observe(self, item: str, attempt: Attempt) -> None:
        """Every attempt: the hook, and an early stop when the job cannot work at all (a
        refused connection, a name that does not resolve, a certificate that does not verify,
        from the very first requests on). Once anything answered, the same errors are an
        outage, for the breaker."""
        if self.on_attempt is not None:
            self.on_attempt(item, attempt.status, attempt.error)
        if self._answered:
            return
        if attempt.status is not None:
            self._answered = True
            return
        key = incurable(attempt.error)
        if key is None:
            return
        self._incurable[key] += 1
        if self._incurable[key] >= self.INCURABLE_AFTER and not self.halted.is_set():
            self._set_halt(Halt("unreachable", None, self.config.redact(
                f"{attempt.error} on each of the first {self._incurable[key]} requests, and no "
                f"answer yet: {INCURABLE[key]}")))

    def _intent(self, item: str) -> Awaitable[bool]:
        assert self._writer is not None
        return self._writer.commit(Record.sent(item))

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._wake.set()  # a task died: wake the pass so the error surfaces

    async def _produce(self, ids: AsyncIterator[list[str]], queue: IdQueue) -> None:
        halted, history, workers = self.halted, self._history, self._workers
        assert workers is not None
        async for chunk in ids:
            for item in chunk:
                if halted.is_set():
                    break
                self._outstanding += 1
                it = history.pop(item) if item in history else Item(item)
                if not it.suspect:
                    workers.unsent += 1
                await queue.put(it)
            if halted.is_set():
                break
        self._feeding = False
        if self._outstanding == 0:
            self._wake.set()

    async def _shutdown(self, producer: asyncio.Task[None], feeder: asyncio.Task[None],
                        tasks: list[asyncio.Task[None]], workers: Worker) -> None:
        producer.cancel()
        feeder.cancel()
        if self.halted.is_set() and workers.in_flight:
            await self._wait_first(workers.idle, self._hurry, timeout=self.config.grace)
        for t in tasks:
            t.cancel()
        await asyncio.gather(producer, feeder, *tasks, return_exceptions=True)

    @staticmethod
    async def _wait_first(*events: asyncio.Event, timeout: float) -> None:
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    # -- recording -----------------------------------------------------------------------------

    def _settle(self, item: Item, kind: str, attempt: Attempt, *, permanent: bool,
                count_pass: bool = True) -> None:
        """A worker's final word on an ID for this pass: queue its record for the writer."""
        assert self._writer is not None
        # The journal gets an ok answer's body as received; the parsed payload is kept only
        # for the on_result hook.
        body = attempt.body
        keep = self.on_result is not None or body is None
        rec = Record.outcome(kind, item.id, attempt.status, attempt.error, permanent,
                             attempt.data if keep else None, self.pass_no, item.tries, item.paid,
                             body)
        self._writer.put(rec)
        if kind == "failed":
            self._failed[item.id] = (permanent, attempt.status, attempt.error, item.tries,
                                     item.unusable)
        if count_pass:
            self._outstanding -= 1
            if self._outstanding == 0 and not self._feeding:
                self._wake.set()

    def _on_commit(self, records: list[Record]) -> None:
        """Called by the writer once ``records`` are durable: only now do they count."""
        assert self._journal is not None
        outcome = self._journal.state.outcome
        for rec in records:
            kind = rec.kind
            self.billable += rec.paid  # outcome and "billed" records; the others carry 0
            if kind == "ok":
                self.ok += 1
            elif kind == "failed":
                self.failed += 1
            elif kind == "unavailable":
                self.unavailable += 1
            else:
                continue
            if outcome.get(rec.id) != "ok":  # type: ignore[arg-type]
                outcome[rec.id] = "perm" if kind == "failed" and rec.permanent else kind  # type: ignore[index]
            if self.on_result is not None:
                try:
                    self.on_result(Result(rec.id, kind, rec.status, rec.data, rec.error,  # type: ignore[arg-type]
                                          rec.permanent, rec.pass_no, rec.tries))
                except Exception:
                    log.exception("on_result hook failed for ID %r", rec.id)

    def _on_storage_error(self, error: StorageError) -> None:
        self._set_halt(Halt("storage", None, str(error)))

    # -- reporting -----------------------------------------------------------------------------

    def progress(self) -> Progress:
        """A snapshot of the run's progress."""
        now = time.monotonic()
        w = self._workers
        requests = self.requests + (w.requests if w else 0)
        samples = self._rate_samples
        samples.append((now, requests))
        while len(samples) > 2 and now - samples[0][0] > 10:
            samples.pop(0)
        t0, r0 = samples[0]
        rate = (requests - r0) / (now - t0) if now - t0 > 0.2 else 0.0
        done = self.ok + self.failed + self.unavailable + self.skipped
        eta = None
        if self.total is not None and self.pass_no == 1:
            elapsed = now - self._started
            settled_here = self.ok + self.failed + self.unavailable
            left = max(0, self.total - done - self.duplicates)
            if settled_here and elapsed > 1:
                eta = left / (settled_here / elapsed)
        g = self._governor
        total = self.total
        if self.pass_no == 2:
            done, total = done - self._pass2[0], self._pass2[1]
        return Progress(
            pass_no=self.pass_no, total=total, done=done, ok=self.ok, failed=self.failed,
            unavailable=self.unavailable, skipped=self.skipped,
            retries=self.retries + (w.retries if w else 0), requests=requests,
            in_flight=w.in_flight if w else 0, parked=len(w.parking) if w else 0, rate=rate,
            paused_for=g.paused_for if g else 0.0,
            elapsed=now - self._started, eta=eta, cooling_down=self._cooling,
            effective_rate=g.effective_rate if g else self.config.rate,
            configured_rate=self.config.rate, breaker_open=g.breaker_open if g else False)

    async def _tick(self) -> None:
        """Every second: the live snapshot for ``asyncrawl status``; and ``on_progress``."""
        step = min(self.progress_every, LIVE_EVERY)
        last_hook = time.monotonic()
        while True:
            await asyncio.sleep(step)
            p = self.progress()
            if self._journal is not None:
                await asyncio.to_thread(write_live, self._journal.state_dir, p)
            if self.on_progress is not None and time.monotonic() - last_hook >= self.progress_every * 0.99:
                last_hook = time.monotonic()
                try:
                    self.on_progress(p)
                except Exception:
                    log.exception("on_progress hook failed")

    def _summary(self, journal: Journal, seen: set[str]) -> Summary:
        outcome = journal.state.outcome
        ok = failed = unavailable = pending = 0
        for item in seen:
            st = outcome.get(item)
            if st == "ok":
                ok += 1
            elif st == "unavailable":
                unavailable += 1
            elif st in ("failed", "perm"):
                failed += 1
            else:
                pending += 1
        return Summary(ok=ok, failed=failed, unavailable=unavailable, pending=pending,
                       fetched=self.ok, skipped=self.skipped, duplicates=self.duplicates,
                       retries=self.retries, requests=self.requests, billable=self.billable,
                       halt=self.halt, elapsed=time.monotonic() - self._started,
                       state_dir=str(journal.state_dir))


LIVE_EVERY = 1.0
LIVE = "live.json"


def write_live(state_dir: Path, p: Progress) -> None:
    """Replace ``live.json`` (not durable: a view for ``status``, never read back by a run)."""
    tmp = state_dir / (LIVE + ".tmp")
    try:
        tmp.write_bytes(orjson.dumps(asdict(p) | {"pid": os.getpid(), "ts": time.time()}))
        os.replace(tmp, state_dir / LIVE)
    except OSError:
        pass  # a view only; the journal is what matters


def _check_job(cfg: Config, job: dict[str, Any] | None) -> None:
    """Refuse a state directory made by another job: its settled IDs would be skipped, and the
    new job would fetch nothing and say it had finished."""
    now = cfg.job_identity()
    if job is None or job == now or cfg.reuse_state:
        return
    was = ", ".join(f"{k} {job.get(k)!r}" for k in ("method", "url", "params") if job.get(k) != now[k])
    raise JobMismatch(
        f"the state directory {cfg.state_dir} belongs to another job ({was}; this run has "
        + ", ".join(f"{k} {now[k]!r}" for k in ("method", "url", "params") if job.get(k) != now[k])
        + "). Start the new job with its own state (--state DIR), or, to fetch from the new "
        "address what the old job had not settled and keep what it had, pass --reuse-state "
        "([state] reuse = true)")


async def _finish(task: asyncio.Task[Any]) -> None:
    """Await a task we own, even if our caller is being cancelled meanwhile."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
    if not task.done():  # we were cancelled while it still ran: wait once more, then let go
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
