"""The governor's policies on a fake clock: no sleeping, every time is an explicit ``now``."""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Awaitable, Callable

import pytest

from asyncrawl.governor import Breaker, Budget, Governor, RateController, Ticket


def simulate_quota(quota: int, rate: float, seconds: float, latency: float = 0.002,
                   retry_after: float = 1.0) -> tuple[RateController, list[tuple[float, bool]]]:
    """A client paced by ``RateController`` against a fixed-window server allowing ``quota``
    requests per second (429 + Retry-After beyond it). Returns the answers as (time, limited)."""
    c = RateController(max_rate=rate, now=0.0)
    now, paused_until, window, used = 0.0, 0.0, -1, 0
    answers: list[tuple[float, bool]] = []
    while now < seconds:
        now = max(now + 1.0 / c.rate, paused_until)
        c.tick(now)
        c.on_send(now)
        sent = now
        if int(now) != window:
            window, used = int(now), 0
        limited = used >= quota
        used += not limited
        done = now + latency
        c.on_response(done, sent, limited)
        answers.append((done, limited))
        if limited and done + retry_after > paused_until:
            c.on_pause(max(done, paused_until), done + retry_after)
            paused_until = done + retry_after
    return c, answers


def test_rate_controller_finds_a_hard_quota_quickly() -> None:
    c, answers = simulate_quota(quota=40, rate=200, seconds=60)
    late = [limited for t, limited in answers if t >= 5]
    ok_per_s = sum(1 for lim in late if not lim) / 55
    assert sum(late) / len(late) < 0.05
    assert ok_per_s >= 36
    assert 36 <= c.rate <= 40.5
    assert c.ceiling is not None and 38 <= c.ceiling <= 42


@pytest.mark.parametrize("quota", [5, 80, 400])
def test_rate_controller_converges_for_other_quotas(quota: int) -> None:
    _, answers = simulate_quota(quota=quota, rate=quota * 5, seconds=60)
    late = [lim for t, lim in answers if t >= 15]
    assert sum(late) / len(late) < 0.05
    assert sum(1 for lim in late if not lim) / 45 >= 0.85 * quota


def simulate_in_flight(quota: int, rate: float, seconds: float, retry_after: float | None,
                       in_flight: int = 16, latency: float = 0.05) -> list[tuple[float, bool]]:
    """``simulate_quota`` with ``in_flight`` requests out at once (``latency`` each), and a
    server that may say nothing of when to come back (``retry_after`` None): the answers."""
    c = RateController(max_rate=rate, now=0.0)
    now, paused_until, window, used, slot = 0.0, 0.0, -1, 0, 0.0
    answers: list[tuple[float, bool]] = []
    out: list[tuple[float, float, bool]] = []  # (answered at, sent at, limited)
    while now < seconds:
        send_at = max(slot, paused_until, now)
        if len(out) >= in_flight or (out and out[0][0] <= send_at):
            done, sent, limited = heapq.heappop(out)
            now = done
            c.on_response(done, sent, limited, limited and retry_after is not None)
            answers.append((done, limited))
            if limited and retry_after is not None and done + retry_after > paused_until:
                c.on_pause(max(done, paused_until), done + retry_after)
                paused_until = done + retry_after
            continue
        now = send_at
        c.tick(now)
        if now < max(slot, paused_until):
            continue
        c.on_send(now)
        slot = now + 1.0 / c.rate
        if int(now) != window:
            window, used = int(now), 0
        limited = used >= quota
        used += not limited
        heapq.heappush(out, (now + latency, now, limited))
    return answers


@pytest.mark.parametrize(("quota", "rate", "retry_after"), [
    (10, 30, None), (5, 25, None), (40, 200, None), (80, 400, None), (10, 30, 5.0)])
def test_an_overrun_without_a_pause_or_with_a_long_one_is_no_collapse(
        quota: int, rate: float, retry_after: float | None) -> None:
    """A 429 that says nothing of when to come back: the requests sent just after the cut met
    the window that was overrun, and each such episode cut again, to a tenth (10 a second
    fell to 0.26); a long Retry-After counted as time the server took nothing in (5 s: cut to
    3 for a quota of 10). A rate-limit audit against a server of its own."""
    answers = simulate_in_flight(quota, rate, 60, retry_after)
    late = [limited for t, limited in answers if t >= 15]
    # (a 5-s pause: 7.8 ok/s before; a second of each pause still counts, see _cut)
    assert sum(1 for lim in late if not lim) / 45 >= (0.85 if retry_after else 0.9) * quota
    assert sum(late) / len(late) < 0.05


def test_rate_controller_recovers_when_the_limit_goes_away() -> None:
    c = RateController(max_rate=100, now=0.0)
    c.on_send(0.0)
    c.on_response(0.01, 0.0, limited=True)
    c.tick(0.5)
    assert c.rate < 100 and c.cuts == 1
    t = 1.0
    while t < 120:  # clean answers only: climb back, but never above the configured rate
        c.on_send(t)
        c.on_response(t + 0.01, t, limited=False)
        t += 0.1
    assert c.rate == 100


