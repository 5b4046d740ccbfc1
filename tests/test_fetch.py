"""fetch.py against real aiohttp.web servers on loopback: ID encoding as seen by a server, the
outcome class of every kind of answer, body limits, timeouts, refused connections and redirects
(including that credentials never cross to another origin)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import random
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncrawl import Config
from asyncrawl.config import MAX_ID_LENGTH
from asyncrawl.fetch import Attempt, Fetcher, Outcome, RequestBuilder, body_code, encode_id
from asyncrawl.source import _problem

pytestmark = pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's

KEY = "k-secret"
HEADERS = {"X-Api-Key": KEY, "Accept": "application/json"}
LIMIT = 100_000  # max_body_bytes in these tests


@dataclass
class Server:
    base: str
    hits: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (raw_path, headers)
    sent: dict[str, int] = field(default_factory=dict)  # streamed bytes per handler name
    done: dict[str, asyncio.Event] = field(default_factory=dict)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def netloc(self) -> str:
        return self.base.removeprefix("http://")


async def serve(host: str, routes: Callable[[Server], list[web.RouteDef]]) -> AsyncIterator[Server]:
    app = web.Application()
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    server = Server("")

    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        server.hits.append((request.raw_path, dict(request.headers)))
        return await handler(request)

    app.middlewares.append(record)
    app.add_routes(routes(server))
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, 0)
        await site.start()
    except OSError as e:  # pragma: no cover - depends on the host's loopback setup
        await runner.cleanup()
        pytest.skip(f"cannot listen on {host}: {e}")
    server.base = f"http://{host}:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        server.release.set()
        await runner.cleanup()


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"raw_path": request.raw_path, "id": request.match_info["id"],
                              "query": dict(request.query), "headers": dict(request.headers)})


def json_of_size(n: int) -> bytes:
    """A JSON document of exactly ``n`` bytes."""
    return b'"' + b"x" * (n - 2) + b'"'


def main_routes(server: Server) -> list[web.RouteDef]:
    async def status(request: web.Request) -> web.Response:
        code = int(request.match_info["id"])
        headers = {}
        if "ra" in request.query:
            headers["Retry-After"] = request.query["ra"]
        return web.Response(status=code, body=b'{"error": "x"}', content_type="application/json",
                            headers=headers)

    async def named(request: web.Request) -> web.StreamResponse:
        name = request.match_info["id"]
        if name == "ok":
            return web.json_response({"hello": "wörld", "n": [1, 2]})
        if name == "text":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if name == "empty":
            return web.Response(status=204)
        if name == "at-limit":
            return web.Response(body=json_of_size(LIMIT), content_type="application/json")
        if name == "over-limit":
            return web.Response(body=json_of_size(LIMIT + 1), content_type="application/json")
        if name == "gzip-small":
            return web.Response(body=gzip.compress(b'{"small": true}'), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        if name == "ra-date":
            when = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
            return web.Response(status=503, headers={"Retry-After": when})
        raise web.HTTPNotFound()

    async def stream(request: web.Request) -> web.StreamResponse:
        """A 64 MiB body, streamed (gzip-encoded: random bytes, or a bomb of spaces that compresses
        1000:1); records how much of it could be sent before the client hung up."""
        name = request.match_info["id"]
        total = 64 << 20
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        gz = name.startswith("gzip")
        if gz:
            resp.headers["Content-Encoding"] = "gzip"
        if name.endswith("-cl") and not gz:
            resp.content_length = total
        server.done[name] = done = asyncio.Event()
        sent = 0
        comp = zlib.compressobj(1, wbits=31)
        chunk = random.randbytes(256 << 10) if "random" in name else b" " * (256 << 10)
        try:
            await resp.prepare(request)
            while sent < total:
                await resp.write(comp.compress(chunk) if gz else chunk)
                sent += len(chunk)
            if gz:
                await resp.write(comp.flush())
            await resp.write_eof()
        except OSError:  # the client hung up (ConnectionResetError and friends)
            pass
        finally:
            server.sent[name] = sent
            done.set()
        return resp

    async def gzip_bomb_with_length(request: web.Request) -> web.Response:
        body = gzip.compress(b" " * (32 << 20), compresslevel=9)
        assert len(body) < LIMIT  # the compressed size alone is under the limit
        return web.Response(body=body, content_type="application/json",
                            headers={"Content-Encoding": "gzip"})

    async def slow(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.release.wait(), 10)
        return web.json_response({"late": True})

    async def redirect(request: web.Request) -> web.Response:
        code = int(request.query.get("code", "302"))
        return web.Response(status=code, headers={"Location": request.query["to"]})

    async def loop(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "/loop/" + request.match_info["id"]})

    return [
        web.route("*", "/items/{id}", echo),
        web.route("*", "/any/{id:.*}", echo),  # aiohttp's plain {id} cannot match "{" or "}"
        web.route("*", "/v1/items/{id}/detail", echo),
        web.get("/status/{id}", status),
        web.get("/r/{id}", named),
        web.get("/stream/{id}", stream),
        web.get("/bomb/{id}", gzip_bomb_with_length),
        web.get("/slow/{id}", slow),
        web.get("/redirect/{id}", redirect),
        web.get("/loop/{id}", loop),
    ]


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async for s in serve("127.0.0.1", main_routes):
        yield s


@pytest.fixture
async def other() -> AsyncIterator[Server]:
    """Another origin: 127.0.0.2 (the whole of 127/8 is loopback on Linux)."""
    async for s in serve("127.0.0.2", lambda _: [web.route("*", "/items/{id}", echo)]):
        yield s


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def config(url: str, **kw: Any) -> Config:
    kw.setdefault("headers", HEADERS)
    return Config(url=url, timeout=kw.pop("timeout", 5.0), max_body_bytes=LIMIT, **kw)


async def attempt(session: aiohttp.ClientSession, url: str, item: str, **kw: Any) -> Attempt:
    return await Fetcher(session, config(url, **kw)).attempt(item)


# -- encoding IDs --------------------------------------------------------------------------------

TRICKY_IDS = [
    "../admin", "a/b", "x?y=1", "%2e%2e", "%2F", ".", "..", "...", "#f", "sp ace", "ünï", "a+b",
    "100%", "a;b=c", "a&b", "\\..\\x", "//evil.example", "@evil", "~user", "a\u2028b",
    "".join(["aé/?#%.", "☃"][i % 2] for i in range(200))[:1000],
    "x" * 1000,
]


@pytest.mark.parametrize("item", TRICKY_IDS, ids=lambda s: s[:20])
async def test_id_is_one_path_segment_and_one_query_value(
    server: Server, session: aiohttp.ClientSession, item: str
) -> None:
    a = await attempt(session, server.base + "/items/{id}", item, params={"q": "id:{id}"})
    assert a.outcome is Outcome.OK, a
    path, _, query = a.data["raw_path"].partition("?")
    prefix, segment = path.rsplit("/", 1)
    assert prefix == "/items"  # nothing added to or removed from the path
    assert unquote(segment) == item
    assert a.data["id"] == item  # the server's router decoded it back
    assert a.data["query"] == {"q": "id:" + item}
    assert query == "q=id%3A" + encode_id(item)
    assert len(server.hits) == 1


async def test_template_path_and_query_are_kept(server: Server, session: aiohttp.ClientSession) -> None:
    item = "../a b?c#d"
    url = server.base + "/v1/items/{id}/detail?fields=a%2Cb&x=1"
    a = await attempt(session, url, item, params={"q": "{id}", "filter": "a&b=c"})
    assert a.outcome is Outcome.OK, a
    enc = encode_id(item)
    assert a.data["raw_path"] == f"/v1/items/{enc}/detail?fields=a%2Cb&x=1&q={enc}&filter=a%26b%3Dc"
    assert a.data["id"] == item
    assert a.data["query"] == {"fields": "a,b", "x": "1", "q": item, "filter": "a&b=c"}


async def test_id_only_in_query(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/items/fixed", "a/b&c=d", params={"id": "{id}"})
    assert a.outcome is Outcome.OK, a
    assert a.data["raw_path"] == "/items/fixed?id=a%2Fb%26c%3Dd"
    assert a.data["query"] == {"id": "a/b&c=d"}


_valid_ids = st.text(min_size=1, max_size=MAX_ID_LENGTH).filter(lambda s: _problem(s) is None)


@given(_valid_ids)
def test_encode_id_cannot_escape_its_segment(item: str) -> None:
    enc = encode_id(item)
    assert unquote(enc, errors="strict") == item
    assert enc not in ("", ".", "..")
    assert not set(enc) & set("/?#\\ &=+;@:\"<>{}|^`")
    assert enc.isascii() and enc.isprintable()


@given(_valid_ids)
def test_request_builder_keeps_host_and_path(item: str) -> None:
    build = RequestBuilder(Config(url="https://api.example.com/v1/n/{id}/x", params={"k": "{id}"}))
    req = build(item)
    assert req.url.host == "api.example.com"
    assert req.url.raw_path == f"/v1/n/{encode_id(item)}/x"
    assert req.url.query == {"k": item}
    assert req.method == "GET"


_TEMPLATES = [
    ("https://api.example.com/v1/n/{id}", {}),
    ("http://u:p@h:8080/a%20b/{id}.json?x=1&y", {"k": "v w", "n": 3}),
    ("http://[::1]:8080/{id}/x/{id}", {}),
    ("HTTP://Example.COM:80/ü/{id}?", {}),
    ("http://h/items?id={id}", {}),  # {id} in the query: the general path
    ("http://h/items", {"id": "{id}"}),
]


@pytest.mark.parametrize(("url", "params"), _TEMPLATES)
@given(item=_valid_ids)
def test_request_builder_fast_path_builds_the_same_url(url: str, params: dict[str, object],
                                                        item: str) -> None:
    """The URL assembled from parts (``{id}`` only in the path) equals the parsed one."""
    build = RequestBuilder(Config(url=url, params=params))
    fast = build(item).url
    build._fast = None  # the general path: fill the template, parse it
    slow = build(item).url
    assert str(fast) == str(slow) and fast == slow
    assert (fast.host, fast.port, fast.raw_path, fast.raw_query_string) == (
        slow.host, slow.port, slow.raw_path, slow.raw_query_string)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(item=_valid_ids)
@example(item="{id}")
@example(item="}{/")
async def test_server_decodes_any_id(server: Server, session: aiohttp.ClientSession, item: str) -> None:
    a = await attempt(session, server.base + "/any/{id}", item)
    assert a.outcome is Outcome.OK, a
    prefix, segment = a.data["raw_path"].rsplit("/", 1)
    assert prefix == "/any"
    assert unquote(segment) == item
    assert a.data["id"] == item


# -- classification ------------------------------------------------------------------------------


async def test_200_json_is_ok(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "ok")
    assert a == Attempt(Outcome.OK, 200, data={"hello": "wörld", "n": [1, 2]}, billable=True,
                        body=a.body)
    assert a.body is not None and orjson.loads(a.body) == a.data  # the body as received
    assert server.hits[0][1]["X-Api-Key"] == KEY
    assert server.hits[0][1]["Accept"] == "application/json"


async def test_200_not_json_is_retry(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "text")
    assert a.outcome is Outcome.RETRY
    assert a.status == 200 and a.billable
    assert a.error is not None and "JSON" in a.error


async def test_204_is_retry(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "empty")
    assert a.outcome is Outcome.RETRY
    assert a.status == 204


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (400, Outcome.SKIP), (404, Outcome.SKIP), (410, Outcome.SKIP), (418, Outcome.SKIP),
        (422, Outcome.SKIP), (401, Outcome.FATAL), (402, Outcome.FATAL), (408, Outcome.RETRY),
        (429, Outcome.RETRY), (500, Outcome.RETRY), (502, Outcome.RETRY), (503, Outcome.RETRY),
        (504, Outcome.RETRY), (599, Outcome.RETRY),
    ],
)
async def test_status_classes(server: Server, session: aiohttp.ClientSession, code: int,
                              outcome: Outcome) -> None:
    a = await attempt(session, server.base + "/status/{id}", str(code))
    assert a.outcome is outcome
    assert a.status == code
    assert a.error == f"HTTP {code}"
    assert a.data is None
    assert not a.billable


async def test_configured_status_sets_win(server: Server, session: aiohttp.ClientSession) -> None:
    url = server.base + "/status/{id}"
    kw: dict[str, Any] = dict(retryable=[404], skip=[503], fatal=[418])
    assert (await attempt(session, url, "404", **kw)).outcome is Outcome.RETRY
    assert (await attempt(session, url, "503", **kw)).outcome is Outcome.SKIP
    assert (await attempt(session, url, "418", **kw)).outcome is Outcome.FATAL
    assert (await attempt(session, url, "401", **kw)).outcome is Outcome.SKIP  # no longer fatal
    # a retryable list of one's own names what is retried: another 5xx is a skip (500 was
    # retried with retryable = [429])
    for code in ("500", "501", "599"):
        assert (await attempt(session, url, code, retryable=[429])).outcome is Outcome.SKIP
    assert (await attempt(session, url, "501")).outcome is Outcome.RETRY  # (the default: 5xx)


@pytest.mark.parametrize(("ra", "expected"), [("7", 7.0), ("0", 0.0), ("2.5", 2.5), ("soon", None)])
async def test_429_retry_after_seconds(server: Server, session: aiohttp.ClientSession, ra: str,
                                       expected: float | None) -> None:
    a = await attempt(session, server.base + "/status/{id}", "429", params={"ra": ra})
    assert a.outcome is Outcome.RETRY
    assert a.status == 429
    assert a.retry_after == expected


async def test_503_retry_after_date(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "ra-date")
    assert a.outcome is Outcome.RETRY
    assert a.retry_after is not None and 100.0 < a.retry_after <= 121.0


# -- body limits ---------------------------------------------------------------------------------


async def test_body_at_limit_is_read(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "at-limit")
    assert a.outcome is Outcome.OK
    assert len(a.data) == LIMIT - 2


async def test_body_over_limit_with_length(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "over-limit")
    # an answer paid for that cannot be used: bought again at most paid_retries times (a skip
    # was bought again in pass 2 whatever paid_retries said)
    assert a.outcome is Outcome.RETRY and a.billable
    assert a.status == 200
    assert a.error is not None and str(LIMIT) in a.error


@pytest.mark.parametrize("name", ["plain-cl", "plain-chunked", "gzip-random-chunked"])
async def test_huge_body_is_cut_off(server: Server, session: aiohttp.ClientSession, name: str) -> None:
    a = await attempt(session, server.base + "/stream/{id}", name)
    assert a.outcome is Outcome.RETRY and a.billable, a
    assert a.error is not None and str(LIMIT) in a.error
    await asyncio.wait_for(server.done[name].wait(), 10)
    assert server.sent[name] < 64 << 20  # the client hung up long before the end


@pytest.mark.parametrize("path", ["/bomb/with-length", "/stream/gzip-bomb-chunked"])
async def test_gzip_bomb_is_cut_off(server: Server, session: aiohttp.ClientSession, path: str) -> None:
    """Bodies that are small on the wire but decompress beyond the limit."""
    a = await attempt(session, server.base + path.rsplit("/", 1)[0] + "/{id}", path.rsplit("/", 1)[1])
    assert a.outcome is Outcome.RETRY and a.billable, a
    assert a.error is not None and str(LIMIT) in a.error


async def test_small_gzip_body_is_decoded(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/r/{id}", "gzip-small")
    assert a.outcome is Outcome.OK
    assert a.data == {"small": True}


# -- network failures ----------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), [
    (402, 402), ("402", 402), (" 401 ", 401), (401.0, 401), (599, 599),  # numbers, however written
    ("E402", 400), (401.5, 400), (True, 400), ("", 400), ([402], 400),  # anything else: a 400,
    (1001, 400), (0, 400), (-1, 400), (10001, 400), (99, 400), (600, 400)])  # no HTTP status too
def test_a_body_code_is_a_status_however_the_api_writes_it(code: object, status: int) -> None:
    assert body_code(code) == status


async def code_in_body(request: web.Request) -> web.Response:
    """200 with ``{"code": X}``, X the JSON the ID writes."""
    return web.json_response({"code": json.loads(request.match_info["id"]), "data": 1})


async def test_a_retry_after_on_a_2xx_whose_body_says_429_is_honoured(
        session: aiohttp.ClientSession) -> None:
    """``Retry-After`` was read only from answers of status 300 and up: a 200 whose body code
    is 429, with its ``Retry-After: 4``, was retried after the backoff's fraction of a second."""
    async def limited(request: web.Request) -> web.Response:
        return web.json_response({"code": 429}, headers={"Retry-After": "4"})

    async for srv in serve("127.0.0.1", lambda _: [web.get("/lim/{id}", limited)]):
        a = await attempt(session, srv.base + "/lim/{id}", "x", error_field="code")
    assert a.outcome is Outcome.RETRY and a.status == 429 and a.retry_after == 4.0, a


