"""Hostile input and secrets (issue 6): nothing leaks, nothing crashes, every bad input gets a clear
error. Everything runs against real servers over loopback: ``Hostile``, a raw HTTP/1.1 server (in
its own thread, so that CLI subprocesses can use it too) that misbehaves on purpose, optionally
over TLS with a CA generated here by the ``openssl`` command.

Each protection has a test here (or in test_fetch / test_config / test_cli) that fails when the
protection is removed; SECURITY.md states what is guaranteed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, unquote

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrawl import Config, ConfigError, Crawler
from asyncrawl.fetch import INSECURE_WARNING, Fetcher, Outcome, RequestBuilder, encode_id
from asyncrawl.journal import JOURNAL

from .conftest import ROOT, asyncrawl_log, db_rows, write_config, write_ids

# A key with characters that a URL must percent-encode: redaction has to catch the encoded form.
KEY = "sk+live/7f3a9c=="
TOKEN = "tok-5e1d0b8c77aa"  # sent as "Authorization: Bearer TOKEN"
SIG = "sig-a4f2c9e0d1b3"  # from ${ENV}, in a header with an ordinary name
SECRETS = (KEY, TOKEN, SIG)


def forms(secret: str) -> set[str]:
    """The ways a secret can appear in text: as is and percent-encoded."""
    return {secret, quote(secret, safe=""), quote(secret), quote_plus(secret)}


def assert_no_secret(*blobs: str | bytes, secrets: tuple[str, ...] = SECRETS) -> None:
    for blob in blobs:
        raw = blob.encode() if isinstance(blob, str) else blob
        for s in secrets:
            for f in forms(s):
                assert f.encode() not in raw, f"secret form {f!r} found in {raw[:3000]!r}"


# -- the hostile server --------------------------------------------------------------------------

Behaviour = Callable[["Hostile", asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]


def _response(status: int, body: bytes = b"", ctype: str = "application/json",
              extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def _static(status: int, body: bytes, ctype: str = "application/json", extra: str = "") -> Behaviour:
    async def send(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
        w.write(_response(status, body, ctype, extra))

    return send


async def _ok(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
    item = unquote(target.split("?")[0].rsplit("/", 1)[1])
    w.write(_response(200, json.dumps({"id": item}).encode()))


async def _stall_headers(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                         target: str) -> None:
    await h.release.wait()  # accepts, reads the request, never answers


async def _stall_body(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"id": "stall-body", "x": "')
    await w.drain()
    await h.release.wait()


async def _drip(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
    """A byte every 0.1 s: never silent long enough for the read timeout, forever in total."""
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    while not h.release.is_set():
        w.write(b" ")
        await w.drain()
        await asyncio.sleep(0.1)


async def _hangup(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
    pass  # closes the connection without a word


def _redirect_to(location: Callable[[Hostile, str], str], code: int = 302) -> Behaviour:
    async def send(h: Hostile, r: asyncio.StreamReader, w: asyncio.StreamWriter, target: str) -> None:
        w.write(_response(code, b"", extra=f"Location: {location(h, target)}\r\n"))

    return send


def _echo_query(target: str) -> str:
    return "?" + target.split("?", 1)[1] if "?" in target else ""


BOMB = gzip.compress(b" " * (8 << 20), compresslevel=9)  # ~8 KiB on the wire, 8 MiB decoded

BEHAVIOURS: dict[str, Behaviour] = {
    "ok": _ok,
    "plain-json": _static(200, b'{"id": "plain-json"}', "text/plain"),  # lenient: JSON is JSON
    "html": _static(200, b"<html><body>Service temporarily unavailable</body></html>", "text/html"),
    "bad-json": _static(200, b'{"id": "bad-json", "tru', "application/json"),
    "error-in-body": _static(200, b'{"error": {"code": 404, "message": "no such note"}}'),
    "fatal-in-body": _static(200, b'{"error": {"code": 402, "message": "insufficient balance"}}'),
    "bomb": _static(200, BOMB, extra="Content-Encoding: gzip\r\n"),
    "stall-headers": _stall_headers,
    "stall-body": _stall_body,
    "drip": _drip,
    "hangup": _hangup,
    # invalid HTTP: aiohttp's error message quotes the request URL, query string included
    "bad-length": lambda h, r, w, t: _write(w, b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n{}"),
    "not-http": lambda h, r, w, t: _write(w, b"SSH-2.0-OpenSSH_9.6\r\n\r\n"),
    "huge-header": lambda h, r, w, t: _write(w, b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * 70000 + b"\r\n\r\n"),
    "unauthorized": _static(401, b'{"error": "invalid key"}'),
    # redirects: to the other origin (echoing the request's query, api_key included) ...
    "out": _redirect_to(lambda h, t: f"{h.other}/items/landed{_echo_query(t)}"),
    # ... via a same-origin hop first
    "hop": _redirect_to(lambda h, t: f"/items/out{_echo_query(t)}", 307),
    # ... with a token of the server's own in the Location (asyncrawl never knew it)
    "signed": _redirect_to(lambda h, t: f"{h.other}/items/landed?token=server-signed-31337&n=1"),
    # ... a 303 after a POST: the body is not sent again
    "see-other": _redirect_to(lambda h, t: "/items/ok", 303),
}


async def _write(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(data)


@dataclass
class Request:
    target: str
    raw: bytes  # the request head and body as received


class Hostile:
    """A raw HTTP/1.1 server in a thread. The behaviour is picked by the last path segment
    (``/items/<behaviour>``; "ok" for anything unknown); every request is recorded raw."""

    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.tls = tls
        self.requests: list[Request] = []
        self.other = ""  # base URL of the other origin, for the redirect behaviours
        self.base = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.release: asyncio.Event

    @property
    def item_url(self) -> str:
        return self.base + "/items/{id}"

    def names(self) -> list[str]:
        return [r.target.split("?")[0].rsplit("/", 1)[1] for r in self.requests]

    def __enter__(self) -> Hostile:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.release = asyncio.Event()
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_server(self._handle, self.host, 0, ssl=self.tls)
        except OSError as e:  # pragma: no cover - depends on the host's loopback setup
            self._error = e
            self._ready.set()
            return
        port = server.sockets[0].getsockname()[1]
        self.base = f"{'https' if self.tls else 'http'}://{self.host}:{port}"
        self._ready.set()
        await self._stop.wait()
        self.release.set()
        server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            target = head.split(b" ", 2)[1].decode()
            self.requests.append(Request(target, head + body))
            name = target.split("?")[0].rsplit("/", 1)[-1]
            await BEHAVIOURS.get(name, _ok)(self, reader, writer, target)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ssl.SSLError):
            pass  # the client hung up or rejected the certificate: part of the game
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, asyncio.CancelledError):
                await writer.wait_closed()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    with Hostile() as h:
        yield h


@pytest.fixture
def other() -> Iterator[Hostile]:
    """Another origin on 127.0.0.2 (all of 127/8 is loopback on Linux)."""
    with Hostile("127.0.0.2") as h:
        yield h


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as s:
        yield s


def hostile_config(url: str, state: Path | None = None, **kw: Any) -> Config:
    """The key in every usual place: an api_key parameter, a Bearer token, a cookie, and an
    ${ENV} value in an ordinary-looking header."""
    doc = {"request": {"url": url, "timeout": 1.5, "read_timeout": 0.3, "max_body_bytes": 100_000,
                       "params": {"api_key": KEY, "q": "{id}"},
                       "headers": {"Authorization": f"Bearer {TOKEN}", "Cookie": f"sid={KEY}",
                                   "X-Signature": f"v1 {SIG}",
                                   "X-Client": "asyncrawl-tests"}},
           "response": {"error_field": "error.code"},
           "limits": {"concurrency": 8, "rate": 1000, "breaker": False, "adaptive": False,
                      },
           "retry": {"max_tries": 2, "backoff_base": 0.01, "backoff_max": 0.02},
           "passes": {"second_pass": False, "cooldown": 0},
           "run": {"grace": 1}}
    if state is not None:
        doc["state"] = {"dir": str(state)}
    # SIG as if it came from ${ENV} (what from_dict does with an expanded value)
    return Config.from_dict(doc, secrets=frozenset({SIG}), **kw)


# -- 1. secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "hidden"),
    [
        ({"Authorization": "Bearer tok-abcdef123"}, ["tok-abcdef123"]),
        ({"Authorization": "Token tok-abcdef123"}, ["tok-abcdef123"]),
        ({"Proxy-Authorization": "Bearer tok-abcdef123"}, ["tok-abcdef123"]),
        ({"Authorization": "Basic " + base64.b64encode(b"alice:pa55-w0rd").decode()},
         ["pa55-w0rd", "alice:pa55-w0rd", base64.b64encode(b"alice:pa55-w0rd").decode()]),
        ({"Cookie": "theme=dark; session=sess-0a1b2c3d"}, ["sess-0a1b2c3d"]),
    ],
    ids=["bearer", "token", "proxy-bearer", "basic", "cookie"],
)
def test_credential_inside_an_auth_header_is_redacted_on_its_own(
        headers: dict[str, str], hidden: list[str]) -> None:
    cfg = Config(url="https://api.example.com/n/{id}", headers=headers)
    for part in hidden:
        assert part in cfg.secrets
        text = cfg.redact(f"upstream said: token {part} is invalid ({quote(part, safe='')})")
        assert part not in text and quote(part, safe="") not in text
    assert "dark" not in cfg.secrets  # a short cookie value is no credential


def test_bearer_token_from_env_and_from_cli_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   hostile: Hostile) -> None:
    """``Authorization = "Bearer ${TOKEN}"`` and ``-H 'Authorization: Bearer literal'``."""
    monkeypatch.setenv("ASYNCRAWL_T_TOKEN", TOKEN)
    cfg = Config.from_dict({"request": {"url": "https://h.example/{id}",
                                        "headers": {"Authorization": "Bearer ${ASYNCRAWL_T_TOKEN}"}}})
    assert TOKEN in cfg.secrets and f"Bearer {TOKEN}" in cfg.secrets
    # a literal token on the command line: the 401 halt message and everything else stays clean
    ids = write_ids(tmp_path / "ids.txt", ["a", "unauthorized", "b"])
    conf = write_config(tmp_path / "c.toml", hostile.item_url, tmp_path / "state", ids,
                        request__headers={})
    r = run_cli("run", "-c", str(conf), "--no-progress", "-H", f"Authorization: Bearer {TOKEN}",
                env={"ASYNCRAWL_TEST_KEY": "unused"})
    assert r.returncode == 3, r.stderr
    assert any(TOKEN.encode() in q.raw for q in hostile.requests)  # it was sent ...
    assert_no_secret(r.stdout, r.stderr, *dir_bytes(tmp_path / "state"), secrets=(TOKEN,))  # ... only


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_secret_names_make_any_header_or_parameter_secret(
        hostile: Hostile, other: Hostile, session: aiohttp.ClientSession) -> None:
    """``[request] secret_names``: headers and parameters whose names no built-in rule knows."""
    hostile.other = other.base
    cfg = Config(url=hostile.base + "/items/{id}", headers={"X-Tenant": "tenant-7c1e"},
                 params={"sid": "sid-92b0f1", "q": "{id}"}, secret_names=["x-tenant", "SID"],
                 follow_redirects="any")
    assert {"tenant-7c1e", "sid-92b0f1"} <= cfg.secrets
    assert "tenant-7c1e" not in repr(cfg) and "sid-92b0f1" not in repr(cfg)
    assert cfg.redact("GET /x?sid=anything&q=1") == "GET /x?sid=***&q=1"
    a = await Fetcher(session, cfg).attempt("out")  # to the other origin, query echoed
    assert a.outcome is Outcome.OK, a
    (landed,) = other.requests
    assert landed.target == "/items/landed?q=out"
    assert b"tenant-7c1e" not in landed.raw and b"X-Tenant" not in landed.raw
    with pytest.raises(ConfigError, match=r"request\.secret_names"):
        Config(url=cfg.url, secret_names=[5])


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('[limits]\nrate = "${ASYNCRAWL_T_S}"\n', "limits.rate"),
        ('[limits]\nconcurrency = "${ASYNCRAWL_T_S}"\n', "limits.concurrency"),
        ('[retry]\njitter = "${ASYNCRAWL_T_S}"\n', "retry.jitter"),
        ('[retry]\nretryable = ["${ASYNCRAWL_T_S}"]\n', "retry.retryable"),
        ('method = "${ASYNCRAWL_T_S}"\n', "request.method"),
        ('ca_bundle = "${ASYNCRAWL_T_S}.pem"\n', "request.ca_bundle"),
        ('url = "ftp://h.example/${ASYNCRAWL_T_S}/{id}"\n', "request.url"),
    ],
)
def test_config_error_never_quotes_a_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            body: str, key: str) -> None:
    secret = "s3cr3t-f00d-" + os.urandom(4).hex()
    monkeypatch.setenv("ASYNCRAWL_T_S", secret)
    p = tmp_path / "c.toml"
    if not body.startswith("url"):
        body = 'url = "https://api.example.com/n/{id}"\n' + body
    p.write_text("[request]\n" + body, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert key in str(e.value)
    assert secret not in str(e.value) and secret not in repr(e.value)
    assert all(secret not in str(a) for a in e.value.args)


@pytest.mark.parametrize("url", ["ftp://${ASYNCRAWL_T_S}@h.example/{id}",
                                 "https://h.example/${ASYNCRAWL_T_S}/{id}#x"])
def test_url_error_never_quotes_a_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("ASYNCRAWL_T_S", "s3cr3t-in-url-77")
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"request": {"url": url}})
    assert "request.url" in str(e.value)
    assert "s3cr3t-in-url-77" not in str(e.value)


@settings(max_examples=300, deadline=None)
@given(secret=st.text(st.characters(blacklist_characters="*", blacklist_categories=("Cs",)),
                      min_size=3, max_size=40),
       before=st.text(max_size=20), after=st.text(max_size=20),
       form=st.sampled_from([str, lambda s: quote(s, safe=""), quote, quote_plus,
                             lambda s: repr(s.encode())[2:-1], lambda s: repr(s)[1:-1],
                             lambda s: json.dumps(s)[1:-1]]))
def test_redact_removes_every_form_of_a_secret(secret: str, before: str, after: str,
                                               form: Callable[[str], str]) -> None:
    """Escaped too, as a parser's error quotes the bytes of a header a server echoed back
    (``b'X-Api-Key: cl\\xc3\\xa9-...'``: the key was in the log)."""
    cfg = Config(url="https://api.example.com/n/{id}", secrets=frozenset({secret}))
    out = cfg.redact(before + form(secret) + after)
    for f in forms(secret):
        assert f not in out
    assert form(secret) not in out


@pytest.mark.parametrize("how", ["-H", "env"])
def test_a_secret_that_is_no_utf8_is_refused_with_its_name(tmp_path: Path, how: str) -> None:
    """Bytes that are no UTF-8 (read back as surrogates) crashed the run with a traceback."""
    ids = write_ids(tmp_path / "ids.txt", ["a"])
    header = "X-Api-Key: ${ASYNCRAWL_T_BAD}" if how == "env" else "X-Api-Key: ab\udcffcdef"
    env = {**os.environ, "ASYNCRAWL_T_BAD": "ab\udcffcdef"}
    r = subprocess.run([sys.executable, "-m", "asyncrawl", "run", "--url", "http://127.0.0.1:9/{id}",
                        "--ids", str(ids), "--state", str(tmp_path / "st"), "-H", header,
                        "--dry-run"], capture_output=True, env=env, cwd=tmp_path)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and "Traceback" not in err, err
    assert ("${ASYNCRAWL_T_BAD} is not valid UTF-8" if how == "env"
            else "'X-Api-Key' or its value is not valid UTF-8") in err


def test_config_error_through_the_cli_never_quotes_a_secret(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[request]\nurl = "https://api.example.com/n/{id}"\n'
                 '[limits]\nrate = "${ASYNCRAWL_T_S}"\n', encoding="utf-8")
    r = run_cli("run", "-c", str(p), "--ids", str(write_ids(tmp_path / "ids", ["a"])),
                env={"ASYNCRAWL_T_S": SIG})
    assert r.returncode == 2
    assert "limits.rate" in r.stderr
    assert_no_secret(r.stdout, r.stderr, secrets=(SIG,))


def test_userinfo_password_in_the_template_is_secret() -> None:
    cfg = Config(url="https://crawler:pw-0c4d9e2f@api.example.com/n/{id}")
    assert "pw-0c4d9e2f" in cfg.secrets
    assert "pw-0c4d9e2f" not in repr(cfg)
    assert "pw-0c4d9e2f" not in repr(RequestBuilder(cfg)("x"))


def test_request_repr_shows_no_credential() -> None:
    cfg = Config(url="https://api.example.com/n/{id}", params={"api_key": KEY, "q": "{id}"},
                 headers={"Authorization": f"Bearer {TOKEN}", "X-Api-Key": KEY})
    req = RequestBuilder(cfg)("x")
    assert KEY in str(req.url) or quote(KEY, safe="") in str(req.url)  # it is really there
    text = repr(req)
    assert_no_secret(text)
    assert "X-Api-Key" in text and "api_key=***" in text  # names stay, for debugging


@pytest.mark.parametrize("name", ["bad-length", "not-http", "huge-header"])
async def test_aiohttp_errors_quoting_the_url_are_redacted(hostile: Hostile,
                                                           session: aiohttp.ClientSession,
                                                           name: str) -> None:
    """aiohttp's ClientResponseError quotes the URL with its query: ``?api_key=sk%2Blive...``
    (http1's errors quote nothing of the request)."""
    a = await Fetcher(session, hostile_config(hostile.item_url)).attempt(name)
    assert a.outcome is Outcome.RETRY and a.status is None, a
    assert a.error is not None and "ClientResponseError" in a.error
    assert "api_key=***" in a.error  # the URL is there, the key is not
    assert_no_secret(a.error, repr(a))


async def test_secret_in_a_parameter_with_an_ordinary_name_is_redacted_when_encoded(
        hostile: Hostile, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(aiohttp's client: its errors quote the URL; http1's quote nothing of the request.)
    An ${ENV} value in ``?auth=`` travels percent-encoded; only its encoded form is in the
    error text, and no parameter-name rule applies: the encoded form must be redacted as such."""
    monkeypatch.setenv("ASYNCRAWL_T_AUTH", KEY)
    cfg = Config.from_dict({"request": {"url": hostile.item_url,
                                        "params": {"auth": "${ASYNCRAWL_T_AUTH}"}}})
    a = await Fetcher(session, cfg).attempt("bad-length")
    assert a.error is not None and "auth=***" in a.error
    assert_no_secret(a.error)


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_location_with_a_server_issued_token_is_redacted(hostile: Hostile, other: Hostile,
                                                               session: aiohttp.ClientSession) -> None:
    """Even a token asyncrawl never knew (a server-signed Location) is blanked by its name."""
    hostile.other = other.base
    cfg = Config(url=hostile.base + "/items/{id}")
    assert cfg.secrets == frozenset()
    a = await Fetcher(session, cfg).attempt("signed")
    assert a.outcome is Outcome.SKIP and a.status == 302
    assert a.error == f"redirect not followed: Location {other.base}/items/landed?token=***&n=1"


async def test_a_secret_cut_through_by_an_error_s_length_limit_is_still_redacted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session: aiohttp.ClientSession) -> None:
    """An error is cut to its length once redacted: cut first, a key in the URL's path that
    straddled the cut no longer matched, and 29 of its 30 characters were stored and logged
    (a redirect loop's Location, with a long ID: a security audit). A config value of the
    wrong type quotes 40 characters of it, redacted first too."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    secret = "pathsecret0123456789abcdef" + os.urandom(4).hex()
    monkeypatch.setenv("ASYNCRAWL_T_S", secret)

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.rel_url)

    app = web.Application()
    app.router.add_get("/{tail:.*}", loop)
    async with TestServer(app, host="127.0.0.1") as server:
        for pad in range(400, 440, 3):  # (wherever the cut falls: in the key, or around it)
            p = tmp_path / "c.toml"
            p.write_text(f'[request]\nurl = "http://127.0.0.1:{server.port}/items/{{id}}/tok/'
                         '${ASYNCRAWL_T_S}"\nmax_redirects = 1\n', encoding="utf-8")
            a = await Fetcher(session, Config.load(p)).attempt("loop" + "A" * pad)
            assert a.error is not None and "too many redirects" in a.error
            assert secret[:8] not in a.error, (pad, a.error[-60:])
    p.write_text('[request]\nurl = "https://h.example/{id}"\ntimeout = "${ASYNCRAWL_T_S}"\n',
                 encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert "timeout" in str(e.value) and secret[:8] not in str(e.value)


def dir_bytes(d: Path) -> list[bytes]:
    return [p.read_bytes() for p in d.rglob("*") if p.is_file()]


@pytest.mark.parametrize("client", ["aiohttp", "http1"])
def test_a_hostile_job_writes_no_secret_anywhere(tmp_path: Path, hostile: Hostile, other: Hostile,
                                                 client: str) -> None:
    """A full CLI job against every misbehaviour at once, the key in a parameter (with characters
    that get percent-encoded), a Bearer header, a cookie and an ${ENV} header; then every byte
    asyncrawl wrote (stdout, stderr, log file, state directory, exports) is searched."""
    hostile.other = other.base
    names = ["ok", "plain-json", "html", "bad-json", "error-in-body", "bomb", "stall-headers",
             "stall-body", "hangup", "bad-length", "not-http", "huge-header", "out", "hop"]
    ids = write_ids(tmp_path / "ids.txt", [*names, *(f"n{i}" for i in range(30))])
    state = tmp_path / "state"
    env = {"ASYNCRAWL_TEST_KEY": KEY, "ASYNCRAWL_T_TOKEN": TOKEN, "ASYNCRAWL_T_SIG": SIG,
           "ASYNCRAWL_HTTP": "auto" if client == "http1" else client}
    conf = write_config(tmp_path / "c.toml", hostile.item_url, state, ids,
                        request={"read_timeout": 0.3, "max_body_bytes": 100_000,
                                 "follow_redirects": "any"},
                        request__params={"api_key": "${ASYNCRAWL_TEST_KEY}", "q": "{id}"},
                        request__headers={"Authorization": "Bearer ${ASYNCRAWL_T_TOKEN}",
                                          "Cookie": "sid=${ASYNCRAWL_TEST_KEY}",
                                          "X-Signature": "v1 ${ASYNCRAWL_T_SIG}"},
                        response={"error_field": "error.code"},
                        limits={"breaker": False},
                        retry={"max_tries": 2})
    log_file = tmp_path / "run.log"
    outputs: list[str] = []
    r = run_cli("run", "-c", str(conf), "--log-file", str(log_file), "--log-format", "json", env=env)
    outputs += [r.stdout, r.stderr]
    assert r.returncode == 0, r.stderr  # the second pass settles what failed as unavailable
    s = json.loads(run_cli("status", "-c", str(conf), "--json", env=env).stdout)
    assert (s["ok"], s["unavailable"]) == (34, 10)  # ok, plain-json, hop/out (landed) + 30 others
    for outcome in ("ok", "unavailable", "failed", "in-doubt"):
        for fmt in ("jsonl", "csv", "ids"):
            r = run_cli("export", "-c", str(conf), "--outcome", outcome, "--format", fmt, env=env)
            assert r.returncode == 0, r.stderr
            outputs += [r.stdout, r.stderr]
    r = run_cli("export", "-c", str(conf), "--outcome", "unavailable", env=env)
    unavailable = [json.loads(x) for x in r.stdout.splitlines()]
    errors = " ".join(str(u["error"]) for u in unavailable)
    if client == "aiohttp":  # (its errors quote the URL: they were there, redacted)
        assert "ClientResponseError" in errors and "api_key=***" in errors
    else:
        assert "ProtocolError" in errors
    r = run_cli("status", "-c", str(conf), env=env)
    outputs += [r.stdout, r.stderr]
    blobs = [o.encode() for o in outputs] + dir_bytes(state) + [log_file.read_bytes()]
    assert sum(map(len, blobs)) > 5_000
    assert_no_secret(*blobs)
    # the key did go to the API (every form it takes on the wire), and never to the other origin
    assert any(quote(KEY, safe="").encode() in q.raw for q in hostile.requests)
    assert any(TOKEN.encode() in q.raw for q in hostile.requests)
    assert len(other.requests) == 2  # "out" and "hop" landed there
    assert_no_secret(*(q.raw for q in other.requests))


@pytest.mark.parametrize("name", ["client_secret", "private_token", "api_token", "auth",
                                  "access_key", "X-Amz-Signature"])
def test_a_literal_credential_in_a_common_parameter_name_is_never_written(
        tmp_path: Path, hostile: Hostile, name: str) -> None:
    """Only a few exact names counted as credentials in a query: the value of client_secret,
    private_token (GitLab), auth (Firebase) or access_key, written literally in the template
    or in [request.params], went into state.db's job and run records in clear."""
    secret = f"Lit{name.replace('-', '')}Secret9"
    ids = write_ids(tmp_path / "ids.txt", ["ok", "n1", "n2"])
    state = tmp_path / "state"
    conf = write_config(tmp_path / "c.toml", f"{hostile.item_url}?{name}={secret}", state, ids,
                        request__params={f"x_{name}": secret})
    outputs = []
    for args in (["run", "-c", str(conf), "--log-format", "json"], ["status", "-c", str(conf)],
                 ["export", "-c", str(conf), "--outcome", "ok"]):
        r = run_cli(*args, env={"ASYNCRAWL_TEST_KEY": KEY})
        assert r.returncode == 0, r.stderr
        outputs += [r.stdout, r.stderr]
    assert any(secret.encode() in q.raw for q in hostile.requests)  # it went to the API
    assert_no_secret(*outputs, *dir_bytes(state), secrets=(secret,))


def test_the_job_check_still_sees_ordinary_parameters_and_resumes_states_of_before() -> None:
    """Names like max_tokens or sort_key are not credentials: the state's job identity keeps
    their values, so a run with another value is another job. A state written while
    client_secret's value was kept in clear resumes with the same config."""
    from asyncrawl import JobMismatch
    from asyncrawl.config import check_job

    def config(tokens: str, sort: str = "a") -> Config:
        return Config(url="http://h/items/{id}?client_secret=S3cretValue&page_token=p",
                      params={"max_tokens": tokens, "sort_key": sort, "x_auth": "A1b2c3"},
                      state_dir="unused")

    ident = config("256").job_identity()
    assert "S3cretValue" not in str(ident) and "A1b2c3" not in str(ident)
    check_job(config("256"), ident)
    for other in (config("1024"), config("256", sort="b")):
        with pytest.raises(JobMismatch):
            check_job(other, ident)
    before = {**ident, "url": "http://h/items/{id}?client_secret=S3cretValue&page_token=p",
              "params": {**ident["params"], "x_auth": "A1b2c3"}}
    check_job(config("256"), before)


def test_the_job_check_sees_env_values_in_the_host() -> None:
    """Every ${ENV} value is a secret, kept redacted in the state's job identity: a state of a
    job against ``http://${API_HOST}/...`` (staging) took production's for its own, settled
    IDs and all. Another API key, in a parameter of any name, is still the same job; a host
    unset (a dry run, status) is nothing to compare."""
    from asyncrawl import JobMismatch
    from asyncrawl.config import UNSET_ENV, check_job

    def config(host: str, key: str = "k-1234567") -> Config:
        return Config(url=f"http://{host}/items/{{id}}?api_key={key}",
                      params={"user_key": key}, secrets=frozenset({host, key}),
                      state_dir="unused")

    ident = config("Staging.Example.com").job_identity()
    assert not any(v in str(ident).lower() for v in ("staging", "k-1234567"))
    check_job(config("Staging.Example.com", key="k-7654321"), ident)
    check_job(config("staging.example.com"), ident)
    check_job(config(UNSET_ENV + "API_HOST"), ident)
    for other in ("Prod.Example.com", "staging.example.com:8443"):
        with pytest.raises(JobMismatch, match=r"\$\{ENV\} values in its URL's host"):
            check_job(config(other), ident)
    before = {k: v for k, v in ident.items() if k != "address"}  # (an earlier release's)
    check_job(config("Prod.Example.com"), before)


# -- 2. redirects: credentials never cross origins -----------------------------------------------


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
@pytest.mark.parametrize("follow", ["same-origin", "any", "none"])
@pytest.mark.parametrize("start", ["out", "hop"])
async def test_other_origin_never_sees_the_key(hostile: Hostile, other: Hostile,
                                               session: aiohttp.ClientSession, follow: str,
                                               start: str) -> None:
    """The API redirects to 127.0.0.2 and even echoes the request's query (api_key included)
    into the Location. With the default (same-origin) the other origin gets no request at all;
    with ``any`` it gets one that carries no header, parameter or value that is a secret."""
    hostile.other = other.base
    a = await Fetcher(session, hostile_config(hostile.item_url, follow_redirects=follow)).attempt(start)
    assert_no_secret(*(q.raw for q in other.requests))
    assert_no_secret(repr(a))
    if follow == "any":
        assert a.outcome is Outcome.OK, a
        (landed,) = other.requests
        assert landed.target.startswith("/items/landed?q=")  # the ordinary parameter went along
        assert b"X-Client: asyncrawl-tests" in landed.raw  # and so did the ordinary header
        assert b"Authorization" not in landed.raw and b"Cookie" not in landed.raw
        assert b"X-Signature" not in landed.raw
    else:
        assert other.requests == []
        assert a.outcome is Outcome.SKIP and a.status in (302, 307), a
        assert a.error is not None and "redirect not followed" in a.error
        if follow == "same-origin" and start == "hop":
            assert hostile.names() == ["hop", "out"]  # the same-origin hop was followed, keyed
            assert all(TOKEN.encode() in q.raw for q in hostile.requests)


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_303_after_post_does_not_resend_the_body(hostile: Hostile,
                                                       session: aiohttp.ClientSession) -> None:
    from asyncrawl.fetch import Request as Req

    cfg = Config(url=hostile.item_url)
    fetcher = Fetcher(session, cfg, request_for=lambda i: Req(
        "POST", RequestBuilder(cfg)(i).url, {}, {"secret_query": "body-9f8e7d"}))
    a = await fetcher.attempt("see-other")
    assert a.outcome is Outcome.OK, a
    first, second = hostile.requests
    assert first.raw.startswith(b"POST ") and b"body-9f8e7d" in first.raw
    assert second.raw.startswith(b"GET /items/ok") and b"body-9f8e7d" not in second.raw


# -- 3. URLs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://api.example.com/a b/{id}", "whitespace"),
        ("https://api.example.com/a\tb/{id}", "whitespace"),
        ("https://api.example.com/{id}\r\nX-Evil: 1", "whitespace"),
        ("https://api.example.com:99999/{id}", "invalid URL"),
        ("https://api.example.com:https/{id}", "invalid URL"),
        ("https://api.example.com/a%zz/{id}", "%25"),
        ("https://bücher.example/{id}", "punycode"),
        ("https://api.example.com/{id}?x={id}#{id}", "fragment"),
        ("http://{id}:80/x", "host"),
        ("mailto:{id}@example.com", "http://"),
        ("//api.example.com/{id}", "http://"),
    ],
)
def test_bad_url_templates_are_refused_at_startup(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config(url=url)
    assert e.value.key == "request.url"
    assert why in str(e.value)


def test_non_ascii_in_the_template_path_is_sent_percent_encoded() -> None:
    cfg = Config(url="https://api.example.com/notizen/grüße/{id}?sort=größe&x=a%2Cb")
    req = RequestBuilder(cfg)("ü/x")
    assert req.url.raw_path == "/notizen/gr%C3%BC%C3%9Fe/" + encode_id("ü/x")
    assert req.url.raw_query_string == "sort=gr%C3%B6%C3%9Fe&x=a%2Cb"
    assert req.url.raw_path.isascii()


@pytest.mark.parametrize("item", ["../admin", "a/b", "x?y=1", "%2e%2e", "#f", "sp ace", "ünï",
                                  "..", "x" * 1024, "a&api_key=stolen", "@127.0.0.2", "\\..\\x"])
@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_hostile_ids_cannot_move_the_request(hostile: Hostile, session: aiohttp.ClientSession,
                                                   item: str) -> None:
    cfg = Config(url=hostile.base + "/v1/items/{id}", params={"api_key": KEY, "q": "{id}"})
    a = await Fetcher(session, cfg).attempt(item)
    assert a.outcome is Outcome.OK, a
    (req,) = hostile.requests
    path, _, query = req.target.partition("?")
    assert path == "/v1/items/" + encode_id(item)
    assert query == f"api_key={quote(KEY, safe='')}&q={encode_id(item)}"
    assert a.data == {"id": item}


# -- 4. TLS --------------------------------------------------------------------------------------


@dataclass
class Pki:
    ca_a: Path  # signs server A's certificate
    ca_b: Path  # signs server B's certificate
    server_a: ssl.SSLContext
    server_b: ssl.SSLContext


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Two throwaway CAs, each with a server certificate for 127.0.0.1 (``openssl`` command)."""
    if shutil.which("openssl") is None:  # pragma: no cover
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("pki")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    contexts = {}
    for n in ("a", "b"):
        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        run("req", "-x509", *ec, "-keyout", f"ca_{n}.key", "-out", f"ca_{n}.pem", "-days", "2",
            "-subj", f"/CN=asyncrawl test CA {n}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        run("req", *ec, "-keyout", f"srv_{n}.key", "-out", f"srv_{n}.csr", "-subj", "/CN=127.0.0.1")
        run("x509", "-req", "-in", f"srv_{n}.csr", "-CA", f"ca_{n}.pem", "-CAkey", f"ca_{n}.key",
            "-set_serial", "7", "-days", "2", "-out", f"srv_{n}.pem", "-extfile", "ext.cnf")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(d / f"srv_{n}.pem", d / f"srv_{n}.key")
        contexts[n] = ctx
    return Pki(d / "ca_a.pem", d / "ca_b.pem", contexts["a"], contexts["b"])


@pytest.fixture
def tls_a(pki: Pki) -> Iterator[Hostile]:
    with Hostile(tls=pki.server_a) as h:
        yield h


@pytest.fixture
def tls_b(pki: Pki) -> Iterator[Hostile]:
    with Hostile(tls=pki.server_b) as h:
        yield h


@pytest.fixture
async def tls_session() -> Any:
    async with aiohttp.ClientSession() as s:
        yield s
    await tls_settle()


async def tls_settle() -> None:
    """Let closed TLS connections finish their shutdown before the loop ends (aiohttp's advice
    for a graceful close; otherwise the loop closes under them: "unclosed transport")."""
    await asyncio.sleep(0.25)


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_tls_is_verified_by_default(tls_a: Hostile, tls_session: aiohttp.ClientSession) -> None:
    a = await Fetcher(tls_session, Config(url=tls_a.item_url)).attempt("ok")
    assert a.outcome is Outcome.RETRY and a.status is None, a
    assert a.error is not None and "certificate" in a.error and "ca_bundle" in a.error
    assert tls_a.requests == []  # not one byte of HTTP went out


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_a_certificate_for_another_host_says_so_not_to_add_a_ca(
        pki: Pki, tls_session: aiohttp.ClientSession) -> None:
    """Every certificate failure said to add the server's private CA (ca_bundle), a CA that
    is already trusted here: the certificate is for 127.0.0.1, the server at 127.0.0.2."""
    with Hostile(host="127.0.0.2", tls=pki.server_a) as other:
        cfg = Config(url=other.item_url, ca_bundle=str(pki.ca_a))
        a = await Fetcher(tls_session, cfg).attempt("ok")
    assert a.outcome is Outcome.RETRY and a.error is not None, a
    assert "for another host" in a.error and "ca_bundle" not in a.error, a.error


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_ca_bundle_is_trusted(tls_a: Hostile, pki: Pki, tls_session: aiohttp.ClientSession) -> None:
    a = await Fetcher(tls_session, Config(url=tls_a.item_url, ca_bundle=str(pki.ca_a))).attempt("ok")
    assert a.outcome is Outcome.OK, a
    assert a.data == {"id": "ok"}


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_ca_bundle_adds_to_the_system_trust(tls_a: Hostile, tls_b: Hostile, pki: Pki,
                                                  tls_session: aiohttp.ClientSession,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """CA B stands in for the system's trust store (OpenSSL reads SSL_CERT_FILE); ``ca_bundle``
    adds CA A: both servers verify, so the bundle did not replace the system's CAs."""
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_b))
    fetch = Fetcher(tls_session, Config(url=tls_a.base + "/items/{id}", ca_bundle=str(pki.ca_a)))
    assert (await fetch.attempt("ok")).outcome is Outcome.OK
    fetch_b = Fetcher(tls_session, Config(url=tls_b.base + "/items/{id}", ca_bundle=str(pki.ca_a)))
    b = await fetch_b.attempt("ok")
    assert b.outcome is Outcome.OK, b


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_verify_off_works_and_warns(tls_a: Hostile, tls_session: aiohttp.ClientSession) -> None:
    with asyncrawl_log() as lines:
        a = await Fetcher(tls_session, Config(url=tls_a.item_url, verify_tls=False)).attempt("ok")
    assert a.outcome is Outcome.OK, a
    assert lines == [INSECURE_WARNING]
    assert "TLS certificate verification is OFF" in INSECURE_WARNING


