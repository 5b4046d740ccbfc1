"""A lean HTTP/1.1 client: keep-alive connections on asyncio's protocol API, answers parsed by
aiohttp's own parser (llhttp, Node.js's parser, in aiohttp's compiled extension).

aiohttp's client spends ~75-100 µs of CPU on a request here, most of it in machinery a crawl
does not use per request (``bench/throughput.py``); this one ~25 µs on asyncio's loop, less on
uvloop's. It does only what ``fetch.Fetcher`` asks of its own sessions: one request at a time
per connection, the whole answer read before it returns (bounded by ``limit`` after
decompression), ``gzip`` and ``deflate`` decoded, and three timeouts (connect, silence, total).
No proxy, no HEAD, no cookies, no redirects (the fetcher follows those itself):
``Client.serves`` says which requests it takes; the rest go through aiohttp's client, and so
does a crawl when ``ASYNCRAWL_HTTP=aiohttp``, when the application passed its own session, or
when aiohttp runs without its compiled extension (``COMPILED``).

Failures are its own exceptions, which ``fetch`` classifies: ``ConnectError`` and
``ConnectTimeout`` sent nothing; every other failure came after the request had its
connection, so it may have reached the server.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json as stdjson
import math
import os
import re
import socket
import ssl
import sys
import time
import zlib
from collections.abc import Mapping
from typing import Any

import aiohappyeyeballs
from aiohttp import http_parser
from aiohttp.http_exceptions import LineTooLong
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ._version import __version__
from .errors import ConfigError

CHOICES = ("auto", "aiohttp")
HttpResponseParser = http_parser.HttpResponseParser  # (aiohttp's compiled one where it has it)
# crawls send through this client where aiohttp has its compiled parser; without it (no wheel
# for the platform, AIOHTTP_NO_EXTENSIONS) through aiohttp's client, whose answers that same
# pure-Python parser reads: older versions of it fail on trailers and other transfer codings
COMPILED = HttpResponseParser is not http_parser.HttpResponseParserPy
KEEPALIVE = 15.0  # seconds an idle connection is kept (aiohttp's default too)
DNS_TTL = 300.0  # seconds a host's addresses are kept (as the fetcher's aiohttp session does)
HAPPY_EYEBALLS = 0.25  # seconds before the next address is tried beside (RFC 8305; aiohttp's)
MAX_HEAD = 64 * 1024  # bytes: an answer's head, and its trailers (a normal head is < 2 KiB);
#                        checked once per read, so a read that ends the head may pass it
MAX_FIELD = 8190  # bytes: one header, name and value (aiohttp's limit too)
USER_AGENT = f"asyncrawl/{__version__} Python/{sys.version_info[0]}.{sys.version_info[1]}"
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]").search
_BAD_FIELD = re.compile(r"[\r\n\x00]").search
_STREAM_LIMIT = 2**30  # bytes the parser's body stream may hold before it asks for a pause:
#                        never (each read is taken from it at once, and ``limit`` bounds it)
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
_DEFAULTS = (("user-agent", "User-Agent", USER_AGENT), ("accept", "Accept", "*/*"),
             ("accept-encoding", "Accept-Encoding", "gzip, deflate"))


class ConnectError(OSError):
    """No connection to ``host:port`` (``os_error`` says why): nothing was sent."""

    def __init__(self, host: str, port: int, os_error: BaseException) -> None:
        super().__init__(f"cannot connect to {host}:{port} ({os_error.__class__.__name__}: "
                         f"{os_error})")
        self.host, self.port, self.os_error = host, port, os_error


class ConnectTimeout(TimeoutError):
    """No connection within ``after`` seconds (the connect timeout, or what the total left):
    nothing was sent."""

    def __init__(self, after: float) -> None:
        super().__init__(f"no connection within {after:g}s" if after != math.inf
                         else "no connection (the system's connect timeout)")
        self.after = after


class ReadTimeout(TimeoutError):
    """The server stayed silent for the read timeout, before or within its answer."""


class Disconnected(ConnectionError):
    """The server closed the connection before its answer was complete."""


class ProtocolError(OSError):
    """The answer is not HTTP/1.1 this client reads (malformed, an upgrade, a bad encoding)."""


class BrokenAnswer(OSError):
    """An answer's head came (``status``, ``headers``), and its body did not come whole:
    ``cause`` says why (cut short, the server silent, an encoding that does not decode)."""

    def __init__(self, status: int, headers: CIMultiDictProxy[str], cause: OSError) -> None:
        super().__init__(str(cause))
        self.status, self.headers, self.cause = status, headers, cause


def wanted() -> bool:
    """Whether crawls use this client: ``ASYNCRAWL_HTTP`` is ``auto`` (or unset) and aiohttp has
    its compiled parser; ``aiohttp`` keeps aiohttp's client for every request. (``httptools``,
    which named this client while it parsed with httptools, still means ``auto``.)"""
    choice = os.environ.get("ASYNCRAWL_HTTP", "").strip().lower() or "auto"
    if choice not in CHOICES and choice != "httptools":
        raise ConfigError(f"ASYNCRAWL_HTTP must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice != "aiohttp" and COMPILED


class Answer:
    """One answer: its status, headers (as the parser made them, case-insensitive) and body
    (``None``: larger than the limit)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: CIMultiDictProxy[str], body: bytes | None) -> None:
        self.status, self.headers, self.body = status, headers, body


