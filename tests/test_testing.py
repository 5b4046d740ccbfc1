"""The mock API over real loopback, with a real aiohttp client (and as a separate process)."""

from __future__ import annotations

import asyncio
import collections
import email.utils
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from yarl import URL

from asyncrawl.testing import Fault, LogEntry, MockAPI, demo_faults, payload_for, read_log

KEY = {"X-Api-Key": "demo-key"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def fetch(
    session: aiohttp.ClientSession, api: MockAPI, item_id: str, *, method: str = "GET",
    headers: dict[str, str] | None = KEY,
) -> tuple[int, Any, bytes]:
    url = URL(api.url_for(item_id), encoded=True)
    async with session.request(method, url, headers=headers) as r:
        return r.status, r.headers, await r.read()


async def statuses(session: aiohttp.ClientSession, api: MockAPI, item_id: str, n: int) -> list[int]:
    return [(await fetch(session, api, item_id))[0] for _ in range(n)]


async def test_ok_payload_log_and_repr(session: aiohttp.ClientSession) -> None:
    async with MockAPI() as api:
        assert api.url.startswith("http://127.0.0.1:")
        assert api.item_url == api.url + "/items/{id}"
        status, headers, body = await fetch(session, api, "42")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert orjson.loads(body) == payload_for("42") == {
            "id": "42", "title": "Item 42", "value": payload_for("42")["value"]}
        assert api.paid() == ["42"] and api.starts() == ["42"]
        assert [(e.seq, e.event, e.id, e.status, e.authorized) for e in api.log] == [
            (0, "start", "42", None, True), (1, "end", "42", 200, True)]
        assert api.counts() == collections.Counter({200: 1})
        assert "requests=1" in repr(api) and "paid=1" in repr(api) and "unlimited" in repr(api)
        async with session.get(api.url + "/health") as r:
            assert r.status == 200
    assert "stopped" in repr(api)


@pytest.mark.parametrize(("kind", "status"), [
    ("not_found", 404), ("bad_request", 400), ("gone", 500)])
async def test_permanent_faults(session: aiohttp.ClientSession, kind: str, status: int) -> None:
    async with MockAPI(faults={"x": Fault(kind)}) as api:
        assert await statuses(session, api, "x", 3) == [status] * 3
        assert await statuses(session, api, "other", 1) == [200]
        assert api.paid() == ["other"]


async def test_flaky_then_ok(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("flaky", times=2)}) as api:
        assert await statuses(session, api, "x", 4) == [503, 503, 200, 200]
        assert api.paid() == ["x", "x"]


async def test_rate_limited_retry_after_seconds(session: aiohttp.ClientSession) -> None:
    faults = {"x": Fault("rate_limited", retry_after=3), "y": Fault("rate_limited", 2, 0.25)}
    async with MockAPI(faults=faults) as api:
        status, headers, _ = await fetch(session, api, "x")
        assert (status, headers["Retry-After"]) == (429, "3")
        assert await statuses(session, api, "x", 1) == [200]
        assert [(await fetch(session, api, "y"))[1].get("Retry-After") for _ in range(3)] == [
            "0.25", "0.25", None]


async def test_rate_limited_retry_after_http_date(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("rate_limited", retry_after=5, http_date=True)}) as api:
        now = time.time()
        status, headers, _ = await fetch(session, api, "x")
        assert status == 429 and headers["Retry-After"].endswith(" GMT")
        when = email.utils.parsedate_to_datetime(headers["Retry-After"]).timestamp()
        assert now + 4 <= when <= now + 7


async def test_slow(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("slow", delay=0.3)}, latency=0.05) as api:
        t0 = time.monotonic()
        assert await statuses(session, api, "x", 1) == [200]
        assert time.monotonic() - t0 >= 0.35
        t0 = time.monotonic()
        assert await statuses(session, api, "y", 1) == [200]
        assert 0.05 <= time.monotonic() - t0 < 0.3