def test_rate_controller_ignores_answers_to_requests_sent_before_a_cut() -> None:
    c = RateController(max_rate=100, now=0.0)
    for i in range(50):
        c.on_send(i * 0.01)
    c.on_response(0.6, 0.0, limited=True)
    c.tick(1.0)
    rate = c.rate
    for i in range(20):  # the rest of the old burst comes back limited: old news
        c.on_response(1.0 + i * 0.001, 0.1, limited=True)
    c.tick(2.0)
    assert c.rate == rate and c.cuts == 1


def test_breaker_opens_on_an_outage_probes_and_closes() -> None:
    b = Breaker(probe_initial=0.5, probe_max=2.0)
    for i in range(30):
        b.on_response(i * 0.01, f"ok{i}", failed=False, probe=False)
    for i in range(7):
        b.on_response(1.0 + i * 0.01, f"bad{i}", failed=True, probe=False)
    assert not b.open
    b.on_response(1.1, "bad7", failed=True, probe=False)
    assert b.open and b.opened == 1
    assert b.gate(1.2) == pytest.approx(0.4)  # wait for the first probe
    assert b.gate(1.6) == 0  # this caller is the probe
    assert b.gate(1.6) > 0  # nobody else while it is out
    b.on_response(1.7, "p1", failed=True, probe=True)
    assert b.gate(1.8) == pytest.approx(0.9)  # the interval doubled to 1 s
    assert b.gate(2.7) == 0
    b.on_response(2.8, "p2", failed=True, probe=True)
    assert b.gate(2.8) == pytest.approx(2.0)
    assert b.gate(4.8) == 0
    b.on_response(4.9, "p3", failed=True, probe=True)
    assert b.gate(4.9) == pytest.approx(2.0)  # capped at probe_max
    assert b.gate(6.9) == 0
    b.on_response(7.0, "p4", failed=False, probe=True)
    assert not b.open and b.gate(7.0) is None


def test_breaker_needs_failures_from_several_ids() -> None:
    b = Breaker()
    for i in range(20):  # one ID failing over and over is that ID's problem, not an outage
        b.on_response(i * 0.01, "same", failed=True, probe=False)
    assert not b.open


def test_breaker_ignores_a_scatter_of_failures() -> None:
    b = Breaker()
    t = 0.0
    for i in range(1000):  # 15% failures, spread out: a normal day
        b.on_response(t, f"id{i}", failed=i % 7 == 0, probe=False)
        t += 0.003
    assert not b.open


async def test_a_shared_budget_keeps_the_slots_of_requests_cut_off_in_flight() -> None:
    """What a run gives back to a shared job's budget when it ends: granted, not billed, and
    not still out (a request cut off by a stop may have been billed)."""
    async def grant(n: int) -> int:
        return min(n, 4)

    b = Budget(100, grant)
    assert all([await b.reserve() for _ in range(4)])
    b.release(True)
    b.release(False)  # two answered (one billed); two cut off in flight
    assert (b.granted, b.billed, b.reserved, b.unspent) == (4, 1, 2, 1)


async def test_budget_never_overshoots_with_requests_in_flight() -> None:
    b = Budget(3)
    assert all([await b.reserve() for _ in range(3)])
    waiter = asyncio.create_task(b.reserve())
    await asyncio.sleep(0)
    assert not waiter.done()  # all three slots are in flight
    b.release(False)  # one came back unbilled: its slot is free again
    assert await waiter
    b.release(True)
    b.release(True)
    b.release(True)
    assert b.exhausted
    assert not await b.reserve()


# -- issue 11: a healthy-but-flaky server is not a sick one --------------------------------------


def test_rate_controller_ignores_a_background_of_single_item_429s() -> None:
    """0.3 % of answers are 429 whatever the rate (per-item locks): no cut, no pause."""
    c = RateController(max_rate=400, now=0.0)
    t, n = 0.0, 0
    limiting = []
    while t < 60:
        c.tick(t)
        c.on_send(t)
        n += 1
        limited = n % 333 == 0
        c.on_response(t + 0.005, t, limited, asked=limited)
        if limited:
            limiting.append(c.limiting(t + 0.005))
        t += 1.0 / c.rate
    assert len(limiting) > 50
    assert not any(limiting)  # a lone Retry-After holds its own item, not the job
    assert c.rate == 400 and c.cuts == 0


def test_rate_controller_still_pauses_and_cuts_for_a_quota_overrun() -> None:
    c = RateController(max_rate=200, now=0.0)
    for i in range(200):  # one second at 200 req/s against a quota of 40: 160 are refused
        c.on_send(i / 200)
        limited = i % 5 != 0
        c.on_response(i / 200 + 0.005, i / 200, limited, asked=limited)
    assert c.limiting(1.0)  # every Retry-After holds the whole job
    c.tick(1.5)
    assert c.cuts >= 1 and c.rate < 60