class Inflate:
    """``gzip`` / ``deflate`` decoding bounded by ``limit`` bytes of output (a bomb stops
    there). ``deflate`` is zlib-wrapped by the RFC and raw from some servers: the first byte
    tells which (as aiohttp reads it). A gzip body may hold several members (RFC 1952 §2.2).
    Other bytes after the end of the stream, or a stream that ends early, are an error
    (``zlib.error``); an empty body is empty."""

    __slots__ = ("_d", "gzip", "limit", "size")

    def __init__(self, encoding: str, limit: int) -> None:
        self.gzip = encoding in ("gzip", "x-gzip")
        self._d: Any = None  # (made on the first byte)
        self.limit, self.size = limit, 0

    def feed(self, data: bytes) -> bytes | None:
        """The decoded bytes (``None``: the limit is passed). Raises ``zlib.error``."""
        out: list[bytes] = []
        while data:
            if self._d is None:  # deflate's first byte: a zlib header (CM = 8), else raw
                self._d = zlib.decompressobj(
                    16 + zlib.MAX_WBITS if self.gzip
                    else zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS)
            elif self._d.eof:
                if not (self.gzip and data[0] == 0x1F):  # (0x1f: another member's magic)
                    raise zlib.error("data after the end of the compressed stream")
                self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            piece = self._d.decompress(data, self.limit - self.size + 1)
            self.size += len(piece)
            if self.size > self.limit or self._d.unconsumed_tail:
                return None
            out.append(piece)
            data = self._d.unused_data
        return out[0] if len(out) == 1 else b"".join(out)

    def flush(self) -> bytes | None:
        if self._d is None:  # (an empty body)
            return b""
        out = self._d.flush()
        if not self._d.eof:
            raise zlib.error("the compressed stream ends early")
        self.size += len(out)
        return None if self.size > self.limit else out