async def test_drop_post_once(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("drop")}) as api:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await fetch(session, api, "x", method="POST")
        assert (await fetch(session, api, "x", method="POST"))[0] == 200
        assert [e.status for e in api.log if e.event == "end"] == [0, 200]
        assert api.paid() == ["x"]


async def test_drop_get_is_resent_once_by_aiohttp(session: aiohttp.ClientSession) -> None:
    # aiohttp resends an idempotent request once after a disconnect: times=2 makes it visible.
    async with MockAPI(faults={"x": Fault("drop", times=2), "y": Fault("drop")}) as api:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await fetch(session, api, "x")
        assert api.counts() == collections.Counter({0: 2})
        assert await statuses(session, api, "x", 1) == [200]
        assert await statuses(session, api, "y", 1) == [200]
        assert api.starts() == ["x", "x", "x", "y", "y"]


async def test_invalid_json_then_ok(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("invalid_json")}, balance=5) as api:
        status, _, body = await fetch(session, api, "x")
        assert status == 200
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(body)
        assert api.paid() == [] and api.balance_left == 5
        status, _, body = await fetch(session, api, "x")
        assert (status, orjson.loads(body)) == (200, payload_for("x"))
        assert api.paid() == ["x"] and api.balance_left == 4


async def test_error_in_body(session: aiohttp.ClientSession) -> None:
    async with MockAPI(faults={"x": Fault("error_in_body", status=402)}) as api:
        for _ in range(2):
            status, _, body = await fetch(session, api, "x")
            assert status == 200 and orjson.loads(body)["code"] == 402
        assert api.paid() == []


async def test_auth(session: aiohttp.ClientSession) -> None:
    async with MockAPI(api_key="k1") as api:
        assert (await fetch(session, api, "a", headers=None))[0] == 401
        assert (await fetch(session, api, "a", headers={"X-Api-Key": "nope"}))[0] == 401
        assert (await fetch(session, api, "a", headers={"Authorization": "Bearer nope"}))[0] == 401
        assert (await fetch(session, api, "a", headers={"X-Api-Key": "k1"}))[0] == 200
        assert (await fetch(session, api, "a", headers={"Authorization": "Bearer k1"}))[0] == 200
        assert [e.authorized for e in api.log if e.event == "start"] == [False] * 3 + [True] * 2
        assert api.paid() == ["a", "a"]
    async with MockAPI(api_key=None) as api:
        assert (await fetch(session, api, "a", headers=None))[0] == 200


async def test_balance_then_402(session: aiohttp.ClientSession) -> None:
    async with MockAPI(balance=2, faults={"nf": Fault("not_found")}) as api:
        assert await statuses(session, api, "nf", 1) == [404]  # unbilled answers cost nothing
        assert await statuses(session, api, "a", 1) == [200]
        assert await statuses(session, api, "b", 1) == [200]
        assert api.balance_left == 0
        status, _, body = await fetch(session, api, "c")
        assert (status, orjson.loads(body)) == (402, {"error": "insufficient balance"})
        assert await statuses(session, api, "nf", 1) == [402]
        assert (await fetch(session, api, "c", headers=None))[0] == 401  # auth is checked first
        assert api.paid() == ["a", "b"]


async def test_balance_not_overdrawn_by_concurrent_requests(
    session: aiohttp.ClientSession,
) -> None:
    async with MockAPI(balance=3, latency=0.05) as api:
        results = await asyncio.gather(*(fetch(session, api, str(i)) for i in range(10)))
        assert sorted(r[0] for r in results) == [200] * 3 + [402] * 7
        assert len(api.paid()) == 3 and api.balance_left == 0


async def test_quota(session: aiohttp.ClientSession) -> None:
    async with MockAPI(quota=3) as api:
        results = [await fetch(session, api, str(i)) for i in range(10)]
        limited = [r for r in results if r[0] == 429]
        assert len(limited) >= 10 - 2 * 3  # at most two 1-second windows touched
        assert all(r[1]["Retry-After"] == "1" for r in limited)


