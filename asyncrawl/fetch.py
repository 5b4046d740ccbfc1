"""One HTTP attempt for one ID: build the request, send it, read the body, classify the result.

This is the only module that sends requests, and ``Fetcher._attempt`` is the one place where
aiohttp's exceptions become outcomes (an ``Outcome`` and an ``ErrorKind``): it never raises for a
network or HTTP problem. Every answer
falls in exactly one ``Outcome`` class (SPEC §2; the status sets are the defaults of
``[retry] retryable / skip / fatal``)::

    OK     2xx whose body parses as JSON              -> settled
    RETRY  408/429/5xx, connection errors, timeouts,  -> backoff (honouring Retry-After)
           a 2xx body that does not parse, is cut        (a paid 2xx: at most paid_retries
           short or is over max_body_bytes               more times, ``Attempt.unusable``)
    SKIP   400/404/410, every other 4xx, unfollowed   -> recorded failed, permanent
           redirects
    FATAL  401/402/407 (407 also as a proxy's answer  -> the whole job halts
           to an https:// tunnel)

Where: ``RequestBuilder`` builds a request (``Fetcher.hooked`` for a ``request_for`` hook);
``_attempt`` sends it and maps every exception (its ``except`` branches, ``_broken``,
``_redirect``); ``_classify`` and ``status_class`` classify an answer. What follows an
outcome (retry, settle, halt) is ``worker.decide``'s.

Hostile servers are expected: the body is read up to ``max_body_bytes`` (after decompression,
so a gzip bomb stops at the same limit); a server that never answers or stalls mid-body meets
the connect / read / total timeouts; every error text is redacted (``Config.redact``) before it
leaves this module, because aiohttp's messages can quote the request URL and its query.
Credentials never cross origins: a redirect to another origin is not followed by default, and
when ``follow_redirects = "any"`` it carries no secret header or value.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import contextvars
import enum
import errno
import ipaddress
import json
import logging
import os
import re
import socket
import ssl
import time
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast
from urllib.parse import parse_qsl, quote, quote_plus, urlsplit

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from . import http1
from .alloc import fix_mmap_threshold
from .config import (
    _SECRET_PARAM,
    _TOKEN,
    DEFAULT_RETRYABLE,
    MIN_SECRET_LENGTH,
    Config,
    _is_http_url,
)
from .errors import ConfigError, SessionClosed
from .jsontext import parse_json
from .retry import parse_retry_after
from .types import ErrorKind

log = logging.getLogger("asyncrawl")

REDIRECTS = frozenset({301, 302, 303, 307, 308})
INSECURE_WARNING = ("TLS certificate verification is OFF (verify_tls = false or --insecure): "
                    "anyone on the network path can read and change the traffic, API key included")


class Outcome(enum.Enum):
    """The four outcome classes."""

    OK = "ok"
    RETRY = "retry"
    SKIP = "skip"
    FATAL = "fatal"


@dataclass(frozen=True, slots=True)
class Request:
    """What to send for one ID. A ``request_for`` hook may return its own.

    Its ``repr`` shows header *names* only and blanks secret-named query values, so a request
    that ends up in a traceback or a debug line does not carry the key with it."""

    method: str
    url: URL | str
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None

    def __repr__(self) -> str:
        url = URL(self.url) if not isinstance(self.url, URL) else self.url
        if url.query:
            url = url.with_query([(k, "***" if _SECRET_PARAM.match(k) else v)
                                  for k, v in url.query.items()])
        if url.password:
            url = url.with_password("***")
        body = "" if self.json is None else ", json=..."
        return f"Request({self.method!r}, {str(url)!r}, headers={sorted(self.headers)!r}{body})"


@dataclass(frozen=True, slots=True)
class Response:
    """What a classifier hook sees: the status, headers and parsed body (``None`` if unparsable)."""

    id: str
    status: int
    headers: Mapping[str, str]
    data: Any
    body_ok: bool


class Attempt(NamedTuple):
    """The result of one attempt (a tuple: one is made per request). ``body`` is the raw body of
    an ``OK`` answer, ``data`` the payload parsed from it; ``kind`` what went wrong (``None``:
    nothing), ``error`` the same in words, redacted."""

    outcome: Outcome
    status: int | None = None
    data: Any = None
    error: str | None = None
    retry_after: float | None = None
    billable: bool = False
    body: bytes | None = None
    kind: ErrorKind | None = None
    # the request may have reached the server, and no answer came (a timeout after the
    # connect, a dropped connection): possibly billed (``Record.unanswered``)
    unanswered: bool = False
    # nothing left the process: the attempt failed before its first request had its connection
    # (a refused connect, a name that does not resolve, a TLS handshake): its intent is taken back
    sent_nothing: bool = False

    @property
    def unusable(self) -> bool:
        """A paid (2xx) answer that cannot be used: its body did not parse, did not come whole
        or was too large. Bought again at most ``paid_retries`` times, in all runs; an answer
        whose body or a hook says to try again is retried as its status would be."""
        return self.outcome is Outcome.RETRY and self.billable and self.kind is not ErrorKind.HTTP


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


_TEMPLATE_SAFE = "%:/?#[]@!$&'()*+,;=~-._"


class RequestBuilder:
    """Turns an ID into a ``Request`` from the config's URL template, params, headers and
    body (``[request] json`` or ``body``), and ``key`` (one of ``[request] keys``) where
    ``key_header`` / ``key_param`` say."""

    __slots__ = ("_fast", "_parts", "_query_parts", "body", "headers", "method")

    def __init__(self, config: Config, key: str | None = None) -> None:
        self.method = config.method
        self.headers = {k: str(v) for k, v in config.headers.items()}  # TOML may give numbers
        if key is not None and config.key_param is None:
            self.headers[config.key_header] = config.key_value(key)
        self.body, content_type = body_maker(config)
        if content_type and not any(k.lower() == "content-type" for k in self.headers):
            self.headers["Content-Type"] = content_type
        # The template is sent as written (encoded=True), so non-ASCII is percent-encoded here
        # (UTF-8); reserved characters and existing %XX escapes are kept as they are.
        self._parts = [quote(p, safe=_TEMPLATE_SAFE) for p in config.url.split("{id}")]
        # Query parameters are encoded here, once; only {id} is filled per request.
        query = [
            (quote(str(k), safe=""), str(v).split("{id}")) for k, v in config.params.items()
        ]
        self._query_parts = [
            (k, [quote(p, safe="") for p in pieces]) for k, pieces in query
        ]
        if key is not None and config.key_param is not None:  # taken as is: no {id} in a key
            self._query_parts.append((quote(config.key_param, safe=""), [quote(key, safe="")]))
        self._fast = self._fast_parts()

    def _fast_parts(self) -> tuple[URL | None, str, str, list[str], str] | None:
        """When ``{id}`` is only in the template's path and params carry no ``{id}``: the
        origin's URL (if there is no query), scheme, authority, path pieces and query string,
        so that a URL is assembled without parsing."""
        if len(self._parts) < 2 or any(len(p) > 1 for _, p in self._query_parts):
            return None
        marker = "asyncrawl0id0marker"
        template = marker.join(self._parts)
        if template.count(marker) != len(self._parts) - 1:
            return None
        try:
            url = URL(template, encoded=True)
        except ValueError:
            return None
        if not url.absolute or url.raw_fragment or marker in url.raw_query_string \
                or marker in (url.raw_authority or "") \
                or url.raw_path.count(marker) != len(self._parts) - 1:
            return None
        qs = url.raw_query_string
        if self._query_parts:
            extra = "&".join(f"{k}={pieces[0]}" for k, pieces in self._query_parts)
            qs = f"{qs}&{extra}" if qs else extra
        pieces = url.raw_path.split(marker)
        # without a query: the origin's URL, to which each request's path is given (yarl
        # then takes its host and port as they are, instead of parsing the authority again)
        base = URL.build(scheme=url.scheme, authority=url.raw_authority, encoded=True) \
            if not qs and pieces[0].startswith("/") else None
        return base, url.scheme, url.raw_authority, pieces, qs

    def __call__(self, item_id: str) -> Request:
        return Request(self.method, self.url(item_id), self.headers)

    def url(self, item_id: str) -> URL:
        enc = encode_id(item_id)
        if self._fast is not None:
            base, scheme, authority, path, qs = self._fast
            if base is not None:
                return base.with_path(enc.join(path), encoded=True)
            return URL.build(scheme=scheme, authority=authority, path=enc.join(path),
                             query_string=qs, encoded=True)
        url = enc.join(self._parts)
        if self._query_parts:
            q = "&".join(f"{k}={enc.join(pieces)}" for k, pieces in self._query_parts)
            url += ("&" if "?" in url else "?") + q
        return URL(url, encoded=True)


def with_key(config: Config, key: str, url: URL,
             headers: Mapping[str, str]) -> tuple[URL, Mapping[str, str]]:
    """``url`` and ``headers`` carrying ``key`` where the config says (a ``request_for``
    hook's request, which knows nothing of the keys)."""
    if config.key_param is not None:
        return url.update_query({config.key_param: key}), headers
    name = config.key_header.lower()
    return url, {**{k: v for k, v in headers.items() if k.lower() != name},
                 config.key_header: config.key_value(key)}


def body_maker(config: Config) -> tuple[Callable[[str], bytes] | None, str | None]:
    """The request body for an ID (``None``: no body) and its content type.

    ``[request] json``: the table or array with ``{id}`` filled into its string values (never
    into keys), serialised afterwards, so that an ID with quotes or backslashes cannot change
    the document. ``[request] body``: the text with ``{id}`` filled in, form-encoded when the
    content type is ``application/x-www-form-urlencoded``."""
    if config.json is not None:
        template = config.json

        def fill(value: Any, item: str) -> Any:
            if isinstance(value, str):
                return value.replace("{id}", item) if "{id}" in value else value
            if isinstance(value, Mapping):
                return {k: fill(v, item) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [fill(v, item) for v in value]
            return value

        return (lambda item: orjson.dumps(fill(template, item))), "application/json"
    if config.body is not None:
        # the type the request says it has: a Content-Type header (-H) wins over content_type
        # (``RequestBuilder`` sends that header then), and the body is encoded as it says
        given = [v for k, v in config.headers.items() if k.lower() == "content-type"]
        ctype = str(given[0]) if given else config.content_type or "text/plain; charset=utf-8"
        form = ctype.split(";")[0].strip().lower() == "application/x-www-form-urlencoded"
        pieces = config.body.split("{id}")

        def text(item: str) -> bytes:
            return (quote_plus(item) if form else item).join(pieces).encode("utf-8")

        return text, ctype
    return None, None


def status_class(status: int, config: Config) -> Outcome:
    """The class of an HTTP status per the config's sets (SPEC §2). A status in none of them:
    2xx ok, 3xx and 4xx skip, 5xx retried while ``retryable`` is the default (a list of the
    user's own names every status retried: another 5xx is a skip), anything else retried."""
    if status in config.fatal:
        return Outcome.FATAL
    if status in config.retryable:
        return Outcome.RETRY
    if status in config.skip:
        return Outcome.SKIP
    if 200 <= status < 300:
        return Outcome.OK
    if 300 <= status < 500:
        return Outcome.SKIP
    if 500 <= status < 600 and config.retryable != DEFAULT_RETRYABLE:
        return Outcome.SKIP
    return Outcome.RETRY


def body_code(code: Any) -> int:
    """An error code found in a body (``[response] error_field``) as a status to classify: an
    integer, also when written as a string or a float (``"402"``, ``402.0``: many APIs send
    their codes so); anything else (a word, ``true``, a fraction, or an integer that is no
    HTTP status: ``0``, ``-1``, ``10001``, an application's own codes) counts as a 400. (Such
    an integer was retried as an unknown status is: every try a paid 200, ``2 x max_tries``
    of them an ID, with no ``paid_retries`` to stop it.)"""
    number = _integer(code)
    return 400 if number is None or not 100 <= number <= 599 else number


def _integer(code: Any) -> int | None:
    """``code`` as the integer it writes (``402``, ``"402"``, ``402.0``), or ``None``."""
    if isinstance(code, bool):
        return None
    if isinstance(code, int):
        return code
    if (isinstance(code, float) and code.is_integer()) or (
            isinstance(code, str) and code.strip().isdecimal()):
        return int(code)
    return None


def is_success(code: Any, values: tuple[Any, ...]) -> bool:
    """Whether an ``error_field`` value is one of ``[response] success_values``: as written,
    or as the same integer however either writes it (``"0"``, ``0.0`` and ``0`` are one)."""
    if any(v == code and isinstance(v, bool) is isinstance(code, bool) for v in values):
        return True  # (as written: but true is not 1)
    number = _integer(code)
    return number is not None and any(_integer(v) == number for v in values)


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
        observe: Callable[[str, Attempt, bool], None] | None = None,
        lean: bool = False,
    ) -> None:
        self.session = session
        # whether the session's connector says when a request has its connection (then what
        # may have been sent is known; another session's ambiguous failure counts as sent)
        self._marks = isinstance(session.connector, Connector)
        self.observe = observe
        self.config = config
        self.request_for = request_for  # a hook; None: the config's template (no Request made)
        # one builder per API key (``[request] keys``; the lane of ``Governor``), else one
        self._builds = [RequestBuilder(config, key) for key in config.keys] or [
            RequestBuilder(config)]
        self.classify = classify
        self.timeout = client_timeout(config)
        # a 200 is OK when its body parses, unless a hook or the config may say otherwise
        self._plain_200 = (classify is None and not config.error_field
                           and config.response_format == "json"
                           and status_class(200, config) is Outcome.OK)
        self._ssl = tls_context(config)
        self._proxy = config.proxy or env_proxy(config.url)
        # ``lean``: the session is the run's own, so what it sends may go by asyncrawl's own
        # client instead (not through a proxy; ``http1.Client.serves`` says what else it takes)
        self.lean = http1.Client(limit=config.concurrency, verify=self._ssl) \
            if lean and self._proxy is None else None
        if self._ssl is False:
            log.warning("%s", INSECURE_WARNING)  # on every run: a Fetcher serves one run

    def close(self) -> None:
        """Close the lean client's idle connections (the session is closed by its owner)."""
        if self.lean is not None:
            self.lean.close()

    def hooked(self, item_id: str, lane: int = 0) -> Request | None:
        """The ``request_for`` hook's request for ``item_id``, with the API key of ``lane``
        (``None``: no hook; the config's template is built by ``attempt``). Called before
        the request's ``sent`` intent is committed: a hook that raises has sent nothing."""
        if self.request_for is None:
            return None
        req = self.request_for(item_id)
        if not isinstance(req, Request):
            raise ConfigError(f"request_for returned {type(req).__name__} for ID {item_id!r}: "
                              "it must return an asyncrawl.Request")
        url, headers = _checked(req, item_id)
        if self.config.keys:  # the hook builds the request; the key is the lane's
            url, headers = with_key(self.config, self.config.keys[lane], url, headers)
        return Request(req.method, url, headers, req.json)

    async def attempt(self, item_id: str, lane: int = 0, *, first: bool = True,
                      request: Request | None = None) -> Attempt:
        """One try for ``item_id``, with the API key of ``lane`` (``[request] keys``):
        ``request`` (``hooked``'s), else the config's template. Never raises for network or
        HTTP problems. Every attempt, whatever it led to, is shown to ``observe`` (the
        operator's error counts, the run's early stops), with ``first``: the ID's first try,
        with no failure of it behind it (what it meets says something of the API, not only
        of that ID)."""
        if request is None and self.request_for is not None:
            request = self.hooked(item_id, lane)
        result = await self._attempt(item_id, lane, request)
        if self.observe is not None:
            self.observe(item_id, result, first)
        return result

    async def _attempt(self, item_id: str, lane: int, req: Request | None) -> Attempt:
        cfg = self.config
        hop = 0  # (a failure after a redirect's answer came: a request did leave)
        try:
            data: bytes | None = None
            url: URL
            headers: Mapping[str, str]
            if req is None:
                b = self._builds[lane]
                method, url, headers, body = b.method, b.url(item_id), b.headers, None
                if b.body is not None:
                    data = b.body(item_id)
            else:
                # (``hooked`` made its URL a ``URL``: nothing to build again a request)
                method, url, headers, body = req.method, cast(URL, req.url), req.headers, req.json
            timeout, began = self.timeout, time.monotonic()
            ours: set[str] | None = None  # the credentials the request carried (hop 0's)
            for hop in range(cfg.max_redirects + 1):
                if hop:  # (``timeout`` bounds the whole attempt: its hops share it; a hop
                    # with less than a tenth of it left is not sent: its answer, the paid one
                    # as often as not, would come too late, and be bought again)
                    left = cfg.timeout - (time.monotonic() - began)
                    if left < 0.1 * cfg.timeout:
                        return Attempt(Outcome.RETRY, None, kind=ErrorKind.TIMEOUT, error=(
                            f"timeout: {cfg.timeout:g}s all but spent after {hop} "
                            f"redirect{'s' if hop > 1 else ''}"))
                    timeout = aiohttp.ClientTimeout(
                        total=left, sock_connect=min(self.timeout.sock_connect or left, left),
                        sock_read=self.timeout.sock_read)
                if self.lean is not None and self.lean.serves(method, url):
                    _CONNECTED.set(True)  # (from here on, only a connect's failure sent nothing)
                    try:
                        answer = await self.lean.request(
                            method, url, headers, json=body, data=data,
                            limit=cfg.max_body_bytes, total=timeout.total,
                            connect=timeout.sock_connect, silence=timeout.sock_read,
                            fixed=req is None and headers is self._builds[lane].headers)
                        status, answered = answer.status, answer.headers
                    except http1.BrokenAnswer as e:  # (a redirect's body is not read: as
                        if e.status not in REDIRECTS or "Location" not in e.headers:  # aiohttp)
                            raise
                        status, answered = e.status, e.headers
                    else:
                        if status not in REDIRECTS or "Location" not in answered:
                            return self._classify(item_id, status, answered, answer.body)
                else:
                    if self.session.closed:  # (by the application that gave it: aiohttp would
                        raise SessionClosed(  # refuse with a RuntimeError, sending nothing)
                            "the aiohttp session given to the Crawler was closed while the run "
                            "went on", sent=hop > 0)
                    if self._marks:  # (each hop: a redirect's answer came; its target's not yet)
                        _CONNECTED.set(False)
                    async with self.session.request(
                        method, url, headers=headers, json=body, data=data,
                        allow_redirects=False, timeout=timeout, ssl=self._ssl,
                        proxy=self._proxy,
                        raise_for_status=False,  # (an application's session may say otherwise)
                    ) as resp:
                        status, answered = resp.status, resp.headers
                        if status not in REDIRECTS or "Location" not in answered:
                            try:
                                body = await self._read(resp)
                            except (aiohttp.ClientError, OSError) as e:  # (TimeoutError too)
                                return self._broken(item_id, status, answered, e)
                            return self._classify(item_id, status, answered, body,
                                                  head=method == "HEAD")
                if ours is None:  # (the request as it was made: a later hop may carry less)
                    ours = _ours(url, headers, body, data, cfg)
                hop_to = self._redirect(status, answered["Location"], url, headers, hop, ours)
                if isinstance(hop_to, Attempt):
                    return hop_to
                url, headers = hop_to
                if status == 303:  # "see other": fetch it, do not resend the body
                    method, body, data = "GET", None, None
            raise AssertionError("unreachable")  # pragma: no cover
        except http1.BrokenAnswer as e:  # (the lean client's: its head came, not its body)
            return self._broken(item_id, e.status, e.headers, e.cause)
        except http1.ConnectError as e:  # (the lean client's: nothing was sent)
            if isinstance(e.os_error, ssl.SSLCertVerificationError):
                return self._certificate(e.os_error, first=hop == 0)
            kind, error = _connect_error(e, self._proxy)
            return Attempt(Outcome.RETRY, None, error=cfg.redact(error)[:500], kind=kind,
                           sent_nothing=hop == 0)
        except aiohttp.ClientConnectorCertificateError as e:
            return self._certificate(e.certificate_error, first=hop == 0)
        except TimeoutError as e:  # aiohttp's ServerTimeoutError family is a TimeoutError too
            left = self._may_have_left(e)
            return Attempt(Outcome.RETRY, None, error=self._timeout_error(e),
                           kind=ErrorKind.TIMEOUT, unanswered=left,
                           sent_nothing=hop == 0 and not left)
        except aiohttp.ClientConnectorError as e:  # (no connection: nothing was sent)
            kind, error = _connect_error(e, self._proxy)
            return Attempt(Outcome.RETRY, None, error=cfg.redact(error)[:500], kind=kind,
                           sent_nothing=hop == 0)
        except aiohttp.ClientHttpProxyError as e:  # the proxy refused an https:// tunnel
            # (CONNECT): nothing reached the API. A status the config makes fatal (407: the
            # proxy refuses the credentials) halts, as the same answer to an http:// request
            # does; any other is the proxy failing to reach the API, tried again
            fatal = status_class(e.status, cfg) is Outcome.FATAL
            return Attempt(Outcome.FATAL if fatal else Outcome.RETRY, e.status if fatal else None,
                           error=cfg.redact(f"the proxy answered CONNECT with HTTP {e.status} "
                                            f"{e.message}".rstrip())[:300],
                           kind=ErrorKind.HTTP if fatal else ErrorKind.PROXY,
                           sent_nothing=hop == 0)
        except (aiohttp.ClientError, OSError) as e:  # (OSError: a socket error not wrapped)
            if getattr(e, "errno", None) in _OUT_OF_FILES:  # (no socket: nothing was sent)
                return Attempt(Outcome.RETRY, None, error=_out_of_files(e),
                               kind=ErrorKind.LOCAL, sent_nothing=hop == 0)
            left = self._may_have_left(e)
            return Attempt(Outcome.RETRY, None, error=cfg.redact(_describe(e))[:300],
                           kind=ErrorKind.NETWORK, unanswered=left,
                           sent_nothing=hop == 0 and not left)

    def _redirect(self, status: int, location: str, url: URL, headers: Mapping[str, str],
                  hop: int, ours: set[str]) -> Attempt | tuple[URL, Mapping[str, str]]:
        """Where a redirect leads (its URL, and the headers to send there: none secret if to
        another origin, nor a query parameter holding one of ``ours``), or the ``Attempt``
        that ends here: not followed, too many, invalid."""
        cfg = self.config
        # the server's bytes as text that can be stored (not UTF-8: escaped, not surrogates);
        # ``shown``: control characters, a terminal's escapes among them, escaped too
        raw = location.encode("utf-8", "surrogateescape")
        text = raw.decode("utf-8", "backslashreplace")
        shown = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
        if text != location:  # (bytes that are no UTF-8: followed percent-encoded as they came,
            location = quote(raw, safe="!#$%&'()*+,/:;=?@[]~")  # not as their escapes' text)
        try:
            given = URL(location)
            target = url.join(given)
            same = target.origin() == url.origin()
            (target.raw_host or "").encode("idna")  # (an empty or over-long label: invalid)
        except ValueError:  # not a URL, or one without a host (mailto:, data:)
            return Attempt(Outcome.SKIP, status, error=cfg.redact(
                f"redirect to an invalid Location {shown}")[:500], kind=ErrorKind.REDIRECT)
        if given.user is not None or given.password is not None:  # the server's credentials:
            return Attempt(Outcome.SKIP, status, error=cfg.redact(  # never sent (nor shown)
                f"redirect not followed: its Location carries credentials "
                f"({given.with_user(None)})")[:500], kind=ErrorKind.REDIRECT)
        allowed = cfg.follow_redirects == "any" or (
            same and cfg.follow_redirects == "same-origin")
        if not allowed or hop == cfg.max_redirects:
            why = "too many redirects" if allowed else "redirect not followed"
            return Attempt(Outcome.SKIP, status, error=cfg.redact(
                f"{why}: Location {shown}")[:500], kind=ErrorKind.REDIRECT)
        if not same:  # never carry credentials to another origin (nor its Host)
            target = _without_credentials(target, cfg, ours)
            headers = {k: v for k, v in headers.items()
                       if not cfg.is_secret_header(k) and cfg.redact(v) == v
                       and k.lower() != "host"}
        return target, headers

    def _certificate(self, e: BaseException, *, first: bool) -> Attempt:
        code: int | None = getattr(e, "verify_code", None)
        fix = _CERTIFICATE_FIX.get(code, _PRIVATE_CA) if code is not None else _PRIVATE_CA
        return Attempt(Outcome.RETRY, None, error=self.config.redact(
            f"{CERTIFICATE}: {_describe(e)}; {fix}")[:500], kind=ErrorKind.TLS,
            sent_nothing=first)

    def _may_have_left(self, e: BaseException) -> bool:
        """Whether an attempt that failed with ``e`` and no answer may have reached the server
        (possibly billed): it had its connection (a timeout in a DNS lookup, in the wait for
        a pooled connection or in the connect, or a URL aiohttp refuses, sent nothing)."""
        if isinstance(e, (http1.ConnectTimeout, _CONNECT_TIMEOUT)):
            return False
        return _CONNECTED.get() if self._marks else True

    def _timeout_error(self, e: TimeoutError) -> str:
        if isinstance(e, http1.ConnectTimeout):
            return f"timeout: {e}"
        if isinstance(e, _CONNECT_TIMEOUT):
            return f"timeout: no connection within {self.timeout.sock_connect:g}s"
        if isinstance(e, (http1.ReadTimeout, _READ_TIMEOUT)):
            return f"timeout: the server sent nothing for {self.timeout.sock_read:g}s"
        return "timeout"

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The body, or ``None`` when it is larger than ``max_body_bytes`` (after decoding).
        A session that leaves the decoding to this (``new_session``'s) has gzip and deflate
        decoded by ``http1.Inflate``: a stream that does not end whole is an error."""
        limit = self.config.max_body_bytes
        length = resp.content_length
        coding = resp.headers.get("Content-Encoding", "").strip().lower()
        if length is not None:
            if length > limit:
                return None
            if not coding:  # no decompression: cannot grow
                return await resp.read()
        inflate = None
        if coding in ("gzip", "x-gzip", "deflate") and not self.session.auto_decompress:
            inflate = http1.Inflate(coding, limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async for raw in resp.content.iter_any():
                chunk = raw if inflate is None else inflate.feed(raw)
                if chunk is None:
                    return None
                size += len(chunk)
                if size > limit:
                    return None
                chunks.append(chunk)
            if inflate is not None:
                tail = inflate.flush()
                if tail is None:
                    return None
                chunks.append(tail)
        except zlib.error as e:
            raise http1.ProtocolError(f"cannot decode content-encoding {coding}: {e}") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _broken(self, item_id: str, status: int, headers: Mapping[str, str],
                e: BaseException) -> Attempt:
        """An answer whose head came and whose body did not come whole (cut short, the server
        silent, an encoding that does not decode). Its status stands: a 2xx was paid for, an
        answer that cannot be used (bought again at most ``paid_retries`` times), and any
        other is what it says (a 402 halts; a 429 or a 503 waits as its Retry-After asks)."""
        if not 200 <= status < 300:
            return self._classify(item_id, status, headers, b"")
        if isinstance(e, TimeoutError):
            why, kind = self._timeout_error(e), ErrorKind.TIMEOUT
        else:
            why, kind = _describe(e), ErrorKind.NETWORK
        return Attempt(Outcome.RETRY, status, error=self.config.redact(
            f"HTTP {status}, its body not whole: {why}")[:500], billable=True, kind=kind)

    def _classify(self, item_id: str, status: int, headers: Mapping[str, str],
                  body: bytes | None, *, head: bool = False) -> Attempt:
        """The ``Attempt`` an answer makes; ``head``: the answer to a HEAD, whose payload is
        null in every format (it has no body: one that does not parse is none to pay for
        again)."""
        cfg = self.config
        if status == 200 and self._plain_200 and body is not None:  # the common case, in short
            try:
                return Attempt(Outcome.OK, 200, orjson.loads(body), None, None, True, body)
            except orjson.JSONDecodeError:
                pass  # classified below
        if body is None:  # (over the limit: a 2xx is an answer paid for that cannot be used,
            if not 200 <= status < 300:  # any other status is what it says)
                return self._classify(item_id, status, headers, b"")
            return Attempt(Outcome.RETRY, status, error=f"body larger than {cfg.max_body_bytes} "
                           "bytes", billable=True, kind=ErrorKind.TOO_LARGE)
        if body.startswith(codecs.BOM_UTF8) and cfg.response_format != "bytes":  # (some servers'
            body = body[3:]  # UTF-8 begins with one: not JSON, nor text)
        data, body_ok = (None, True) if head else _parse(body, cfg.response_format)
        outcome = status_class(status, cfg)
        effective = status
        if body_ok and cfg.error_field and outcome is Outcome.OK:
            code = _field(data, cfg.error_field)
            if code is not None and not is_success(code, cfg.success_values):
                effective = body_code(code)  # (a 2xx code is a success, as a 2xx status is)
                outcome = status_class(effective, cfg)
        if self.classify is not None:
            verdict = self.classify(Response(item_id, status, CIMultiDict(headers), data, body_ok))
            if verdict is not None:
                try:
                    outcome = Outcome(verdict)
                except (ValueError, TypeError):
                    raise ConfigError(
                        f"classify returned {verdict!r} for ID {item_id!r}: it must return an "
                        "Outcome, 'ok', 'retry', 'skip', 'fatal' or None") from None
        billable = 200 <= status < 300
        if outcome is Outcome.OK:
            if not body_ok:
                return Attempt(Outcome.RETRY, status, error=_unparsable(status, body, cfg),
                               billable=billable, kind=ErrorKind.BODY)
            # the store splices a JSON body in as received; text and bytes go in as strings
            return Attempt(Outcome.OK, status, data=data, billable=billable,
                           body=body if cfg.response_format == "json" and not head else None)
        error = f"HTTP {effective}" if effective == status else f"HTTP {status}, body code {effective}"
        kind = ErrorKind.HTTP
        # (a 2xx too, whose body code or classify hook says to retry: a 429 in the body with
        # its Retry-After was retried after the backoff's fraction of a second)
        retry_after = parse_retry_after(headers.get("Retry-After"), date=headers.get("Date")) \
            if status >= 300 or outcome is Outcome.RETRY else None
        if not body_ok and 200 <= status < 300:
            error, kind = _unparsable(status, body, cfg), ErrorKind.BODY
        return Attempt(outcome, effective, error=error, retry_after=retry_after, billable=billable,
                       kind=kind)


def _parse(body: bytes, fmt: str) -> tuple[Any, bool]:
    """The payload of a body in the configured ``[response] format``, and whether it parsed:
    ``json`` (the parsed value), ``text`` (UTF-8 text) or ``bytes`` (base64, always parses)."""
    if fmt == "json":
        try:
            return parse_json(body), True  # (exact: what orjson refuses of JSON, big integers)
        except ValueError:
            return None, False
    if fmt == "text":
        try:
            return body.decode("utf-8"), True
        except UnicodeDecodeError:
            return None, False
    return base64.b64encode(body).decode("ascii"), True


def _unparsable(status: int, body: bytes, cfg: Config) -> str:
    what = "valid JSON" if cfg.response_format == "json" else "UTF-8 text"
    size = "empty" if not body else f"{len(body):,} bytes"
    return f"2xx body is not {what}: HTTP {status}, {size} ([response] format = {cfg.response_format})"


def _ours(url: URL, headers: Mapping[str, str], body: Any, data: bytes | None,
          cfg: Config) -> set[str]:
    """The credentials a request carried as written (a literal key, not only ``${ENV}``
    values): the values of its secret-named query parameters, form fields and JSON fields
    (at any depth), and of its secret headers, with a header's token (``Bearer <token>``)."""
    ours = {v for k, v in url.query.items() if cfg.is_secret_param(k)}
    for k, v in headers.items():
        if cfg.is_secret_header(k):
            ours.update((v, *v.split()[-1:]))
    if data:  # (a form body: its fields; any other text has no names to go by)
        with contextlib.suppress(ValueError):
            ours.update(v for k, v in parse_qsl(data.decode("utf-8", "replace"))
                        if cfg.is_secret_param(k))
    todo = [body]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str | int) and not isinstance(v, bool) \
                        and cfg.is_secret_param(str(k)):
                    ours.add(str(v))
                todo.append(v)
        elif isinstance(node, list):
            todo.extend(node)
    ours.discard("")
    return ours


def _without_credentials(url: URL, cfg: Config, ours: set[str]) -> URL:
    """``url`` (another origin's, from a ``Location``) minus userinfo and every query parameter
    that carries a credential of ours, under any name: a secret value (``${ENV}``, an API key)
    or one of ``ours`` (a server may echo the request's query, ``api_key`` included, into a
    ``Location``). A secret-named parameter whose value is the server's own (a presigned URL's
    ``X-Amz-Signature``) is that URL's, and goes along: dropped, the URL answered 403."""
    if url.user is not None or url.password is not None:
        url = url.with_user(None)
    if url.query_string:
        keep = [(k, v) for k, v in url.query.items()
                if not (v in ours and (len(v) >= MIN_SECRET_LENGTH or cfg.is_secret_param(k)))
                and cfg.redact(f"{k}={v}") == f"{k}={v}"]  # (a short one: by its name too)
        if len(keep) != len(url.query):
            url = url.with_query(keep)
    return url


# aiohttp >= 3.10 tells the connect and the read timeout apart (older ones: "timeout")
_CONNECT_TIMEOUT: Any = getattr(aiohttp, "ConnectionTimeoutError", ())
_READ_TIMEOUT: Any = getattr(aiohttp, "SocketTimeoutError", ())


RESEND_WARNING = (
    "the injected aiohttp session resends a GET/HEAD/PUT once, silently, when a connection drops "
    "before the answer (aiohttp's retry of persistent connections): such a resend has no 'sent' "
    "record of its own, may be billed twice and is missing from the in-doubt list. Build the "
    "session with asyncrawl.new_session(config), or let the Crawler create its own")


def keep_reads_off_mmap() -> None:
    """asyncio's socket reads from the C allocator's heap, not by ``mmap``, and large bodies
    by ``mmap`` again once freed (``alloc.fix_mmap_threshold``)."""
    fix_mmap_threshold()


# set by ``Connector`` once an attempt has its connection (the attempt's own context: the
# connect is awaited in the worker's task)
_CONNECTED: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncrawl_connected",
                                                                  default=False)