class _Connection(asyncio.Protocol):
    """One keep-alive connection: sends a request, parses its answer, resolves the waiter."""

    _reading_paused = False  # (read by aiohttp's body stream: a read is drained at once, so
    #                           its flow control has nothing to do: see ``pause_reading``)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None  # (aiohttp's, one for each answer: ``send``)
        self.waiter: asyncio.Future[Answer] | None = None
        self.closed = False  # the connection is gone (or going)
        self.reusable = False  # the last answer left it fit for another request
        self.idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = math.inf
        self._silence: float | None = None
        self._last = 0.0
        self._limit = 0
        # the answer's body as the parser feeds it (a StreamReader): there once its head is
        self._payload: Any = None
        self._headers: CIMultiDictProxy[str] = _NO_HEADERS
        self._chunks: list[bytes] = []
        self._size = 0
        self._status = 0
        self._encoding = ""
        self._inflate: Inflate | None = None
        self._keep_alive = False
        self._head_bytes = 0
        self._fed_body = False

    # -- asyncio's callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self._last = self.loop.time()
        self._fed_body, head_before = False, self._payload is None
        try:
            messages, _, _ = self.parser.feed_data(data)
            for message, payload in messages:
                if self._payload is not None:  # (the answer before this head is whole: its
                    self._read_body()          # body first, before this head replaces it)
                if self.waiter is None:  # a second answer in the bytes of the first
                    self.close()
                    return
                self._begin(message, payload)
            if self._payload is not None:
                self._read_body()
        except ProtocolError as e:
            self._fail(e)
            return
        except Exception as e:  # the parser's (aiohttp's ``BadHttpMessage`` family)
            if self._whole():  # bytes that are no answer after one that is whole: it is kept,
                return         # the connection is not
            if head_before and not self._head_bytes and self._apart(data):
                return
            if isinstance(e, LineTooLong):
                why = f"a header over {MAX_FIELD} bytes (or the status line): not read"
            else:
                why = " ".join(str(getattr(e, "message", None) or e).split())  # (one line)
                why = f"invalid HTTP answer: {e.__class__.__name__}: {why}"
            self._fail(ProtocolError(why))
            return
        if self.waiter is None:
            return
        # the parser buffers a header (or a trailer) before it hands it over, each up to
        # MAX_FIELD: reads are counted too, the head's, then after it those with no body byte
        trailers = self._payload is not None
        if trailers and (self._fed_body or head_before):  # (the read that ended the head was
            self._head_bytes = 0                           # counted as the head's)
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD:
            what = "trailers" if trailers else "a head"
            self._fail(ProtocolError(f"{what} over {MAX_HEAD} bytes"
                                     f"{'' if trailers else ' (status line and headers)'}: "
                                     "not read"))

    def eof_received(self) -> bool:
        self.closed = True  # (before connection_lost, a turn later: not to be taken again)
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None:
            return
        headed = self._payload is not None
        if exc is None and headed:  # the parser tells whether the close ends the body (HTTP/1.0
            try:                    # style) or cuts it short (a length or chunks not whole)
                self.parser.feed_eof()
                self._read_body()
            except ProtocolError as e:
                self._fail(e)
                return
            except Exception:  # (the parser's: cut short, below)
                pass
            if self.waiter is None:
                return
        what = "while sending its answer" if headed else "before answering"
        self._fail(Disconnected(f"the server closed the connection {what}"
                                + (f" ({exc})" if exc else "")))

    # -- aiohttp's body stream calls these; a read is drained at once -------------------------

    def pause_reading(self, *_: Any, **__: Any) -> None:
        pass

    def resume_reading(self, *_: Any, **__: Any) -> None:
        pass

    # -- an answer, as the parser hands it over ------------------------------------------------

    def _begin(self, message: Any, payload: Any) -> None:
        """A head is parsed: ``message`` (aiohttp's ``RawResponseMessage``) and its body's
        stream."""
        status = message.code
        if 100 <= status < 200:  # an interim answer (103 Early Hints): the real one follows
            if status == 101 or message.upgrade:
                raise ProtocolError("the server switched protocols")
            return
        headers = message.headers
        self._status, self._headers, self._head_bytes = status, headers, 0
        self._keep_alive, self._payload = not message.should_close, payload
        try:  # (the parser delimits the body; this is for the limit before it comes)
            length = int(headers.get("Content-Length", ""))
        except ValueError:
            length = None
        if status in (204, 304):
            length = 0
        if length is not None and length > self._limit:
            self._too_large()
            return
        self._encoding = headers.get("Content-Encoding", "").strip().lower()
        if self._encoding in ("gzip", "x-gzip", "deflate") and length != 0:
            self._inflate = Inflate(self._encoding, self._limit)
        # (another coding was not asked for: its body is kept as it came, as aiohttp does)

    def _read_body(self) -> None:
        """Take what the parser has fed the body's stream; the answer is whole at its end."""
        payload = self._payload
        if self.waiter is None or payload is None:
            return
        body = payload.read_nowait()  # (raises what the parser found wrong in the body)
        if body:
            self._fed_body = True
            if self._inflate is not None:
                try:
                    out = self._inflate.feed(body)
                except zlib.error as e:
                    raise self._undecodable(e) from None
                if out is None:
                    self._too_large()
                    return
                if out:
                    self._chunks.append(out)
            else:
                self._size += len(body)
                if self._size > self._limit:
                    self._too_large()
                    return
                self._chunks.append(body)
        if payload.is_eof():
            self.reusable = self._keep_alive and not self._stray()
            self._complete()

    def _stray(self) -> bool:
        """Whether bytes after the answer began another one, which nobody asked for: the
        parser's end then hands a head over (or fails on it). The connection is not used
        again: the rest of that head would be read as the start of the next answer."""
        try:
            return self.parser.feed_eof() is not None
        except Exception:
            return True

    def _whole(self) -> bool:
        """Whether the answer was whole before the parser failed on what followed it (a 204 or
        a 304 with a body, bytes beyond ``Content-Length``): then it resolves, and the
        connection is not used again. (Where its head came in the same read as what broke
        the parser, the parser never handed it over: ``_apart``.)"""
        if self.waiter is None or self._payload is None or not self._payload.is_eof():
            return False
        self._keep_alive = False
        try:
            self._read_body()
        except ProtocolError as e:
            self._fail(e)
        return True

    def _apart(self, data: bytes) -> bool:
        """The parser failed on the answer's first read before it handed its head over, and
        that read holds a whole head and more: the head is parsed again by itself, with a new
        parser, then the rest, so that a whole answer followed by bytes that are none (a
        ``Content-Length`` counted in characters, not bytes) is kept (``_whole``), as it is
        when those bytes come in a read of their own. Else the paid answer was lost: no
        status, taken for a call with no answer, and bought again past ``paid_retries``."""
        end = data.find(b"\r\n\r\n") + 4
        if not 4 <= end < len(data):
            return False
        self.parser = self._parser()
        self.data_received(data[:end])
        self.data_received(data[end:])  # (the answer whole already: bytes nobody asked for,
        return True                     # and the connection is closed, not used again)

    def _parser(self) -> Any:
        return HttpResponseParser(
            self,  # type: ignore[arg-type]  # (it calls only what a _Connection has)
            self.loop, _STREAM_LIMIT, max_line_size=MAX_FIELD, max_field_size=MAX_FIELD,
            read_until_eof=True, auto_decompress=False)  # (gzip and deflate: ``Inflate``)

    # -- one exchange --------------------------------------------------------------------------

    def send(self, payload: bytes, limit: int, deadline: float,
             silence: float | None) -> asyncio.Future[Answer]:
        """Write one request; the future resolves with its answer or fails."""
        self.waiter = waiter = self.loop.create_future()
        # a parser for each answer: what the last one holds (a stray head's start) is not read
        # as the start of this one
        self.parser = self._parser()
        self.reusable, self._limit, self._deadline, self._silence = False, limit, deadline, silence
        self._headers, self._chunks, self._size, self._payload = _NO_HEADERS, [], 0, None
        self._encoding, self._inflate = "", None
        self._keep_alive = False
        self._head_bytes = 0
        self._last = now = self.loop.time()
        due = min(deadline, now + silence) if silence is not None else deadline
        if due != math.inf:
            self._timer = self.loop.call_at(due, self._on_timer)
        self.transport.write(payload)  # type: ignore[union-attr]
        return waiter

    def head(self) -> tuple[int, CIMultiDictProxy[str]] | None:
        """The status and headers of the answer under way, once its head has come."""
        return (self._status, self._headers) if self._payload is not None else None

    def _on_timer(self) -> None:
        self._timer = None
        if self.waiter is None:
            return
        now = self.loop.time()
        if now >= self._deadline:
            self._fail(TimeoutError())
            return
        if self._silence is not None:
            if now >= self._last + self._silence:
                self._fail(ReadTimeout())
                return
            due = min(self._deadline, self._last + self._silence)
        else:
            due = self._deadline
        self._timer = self.loop.call_at(due, self._on_timer)

    def _undecodable(self, e: zlib.error) -> ProtocolError:
        return ProtocolError(f"cannot decode content-encoding {self._encoding}: {e}")

    def _complete(self) -> None:
        if self._inflate is not None:
            try:
                tail = self._inflate.flush()
            except zlib.error as e:
                self._fail(self._undecodable(e))
                return
            if tail is None:
                self._too_large()
                return
            self._chunks.append(tail)
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._resolve(Answer(self._status, self._headers, body))

    def _too_large(self) -> None:
        """The body passes the limit: the answer without it; the rest is not read."""
        self.reusable = False
        self._resolve(Answer(self._status, self._headers, None))
        self.close()

    def _resolve(self, answer: Answer) -> None:
        waiter, self.waiter = self.waiter, None
        self._stop_timer()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        self._stop_timer()
        self.reusable = False
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()