@pytest.mark.parametrize("item_id", ["a/b", "../x", "x?y=1", "sp ace", "ünï", "a%2Fb", "#f", "%"])
async def test_id_round_trip(session: aiohttp.ClientSession, item_id: str) -> None:
    async with MockAPI() as api:
        status, _, body = await fetch(session, api, item_id)
        assert (status, orjson.loads(body)) == (200, payload_for(item_id))
        assert api.starts() == [item_id] and api.paid() == [item_id]


async def test_log_file(session: aiohttp.ClientSession, tmp_path: Path) -> None:
    log = tmp_path / "mock.jsonl"
    async with MockAPI(log_path=log, faults={"b": Fault("flaky")}) as api:
        for item_id in ["a", "b", "b"]:
            await fetch(session, api, item_id)
        await fetch(session, api, "a", headers=None)
        lines = log.read_bytes().splitlines()  # readable while the server still runs
        assert [LogEntry(**orjson.loads(line)) for line in lines] == api.log
    entries = read_log(log)
    assert entries == api.log and len(entries) == 8
    assert [(e.event, e.id, e.status) for e in entries if e.event == "end"] == [
        ("end", "a", 200), ("end", "b", 503), ("end", "b", 200), ("end", "a", 401)]
    with log.open("ab") as f:
        f.write(b'{"seq": 8, "event": "sta')  # a torn tail is ignored
    assert read_log(log) == entries


def test_demo_faults_mixture() -> None:
    ids = [f"note-{i}" for i in range(50_000)]
    kinds = collections.Counter(demo_faults(i).kind for i in ids)
    share = {k: n / len(ids) for k, n in kinds.items()}
    expected = {"ok": 0.85, "not_found": 0.03, "bad_request": 0.01, "gone": 0.01, "flaky": 0.08,
                "slow": 0.01, "drop": 0.01, "invalid_json": 0.01}
    assert set(share) == set(expected)
    for kind, p in expected.items():
        assert abs(share[kind] - p) < 0.005 + p * 0.15, (kind, share[kind])
    assert [demo_faults(i) for i in ids[:200]] == [demo_faults(i) for i in ids[:200]]


def test_fault_validation() -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("nope")
    with pytest.raises(ValueError):
        Fault("flaky", times=-1)


@pytest.mark.parametrize(("sig", "args", "headers"), [
    (signal.SIGTERM, ["--no-auth"], {}),
    (signal.SIGINT, ["--api-key", "s3cret", "--port", "PORT"], {"Authorization": "Bearer s3cret"}),
])
async def test_process_entry_point(
    tmp_path: Path, sig: signal.Signals, args: list[str], headers: dict[str, str],
) -> None:
    log = tmp_path / "proc.jsonl"
    with socket.socket() as sock:  # a free port, for the --port case
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [str(port) if a == "PORT" else a for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncrawl.testing", *args, "--faults", "none",
        "--log", str(log), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("listening on http://127.0.0.1:") and line.endswith("\n")
        url = line.split()[-1]
        if "--port" in args:
            assert url == f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.get(url + "/items/a%2Fb") as r:
                assert (r.status, await r.json()) == (200, payload_for("a/b"))
            async with s.get(url + "/items/a", headers={"Authorization": "x"}) as r:
                assert r.status == (200 if sig == signal.SIGTERM else 401)
        proc.send_signal(sig)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out == b"" and err == b""
    assert [(e.event, e.id, e.status) for e in read_log(log)][:2] == [
        ("start", "a/b", None), ("end", "a/b", 200)]
    assert len(read_log(log)) == 4


async def test_asyncrawl_session_sees_every_drop_and_never_resends() -> None:
    from asyncrawl import Config, new_session
    from asyncrawl.fetch import resends_silently

    async with MockAPI(faults={"x": Fault("drop")}) as api:
        session = new_session(Config(url=api.item_url))
        try:
            assert not resends_silently(session)
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await fetch(session, api, "x")
            assert api.starts() == ["x"]  # one request left, one arrived
        finally:
            await session.close()
    async with aiohttp.ClientSession() as plain:
        assert resends_silently(plain)