class Connector(aiohttp.TCPConnector):
    """aiohttp's connector, saying when an attempt has its connection: what fails before that
    sent nothing; what fails after it without an answer may have reached the server."""

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        for _ in range(3):  # (a few: a server that talks first on a new one fails anyway)
            if conn.protocol is None or not conn.protocol.should_close:
                break
            # a pooled connection that holds bytes nobody asked for (an answer the server sent
            # while it was idle): aiohttp would hand them to this request as its answer, and
            # each later answer on it to the request after (aio-libs/aiohttp#13656)
            conn.close()
            conn = await super().connect(req, traces, timeout)
        _CONNECTED.set(True)
        return conn


def new_session(config: Config) -> aiohttp.ClientSession:
    """The session a ``Crawler`` creates for itself: at most ``concurrency`` connections, no
    cookie jar (a cookie one origin sets must never travel to another), and no silent resend.

    NOTE: aiohttp resends an idempotent request once when a connection drops before the answer
    (RFC 9112 §9.3.1 allows it; ``ClientSession._retry_connection``, which aiohttp's own test
    client switches off the same way). For a paid API that is a second call that nobody
    recorded: every request that leaves asyncrawl has its durable ``sent`` record, and a drop
    is a retryable failure decided by asyncrawl's own policy instead. Pass the result as
    ``Crawler(config, session=...)`` to share one session and keep that guarantee. Its
    answers' bodies come as sent (``auto_decompress=False``): asyncrawl decodes gzip and
    deflate itself (``Fetcher._read``); an application's own requests through it get them
    encoded."""
    connector = Connector(limit=config.concurrency, ttl_dns_cache=300)
    # (bodies decoded by ``Fetcher._read``, as asyncrawl's own client does: aiohttp's decoder
    # takes a gzip stream cut short, or without its end, for a whole body)
    session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                    auto_decompress=False,
                                    headers={"Accept-Encoding": "gzip, deflate"})
    session._retry_connection = False
    return session