def tls(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    """The TLS context for ``Fetcher``'s ``ssl`` setting: ``True`` the system's CAs, ``False``
    no verification, or the context itself."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    ctx = ssl.create_default_context()
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]


class Client:
    """Keep-alive connections to any number of origins, at most ``limit`` idle per origin,
    each idle for at most ``KEEPALIVE`` seconds. ``close`` closes the idle ones; a request in
    flight closes its own when it ends."""

    def __init__(self, *, limit: int, verify: ssl.SSLContext | bool = True) -> None:
        self.limit = limit
        self._verify = verify
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[tuple[bool, str, int], list[_Connection]] = {}
        self._addresses: dict[tuple[str, int], tuple[float, list[AddrInfo]]] = {}
        # lookups under way, each shared by every connect that needs it meanwhile
        self._lookups: dict[tuple[str, int], asyncio.Task[list[AddrInfo]]] = {}
        self._fixed: dict[int, tuple[Mapping[str, str], str]] = {}
        self._closed = False

    @staticmethod
    def serves(method: str, url: URL) -> bool:
        """Whether this client takes the request (else: aiohttp)."""
        return url.scheme in ("http", "https") and method.upper() != "HEAD" \
            and bool(url.raw_host)

    async def request(self, method: str, url: URL, headers: Mapping[str, str], *,
                      json: Any = None, data: bytes | None = None, limit: int,
                      total: float | None = None, connect: float | None = None,
                      silence: float | None = None, fixed: bool = False) -> Answer:
        """Send one request and read its whole answer (``body`` ``None``: over ``limit``
        bytes). ``total`` bounds it all, ``connect`` a new connection, ``silence`` how long
        the server may send nothing. ``fixed``: ``headers`` never change (the config's: their
        lines are made once)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total if total else math.inf
        payload = self._head(method.upper(), url, headers, data, json, fixed)
        secure = url.scheme == "https"
        key = (secure, url.raw_host or "", url.port or (443 if secure else 80))
        conn = self._take(key, loop.time())
        if conn is None:
            conn = await self._connect(loop, key, connect, deadline)
        try:
            answer = await conn.send(payload, limit, deadline, silence)
        except OSError as e:  # (TimeoutError, Disconnected, ProtocolError)
            conn.close()
            head = conn.head()
            if head is None:
                raise
            raise BrokenAnswer(*head, e) from e
        except BaseException:
            conn.close()
            raise
        if conn.reusable and not conn.closed and not self._closed:
            conn.idle_since = loop.time()
            idle = self._idle.setdefault(key, [])
            idle.append(conn)
            if len(idle) > self.limit:  # (the closed first, then the longest idle)
                idle[:] = [c for c in idle if not c.closed]
                while len(idle) > self.limit:
                    idle.pop(0).close()
        else:
            conn.close()
        return answer

    def close(self) -> None:
        """Close every idle connection, and stop the lookups under way; requests in flight
        close theirs as they end."""
        self._closed = True
        for lookup in self._lookups.values():
            lookup.cancel()
        self._lookups.clear()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    # -- the pieces ----------------------------------------------------------------------------

    def _take(self, key: tuple[bool, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE \
                    and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
            conn.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, key: tuple[bool, str, int],
                       connect: float | None, deadline: float) -> _Connection:
        """A new connection: the host's addresses (cached ``DNS_TTL``), tried as RFC 8305's
        happy eyeballs do (aiohappyeyeballs, as aiohttp does), then TLS for https."""
        secure, host, port = key
        budget = min(connect or math.inf, deadline - loop.time())
        ctx = None
        if secure:
            if self._tls is None:
                self._tls = tls(self._verify)
            ctx = self._tls
        try:
            async with asyncio.timeout(budget if budget != math.inf else None):
                infos = await self._resolve(loop, host, port)
                sock = await aiohappyeyeballs.start_connection(
                    infos, happy_eyeballs_delay=HAPPY_EYEBALLS, loop=loop)
                try:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop), sock=sock, ssl=ctx,
                        server_hostname=host if secure else None)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError:  # (the budget's, or the kernel's connect timeout)
            raise ConnectTimeout(max(budget, 0.0)) from None
        except UnicodeError as e:  # a name IDNA refuses (an empty or over-long label)
            raise ConnectError(host, port, socket.gaierror(socket.EAI_NONAME, str(e))) from None
        except (OSError, ssl.SSLError) as e:  # (gaierror, refused, a failed handshake ...)
            raise ConnectError(host, port, e) from None
        return conn

    async def _resolve(self, loop: asyncio.AbstractEventLoop, host: str,
                       port: int) -> list[AddrInfo]:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:  # (no lookup, and no thread for one)
            if ip.version == 6:
                return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                         (host, port, 0, 0))]
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        key = (host, port)
        cached = self._addresses.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        lookup = self._lookups.get(key)
        if lookup is None:  # one lookup for all the connects that wait for it, as aiohttp's
            lookup = self._lookups[key] = loop.create_task(  # (owned: ``close`` cancels it)
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))  # type: ignore[arg-type]
            lookup.add_done_callback(lambda done: self._looked_up(key, done))
        return await asyncio.shield(lookup)  # (a connect that gives up leaves it to the rest)

    def _looked_up(self, key: tuple[str, int], lookup: asyncio.Task[list[AddrInfo]]) -> None:
        """A lookup ended: its addresses are kept ``DNS_TTL`` seconds (a failure is not)."""
        if self._lookups.get(key) is lookup:
            del self._lookups[key]
        if not lookup.cancelled() and lookup.exception() is None:
            self._addresses[key] = (time.monotonic() + DNS_TTL, lookup.result())

    def _head(self, method: str, url: URL, headers: Mapping[str, str], data: bytes | None,
              json: Any, fixed: bool) -> bytes:
        """The request's bytes: request line, headers (UTF-8, as aiohttp sends them), body."""
        target = url.raw_path_qs or "/"
        if _BAD_TARGET(target) or _BAD_TARGET(method):
            raise ValueError(f"a request target or method with a space or control character: "
                             f"{method!r}")
        if fixed:
            cached = self._fixed.get(id(headers))
            if cached is None or cached[0] is not headers:
                cached = self._fixed[id(headers)] = (headers, _fields(headers))
            fields = cached[1]
        else:
            fields = _fields(headers)
        if not fields.startswith("\r\nHost:"):
            fields = f"\r\nHost: {_host(url)}{fields}"
        if url.raw_user is not None:
            if "\nauthorization:" in fields.lower():
                raise ValueError("an Authorization header and credentials in the URL: one or "
                                 "the other")
            fields += f"\r\nAuthorization: Basic {_basic(url.user or '', url.password or '')}"
        if json is not None:  # (a hook's: serialised as aiohttp's session does)
            data = stdjson.dumps(json).encode()
            if "\ncontent-type:" not in fields.lower():
                fields += "\r\nContent-Type: application/json"
        if data is not None:
            fields += f"\r\nContent-Length: {len(data)}"
        elif method in ("POST", "PUT", "PATCH"):
            fields += "\r\nContent-Length: 0"
        head = f"{method} {target} HTTP/1.1{fields}\r\n\r\n".encode()
        return head + data if data is not None else head


