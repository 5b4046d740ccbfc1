"""retry.py: the backoff formula, Retry-After parsing, and which of the two wins."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrawl.retry import backoff_delay, parse_retry_after, retry_delay

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)

tries_st = st.integers(min_value=1, max_value=100_000)
base_st = st.floats(min_value=0.001, max_value=100.0)
cap_st = st.floats(min_value=0.0, max_value=3600.0)


def ceiling(tries: int, base: float, cap: float) -> float:
    return min(cap, base * 2.0 ** min(tries - 1, 64))


# -- backoff_delay --------------------------------------------------------------------------------


@pytest.mark.parametrize("jitter", ["full", "equal", "none"])
@pytest.mark.parametrize("tries", [1, 2, 7, 30, 64, 65, 1023, 1024, 10_000, 10**9])
def test_backoff_never_exceeds_cap(jitter: str, tries: int) -> None:
    rng = random.Random(tries)
    for _ in range(50):
        d = backoff_delay(tries, base=1.0, cap=60.0, jitter=jitter, rng=rng)
        assert math.isfinite(d)
        assert 0.0 <= d <= 60.0


@given(tries=tries_st, base=base_st, cap=cap_st, seed=st.integers(0, 2**32))
def test_full_jitter_within_zero_and_ceiling(tries: int, base: float, cap: float, seed: int) -> None:
    d = backoff_delay(tries, base=base, cap=cap, jitter="full", rng=random.Random(seed))
    assert 0.0 <= d <= ceiling(tries, base, cap)


@given(tries=tries_st, base=base_st, cap=cap_st, seed=st.integers(0, 2**32))
def test_equal_jitter_within_half_ceiling_and_ceiling(
    tries: int, base: float, cap: float, seed: int
) -> None:
    c = ceiling(tries, base, cap)
    d = backoff_delay(tries, base=base, cap=cap, jitter="equal", rng=random.Random(seed))
    assert c / 2 <= d <= c


def test_full_jitter_actually_varies() -> None:
    rng = random.Random(1)
    delays = {backoff_delay(5, base=1.0, cap=60.0, jitter="full", rng=rng) for _ in range(20)}
    assert len(delays) > 10
    assert min(delays) < 8.0  # not stuck at the ceiling (16 s)


def test_no_jitter_is_exact_doubling_capped() -> None:
    got = [backoff_delay(n, base=1.0, cap=10.0, jitter="none") for n in range(1, 8)]
    assert got == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    got = [backoff_delay(n, base=1.0, cap=60.0, jitter="none") for n in range(1, 6)]
    assert got == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert backoff_delay(10_000, base=1.0, cap=60.0, jitter="none") == 60.0
    assert backoff_delay(3, base=0.5, cap=60.0, jitter="none") == 2.0


def test_backoff_tries_below_one_is_base() -> None:
    assert backoff_delay(0, base=1.5, cap=60.0, jitter="none") == 1.5


# -- parse_retry_after ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("120", 120.0), ("0", 0.0), ("1.5", 1.5), (" 7 ", 7.0), ("\t30\r\n", 30.0)],
)
def test_retry_after_seconds(value: str, expected: float) -> None:
    assert parse_retry_after(value, now=NOW.timestamp()) == expected


def test_retry_after_http_date_in_future() -> None:
    when = format_datetime(NOW + timedelta(seconds=90), usegmt=True)
    assert when.endswith(" GMT")
    assert parse_retry_after(when, now=NOW.timestamp()) == pytest.approx(90.0)


@pytest.mark.parametrize("form", ["%a, %d %b %Y %H:%M:%S GMT", "%A, %d-%b-%y %H:%M:%S GMT",
                                  "%a %b %d %H:%M:%S %Y"])
def test_retry_after_takes_each_of_the_three_http_date_forms(form: str) -> None:
    """RFC 9110 §5.6.7: IMF-fixdate, RFC 850's and asctime's (no zone: GMT); asctime's was
    refused, and a server's pause was taken for none."""
    when = (NOW + timedelta(seconds=90)).strftime(form)
    assert parse_retry_after(when, now=NOW.timestamp()) == pytest.approx(90.0)


def test_retry_after_http_date_in_past_is_zero() -> None:
    when = format_datetime(NOW - timedelta(hours=3), usegmt=True)
    assert parse_retry_after(when, now=NOW.timestamp()) == 0.0


@pytest.mark.parametrize(
    "value",
    [
        None, "", "   ", "soon", "-5", "-0.5", "+5", "1e5", "inf", "nan", "0x10", "1.2.3",
        "١٢",  # non-ASCII digits
        "Wed, 21 Oct 2015 07:28:00",  # a date without a zone is not an HTTP-date
        "Wed, 99 Foo 2015 99:99:99 GMT",
    ],
)
def test_retry_after_garbage_is_none(value: str | None) -> None:
    assert parse_retry_after(value, now=NOW.timestamp()) is None


