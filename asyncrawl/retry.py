"""Pure functions that decide *when* to try again: backoff delay and ``Retry-After`` parsing.

The backoff for the n-th failed try (n = 1, 2, ...) is::

    ceiling = min(backoff_max, backoff_base * 2 ** (n - 1))
    full jitter:   delay = uniform(0, ceiling)
    equal jitter:  delay = ceiling / 2 + uniform(0, ceiling / 2)
    no jitter:     delay = ceiling

and a server's ``Retry-After`` (seconds or an HTTP-date, RFC 9110 §10.2.3), capped at
``retry_after_max``, wins whenever it is longer than the computed delay.
"""

from __future__ import annotations

import datetime
import math
import random
import time
from email.utils import parsedate_to_datetime


def backoff_delay(
    tries: int, *, base: float, cap: float, jitter: str = "full", rng: random.Random | None = None
) -> float:
    """Delay in seconds before the try after ``tries`` failed ones (``tries`` >= 1)."""
    exp = min(max(tries - 1, 0), 64)  # 2**64 * base is past any sane cap; avoids overflow
    ceiling = min(cap, base * (2.0**exp))
    uniform = (rng or random).uniform
    if jitter == "full":
        return uniform(0.0, ceiling)
    if jitter == "equal":
        return ceiling / 2 + uniform(0.0, ceiling / 2)
    return ceiling


def parse_retry_after(value: str | None, *, now: float | None = None,
                      date: str | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header value, or ``None`` if unusable.

    Accepts delta-seconds (``"120"``; a decimal is tolerated) and HTTP-dates
    (``"Wed, 21 Oct 2015 07:28:00 GMT"``). A date is counted from the answer's own ``Date``
    (``date``), on the server's clock, where it has one: from ours, a machine 5 minutes behind
    the server paused 5 minutes too long for each 429, one ahead not at all. A date in the
    past means 0.
    """
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > 64:
        return None
    if value.isascii() and value.replace(".", "", 1).isdigit():
        try:
            seconds = float(value)
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) else None
    ts = _http_date(value)
    if ts is None:
        return None
    sent = _http_date(date.strip()) if date and len(date) <= 64 else None
    if sent is None:
        sent = time.time() if now is None else now
    return max(0.0, ts - sent)


def _http_date(value: str) -> float | None:
    """An HTTP-date's POSIX time (RFC 9110 §5.6.7: its three forms), or ``None``."""
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or (when.tzinfo is None and "," in value):  # (a date without its zone)
        return None
    if when.tzinfo is None:  # asctime's form, "Sun Nov  6 08:49:37 1994", has none: HTTP-dates
        when = when.replace(tzinfo=datetime.UTC)  # are GMT (RFC 9110 §5.6.7)
    try:
        return when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def retry_delay(
    tries: int,
    retry_after: float | None,
    *,
    base: float,
    cap: float,
    retry_after_max: float,
    jitter: str = "full",
    rng: random.Random | None = None,
) -> float:
    """The delay to use: computed backoff, or the server's Retry-After (capped) when longer."""
    delay = backoff_delay(tries, base=base, cap=cap, jitter=jitter, rng=rng)
    if retry_after is not None:
        delay = max(delay, min(retry_after, retry_after_max))
    return delay