def connection_limit(session: aiohttp.ClientSession) -> int | None:
    """The most connections ``session`` opens to one host at once (``None``: no limit)."""
    connector = session.connector
    limits = [n for n in (getattr(connector, "limit", 0), getattr(connector, "limit_per_host", 0))
              if n]
    return min(limits) if limits else None


def resends_silently(session: aiohttp.ClientSession) -> bool:
    """Whether ``session`` would resend a request once on a dropped connection (see
    :func:`new_session`)."""
    return bool(getattr(session, "_retry_connection", False))


def env_proxy(url_template: str) -> str | None:
    """The proxy that ``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``ALL_PROXY`` name for the template's
    scheme, unless ``NO_PROXY`` exempts its host (as curl and pip read them). Read once per
    run, not per request: aiohttp's ``trust_env`` would scan the environment and read
    ``~/.netrc`` for every request."""
    parts = urlsplit(url_template.replace("{id}", "x"))
    proxies = urllib.request.getproxies_environment()
    if not parts.hostname or _bypassed(parts.hostname, proxies):
        return None
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if proxy and not _is_http_url(proxy):  # (not shown: it may hold a password)
        raise ConfigError(f"the proxy that {parts.scheme.upper()}_PROXY (or ALL_PROXY) names in "
                          "the environment is not an http:// or https:// URL with a host (and "
                          "a port 1-65535): fix it, or unset it")
    return proxy


