"""A run's progress as numbers: its counters, ``Progress`` snapshots (request rate over the
last seconds, ETA, pass 2 counted on its own), and the ticker that hands them out every second
(``on_progress``, and ``live.json`` in the state directory for ``asyncrawl status``).

Everything here reads counters; nothing decides. The displays (``progress.py``) format what
this module computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from .errors import AsyncrawlError
from .types import Progress

log = logging.getLogger("asyncrawl")

LIVE = "live.json"
LIVE_EVERY = 1.0  # seconds between two live.json snapshots


@dataclass(slots=True)
class Tally:
    """A run's counters. ``ok``/``failed``/``unavailable``/``billable`` change only when the
    writer reports records durable; the others as things happen."""

    ok: int = 0
    failed: int = 0
    unavailable: int = 0
    skipped: int = 0  # settled by an earlier run
    duplicates: int = 0
    retries: int = 0  # of passes that ended (the running pass's are the workers')
    requests: int = 0  # likewise
    unanswered: int = 0  # likewise: tries with no answer after their connect (possibly billed)
    billable: int = 0

    @property
    def settled(self) -> int:
        return self.ok + self.failed + self.unavailable


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the running pass and the governor show at one moment."""

    pass_no: int
    requests: int  # this pass's, so far
    retries: int
    in_flight: int
    parked: int
    paused_for: float
    effective_rate: float
    breaker_open: bool
    cooling_down: bool
    store_stalled: bool = False


class Meter:
    """Makes ``Progress`` snapshots of one run. ``total``: the IDs of the list, if known (for
    the ETA); ``pass2``: set when pass 2 begins, (IDs done before it, IDs in it)."""

    def __init__(self, tally: Tally, *, total: int | None, configured_rate: float) -> None:
        self.tally = tally
        self.total = total
        self.configured_rate = configured_rate
        self.started = time.monotonic()
        self.pass2 = (0, 0)
        # (the start: the first snapshot's rate is over the run so far, not 0)
        self._samples: list[tuple[float, int]] = [(self.started, 0)]

    def __repr__(self) -> str:
        return f"<Meter total={self.total} pass2={self.pass2} {self.tally!r}>"

    def _rate(self, now: float, requests: int) -> float:
        """Requests per second over the last ~10 s."""
        samples = self._samples
        samples.append((now, requests))
        while len(samples) > 2 and now - samples[0][0] > 10:
            samples.pop(0)
        t0, r0 = samples[0]
        return (requests - r0) / (now - t0) if now - t0 > 0.2 else 0.0

    def left(self) -> int | None:
        """The list's IDs not settled yet (``None``: its length is not known)."""
        t = self.tally
        if self.total is None:
            return None
        return max(0, self.total - t.settled - t.skipped - t.duplicates)

    def _eta(self, now: float) -> float | None:
        """Seconds left in pass 1 at the rate IDs were settled so far."""
        t = self.tally
        elapsed = now - self.started
        left = self.left()
        if left is None or not t.settled or elapsed <= 1:
            return None
        return left / (t.settled / elapsed)

    def progress(self, g: Gauges) -> Progress:
        now = time.monotonic()
        t = self.tally
        requests = t.requests + g.requests
        done = t.settled + t.skipped
        eta = self._eta(now) if g.pass_no == 1 else None
        total = self.total
        failed = t.failed
        if g.pass_no == 2:  # pass 2 counts its own IDs: "[pass 2] 12/90", not 5,254/5,100
            done, total = done - self.pass2[0], self.pass2[1]
            # each ID it settles (ok or unavailable) was failed: it is not counted twice
            failed = max(0, failed - done)
        elif total is not None:  # the list's lines, less the duplicates found so far: its IDs
            total = max(done, total - t.duplicates)
        return Progress(
            pass_no=g.pass_no, total=total, done=done, ok=t.ok, failed=failed,
            unavailable=t.unavailable, skipped=t.skipped, retries=t.retries + g.retries,
            requests=requests, in_flight=g.in_flight, parked=g.parked,
            rate=self._rate(now, requests), paused_for=g.paused_for, elapsed=now - self.started,
            eta=eta, cooling_down=g.cooling_down, effective_rate=g.effective_rate,
            configured_rate=self.configured_rate, breaker_open=g.breaker_open,
            store_stalled=g.store_stalled)


async def tick(progress: Callable[[], Progress], state_dir: Path | None,
               on_progress: Callable[[Progress], None] | None, every: float,
               publish: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> None:
    """Until cancelled: every second the live snapshot for ``asyncrawl status`` (``live.json``
    in ``state_dir``, or ``publish``: a shared job's database); and ``on_progress`` every
    ``every`` seconds."""
    import asyncio  # (here: ``status`` reads live.json without it)

    step = min(every, LIVE_EVERY)
    last_hook = time.monotonic()
    last_live = 0.0
    hook_failed = False
    while True:
        await asyncio.sleep(step)
        p = progress()
        if state_dir is not None:
            await asyncio.to_thread(write_live, state_dir, p)
        if publish is not None and time.monotonic() - last_live >= LIVE_EVERY * 0.99:
            last_live = time.monotonic()
            with contextlib.suppress(AsyncrawlError):  # a view only: the heartbeat notices
                await publish(asdict(p) | {"ts": time.time()})  # a database that has gone
        if on_progress is not None and time.monotonic() - last_hook >= every * 0.99:
            last_hook = time.monotonic()
            try:
                on_progress(p)
            except Exception:
                if not hook_failed:  # (once: not a traceback a tick for the whole run)
                    log.exception("on_progress hook failed (its later failures in this run "
                                  "are not logged)")
                hook_failed = True


def write_live(state_dir: Path, p: Progress) -> None:
    """Replace ``live.json`` (not durable: a view for ``status``, never read back by a run)."""
    tmp = state_dir / (LIVE + ".tmp")
    try:  # (owner-only, as the state's other files: made 0644 under a umask of 022)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as f:
            f.write(orjson.dumps(asdict(p) | {"pid": os.getpid(), "ts": time.time(),
                                              "mono": time.monotonic()}))
        os.replace(tmp, state_dir / LIVE)
    except OSError:
        pass  # a view only; the store is what matters


def live_age(live: dict[str, object]) -> float:
    """How old ``live.json``'s figures are: by the clock no NTP step moves, one for the whole
    machine (the run's, where its state is); by the wall clock only for a file without it (a
    step of the wall clock back hid a frozen run, forward aged a healthy one by an hour)."""
    mono, ts = live.get("mono"), live.get("ts")
    if isinstance(mono, float):
        return max(0.0, time.monotonic() - mono)
    return max(0.0, time.time() - float(ts)) if isinstance(ts, int | float) else 0.0


def read_live(state_dir: Path) -> dict[str, object] | None:
    """The last ``live.json`` of a running job, if there is one."""
    try:
        live = orjson.loads((state_dir / LIVE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return live if isinstance(live, dict) else None
