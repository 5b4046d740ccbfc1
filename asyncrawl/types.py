"""The values a run hands out: ``Halt``, ``Result``, ``Progress``, ``Summary`` (and ``ids_left``,
what one leaves to fetch), and ``ErrorKind``.

Plain frozen data at the bottom of the package: this module imports nothing of asyncrawl, so
every other module (the read-only ``status`` and ``export`` included) can use these types
without loading the crawler or aiohttp.
"""

from __future__ import annotations

import enum
import signal as signal_mod
from dataclasses import dataclass
from typing import Any


class ErrorKind(enum.Enum):
    """What went wrong with one attempt, as a type rather than as text. ``fetch.py`` sets it
    where it maps aiohttp's exceptions and the answer's status; ``None`` on an attempt means
    it went well."""

    TIMEOUT = "timeout"  # connect, read or total timeout
    REFUSED = "refused"  # nothing listens at the address
    PROXY = "proxy"  # the proxy refused the connection or could not be reached
    DNS = "dns"  # the host name does not resolve
    TLS = "tls"  # the certificate does not verify
    NETWORK = "network"  # any other connection error: reset, dropped, disconnected
    HTTP = "http"  # an error status (4xx, 5xx, or an error code in the body)
    BODY = "body"  # a 2xx answer whose body does not parse
    TOO_LARGE = "too_large"  # a body over max_body_bytes
    REDIRECT = "redirect"  # a redirect not followed, too many, or to an invalid Location
    LOCAL = "local"  # this machine's limit, not the API's: too many open files (nothing sent)


@dataclass(frozen=True, slots=True)
class Halt:
    """Why a run stopped before finishing. ``reason``: fatal, budget, storage, unreachable (an
    error that waiting cannot cure, from the first requests on), signal (a signal, or
    ``Crawler.stop()``), cancelled (the run's task), error (a hook or the ID source raised;
    exit 130 as cancelled); or a ``Crawler.stop(reason)``'s own. (key_retired
    is the alert's reason when one of several API keys is refused: the run goes on.)"""

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
    IDs of the current pass: in pass 2, the IDs that pass 1 left failed. ``failed``: IDs
    recorded failed and not settled since (in pass 2, those it has yet to settle)."""

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
    # the state store has answered nothing for ~10 s while records wait for it (a hung disk, a
    # database holding its locks): no request counts, and none starts, until it answers
    store_stalled: bool = False


@dataclass(frozen=True, slots=True)
class Summary:
    """What a run ended with. ``ok``/``failed``/``unavailable``/``pending`` count this run's IDs
    by their state after the run (IDs settled by earlier runs included); in a job shared by
    several processes (PostgreSQL), the whole job's IDs, whichever process fetched them.
    ``fetched``, ``requests``, ``retries`` and ``billable`` are this run's own."""

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
    # requests with no answer after their connect (a timeout, a dropped connection): the
    # server may have taken them, so possibly billed (``status``: ``unanswered``)
    unanswered: int = 0
    # requests cut off in flight when the run stopped (a second signal, the grace period out):
    # their answers were not waited for, so in doubt, possibly billed (``status``: in doubt)
    cut_off: int = 0

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


def ids_left(s: Summary, total: int | None) -> tuple[int, int]:
    """(IDs still to fetch, of which lines of the list not read yet). Lines not read yet are
    counted as IDs to fetch: a later line may repeat an ID or name one settled earlier, so with
    unread lines the figure is an upper bound (``run --dry-run`` counts exactly)."""
    seen = s.ok + s.failed + s.unavailable + s.pending
    unread = max(0, total - s.duplicates - seen) if total is not None else 0
    return s.failed + s.pending + unread, unread