def test_429s_to_requests_sent_just_after_a_cut_do_not_count_against_the_next_episode() -> None:
    """Answers that met the window a cut answered (sent within ``SETTLE`` of it) open no
    episode; nor does their share of 429s judge the next one: a lone 429 a second later,
    among a second's ~380 answers (background), cut the rate again (380 -> 361)."""
    c, t = RateController(max_rate=400, now=0.0), 0.0
    while t < 2.0:  # two clean seconds at 400 req/s
        c.on_send(t)
        c.on_response(t + 0.005, t, False)
        t += 1 / 400
    for i in range(80):  # then a quota of 200: every other request refused, no Retry-After
        c.on_send(t)
        c.on_response(t + 0.005, t, i % 2 == 1)
        t += 1 / 400
    c.tick(t + 0.3)
    assert c.cuts == 1
    cut_at, t = t + 0.3, t + 0.3
    while t < cut_at + 1.5:  # the window the cut answered refuses what goes in the next 0.3 s
        c.on_send(t)
        refused = t < cut_at + 0.3 and int(t * 100) % 3 == 0
        c.on_response(t + 0.005, t, refused)
        t += 1 / c.rate
    c.on_send(t)
    c.on_response(t + 0.005, t, True)  # one per-item 429 among the second's answers
    c.tick(t + 0.5)
    assert c.cuts == 1


def paused_by_one_429(sent_at: float = 1.0) -> RateController:
    """A controller at 50 req/s whose job the answer at 1.05 s to the request sent at
    ``sent_at`` paused until 2.05 s (a ``Retry-After: 1``): one 429 among 50 answers."""
    c = RateController(max_rate=50, now=0.0)
    for i in range(50):
        c.on_send(i / 50)
        c.on_response(i / 50 + 0.05, i / 50, False)
    c.on_response(1.05, sent_at, True, asked=True)
    assert c.limiting(1.05)  # (one 429 among a second's 50 answers: more than the noise)
    c.on_pause(1.05, 2.05, cause=sent_at)
    return c


def test_a_pause_ends_when_the_server_takes_requests_sent_after_the_one_it_refused() -> None:
    """A per-item 429 whose ``Retry-After`` paused the job: the answers accepting two requests
    sent after it show that the server is not holding the job back, and the pause ends (at
    rate 50 a 1 % mix of per-item 429s with ``Retry-After: 1`` held the job at ~5 req/s: a
    rate-limit audit). Answers to requests sent before it say nothing: they were in the
    window before the refusal."""
    c = paused_by_one_429()
    c.on_response(1.06, 0.99, False)  # sent before the refused request: no evidence
    c.on_response(1.07, 1.02, False)
    assert c.resumed is None
    c.on_response(1.08, 1.03, False)  # the second sent after it
    assert c.resumed == 1.08
    c.tick(1.4)  # judged soon, as if unpaused; a lone 429 at the rate it came: a 5 % cut at most
    assert c.rate >= 0.95 * 50


def test_a_pause_holds_while_the_server_refuses_what_was_sent_after() -> None:
    """A window that is used up refuses every request sent after the first refused one: the
    pause runs its course; and a pause asked for by someone else (another process of a shared
    job, the upstream) is not this controller's to end."""
    c = paused_by_one_429()
    c.on_response(1.06, 1.01, True, asked=True)  # refused too
    c.on_response(1.07, 1.00, False)  # (sent before the latest refused one)
    c.on_response(1.08, 1.02, False)
    assert c.resumed is None  # one accepted after the latest refusal is not enough
    c = paused_by_one_429()
    c.on_pause(1.06, 3.0)  # another process's pause, longer: it runs its course
    c.on_response(1.07, 1.02, False)
    c.on_response(1.08, 1.03, False)
    assert c.resumed is None


async def test_the_governor_lets_requests_go_again_when_a_pause_ends_early() -> None:
    gov = Governor(rate=50, burst=1)
    sent = [await gov.acquire() for _ in range(3)]
    gov.on_response(sent[0], "a", limited=True, failed=False, retry_after=30.0)
    assert gov.paused_for > 29  # (a lone 429 at the start: more than the noise)
    gov.on_response(sent[1], "b", limited=False, failed=False, retry_after=None)
    gov.on_response(sent[2], "c", limited=False, failed=True, retry_after=None)
    assert gov.paused_for > 29  # a 5xx is no sign that the server takes the job
    later = Ticket(sent[2].sent_at + 0.001, False)
    gov.on_response(later, "d", limited=False, failed=False, retry_after=None)
    gov.on_response(later, "e", limited=False, failed=False, retry_after=None)
    assert gov.paused_for == 0


async def test_requests_waiting_in_a_pause_go_when_it_ends_early() -> None:
    """A request waiting in ``acquire`` slept the whole ``Retry-After`` in one go: the pause
    ended early, and it still waited 30 s (a review). And a pause of another process's that
    the 429's extended runs its course: only what the 429 added is taken back."""
    gov = Governor(rate=50, burst=1)
    sent = [await gov.acquire() for _ in range(3)]
    gov.on_response(sent[0], "a", limited=True, failed=False, retry_after=30.0)
    waiting = asyncio.create_task(gov.acquire())
    await asyncio.sleep(0)
    assert not waiting.done()
    for t, i in zip(sent[1:], "bc", strict=True):
        gov.on_response(t, i, limited=False, failed=False, retry_after=None)
    assert gov.paused_for == 0
    await asyncio.wait_for(waiting, 2)  # (within its next look, 0.25 s)

    gov = Governor(rate=50, burst=1)
    sent = [await gov.acquire() for _ in range(3)]
    gov.pause(10.0)  # another process's (a shared job's heartbeat)
    gov.on_response(sent[0], "a", limited=True, failed=False, retry_after=30.0)
    assert gov.paused_for > 29
    for t, i in zip(sent[1:], "bc", strict=True):
        gov.on_response(t, i, limited=False, failed=False, retry_after=None)
    assert 9 < gov.paused_for <= 10


