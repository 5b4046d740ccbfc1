"""The requests real APIs need: a JSON or form body with the ID (POST/PUT/PATCH), and proxies
(``[request] proxy``, and HTTP_PROXY / NO_PROXY from the environment), against real servers
on loopback: an aiohttp app that records what it got, and a forward proxy of our own."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from asyncrawl import Config, ConfigError, Crawler

from .conftest import KEY, cli, write_config, write_ids

ODD = ['a"b\\c', "x/y", "p&q=r", "ünï", "plain"]  # IDs that break naive string building


class Recorder:
    """An API that takes the ID in the body: records method, content type and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.headers.get("Content-Type", ""), body))
        ctype = request.headers.get("Content-Type", "").split(";")[0]
        if ctype == "application/json":
            item = json.loads(body)["note_id"]
        elif ctype == "application/x-www-form-urlencoded":
            item = (await request.post())["note_id"]
        else:
            item = body.decode()
        return web.json_response({"id": item, "title": f"note {item}"})


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/v1/notes/query", rec.handle)
    runner, base = await serve(app)
    yield rec, base
    await runner.cleanup()


def config(base: str, tmp_path: Path, **kw: Any) -> Config:
    return Config(url=base + "/v1/notes/query", state_dir=str(tmp_path / "state"),
                  rate=1000.0, concurrency=4, cooldown=0.0, max_tries=2, backoff_base=0.01,
                  **kw)


async def test_json_body_carries_each_id_as_a_string_value(recorder: Any, tmp_path: Path) -> None:
    rec, base = recorder
    cfg = config(base, tmp_path, method="POST",
                 json={"note_id": "{id}", "fields": ["title"], "n": 1, "label": "id {id}!"})
    got: dict[str, Any] = {}
    async with Crawler(cfg, on_result=lambda r: got.__setitem__(r.id, r.data)) as c:
        s = await c.run(ODD)
    assert s.ok == len(ODD) and s.halt is None
    bodies = [json.loads(b) for m, ct, b in rec.seen]
    assert {m for m, _, _ in rec.seen} == {"POST"}
    assert {ct for _, ct, _ in rec.seen} == {"application/json"}
    assert sorted(b["note_id"] for b in bodies) == sorted(ODD)  # quotes, backslashes intact
    assert all(b["fields"] == ["title"] and b["n"] == 1 and b["label"] == f"id {b['note_id']}!"
               for b in bodies)
    assert got['a"b\\c'] == {"id": 'a"b\\c', "title": 'note a"b\\c'}


async def test_form_body_encodes_the_id(recorder: Any, tmp_path: Path) -> None:
    rec, base = recorder
    cfg = config(base, tmp_path, method="PUT", body="note_id={id}&v=1",
                 content_type="application/x-www-form-urlencoded")
    async with Crawler(cfg) as c:
        s = await c.run(ODD)
    assert s.ok == len(ODD)
    assert {m for m, _, _ in rec.seen} == {"PUT"}
    # the server decoded note_id back to each ID: "&" and "=" in an ID did not split the form
    assert all(b"v=1" in b for _, _, b in rec.seen)


async def test_a_form_type_given_as_a_header_form_encodes_the_id(recorder: Any,
                                                                   tmp_path: Path) -> None:
    """``-H 'Content-Type: application/x-www-form-urlencoded' --data 'note_id={id}'`` (the
    command line has no other way to type a body) sent the ID raw: ``p&q=r`` reached the
    server as note_id ``p`` plus a field ``q``, and was paid for and recorded as ``p&q=r``."""
    from urllib.parse import parse_qs

    rec, base = recorder
    ids = write_ids(tmp_path / "ids.txt", ODD)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncrawl", "run", "--url", base + "/v1/notes/query",
        "--ids", str(ids), "--state", str(tmp_path / "state"), "-X", "POST",
        "-H", "content-type: application/x-www-form-urlencoded", "--data", "note_id={id}&v=1",
        "--no-progress", cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    forms = [parse_qs(b.decode(), keep_blank_values=True, strict_parsing=True)
             for _, _, b in rec.seen]
    assert sorted(f["note_id"][0] for f in forms) == sorted(ODD)
    assert all(set(f) == {"note_id", "v"} for f in forms)


async def test_cli_posts_a_json_body_from_the_command_line(recorder: Any, tmp_path: Path) -> None:
    rec, base = recorder
    ids = write_ids(tmp_path / "ids.txt", ODD)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncrawl", "run", "--url", base + "/v1/notes/query",
        "--ids", str(ids), "--state", str(tmp_path / "state"), "-X", "POST",
        "--json", '{"note_id": "{id}"}', "--no-progress", cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert sorted(json.loads(b)["note_id"] for _, _, b in rec.seen) == sorted(ODD)