@pytest.mark.parametrize(("code", "success", "outcome"), [
    (200, [], Outcome.OK), ("200", [], Outcome.OK), (204.0, [], Outcome.OK),  # a 2xx: a success
    (402, [], Outcome.FATAL), ("503", [], Outcome.RETRY), (404, [], Outcome.SKIP),
    (0, [], Outcome.SKIP), (0, [0], Outcome.OK), ("0", [0], Outcome.OK), (0, ["0"], Outcome.OK),
    (0.0, [0], Outcome.OK), ("ok", ["ok"], Outcome.OK), ("OK", ["ok"], Outcome.SKIP),
    ([1], [[1]], Outcome.OK), (True, [1], Outcome.SKIP), (1, [True], Outcome.SKIP),
    (10001, [], Outcome.SKIP)])
async def test_a_code_in_the_body_is_classified_like_a_status(
        session: aiohttp.ClientSession, code: object, success: list[object],
        outcome: Outcome) -> None:
    """A 2xx code was a skip (a paid result bought again in pass 2, then dropped), and a
    success value matched only as the API wrote it (``"0"`` against ``0``: bought again)."""
    async for srv in serve("127.0.0.1", lambda _: [web.get("/code/{id}", code_in_body)]):
        a = await attempt(session, srv.base + "/code/{id}", json.dumps(code),
                          error_field="code", success_values=success)
        assert a.outcome is outcome, a
        assert a.billable
        if outcome is Outcome.OK:
            assert a.data == {"code": code, "data": 1}