async def test_a_key_s_pause_ends_when_the_server_takes_its_later_requests() -> None:
    gov = Governor(rate=50, burst=2, keys=2)
    sent = [await gov.acquire() for _ in range(6)]
    first, *after = [t for t in sent if t.lane == 0]
    gov.on_response(first, "a", limited=True, failed=False, retry_after=30.0)
    assert gov.lanes[0].paused_until > gov.lanes[1].paused_until  # (its key only)
    other = next(t for t in sent if t.lane == 1)
    gov.on_response(other, "b", limited=False, failed=False, retry_after=None)
    gov.on_response(other, "c", limited=False, failed=False, retry_after=None)
    assert gov.lanes[0].paused_until > gov.lanes[1].paused_until  # (another key's answers)
    for t, i in zip(after[:2], "de", strict=True):
        gov.on_response(t, i, limited=False, failed=False, retry_after=None)
    assert gov.lanes[0].paused_until <= asyncio.get_running_loop().time()


def test_breaker_judges_slow_failures_among_the_requests_sent_beside_them() -> None:
    """The last answers of a job are the timeouts of requests sent 1.5 s earlier among
    successes: in arrival order ten failures in a row, in send order a scatter."""
    b = Breaker()
    for i in range(300):  # 300 first tries sent over 1.5 s, every 20th stalls
        if i % 20:
            b.on_response(i * 0.005 + 0.01, f"ok{i}", failed=False, probe=False, sent_at=i * 0.005)
    for i in range(0, 300, 20):  # the stalls time out 1.5 s after they were sent
        b.on_response(i * 0.005 + 1.5, f"slow{i}", failed=True, probe=False, sent_at=i * 0.005)
    assert not b.open and b.opened == 0


def test_breaker_needs_a_longer_run_of_failures_on_a_flaky_server() -> None:
    b = Breaker()
    t = 0.0
    for i in range(2000):  # a server that fails 17 % of first tries
        b.on_response(t, f"w{i}", failed=i % 6 == 0, probe=False)
        t += 0.0025
    assert not b.open
    for i in range(8):  # a cluster of eight bad IDs among two good: no outage at 17 %
        b.on_response(t, f"bad{i}", failed=True, probe=False)
        t += 0.0025
    assert not b.open
    for i in range(12):  # but an unbroken run that 17 % cannot explain is one
        b.on_response(t, f"down{i}", failed=True, probe=False)
        t += 0.0025
    assert b.open


def open_breaker(probe_after: float) -> Governor:
    """A governor whose breaker an outage has just opened; it probes every ``probe_after`` s."""
    gov = Governor(rate=1000, burst=10,
                   breaker=Breaker(probe_initial=probe_after, probe_max=probe_after))
    assert gov.breaker is not None
    now = asyncio.get_running_loop().time()
    for i in range(10):
        gov.breaker.on_response(now, f"x{i}", failed=True, probe=False)
    assert gov.breaker_open
    return gov


async def test_a_probe_that_was_not_sent_lets_the_next_request_probe() -> None:
    """With several keys a worker may hold the probe's ticket and not send (its key was
    retired meanwhile): handed back with ``unused``, the next request probes at once instead
    of the breaker waiting for an answer that never comes."""
    gov = open_breaker(probe_after=0.01)
    probe = await asyncio.wait_for(gov.acquire(), 5)
    assert probe.probe
    with pytest.raises(TimeoutError):  # one probe at a time: the others wait for its answer
        await asyncio.wait_for(gov.acquire(), 0.3)
    gov.unused(probe)
    assert (await asyncio.wait_for(gov.acquire(), 5)).probe


async def test_an_open_breaker_stands_down_when_nothing_unsent_is_left() -> None:
    gov = open_breaker(probe_after=60)
    gov.unsent = lambda: True  # fresh IDs wait: they are held (the first probe is 60 s away)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gov.acquire(), 0.3)
    gov.unsent = lambda: False  # only retries left: each goes by its own backoff
    ticket = await asyncio.wait_for(gov.acquire(), 5)
    assert not gov.breaker_open and not ticket.probe


async def tickets(gov: Governor, tasks: int, seconds: float,
                  take: Callable[[], Awaitable[object]],
                  then: Callable[[], None] | None = None) -> tuple[list[float], float]:
    """``tasks`` workers taking tickets with ``take()`` for ``seconds`` (``then()`` once they
    are all waiting, before the clock starts): when each got one, and the seconds timed."""
    loop = asyncio.get_running_loop()
    passed: list[float] = []

    async def worker() -> None:
        while True:
            await take()
            passed.append(loop.time())

    workers = [asyncio.create_task(worker()) for _ in range(tasks)]
    await asyncio.sleep(0)
    if then is not None:
        then()
    t0 = loop.time()
    try:
        await asyncio.sleep(seconds)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return passed, loop.time() - t0