def _bypassed(host: str, proxies: Mapping[str, str]) -> bool:
    """Whether ``NO_PROXY`` exempts ``host``: the stdlib's match of names, domains and
    addresses, and, as curl and pip do, an IP address within a range listed in CIDR form
    (``10.0.0.0/8``), which the stdlib ignores."""
    if urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return True  # (the stdlib's, which typeshed does not list)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in proxies.get("no", "").split(","):
        try:
            if ip in ipaddress.ip_network(entry.strip().strip("[]"), strict=False):
                return True
        except ValueError:
            continue
    return False


def client_timeout(config: Config) -> aiohttp.ClientTimeout:
    """``timeout`` bounds the whole attempt (connect, headers, body); ``connect_timeout``
    (default: 10 s, at most ``timeout``) the TCP/TLS connect; ``read_timeout`` how long the server
    may stay silent, before the first byte of the answer or in the middle of its body (default:
    none of its own: the total bounds a silent server too)."""
    connect = config.connect_timeout if config.connect_timeout is not None else 10.0
    read = config.read_timeout
    return aiohttp.ClientTimeout(
        total=config.timeout, sock_connect=min(connect, config.timeout),
        sock_read=read if read is not None and read < config.timeout else None)


def tls_context(config: Config) -> ssl.SSLContext | bool:
    """What to pass as aiohttp's ``ssl=``: ``True`` (verify against the system's CAs), a context
    that trusts the system's CAs *plus* ``ca_bundle``, or ``False`` when ``verify_tls`` is off."""
    if not config.verify_tls:
        return False
    if not config.ca_bundle:
        return True
    ctx = ssl.create_default_context()  # the system's trust store ...
    try:  # ... plus the bundle (checked by Config; it may have gone since)
        if os.path.isdir(config.ca_bundle):
            ctx.load_verify_locations(capath=config.ca_bundle)
        else:
            ctx.load_verify_locations(cafile=config.ca_bundle)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load CA bundle {config.ca_bundle} ({e.__class__.__name__})",
                          key="request.ca_bundle") from None
    return ctx