async def test_timeout_is_retry(server: Server, session: aiohttp.ClientSession) -> None:
    start = time.monotonic()
    a = await attempt(session, server.base + "/slow/{id}", "x", timeout=0.3)
    assert time.monotonic() - start >= 0.25
    assert a.outcome is Outcome.RETRY
    assert a.status is None
    assert a.error == "timeout"


async def test_refused_connection_is_retry(session: aiohttp.ClientSession) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = await attempt(session, f"http://127.0.0.1:{port}/items/{{id}}", "x")
    assert a.outcome is Outcome.RETRY
    assert a.status is None
    assert a.error is not None and "connect" in a.error.lower()
    assert KEY not in a.error


# -- redirects -----------------------------------------------------------------------------------


def redirect_url(server: Server, to: str, code: int = 302) -> str:
    return f"{server.base}/redirect/{{id}}?code={code}&to={quote(to, safe='')}"


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
async def test_same_origin_redirect_is_followed(server: Server, session: aiohttp.ClientSession,
                                                code: int) -> None:
    a = await attempt(session, redirect_url(server, "/r/ok", code), "x")
    assert a.outcome is Outcome.OK
    assert a.data == {"hello": "wörld", "n": [1, 2]}
    assert [h[0].split("?")[0] for h in server.hits] == ["/redirect/x", "/r/ok"]
    assert all(h[1].get("X-Api-Key") == KEY for h in server.hits)