def test_a_body_needs_a_method_that_takes_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs POST, PUT or PATCH"):
        Config(url="http://127.0.0.1:1/q", json={"id": "{id}"})
    with pytest.raises(ConfigError, match="not both"):
        Config(url="http://127.0.0.1:1/q", method="POST", json={"id": "{id}"}, body="{id}")
    with pytest.raises(ConfigError, match=r"must contain \{id\}"):
        Config(url="http://127.0.0.1:1/q", method="POST", json={"id": "fixed"})
    r = cli("run", "--url", "http://127.0.0.1:1/q", "--ids", str(write_ids(tmp_path / "i", ["a"])),
            "--state", str(tmp_path / "s"), "-X", "POST", "--json", "{not json", cwd=tmp_path)
    assert r.returncode == 2 and "--json" in r.stderr


# -- proxies ------------------------------------------------------------------------------------


class ForwardProxy:
    """A plain HTTP forward proxy: takes absolute-form requests, fetches them, records them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []  # (absolute URL, Proxy-Authorization)
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path  # the request line's target: absolute-form through a proxy
        target = raw if raw.startswith("http://") else f"http://{request.host}{raw}"
        self.seen.append((target, request.headers.get("Proxy-Authorization")))
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "proxy-authorization", "proxy-connection")}
        async with self.session.request(request.method, target, headers=headers,
                                        data=await request.read()) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[ForwardProxy, str]]:
    p = ForwardProxy()
    p.session = aiohttp.ClientSession()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", p.handle)
    runner, base = await serve(app)
    yield p, base
    await runner.cleanup()
    await p.session.close()


async def test_request_proxy_key_sends_every_request_through_it(
        recorder: Any, proxy: Any, tmp_path: Path) -> None:
    rec, base = recorder
    p, proxy_base = proxy
    secret = "pr0xy-s3cret-pw"
    url = proxy_base.replace("http://", f"http://crawler:{secret}@")
    cfg = config(base, tmp_path, method="POST", json={"note_id": "{id}"}, proxy=url)
    assert secret in cfg.secrets and secret not in repr(cfg) and secret not in cfg.redact(url)
    async with Crawler(cfg) as c:
        s = await c.run(ODD)
    assert s.ok == len(ODD)
    assert len(p.seen) == len(ODD) == len(rec.seen)
    assert all(u == base + "/v1/notes/query" for u, _ in p.seen)
    assert all(auth and auth.startswith("Basic ") for _, auth in p.seen)  # its credentials


async def test_proxy_flag_expands_env_and_a_proxy_refusing_it_halts_the_job(
        mock_process: Any, proxy: Any, tmp_path: Path) -> None:
    """``--proxy`` takes ``${ENV}`` like ``-H`` and ``[request] proxy``; a proxy that refuses
    the credentials (407 for every request) halts the job (exit 3) instead of recording every
    ID as confirmed unavailable."""
    p, proxy_base = proxy
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"p{i}" for i in range(20)])
    secret = "pr0xy-fr0m-env"
    flag = proxy_base.replace("http://", "http://crawler:${ASYNCRAWL_TEST_PROXY_PW}@")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "s1", ids)
    code, err = await _cli("run", "-c", str(cfg), "--no-progress", "--proxy", flag,
                           env=_cli_env(ASYNCRAWL_TEST_PROXY_PW=secret))
    assert code == 0, err
    expected = "Basic " + base64.b64encode(f"crawler:{secret}".encode()).decode()
    assert len(p.seen) == 20 and {auth for _, auth in p.seen} == {expected}
    assert secret not in err

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=407, headers={"Proxy-Authenticate": 'Basic realm="p"'})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner, refusing = await serve(app)
    try:
        cfg2 = write_config(tmp_path / "c2.toml", mock.item_url, tmp_path / "s2", ids)
        code, err = await _cli("run", "-c", str(cfg2), "--no-progress", "--proxy", refusing,
                               env=_cli_env())
    finally:
        await runner.cleanup()
    assert code == 3, err
    r = cli("status", "-c", str(cfg2), "--json", env=_cli_env())
    assert json.loads(r.stdout)["unavailable"] == 0  # nothing given up on: a rerun fetches all


@pytest.mark.parametrize(("status", "code", "unavailable"), [(407, 3, 0), (502, 2, 0)])
async def test_a_proxy_refusing_an_https_tunnel_is_what_it_says(
        tmp_path: Path, status: int, code: int, unavailable: int) -> None:
    """An https:// API through a proxy: the proxy's answer to CONNECT comes as aiohttp's
    ClientHttpProxyError, which was taken for a dropped connection (possibly billed): a 407
    (credentials refused) was retried, every ID ended confirmed unavailable, exit 0, where the
    same 407 for an http:// API halts (exit 3). Now a 407 halts; another refusal of every
    tunnel is an unreachable API (exit 2); nothing of it reached the API, nor is billed."""
    tunnels: list[bytes] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        tunnels.append(head.split(b" ", 2)[0])
        writer.write(b"HTTP/1.1 %d Refused\r\nProxy-Authenticate: Basic realm=\"p\"\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n" % status)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ids = write_ids(tmp_path / "ids.txt", [f"t{i}" for i in range(6)])
    secret = "tunn3l-pw-77"
    try:
        code_got, err = await _cli(
            "run", "--url", "https://api.invalid:9/items/{id}", "--ids", str(ids), "--state",
            str(tmp_path / "state"), "--no-progress", "--max-tries", "2", "--rate", "100", "--cooldown", "0",
            "--proxy", f"http://crawler:{secret}@127.0.0.1:{port}", env=_cli_env(),
            cwd=tmp_path)
    finally:
        server.close()
        await server.wait_closed()
    assert code_got == code, err
    assert tunnels and set(tunnels) == {b"CONNECT"}
    assert secret not in err
    r = cli("status", "--state", str(tmp_path / "state"), "--json", env=_cli_env())
    st = json.loads(r.stdout)
    assert st["unavailable"] == unavailable and st["billable"] == 0
    assert st["no_answer"] == 0 and st["in_doubt"] == 0, st  # the API saw nothing
    if status == 407:
        assert st["halt"]["status"] == 407


async def test_a_proxy_whose_name_does_not_resolve_says_check_the_proxy(tmp_path: Path) -> None:
    """The hint said to check the host name of [request] url."""
    ids = write_ids(tmp_path / "ids.txt", ["a"])
    code, err = await _cli("run", "--url", "http://127.0.0.1:9/{id}", "--ids", str(ids),
                           "--state", str(tmp_path / "s"), "--no-progress", "--proxy",
                           "http://no-such-proxy.invalid:3128", env=_cli_env(), cwd=tmp_path)
    assert code == 2 and "the proxy's name no-such-proxy.invalid does not resolve" in err, err
    assert "check [request] proxy" in err


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    return {**env, "ASYNCRAWL_TEST_KEY": KEY, **extra}


async def _cli(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncrawl", *args, env=env, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_http_proxy_from_the_environment_is_used_and_no_proxy_bypasses_it(
        mock_process: Any, proxy: Any, tmp_path: Path) -> None:
    p, proxy_base = proxy
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"e{i}" for i in range(20)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "s1", ids)
    code, err = await _cli("run", "-c", str(cfg), "--no-progress",
                           env=_cli_env(HTTP_PROXY=proxy_base))
    assert code == 0, err
    assert len(p.seen) == 20  # through the proxy the environment names

    # a dead proxy in the environment: the run says so at once (exit 2), sends nothing ...
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    cfg2 = write_config(tmp_path / "c2.toml", mock.item_url, tmp_path / "s2", ids)
    code, err = await _cli("run", "-c", str(cfg2), "--no-progress", env=_cli_env(HTTP_PROXY=dead))
    assert code == 2, err
    assert "cannot connect to the proxy 127.0.0.1:9" in err and "HTTP_PROXY" in err
    # ... unless NO_PROXY exempts the API's host
    code, err = await _cli("run", "-c", str(cfg2), "--no-progress",
                           env=_cli_env(HTTP_PROXY=dead, NO_PROXY="127.0.0.1"))
    assert code == 0, err


@pytest.mark.parametrize(("no_proxy", "url", "direct"), [
    ("localhost,127.0.0.0/8", "http://127.0.0.1:8080/items/{id}", True),
    ("10.0.0.0/8", "https://10.20.30.40/items/{id}", True),
    ("10.0.0.0/8", "https://11.0.0.1/items/{id}", False),
    ("::1/128", "http://[::1]:8080/items/{id}", True),
    ("example.com", "https://api.example.com/items/{id}", True),
    ("192.168.0.0/16", "https://api.example.com/items/{id}", False),
])
def test_no_proxy_exempts_addresses_in_a_cidr_range(
        monkeypatch: pytest.MonkeyPatch, no_proxy: str, url: str, direct: bool) -> None:
    """NO_PROXY=10.0.0.0/8 (curl's and pip's form) was ignored: the stdlib matches names only,
    so an internal API's requests, key and all, went to the proxy (a README audit)."""
    from asyncrawl.fetch import env_proxy

    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    assert (env_proxy(url) is None) == direct
