"""Prometheus metrics for a long job: ``asyncrawl run --metrics HOST:PORT`` serves
``/metrics`` in the standard text format (prometheus_client, the ``metrics`` extra).

Counters are fed by the crawler's hooks as attempts and results come back; gauges are read
from the run's ``Progress`` when Prometheus scrapes. The endpoint is an aiohttp app on the
run's own event loop, started and cleaned up by the command (no thread of its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from .config import Config
from .errors import ConfigError, require_extra
from .fetch import Outcome, status_class
from .types import Progress, Result


def _client() -> Any:
    return require_extra("prometheus_client", "metrics", "--metrics")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT`` means 127.0.0.1), checked."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"must be HOST:PORT, e.g. 127.0.0.1:9464; got {text!r}",
                          key="--metrics")
    return host.strip("[]") or "127.0.0.1", int(port)


class Metrics:
    """The job's metrics in a registry of their own (nothing global is touched)."""

    def __init__(self, config: Config, progress: Callable[[], Progress]) -> None:
        pc = _client()
        self.config = config
        self.registry = reg = pc.CollectorRegistry()
        self.requests = pc.Counter(
            "asyncrawl_requests", "Attempts by outcome class (ok, retry, skip, fatal; error: "
            "no HTTP answer) and HTTP status", ["outcome", "status"], registry=reg)
        self.results = pc.Counter("asyncrawl_results", "IDs settled or failed, as recorded",
                                  ["outcome"], registry=reg)
        self.billable = pc.Counter("asyncrawl_billable_calls",
                                   "2xx answers (what the provider bills)", registry=reg)
        gauges = {
            "in_flight": ("asyncrawl_in_flight", "requests on the wire"),
            "parked": ("asyncrawl_parked", "IDs waiting for their retry time"),
            "effective_rate": ("asyncrawl_rate_limit", "the current rate limit (requests/s)"),
            "rate": ("asyncrawl_request_rate", "requests per second, recent"),
            "paused_for": ("asyncrawl_paused_seconds", "seconds left of a job-wide pause"),
            "breaker_open": ("asyncrawl_breaker_open", "1 while the outage breaker is open"),
            "eta": ("asyncrawl_eta_seconds", "estimated seconds left in this pass (-1: unknown)"),
            "pass_no": ("asyncrawl_pass", "the pass being run (1 or 2)"),
        }
        for field, (name, doc) in gauges.items():
            pc.Gauge(name, doc, registry=reg).set_function(_reader(progress, field))

    @staticmethod
    def check() -> None:
        """``ConfigError`` (exit 2, before anything is sent) without prometheus_client."""
        _client()

    def attempt(self, item_id: str, status: int | None, error: str | None) -> None:
        """``Crawler(on_attempt=...)``: every attempt."""
        if status is None:
            self.requests.labels("error", "").inc()
            return
        outcome = status_class(status, self.config)
        if error is not None and outcome is Outcome.OK:  # (a 2xx whose body cannot be used:
            outcome = Outcome.RETRY  # bought again, as a retry)
        self.requests.labels(outcome.value, str(status)).inc()
        if 200 <= status < 300:
            self.billable.inc()

    def result(self, r: Result) -> None:
        """``Crawler(on_result=...)``: every recorded outcome."""
        self.results.labels(r.outcome).inc()

    def text(self) -> bytes:
        return bytes(_client().generate_latest(self.registry))


def _reader(progress: Callable[[], Progress], field: str) -> Callable[[], float]:
    def read() -> float:
        value = getattr(progress(), field)
        if value is None:
            return -1.0
        return float(value)
    return read


@contextlib.asynccontextmanager
async def serving(metrics: Metrics, address: str) -> AsyncIterator[str]:
    """Serve ``/metrics`` at ``address`` for the block's duration; yields the URL."""
    from aiohttp import web

    host, port = parse_address(address)

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.text(),
                            headers={"Content-Type": _client().CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}",
                              key="--metrics") from None
        bound = runner.addresses[0]
        yield f"http://{bound[0]}:{bound[1]}/metrics"
    finally:
        await runner.cleanup()
