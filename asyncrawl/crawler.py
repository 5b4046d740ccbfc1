"""The library's entry point: ``Crawler`` holds a job's config, hooks and HTTP session; each
``run()`` opens the job's store, makes a fresh ``run.Run`` and executes it.

::

    config = asyncrawl.Config.load("config.toml")
    async with asyncrawl.Crawler(config) as crawler:
        summary = await crawler.run(ids)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import operator
import weakref
from collections.abc import AsyncIterable, Callable, Iterable

import aiohttp

from . import http1
from .config import Config, check_job
from .errors import ConfigError
from .fetch import (
    RESEND_WARNING,
    Classifier,
    Request,
    connection_limit,
    new_session,
    resends_silently,
)
from .run import Hooks, Run
from .source import IdsFile, id_chunks, prescan_file
from .store import open_store
from .types import Halt, Progress, Result, Summary

log = logging.getLogger("asyncrawl")

__all__ = ["Crawler", "Halt", "Progress", "Result", "Summary"]


_WARNED: weakref.WeakSet[aiohttp.ClientSession] = weakref.WeakSet()  # (``RESEND_WARNING`` said)

class Crawler:
    """Fetch every ID once. Use as ``async with Crawler(config) as c: summary = await c.run(ids)``.

    Args:
        config: the job's configuration.
        session: an ``aiohttp.ClientSession`` to use; it is never closed by the crawler. Build
            it with :func:`asyncrawl.new_session` to keep the guarantee that every request
            that leaves has its ``sent`` record (a plain session resends a dropped GET once,
            silently: a warning says so). Without it the crawler makes its own, and sends
            through ``asyncrawl.http1`` instead (aiohttp's client for a proxy or ``HEAD``;
            ``ASYNCRAWL_HTTP=aiohttp`` for everything).
        request_for: hook building the ``Request`` for an ID (default: the config's template).
        classify: hook overriding the outcome class of a response (return ``None`` to keep it).
        on_result: called with each ``Result`` once it is durable (e.g. to stream it onward).
        on_failure: called with each ``Result`` of a failed or unavailable ID once it is
            durable: ``on_result`` without the ok ones (without ``on_result``, no ``Result``
            is made for an ok ID, and its parsed payload is not kept for it).
        on_progress: called with a ``Progress`` snapshot every ``progress_every`` seconds.
        on_halt: called with the ``Halt`` and ``Summary`` when a run halts on what an
            operator must act on: a fatal answer (401/402), the request budget, a storage
            failure (as ``[alerts]``). Not on ``stop()``, a cancellation or an API that cannot
            be reached at all: ``run`` returns or raises those to its caller. What it raises
            is logged.
        on_attempt: called with ``(id, status, error)`` for every attempt as it comes back
            (``error`` is None for a good one): every try counts, not only recorded IDs. It
            observes only; it never changes what happens (what it raises is logged).
        total: the number of IDs, if known (for the ETA).

    What the ID source, ``request_for`` or ``classify`` raises stops the job as a halt does
    (no new request; those in flight get the grace period and their answers are kept), then
    ``run`` raises it.
    """

    def __init__(
        self,
        config: Config,
        *,
        session: aiohttp.ClientSession | None = None,
        request_for: Callable[[str], Request] | None = None,
        classify: Classifier | None = None,
        on_result: Callable[[Result], None] | None = None,
        on_failure: Callable[[Result], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_halt: Callable[[Halt, Summary], None] | None = None,
        on_attempt: Callable[[str, int | None, str | None], None] | None = None,
        progress_every: float = 1.0,
        total: int | None = None,
    ) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"config must be an asyncrawl.Config (Config.load(path) reads a "
                              f"file), got {type(config).__name__}")
        hooks = {"request_for": request_for, "classify": classify, "on_result": on_result,
                 "on_failure": on_failure, "on_progress": on_progress, "on_halt": on_halt,
                 "on_attempt": on_attempt}
        for name, hook in hooks.items():
            if hook is None:
                continue
            if not callable(hook):
                raise ConfigError(f"{name} must be a function, got {type(hook).__name__}")
            if inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(
                    type(hook).__call__):  # (an object whose __call__ is async)
                raise ConfigError(f"{name} must be a plain function, not a coroutine function: "
                                  "it is called, never awaited (hand the work to a task or "
                                  "a queue of your own)")
        if not isinstance(progress_every, int | float) or not progress_every > 0:  # (nan too)
            raise ConfigError(f"progress_every must be greater than 0 (seconds), "
                              f"got {progress_every!r:.40}")
        if total is not None:
            try:  # (an int, or what stands for one: numpy's, say)
                count = operator.index(total)
            except TypeError:
                count = -1
            if count < 0:
                raise ConfigError(f"total must be the number of IDs (0 or more), got "
                                  f"{total!r:.40}")
            total = count
        if session is not None and not isinstance(session, aiohttp.ClientSession):
            raise ConfigError(f"session must be an aiohttp.ClientSession, got "
                              f"{type(session).__name__}")
        self.config = config
        self.hooks = Hooks(request_for=request_for, classify=classify, on_result=on_result,
                           on_failure=on_failure, on_progress=on_progress, on_halt=on_halt,
                           on_attempt=on_attempt, progress_every=progress_every)
        self.total = total
        self._session = session
        if session is not None and resends_silently(session) and session not in _WARNED:
            _WARNED.add(session)  # (once a session: not for each Crawler an application makes)
            log.warning("%s", RESEND_WARNING)
        narrow = None if session is None else connection_limit(session)
        if narrow is not None and narrow < self.config.concurrency:
            log.warning("the session's connector opens at most %d connections to a host, fewer "
                        "than concurrency = %d: the requests beyond wait for one, their timeout "
                        "running (build the session with asyncrawl.new_session(config), or give "
                        "its connector limit >= concurrency)", narrow, self.config.concurrency)
        self._own_session: aiohttp.ClientSession | None = None
        self._run: Run | None = None  # the current (or last) run
        self._live: dict[Run, asyncio.Future[None]] = {}  # runs under way: when each ends
        self._asked: list[tuple[str, int | None]] = []  # stops asked for while none was under way

    def __repr__(self) -> str:
        return f"<Crawler {self._run!r}>"

    async def __aenter__(self) -> Crawler:
        if self._session is None:
            self._own_session = self._session = new_session(self.config)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Leaving the block stops a run still going (another task's ``run()``: an error or a
        cancellation left the block early) and waits for it to end, its requests in flight
        given the grace period: no crawl goes on, and spends, unwatched. Cancelled meanwhile,
        the grace period is cut short (as by a second ``stop``)."""
        try:
            if self._live:
                for run in self._live:
                    run.stop.set(Halt("cancelled", None, "the crawler's `async with` block "
                                      "was left while this run was going"))
                try:
                    await asyncio.wait(list(self._live.values()))
                except asyncio.CancelledError:
                    for run in self._live:
                        run.request_stop()  # (set already: cuts the grace period short)
                    raise
        finally:
            if self._own_session is not None:
                await self._own_session.close()
                self._session = self._own_session = None

    # -- what an application watches or does while a run goes ---------------------------------

    @property
    def ok(self) -> int:
        """IDs fetched ok (durably) by the current run."""
        return self._run.tally.ok if self._run else 0

    @property
    def halt(self) -> Halt | None:
        """Why the current (or last) run halted, if it did."""
        return self._run.stop.halt if self._run else None

    def progress(self) -> Progress:
        """A snapshot of the current run's progress."""
        run = self._run or Run(self.config, self.hooks, total=self.total)
        return run.progress()

    def stop(self, reason: str = "signal", *, signum: int | None = None) -> None:
        """Stop the run like SIGINT: no new requests, in-flight ones get the grace period.
        A second call cuts the grace period short. Called while no run is under way, it stops
        a ``run()`` task created in the same turn of the loop, not yet started (at once: it
        sends nothing), which would otherwise crawl on unstopped; not a run started later."""
        if signum is not None and (not isinstance(signum, int) or isinstance(signum, bool)):
            raise ConfigError(f"signum must be a signal number, got {signum!r:.40}")
        if not self._live:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # (no loop: no task waits to start)
                return
            if not self._asked:  # (a task created before this call starts before this runs)
                loop.call_soon(self._asked.clear)
            self._asked.append((reason, signum))
        for run in self._live:
            run.request_stop(reason, signum)

    # -- the run -------------------------------------------------------------------------------

    async def run(self, ids: Iterable[str] | AsyncIterable[str] | None = None) -> Summary:
        """Fetch every unsettled ID of ``ids`` (default: the config's IDs file)."""
        if isinstance(ids, str):  # (an iterable of one-character IDs: never what was meant)
            raise ConfigError("ids is a str: pass an iterable of IDs (a list, say), or set "
                              "[source] ids to a file")
        if ids is not None and not isinstance(ids, Iterable | AsyncIterable):
            raise ConfigError(f"ids must be an iterable or an async iterable of str, got "
                              f"{type(ids).__name__}")
        if self._session is not None and self._session.closed:
            raise ConfigError("the session given to the Crawler is closed")
        run = Run(self.config, self.hooks, total=self.total)
        asked, self._asked = self._asked, []
        for reason, signum in asked:  # (stopped before it started)
            run.request_stop(reason, signum)
        ended = self._live[run] = asyncio.get_running_loop().create_future()
        try:
            return await self._execute(run, ids)
        finally:
            del self._live[run]
            ended.set_result(None)

    async def _execute(self, run: Run, ids: Iterable[str] | AsyncIterable[str] | None) -> Summary:
        cfg = self.config
        # asyncrawl's own HTTP client (http1) sends when the session is the crawler's own
        lean = (self._session is None or self._own_session is not None) and http1.wanted()
        if ids is None and cfg.state_url is not None and not cfg.ids:
            ids = []  # join the shared job: work on the IDs it has
        if ids is None:
            if not cfg.ids or cfg.ids == "-":
                raise ConfigError("no IDs: pass ids= or set [source] ids to a file")
            ids = IdsFile(cfg.ids, self.total)
            if self.total is None:
                ids.lines = run.meter.total = await asyncio.to_thread(prescan_file, cfg.ids)
        source = ids if isinstance(ids, IdsFile) else id_chunks(ids)
        store = await open_store(cfg.state, cfg.job, lease=cfg.lease,
                                 cooldown=cfg.cooldown if cfg.second_pass else 0.0)
        self._run = run  # (once its store is open: not a run refused the state's lock)
        try:
            check_job(cfg, await store.claim_identity(cfg.job_identity()))
            session, own = self._session, None
            if session is None:
                session = own = new_session(cfg)
            try:
                return await run.execute(store, session, source, lean=lean)
            finally:
                if own is not None:
                    await own.close()
        finally:
            await store.close()