@pytest.mark.parametrize(("content", "why"), [(None, "not found"), ("not a certificate", "PEM")])
def test_bad_ca_bundle_is_a_config_error(tmp_path: Path, content: str | None, why: str) -> None:
    p = tmp_path / "ca.pem"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ConfigError) as e:
        Config(url="https://h.example/{id}", ca_bundle=str(p))
    assert e.value.key == "request.ca_bundle" and why in str(e.value)


async def test_tls_through_a_whole_run(tls_a: Hostile, pki: Pki, tmp_path: Path) -> None:
    """Default: a certificate that does not verify on the first requests stops the run at once
    (exit 2, with the fix: waiting cannot cure it); ``verify_tls = false`` fetches and warns on
    every run."""
    ids = ["t1", "t2", "t3"]
    base = dict(url=tls_a.item_url, max_tries=2, backoff_base=0.01, backoff_max=0.02,
                second_pass=False, breaker=False, rate=1000.0)
    async with Crawler(Config(**base, state_dir=str(tmp_path / "s1"))) as c:
        s = await asyncio.wait_for(c.run(ids), 30)
    assert (s.ok, s.exit_code) == (0, 2)
    assert s.halt is not None and s.halt.reason == "unreachable"
    assert "TLS certificate verification failed" in s.halt.message
    assert "ca_bundle" in s.halt.message
    assert tls_a.requests == []

    insecure = Config(**base, state_dir=str(tmp_path / "s2"), verify_tls=False)
    with asyncrawl_log() as lines:
        for _ in range(2):  # the second run has nothing left to fetch: it warns all the same
            async with Crawler(insecure) as c:
                s = await asyncio.wait_for(c.run(ids), 30)
            assert s.ok == 3
    await tls_settle()
    assert lines.count(INSECURE_WARNING) == 2