CERTIFICATE = "TLS certificate verification failed"
_PRIVATE_CA = "if the server uses a private CA, add it with [request] ca_bundle"
# the fix of a certificate that verifies but for the reason its OpenSSL code says (else a CA
# this machine does not trust: _PRIVATE_CA)
_CLOCK = "check the server's certificate, and this machine's clock"
_CERTIFICATE_FIX = {
    9: _CLOCK,  # X509_V_ERR_CERT_NOT_YET_VALID
    10: _CLOCK,  # X509_V_ERR_CERT_HAS_EXPIRED
    62: "the certificate is for another host: check the host of [request] url",  # a name's
    64: "the certificate is for another host: check the host of [request] url",  # an address's
}

# Errors that waiting cannot cure when they come before any answer: the fix for each.
INCURABLE = {
    ErrorKind.REFUSED: "nothing listens at that address: check the host and port of "
                       "[request] url (or --url), and that the server is up",
    ErrorKind.DNS: "check the host name of [request] url (or --url), and the machine's DNS",
    ErrorKind.PROXY: "check [request] proxy (or --proxy), or the HTTP_PROXY / HTTPS_PROXY / "
                     "NO_PROXY environment variables, which asyncrawl follows like curl",
    ErrorKind.TLS: "check the scheme and host name of [request] url (https:// to a server that "
                   "speaks plain HTTP fails so), and the fix the error names",
}
# Skip-class answers that, given for every request from the first on, say the job cannot work
# (not that those IDs are missing): what to fix. ``run`` halts on them (``REFUSED_AFTER``).
REFUSING = {
    403: "the API forbids these requests: check the API key, its permissions and the URL",
    405: "the API does not take this method there: check [request] method and url",
}