async def test_a_hook_s_url_as_a_string_follows_a_redirect(
        server: Server, session: aiohttp.ClientSession) -> None:
    from asyncrawl.fetch import Request

    url = redirect_url(server, "/r/ok").replace("{id}", "x")
    fetcher = Fetcher(session, config(server.base + "/items/{id}"),
                      request_for=lambda item: Request("GET", url, dict(HEADERS)))  # a str
    a = await fetcher.attempt("x")  # (TypeError from URL.join before)
    assert a.outcome is Outcome.OK and a.data == {"hello": "wörld", "n": [1, 2]}


async def test_an_application_s_session_that_raises_for_status_changes_no_class(
        server: Server) -> None:
    """A session made with ``raise_for_status=True`` raised on 402 and 404 inside aiohttp,
    which made them network errors: a 402 did not halt, a 404 was retried."""
    async with aiohttp.ClientSession(raise_for_status=True) as raising:
        for code, outcome in ((402, Outcome.FATAL), (404, Outcome.SKIP), (503, Outcome.RETRY)):
            a = await attempt(raising, server.base + "/status/{id}", str(code))
            assert (a.outcome, a.status) == (outcome, code), a


async def test_absolute_same_origin_redirect_is_followed(server: Server,
                                                         session: aiohttp.ClientSession) -> None:
    a = await attempt(session, redirect_url(server, server.base + "/items/there"), "x")
    assert a.outcome is Outcome.OK
    assert a.data["id"] == "there"
    assert a.data["headers"]["X-Api-Key"] == KEY