def _basic(user: str, password: str) -> str:
    """Basic credentials as aiohttp encodes them (latin-1; UTF-8 for what latin-1 lacks)."""
    text = f"{user}:{password}"
    try:
        raw = text.encode("latin-1")
    except UnicodeEncodeError:
        raw = text.encode()
    return base64.b64encode(raw).decode("ascii")


def _host(url: URL) -> str:
    """The ``Host`` header's value: the host (in brackets if IPv6), and its port unless the
    scheme's default."""
    host = url.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    return host if url.is_default_port() else f"{host}:{url.port}"


def _fields(headers: Mapping[str, str]) -> str:
    """The header lines (each preceded by CRLF): an application's ``Host`` first if it sets
    one, the defaults it does not set, then its headers. A name or value with CR, LF or NUL,
    or a name with a colon or space, is refused."""
    names = {k.lower() for k in headers}
    out = [f"\r\n{name}: {value}" for low, name, value in _DEFAULTS if low not in names]
    for name, value in headers.items():
        value = str(value)
        if not name or _BAD_FIELD(name) or _BAD_FIELD(value) or ":" in name or " " in name:
            raise ValueError(f"invalid header name or value for {name!r}")
        if name.lower() in ("content-length", "transfer-encoding"):  # (the client frames)
            raise ValueError(f"{name!r} is the HTTP client's to set")
        if name.lower() == "host":
            out.insert(0, f"\r\nHost: {value}")
        else:
            out.append(f"\r\n{name}: {value}")
    return "".join(out)
