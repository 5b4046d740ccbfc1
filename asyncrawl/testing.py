"""A fault-injecting mock of a paid, rate-limited item API: a real aiohttp server on loopback.

Used by ``asyncrawl demo``, by the test suite and the benchmarks (in-process, or as a separate
process via ``python -m asyncrawl.testing``, which ``MockProcess`` starts), and by users who want
to try a configuration against realistic faults without a key or a network::

    async with MockAPI(faults=demo_faults, balance=1000) as api:
        config = asyncrawl.Config(url=api.item_url, headers={"X-Api-Key": "demo-key"})
        ...
        assert api.paid() == [...]            # what would have been billed

Routes: ``GET|POST /items/{id}`` (the ID percent-encoded as one path segment; ``%2F`` works)
and ``GET /health``. Each item request passes these checks in order:

1. auth: ``X-Api-Key: K`` or ``Authorization: Bearer K``, else 401 (skipped if ``api_key=None``);
2. outage / quota: 503 to everything during an ``outage``; beyond ``quota`` requests in the
   current 1-second window, 429 with ``Retry-After: 1``;
3. balance: once ``balance`` paid answers were given, 402 ``{"error": "insufficient balance"}``;
4. the ID's :class:`Fault`. Per-ID attempt counters (``times``) count only requests that get
   this far. A 200 carrying :func:`payload_for` is billed and uses one unit of balance.

NOTE: a plain aiohttp session silently resends an idempotent request (GET) once when the server
drops the connection, so a ``drop`` fault with ``times=1`` is invisible to such a client (use
``times=2``, or POST); asyncrawl's own session (``asyncrawl.new_session``) does not resend, and
sees every drop. The log shows every attempt.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import email.utils
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import orjson
from aiohttp import web

__all__ = ["Fault", "LogEntry", "MockAPI", "demo_faults", "flaky_faults", "main", "no_faults",
           "payload_for", "read_log", "requests_by_id"]

KINDS = frozenset({"ok", "not_found", "bad_request", "gone", "flaky", "rate_limited", "slow",
                   "stall", "drop", "invalid_json", "error_in_body"})
_ALWAYS = {"not_found": 404, "bad_request": 400, "gone": 500}  # status for every attempt
_FIRST_TIMES = frozenset({"flaky", "rate_limited", "stall", "drop", "invalid_json"})  # use `times`
# the status a kind answers with when Fault.status is not given
_DEFAULT_STATUS = {**_ALWAYS, "flaky": 503, "stall": 504, "error_in_body": 402}
_JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Fault:
    """How the mock answers one ID.

    ``kind`` is one of: ``ok``; ``not_found`` / ``bad_request`` / ``gone`` (404 / 400 / 500 on
    every attempt); ``flaky`` (503), ``rate_limited`` (429 + ``Retry-After``), ``stall`` (504
    after ``delay`` seconds), ``drop`` (connection closed, no response) and ``invalid_json`` (200
    with a truncated JSON body), each for the first ``times`` attempts and then ok; ``slow`` (ok
    after ``delay`` seconds); ``error_in_body`` (200 with ``{"code": status, "message": ...}`` on
    every attempt, never billed). ``status`` overrides the HTTP status of ``gone``, ``flaky`` and
    ``stall`` (e.g. ``Fault("gone", status=503)``) and is the code inside ``error_in_body``.
    """

    kind: str = "ok"
    times: int = 1
    retry_after: float = 1.0
    http_date: bool = False  # Retry-After as an RFC 9110 IMF-fixdate instead of seconds
    delay: float = 0.0
    status: int | None = None  # None: the kind's own (see _DEFAULT_STATUS)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; use one of {sorted(KINDS)}")
        if self.times < 0 or self.retry_after < 0 or self.delay < 0:
            raise ValueError("Fault times, retry_after and delay must be >= 0")
        if self.status is None and self.kind in _DEFAULT_STATUS:
            object.__setattr__(self, "status", _DEFAULT_STATUS[self.kind])


_OK = Fault()


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One event seen by the mock: a request arriving (``start``) or being answered (``end``)."""

    seq: int  # global order of events
    event: str  # "start" or "end"
    id: str
    status: int | None  # None for "start"; 0 when the connection was dropped without an answer
    t: float  # time.time()
    authorized: bool


def _crc(salt: bytes, item_id: str) -> int:
    return zlib.crc32(salt + item_id.encode("utf-8", "surrogatepass"))