@pytest.mark.parametrize("how", ["flag", "config"])
def test_cli_insecure_warns_on_every_run(tls_a: Hostile, tmp_path: Path, how: str) -> None:
    ids = write_ids(tmp_path / "ids.txt", ["c1", "c2"])
    extra = {"request": {"verify_tls": False}} if how == "config" else {}
    conf = write_config(tmp_path / "c.toml", tls_a.item_url, tmp_path / "state", ids, **extra)
    flags = ["--insecure"] if how == "flag" else []
    for _ in range(2):
        r = run_cli("run", "-c", str(conf), "--no-progress", *flags, env={"ASYNCRAWL_TEST_KEY": "k-123"})
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("TLS certificate verification is OFF") == 1, r.stderr
    assert len(tls_a.requests) == 2


def test_cli_default_refuses_an_untrusted_certificate(tls_a: Hostile, pki: Pki, tmp_path: Path) -> None:
    ids = write_ids(tmp_path / "ids.txt", ["c1"])
    conf = write_config(tmp_path / "c.toml", tls_a.item_url, tmp_path / "state", ids)
    env = {"ASYNCRAWL_TEST_KEY": "k-123"}
    r = run_cli("run", "-c", str(conf), "--no-progress", "--no-second-pass", env=env)
    assert r.returncode == 2, r.stderr
    assert "verification is OFF" not in r.stderr
    assert "TLS certificate verification failed" in r.stdout + r.stderr
    assert "ca_bundle" in r.stderr
    # with the CA as ca_bundle, a rerun fetches it
    conf = write_config(tmp_path / "c.toml", tls_a.item_url, tmp_path / "state", ids,
                        request={"ca_bundle": str(pki.ca_a)})
    r = run_cli("run", "-c", str(conf), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert tls_a.names() == ["c1"]


# -- 5. hostile responses ------------------------------------------------------------------------


def outcomes(state: Path) -> dict[str, dict[str, Any]]:
    """ID -> its outcome as the state database has it, in the record's short keys (``k``
    outcome, ``s`` status, ``e`` error, ``perm``, ``n`` tries, ``data``)."""
    out: dict[str, dict[str, Any]] = {}
    for item, state_, status, error, tries, data in db_rows(
            state, "SELECT i.id, i.state, i.status, i.error, i.tries, r.data FROM items i "
                   "JOIN results r ON r.id = i.id"):
        out[item] = {"k": "failed" if state_ == "perm" else state_, "s": status, "e": error,
                     "perm": state_ == "perm", "n": tries,
                     "data": json.loads(data) if data is not None else None}
    return out


@pytest.mark.parametrize("client", ["aiohttp", "http1"])
async def test_every_misbehaviour_is_classified_and_recorded(hostile: Hostile, tmp_path: Path,
                                                            client: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One run through ``Crawler.run`` against every kind of bad answer: each ID gets a record
    with a clear status and error, no worker dies, and the run ends."""
    expected: dict[str, tuple[str, int | None, bool, str]] = {
        # id: (kind, status, permanent, error contains)
        "ok": ("ok", 200, False, ""),
        "plain-json": ("ok", 200, False, ""),
        "html": ("failed", 200, False, "not valid JSON"),
        "bad-json": ("failed", 200, False, "not valid JSON"),
        "error-in-body": ("failed", 404, True, "HTTP 200, body code 404"),
        "bomb": ("failed", 200, False, "larger than 100000"),  # (paid for: paid_retries)
        "stall-headers": ("failed", None, False, "sent nothing for 0.3s"),
        "stall-body": ("failed", 200, False, "sent nothing for 0.3s"),  # (its head came)
        "drip": ("failed", 200, False, "timeout"),
        "hangup": ("failed", None, False, "ServerDisconnectedError"),
        "bad-length": ("failed", None, False, "ClientResponseError"),
        "not-http": ("failed", None, False, "ClientResponseError"),
        "huge-header": ("failed", None, False, "ClientResponseError"),
    }
    monkeypatch.setenv("ASYNCRAWL_HTTP", "auto" if client == "http1" else client)
    if client == "http1":  # (the crawler's own session: http1 sends)
        expected |= {"hangup": ("failed", None, False, "Disconnected: the server closed"),
                     "bad-length": ("failed", None, False, "ProtocolError: invalid HTTP answer"),
                     "not-http": ("failed", None, False, "ProtocolError: invalid HTTP answer"),
                     "huge-header": ("failed", None, False, "ProtocolError: a header over")}
    state = tmp_path / "state"
    ids = [*expected, *(f"fine-{i}" for i in range(20))]
    t0 = time.monotonic()
    async with Crawler(hostile_config(hostile.item_url, state)) as crawler:
        summary = await asyncio.wait_for(crawler.run(ids), 60)
    took = time.monotonic() - t0
    assert summary.halt is None
    assert (summary.ok, summary.failed, summary.pending) == (22, 11, 0)
    assert summary.exit_code == 6
    records = outcomes(state)
    assert set(records) == set(ids)
    for item, (kind, status, permanent, text) in expected.items():
        rec = records[item]
        assert (rec["k"], rec.get("s"), rec.get("perm", False)) == (kind, status, permanent), rec
        assert text in (rec.get("e") or ""), rec
        if kind == "failed" and not permanent:
            assert rec["n"] == 2  # retried up to max_tries
        if kind == "ok":
            assert rec["data"] == {"id": item}
    # the total bounds a server that never goes silent
    assert records["drip"]["e"].startswith("HTTP 200, its body not whole: timeout;")
    assert took < 30  # two tries of the 1.5 s total for "drip" dominate
    assert_no_secret(b"".join(p.read_bytes() for p in state.glob("state.db*")))


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_read_timeout_catches_a_silent_server_long_before_the_total(
        hostile: Hostile, session: aiohttp.ClientSession) -> None:
    """``read_timeout`` (aiohttp's sock_read) covers the wait for the first byte and stalls
    mid-body; ``timeout`` stays the bound on the whole attempt."""
    cfg = Config(url=hostile.item_url, timeout=20.0, read_timeout=0.3)
    for name in ("stall-headers", "stall-body"):
        t0 = time.monotonic()
        a = await Fetcher(session, cfg).attempt(name)
        assert 0.25 < time.monotonic() - t0 < 3
        assert a.outcome is Outcome.RETRY and a.error is not None
        assert a.error.endswith("timeout: the server sent nothing for 0.3s"), a.error


@pytest.mark.usefixtures("both_clients")  # aiohttp's client and http1's
async def test_connect_timeout(session: aiohttp.ClientSession) -> None:
    """A listener whose accept queue is full never completes the handshake."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                c = socket.socket()
                c.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    c.connect(("127.0.0.1", port))
                fillers.append(c)
            await asyncio.sleep(0.1)
            cfg = Config(url=f"http://127.0.0.1:{port}/items/{{id}}", timeout=20.0, connect_timeout=0.3)
            t0 = time.monotonic()
            a = await Fetcher(session, cfg).attempt("x")
        finally:
            for c in fillers:
                c.close()
    assert time.monotonic() - t0 < 3
    assert a.outcome is Outcome.RETRY and a.error == "timeout: no connection within 0.3s"


async def test_error_in_a_200_body_can_halt_the_job(hostile: Hostile, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = hostile_config(hostile.item_url, state, concurrency=1)
    async with Crawler(cfg) as crawler:
        summary = await asyncio.wait_for(crawler.run(["ok", "fatal-in-body", *(f"x{i}" for i in range(50))]),
                                         30)
    assert summary.halt is not None and summary.halt.reason == "fatal" and summary.halt.status == 402
    assert summary.exit_code == 3
    assert len(hostile.requests) < 10  # the job stopped at once
    halts = db_rows(state, "SELECT halt_status FROM runs WHERE halt_reason IS NOT NULL")
    assert halts and halts[-1][0] == 402


# -- 6. state directory and input files ----------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None, umask: int | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "asyncrawl", *args]
    if umask is not None:
        cmd = ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, cwd=ROOT)


def test_state_directory_is_owner_only_even_with_umask_000(hostile: Hostile, tmp_path: Path) -> None:
    state = tmp_path / "state"
    conf = write_config(tmp_path / "c.toml", hostile.item_url, state,
                        write_ids(tmp_path / "ids.txt", ["a", "b"]))
    r = run_cli("run", "-c", str(conf), "--no-progress", "--log-file", str(tmp_path / "run.log"),
                env={"ASYNCRAWL_TEST_KEY": "k-123"}, umask=0)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "run.log").stat().st_mode) == 0o600  # (0666, world-writable)
    from asyncrawl.live import LIVE, write_live
    from asyncrawl.types import Progress

    old = os.umask(0)
    try:  # (the figures of a run under way: written at its progress ticks, too few here)
        write_live(state, Progress(1, 2, 2, 2, 0, 0, 0, 0, 2, 0, 0, 1.0, 0.0, 1.0, None))
    finally:
        os.umask(old)
    assert stat.S_IMODE((state / LIVE).stat().st_mode) == 0o600
    assert (state / "state.db").exists()
    for path in state.glob("state.db*"):  # the database, and its -wal / -shm while they exist
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((state / "lock").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "intents.log").stat().st_mode) == 0o600


