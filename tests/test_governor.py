"""The governor's policies on a fake clock: no sleeping, every time is an explicit ``now``."""

from __future__ import annotations

import asyncio

import pytest

from asyncrawl.governor import Breaker, Budget, RateController


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