async def test_requests_waiting_when_the_rate_is_shared_out_go_at_the_new_rate() -> None:
    """A run of a shared job that takes a smaller share (more runs joined) paces the requests
    already waiting for its bucket at the new rate too: they used to drain at the old rate
    (a burst over the job's rate in the first seconds of a multi-process job)."""
    gov = Governor(rate=1000, burst=1, adaptive=False)
    await gov.acquire()  # the bucket is full: every worker below waits in it

    def re_share() -> None:  # once each is waiting in the bucket of 1,000/s
        gov.share(100)  # 99 more runs: 10/s

    passed, elapsed = await tickets(gov, 30, 0.5, lambda: gov.acquire(), then=re_share)
    # At 10/s with a burst of 1: at most 1 + 10 x the time (30 in a few ms before the fix)
    assert 1 <= len(passed) <= 2 + 10 * elapsed * 1.05, (len(passed), elapsed)


async def test_a_re_share_of_the_rate_adds_no_burst_to_the_job_s() -> None:
    """A run that spent its burst and then takes a smaller share (a run joined) gets a bucket
    as used up as its old one; a run that joins a job at work (it has sent nothing) starts
    with its bucket spent: the others may have spent the job's burst. (Each new bucket used to
    start full: runs started a little apart went over the job's rate by a burst a join.)"""
    first = Governor(rate=100, burst=10, adaptive=False)
    for _ in range(10):
        await asyncio.wait_for(first.acquire(), 5)
    assert not first.lanes[0].limiter.has_capacity()  # its burst is spent
    first.share(2)
    assert not first.lanes[0].limiter.has_capacity()  # still spent: no new burst
    joining = Governor(rate=100, burst=10, adaptive=False)
    joining.share(2)
    assert not joining.lanes[0].limiter.has_capacity()
    alone = Governor(rate=100, burst=10, adaptive=False)  # a job's first run: its burst
    assert alone.lanes[0].limiter.has_capacity(10)


def pace(c: RateController, answer: Callable[[float], bool], seconds: float, *,
         in_flight: int = 64, latency: float = 0.005) -> list[tuple[float, float, bool]]:
    """A client paced by ``c`` against ``answer(t) -> limited`` (the server decides half-way),
    with up to ``in_flight`` requests out at once, each answered ``latency`` seconds after it
    was sent. Every 429 carries ``Retry-After: 1`` and, when ``c`` judges it holds the job
    back, pauses the job as the governor does. Returns (time, rate, limited) per request."""
    out: list[tuple[float, float, bool]] = []  # heap of (answered at, sent at, limited)
    t, paused_until, ready, seen = 0.0, 0.0, 0.0, []
    while t < seconds:
        slot = max(ready, paused_until, t)
        if len(out) >= in_flight or (out and out[0][0] <= slot):
            at, sent, limited = heapq.heappop(out)
            t = max(t, at)
            c.on_response(t, sent, limited, asked=limited)
            if c.resumed is not None:  # (as the governor: the server took what was sent after)
                c.resumed, paused_until = None, min(paused_until, c.resumed)
            if limited and c.limiting(t) and t + 1.0 > paused_until:
                c.on_pause(max(t, paused_until), t + 1.0, cause=sent)
                paused_until = t + 1.0
            continue
        t = slot
        c.tick(t)
        c.on_send(t)
        limited = answer(t + latency / 2)
        heapq.heappush(out, (t + latency, t, limited))
        ready = t + 1.0 / c.rate
        seen.append((t, c.rate, limited))
    return seen


@pytest.mark.parametrize("rate", [20, 50, 100])
def test_lone_429s_at_a_low_rate_do_not_ratchet_the_rate_down(rate: int) -> None:
    """Every 333rd answer is a 429 with ``Retry-After: 1`` whatever the rate (per-item locks),
    at rates where a second holds too few answers to tell one from a quota overrun (one 429
    among 50 answers is 2 %). Each pauses the job (as it must: see
    ``test_retry_after_pauses_the_whole_job``), and the first ones cut the rate; but no 429
    cuts below what the server has been seen to take: after ``T`` s of sending without a
    429 that followed one and its pause, ``quota >= rate x T / (T + pause)`` (here T = 333 /
    rate, so 0.77 of the rate at 100 req/s, 0.87 at 50, 0.94 at 20). The rate used to ratchet
    down for good: 100 req/s ended at 8.5, 50 at 7, 20 at 6.3."""
    n = 0

    def answer(t: float) -> bool:
        nonlocal n
        n += 1
        return n % 333 == 0

    seen = pace(RateController(max_rate=rate, now=0.0), answer, seconds=600)
    rates = [r for t, r, _ in seen if t > 5]
    third = len(rates) // 3
    mean, late = sum(rates) / len(rates), sum(rates[-third:]) / third
    bound = rate * (333 / rate) / (333 / rate + 1.0)
    assert min(rates) >= 0.95 * bound, (min(rates), bound)  # not a ratchet: bounded ...
    assert late >= 0.95 * bound and mean >= 0.95 * bound, (mean, late)  # ... all along