async def test_redirect_not_followed_when_none(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, redirect_url(server, "/r/ok"), "x", follow_redirects="none")
    assert a.outcome is Outcome.SKIP
    assert a.status == 302
    assert a.error is not None and "/r/ok" in a.error
    assert len(server.hits) == 1


async def test_cross_origin_redirect_is_not_followed(server: Server, other: Server,
                                                     session: aiohttp.ClientSession) -> None:
    target = other.base + "/items/stolen"
    a = await attempt(session, redirect_url(server, target), "x")
    assert a.outcome is Outcome.SKIP
    assert a.status == 302
    assert a.error is not None and target in a.error
    assert other.hits == []


async def test_other_port_is_another_origin(server: Server, session: aiohttp.ClientSession) -> None:
    async for third in serve("127.0.0.1", lambda _: [web.route("*", "/items/{id}", echo)]):
        a = await attempt(session, redirect_url(server, third.base + "/items/y"), "x")
        assert a.outcome is Outcome.SKIP and a.status == 302
        assert third.hits == []


async def test_cross_origin_redirect_with_any_drops_credentials(
    server: Server, other: Server, session: aiohttp.ClientSession
) -> None:
    headers = {**HEADERS, "Authorization": "Bearer tok-abcdef", "X-Client": "asyncrawl-tests"}
    a = await attempt(session, redirect_url(server, other.base + "/items/elsewhere"), "x",
                      follow_redirects="any", headers=headers)
    assert a.outcome is Outcome.OK
    assert a.data["id"] == "elsewhere"
    assert len(other.hits) == 1
    sent = other.hits[0][1]
    assert "X-Api-Key" not in sent and "Authorization" not in sent
    assert KEY not in str(sent) and "tok-abcdef" not in str(sent)
    assert sent.get("X-Client") == "asyncrawl-tests"  # ordinary headers still go
    assert server.hits[0][1]["X-Api-Key"] == KEY  # the first hop did carry it


async def test_cross_origin_redirect_keeps_the_new_url_s_own_signature(
    server: Server, other: Server, session: aiohttp.ClientSession
) -> None:
    """An API that redirects to a presigned URL on another origin (S3, GCS): its
    ``X-Amz-Signature``, credential and token are that URL's own and go along; they were
    dropped for their names, and the URL answered 403 (each ID given up). What the request
    itself carried (a literal key in its query, echoed back under any name) is still
    dropped."""
    to = (other.base + "/items/obj?X-Amz-Signature=srvsig99&X-Amz-Credential=AKIAEX&"
          "token=srvtok&page=2&api_key=ours-literal-123&echo=ours-literal-123&auth=tok-abcdef")
    headers = {**HEADERS, "Authorization": "Bearer tok-abcdef"}
    a = await attempt(session, redirect_url(server, to) + "&api_key=ours-literal-123", "x",
                      follow_redirects="any", headers=headers)
    assert a.outcome is Outcome.OK, a
    assert "ours-literal-123" in server.hits[0][0]  # the first hop did carry it
    (landed,) = other.hits
    query = landed[0].split("?", 1)[1]
    assert query == "X-Amz-Signature=srvsig99&X-Amz-Credential=AKIAEX&token=srvtok&page=2"
    assert "Authorization" not in landed[1] and KEY not in str(landed)


