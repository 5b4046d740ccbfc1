"""One HTTP attempt for one ID: build the request, send it, read the body, classify the result.

This is the only module that talks to aiohttp, and ``Fetcher.attempt`` is the one boundary where
aiohttp's exceptions become outcomes: it never raises for a network or HTTP problem. Every answer
falls in exactly one ``Outcome`` class (SPEC §2)::

    OK     2xx whose body parses as JSON              -> settled
    RETRY  408/429/5xx, connection errors, timeouts,  -> backoff (honouring Retry-After)
           a 2xx body that does not parse
    SKIP   400/404/410, every other 4xx, unfollowed   -> recorded failed, permanent
           redirects, bodies over max_body_bytes
    FATAL  401/402                                    -> the whole job halts
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from .config import _SECRET_HEADER, Config
from .retry import parse_retry_after

REDIRECTS = frozenset({301, 302, 303, 307, 308})


class Outcome(enum.Enum):
    """The four outcome classes."""

    OK = "ok"
    RETRY = "retry"
    SKIP = "skip"
    FATAL = "fatal"


@dataclass(frozen=True, slots=True)
class Request:
    """What to send for one ID. A ``request_for`` hook may return its own."""

    method: str
    url: URL
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None


@dataclass(frozen=True, slots=True)
class Response:
    """What a classifier hook sees: the status, headers and parsed body (``None`` if unparsable)."""

    id: str
    status: int
    headers: Mapping[str, str]
    data: Any
    body_ok: bool


@dataclass(frozen=True, slots=True)
class Attempt:
    """The result of one attempt."""

    outcome: Outcome
    status: int | None = None
    data: Any = None
    error: str | None = None
    retry_after: float | None = None
    billable: bool = False


Classifier = Callable[[Response], "Outcome | str | None"]


_PLAIN_ID = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]*").fullmatch


def encode_id(item_id: str) -> str:
    """Percent-encode an ID as exactly one path segment or query value: no character survives
    that could change the host, path or query. ``.`` and ``..`` (dot-segments) are encoded too."""
    if _PLAIN_ID(item_id):  # the common case: nothing to encode
        return item_id
    enc = quote(item_id, safe="")
    if enc in (".", ".."):
        enc = enc.replace(".", "%2E")
    return enc


class RequestBuilder:
    """Turns an ID into a ``Request`` from the config's URL template, params and headers."""

    __slots__ = ("_headers", "_method", "_parts", "_query_parts")

    def __init__(self, config: Config) -> None:
        self._method = config.method
        self._headers = {k: str(v) for k, v in config.headers.items()}  # TOML may give numbers
        self._parts = config.url.split("{id}")
        # Query parameters are encoded here, once; only {id} is filled per request.
        query = [
            (quote(str(k), safe=""), str(v).split("{id}")) for k, v in config.params.items()
        ]
        self._query_parts = [
            (k, [quote(p, safe="") for p in pieces]) for k, pieces in query
        ]

    def __call__(self, item_id: str) -> Request:
        enc = encode_id(item_id)
        url = enc.join(self._parts)
        if self._query_parts:
            q = "&".join(f"{k}={enc.join(pieces)}" for k, pieces in self._query_parts)
            url += ("&" if "?" in url else "?") + q
        return Request(self._method, URL(url, encoded=True), self._headers)


def status_class(status: int, config: Config) -> Outcome:
    """The class of an HTTP status per the config's sets (SPEC §2)."""
    if status in config.fatal:
        return Outcome.FATAL
    if status in config.retryable:
        return Outcome.RETRY
    if status in config.skip:
        return Outcome.SKIP
    if 200 <= status < 300:
        return Outcome.OK
    if 400 <= status < 500 or 300 <= status < 400:
        return Outcome.SKIP
    return Outcome.RETRY