@pytest.mark.parametrize("rate", [100, 150, 400])
def test_random_lone_429s_leave_the_rate_alone(rate: int) -> None:
    """0.3 % of answers at random are 429s (so now and then two in one second), four seeds:
    the mean rate stays >= 80 % of the configured one in each (it was 3-97 %, 30 % typical;
    an early pair of 429s before any stretch has shown what the server takes still costs a
    dip)."""
    for seed in range(4):
        draw = random.Random(seed).random
        seen = pace(RateController(max_rate=rate, now=0.0), lambda t, d=draw: d() < 0.003,
                    seconds=600)
        rates = [r for t, r, _ in seen if t > 5]
        assert sum(rates) / len(rates) >= 0.8 * rate, seed


@pytest.mark.parametrize(("rate", "latency"), [(1500, 0.005), (1500, 0.05), (3000, 0.02)])
def test_per_item_429s_at_a_high_rate_from_the_start_cost_little(rate: int,
                                                                  latency: float) -> None:
    """0.3 % of answers at random are 429s from the first request, at a high rate: the first
    episodes come before the background share is known and before a second of steady sending,
    when only what came back per second of wall-clock time was trusted as the quota; that is
    low while the sending ramps up, and it cut 1,500 req/s to 2-16 % in the first seconds
    (the mock API's flaky mix: 1,500 -> 267 req/s within 2 s). The share of 429s among the
    episode's answers says how far over a quota the job can be: the rate stays >= 50 % in
    the first 10 s and >= 75 % on average, for four seeds."""
    for seed in range(4):
        draw = random.Random(seed).random
        seen = pace(RateController(max_rate=rate, now=0.0), lambda t, d=draw: d() < 0.003,
                    seconds=60, latency=latency)
        first = [r for t, r, _ in seen if t < 10]
        rates = [r for t, r, _ in seen if t > 5]
        assert min(first) >= 0.5 * rate, (seed, min(first))
        assert sum(rates) / len(rates) >= 0.75 * rate, seed


def test_lone_429s_with_many_requests_in_flight_leave_the_rate_alone() -> None:
    """0.3 % random per-item 429s at 100 req/s, 32 in flight, 0.2 s latency: the mean rate
    stays >= 85 % of the configured one (it was 46 %)."""
    draw = random.Random(1).random
    seen = pace(RateController(max_rate=100, now=0.0), lambda t: draw() < 0.003, seconds=300,
                in_flight=32, latency=0.2)
    rates = [r for t, r, _ in seen if t > 20]
    assert sum(rates) / len(rates) >= 85


def lowered_quota(before: int, after: int, at: float) -> Callable[[float], bool]:
    """A server with a fixed 1-s window of ``before`` requests, ``after`` from ``at`` s on:
    ``answer(t) -> limited`` for ``pace``."""
    state = {"window": -1, "used": 0}

    def answer(t: float) -> bool:
        quota = before if t < at else after
        if int(t) != state["window"]:
            state["window"], state["used"] = int(t), 0
        state["used"] += 1
        return state["used"] > quota

    return answer


def test_a_quota_lowered_mid_run_is_found_again() -> None:
    """A server whose windowed quota drops from 100 to 60 req/s two minutes in (another client
    took a share of the key): what it took before does not hold the rate above the new quota:
    at most 10 % over it 40 s after the drop, and after a minute, successful requests >= 0.85
    x 60 per second and < 5 % 429s."""
    seen = pace(RateController(max_rate=150, now=0.0), lowered_quota(100, 60, 120), seconds=420)
    assert max(r for t, r, _ in seen if t >= 160) <= 1.1 * 60  # within 40 s of the drop
    late = [limited for t, _, limited in seen if t >= 180]
    assert sum(late) / len(late) < 0.05
    assert sum(1 for lim in late if not lim) / 240 >= 0.85 * 60


def test_a_quota_lowered_mid_run_is_found_again_with_nothing_in_flight_after_a_429() -> None:
    """The same at 5 ms of latency (no request out when a 429 comes back): each window's
    overrun is one 429 and its pause, a lone 429 at a rate the server was seen to take (40
    req/s): excused for two minutes, at a 429 every 1.3 s (a rate-limit audit). More 429s
    since that figure was last shown than 1.5 % gives by chance drop it: below 12 req/s within
    30 s of the drop (18.5 s here), and < 1 % 429s from 90 s on."""
    seen = pace(RateController(max_rate=50, now=0.0), lowered_quota(40, 10, 60), seconds=180,
                in_flight=16, latency=0.005)
    assert max(r for t, r, _ in seen if 40 <= t < 60) >= 38  # (what the server took before)
    assert next(t for t, r, _ in seen if t > 60 and r < 12) < 90
    late = [limited for t, _, limited in seen if t >= 90]
    assert sum(late) / len(late) < 0.01