@pytest.mark.parametrize("value", ["9" * 65, "1" + "0" * 400, "1." + "5" * 100, "x" * 10_000])
def test_retry_after_overlong_is_none(value: str) -> None:
    assert parse_retry_after(value, now=NOW.timestamp()) is None


@given(st.text())
def test_parse_retry_after_never_raises(value: str) -> None:
    got = parse_retry_after(value, now=NOW.timestamp())
    assert got is None or (isinstance(got, float) and math.isfinite(got) and got >= 0.0)


@given(
    st.from_regex(
        r"\A(Mon|Tue|Wed|Thu|Fri|Sat|Sun|Xyz)?,? ?[0-9]{0,3} (Jan|Feb|Dec|Foo)? ?-?[0-9]{0,6} "
        r"[0-9]{0,3}:[0-9]{0,3}:?[0-9]{0,3} ?(GMT|UTC|[+-][0-9]{4}|[A-Z]{1,3})?\Z"
    )
)
def test_parse_retry_after_never_raises_on_date_like_text(value: str) -> None:
    got = parse_retry_after(value, now=NOW.timestamp())
    assert got is None or (isinstance(got, float) and math.isfinite(got) and got >= 0.0)


# -- retry_delay ----------------------------------------------------------------------------------


def test_retry_delay_prefers_longer_retry_after() -> None:
    d = retry_delay(1, 30.0, base=1.0, cap=60.0, retry_after_max=600.0, jitter="none")
    assert d == 30.0


def test_retry_delay_keeps_backoff_when_retry_after_is_shorter() -> None:
    d = retry_delay(5, 2.0, base=1.0, cap=60.0, retry_after_max=600.0, jitter="none")
    assert d == 16.0


def test_retry_delay_caps_retry_after() -> None:
    d = retry_delay(1, 86_400.0, base=1.0, cap=60.0, retry_after_max=120.0, jitter="none")
    assert d == 120.0
    d = retry_delay(1, 1e64, base=1.0, cap=60.0, retry_after_max=120.0, jitter="full",
                    rng=random.Random(0))
    assert d == 120.0


def test_retry_delay_without_retry_after_is_backoff() -> None:
    d = retry_delay(3, None, base=1.0, cap=60.0, retry_after_max=600.0, jitter="none")
    assert d == 4.0


@given(tries=tries_st, ra=st.none() | st.floats(min_value=0.0, max_value=1e300),
       ra_max=st.floats(min_value=0.001, max_value=3600.0), seed=st.integers(0, 2**32))
def test_retry_delay_bounds(tries: int, ra: float | None, ra_max: float, seed: int) -> None:
    d = retry_delay(tries, ra, base=1.0, cap=60.0, retry_after_max=ra_max, jitter="full",
                    rng=random.Random(seed))
    assert 0.0 <= d <= max(60.0, ra_max)
    if ra is not None:
        assert d >= min(ra, ra_max)


def test_a_retry_after_date_counts_from_the_answer_s_own_date() -> None:
    """A ``Retry-After`` date is the server's clock's: counted from our clock, a machine 5
    minutes behind the server paused 5 minutes too long for each 429, one ahead not at all
    (a clocks audit). The answer's ``Date`` says when the server's clock said it; without a
    usable one, ours is all there is."""
    server_now = NOW + timedelta(minutes=5)
    when = format_datetime(server_now + timedelta(seconds=3), usegmt=True)
    date = format_datetime(server_now, usegmt=True)
    assert parse_retry_after(when, now=NOW.timestamp(), date=date) == pytest.approx(3.0)
    behind = format_datetime(NOW - timedelta(minutes=5), usegmt=True)  # (a server behind us)
    assert parse_retry_after(format_datetime(NOW - timedelta(minutes=5) + timedelta(seconds=3),
                                             usegmt=True), now=NOW.timestamp(),
                             date=behind) == pytest.approx(3.0)
    assert parse_retry_after(when, now=NOW.timestamp(), date="soon") == pytest.approx(303.0)


async def test_the_fetch_reads_a_retry_after_date_against_the_answer_s_date() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from asyncrawl import Config
    from asyncrawl.fetch import Fetcher

    async def limited(request: web.Request) -> web.Response:
        server_now = datetime.now(UTC) + timedelta(minutes=5)  # (its clock ahead of ours)
        return web.Response(status=429, headers={
            "Date": format_datetime(server_now, usegmt=True),
            "Retry-After": format_datetime(server_now + timedelta(seconds=3), usegmt=True)})

    app = web.Application()
    app.router.add_get("/items/{id}", limited)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}")
        attempt = await Fetcher(session, cfg).attempt("a")
    assert attempt.status == 429 and attempt.retry_after == pytest.approx(3.0, abs=1.0)
