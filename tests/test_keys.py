"""Several API keys (``[request] keys``): each request carries one key, each key has its share
of the rate and its own 429 pause, a key refused with 401/402 is retired (alert) while the
others go on, and the job halts only when no key is left. The ledger counts calls per key by
fingerprint, never the key. Against a real aiohttp server on loopback that checks the keys."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asyncrawl import Config, ConfigError, Crawler
from asyncrawl.config import key_fingerprint
from asyncrawl.report import status

from .conftest import as_schema_2, cli, write_config, write_ids

GOOD1, BAD, GOOD2 = "key-one-a1b2c3d4", "key-revoked-e5f6", "key-two-0a9b8c7d"


class KeyedAPI:
    """Answers 200 for the keys in ``good``, 401 for the others; ``limited``: keys whose first
    request gets a 429 with ``Retry-After`` (then 200s). Logs (monotonic time, key) per call."""

    def __init__(self, good: set[str], *, header: str = "Authorization",
                 limited: dict[str, float] | None = None) -> None:
        self.good = good
        self.header = header
        self.limited = dict(limited or {})
        self.log: list[tuple[float, str]] = []
        self.alerts: list[dict[str, Any]] = []

    def key_of(self, request: web.Request) -> str:
        if self.header == "?":
            return request.query.get("api_key", "")
        return request.headers.get(self.header, "").removeprefix("Bearer ")

    async def item(self, request: web.Request) -> web.Response:
        key = self.key_of(request)
        self.log.append((time.monotonic(), key))
        if key not in self.good:
            return web.json_response({"error": "invalid key"}, status=401)
        if key in self.limited:
            wait = self.limited.pop(key)
            return web.json_response({"error": "slow down"}, status=429,
                                     headers={"Retry-After": f"{wait:g}"})
        return web.json_response({"id": request.match_info["id"]})

    async def alert(self, request: web.Request) -> web.Response:
        self.alerts.append(await request.json())
        return web.json_response({})


@pytest.fixture
async def keyed() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(api: KeyedAPI) -> str:
        app = web.Application()
        app.router.add_get("/v1/items/{id}", api.item)
        app.router.add_post("/alert", api.alert)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


def config(base: str, tmp_path: Path, **kw: Any) -> Config:
    defaults: dict[str, Any] = dict(
        url=base + "/v1/items/{id}", state_dir=str(tmp_path / "state"), rate=2000.0,
        concurrency=8, max_tries=3, backoff_base=0.01, backoff_max=0.05, cooldown=0.0,
        retry_after_max=5.0, timeout=5.0, grace=2.0)
    defaults.update(kw)
    return Config(**defaults)


def test_keys_are_checked_and_redacted() -> None:
    base = "http://127.0.0.1:1/v1/items/{id}"
    for bad, key in [({"keys": "abc"}, "request.keys"), ({"keys": ["a1b2c3", "a1b2c3"]},
                                                         "request.keys"),
                     ({"keys": [""]}, "request.keys"),
                     ({"keys": ["a1b2c3"], "key_format": "Bearer"}, "request.key_format"),
                     ({"keys": ["a1b2c3"], "headers": {"authorization": "x"}},
                      "request.key_header"),
                     # a key goes in one place: a query parameter, or a header
                     ({"keys": ["a1b2c3"], "key_param": "k", "key_header": "X-Key"},
                      "request.key_param"),
                     ({"keys": ["a1b2c3"], "key_param": "k", "key_format": "{key}"},
                      "request.key_param")]:
        with pytest.raises(ConfigError) as e:
            Config(url=base, **bad)
        assert e.value.key == key
    cfg = Config(url=base, keys=[GOOD1, GOOD2], key_header="X-Key", key_format="{key}")
    assert cfg.redact(f"sent {GOOD1} and {GOOD2}") == "sent *** and ***"
    assert cfg.is_secret_header("x-key")
    assert GOOD1 not in repr(cfg) and GOOD2 not in repr(cfg)
    assert "keys" not in json.dumps(cfg.job_identity())  # keys rotate: not the job's identity


async def test_a_refused_key_is_retired_and_the_others_finish_the_job(
        keyed: Any, tmp_path: Path) -> None:
    api = KeyedAPI({GOOD1, GOOD2})
    base = await keyed(api)
    cfg = config(base, tmp_path, keys=[GOOD1, BAD, GOOD2], webhook=base + "/alert")
    ids = [f"n{i}" for i in range(300)]
    async with Crawler(cfg, total=len(ids)) as c:
        s = await c.run(ids)
    assert s.halt is None and s.ok == len(ids) and s.failed == 0 and s.exit_code == 0
    used = Counter(key for _, key in api.log)
    assert used[GOOD1] > 0 and used[GOOD2] > 0
    # the bad key is used until its first refusal comes back: at most what was out with it then
    assert 1 <= used[BAD] <= cfg.concurrency
    # once retired, it is never sent again
    first_401 = min(t for t, k in api.log if k == BAD)
    later = [k for t, k in api.log if t > first_401 + 0.5]
    assert BAD not in later
    # one alert, naming the key by fingerprint only
    assert len(api.alerts) == 1
    alert = api.alerts[0]
    assert alert["reason"] == "key_retired" and alert["status"] == 401
    assert key_fingerprint(BAD) in alert["message"] and BAD not in json.dumps(alert)
    assert "2 of 3 keys left" in alert["message"]
    assert 0 < alert["pending"] <= len(ids)  # (it said 0, with the list still to fetch)
    # the ledger counts calls per key by fingerprint, and they add up
    st = status(cfg)
    by_key = {row["key"]: row for row in st["keys"]}
    assert set(by_key) == {key_fingerprint(k) for k in (GOOD1, BAD, GOOD2)}
    for key in (GOOD1, BAD, GOOD2):
        assert by_key[key_fingerprint(key)]["sent"] == used[key]
    assert by_key[key_fingerprint(BAD)]["billable"] == 0
    assert sum(r["billable"] for r in st["keys"]) == st["billable"] == len(ids)
    # no key is in the state: not one byte of it
    raw = b"".join(p.read_bytes() for p in (tmp_path / "state").iterdir() if p.is_file())
    for key in (GOOD1, BAD, GOOD2):
        assert key.encode() not in raw


async def test_the_job_halts_when_every_key_is_refused(keyed: Any, tmp_path: Path) -> None:
    api = KeyedAPI(set())
    base = await keyed(api)
    cfg = config(base, tmp_path, keys=[GOOD1, GOOD2], webhook=base + "/alert")
    async with Crawler(cfg) as c:
        s = await c.run([f"n{i}" for i in range(100)])
    assert s.halt is not None and s.halt.reason == "fatal" and s.exit_code == 3
    assert "every API key has been refused" in s.halt.message
    assert s.ok == 0 and len(api.log) <= 2 * cfg.concurrency
    # an alert for the first key, the halt's for the last
    assert [a["reason"] for a in api.alerts] == ["key_retired", "fatal"]


async def test_requests_share_the_keys_and_a_429_pauses_only_its_key(
        keyed: Any, tmp_path: Path) -> None:
    api = KeyedAPI({GOOD1, GOOD2}, limited={GOOD1: 1.0})
    base = await keyed(api)
    # rate 200 in all: 100/s per key; 300 IDs take ~1.5 s, longer than GOOD1's pause
    cfg = config(base, tmp_path, keys=[GOOD1, GOOD2], rate=200.0, burst=4)
    ids = [f"n{i}" for i in range(300)]
    async with Crawler(cfg) as c:
        s = await c.run(ids)
    assert s.halt is None and s.ok == len(ids)
    limited_at = min(t for t, k in api.log if k == GOOD1)  # its first request got the 429
    window = [k for t, k in api.log if limited_at + 0.05 < t < limited_at + 0.95]
    assert GOOD2 in window  # the other key went on ...
    assert GOOD1 not in window  # ... while the limited one waited out its Retry-After
    used = Counter(k for _, k in api.log)
    # outside the pause the two keys share the requests: each has at least a quarter
    assert min(used[GOOD1], used[GOOD2]) >= len(ids) / 4


async def test_a_key_can_go_in_a_query_parameter(keyed: Any, tmp_path: Path) -> None:
    api = KeyedAPI({GOOD1, GOOD2}, header="?")
    base = await keyed(api)
    cfg = config(base, tmp_path, keys=[GOOD1, GOOD2], key_param="api_key")
    async with Crawler(cfg) as c:
        s = await c.run([f"n{i}" for i in range(50)])
    assert s.ok == 50 and s.halt is None
    assert {k for _, k in api.log} == {GOOD1, GOOD2}


async def test_cli_keys_from_the_environment_never_printed(keyed: Any, tmp_path: Path) -> None:
    api = KeyedAPI({GOOD1, GOOD2})
    base = await keyed(api)
    state = tmp_path / "state"
    ids = write_ids(tmp_path / "ids.txt", [f"n{i}" for i in range(120)])
    conf = write_config(tmp_path / "c.toml", base + "/v1/items/{id}", state, ids,
                        request={"keys": ["${K1}", "${K2}", "${K3}"]})
    env = {"K1": GOOD1, "K2": BAD, "K3": GOOD2, "ASYNCRAWL_TEST_KEY": "unused-header-key"}
    run = await asyncio.to_thread(cli, "run", "-c", str(conf), env=env)
    assert run.returncode == 0, run.stderr
    assert "retired" in run.stderr and key_fingerprint(BAD) in run.stderr
    st = await asyncio.to_thread(cli, "status", "-c", str(conf), "--json", env=env)
    text_st = await asyncio.to_thread(cli, "status", "-c", str(conf), env=env)
    for out in (run.stdout, run.stderr, st.stdout, text_st.stdout):
        for key in (GOOD1, BAD, GOOD2):
            assert key not in out
    got = json.loads(st.stdout)
    assert {r["key"] for r in got["keys"]} == {key_fingerprint(k) for k in (GOOD1, BAD, GOOD2)}
    assert f"key {key_fingerprint(GOOD1)}" in text_st.stdout


async def test_a_state_of_schema_1_is_upgraded_on_open(keyed: Any, tmp_path: Path) -> None:
    import sqlite3

    api = KeyedAPI({GOOD1, GOOD2})
    base = await keyed(api)
    cfg = config(base, tmp_path, keys=[GOOD1, GOOD2])
    async with Crawler(cfg) as c:
        await c.run(["a", "b"])
    as_schema_2(tmp_path / "state" / "state.db")
    db = sqlite3.connect(tmp_path / "state" / "state.db")  # as the release before keys made it
    db.executescript("DROP TABLE key_ledger; PRAGMA user_version = 1;")
    db.close()
    assert status(cfg)["keys"] == [] and status(cfg)["ok"] == 2  # readable as it is
    async with Crawler(cfg) as c:
        s = await c.run(["a", "b", "c"])
    assert s.ok == 3
    db = sqlite3.connect(tmp_path / "state" / "state.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == 5
    db.close()
    assert sum(r["sent"] for r in status(cfg)["keys"]) == 1  # only "c" was sent since


async def test_only_a_401_or_402_retires_a_key(keyed: Any, tmp_path: Path) -> None:
    """A status the user made fatal (here 403) is not the key's fault: the job halts at once,
    no key is retired, no key_retired alert."""

    class Forbidden(KeyedAPI):
        async def item(self, request: web.Request) -> web.Response:
            self.log.append((time.monotonic(), self.key_of(request)))
            return web.json_response({"error": "banned"}, status=403)

    api = Forbidden({GOOD1, GOOD2})
    base = await keyed(api)
    cfg = config(base, tmp_path, keys=[GOOD1, GOOD2], fatal=[401, 402, 403],
                 skip=[400, 404, 410], webhook=base + "/alert")
    async with Crawler(cfg) as c:
        s = await c.run([f"n{i}" for i in range(50)])
    assert s.halt is not None and s.halt.reason == "fatal" and s.halt.status == 403
    assert "every API key" not in s.halt.message
    assert [a["reason"] for a in api.alerts] == ["fatal"]


async def test_the_keys_together_keep_to_the_job_s_burst() -> None:
    """Each key has a share of the burst of at least 1; together they never exceed it."""
    from asyncrawl.governor import Governor

    gov = Governor(rate=0.1, burst=2, keys=5, adaptive=False)
    for _ in range(2):  # the job's burst: at once
        await asyncio.wait_for(gov.acquire(), 1.0)
    with pytest.raises(TimeoutError):  # the next token is 10 s away, whichever key
        await asyncio.wait_for(gov.acquire(), 0.3)