def payload_for(item_id: str, *, pad: int = 0) -> dict[str, Any]:
    """The deterministic JSON object a successful (200) answer carries for ``item_id``.

    ``pad``: add a ``"pad"`` string of that many characters (a mock started with
    ``payload_bytes=N`` answers ``payload_for(id, pad=N)``): large records for crash tests.
    """
    payload: dict[str, Any] = {"id": item_id, "title": f"Item {item_id}",
                               "value": _crc(b"value:", item_id) % 100_000}
    if pad > 0:
        seed = f"{_crc(b'pad:', item_id):08x}"
        payload["pad"] = (seed * (pad // len(seed) + 1))[:pad]
    return payload


# Per-mille shares of the demo mixture; the remaining 850 are ok.
_DEMO_MIX: tuple[tuple[int, Fault], ...] = (
    (30, Fault("not_found")),
    (10, Fault("bad_request")),
    (10, Fault("gone")),
    (25, Fault("flaky", times=1)),
    (25, Fault("flaky", times=2)),
    (30, Fault("flaky", times=1)),  # no per-ID 429s: real 429s come from a quota (``quota=``)
    (10, Fault("slow", delay=0.2)),
    (10, Fault("drop", times=2)),  # twice: a plain aiohttp session resends a GET once by itself
    (10, Fault("invalid_json", times=1)),
)
_DEMO_TABLE: tuple[Fault, ...] = tuple(f for n, f in _DEMO_MIX for _ in range(n))


def demo_faults(item_id: str) -> Fault:
    """A deterministic mixture chosen by ``zlib.crc32`` of the ID: about 15% of IDs misbehave.

    3% not_found, 1% bad_request, 1% gone, 8% flaky (``times`` 1 or 2), 1% slow (0.2 s), 1%
    drop (twice: the client sees it), 1% invalid_json; the rest are ok. No per-ID 429s: a real
    server says 429 when a client exceeds its quota, so ``asyncrawl demo`` sets ``quota=``.
    """
    bucket = _crc(b"fault:", item_id) % 1000
    return _DEMO_TABLE[bucket] if bucket < len(_DEMO_TABLE) else _OK


# Per-mille shares of the flaky mixture (issue 11's realistic fault mix); the remaining 757 are ok.
_FLAKY_MIX: tuple[tuple[int, Fault], ...] = (
    (34, Fault("flaky", times=1, status=500)),
    (33, Fault("flaky", times=2, status=502)),
    (33, Fault("flaky", times=3, status=503)),
    (30, Fault("flaky", times=6, status=500)),  # outlasts max_tries = 5: succeeds in pass 2
    (10, Fault("gone", status=503)),  # always 503: confirmed unavailable after pass 2
    (20, Fault("stall", delay=3.0)),  # 3 s, then 504 (a client timeout cuts it sooner)
    (10, Fault("drop", times=1)),  # a plain aiohttp session resends it once, silently
    (50, Fault("not_found")),
    (20, Fault("bad_request")),
    (3, Fault("rate_limited", times=1, retry_after=1.0)),
)
_FLAKY_TABLE: tuple[Fault, ...] = tuple(f for n, f in _FLAKY_MIX for _ in range(n))


def flaky_faults(item_id: str) -> Fault:
    """A healthy but flaky server, deterministic by ``zlib.crc32`` of the ID: about 17% of IDs
    need retries and 7% are bad.

    10% answer 500/502/503 one to three times, then 200; 3% answer 500 six times, then 200;
    1% always 503; 2% stall 3 s, then 504 (once); 1% drop the connection once; 5% 404; 2% 400;
    0.3% 429 with ``Retry-After: 1`` once. The rest are ok.
    """
    bucket = _crc(b"flaky:", item_id) % 1000
    return _FLAKY_TABLE[bucket] if bucket < len(_FLAKY_TABLE) else _OK


def no_faults(item_id: str) -> Fault:
    """Every ID answers 200 with :func:`payload_for`."""
    return _OK


FAULT_MIXES: dict[str, Callable[[str], Fault]] = {
    "demo": demo_faults, "flaky": flaky_faults, "none": no_faults}  # ``--faults NAME``


def read_log(path: str | os.PathLike[str]) -> list[LogEntry]:
    """Read a log file written with ``log_path``; a torn last line (a killed writer) is ignored."""
    entries: list[LogEntry] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                entries.append(LogEntry(**orjson.loads(line)))
            except (orjson.JSONDecodeError, TypeError):
                break
    return entries


def requests_by_id(log: list[LogEntry]) -> dict[str, list[tuple[float, float | None, int | None]]]:
    """Each ID's requests in arrival order as ``(start, end, status)`` (``end`` and ``status``
    are None for a request the log has no answer to): to judge retry timing from the server."""
    out: dict[str, list[tuple[float, float | None, int | None]]] = {}
    open_: dict[str, list[int]] = {}
    for e in log:
        reqs = out.setdefault(e.id, [])
        if e.event == "start":
            open_.setdefault(e.id, []).append(len(reqs))
            reqs.append((e.t, None, None))
        elif open_.get(e.id):
            i = open_[e.id].pop(0)
            reqs[i] = (reqs[i][0], e.t, e.status)
    return out


def most_in_window(times: Sequence[float], width: float = 1.0) -> int:
    """The most of ``times`` (sorted) in any window ``width`` seconds long: to judge a rate
    limit from the server's log (every request's start)."""
    return max((bisect.bisect_left(times, t + width) - i for i, t in enumerate(times)), default=0)


@dataclass(slots=True)
class _Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None
    wait: float = 0.0
    drop: bool = False
    billed: bool = False


def _error(status: int, message: str, **headers: str) -> _Reply:
    return _Reply(status, orjson.dumps({"error": message}), headers or None)


class MockAPI:
    """The mock server. Start with ``await api.start()`` or ``async with MockAPI(...) as api``.

    Args:
        faults: an ID -> :class:`Fault` function, or a mapping (missing IDs are ok); None: no
            faults.
        api_key: the key clients must send; None disables the check.
        balance: how many paid answers are given before every further request gets 402;
            None: unlimited.
        latency: seconds added to every answer.
        log_path: also append every :class:`LogEntry` to this file as a JSON line, written
            unbuffered so another process can read it even after this one is killed.
        quota: a hard limit in requests per second (a fixed 1-second window); None: no limit.
        outage: ``(start, duration)``: every authorized request answers 503 (no Retry-After)
            from ``start`` to ``start + duration`` seconds after the first request.
        payload_bytes: pad every payload with that many characters (``payload_for(id, pad=N)``).
    """

    def __init__(
        self,
        *,
        faults: Callable[[str], Fault] | Mapping[str, Fault] | None = None,
        api_key: str | None = "demo-key",
        balance: int | None = None,
        latency: float = 0.0,
        log_path: str | os.PathLike[str] | None = None,
        quota: float | None = None,
        outage: tuple[float, float] | None = None,
        payload_bytes: int = 0,
    ) -> None:
        if faults is None:
            faults = no_faults
        elif isinstance(faults, Mapping):
            faults = _mapping_faults(faults)
        self._faults: Callable[[str], Fault] = faults
        self._api_key = api_key
        self._bearer = f"Bearer {api_key}"
        self._balance_left = balance
        self._latency = latency
        self._log_path = log_path
        self._quota = quota
        self._outage = outage
        if payload_bytes < 0:
            raise ValueError("MockAPI payload_bytes must be >= 0")
        self._pad = payload_bytes
        self._first_request: float | None = None
        self._window = -1
        self._window_count = 0
        self._attempts: collections.Counter[str] = collections.Counter()
        self._paid: list[str] = []
        self._requests = 0
        self._answered = 0
        self._log_file: BinaryIO | None = None
        self._runner: web.AppRunner | None = None
        self.log: list[LogEntry] = []
        self.url = ""
        self.item_url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving on ``host:port`` (0: any free port) and return the base URL."""
        if self._runner is not None:
            raise RuntimeError("MockAPI is already started")
        if self._log_path is not None:
            self._log_file = await asyncio.to_thread(open, self._log_path, "ab", buffering=0)
        app = web.Application()
        app.router.add_get("/items/{id:.+}", self._handle, allow_head=False)
        app.router.add_post("/items/{id:.+}", self._handle)
        app.router.add_get("/health", _health)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = runner.addresses[0][1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound_port}"
        self.item_url = f"{self.url}/items/{{id}}"
        return self.url

    async def close(self) -> None:
        """Stop serving (in-flight answers get about 1 s) and close the log file. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        log_file, self._log_file = self._log_file, None
        if log_file is not None:
            log_file.close()

    async def __aenter__(self) -> MockAPI:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- inspection --------------------------------------------------------------------------

    def url_for(self, item_id: str) -> str:
        """The URL of one item, the ID percent-encoded as a single path segment."""
        return self.item_url.replace("{id}", quote(item_id, safe=""))

    @property
    def balance_left(self) -> int | None:
        """Paid answers left before 402s start (None: unlimited)."""
        return self._balance_left

    def starts(self) -> list[str]:
        """IDs in arrival order, one per request."""
        return [e.id for e in self.log if e.event == "start"]

    def paid(self) -> list[str]:
        """IDs answered 200 with a valid payload (billed), in answer order."""
        return list(self._paid)

    def counts(self) -> collections.Counter[int]:
        """Answer status -> count (0 counts dropped connections)."""
        return collections.Counter(e.status for e in self.log if e.status is not None)

    def __repr__(self) -> str:
        state = "stopped" if self._runner is None else self.url
        balance = "unlimited" if self._balance_left is None else self._balance_left
        return (f"<MockAPI {state} requests={self._requests}"
                f" in_flight={self._requests - self._answered} paid={len(self._paid)}"
                f" balance_left={balance}>")

    # -- serving -----------------------------------------------------------------------------

    def _record(self, event: str, item_id: str, status: int | None, authorized: bool) -> None:
        if status is None:
            self._requests += 1
        else:
            self._answered += 1
        entry = LogEntry(len(self.log), event, item_id, status, time.time(), authorized)
        self.log.append(entry)
        if self._log_file is not None:
            self._log_file.write(orjson.dumps({
                "seq": entry.seq, "event": event, "id": item_id, "status": status,
                "t": entry.t, "authorized": authorized,
            }, option=orjson.OPT_APPEND_NEWLINE))

    def _is_authorized(self, request: web.Request) -> bool:
        if self._api_key is None:
            return True
        headers = request.headers
        return (headers.get("X-Api-Key") == self._api_key
                or headers.get("Authorization") == self._bearer)

    def _decide(self, item_id: str, authorized: bool) -> _Reply:
        """Pick the answer at arrival, so concurrent requests can never overdraw the balance."""
        if not authorized:
            return _error(401, "invalid or missing API key")
        if self._outage is not None:
            now = time.monotonic()
            if self._first_request is None:
                self._first_request = now
            start, duration = self._outage
            if start <= now - self._first_request < start + duration:
                return _error(503, "upstream outage")
        if self._quota is not None:
            window = int(time.monotonic())
            if window != self._window:
                self._window, self._window_count = window, 0
            if self._window_count >= self._quota:
                return _error(429, "request quota exceeded", **{"Retry-After": "1"})
            self._window_count += 1
        if self._balance_left is not None and self._balance_left <= 0:
            return _error(402, "insufficient balance")
        fault = self._faults(item_id)
        kind = fault.kind
        early = False  # still within the fault's first `times` attempts?
        if kind in _FIRST_TIMES:  # only these need a counter (keeps memory flat for big runs)
            self._attempts[item_id] += 1
            early = self._attempts[item_id] <= fault.times
        if kind in _ALWAYS:
            status = fault.status or _ALWAYS[kind]
            return _error(status, _phrase(status).lower())
        if kind == "error_in_body":
            return _Reply(200, orjson.dumps({"code": fault.status,
                                             "message": _phrase(fault.status or 500)}))
        if early and kind in ("flaky", "stall"):
            status = fault.status or 503
            reply = _error(status, _phrase(status).lower())
            reply.wait = fault.delay if kind == "stall" else 0.0
            return reply
        if early and kind == "rate_limited":
            if fault.http_date:
                when = email.utils.formatdate(math.ceil(time.time() + fault.retry_after),
                                              usegmt=True)
            else:  # whole seconds as RFC 9110 says; a fraction is kept for fast tests
                when = f"{fault.retry_after:.3f}".rstrip("0").rstrip(".")
            return _error(429, "rate limited", **{"Retry-After": when})
        if early and kind == "drop":
            return _Reply(0, drop=True)
        if early and kind == "invalid_json":
            return _Reply(200, orjson.dumps(payload_for(item_id, pad=self._pad))[:-7])  # truncated: not JSON
        if self._balance_left is not None:
            self._balance_left -= 1
        return _Reply(200, orjson.dumps(payload_for(item_id, pad=self._pad)), billed=True,
                      wait=fault.delay if kind == "slow" else 0.0)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        item_id = request.match_info["id"]
        authorized = self._is_authorized(request)
        self._record("start", item_id, None, authorized)
        reply = self._decide(item_id, authorized)
        wait = self._latency + reply.wait
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:  # server shutting down: nothing is sent or billed
                if reply.billed and self._balance_left is not None:
                    self._balance_left += 1
                self._record("end", item_id, 0, authorized)
                raise
        self._record("end", item_id, reply.status, authorized)
        if reply.drop:
            # Closing the transport and returning a response makes the client see
            # ServerDisconnectedError; aiohttp then skips the write without logging anything.
            if request.transport is not None:
                request.transport.close()
            return web.Response()
        if reply.billed:
            self._paid.append(item_id)
        return web.Response(body=reply.body, status=reply.status, headers=reply.headers,
                            content_type=_JSON)


class MockProcess:
    """The mock API in a process of its own: ``python -m asyncrawl.testing --log LOG ARGS``
    (a client in this process then competes with no server for the CPU). ``url`` and
    ``item_url`` once it listens; ``stop()``, or use it as a context manager."""

    def __init__(self, log: str | os.PathLike[str], *args: str,
                 cwd: str | os.PathLike[str] | None = None) -> None:
        self.log_path = Path(log)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrawl.testing", "--log", str(log), *args],
            stdout=subprocess.PIPE, text=True, cwd=cwd)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"mock API did not start: {line!r}")
        self.url = line.removeprefix("listening on ")
        self.item_url = self.url + "/items/{id}"

    def __enter__(self) -> MockProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def settled_log(self, quiet: float = 0.3, timeout: float = 15.0) -> list[LogEntry]:
        """The log once it stopped growing (answers to a killed client are still logged)."""
        deadline = time.monotonic() + timeout
        size = -1
        while time.monotonic() < deadline:
            new = self.log_path.stat().st_size if self.log_path.exists() else 0
            if new == size:
                break
            size = new
            time.sleep(quiet)
        return read_log(self.log_path) if self.log_path.exists() else []

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s), and wait for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _mapping_faults(faults: Mapping[str, Fault]) -> Callable[[str], Fault]:
    def lookup(item_id: str) -> Fault:
        return faults.get(item_id, _OK)

    return lookup


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"error {status}"


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status": "ok"}', content_type=_JSON)