async def test_a_key_the_first_request_carried_is_dropped_after_a_same_origin_hop(
    server: Server, other: Server, session: aiohttp.ClientSession
) -> None:
    """A literal key in the URL template, a same-origin hop without it, then a redirect to
    another origin that echoes it: still dropped (what the request carried, not the hop)."""
    to = other.base + "/items/obj?api_key=ours-literal-123&page=2"
    hop = redirect_url(server, to).replace("{id}", "x")
    a = await attempt(session, redirect_url(server, hop) + "&api_key=ours-literal-123", "x",
                      follow_redirects="any", headers=HEADERS)
    assert a.outcome is Outcome.OK, a
    (landed,) = other.hits
    assert landed[0] == "/items/obj?page=2"


def test_the_credentials_a_request_carried_are_found_in_its_body_too() -> None:
    """A key written in the JSON body or a form body (no ``${ENV}``) is one of ours: a
    ``Location`` echoing it to another origin loses it; a short value of ours (``sig=1``)
    is dropped only under a secret name, not from ``page=1``."""
    from yarl import URL

    from asyncrawl.fetch import _ours, _without_credentials

    cfg = Config(url="http://api.example/{id}")
    ours = _ours(URL("http://api.example/x?sig=1&q=a"), {"X-Api-Key": "hdr-key-77"},
                 {"query": {"api_key": "BODYKEY123", "n": 5}, "list": [{"token": "tok-9"}]},
                 b"client_secret=form-sec-1&x=y", cfg)
    assert ours == {"1", "hdr-key-77", "BODYKEY123", "tok-9", "form-sec-1"}
    target = URL("http://evil.example/p?api_key=BODYKEY123&a=tok-9&b=form-sec-1&c=hdr-key-77"
                 "&page=1&sig=1&X-Amz-Signature=theirs")
    assert str(_without_credentials(target, cfg, ours)) == \
        "http://evil.example/p?page=1&X-Amz-Signature=theirs"


async def test_cross_origin_redirect_drops_env_secrets_in_any_header(
    server: Server, other: Server, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCRAWL_T_SIG", "sig-0123456789")
    cfg = Config.from_dict({
        "request": {"url": redirect_url(server, other.base + "/items/elsewhere"),
                    "follow_redirects": "any",
                    "headers": {"X-Signature": "v1 ${ASYNCRAWL_T_SIG}"}},
    })
    a = await Fetcher(session, cfg).attempt("x")
    assert a.outcome is Outcome.OK
    assert server.hits[0][1]["X-Signature"] == "v1 sig-0123456789"
    assert "sig-0123456789" not in str(other.hits[0][1])


async def test_cross_origin_redirect_drops_literal_auth_and_signature_headers(
    server: Server, other: Server, session: aiohttp.ClientSession
) -> None:
    """``X-Auth`` and ``X-Signature`` with values written in the config (no ${ENV}) went to
    the other origin, though a query parameter named auth or signature counted as secret."""
    headers = {**HEADERS, "X-Auth": "literal77", "X-Signature": "SIG2", "X-Req-Sig": "s3",
               "X-Credential": "c4", "X-Client": "asyncrawl-tests"}
    a = await attempt(session, redirect_url(server, other.base + "/items/elsewhere"), "x",
                      follow_redirects="any", headers=headers)
    assert a.outcome is Outcome.OK
    sent = other.hits[0][1]
    for name in ("X-Auth", "X-Signature", "X-Req-Sig", "X-Credential"):
        assert name not in sent and server.hits[0][1][name] == headers[name]
    assert sent.get("X-Client") == "asyncrawl-tests"


async def test_redirect_loop_stops(server: Server, session: aiohttp.ClientSession) -> None:
    a = await attempt(session, server.base + "/loop/{id}", "x", max_redirects=2)
    assert a.outcome is Outcome.SKIP
    assert a.status == 302
    assert a.error is not None and "too many redirects" in a.error
    assert len(server.hits) == 3


@pytest.mark.parametrize("location", ["http://[::1", "mailto:someone@example.com", "http://h:99999/x"])
async def test_redirect_to_invalid_location_is_skip(server: Server, session: aiohttp.ClientSession,
                                                    location: str) -> None:
    a = await attempt(session, redirect_url(server, location), "x", follow_redirects="any")
    assert a.outcome is Outcome.SKIP
    assert a.status == 302
    assert a.error is not None and location in a.error


@pytest.mark.parametrize("location", ["http://evil:pw@{netloc}/items/b", "//evil:pw@{netloc}/x"])
async def test_a_redirect_with_credentials_in_its_location_is_not_followed(
        server: Server, session: aiohttp.ClientSession, location: str) -> None:
    """A Location with a user and password was followed (the server's credentials sent as
    Basic auth), or with an Authorization header of one's own raised out of the fetcher: the
    run ended with exit 1, and every rerun the same."""
    to = location.format(netloc=server.netloc)
    for headers in (HEADERS, {**HEADERS, "Authorization": "Bearer k-secret"}):
        a = await attempt(session, redirect_url(server, to), "x", headers=headers)
        assert (a.outcome, a.status) == (Outcome.SKIP, 302), a
        assert a.error is not None and "credentials" in a.error and "pw" not in a.error
    assert len(server.hits) == 2  # (the redirects only)


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[bytes, bool], Awaitable[str]]]:
    """Servers that send ``answer``'s bytes as they are, whatever was asked, then close the
    connection (``stall``: keep it open, silent); each one's item URL."""
    servers: list[asyncio.Server] = []
    handlers: set[asyncio.Task[Any]] = set()
    release = asyncio.Event()

    async def start(answer: bytes, stall: bool = False) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handlers.add(asyncio.current_task())  # type: ignore[arg-type]
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                if stall:
                    await release.wait()
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(srv)
        return f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/items/{{id}}"

    yield start
    release.set()
    for srv in servers:
        srv.close()
    await asyncio.wait_for(asyncio.gather(*handlers), 10)