_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def _out_of_files(err: BaseException) -> str:
    return (f"too many open files on this machine ({_describe(err)}): the try waits for "
            "connections to close (raise `ulimit -n`, or lower [limits] concurrency)")


def _connect_error(e: aiohttp.ClientConnectorError | http1.ConnectError,
                   proxy: str | None) -> tuple[ErrorKind, str]:
    """A connect failure's kind, in words an operator acts on: ``connection refused to
    host:port``, ``name host does not resolve``; else the exception as usual. ``proxy``: the
    proxy the request went through, if any."""
    err = e.os_error
    if getattr(err, "errno", None) in _OUT_OF_FILES:
        return ErrorKind.LOCAL, _out_of_files(err)
    if isinstance(e, aiohttp.ClientProxyConnectionError):
        return ErrorKind.PROXY, f"cannot connect to the proxy {e.host}:{e.port} ({_describe(err)})"
    if isinstance(err, socket.gaierror) or type(e).__name__ == "ClientConnectorDNSError":
        if proxy is not None and e.host == urlsplit(proxy).hostname:  # (aiohttp says DNS)
            return ErrorKind.PROXY, f"the proxy's name {e.host} does not resolve"
        return ErrorKind.DNS, f"name {e.host} does not resolve"
    if isinstance(err, ConnectionRefusedError) or getattr(err, "errno", None) == errno.ECONNREFUSED:
        return ErrorKind.REFUSED, f"connection refused to {e.host}:{e.port}"
    if isinstance(err, ssl.SSLError) and not isinstance(err, _SSL_CUT_OFF):
        # the two ends do not speak TLS alike: https:// to a plain-HTTP port (wrong version
        # number), no protocol version or cipher in common; not a connection cut short
        return ErrorKind.TLS, f"TLS handshake with {e.host}:{e.port} failed ({_describe(err)})"
    return ErrorKind.NETWORK, _describe(e)