# -- process entry point -----------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api = MockAPI(
        faults=FAULT_MIXES[args.faults],
        api_key=None if args.no_auth else args.api_key,
        balance=args.balance,
        latency=args.latency,
        log_path=args.log,
        quota=args.quota,
        outage=args.outage,
        payload_bytes=args.payload_bytes,
    )
    await api.start(args.host, args.port)
    try:
        print(f"listening on {api.url}", flush=True)  # (the first line: ``MockProcess`` reads it)
        if sys.stdout.isatty():  # (someone at a terminal: how to call it)
            key = "" if args.no_auth else ", with the key (--api-key) in the header X-Api-Key"
            print(f"asyncrawl's URL: {api.url}/items/{{id}}{key}", flush=True)
        await stop.wait()
    finally:
        await api.close()


def _outage_arg(text: str) -> tuple[float, float]:
    try:
        start, duration = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected START,DURATION in seconds, e.g. 2,8") from None
    return start, duration


def main(argv: list[str] | None = None) -> int:
    """Run the mock as a process until SIGTERM or SIGINT; prints ``listening on URL`` first."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncrawl.testing", description="Serve the fault-injecting mock API.",
        epilog="It answers GET /items/{id} with a JSON payload (and the faults chosen), so "
               "asyncrawl's URL is http://HOST:PORT/items/{id}; with a key, each request "
               "carries it as 'X-Api-Key: KEY' or 'Authorization: Bearer KEY' (else 401). "
               "The first line it prints is 'listening on http://HOST:PORT'.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): any free port")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--api-key", default="demo-key", help="required key (default: demo-key)")
    auth.add_argument("--no-auth", action="store_true", help="accept requests without a key")
    parser.add_argument("--balance", type=int, default=None, help="paid answers before 402s")
    parser.add_argument("--faults", choices=sorted(FAULT_MIXES), default="demo",
                        help="demo (default): demo_faults; flaky: flaky_faults; none: all ok")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to each answer")
    parser.add_argument("--log", default=None, help="append every request event as JSON lines")
    parser.add_argument("--quota", type=float, default=None, help="hard limit in requests/s")
    parser.add_argument("--outage", type=_outage_arg, default=None, metavar="START,DURATION",
                        help="answer 503 to everything from START for DURATION seconds "
                             "(counted from the first request)")
    parser.add_argument("--payload-bytes", type=int, default=0, metavar="N",
                        help="pad every payload with N characters (large records)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except OSError as exc:  # e.g. the port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