@pytest.mark.parametrize(("header", "message"), [
    (b'{"asyncrawl_journal": 99}\n', "journal format 99 was written by an incompatible asyncrawl"),
    (b'{"something": "else"}\n', "not an asyncrawl journal"),
])
def test_incompatible_state_directory_is_refused(hostile: Hostile, tmp_path: Path, header: bytes,
                                                 message: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / JOURNAL).write_bytes(header + b'{"k": "ok", "id": "a", "data": 1, "ts": 0}\n')
    before = (state / JOURNAL).read_bytes()
    conf = write_config(tmp_path / "c.toml", hostile.item_url, state,
                        write_ids(tmp_path / "ids.txt", ["a", "b"]))
    env = {"ASYNCRAWL_TEST_KEY": "k-123"}
    for args in (["run", "--no-progress"], ["status"], ["export"]):
        r = run_cli(*args, "-c", str(conf), env=env)
        assert r.returncode == 5, (args, r.stderr)
        assert message in r.stderr and str(state / JOURNAL) in r.stderr
        assert "Traceback" not in r.stderr
    assert hostile.requests == []
    assert (state / JOURNAL).read_bytes() == before  # left as it was


@pytest.mark.parametrize(("data", "where", "why"), [
    (b"a1\na2\nb\x00c\n", "ids.txt:3", "U+0000"),
    (b"a1\n\xc0\xafx\n", "ids.txt:2", "UTF-8"),
    (b"a1\n" + b"y" * 1025 + b"\n", "ids.txt:2", "limit"),
    (b"a1\r\nx\x1b[31m\r\n", "ids.txt:2", "U+001B"),
    (None, "ids.txt", "directory"),
])
def test_bad_ids_file_exits_2_before_any_request(hostile: Hostile, tmp_path: Path, data: bytes | None,
                                                 where: str, why: str) -> None:
    ids = tmp_path / "ids.txt"
    if data is None:
        ids.mkdir()
    else:
        ids.write_bytes(data)
    conf = write_config(tmp_path / "c.toml", hostile.item_url, tmp_path / "state", ids)
    r = run_cli("run", "-c", str(conf), "--no-progress", env={"ASYNCRAWL_TEST_KEY": "k-123"})
    assert r.returncode == 2, r.stderr
    assert where in r.stderr and why in r.stderr
    assert "Traceback" not in r.stderr
    assert hostile.requests == []