async def test_a_location_s_control_characters_are_escaped(
        raw: Callable[[bytes, bool], Awaitable[str]], session: aiohttp.ClientSession) -> None:
    """A terminal's escapes in a Location were stored, and shown by status and export."""
    url = await raw(b"HTTP/1.1 302 Found\r\nLocation: http://other.example/\x1b[2Jx\r\n"
                    b"Content-Length: 0\r\n\r\n")
    a = await attempt(session, url, "x")
    assert a.outcome is Outcome.SKIP and a.error is not None
    assert "\x1b" not in a.error and "\\x1b[2Jx" in a.error, a.error


# -- an answer whose head came and whose body did not ------------------------------------------


@pytest.mark.parametrize(("status", "outcome"), [
    (402, Outcome.FATAL), (401, Outcome.FATAL), (503, Outcome.RETRY), (429, Outcome.RETRY),
    (404, Outcome.SKIP)])
@pytest.mark.parametrize("how", ["cut", "stalled", "too-large"])
async def test_a_status_stands_when_its_body_does_not_come_whole(
        raw: Callable[[bytes, bool], Awaitable[str]], session: aiohttp.ClientSession,
        status: int, outcome: Outcome, how: str) -> None:
    """A 402 whose body was cut short, stalled or was over the limit was a network error (or a
    skip): retried, and every ID ended unavailable with exit 0 instead of a halt; a 503's
    Retry-After was not heard."""
    length = LIMIT + 1 if how == "too-large" else 100
    url = await raw(b"HTTP/1.1 %d X\r\nRetry-After: 7\r\nContent-Length: %d\r\n\r\n{\"a\""
                    % (status, length), how == "stalled")
    a = await attempt(session, url, "x", timeout=0.5)
    assert (a.outcome, a.status, a.billable, a.unanswered) == (outcome, status, False, False), a
    if status in (429, 503):
        assert a.retry_after == 7.0


@pytest.mark.parametrize("how", ["cut", "stalled"])
async def test_a_2xx_whose_body_does_not_come_whole_was_paid_for(
        raw: Callable[[bytes, bool], Awaitable[str]], session: aiohttp.ClientSession,
        how: str) -> None:
    """It was a network error, not billable: bought again max_tries times in each pass (ten
    times by default), where an answer paid for that cannot be used is bought again at most
    paid_retries times."""
    url = await raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"a\"", how == "stalled")
    a = await attempt(session, url, "x", timeout=0.5)
    assert (a.outcome, a.status, a.billable, a.unanswered) == (Outcome.RETRY, 200, True, False), a
    assert a.error is not None and "body not whole" in a.error


