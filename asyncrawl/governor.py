"""[2] The one place that decides "may I send a request now", for the whole job.

``Governor.acquire`` lets a request start when all of these agree, in this order:

1. **Pause** — a ``Retry-After`` on a 429/503 holds *every* worker until the stated time.
2. **Breaker** (``Breaker``) — during an upstream outage nothing is sent but one probe at a time,
   at growing intervals; the first probe that is not a retryable failure closes it.
3. **Adaptive rate** (``RateController``) — paces requests at the effective rate, which drops
   when the server limits us and climbs back while it does not.
4. **Token bucket** — aiolimiter at the configured ``rate`` with ``burst``: the hard ceiling.

With several API keys, 3 and 4 (and a 429's pause) are per key: see ``Governor``.

A request takes its ticket before its ``sent`` intent is durable and leaves after (the worker),
so the time between varies: a stall of the state's writer holds back the requests whose tickets
came meanwhile, and they would all leave together at its end, over the rate. So the bucket is
kept twice: a ticket is taken from the first, and the request passes through the second, with
the same capacity and rate, as it leaves (``may_leave`` / ``leave``): what leaves keeps to the
rate whatever the wait between. And what holds requests back is asked again then (``holds``):
a pause or an open breaker that came meanwhile holds back the requests that had their tickets
(bench/README.md, stop 42).

``Budget`` (billable calls this run: ``--max-requests``) is kept apart. Retries are ordinary
traffic under the same rate: a retry waits for its own backoff and for nothing else while the
server is healthy; what protects a sick server are the signs that it is sick (429s slow the
rate, a run of failures across many IDs opens the breaker), not a cap on retries. The policy
classes are plain objects driven by an explicit ``now``, so their logic is tested on a fake
clock; ``Governor`` wires them to the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiolimiter import AsyncLimiter

PROVEN_FOR = 120.0  # seconds a figure of what the server takes holds without a stretch showing it
SETTLE = 1.0  # seconds after a cut (with no pause of the server's) whose requests' 429s open no episode
MAX_NOISE = 0.015  # the largest share of 429s taken for background, not a quota (``_noise``)
RESUME_AFTER = 2  # answers accepting requests sent after the one refused that end its pause


class RateController:
    """The effective request rate: multiplicative decrease, additive increase, with memory.

    NOTE: the algorithm is AIMD (as in TCP congestion control) with two refinements, because
    plain AIMD saws between half the quota and the quota (75% average use) and every overshoot
    costs a job-wide ``Retry-After`` pause:

    * **Decrease to the measured quota.** The first rate-limit answer to a request sent after
      the last decrease opens an *episode*; it is judged when the server's pause is over (at
      least 0.25 s later), once the answers to what was sent meanwhile are in. If the job had
      been sending steadily for a second before it, the quota is ``q = send rate × accepted
      share`` (or the answers accepted in the second before the episode, if more), a sharp
      estimate; otherwise (a burst at the start, or right after a pause, when
      a windowed quota lets through more than it sustains) only the accepted answers per
      wall-clock second are trusted, a low estimate not kept as the ceiling, or, if higher,
      the rate less the share of 429s among the episode's answers (while the sending ramps
      up, the first is far below any quota: a few per-item 429s at 1,500 req/s cut it to
      267 before this; a quota far below the rate shows as a large share) (and a lone 429,
      the first in five seconds, is too little to go on: the rate only drops 5%). The rate becomes
      ``min(0.95 × rate, 0.97 × q)`` (``0.95 × q`` for a low estimate), at least a tenth of
      the rate.
    * **Background 429s are not a quota.** Some servers answer 429 to a few single items (a
      per-item lock, a hot key) whatever the job's rate; slowing down does not make them go
      away, and cutting for each would ratchet the rate down for good (a 0.3% mix of them
      took a 400 req/s job to 26 req/s). ``background`` is the long-run share of 429s among
      all answers (a moving average over about 2,000); an episode whose share of 429s is at
      most ``min(2 × background, 1%) + 0.5%`` among the answers of any second of it changes
      nothing. A quota overrun shows as a share well
      above what the job sees at other times. The same test decides whether a ``Retry-After``
      pauses the whole job (``limiting``) or only the item it came with.
    * **What the server took.** A stretch without a 429 that began with one bounds a quota
      from below: if that 429 was the quota's, its bucket (or window) was empty when it said
      no, and refilled at most at the quota's rate since, pauses included, so ``quota >=
      accepted / wall`` over the stretch (at least 2 s of sending; see ``_clean_stretch``).
      An episode of few 429s (no more among its answers than the background gives by chance)
      at a rate within 3% of that bound is about its items: no cut, and the ceiling is
      forgotten (a fast climb back); above it, its cut goes no lower than the bound, and the
      ceiling becomes the rate where it came. Without this, each lone 429 at a low rate (one
      is 2% of a second's answers at 50 req/s) cut 5% and set a ceiling there, and the rate
      ratcheted down for good (50 req/s ended at 7). The bound is an estimate, not a proof:
      a per-item 429 or a bucket's saved-up burst can put it too high, so it is kept only
      while stretches keep showing 90% of it, and dropped two minutes after the last one,
      or at once when an episode of many 429s comes below it (the quota changed), or when
      the lone 429s since the last stretch that showed it are more than 1.5% of the answers
      can give by chance (a quota lowered mid-run, overrun once after each pause). Episodes
      of many 429s cut as before, below it too.
    * **A share of a job.** With several processes on one job (``shared``: ``Governor.share``)
      each sees its own share of the answers, and an episode that is not steady shows it over
      less than a second: a newcomer's first requests, or the first after a pause, can fall in
      a window the others had used up (30 req/s looked like 4 from five answers, and that
      figure, published as the job's rate, slowed every process). Such an episode cuts at
      most to half the rate, or further only if more than half of the answers of a second
      (of at least five) were 429s (the job is more than twice over its quota).
      ``bench/shared_sim.py``.
    * **Slow near the ceiling.** The rate climbs by 5% per clean second while it is below 90% of
      the last estimated quota, or above 105% of it (the quota was raised), and by only 0.1%
      per second in between — so overshoots, and their pauses, are rare once converged.

    Never above ``max_rate``; never below ``min_rate``.
    """

    __slots__ = ("_accepted", "_asked", "_decide_at", "_episode_answers", "_episode_share",
                 "_foreign_end", "_held_by", "_held_took", "_last_cut", "_last_raise", "_limited",
                 "_limited_recent", "_own_cut", "_pause_end", "_paused", "_proven",
                 "_proven_answers", "_proven_at", "_proven_limited", "_recent", "_recent_at_episode", "_sent",
                 "_settle", "_since", "_steady", "_stretch", "_stretch_origin", "_stretch_paused",
                 "_stretch_took", "_sure_share", "background", "ceiling", "cuts", "max_rate",
                 "min_rate", "rate", "resumed", "shared")

    def __init__(self, *, max_rate: float, min_rate: float | None = None, now: float = 0.0) -> None:
        self.max_rate = max_rate
        self.min_rate = min_rate if min_rate is not None else min(max_rate, 0.1)
        self.rate = max_rate
        self.shared = False  # one of several processes sharing a job's rate (``Governor.share``)
        self.ceiling: float | None = None
        self.cuts = 0
        self._last_cut = -math.inf  # answers to requests sent before this describe an old rate
        self._own_cut = -math.inf  # ... of which this controller's own cuts (not ``adopt``'s)
        # a 429 to a request sent before this may still be the overrun's that the last cut
        # answered: a window the server had not reset yet (``SETTLE``); it opens no episode
        self._settle = -math.inf
        self._last_raise = now
        self._decide_at: float | None = None  # an open episode is judged then
        self._since: float | None = None  # first send since the last decrease
        self._sent = self._accepted = self._limited = 0
        self._paused = 0.0  # seconds paused since then
        self._pause_end = -math.inf
        self._steady = False  # had the job sent steadily for a second before the episode?
        self._recent: deque[float] = deque()  # accepted answers of the last second
        self._recent_at_episode = 0
        self._limited_recent: deque[float] = deque()  # rate-limit answers of the last second
        self._asked: deque[float] = deque()  # answers of the last second that asked us to wait
        self.background = 0.0  # long-run share of 429s among answers
        self._episode_share = 0.0  # the highest share of 429s in a second, since the last judgement
        self._sure_share = 0.0  # ... of the seconds with at least five answers
        self._proven = 0.0  # a rate the server has been seen to sustain (see _clean_stretch)
        self._proven_at = -math.inf  # ... last seen then (forgotten after two minutes)
        self._proven_answers = self._proven_limited = 0  # answers, and 429s, since then
        self._stretch: float | None = None  # when the latest 429 came (None: none yet) ...
        self._stretch_origin = 0.0  # ... and when its request was sent
        self._stretch_took = 0  # accepted answers to requests sent since then
        self._stretch_paused = 0.0  # time paused since then
        self._episode_answers = 0  # answers since the open episode began
        # A pause of the server's that one of our answers began (``on_pause``'s ``cause``),
        # under way: when the latest request it refused was sent, and how many answers have
        # accepted requests sent after that one (``RESUME_AFTER`` of them end the pause)
        self._held_by: float | None = None
        self._held_took = 0
        self._foreign_end = -math.inf  # the end of the latest pause with no cause (not ours)
        self.resumed: float | None = None  # a pause ends early, then: the governor's to take

    def __repr__(self) -> str:
        return (f"<RateController rate={self.rate:.2f}/{self.max_rate:g} ceiling={self.ceiling} "
                f"cuts={self.cuts}>")

    @property
    def limited(self) -> bool:
        """True while the effective rate is below the configured one."""
        return self.rate < self.max_rate

    def on_send(self, now: float) -> None:
        self.tick(now)
        if self._since is None:
            self._since = now
        self._sent += 1
        self._maybe_raise(now)

    def on_pause(self, start: float, end: float, cause: float | None = None) -> None:
        """The job is paused from ``start`` to ``end``: not sending, so not counted as time.
        ``cause``: when the request was sent whose answer asked for this pause (None: another
        process's pause, a shared job's, or one that holds several keys at once). The server
        taking requests sent after the one it refused ends such a pause early (``on_response``),
        but not before a pause with no cause ends (``_foreign_end``)."""
        if cause is not None and (self._held_by is not None or end >= self._pause_end):
            self._held_by = cause if self._held_by is None else max(self._held_by, cause)
            self._held_took = 0
        elif cause is None:
            self._foreign_end = max(self._foreign_end, end)
            if end > self._pause_end:
                self._held_by = None  # (a pause of someone else's: it runs its course)
        self._paused += end - start
        self._stretch_paused += end - start
        self._pause_end = max(self._pause_end, end)
        if self._decide_at is not None:
            self._decide_at = max(self._decide_at, end)

    def on_response(self, now: float, sent_at: float, limited: bool, asked: bool = False,
                    failed: bool = False) -> None:
        """Record an answer; ``limited``: the server said "too many requests"; ``asked``: the
        answer carried a ``Retry-After``; ``failed``: another retryable failure (a 5xx)."""
        self.background += (limited - self.background) / 2000.0
        held = self._held_by
        if held is not None and sent_at > held and now < self._pause_end:
            if limited or failed:  # (refused too: the server still holds the job back)
                self._held_by, self._held_took = sent_at, 0
            else:
                self._held_took += 1
                if self._held_took >= RESUME_AFTER:
                    self._resume(now)
        if asked:
            self._asked.append(now)
        # an answer about the rate of now: to a request sent since the last cut, and for a
        # 429 not in the second after it (the overrun the cut answered: its window not reset)
        current = sent_at >= self._last_cut and not (limited and sent_at < self._settle)
        if limited:
            self._clean_stretch(now, sent_at)
            self._proven_limited += 1
            self._limited_recent.append(now)
            if current:
                second = self._recent_share(now)
                self._episode_share = max(self._episode_share, second)
                if len(self._recent) + len(self._limited_recent) >= 5:
                    self._sure_share = max(self._sure_share, second)
        elif self._stretch is not None and sent_at >= self._stretch:
            self._stretch_took += 1
        self._proven_answers += 1  # (after ``_clean_stretch``: this answer is of the new count)
        if current:
            if limited:
                self._limited += 1
                if self._decide_at is None:
                    self._episode_answers = 0
                    self._decide_at = now + 0.25
                    since = self._since if self._since is not None else now
                    self._steady = now - max(since, self._pause_end) >= 1.0
                    while self._recent and self._recent[0] < now - 1.0:
                        self._recent.popleft()
                    self._recent_at_episode = len(self._recent)
            else:
                self._accepted += 1
        if not limited:
            self._recent.append(now)
            while self._recent[0] < now - 1.0:
                self._recent.popleft()
        if self._decide_at is not None:
            self._episode_answers += 1
        self.tick(now)
        if not limited:
            self._maybe_raise(now)

    def _resume(self, now: float) -> None:
        """End the pause under way now: the server has taken requests sent after the last one
        it refused, so it was not holding back the job (a per-item 429: one item's lock, a
        hot key) or it no longer is (its window was reset). The rest of the pause is no time
        paused, and the episode is judged soon (with no pause, a lone 429 at a rate the server
        takes cuts nothing: ``_cut``)."""
        self._held_by = None
        until = max(now, self._foreign_end)  # (another process's pause that ours extended)
        if until >= self._pause_end:
            return
        rest = self._pause_end - until
        self._paused = max(0.0, self._paused - rest)
        self._stretch_paused = max(0.0, self._stretch_paused - rest)
        self._pause_end = until
        if self._decide_at is not None:
            self._decide_at = min(self._decide_at, until + 0.25)
        self.resumed = until

    def _clean_stretch(self, now: float, sent_at: float) -> None:
        """A 429 ends a stretch without one: what the server took in it bounds a quota from
        below, if the 429 that began it was the quota's (its bucket, or window, was empty
        when it refused that request, after it was sent): since then it refilled at most at
        the quota's rate, pauses included, so ``quota >= accepted / wall``, counting the
        accepted answers to requests sent after that 429 came back, over the time from when
        it was sent to now. (A per-item 429, or a burst the bucket had saved up, can make
        this too high: so it is kept only while stretches keep showing 90 % of it, and
        forgotten two minutes after the last.) The first stretch, from the start, proves
        nothing: the bucket may have been full."""
        if self._stretch is not None and now - self._stretch - self._stretch_paused >= 2.0:
            took = self._stretch_took / (now - self._stretch_origin)
            proven = self._proven_now(now)
            if took >= 0.9 * proven:
                self._proven, self._proven_at = max(proven, took), now
                self._proven_answers = self._proven_limited = 0
        # (a pause already under way, for an earlier 429 of this episode, is the stretch's too)
        self._stretch, self._stretch_origin, self._stretch_took = now, sent_at, 0
        self._stretch_paused = max(0.0, self._pause_end - now)

    def _proven_now(self, now: float) -> float:
        """What the server was seen to take, unless no stretch has shown it for two minutes."""
        return self._proven if now - self._proven_at <= PROVEN_FOR else 0.0

    def limiting(self, now: float) -> bool:
        """Is the server holding back the *job* (not one item)? True when the answers of the
        last second that asked us to wait are more of them than the background (see the class
        docstring): then a ``Retry-After`` pauses every request, not only its own item."""
        self._trim(now)
        answers = len(self._recent) + len(self._limited_recent)
        return bool(self._asked) and len(self._asked) > self._noise() * answers

    def _trim(self, now: float) -> None:
        """Keep only the last second in the per-second windows."""
        cutoff = now - 1.0
        for q in (self._recent, self._limited_recent, self._asked):
            while q and q[0] < cutoff:
                q.popleft()

    def _recent_share(self, now: float) -> float:
        """The share of 429s among the answers of the last second."""
        self._trim(now)
        limited = len(self._limited_recent)
        return limited / (len(self._recent) + limited) if limited else 0.0

    def _noise(self) -> float:
        """The share of 429s that is background, not a quota: twice the long-run share, but
        never more than 1.5% (else a quota's own 429s would raise it until nothing counts)."""
        return min(2 * self.background, MAX_NOISE - 0.005) + 0.005

    def tick(self, now: float) -> None:
        """Judge an open episode once its time has come."""
        if self._decide_at is not None and now >= self._decide_at:
            self._cut(now)

    def _cut(self, now: float) -> None:
        answered = self._accepted + self._limited
        share, self._episode_share = self._episode_share, 0.0
        sure, self._sure_share = self._sure_share, 0.0
        if share <= self._noise():
            self._no_cut()  # background 429s (see the class docstring): change nothing
            return
        proven = self._proven_now(now)
        # few: no more 429s than the background gives by chance among the episode's answers
        answers = max(self._episode_answers, self._limited)
        lone = _binomial_tail(self._limited, answers, self._noise()) > 1e-3
        if proven and _binomial_tail(self._proven_limited, self._proven_answers,
                                     MAX_NOISE) <= 1e-6:
            # Lone 429s, but more of them since what the server took was last shown than the
            # most background ever allowed gives, beyond doubt: a window overrun after each
            # pause (a quota lowered mid-run: 40 -> 10 req/s kept a 429 and a 1-s pause
            # every 1.3 s for two minutes; now ~13 s)
            proven = self._proven = 0.0
        if lone and 0.97 * self.rate <= proven:
            # A lone 429 at a rate the server has been seen to take (or within the 3 % that a
            # cut keeps below a quota): no quota refuses that, so it is about its item. No
            # cut; and the ceiling (set by a like 429, likely) is forgotten: a fast climb.
            self.ceiling = None
            self._no_cut()
            return
        if not lone and self.rate < proven:
            proven = self._proven = 0.0  # many 429s below what the server took: it changed
        wall = max(now - (self._since if self._since is not None else now), 0.05)
        if self._steady:
            send_rate = min(self.rate, self._sent / max(wall - self._paused, 0.05))
            quota = send_rate * self._accepted / answered if answered else send_rate / 2
            # what the server accepted in the second before it said no: a quota, if windowed
            quota = max(quota, min(float(self._recent_at_episode), self.rate))
            self.ceiling = max(quota, self.min_rate)
            target = 0.97 * quota
        elif self._limited <= 1 and now - self._own_cut > 5.0:
            # A lone "too many requests" right after a pause or at the start: too little to
            # estimate from; back off a little (a real quota overrun brings many at once).
            # A job-wide rate just adopted is no cut of this controller's: a process joining
            # a shared job whose first few requests meet one 429 (another process's window
            # overrun) backs off 5 %, not to a tenth estimated from three answers.
            target = 0.95 * self.rate
        else:
            # What came back per second of wall-clock time: low at the start (the sending was
            # ramping up) or after a pause. The share of 429s among the episode's answers says
            # how far over a quota the job is (1 - quota / rate, once a saved burst is spent):
            # a few per-item 429s among many answers are no evidence of a quota far below.
            # (accepted per second, over at least a second: the quota of a window a second
            # long shows whole only then; 10 taken in 0.3 s is no quota of 33 a second; and
            # a pause the server asked for beyond a second, the rest of such a window, is no
            # time it took nothing in: Retry-After: 5 cut a quota of 10 to 3. Its whole pause
            # left out, one process met a quota of 30 with 17 429s a run, not 4: shared_sim.py)
            busy = wall - self._paused
            sending = min(self.rate, self._sent / max(busy, 0.005))
            shown = sending * (1 - self._limited / max(self._episode_answers, self._limited))
            quota = max(self._accepted / max(wall - max(0.0, self._paused - 1.0), 1.0), shown)
            self.ceiling = None
            target = 0.95 * quota
            if self.shared:  # a share of the job's answers, over less than a second (the
                # share of 429s of a second with a few answers says nothing: two of two after
                # a pause would let a cut to a tenth through)
                target = max(target, min(0.5, 1.0 - sure) * self.rate)
        rate = max(self.min_rate, 0.1 * self.rate, min(0.95 * self.rate, target))
        if lone and rate < proven:  # a lone 429 cuts no lower than the server took; a quota,
            rate = min(self.rate, proven)  # if any, is between that and where it came
            self.ceiling = self.rate
        self.rate = rate
        self._last_cut = self._own_cut = self._last_raise = now
        # requests sent in the next second may meet the window that was overrun (no pause of
        # the server's said when it resets): their 429s say nothing of the new rate
        self._settle = now if self._pause_end > now - SETTLE else now + SETTLE
        self._new_episode()
        self.cuts += 1

    def _no_cut(self) -> None:
        """Close the episode without a cut: what was sent and accepted since the last cut
        still counts (an estimate made soon after from a count started afresh here took a
        second's three answers for a quota of three a second)."""
        self._decide_at = None
        self._limited = 0

    def _new_episode(self) -> None:
        """Start counting afresh: no episode open, nothing sent, accepted or refused."""
        self._decide_at = self._since = None
        self._sent = self._accepted = self._limited = 0
        self._paused = 0.0

    def adopt(self, rate: float, now: float) -> None:
        """Another process of a shared job cut the job's rate: take ``rate`` (this process's
        share of it) if lower. Not counted as a cut of this controller's own."""
        if rate < self.rate:
            self.rate = max(self.min_rate, rate)
            self._proven = min(self._proven, self.rate)  # it is the job's rate now
            self._last_cut = self._last_raise = now
            self._new_episode()

    def _maybe_raise(self, now: float) -> None:
        if self.rate >= self.max_rate or self._decide_at is not None:
            self._last_raise = now
            return
        elapsed = now - self._last_raise
        if elapsed < 1.0:
            return
        c = self.ceiling
        near = c is not None and 0.9 * c <= self.rate <= 1.05 * c
        growth = 0.001 if near else 0.05
        self.rate = min(self.max_rate, self.rate * (1 + growth) ** elapsed)
        self._last_raise = now

    def reshare(self, max_rate: float) -> None:
        """A new share of a shared job's rate: the rate, and the quota estimate, go with the
        share (a rate slowed down to a quota found is a share of the job's quota: a run that
        found it alone keeps half of it when another one joins or resumes). What the server
        was seen to take shrinks with a smaller share (a larger one is not shown yet)."""
        f = max_rate / self.max_rate
        if f < 1:
            self._proven *= f
        self.rate = max_rate if self.rate >= self.max_rate else min(max_rate, self.rate * f)
        if self.ceiling is not None:
            self.ceiling *= f
        self.max_rate = max_rate


class Breaker:
    """Stops the job during an upstream outage, and probes until the upstream is back.

    Opens when, among the ``recent`` latest-*sent* requests that have been answered (sent
    within ``window`` seconds of the latest), at least ``min_failures`` are retryable failures
    (5xx, timeouts, connection errors: not 429s) from at least ``min_ids`` distinct IDs, they
    make up at least ``ratio`` of them, and the server's own failure rate cannot explain them:
    with ``p`` the share of failures among the answers so far (a moving average over about the
    last thousand, at most ``0.3``), a run of ``f`` failures among ``n`` answers must be less
    likely than ``false_open`` (the binomial tail ``P(X >= f | n, p)``). So a healthy server
    opens it after ``min_failures`` failures in a row, and a flaky one, whose bad IDs come in
    clusters now and then, needs a longer run. While open, ``gate`` allows one probe at a
    time, the first after ``probe_initial`` seconds, then at doubling intervals up to
    ``probe_max``. The first probe that is not a retryable failure closes it.

    NOTE: answers are judged in the order their requests were *sent*, not the order they
    arrive. Slow failures arrive late: when a job sends its last IDs, the answers that come in
    after the fast successes are the timeouts of requests sent seconds earlier, among healthy
    traffic. In arrival order the last few answers are then all failures, which looks like an
    outage and held the whole retry tail at the probe's pace; in send order those timeouts sit
    among the successes sent beside them. An outage still shows at once: what is sent after it
    began fails, and is the latest sent.
    """

    __slots__ = ("_interval", "_next_probe", "_probe_out", "_sent", "_who", "failure_rate",
                 "false_open", "min_failures", "min_ids", "open", "opened", "probe_initial",
                 "probe_max", "ratio", "recent", "window")

    def __init__(self, *, window: float = 2.0, recent: int = 10, min_failures: int = 8,
                 min_ids: int = 5, ratio: float = 0.8, probe_initial: float = 0.5,
                 probe_max: float = 10.0, false_open: float = 1e-7) -> None:
        self.window = window
        self.recent = recent
        self.false_open = false_open
        self.failure_rate = 0.02  # a prior: most servers fail a few percent of first tries
        self.min_failures = min_failures
        self.min_ids = min_ids
        self.ratio = ratio
        self.probe_initial = probe_initial
        self.probe_max = probe_max
        self.open = False
        self.opened = 0
        self._sent: list[float] = []  # when the judged requests were sent, in order
        self._who: list[str | None] = []  # beside each: the ID if it failed, else None
        self._interval = probe_initial
        self._next_probe = 0.0
        self._probe_out = False

    def __repr__(self) -> str:
        state = f"open next_probe={self._next_probe:.1f}" if self.open else "closed"
        return f"<Breaker {state} opened={self.opened} failure_rate={self.failure_rate:.3f}>"

    def stand_down(self) -> None:
        """Close without a probe: there is nothing left for it to hold back."""
        self.open = self._probe_out = False
        self._forget()

    def _forget(self) -> None:
        self._sent.clear()
        self._who.clear()

    def gate(self, now: float, *, take: bool = True) -> float | None:
        """``None``: send normally. ``0``: send, as the probe (``take=False``: only look).
        ``> 0``: wait that long first."""
        if not self.open:
            return None
        if self._probe_out:
            return self._interval
        if now >= self._next_probe:
            if take:
                self._probe_out = True
            return 0.0
        return self._next_probe - now

    def probe_unsent(self) -> None:
        """The probe ``gate`` let through was not sent after all: another may go at once
        (otherwise ``gate`` would wait for its answer for ever)."""
        self._probe_out = False

    def on_response(self, now: float, item_id: str, failed: bool, probe: bool,
                    sent_at: float | None = None) -> None:
        """Record an answer to a request sent at ``sent_at`` (default: ``now``)."""
        if self.open:
            if probe:
                self._probe_out = False
                if failed:
                    self._interval = min(self._interval * 2, self.probe_max)
                    self._next_probe = now + self._interval
                else:
                    self.open = False
                    self._forget()
            return
        self.failure_rate += (failed - self.failure_rate) / 1000.0
        # Two parallel lists, not a list of tuples: one untracked float and one reference per
        # answer, so the garbage collector's young generation does not count a container each.
        times, who = self._sent, self._who
        sent = now if sent_at is None else sent_at
        if times and sent < times[0] and len(times) >= self.recent:
            return  # sent before every request judged now: too old to matter
        mark = item_id if failed else None
        if times and sent < times[-1]:  # answered out of order (a slow one)
            i = bisect.bisect_right(times, sent)
            times.insert(i, sent)
            who.insert(i, mark)
        else:
            times.append(sent)
            who.append(mark)
        newest = times[-1]
        drop = max(len(times) - self.recent, 0)
        while drop < len(times) and times[drop] < newest - self.window:
            drop += 1
        if drop:
            del times[:drop], who[:drop]
        if not failed:
            return
        failures = [i for i in who if i is not None]
        if (len(failures) >= self.min_failures and len(set(failures)) >= self.min_ids
                and len(failures) >= self.ratio * len(times)
                and _binomial_tail(len(failures), len(times), min(self.failure_rate, 0.3))
                < self.false_open):
            self.open = True
            self.opened += 1
            self._interval = self.probe_initial
            self._next_probe = now + self._interval
            self._probe_out = False


def _binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``, ``0 < p < 1``: one minus the first ``k``
    terms, in logs (the first underflows for large ``n``); few terms for the small ``k`` asked
    about here, and none far out in the tail, where it is 0 to within 1e-20."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    mean = n * p
    if k > mean + 12 * math.sqrt(mean * (1 - p)) + 25:
        return 0.0
    log_term = n * math.log1p(-p)
    ratio = math.log(p) - math.log1p(-p)
    below = 0.0
    for i in range(k):
        below += math.exp(log_term)
        log_term += math.log(n - i) - math.log(i + 1) + ratio
    return max(0.0, 1.0 - below)


class Ticket(NamedTuple):
    """Handed out by ``Governor.acquire``; given back with the answer. ``lane``: the API key
    (``Lane``) the request goes out with."""

    sent_at: float
    probe: bool
    lane: int = 0


class Lane:
    """One API key's share of the job's rate (``[request] keys``; one lane without keys): its
    own token bucket, adaptive rate and ``Retry-After`` pause, because a provider that gives a
    quota per key limits each key by itself. ``retired``: the key was refused (401/402)."""

    __slots__ = ("controller", "index", "leave_slot", "leaving", "limiter", "next_slot",
                 "pacing", "paused_until", "rate", "retired", "sends", "turn")

    def __init__(self, index: int, rate: float, burst: int, *, adaptive: bool,
                 now: float) -> None:
        self.index = index
        self.rate = rate
        self.limiter = _bucket(burst, rate)
        self.sends = _bucket(burst, rate)  # the same bucket, as requests leave
        self.controller = RateController(max_rate=rate, now=now) if adaptive else None
        self.paused_until = 0.0
        self.next_slot = 0.0  # pacing at the effective rate, when it is below ``rate``: the
        self.pacing = asyncio.Lock()  # last ticket's time, and its waiters' line (``_paced``)
        self.leave_slot = 0.0  # the same, as requests leave
        self.leaving = asyncio.Lock()
        self.turn = 0.0  # when it is this lane's turn again, at its effective rate
        self.retired = False

    def __repr__(self) -> str:
        return (f"<Lane {self.index} rate={self.effective_rate:.1f}/{self.rate:g} "
                f"paused_until={self.paused_until:.1f} retired={self.retired}>")

    @property
    def effective_rate(self) -> float:
        return self.controller.rate if self.controller else self.rate

    def resize(self, rate: float, burst: int, spent: float, sends_spent: float) -> None:
        """A new share of the job's rate and burst; ``spent`` and ``sends_spent``: how much of
        the new buckets is used up already (what the old ones were: a re-share is no new
        burst)."""
        self.rate = rate
        self.limiter = _bucket(burst, rate, spent)
        self.sends = _bucket(burst, rate, sends_spent)
        c = self.controller
        if c is not None:
            c.reshare(rate)

    def pause(self, now: float, until: float, *, held_until: float = 0.0,
              cause: float | None = None) -> None:
        """Hold this lane until ``until``; ``held_until``: the job is paused until then anyway
        (that time is not counted twice as paused); ``cause``: ``RateController.on_pause``'s."""
        start = max(now, self.paused_until, held_until)
        if until > start and self.controller is not None:
            self.controller.on_pause(start, until, cause)
        self.paused_until = max(self.paused_until, until)


class Governor:
    """Pause + breaker + adaptive rate + token bucket, on the event loop's clock.

    With several API keys (``keys`` > 1) each key is a ``Lane`` with ``1 / keys`` of the rate
    and burst; ``acquire`` gives each request to the live lane whose turn comes first (turns
    advance at each lane's effective rate: a key slowed by its 429s gets fewer requests, a
    paused one none). A 429's ``Retry-After`` pauses its own key; any other ``Retry-After``
    (a 503: the upstream) pauses every key. A key refused with 401/402 is retired (``retire``)."""

    def __init__(self, *, rate: float, burst: int, adaptive: bool = True,
                 breaker: Breaker | None = None, keys: int = 1) -> None:
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self.rate = rate
        self.burst = burst
        self.lanes = [Lane(i, rate / keys, b, adaptive=adaptive, now=now)
                      for i, b in enumerate(_split(burst, keys))]
        self._single = keys == 1
        # several keys: the job's bucket too, the ceiling of all of them together (each
        # lane's share of the burst is at least 1, which could add up to more than it)
        self.limiter = None if self._single else _bucket(burst, rate)
        self.sends = None if self._single else _bucket(burst, rate)
        self.breaker = breaker
        # Are there IDs not yet sent (the breaker's to protect)? Set by each pass; while it says
        # no, an open breaker stands down: the IDs left are retries with their own backoff.
        self.unsent: Callable[[], bool] = lambda: True
        self.paused_until = 0.0  # the whole job's pause
        self.runs = 1  # processes sharing the job's rate (``share``)
        self._sent = False  # has a request been let through yet?

    def __repr__(self) -> str:
        return (f"<Governor rate={self.effective_rate:.1f}/{self.rate:g}/s burst={self.burst} "
                f"paused_for={self.paused_for:.1f}s lanes={len(self.live)} {self.breaker!r}>")

    @property
    def live(self) -> list[Lane]:
        """The lanes whose key has not been refused."""
        return [lane for lane in self.lanes if not lane.retired]

    @property
    def controller(self) -> RateController | None:
        """The first lane's adaptive rate (the only one without ``keys``)."""
        return self.lanes[0].controller

    @property
    def effective_rate(self) -> float:
        return sum(lane.effective_rate for lane in self.live)

    @property
    def paused_for(self) -> float:
        now = self._loop.time()
        until = self.paused_until
        live = self.live
        if live and not self._single:  # every key paused by itself: the job waits too
            until = max(until, min(lane.paused_until for lane in live))
        return max(0.0, until - now)

    @property
    def breaker_open(self) -> bool:
        return self.breaker is not None and self.breaker.open

    def share(self, runs: int) -> None:
        """Take ``1 / runs`` of the job's rate and burst: ``runs`` processes work on one job
        and together keep to its limit. The new buckets are as used up as the old ones, and
        wholly so in a process that has sent nothing yet (joining a job at work: the others
        may have spent the job's burst), so that a re-share never adds a burst to the job's."""
        self.runs = runs
        n = len(self.lanes)
        burst = max(1, round(self.burst / runs))
        def spent(bucket: AsyncLimiter) -> float:
            return _spent(bucket) if self._sent else 1.0

        for lane, b in zip(self.lanes, _split(burst, n), strict=True):
            lane.resize(self.rate / runs / n, b, spent(lane.limiter), spent(lane.sends))
            if lane.controller is not None:
                lane.controller.shared = runs > 1
        if self.limiter is not None and self.sends is not None:
            self.limiter = _bucket(burst, self.rate / runs, spent(self.limiter))
            self.sends = _bucket(burst, self.rate / runs, spent(self.sends))

    def rejoin(self) -> None:
        """This process sends again after it was idle (it took no share of a shared job's
        rate meanwhile, and the processes at work may have spent the job's burst): its
        buckets are used up, as a newcomer's are (``share``)."""
        self._sent = False
        self.share(self.runs)

    def pause(self, seconds: float, cause: float | None = None) -> None:
        """Hold every new request for ``seconds`` (extends, never shortens, a pause);
        ``cause``: with one key, ``RateController.on_pause``'s."""
        now = self._loop.time()
        until = now + seconds
        if until > self.paused_until:
            cause = cause if self._single else None
            for lane in self.lanes:
                start = max(now, self.paused_until, lane.paused_until)
                if until > start and lane.controller is not None:
                    lane.controller.on_pause(start, until, cause)
            self.paused_until = until

    @property
    def cuts(self) -> int:
        """How often the adaptive rate has cut itself (every key's), this run."""
        return sum(lane.controller.cuts for lane in self.lanes if lane.controller is not None)

    def adopt_rate(self, rate: float) -> None:
        """Take ``rate`` (this process's share of a job-wide rate that another process of the
        job cut to) as the effective rate, if lower. With one key only: with several, each
        key's quota is its own, and another process's cut of one key says nothing of the
        others (``Heartbeat`` neither publishes nor adopts then)."""
        c = self.controller
        if self._single and c is not None:
            c.adopt(rate, self._loop.time())

    def retire(self, lane: int) -> int:
        """The key of ``lane`` was refused: no request goes out with it again. Returns how many
        keys are left (0: the job cannot go on)."""
        self.lanes[lane].retired = True
        return len(self.live)

    def _pick(self, now: float) -> Lane | None:
        """The live lane whose turn comes first, of those not paused if there are any (a
        free key's turn runs ahead of now while requests queue for it: once past a paused
        key's pause end, they picked that key and slept on its pause, and every key sent
        nothing for ~0.8 s before each pause ended); ``None``: every key is retired."""
        best, best_at = None, (True, math.inf)
        for lane in self.lanes:
            if not lane.retired:
                at = (lane.paused_until > now, max(lane.turn, lane.paused_until))
                if at < best_at:
                    best, best_at = lane, at
        if best is not None:
            best.turn = max(best.turn, now) + 1.0 / best.effective_rate
        return best

    def ready(self) -> Ticket | None:
        """``acquire``'s ticket at once, when nothing holds a request back (one key, no pause,
        the breaker closed, the adaptive rate not pacing, a token in the bucket and nobody
        waiting for one: a crawl whose rate does not bind); else ``None``, and ``acquire``
        waits. (Two coroutines a request fewer, where the governor was ~20 % of what
        asyncrawl's loop does for a request at the stack's limit: ``bench/overhead.py``.)"""
        if not self._single or self.limiter is not None or self.breaker_open:
            return None
        now = self._loop.time()
        lane = self.lanes[0]
        if self._held(lane, now):
            return None
        c = lane.controller
        if c is not None:
            c.tick(now)
            if c.limited:
                return None
        return self._issue(lane, now, False) if _take(lane.limiter) else None

    async def acquire(self) -> Ticket:
        """Wait until a request may start. With every key retired it waits for ever (the
        worker that retired the last one has stopped the job)."""
        loop = self._loop
        breaker = self.breaker
        while True:
            now = loop.time()
            if self.paused_until > now:  # (looked at again: a pause may end early, ``_resume``)
                await asyncio.sleep(min(self.paused_until - now, 0.25))
                continue
            if breaker is not None and breaker.open:
                if not self.unsent():
                    breaker.stand_down()
                    continue
                gate = breaker.gate(now, take=False)
                if gate is not None and gate > 0:
                    await asyncio.sleep(min(gate, 0.25))  # re-check: it may close meanwhile
                    continue
            lane = self.lanes[0] if self._single else self._pick(now)
            if lane is None:
                await asyncio.Future()  # cancelled with the pass
                continue
            if lane.paused_until > now:  # every live key is paused
                await asyncio.sleep(min(lane.paused_until - now, 0.25))
                continue
            c = lane.controller
            if c is not None:
                c.tick(now)
                if c.limited:
                    async with lane.pacing:
                        lane.next_slot = await _paced(lane.next_slot, c)
            bucket, job_bucket = lane.limiter, self.limiter
            await bucket.acquire()
            if job_bucket is not None:
                await job_bucket.acquire()
            if bucket is not lane.limiter or job_bucket is not self.limiter:
                continue  # the rate was shared out meanwhile (``share``): wait in the new bucket
            # The waits above took time: decide on what holds *now* (a pause may have begun,
            # the breaker may have opened), so that nothing queued before it slips through.
            now = loop.time()
            if self._held(lane, now):
                continue
            probe = False
            if breaker is not None and breaker.open:
                gate = breaker.gate(now)
                if gate is not None and gate > 0:
                    continue
                probe = gate == 0
            return self._issue(lane, now, probe)

    def _held(self, lane: Lane, now: float) -> bool:
        """Whether a pause (the job's, or ``lane``'s key's) or a retired key holds a request
        back now."""
        return self.paused_until > now or lane.paused_until > now or lane.retired

    def _issue(self, lane: Lane, now: float, probe: bool) -> Ticket:
        """The ticket of a request that may start now with ``lane``'s key (it counts as sent)."""
        if lane.controller is not None:
            lane.controller.on_send(now)
        self._sent = True
        return Ticket(now, probe, lane.index)

    def may_leave(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s request may leave now (its intent is durable): a token of the
        second bucket (``leave``'s at once, when there is one and nobody waits for one)."""
        each = self.lanes[ticket.lane]
        c = each.controller
        if c is not None and c.limited:  # (paced at the adaptive rate: ``leave``)
            return False
        lane, job = each.sends, self.sends
        if job is None:
            return _take(lane)
        if not (_free(lane) and _free(job)):
            return False
        lane._level += 1  # (a token of each, as ``_take`` takes one)
        job._level += 1
        return True

    async def leave(self, ticket: Ticket) -> None:
        """Wait until ``ticket``'s request may leave: as many leave in any stretch of time as
        tickets may be taken in it, however long each waited for its intent; paced at the
        adaptive rate while it is below the configured one, as tickets are."""
        lane = self.lanes[ticket.lane]
        c = lane.controller
        if c is not None and c.limited:
            async with lane.leaving:
                lane.leave_slot = await _paced(lane.leave_slot, c)
        while True:
            bucket, job = lane.sends, self.sends
            await bucket.acquire()
            if job is not None:
                await job.acquire()
            if bucket is lane.sends and job is self.sends:
                return
            # (the rate was shared out meanwhile: wait in the new buckets)

    def holds(self, ticket: Ticket) -> bool:
        """Whether something holds ``ticket``'s request back now, which came after its ticket
        (while it waited for its intent and to leave): a pause, the breaker opened (unless
        it is the probe), its key refused. It does not leave then: it goes again later."""
        if self._held(self.lanes[ticket.lane], self._loop.time()):
            return True
        return self.breaker_open and not ticket.probe

    def unused(self, ticket: Ticket) -> None:
        """``ticket``'s request did not leave (its key was retired meanwhile): if it was the
        breaker's probe, the next request may probe."""
        if ticket.probe and self.breaker is not None:
            self.breaker.probe_unsent()

    def on_response(self, ticket: Ticket, item_id: str, *, limited: bool, failed: bool,
                    retry_after: float | None, evidence: bool = True) -> None:
        """Feed an answer back. ``limited``: a 429; ``failed``: another retryable failure;
        ``evidence``: the answer may count towards opening the breaker (an ID's first try:
        retries of IDs that already failed say nothing about the upstream as a whole)."""
        now = self._loop.time()
        lane = self.lanes[ticket.lane]
        c = lane.controller
        asked = retry_after is not None and (limited or failed)
        if c is not None:
            c.on_response(now, ticket.sent_at, limited, asked, failed)
            if c.resumed is not None:  # the server took requests sent after the one it refused
                until, c.resumed = c.resumed, None
                if self._single:
                    self.paused_until = min(self.paused_until, until)
                else:
                    lane.paused_until = min(lane.paused_until, until)
        # A Retry-After holds every request when the server is holding back the job; a lone
        # one (one item's lock, a stray 429 among hundreds of 200s) holds only its own item,
        # which the worker parks for that long. Without the adaptive rate: every one. With
        # several keys, a 429 holds back its own key. Either pause ends early when answers
        # show the server taking requests sent after the refused one (``RateController``).
        if asked and (c is None or c.limiting(now)):
            if limited and not self._single:
                lane.pause(now, now + retry_after,  # type: ignore[operator]
                           held_until=self.paused_until, cause=ticket.sent_at)
            else:
                self.pause(retry_after, ticket.sent_at)  # type: ignore[arg-type]
        if self.breaker is not None and (evidence or ticket.probe):
            self.breaker.on_response(now, item_id, failed or (limited and ticket.probe),
                                     ticket.probe, ticket.sent_at)


def _bucket(capacity: int, rate: float, spent: float = 0.0) -> AsyncLimiter:
    """aiolimiter's token bucket: ``capacity`` requests at most at once, refilled at ``rate``
    a second, ``spent`` (0 to 1) of it used up already. (aiolimiter starts a bucket full and
    has no public way to start it otherwise: its ``_level``, which ``_leak`` keeps current.)"""
    bucket = AsyncLimiter(capacity, capacity / rate)
    if spent > 0:
        bucket._level = min(spent, 1.0) * capacity
        bucket._last_check = asyncio.get_running_loop().time()
    return bucket


def _take(bucket: AsyncLimiter) -> bool:
    """A token from ``bucket`` now, if it has one and no task waits for one (what its
    ``acquire`` does when it need not wait: the same level, through the same private field
    as ``_bucket``)."""
    if not _free(bucket):
        return False
    bucket._level += 1
    return True


async def _paced(last: float, c: RateController) -> float:
    """Wait until ``1 / rate`` after ``last`` (the slot before) at the adaptive rate of now,
    read again at least every 0.25 s; the slot's time. One waiter at a time (the caller holds
    the lane's lock; the others queue behind it), so a rate that climbs while requests wait
    paces them at once: each booked its slot ahead at the rate of its arrival, and after a cut
    to 0.26/s, 16 workers held a minute of slots at that rate while it climbed back."""
    loop = asyncio.get_running_loop()
    while True:
        now = loop.time()
        gap = 1.0 / c.rate
        at = last + gap
        if at <= now:  # on time (a sleep's lateness does not slow the rate down), or late by
            return at if now - at < gap else now  # more than a slot: from now, no catching up
        await asyncio.sleep(min(at - now, 0.25))


def _free(bucket: AsyncLimiter) -> bool:
    """Whether ``bucket`` has a token now for a task that would not wait for it."""
    return not bucket._waiters and bucket.has_capacity()


def _spent(bucket: AsyncLimiter) -> float:
    """How much of ``bucket`` is used up now (0 to 1)."""
    bucket.has_capacity(0)  # (brings its level up to now)
    return bucket._level / bucket.max_rate


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` whole shares as even as can be (each at least 1)."""
    return [max(1, total // parts + (i < total % parts)) for i in range(parts)]


class Budget:
    """At most ``limit`` billable answers this run (``None``: no limit).

    ``grant`` (a job shared by several processes): the limit is the *job's*, and this run may
    only spend what it was granted from it; ``grant(n)`` asks the job for up to ``n`` more
    calls and returns how many it got (0: the job's budget is spent). What a run was granted
    and did not spend goes back to the job when it ends (``unspent``); a run that dies loses
    its grant, so the job stops short rather than over its budget."""

    __slots__ = ("_asking", "_changed", "_grant", "_spent", "billed", "granted", "limit",
                 "reserved")

    def __init__(self, limit: int | None,
                 grant: Callable[[int], Awaitable[int]] | None = None) -> None:
        self.limit = limit
        self.billed = 0
        self.reserved = 0
        self._grant = grant if limit is not None else None
        self.granted = 0 if self._grant is not None else (limit or 0)
        self._spent = False  # the job has nothing more to grant
        self._asking = False
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return (f"<Budget billed={self.billed} reserved={self.reserved} limit={self.limit} "
                f"granted={self.granted}>")

    @property
    def exhausted(self) -> bool:
        if self.limit is None:
            return False
        if self._grant is not None:
            return self._spent and self.billed >= self.granted
        return self.billed >= self.limit

    @property
    def unspent(self) -> int:
        """Granted by the job and not spent (given back when the run ends). A request still
        reserved when the run ends was cut off in flight: it may have been billed, so its
        slot is not given back (the job stops short rather than over its budget)."""
        return max(0, self.granted - self.billed - self.reserved) if self._grant is not None else 0

    async def reserve(self) -> bool:
        """Reserve a slot for one request; ``False`` once the budget is spent."""
        if self.limit is None:
            return True
        while True:
            if self.billed >= self.limit or (self._spent and self.billed >= self.granted):
                return False
            if self.billed + self.reserved < self.granted:
                self.reserved += 1
                return True
            if self._grant is not None and not self._spent and not self._asking:
                self._asking = True
                try:
                    got = await self._grant(GRANT_CHUNK)
                finally:
                    self._asking = False
                    self._wake()
                self.granted += got
                self._spent = got < GRANT_CHUNK
                continue
            if self.reserved == 0 and not self._asking:
                return False  # nothing in flight could give a slot back
            await self._changed.wait()  # every slot is in flight: wait for one to come back

    def release(self, billable: bool) -> None:
        """Return a reserved slot with whether its call was, or may have been, billable (a
        2xx answer, or none at all: the slot is spent)."""
        if self.limit is None:
            self.billed += billable
            return
        self.reserved -= 1
        self.billed += billable
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


GRANT_CHUNK = 16  # calls a run of a shared job takes from the job's budget at a time