def test_messy_but_valid_ids_file_works(hostile: Hostile, tmp_path: Path) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_bytes(b"\xef\xbb\xbf  a1 \r\n\r\n\ta2\r\na1\r\n   \r\nsp ace\r\n\xc3\xbc")
    conf = write_config(tmp_path / "c.toml", hostile.item_url, tmp_path / "state", ids)
    r = run_cli("run", "-c", str(conf), "--no-progress", env={"ASYNCRAWL_TEST_KEY": "k-123"})
    assert r.returncode == 0, r.stderr
    assert sorted(unquote(n) for n in hostile.names()) == ["a1", "a2", "sp ace", "ü"]


@pytest.mark.parametrize("args", [
    ["run", "--url", "http://127.0.0.1:9/{id}", "--proxy", "http://u:PLAINPASS99@[::1"],
    ["status", "--state", "postgresql://u:PLAINPASS99@[::1/db"],
    ["status", "--state", "postgresql://u:PLAIN%ZZPASS99@127.0.0.1:9/db"],
    ["status", "--state", "postgresql://u@127.0.0.1:9/db?password=PLAINPASS99"],
], ids=["proxy", "pg-malformed", "pg-stray-percent", "pg-password-param"])
def test_a_password_in_a_url_that_cannot_be_read_is_not_printed(
        tmp_path: Path, args: list[str]) -> None:
    """A URL the config could not read never had its password known as a secret, and libpq
    quotes the URI (or the token) it refuses: the password was in the error."""
    pytest.importorskip("psycopg", reason="the postgres extra is not installed")
    ids = write_ids(tmp_path / "ids.txt", ["a"])
    extra = ["--ids", str(ids), "--state", str(tmp_path / "st")] if args[0] == "run" else []
    r = subprocess.run([sys.executable, "-m", "asyncrawl", *args, *extra], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)  # (no ./config.toml)
    assert r.returncode in (2, 5) and "asyncrawl: error:" in r.stderr, r.stderr
    assert "PASS99" not in r.stderr + r.stdout and "ZZPASS" not in r.stderr, r.stderr