async def test_the_ticket_at_once_keeps_to_the_rate_and_to_whatever_holds_requests() -> None:
    """``ready`` (a ticket without a wait, what the workers ask first) hands out the bucket's
    tokens like ``acquire`` and nothing more: no ticket while a pause, an open breaker or a
    task waiting in the bucket holds requests back, and the rate holds for tasks mixing it
    with ``acquire``."""
    gov = Governor(rate=40, burst=4, adaptive=False)
    handed = [gov.ready() for _ in range(5)]
    assert all(t is not None for t in handed[:4]) and handed[4] is None  # the burst, no more
    waiting = asyncio.create_task(gov.acquire())  # waits in the bucket for the next token
    await asyncio.sleep(0)
    gov.lanes[0].limiter._level -= 1  # a token is back, the waiting task not yet woken:
    assert gov.ready() is None  # it is the waiting task's, not the next ready's
    await asyncio.wait_for(waiting, 5)

    async def ticket() -> object:
        return gov.ready() or await gov.acquire()

    passed, elapsed = await tickets(gov, 8, 0.5, ticket)
    assert 1 <= len(passed) <= 2 + 40 * elapsed * 1.05, (len(passed), elapsed)

    paused = Governor(rate=1000, burst=10, adaptive=False)
    paused.pause(60)
    assert paused.ready() is None
    assert open_breaker(probe_after=60).ready() is None
    assert Governor(rate=1000, burst=10, keys=2).ready() is None  # several keys: acquire picks
    fresh = Governor(rate=1000, burst=10)
    ticket = fresh.ready()
    assert ticket is not None and not ticket.probe and ticket.lane == 0
    assert fresh.controller is not None and fresh.controller._sent == 1  # counted as sent


def let_leave(gov: Governor, held: list[Ticket]) -> tuple[list[asyncio.Task[None]], list[float]]:
    """The requests of ``held`` (their intents durable now) leave as a worker's do: at once
    (``may_leave``) or once ``leave`` lets them. The tasks, and when each left (filled in as
    they do)."""
    loop = asyncio.get_running_loop()
    left: list[float] = []

    async def go(ticket: Ticket) -> None:
        if not gov.may_leave(ticket):
            await gov.leave(ticket)
        left.append(loop.time())

    return [asyncio.create_task(go(t)) for t in held], left


async def test_requests_held_back_after_their_tickets_leave_within_the_rate() -> None:
    """A request takes its ticket, then waits for its durable intent before it leaves. After a
    stall of the state's writer, the requests whose tickets came meanwhile pass the bucket a
    second time (``may_leave`` / ``leave``) and leave within the rate, not all at once (they
    did: 104 in a second at 50/s with a burst of 50, bench/governor.py accuracy)."""
    rate, burst = 100.0, 5
    gov = Governor(rate=rate, burst=burst, adaptive=False)
    loop = asyncio.get_running_loop()
    held = [gov.ready() or await gov.acquire() for _ in range(20)]  # the writer stalls: ~0.15 s
    t0 = loop.time()
    leaving, left = let_leave(gov, held)
    await asyncio.sleep(0)
    assert len(left) == burst  # the second bucket's burst at once, the rest wait in it
    await asyncio.wait_for(asyncio.gather(*leaving), 5)
    for n, t in enumerate(sorted(left), 1):  # every moment: the bucket's bound
        assert n <= burst + 1 + rate * (t - t0) * 1.05, (n, t - t0)


async def test_what_came_after_a_ticket_holds_its_request_back() -> None:
    """A pause, an open breaker or a refused key that came while a request waited for its
    intent (or to leave) holds it back (``holds``: the worker takes its intent back and the
    ID goes again), except the breaker's own probe: requests with tickets used to leave into
    an outage (16 of them, where the breaker had held back all but 1, in a simulation at 300
    req/s with a 0.1-s stall of the writer)."""
    gov = Governor(rate=1000, burst=10, adaptive=False, keys=2)
    ticket = await gov.acquire()
    assert not gov.holds(ticket)
    gov.pause(60)
    assert gov.holds(ticket)
    gov.paused_until = 0.0
    gov.retire(ticket.lane)
    assert gov.holds(ticket)
    assert not gov.holds(Ticket(ticket.sent_at, False, 1 - ticket.lane))  # the other key
    breaker = open_breaker(probe_after=60)
    assert breaker.holds(Ticket(0.0, False))
    assert not breaker.holds(Ticket(0.0, True))  # the probe goes


async def test_requests_held_back_leave_at_the_adaptive_rate_when_it_is_cut() -> None:
    """The server's 429s cut the rate to 50/s (the bucket still allows 100 at once): the
    requests whose tickets came during a stall leave paced at 50/s, as their tickets came,
    not together (all 10 at once before: within the configured burst, over the quota the
    server showed)."""
    gov = Governor(rate=1000, burst=1000, adaptive=True)
    c = gov.controller
    assert c is not None
    loop = asyncio.get_running_loop()
    c.rate = 50.0
    c._last_raise = loop.time() + 600  # (no climb back during the test)
    held = [gov.ready() or await gov.acquire() for _ in range(10)]  # ~0.18 s: the writer stalls
    t0 = loop.time()
    leaving, left = let_leave(gov, held)
    await asyncio.wait_for(asyncio.gather(*leaving), 5)
    for n, t in enumerate(sorted(left), 1):
        assert n <= 1 + 50 * (t - t0) * 1.05, (n, t - t0)