def _field(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


class Fetcher:
    """Sends one attempt and classifies it. Holds no per-ID state."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        config: Config,
        *,
        request_for: Callable[[str], Request] | None = None,
        classify: Classifier | None = None,
    ) -> None:
        self.session = session
        self.config = config
        self.request_for = request_for or RequestBuilder(config)
        self.classify = classify
        self.timeout = aiohttp.ClientTimeout(
            total=config.timeout, sock_connect=min(config.timeout, 10.0)
        )
        self._ssl: Any = None if config.verify_tls else False
        if config.ca_bundle and config.verify_tls:
            import ssl

            ctx = ssl.create_default_context()
            ctx.load_verify_locations(config.ca_bundle)
            self._ssl = ctx

    async def attempt(self, item_id: str) -> Attempt:
        """One try for ``item_id``. Never raises for network or HTTP problems."""
        cfg = self.config
        try:
            req = self.request_for(item_id)
            method, url, headers = req.method, req.url, req.headers
            for hop in range(cfg.max_redirects + 1):
                async with self.session.request(
                    method, url, headers=headers, json=req.json, allow_redirects=False,
                    timeout=self.timeout, ssl=self._ssl,
                ) as resp:
                    status = resp.status
                    if status in REDIRECTS and "Location" in resp.headers:
                        try:
                            target = url.join(URL(resp.headers["Location"]))
                            same = target.origin() == url.origin()
                        except ValueError:  # not a URL, or one without a host (mailto:, data:)
                            return Attempt(Outcome.SKIP, status, error=cfg.redact(
                                f"redirect to an invalid Location {resp.headers['Location']}"[:500]))
                        allowed = cfg.follow_redirects == "any" or (
                            same and cfg.follow_redirects == "same-origin")
                        if not allowed or hop == cfg.max_redirects:
                            why = "too many redirects" if allowed else "redirect not followed"
                            return Attempt(Outcome.SKIP, status, error=cfg.redact(
                                f"{why}: Location {resp.headers['Location']}"[:500]))
                        if not same:  # never carry credentials to another origin
                            headers = {k: v for k, v in headers.items()
                                       if not _SECRET_HEADER.search(k)
                                       and not any(s in v for s in cfg.secrets)}
                        if status == 303:
                            method = "GET"
                        url = target
                        continue
                    body = await self._read(resp)
                    return self._classify(item_id, status, resp.headers, body)
            raise AssertionError("unreachable")  # pragma: no cover
        except TimeoutError:
            return Attempt(Outcome.RETRY, None, error="timeout")
        except aiohttp.ClientError as e:
            return Attempt(Outcome.RETRY, None, error=cfg.redact(_describe(e)))
        except OSError as e:  # e.g. a socket error aiohttp did not wrap
            return Attempt(Outcome.RETRY, None, error=cfg.redact(_describe(e)))

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The body, or ``None`` when it is larger than ``max_body_bytes`` (after decoding)."""
        limit = self.config.max_body_bytes
        length = resp.content_length
        if length is not None:
            if length > limit:
                return None
            if "Content-Encoding" not in resp.headers:  # no decompression: cannot grow
                return await resp.read()
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _classify(self, item_id: str, status: int, headers: Mapping[str, str],
                  body: bytes | None) -> Attempt:
        cfg = self.config
        retry_after = None if status < 300 else parse_retry_after(headers.get("Retry-After"))
        if body is None:
            return Attempt(Outcome.SKIP, status, error=f"body larger than {cfg.max_body_bytes} bytes",
                           billable=200 <= status < 300)
        data: Any = None
        body_ok = False
        try:
            data = orjson.loads(body)
            body_ok = True
        except orjson.JSONDecodeError:
            pass
        outcome = status_class(status, cfg)
        effective = status
        if body_ok and cfg.error_field and outcome is Outcome.OK:
            code = _field(data, cfg.error_field)
            if code is not None and code not in cfg.success_values:
                effective = code if isinstance(code, int) and not isinstance(code, bool) else 400
                outcome = status_class(effective, cfg)
                if outcome is Outcome.OK:
                    outcome = Outcome.SKIP
        if self.classify is not None:
            verdict = self.classify(Response(item_id, status, CIMultiDict(headers), data, body_ok))
            if verdict is not None:
                outcome = Outcome(verdict)
        billable = 200 <= status < 300
        if outcome is Outcome.OK:
            if not body_ok:
                return Attempt(Outcome.RETRY, status, error="2xx body is not valid JSON",
                               billable=billable)
            return Attempt(Outcome.OK, status, data=data, billable=billable)
        error = f"HTTP {effective}" if effective == status else f"HTTP {status}, body code {effective}"
        if not body_ok and 200 <= status < 300:
            error = "2xx body is not valid JSON"
        return Attempt(outcome, effective, error=error, retry_after=retry_after, billable=billable)


def _describe(e: BaseException) -> str:
    text = str(e)
    name = type(e).__name__
    return f"{name}: {text}"[:300] if text else name