def test_scrubbing_url_credentials_leaves_ordinary_urls_alone() -> None:
    """A port, then an "@" in the path or query, was taken for a password: the message showed
    another host (``http://api.example.com:***@example.com``)."""
    from asyncrawl.errors import without_credentials

    for plain in ("http://api.example.com:8443/v1/users/bob@example.com",
                  "https://api.example.com:443/search?q=a@b.com", "mailto:a@b.com"):
        assert without_credentials(plain) == plain
    for secret, text in (("PASS99", "http://u:PASS99@[::1"), ("p@ss", "postgresql://u:p@ss@h/db"),
                         ("a b", "password='a b' host=x"), ("abc", "pwd=abc&x=1"),
                         ("PASS99", "postgresql://u@h/db?password=PASS99")):
        assert secret not in without_credentials(text), text


def test_the_alert_command_keeps_variables_a_short_secret_is_only_part_of() -> None:
    """A variable holding a secret, or a URL with one in it, is kept from the on_halt
    command; one that a short secret is merely part of is not (a key "usr" took PATH away:
    the command could not be found; a review)."""
    from asyncrawl.alerts import _holds_secret

    cfg = Config(url="https://h.example/{id}", headers={"X-Api-Key": "usr"})
    assert _holds_secret("usr", cfg)
    assert _holds_secret("http://u:usr@proxy.example:3128", cfg)
    assert not _holds_secret("/usr/local/bin:/usr/bin:/bin", cfg)