def test_a_job_wide_rate_adopted_is_no_cut_of_the_controller_s_own() -> None:
    """A process joining a shared job adopts the job's rate (another process's cut), then its
    first few requests meet one 429 (another process's overrun of the quota's window): that is
    too little to estimate a quota from, so it backs off 5 %, as after a start or a pause. It
    cut to a tenth (15.5 -> 1.6 req/s) estimated from three answers, and published that as the
    job's rate (found by a PostgreSQL audit, three processes on a 30 req/s quota)."""
    c = RateController(max_rate=20.0, now=0.0)
    c.adopt(15.5, 0.0)
    assert c.rate == 15.5
    t = 1.0
    for i in range(3):  # three requests, the second answered 429
        c.tick(t)
        c.on_send(t)
        c.on_response(t + 0.05, t, limited=i == 1)
        t += 1 / c.rate
    t += 1.0
    c.tick(t)  # (the episode is judged)
    assert c.cuts == 1 and c.rate >= 0.95 * 15.5 - 1e-9, c.rate


def _newcomer_episode(shared: bool, refused: int) -> RateController:
    """A process that has just joined a shared job (its share of 60 req/s: 30) sends seven
    requests at its rate into a window the other process has all but used up: the last
    ``refused`` are answered 429 with ``Retry-After: 1``, and the pause comes at once."""
    c = RateController(max_rate=60.0, now=0.0)
    c.reshare(30.0)
    c.shared = shared
    t, paused_until = 1.0, 0.0
    for i in range(7):
        c.tick(t)
        c.on_send(t)
        limited = i >= 7 - refused
        c.on_response(t + 0.05, t, limited, asked=limited)
        if limited and c.limiting(t + 0.05) and t + 1.05 > paused_until:
            c.on_pause(max(t + 0.05, paused_until), t + 1.05)
            paused_until = t + 1.05
        t += 1 / 30
    c.tick(paused_until + 0.01)  # (the episode is judged at the pause's end)
    assert c.cuts == 1
    return c


def test_one_process_of_a_shared_job_does_not_take_its_share_of_a_window_for_the_quota() -> None:
    """In a job shared by several processes, an episode that is not steady shows a process its
    share of the answers over less than a second: five accepted of seven, in a window the
    others had used, over a wall that is mostly the pause. Alone, that estimate is the quota
    (30 -> 3.6 req/s); shared, it was published as the job's rate and every process slowed to
    it (bench/shared_sim.py: 0.83 of the quota with two or three processes, against 0.94 with
    one). A shared process cuts at most to half, unless more than half of a second's answers
    were 429s."""
    alone = _newcomer_episode(shared=False, refused=2)
    assert alone.rate < 5, alone.rate  # (one process: the estimate stands)
    shared = _newcomer_episode(shared=True, refused=2)
    assert shared.rate >= 15 - 1e-9, shared.rate
    # most of a second's answers refused: the job is far over its quota, a deeper cut stands
    assert _newcomer_episode(shared=True, refused=5).rate < 15


async def test_the_governor_marks_its_controller_shared_while_other_processes_share_the_job() -> None:
    gov = Governor(rate=60, burst=60)
    assert gov.controller is not None and not gov.controller.shared
    gov.share(3)
    assert gov.controller.shared
    gov.share(1)
    assert not gov.controller.shared


async def test_requests_waiting_at_a_low_adaptive_rate_go_at_once_when_it_climbs() -> None:
    """Each waiting worker booked its slot ahead at the rate of its arrival: after a cut to
    0.26/s, 16 workers held a minute of slots at that rate, and the requests went out one
    every few seconds while the rate had climbed back (a rate-limit audit)."""
    gov = Governor(rate=1000, burst=1000, adaptive=True)
    c = gov.controller
    assert c is not None
    c.rate = 0.25  # (cut deep: one request every 4 s)
    c._last_raise = asyncio.get_running_loop().time() + 600  # (no climb of its own)

    def climbs() -> None:  # once every worker waits for its slot
        c.rate = 100.0

    passed, elapsed = await tickets(gov, 16, 0.5, lambda: gov.acquire(), then=climbs)
    assert len(passed) >= 20  # (~50 at 100/s; 1 at the slots booked before)
    assert len(passed) <= 2 + 100 * elapsed * 1.05


async def test_a_free_key_is_picked_before_a_paused_one_whose_pause_ends_first() -> None:
    """With several keys, a free key's turn runs ahead of now while requests queue for it; a
    paused key whose pause ends before that turn was picked, and the request slept on its
    pause: every key sent nothing for ~0.8 s before each 429's pause ended (a keys audit)."""
    gov = Governor(rate=200, burst=1, keys=2)
    now = asyncio.get_running_loop().time()
    paused, free = gov.lanes
    paused.paused_until = now + 0.8
    free.turn = now + 0.9  # (requests queued for it)
    assert gov._pick(now) is free
    free.paused_until = now + 0.5  # every key paused: the one that may send first (0.8 s)
    assert gov._pick(now) is paused
    paused.retired = free.retired = True
    assert gov._pick(now) is None