# a handshake cut off (the peer closed or reset it): as a dropped connection, not a TLS error
_SSL_CUT_OFF = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BREAK = re.compile(r"[\r\n\x00]")  # (what a header value cannot hold)


def _checked(req: Request, item_id: str) -> tuple[URL, Mapping[str, str]]:
    """A ``request_for`` hook's request, checked before its intent is written (what no
    request could carry raised in the client after it: the ID was left in doubt, and the run
    ended with exit 1): its URL (a ``URL``) and headers; else ``ConfigError``."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"request_for returned a Request for ID {item_id!r} with {what}")

    if not isinstance(req.method, str) or not _TOKEN(req.method):
        raise bad(f"the method {req.method!r:.40}")
    try:
        url = req.url if isinstance(req.url, URL) else URL(req.url)
    except (TypeError, ValueError):
        raise bad(f"the URL {req.url!r:.60}, which is not one") from None
    if url.scheme not in ("http", "https") or not url.raw_host:
        raise bad("a URL that is not http:// or https:// with a host")
    headers = req.headers
    if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and _TOKEN(k) and isinstance(v, str) and not _BREAK.search(v)
            for k, v in headers.items()):
        raise bad("headers that are not header names and text values (no line breaks)")
    if url.user is not None and any(k.lower() == "authorization" for k in headers):
        raise bad("a user and password in the URL and an Authorization header")
    if req.json is not None:
        try:  # (as both clients send it: the standard library's json)
            json.dumps(req.json, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise bad(f"a json body that is not JSON ({e})") from None
    return url, headers


def _describe(e: BaseException) -> str:
    """An exception as an error's text, whole: cut to length only once redacted (a secret
    the cut went through no longer matched, and its first part was kept in clear)."""
    text = str(e)
    name = type(e).__name__
    return f"{name}: {text}" if text else name