async def test_an_answer_nobody_asked_for_is_nobody_s(session: aiohttp.ClientSession) -> None:
    """An answer a server sends on an idle keep-alive connection was taken by aiohttp's pool
    as the next request's answer, and every later answer on it as the one after's: each ID
    recorded ok with another's body (aio-libs/aiohttp#13656; asyncrawl's own client drops
    such a connection)."""
    from asyncrawl.fetch import new_session

    def answer(item: bytes) -> bytes:
        body = b'{"id": "%s"}' % item
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                writer.write(answer(head.split(b" ")[1].rsplit(b"/", 1)[1]))
                await asyncio.sleep(0.02)
                writer.write(answer(b"stray"))  # (once the answer is in: while it is idle)
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    cfg = config(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/items/{{id}}")
    try:
        async with new_session(cfg) as own:
            fetcher = Fetcher(own, cfg)
            for item in ("a", "b", "c"):
                a = await fetcher.attempt(item)
                assert (a.outcome, a.data) == (Outcome.OK, {"id": item}), a
                await asyncio.sleep(0.1)  # (the stray answer comes in meanwhile)
    finally:
        srv.close()


async def test_a_redirect_whose_body_is_cut_short_is_followed_by_both_clients(
        raw: Callable[[bytes, bool], Awaitable[str]], server: Server,
        session: aiohttp.ClientSession) -> None:
    """A redirect's body is not read (aiohttp's client follows it): asyncrawl's own client
    took one cut short for a failed answer (a skip)."""
    to = server.base + "/items/there"
    url = await raw(b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 100\r\n\r\nabc"
                    % to.encode())
    a = await attempt(session, url, "x", follow_redirects="any")
    assert (a.outcome, a.data["id"] if a.data else None) == (Outcome.OK, "there"), a


@pytest.mark.parametrize("cut", ["half", "no-trailer"])
async def test_a_compressed_body_that_does_not_end_whole_is_not_ok(
        raw: Callable[[bytes, bool], Awaitable[str]], cut: str) -> None:
    """aiohttp's decoder took a gzip stream cut in half, or without its trailer, for a whole
    body: with format = "text", part of a page was recorded ok. A session asyncrawl makes
    decodes as its own client does."""
    from asyncrawl.fetch import new_session

    packed = gzip.compress(random.Random(7).randbytes(20_000).hex().encode())
    packed = packed[:len(packed) // 2] if cut == "half" else packed[:-8]
    url = await raw(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(packed), packed))
    cfg = config(url, response_format="text")
    async with new_session(cfg) as own:
        a = await Fetcher(own, cfg).attempt("x")
    assert (a.outcome, a.status, a.billable) == (Outcome.RETRY, 200, True), a
    assert a.error is not None and "compressed stream ends early" in a.error, a.error


async def test_json_after_a_byte_order_mark_is_json(
        raw: Callable[[bytes, bool], Awaitable[str]], session: aiohttp.ClientSession) -> None:
    body = b'\xef\xbb\xbf{"a": 1}'
    url = await raw(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    a = await attempt(session, url, "x")
    assert (a.outcome, a.data, a.body) == (Outcome.OK, {"a": 1}, b'{"a": 1}'), a


async def test_numeric_header_values_are_sent_as_text(server: Server, session: aiohttp.ClientSession,
                                                      tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text(f'[request]\nurl = "{server.base}/items/{{id}}"\n'
                 "[request.headers]\nX-Version = 2\nX-Ratio = 1.5\n", encoding="utf-8")
    a = await Fetcher(session, Config.load(p)).attempt("x")
    assert a.outcome is Outcome.OK, a
    assert a.data["headers"]["X-Version"] == "2"
    assert a.data["headers"]["X-Ratio"] == "1.5"


# -- the allocator regime of socket reads ----------------------------------------------------

# the start of a script that counts glibc's mmapped blocks (prints null elsewhere)
MALLINFO = """
import ctypes, json, socket, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit()
libc.mallinfo2.restype = MallInfo2
"""

MMAPPED_READ = MALLINFO + """
a, b = socket.socketpair()

def mmapped_read() -> int:
    \"\"\"Whether a read as asyncio's transport does it (recv of 256 KiB, 100 bytes there) is
    an mmapped block while its result lives (glibc shrinks it in place: an mremap).\"\"\"
    a.sendall(bytes(100))
    before = libc.mallinfo2().hblks
    data = b.recv(256 * 1024)
    n = libc.mallinfo2().hblks - before
    del data
    return n

from asyncrawl.fetch import keep_reads_off_mmap
was = [mmapped_read(), mmapped_read()]  # a read does not get a process out of the regime
keep_reads_off_mmap()
print(json.dumps([*was, mmapped_read()]))
"""


def test_socket_read_buffers_come_from_the_heap_not_from_mmap() -> None:
    """A fresh process (glibc): reads as asyncio does them are mmaps until
    ``keep_reads_off_mmap``, and come from the heap after it."""
    r = subprocess.run([sys.executable, "-c", MMAPPED_READ], capture_output=True, text=True,
                       timeout=60, check=True)
    counts = orjson.loads(r.stdout)
    if counts is None:
        pytest.skip("not glibc (no mallinfo2): its mmap threshold does not apply")
    first, second, after = counts
    if not first:
        pytest.skip("this interpreter's reads were never mmapped: nothing to show")
    assert second == 1  # the regime persists on its own ...
    assert after == 0, "a read buffer was still mmapped after keep_reads_off_mmap()"


BIG_BODIES = MALLINFO + """
def mmapped(size: int) -> int:
    before = libc.mallinfo2().hblks
    block = bytearray(size)
    n = libc.mallinfo2().hblks - before
    del block
    return n

from asyncrawl.fetch import keep_reads_off_mmap
keep_reads_off_mmap()
out = [mmapped(256 * 1024)]
big = bytearray(8 << 20)  # a body of max_body_bytes, freed
del big
out += [mmapped(1 << 20), mmapped(4 << 20)]
print(json.dumps(out))
"""


def test_large_bodies_stay_mmaps_after_one_was_freed() -> None:
    """glibc's dynamic mmap threshold rose to every mmapped block freed (an 8 MiB body): every
    later body came from the heap, which fragmented and never shrank (a crawl of 1 MB
    payloads: the run ~1 GB, its writing process ~3 GB over 3,000 IDs). The threshold is
    fixed: reads stay on the heap, bodies above it are mmaps, given back when freed."""
    r = subprocess.run([sys.executable, "-c", BIG_BODIES], capture_output=True, text=True,
                       timeout=60, check=True, env={k: v for k, v in os.environ.items()
                                                    if not k.startswith(("MALLOC_", "GLIBC_"))})
    counts = orjson.loads(r.stdout)
    if counts is None:
        pytest.skip("not glibc (no mallinfo2): its mmap threshold does not apply")
    assert counts == [0, 1, 1]
