"""The library end to end against the mock API over loopback: outcome classes, passes, dedup,
resume, halts, hooks, an injected session and cancellation."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import logging
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import asyncrawl.run
from asyncrawl import (
    Config,
    ConfigError,
    Crawler,
    InputError,
    Outcome,
    Progress,
    Request,
    Response,
    Result,
    Summary,
)
from asyncrawl.progress import summary_text
from asyncrawl.report import export, status, status_text
from asyncrawl.testing import Fault, MockAPI, payload_for

from .conftest import (
    KEY,
    answered_2xx,
    asyncrawl_log,
    cli,
    cut_off_after,
    db_rows,
    fast_config,
    outcomes_of,
    stop_once_paid,
)


def exported(config: Config, outcome: str = "ok") -> list[dict]:
    buf = io.StringIO()
    export(config, outcome=outcome, fmt="jsonl", out=buf)
    return [json.loads(line) for line in buf.getvalue().splitlines()]


FAULTS = {
    "nf": Fault("not_found"),
    "bad": Fault("bad_request"),
    "gone": Fault("gone"),
    "flaky": Fault("flaky", times=2),
    "ra-secs": Fault("rate_limited", retry_after=0.3),
    "ra-date": Fault("rate_limited", retry_after=1, http_date=True),
    "junk": Fault("invalid_json", times=1),
    "drop": Fault("drop", times=2),
}


async def test_every_outcome_class_and_two_passes(state: Path) -> None:
    ids = [f"ok{i}" for i in range(50)] + list(FAULTS)
    async with MockAPI(api_key=KEY, faults=FAULTS) as api:
        cfg = fast_config(api, state)
        async with Crawler(cfg) as crawler:
            summary = await crawler.run(ids)
        starts = api.starts()

    assert summary.halt is None
    assert summary.exit_code == 0
    ok_ids = {f"ok{i}" for i in range(50)} | {"flaky", "ra-secs", "ra-date", "junk", "drop"}
    assert summary.ok == len(ok_ids)
    assert summary.unavailable == 3  # nf, bad (skip class) and gone (500 every time)
    assert summary.failed == 0
    got = exported(cfg)
    assert {r["id"] for r in got} == ok_ids
    assert all(r["data"] == payload_for(r["id"]) for r in got)
    unavailable = {r["id"]: r for r in exported(cfg, "unavailable")}
    assert set(unavailable) == {"nf", "bad", "gone"}
    assert unavailable["nf"]["status"] == 404 and unavailable["gone"]["status"] == 500
    # skip class: one try in pass 1, one recheck in pass 2; retryable: max_tries in each pass
    assert starts.count("nf") == 2 and starts.count("bad") == 2
    assert starts.count("gone") == 2 * cfg.max_tries
    assert starts.count("flaky") == 3
    assert starts.count("ok0") == 1
    # every request beyond an ID's first in a pass is a retry (pass 2 rechecks nf, bad, gone)
    assert (summary.requests, summary.retries) == (len(starts), len(starts) - len(ids) - 3)


async def test_retry_after_is_honoured_in_both_forms(state: Path) -> None:
    faults = {"secs": Fault("rate_limited", retry_after=0.6),
              "date": Fault("rate_limited", retry_after=2, http_date=True)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, retry_after_max=5.0)
        async with Crawler(cfg) as crawler:
            summary = await crawler.run(["secs", "date"])
        times = {i: [e.t for e in api.log if e.id == i and e.event == "start"] for i in faults}
    assert summary.ok == 2
    assert times["secs"][1] - times["secs"][0] >= 0.55
    # an HTTP-date has one-second resolution: 2 s ahead means more than 1 s of waiting
    assert times["date"][1] - times["date"][0] >= 1.0


async def test_retry_after_pauses_the_whole_job(state: Path) -> None:
    async with MockAPI(api_key=KEY, faults={"a": Fault("rate_limited", retry_after=1)}) as api:
        cfg = fast_config(api, state, concurrency=2, rate=50.0, burst=1)
        async with Crawler(cfg) as crawler:
            await crawler.run(["a"] + [f"x{i}" for i in range(40)])
        t429 = next(e.t for e in api.log if e.event == "end" and e.status == 429)
        during = [e for e in api.log if e.event == "start" and t429 + 0.05 < e.t < t429 + 0.9]
    assert during == []  # nobody started a request while the server's Retry-After ran
    # (two in flight: one answer, at most, accepts a request sent after the refused one, too
    # little to show that the server takes the job: the next test)


async def test_a_per_item_429_pauses_the_job_only_until_the_server_takes_later_requests(
        state: Path) -> None:
    """The answers accepting requests sent after a 429 show that the server is not holding
    the job back: its pause ends there, and only the refused ID waits for its Retry-After (a
    1 % mix of such 429s held a job at rate 50 at ~5 req/s: a rate-limit audit)."""
    async with MockAPI(api_key=KEY, faults={"a": Fault("rate_limited", retry_after=2)},
                       latency=0.1) as api:
        cfg = fast_config(api, state, concurrency=8, rate=50.0, burst=1)
        async with Crawler(cfg) as crawler:
            s = await crawler.run([f"x{i}" for i in range(10)] + ["a"]
                                  + [f"y{i}" for i in range(100)])
        t429 = next(e.t for e in api.log if e.event == "end" and e.status == 429)
        during = [e.id for e in api.log if e.event == "start" and t429 + 0.3 < e.t < t429 + 1.5]
        again = [e.t for e in api.log if e.event == "start" and e.id == "a"][1]
    assert s.ok == 111
    assert len(during) >= 20  # the job went on (at rate 50: ~60 in that stretch)
    assert again >= t429 + 1.9  # the refused ID waited for its own Retry-After


async def test_duplicates_are_fetched_once_and_a_rerun_fetches_nothing(api: MockAPI, state: Path) -> None:
    ids = ["a", "b", "a", "c", "b", "a"]
    cfg = fast_config(api, state)
    async with Crawler(cfg) as crawler:
        s1 = await crawler.run(ids)
        s2 = await crawler.run(iter(ids))
    assert sorted(api.starts()) == ["a", "b", "c"]
    assert (s1.ok, s1.duplicates, s1.fetched) == (3, 3, 3)
    assert (s2.ok, s2.skipped, s2.requests, s2.fetched) == (3, 3, 0, 0)


async def test_no_second_pass_leaves_failed_and_a_rerun_retries_them(state: Path) -> None:
    faults = {"flaky": Fault("flaky", times=3), "nf": Fault("not_found")}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, second_pass=False, max_tries=2)
        async with Crawler(cfg) as crawler:
            s1 = await crawler.run(["ok", "flaky", "nf"])
            assert (s1.ok, s1.failed, s1.exit_code) == (1, 2, 6)
            s2 = await crawler.run(["ok", "flaky", "nf"])
        assert (s2.ok, s2.failed, s2.skipped) == (2, 1, 1)
        assert api.starts().count("ok") == 1
        assert {r["id"] for r in exported(cfg, "failed")} == {"nf"}


async def test_recheck_permanent_off_sends_skip_class_once(state: Path) -> None:
    async with MockAPI(api_key=KEY, faults={"nf": Fault("not_found")}) as api:
        cfg = fast_config(api, state, recheck_permanent=False)
        async with Crawler(cfg) as crawler:
            s = await crawler.run(["nf", "x"])
        assert api.starts().count("nf") == 1
    assert (s.ok, s.unavailable) == (1, 1)
    assert exported(cfg, "unavailable") == [{"id": "nf", "status": 404, "error": "HTTP 404"}]


async def test_402_halts_at_once_and_keeps_paid_results(state: Path) -> None:
    concurrency = 6
    async with MockAPI(api_key=KEY, balance=40) as api:
        cfg = fast_config(api, state, concurrency=concurrency)
        async with Crawler(cfg) as crawler:
            s = await crawler.run([f"id{i}" for i in range(300)])
        log = list(api.log)
        paid = api.paid()
    assert s.halt is not None and s.halt.reason == "fatal" and s.halt.status == 402
    assert s.exit_code == 3
    first_402 = next(e.seq for e in log if e.event == "end" and e.status == 402)
    late = [e for e in log if e.event == "start" and e.seq > first_402]
    assert len(late) <= concurrency - 1  # only requests already in flight when the 402 was seen
    assert {r["id"] for r in exported(cfg)} == set(paid)
    assert s.ok == len(paid) == 40


async def test_401_halts(state: Path) -> None:
    async with MockAPI(api_key="other-key") as api:
        cfg = fast_config(api, state)
        async with Crawler(cfg) as crawler:
            s = await crawler.run([f"id{i}" for i in range(100)])
        assert len(api.starts()) <= cfg.concurrency
    assert s.halt is not None and (s.halt.reason, s.halt.status, s.exit_code) == ("fatal", 401, 3)
    assert s.ok == 0 and s.pending > 0 and s.requests <= cfg.concurrency


async def test_error_in_body_is_classified_by_error_field(state: Path) -> None:
    faults = {"broke": Fault("error_in_body", status=402)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, error_field="code", concurrency=1)
        async with Crawler(cfg) as crawler:
            s = await crawler.run(["a", "broke", "c"])
    assert s.halt is not None and s.halt.status == 402
    assert s.ok == 1


async def test_classifier_hook_overrides_the_class(api: MockAPI, state: Path) -> None:
    seen: list[Response] = []

    def classify(r: Response) -> Outcome | None:
        seen.append(r)
        return Outcome.SKIP if r.data and r.data.get("id") == "veto" else None

    cfg = fast_config(api, state, recheck_permanent=False)
    async with Crawler(cfg, classify=classify) as crawler:
        s = await crawler.run(["veto", "fine"])
    assert (s.ok, s.unavailable) == (1, 1)
    assert {r.id for r in seen} == {"veto", "fine"} and all(r.status == 200 for r in seen)


async def test_on_result_sees_each_durable_result_once(state: Path) -> None:
    results: list[Result] = []
    async with MockAPI(api_key=KEY, faults={"nf": Fault("not_found")}) as api:
        cfg = fast_config(api, state, second_pass=False)
        async with Crawler(cfg, on_result=results.append) as crawler:
            await crawler.run(["a", "b", "nf"])
    by_id = {r.id: r for r in results}
    assert len(results) == 3
    assert by_id["a"].outcome == "ok" and by_id["a"].data == payload_for("a")
    assert by_id["nf"].outcome == "failed" and by_id["nf"].permanent and by_id["nf"].status == 404


async def test_on_failure_sees_the_failures_alone_beside_on_result(
        state: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``on_failure`` gets the failed and unavailable IDs' results, once each and once
    durable, beside ``on_result`` (every result) or alone; one that raises is logged and the
    crawl goes on."""
    faults = {"nf": Fault("not_found"), "down": Fault("gone")}
    for with_all in (True, False):
        everything: list[Result] = []
        failures: list[Result] = []

        def failed(r: Result, failures: list[Result] = failures) -> None:
            failures.append(r)
            raise RuntimeError("a bug in the application's hook")

        async with MockAPI(api_key=KEY, faults=faults) as api:
            cfg = fast_config(api, state / str(with_all), max_tries=2)
            async with Crawler(cfg, on_result=everything.append if with_all else None,
                               on_failure=failed) as crawler:
                s = await crawler.run(["a", "b", "nf", "down"])
        assert (s.ok, s.unavailable) == (2, 2)
        # the first failure with its traceback, then a count at the end (a hook that failed
        # for every result logged a traceback each: 41,000 lines in a run of 5,000 IDs)
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        messages = [r.getMessage() for r in errors]
        assert len(messages) == 2, messages
        assert messages[0].startswith("on_failure hook failed for ID ")
        assert messages[1].startswith("on_failure hook failed 4 times in this run")
        assert errors[0].exc_info is not None
        caplog.clear()
        # pass 1's failures, then pass 2's unavailable: each a durable outcome
        assert sorted((r.id, r.outcome) for r in failures) == [
            ("down", "failed"), ("down", "unavailable"), ("nf", "failed"), ("nf", "unavailable")]
        if with_all:
            assert [r for r in everything if r.outcome != "ok"] == failures
            assert {r.id for r in everything if r.outcome == "ok"} == {"a", "b"}


async def test_injected_session_is_used_and_left_open(api: MockAPI, state: Path) -> None:
    async with aiohttp.ClientSession() as session:
        async with Crawler(fast_config(api, state), session=session) as crawler:
            s = await crawler.run(["a", "b"])
        assert not session.closed
        async with session.get(api.url + "/health") as resp:  # still usable
            assert resp.status == 200
    assert s.ok == 2


async def test_a_stop_asked_before_the_run_task_started_stops_it(api: MockAPI,
                                                                 state: Path) -> None:
    """``task = create_task(crawler.run(ids)); crawler.stop()`` (a shutdown that comes as the
    crawl is being started): the run stops before it sends anything. The stop was dropped (no
    run was under way yet) and the whole crawl ran, and was paid for."""
    crawler = Crawler(fast_config(api, state))
    task = asyncio.create_task(crawler.run([f"s{i}" for i in range(50)]))
    crawler.stop()
    s = await task
    assert (s.ok, s.halt is not None and s.halt.reason) == (0, "signal")
    assert api.paid() == []
    s = await crawler.run(["s0", "s1"])  # the stop was that run's: the next one crawls
    assert (s.ok, s.halt) == (2, None)
    crawler.stop()  # a late stop (a second Ctrl-C, a shutdown hook) with no run under way
    await asyncio.sleep(0)
    s = await crawler.run(["s2"])  # ... is not the next run's
    assert (s.ok, s.halt) == (1, None)


async def test_cancelled_run_stops_cleanly_and_resumes(state: Path) -> None:
    ids = [f"id{i}" for i in range(400)]
    async with MockAPI(api_key=KEY, latency=0.01) as api:
        cfg = fast_config(api, state, rate=400.0, concurrency=4)
        crawler = Crawler(cfg)
        task = asyncio.create_task(crawler.run(ids))
        deadline = asyncio.get_running_loop().time() + 30
        while crawler.ok < 20:
            assert asyncio.get_running_loop().time() < deadline and not task.done()
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        first = crawler.ok
        paid_before = set(api.paid())
        assert 20 <= first < len(ids)
        s = await Crawler(cfg).run(ids)
        assert s.ok == len(ids) and s.exit_code == 0
        paid = api.paid()
    assert len(paid) == len(set(paid)) == len(ids)  # nothing paid for twice
    assert len(paid_before) >= first


@pytest.mark.parametrize("how", ["cancel", "stop"])
async def test_a_run_that_stops_closes_its_async_id_source_and_reads_no_more(
        state: Path, how: str) -> None:
    """An application's source fed by its own queue: after the run, stopped mid-backlog, a
    task of asyncrawl's read on from it (the source was left suspended, not closed): the IDs
    the application put for its next crawl vanished, its end marker too, and that crawl hung
    (a library audit). Now the source is closed with the run, and nothing of it is left."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    closed = []

    async def from_queue() -> Any:
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            closed.append(True)

    for i in range(300):  # more than the run's queue and read-ahead hold at once
        queue.put_nowait(f"a{i}")
    async with MockAPI(api_key=KEY, latency=0.01) as api:
        cfg = fast_config(api, state, rate=400.0, concurrency=4)
        crawler = Crawler(cfg)
        task = asyncio.create_task(crawler.run(from_queue()))
        deadline = asyncio.get_running_loop().time() + 30
        while crawler.ok < 10:
            assert asyncio.get_running_loop().time() < deadline and not task.done()
            await asyncio.sleep(0.02)
        if how == "cancel":
            task.cancel()
        else:
            crawler.stop()
        with contextlib.suppress(asyncio.CancelledError):
            summary = await task
        if how == "stop":  # (it said "stopped by signal")
            assert summary.halt is not None
            assert summary.halt.message == "stopped by Crawler.stop()"
        assert closed == [True]  # its ``finally`` ran, with the run
        files = [getattr(getattr(t.get_coro(), "cr_code", None), "co_filename", "")
                 for t in asyncio.all_tasks()]
        package = str(Path(asyncrawl.run.__file__).parent)
        assert [f for f in files if f.startswith(package) and not f.endswith("testing.py")] == []
        for i in range(50):  # the application's next work stays in its queue
            queue.put_nowait(f"b{i}")
        queue.put_nowait(None)
        for _ in range(20):
            await asyncio.sleep(0)
        assert queue.qsize() == 51
        s = await asyncio.wait_for(Crawler(cfg).run(from_queue()), 30)
    assert s.fetched == 50


async def test_a_slow_async_id_source_is_crawled_as_its_ids_come(state: Path) -> None:
    """IDs an async source has yielded are fetched while it waits for more (a queue fed over
    time): they waited until 1,024 had come, or the source ended."""
    async with MockAPI(api_key=KEY) as api:
        async def ids() -> Any:
            for i in range(10):
                yield f"early{i}"
            deadline = asyncio.get_running_loop().time() + 10
            while len(api.paid()) < 10:  # (never, before: the ten waited for more)
                assert asyncio.get_running_loop().time() < deadline, "the early IDs waited"
                await asyncio.sleep(0.01)
            yield "late"

        s = await Crawler(fast_config(api, state)).run(ids())
    assert s.ok == 11 and s.exit_code == 0


async def test_an_id_source_that_raises_keeps_the_answers_in_flight(state: Path) -> None:
    """The error is raised once the job has stopped as on a halt: the requests in flight get
    the grace period and their paid answers are kept (they were cut off, in doubt, and a
    rerun bought them again)."""
    attempts: list[str] = []
    async with MockAPI(api_key=KEY, latency=0.05) as api:
        cfg = fast_config(api, state, concurrency=64)

        async def ids() -> Any:
            for i in range(1024):  # (a chunk: read again once most of it has been taken)
                yield f"s{i}"
            deadline = asyncio.get_running_loop().time() + 30
            while len(api.paid()) < 50:  # requests are out: 64 in flight, 50 ms each
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            raise RuntimeError("my ID source failed")

        def seen(item: str, status: int | None, error: str | None) -> None:
            attempts.append(item)
            raise KeyError(item)  # an observer's bug: logged, and the crawl goes on

        with pytest.raises(RuntimeError, match="my ID source failed"):
            async with Crawler(cfg, on_attempt=seen) as crawler:
                await crawler.run(ids())
        paid = api.paid()
    ok = {row[0] for row in db_rows(state, "SELECT id FROM results WHERE outcome = 'ok'")}
    assert len(paid) >= 50 and set(paid) == ok  # every paid answer is recorded
    assert len(attempts) == len(paid)  # (the raising observer ended nothing)
    assert db_rows(state, "SELECT count(*) FROM items WHERE doubt IS NOT NULL") == [(0,)]


async def test_a_request_hook_that_raises_ends_the_run_without_waiting_out_the_grace(
        state: Path) -> None:
    """Its worker's request was counted in flight for ever, so the run waited the whole
    grace period for it before raising."""
    from asyncrawl import Request

    async with MockAPI(api_key=KEY) as api:
        def build(item: str) -> Request:
            if item == "bad":
                raise LookupError("no route for it")
            return Request("GET", api.item_url.replace("{id}", item), {"X-Api-Key": KEY})

        cfg = fast_config(api, state, grace=60.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LookupError):
            await Crawler(cfg, request_for=build).run(["a", "bad", "b", "c"])
    assert loop.time() - started < 30  # (60 s, the grace, before)


async def test_a_request_hook_that_raises_leaves_no_id_in_doubt(state: Path) -> None:
    """The hook was called after the ID's ``sent`` intent was committed: the request that never
    left was counted as sent and listed in doubt (possibly billed) for ever after."""
    from asyncrawl import Request

    async with MockAPI(api_key=KEY) as api:
        def build(item: str) -> Request:
            if item == "bad":
                raise LookupError("no route for it")
            return Request("GET", api.item_url.replace("{id}", item), {"X-Api-Key": KEY})

        with pytest.raises(LookupError):
            await Crawler(fast_config(api, state, concurrency=1), request_for=build).run(
                ["a", "bad", "b"])
        seen = api.starts()
    assert "bad" not in seen
    assert db_rows(state, "SELECT id FROM items WHERE doubt IS NOT NULL") == []
    assert db_rows(state, "SELECT id FROM items WHERE sends > 0") == [(i,) for i in seen]

    def cancels(item: str) -> Request:
        raise asyncio.CancelledError  # (a plain call: nothing cancelled the run)

    async with MockAPI(api_key=KEY) as api:
        with pytest.raises(RuntimeError, match="request_for hook raised CancelledError"):
            await asyncio.wait_for(Crawler(fast_config(api, state / "c"), request_for=cancels).run(
                ["c"]), 30)


async def test_a_halt_on_the_retry_of_an_id_bought_before_keeps_its_bill(state: Path) -> None:
    """An ID whose paid answer did not parse, halted on its retry by a 402: its earlier bill
    was dropped (the server billed 100, status said 96), and a rerun bought it again with
    nothing recorded against it."""
    faults = {f"n{i}": Fault("invalid_json", times=1) for i in range(4)}
    async with MockAPI(api_key=KEY, faults=faults, balance=26) as api:  # (the 26 good ones)
        cfg = fast_config(api, state, concurrency=2, backoff_base=0.5, backoff_max=0.5,
                          jitter="none")
        s = await Crawler(cfg).run([f"n{i}" for i in range(30)])
        assert s.halt is not None and s.halt.status == 402
        billed = api.counts()[200]  # (an answer that does not parse is billed too)
    assert billed == 30 and status(cfg)["billable"] == billed


async def test_ids_of_a_str_subclass_are_crawled_as_their_text(state: Path, api: MockAPI) -> None:
    """An ID of a str subclass (a StrEnum's member) passed the checks, then could not be
    handed to the writing process: the run waited for ever."""
    import enum

    class Kind(enum.StrEnum):
        A = "a1"

    class Tag(str):
        pass

    s = await asyncio.wait_for(Crawler(fast_config(api, state)).run([Kind.A, Tag("t1")]), 30)
    assert (s.ok, s.halt) == (2, None)
    assert sorted(r["id"] for r in exported(fast_config(api, state))) == ["a1", "t1"]


async def test_library_arguments_of_the_wrong_kind_are_config_errors(state: Path,
                                                                      api: MockAPI) -> None:
    """Each raised TypeError, AttributeError, RuntimeError or ValueError from deep inside."""
    cfg = fast_config(api, state)
    for kw in ({"progress_every": "x"}, {"progress_every": None}, {"total": "x"},
               {"session": 5}):
        with pytest.raises(ConfigError):
            Crawler(cfg, **kw)
    with pytest.raises(ConfigError, match="ids must be an iterable"):
        await Crawler(cfg).run(5)  # type: ignore[arg-type]
    closed = aiohttp.ClientSession()
    await closed.close()
    with pytest.raises(ConfigError, match="session given to the Crawler is closed"):
        await Crawler(cfg, session=closed).run(["a"])
    with pytest.raises(ConfigError, match="signum"):
        Crawler(cfg).stop(signum="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="holds a nan"):  # (sent as null)
        Config(url=api.item_url, method="POST", json={"a": float("nan")})
    assert api.starts() == []


async def recheck_unavailable(configure: Any) -> None:
    """Of a job whose ID "gone" was confirmed unavailable (the API has it now): a rerun skips
    it, a rerun with ``recheck_unavailable`` fetches it, and nothing else again."""
    faults = {"gone": Fault("not_found")}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        config: Config = configure(api)
        ids = ["gone", *(f"a{i}" for i in range(20))]
        s = await Crawler(config).run(ids)
        assert (s.ok, s.unavailable, len(api.starts())) == (20, 1, 22)  # (404: one try a pass)
        del faults["gone"]
        s = await Crawler(config).run(ids)
        assert (s.ok, s.unavailable, len(api.starts())) == (20, 1, 22)
        s = await Crawler(config.with_overrides(recheck_unavailable=True)).run(ids)
        assert (s.ok, s.unavailable, api.starts()[22:]) == (21, 0, ["gone"])


async def test_recheck_unavailable_fetches_what_was_given_up_on(state: Path) -> None:
    await recheck_unavailable(lambda api: fast_config(api, state))


async def test_tries_that_sent_nothing_are_no_retries_and_leave_no_doubt(state: Path) -> None:
    """A try refused at the connect sent nothing, but it marked its ID as sent: the ID's next
    try counted as a retry (two refused tries: one retry, of no request). Nor is such an ID
    in doubt when the run ends before its next try."""
    import socket

    from asyncrawl import Request

    calls: collections.Counter[str] = collections.Counter()
    with socket.socket() as closed:  # (bound, not listening: a connect is refused)
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/items/x"
        async with MockAPI(api_key=KEY, faults={}) as api:
            def build(item: str) -> Request:
                calls[item] += 1
                if item != "x":
                    return Request("GET", api.item_url.replace("{id}", item), {"X-Api-Key": KEY})
                if calls[item] == 3:  # (the run ends at x's third try, its intent unwritten)
                    raise LookupError("stop here")
                return Request("GET", refused, {"X-Api-Key": KEY})

            crawler = Crawler(fast_config(api, state, concurrency=1), request_for=build)
            with pytest.raises(LookupError):
                await crawler.run(["a", "b", "x", "c"])
            seen = api.starts()
    assert calls["x"] == 3 and "x" not in seen
    assert db_rows(state, "SELECT id FROM items WHERE doubt IS NOT NULL") == []
    assert db_rows(state, "SELECT sum(sends) FROM items") == [(len(seen),)]
    assert crawler.progress().retries == 0


@pytest.mark.parametrize("made", [
    lambda url: Request("G ET", url), lambda url: Request(None, url),  # type: ignore[arg-type]
    lambda url: Request("GET", "ftp://h.example/x"), lambda url: Request("GET", 5),
    lambda url: Request("GET", url, {"a b": "1"}), lambda url: Request("GET", url, {"": "1"}),
    lambda url: Request("GET", url, {"X": "1\r\nY: 2"}), lambda url: Request("GET", url, [1]),
    lambda url: Request("POST", url, json=object()),
    lambda url: Request("POST", url, json={"d": __import__("datetime").date(2026, 1, 1)}),
    lambda url: Request("POST", url, json={"n": float("nan")}),
    lambda url: Request("GET", url.replace("http://", "http://u:p@"), {"Authorization": "x"}),
])
async def test_a_request_no_client_could_send_is_a_config_error_with_nothing_in_doubt(
        state: Path, made: Any) -> None:
    """request_for's request that no client can send (a method or a header name that is no
    token, a URL that is not http(s), a body that is not JSON) raised in the client after the
    ID's intent: the run ended with a traceback (exit 1) and the ID in doubt, possibly billed."""
    async with MockAPI(api_key=KEY) as api:
        with pytest.raises(ConfigError, match="request_for returned a Request for ID 'a'"):
            await Crawler(fast_config(api, state), request_for=lambda item: made(
                api.item_url.replace("{id}", item))).run(["a"])
        assert api.starts() == []
    assert db_rows(state, "SELECT id FROM items WHERE doubt IS NOT NULL OR sends > 0") == []


async def test_a_json_body_the_standard_library_sends_is_sent(state: Path) -> None:
    """The check of a hook's body used orjson, which refuses what the clients send (an
    integer past 64 bits, a key that is a number)."""
    async with MockAPI(api_key=KEY) as api:
        s = await Crawler(fast_config(api, state), request_for=lambda item: Request(
            "POST", api.item_url.replace("{id}", item), {"X-Api-Key": KEY},
            json={"n": 2**70, 1: "a"})).run(["a"])
    assert s.ok == 1


async def test_a_request_that_may_have_reached_the_server_unanswered_is_listed(
        state: Path) -> None:
    """A timeout after the connect or a dropped connection may come after the server took
    (and billed) the request: its retry was paid again with nothing said (a process frozen
    while its answers came in saw only timeouts). Such an ID is listed as unanswered, and
    possibly billed twice once it is fetched; the in-doubt list (a run cut off) stays as it
    was."""
    faults = {"dropped": Fault("drop", times=1), "late": Fault("slow", delay=1.0)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, timeout=0.3, max_tries=2)
        s = await Crawler(cfg).run(["fine", "dropped", "late"])
    assert (s.ok, s.unavailable, s.unanswered) == (2, 1, 5)  # ("late": twice a pass)
    assert "5 unanswered: possibly billed" in summary_text(s)
    assert sorted(db_rows(state, "SELECT id, doubt FROM items WHERE doubt IS NOT NULL")) == [
        ("dropped", 3), ("late", 2)]
    assert {r["id"]: r["refetched"] for r in exported(cfg, "unanswered")} == {
        "dropped": True, "late": False}
    assert exported(cfg, "in-doubt") == []
    st = status(cfg)
    assert (st["unanswered"], st["unanswered_refetched"], st["in_doubt"]) == (1, 1, 0)
    # each try of "late" timed out, and the server may have billed each one
    assert (st["requests_sent"], st["billable"], st["no_answer"], st["not_billed"]) == (
        7, 2, 5, 0)  # (1 + 2 + 4: "late" twice in each pass)
    assert 2 < len(api.paid()) <= st["billable"] + st["no_answer"]  # what the server billed
    assert "unanswered   1 sent with no answer" in status_text(st)


async def test_a_timeout_before_the_request_had_its_connection_sent_nothing(
        state: Path) -> None:
    """A timeout while waiting for a pooled connection (an injected session that holds fewer
    connections than the workers) sent nothing: not unanswered. Where the session's
    connector cannot say (an application's own), the failure counts as possibly sent."""
    from asyncrawl.fetch import Connector

    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(2.0)
        return web.json_response({"id": request.match_info["id"]})

    app = web.Application()
    app.router.add_get("/items/{id}", handle)
    async with TestServer(app) as server:
        for connector, want in ((Connector, 1), (aiohttp.TCPConnector, 2)):
            where = state / connector.__name__
            cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}",
                         state_dir=str(where), rate=100.0, concurrency=2, max_tries=1,
                         cooldown=0.0, timeout=0.5, second_pass=False)
            async with aiohttp.ClientSession(connector=connector(limit=1)) as session:
                session._retry_connection = False
                await Crawler(cfg, session=session).run(["a", "b"])
            assert status(cfg)["unanswered"] == want, connector


@pytest.mark.parametrize("sync", [False, True])
async def test_an_id_source_that_raises_cancelled_error_ends_the_run(state: Path,
                                                                     sync: bool) -> None:
    """A source that ends with a ``CancelledError`` of its own (nothing cancelled the run)
    ended the producer as if its owner had cancelled it: no halt, and ``run()`` waited for
    ever. It is an error of the source, raised as one."""
    def plain() -> Any:
        yield from ("a", "b")
        raise asyncio.CancelledError

    async def streamed() -> Any:
        for item in ("a", "b"):
            yield item
        raise asyncio.CancelledError

    async with MockAPI(api_key=KEY) as api:
        crawler = Crawler(fast_config(api, state))
        with pytest.raises(InputError, match="raised CancelledError") as raised:
            await asyncio.wait_for(crawler.run(plain() if sync else streamed()), 30)
    assert raised.value.line == 3
    assert crawler.halt is not None and crawler.halt.reason == "error"


@pytest.mark.parametrize("how", ["signal", "error", "cancel"])
async def test_a_402_in_the_grace_period_of_another_stop_halts_and_alerts(
        state: Path, how: str) -> None:
    """A 402 answered to a request in flight when a signal or a failing ID source had stopped
    the run was dropped: the first reason won, so no alert, no exit 3, no fatal halt in the
    state; the operator heard of the empty balance only from the next run."""
    halts: list[Any] = []
    async with MockAPI(api_key=KEY, balance=2, latency=0.5) as api:
        cfg = fast_config(api, state, concurrency=4, grace=10.0)
        crawler = Crawler(cfg, on_halt=lambda h, s: halts.append(h))

        async def in_flight() -> None:
            deadline = asyncio.get_running_loop().time() + 20
            while len(api.starts()) < 4:  # all four out; two will be refused (402)
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)

        async def ids() -> Any:
            for i in range(4):
                yield f"id{i}"
            await in_flight()
            if how == "error":
                raise RuntimeError("my ID source failed")
            await asyncio.Event().wait()  # (more IDs may come)

        async with crawler:
            run = asyncio.ensure_future(crawler.run(ids()))
            if how == "signal":
                await in_flight()
                crawler.stop("signal", signum=15)
                s = await asyncio.wait_for(run, 30)
                assert s.exit_code == 3 and s.ok == 2
            elif how == "cancel":
                await in_flight()
                run.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(run, 30)
            else:
                with pytest.raises(RuntimeError, match="my ID source failed"):
                    await asyncio.wait_for(run, 30)
    assert crawler.halt is not None and (crawler.halt.reason, crawler.halt.status) == ("fatal", 402)
    assert len(halts) == 1 and halts[0].status == 402
    assert list(outcomes_of(state).values()) == ["ok", "ok"]


@pytest.mark.parametrize("turns", [0, 1, 2, 5, 20])
async def test_a_run_cancelled_while_it_opens_its_state_leaves_nothing_locked(
        state: Path, turns: int) -> None:
    """Cancelled within its first turns of the loop, while a thread opens the store (the
    lock, the database, the writing process): the next run of the same process found the
    state locked by the process itself, for ever (0 to 3 ms after the start, before)."""
    async with MockAPI(api_key=KEY) as api:
        cfg = fast_config(api, state)
        task = asyncio.create_task(Crawler(cfg).run(["a", "b", "c"]))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        s = await Crawler(cfg).run(["a", "b", "c"])  # (LockedError naming this pid, before)
        # every task cancelled at once, as asyncio.run's end does: no task of its own to spin
        task = asyncio.create_task(Crawler(cfg).run(["d"]))
        for _ in range(turns):
            await asyncio.sleep(0)
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        s2 = await Crawler(cfg).run(["d"])
    assert s2.exit_code == 0
    assert s.ok == 3 and s.exit_code == 0


async def test_a_second_cancellation_cuts_the_grace_short_and_leaves_nothing_running(
        state: Path) -> None:
    """An application shutting down cancels every task, the crawl's included, more than once:
    the second cancellation ends the grace period, every task of the run has ended when
    ``run()`` raises, and the request cut off is in doubt."""
    started, release = asyncio.Event(), asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        started.set()
        await release.wait()
        return web.json_response({"id": request.match_info["id"]})

    app = web.Application()
    app.router.add_get("/items/{id}", handle)
    async with TestServer(app) as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state), rate=100.0,
                     concurrency=2, max_tries=1, cooldown=0.0, timeout=30.0, grace=30.0)
        crawler = Crawler(cfg)
        task = asyncio.create_task(crawler.run(["slow"]))
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()  # the first: a stop like SIGINT, 30 s of grace for the request out
        deadline = asyncio.get_running_loop().time() + 10
        while crawler.halt is None:  # the run took it: it waits out the grace period now
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        task.cancel()  # the second, well within the grace period
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("asyncrawl")]
        assert left == []
        release.set()
    doubt = db_rows(state, "SELECT id, doubt FROM items WHERE doubt IS NOT NULL")
    assert doubt == [("slow", 0)]  # possibly billed: a rerun says so


async def test_an_ids_file_gone_since_it_was_checked_is_an_input_error_and_starts_nothing(
        state: Path, tmp_path: Path) -> None:
    from asyncrawl import InputError
    from asyncrawl.source import IdsFile

    cfg = Config(url="http://127.0.0.1:9/items/{id}", state_dir=str(state))
    async with Crawler(cfg) as crawler:
        with pytest.raises(InputError, match="cannot read IDs file"):
            await crawler.run(IdsFile(str(tmp_path / "rotated-away.txt"), 3))
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("asyncrawl")] == []


async def test_finish_waits_for_the_task_then_lets_the_cancellation_through() -> None:
    """``tasks.finish`` (how a run awaits the tasks it owns while it stops): a cancellation of
    the caller meanwhile is raised once the task has ended, never swallowed (SPEC §8: the
    CancelledError of a cancelled ``crawler.run()`` propagates)."""
    from asyncrawl.tasks import finish as _finish

    gate = asyncio.Event()
    owned = asyncio.create_task(gate.wait())
    caller = asyncio.create_task(_finish(owned))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0)
    assert not caller.done()  # still waiting for the task it owns
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert owned.done() and not owned.cancelled()

    owned = asyncio.create_task(asyncio.sleep(3600))  # a task its owner cancels: no error
    owned.cancel()
    await _finish(owned)

    async def fails() -> None:
        raise ValueError("a bug in the writer")

    with pytest.raises(ValueError):
        await _finish(asyncio.create_task(fails()))


async def test_in_thread_waits_through_one_cancellation_and_lets_go_at_the_second() -> None:
    """``tasks.in_thread`` (how a store closes): cancelled once, it waits for its call (which
    must run: a dropped close left the state locked); cancelled again, it stops waiting (a
    call stuck on a server that never answers), and the call still runs to its end."""
    import threading

    from asyncrawl.tasks import in_thread

    gate, ran = threading.Event(), threading.Event()

    def call() -> None:
        gate.wait(30)
        ran.set()

    waiter = asyncio.create_task(in_thread(call))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # still waiting for its call
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not ran.is_set()
    gate.set()
    assert await asyncio.to_thread(ran.wait, 30)  # (the call ran on, to its end)


async def test_finish_of_a_task_cancelled_by_its_owner_keeps_the_caller_s_cancellation() -> None:
    """The run stops its ticker (``ticker.cancel()``, then ``finish``), and the application
    cancels the run in that same turn of the loop: the ticker ends cancelled, and so must the
    run. The ticker's own cancellation was taken for the caller's, which was dropped: ``run()``
    returned a Summary to a cancelled task (and an ``asyncio.timeout`` firing then raised
    nothing)."""
    from asyncrawl.tasks import finish

    ticker = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)

    async def closing() -> str:
        ticker.cancel()
        await finish(ticker)
        return "returned"

    caller = asyncio.create_task(closing())
    await asyncio.sleep(0)  # (it has cancelled the ticker and waits for it)
    caller.cancel()  # (the application's, before the ticker has run its cancellation)
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ticker.cancelled()


async def test_a_job_that_ends_exactly_at_the_request_budget_is_finished(state: Path) -> None:
    """``max_requests`` stops a job that has more to fetch (exit 4); one whose last ID was its
    last allowed call has finished (exit 0): no budget halt, no alert."""
    halts = []
    async with MockAPI(api_key=KEY) as api:
        for n, code in ((5, 0), (4, 4)):
            cfg = fast_config(api, state.parent / f"s{n}", max_requests=n, concurrency=2)
            async with Crawler(cfg, on_halt=lambda h, s: halts.append(h.reason)) as crawler:
                s = await crawler.run([f"b{i}" for i in range(5)])
            assert (s.ok, s.exit_code) == (n, code)
    assert halts == ["budget"]


# -- the queue between the producer and the workers ----------------------------------------------


async def test_id_queue_wakes_the_producer_at_half_not_at_every_get() -> None:
    from asyncrawl.idqueue import IdQueue, Item

    q = IdQueue(maxsize=64)
    waits = 0

    async def produce() -> None:
        nonlocal waits
        for i in range(1000):
            if q.full():
                waits += 1  # this put has to wait for room
            await q.put(Item(str(i)))

    got: list[str] = []

    async def consume() -> None:
        while len(got) < 1000:
            got.append((await q.get()).id)
            await asyncio.sleep(0)

    # a getter cancelled while waiting loses nothing
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(produce(), consume())
    assert got == [str(i) for i in range(1000)]  # FIFO, nothing lost or doubled
    assert waits <= (1000 - 64) // 32 + 1  # one wake-up per 32 IDs, not one per ID


async def test_an_injected_session_that_resends_is_warned_about(
        api: MockAPI, state: Path, caplog: pytest.LogCaptureFixture) -> None:
    from asyncrawl import new_session
    from asyncrawl.fetch import RESEND_WARNING

    cfg = fast_config(api, state)
    async with aiohttp.ClientSession() as plain:
        with caplog.at_level("WARNING", logger="asyncrawl"):
            for _ in range(3):  # (an application that makes a Crawler a job, say)
                Crawler(cfg, session=plain)
        assert caplog.text.count(RESEND_WARNING) == 1  # (once a session: it said so each time)
    caplog.clear()
    ours = new_session(cfg)
    try:
        with caplog.at_level("WARNING", logger="asyncrawl"):
            async with Crawler(cfg, session=ours) as crawler:
                summary = await crawler.run(["a", "b"])
        assert summary.ok == 2 and RESEND_WARNING not in caplog.text
        assert not ours.closed  # a session it did not create stays open
    finally:
        await ours.close()


async def test_an_injected_session_with_fewer_connections_than_concurrency_is_warned_about(
        api: MockAPI, state: Path, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's default connector opens 100 connections: at concurrency 200 the other 100
    requests waited for one, their timeout running, and timed out as if the API were slow."""
    from asyncrawl import new_session

    cfg = dataclasses.replace(fast_config(api, state), concurrency=8)
    for connector, warned in ((aiohttp.TCPConnector(limit=2), "at most 2 connections"),
                              (aiohttp.TCPConnector(limit=0, limit_per_host=4), "at most 4"),
                              (aiohttp.TCPConnector(limit=0), None)):
        caplog.clear()
        async with aiohttp.ClientSession(connector=connector) as session:
            with caplog.at_level("WARNING", logger="asyncrawl"):
                Crawler(cfg, session=session)
        assert (warned in caplog.text) if warned else "at most" not in caplog.text
    ours = new_session(cfg)
    try:
        with caplog.at_level("WARNING", logger="asyncrawl"):
            Crawler(cfg, session=ours)
        assert "at most" not in caplog.text
    finally:
        await ours.close()


# -- a paid answer is not bought again and again ------------------------------------------------


async def test_a_2xx_that_does_not_parse_is_bought_at_most_twice_in_all(state: Path) -> None:
    faults = {"junk": Fault("invalid_json", times=1000)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, max_tries=5)  # pass 2 on, with a fresh try budget
        async with Crawler(cfg) as crawler:
            summary = await crawler.run(["a", "junk"])
        bought = [e.id for e in api.log if e.event == "end" and e.status == 200]
    assert bought.count("junk") == 2  # was max_tries x 2 passes = 10 billable calls
    assert summary.ok == 1 and summary.unavailable == 1
    out = io.StringIO()
    export(cfg, outcome="unavailable", out=out)
    rec = json.loads(out.getvalue())
    assert rec["id"] == "junk" and rec["status"] == 200
    assert "not valid JSON" in rec["error"] and "paid_retries" in rec["error"]


async def test_a_2xx_that_does_not_parse_is_bought_at_most_twice_across_runs(
        state: Path) -> None:
    """Each rerun bought it 1 + paid_retries times again (with pass 2 off, each run leaves it
    failed; a run cut off before pass 2 too): paid_retries counted per run. A recheck of
    unavailable IDs buys it once more."""
    faults = {"junk": Fault("invalid_json", times=1000)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, second_pass=False)
        s = await Crawler(cfg).run(["a", "junk"])
        assert (s.ok, s.failed, answered_2xx(api, "junk")) == (1, 1, 2)
        ids = state.parent / "ids.txt"  # (a dry run counted it as a call left)
        ids.write_text("a\njunk\nb\n")
        r = await asyncio.to_thread(cli, "run", "--url", cfg.url, "--state", str(state),
                                    "--ids", str(ids), "--dry-run", cwd=state.parent)
        assert "already done: 2; calls left: 1 " in r.stdout, r.stdout + r.stderr
        s = await Crawler(cfg).run(["a", "junk", "b"])  # (failed: tried again, was bought)
        assert (s.ok, s.unavailable, answered_2xx(api, "junk")) == (2, 1, 2)
        assert "paid_retries" in exported(cfg, "unavailable")[0]["error"]
        s = await Crawler(dataclasses.replace(cfg, recheck_unavailable=True)).run(["junk"])
        assert (s.unavailable, s.failed, answered_2xx(api, "junk")) == (0, 1, 3)  # (one more, then failed)
        s = await Crawler(cfg).run(["junk"])
        assert (s.unavailable, answered_2xx(api, "junk")) == (1, 3)


async def test_a_paid_answer_cut_off_before_its_retry_counts_in_the_next_run(
        state: Path) -> None:
    """The count was looked up only for IDs with an outcome: one stopped while it waited for
    its retry (no outcome yet) started the next run at 0 and was bought 1 + 2 times."""
    faults = {"junk": Fault("invalid_json", times=1000)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        crawler = Crawler(fast_config(api, state, backoff_base=60.0, backoff_max=60.0,
                                      jitter="none"))
        await stop_once_paid(crawler, ["junk"], api, "junk")
        assert db_rows(state, "SELECT state, paid, unusable FROM items") == [(None, 1, 1)]
        (state.parent / "ids.txt").write_text("junk\n")  # (a dry run priced it, with none
        (state.parent / "c.toml").write_text(  # left to buy: it looked at IDs with a state)
            f'[source]\nids = "ids.txt"\n[request]\nurl = "{api.item_url}"\n'
            f'[state]\ndir = "{state}"\n[retry]\npaid_retries = 0\n')
        r = await asyncio.to_thread(cli, "run", "-c", str(state.parent / "c.toml"), "--dry-run",
                                    cwd=state.parent)
        assert "already done: 1; calls left: 0 " in r.stdout, r.stdout + r.stderr
        s = await Crawler(fast_config(api, state)).run(["junk"])
        assert (s.unavailable, answered_2xx(api, "junk")) == (1, 2)


async def test_a_retryable_code_in_a_2xx_body_is_retried_as_its_status_is(state: Path) -> None:
    """It counted as a paid answer that cannot be used: bought twice (paid_retries), not
    max_tries times, and, once that was kept across runs, never tried by the next run."""
    faults = {"busy": Fault("error_in_body", status=503)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, error_field="code", max_tries=4, second_pass=False)
        s = await Crawler(cfg).run(["busy"])
        assert (s.failed, len(api.starts())) == (1, 4)
        s = await Crawler(cfg).run(["busy"])
        assert (s.failed, len(api.starts())) == (1, 8)  # (a rerun retries it: exit 6)


async def _formats_app() -> web.Application:
    async def csv_(request: web.Request) -> web.Response:
        return web.Response(text=f"id,n\n{request.match_info['id']},1\n", content_type="text/csv")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def binary(request: web.Request) -> web.Response:
        return web.Response(body=b"\xff\x00\xfe", content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/csv/{id}", csv_)
    app.router.add_get("/empty/{id}", empty)
    app.router.add_get("/bin/{id}", binary)
    return app


@pytest.mark.parametrize(("path", "fmt", "want"), [
    ("csv", "text", "id,n\nx,1\n"),
    ("empty", "text", ""),
    ("empty", "bytes", ""),
    ("bin", "bytes", "/wD+"),  # base64 of ff 00 fe
])
async def test_response_formats_for_apis_that_do_not_answer_json(
        state: Path, path: str, fmt: str, want: str) -> None:
    server = TestServer(await _formats_app())
    await server.start_server()
    try:
        cfg = Config(url=f"{server.make_url('/')}{path}/{{id}}", state_dir=str(state),
                     response_format=fmt, cooldown=0.0, backoff_base=0.01)
        results: list[Result] = []
        async with Crawler(cfg, on_result=results.append) as crawler:
            summary = await crawler.run(["x"])
    finally:
        await server.close()
    assert summary.ok == 1 and [r.data for r in results] == [want]
    out = io.StringIO()
    export(cfg, outcome="ok", out=out)
    assert json.loads(out.getvalue()) == {"id": "x", "data": want}


async def test_json_format_records_an_empty_204_as_unusable_after_two_calls(state: Path) -> None:
    server = TestServer(await _formats_app())
    await server.start_server()
    calls = 0
    try:
        cfg = Config(url=f"{server.make_url('/')}empty/{{id}}", state_dir=str(state),
                     cooldown=0.0, backoff_base=0.01, second_pass=False)

        def count(response: Response) -> None:
            nonlocal calls
            calls += 1

        async with Crawler(cfg, classify=count) as crawler:
            summary = await crawler.run(["x"])
    finally:
        await server.close()
    assert calls == 2 and summary.failed == 1


async def test_pass_2_progress_counts_its_own_ids(state: Path) -> None:
    faults = {f"bad{i}": Fault("not_found") for i in range(5)}
    seen: list[Progress] = []
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, cooldown=0.2)
        async with Crawler(cfg, on_progress=seen.append, progress_every=0.02, total=25) as crawler:
            await crawler.run([f"ok{i}" for i in range(20)] + list(faults))
        final = crawler.progress()
    second = [p for p in seen if p.pass_no == 2] + [final]
    assert second and all(p.total == 5 and 0 <= p.done <= 5 for p in second)
    assert final.done == 5
    assert all(p.done <= (p.total or 0) for p in seen)
    # an ID pass 2 settles is no longer failed (it was counted as both, past the 25 IDs)
    assert all(p.ok + p.failed + p.unavailable <= 25 for p in [*seen, final])
    assert (final.ok, final.failed, final.unavailable) == (20, 0, 5)


async def test_an_outage_that_lasts_into_pass_2_is_waited_out_not_recorded(state: Path) -> None:
    """Pass 2's tries were no evidence of an outage: one that lasted past the cool-down
    ended every ID of pass 2 confirmed unavailable (the 404s among them as 503s), and later
    runs skipped them. IDs that answered a skip in pass 1 are witnesses in pass 2: their 503s
    open the breaker, which holds the pass until the outage is over."""
    faults = {f"gone{i:02d}": Fault("not_found") for i in range(40)}
    ids = [f"ok{i:02d}" for i in range(40)] + list(faults)
    async with MockAPI(api_key=KEY, faults=faults, outage=(0.6, 2.5)) as api:
        cfg = fast_config(api, state, cooldown=0.8, breaker_probe_max=0.3, concurrency=4,
                          rate=400.0)
        async with Crawler(cfg) as crawler:
            summary = await asyncio.wait_for(crawler.run(ids), 60)
        outage = [e for e in api.log if e.event == "end" and e.status == 503]
    assert (summary.ok, summary.unavailable) == (40, 40)
    gone = list(status_rows(state, "unavailable"))
    assert len(gone) == 40 and {row["status"] for row in gone} == {404}, gone[:3]
    assert outage and len(outage) < 40  # (the breaker held pass 2: a few probes, not 3 an ID)


async def test_no_cool_down_is_waited_out_where_pass_2_would_send_nothing(state: Path) -> None:
    """Every failure of pass 1 a 404 not to be checked again (``recheck_permanent = false``):
    pass 2 settles them unavailable without a request, and the run waited out the whole
    cool-down first (the README's 300 s: five idle minutes) before it did so."""
    faults = {f"gone{i}": Fault("not_found") for i in range(3)}
    seen: list[Progress] = []
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, state, cooldown=300.0, recheck_permanent=False)
        async with Crawler(cfg, on_progress=seen.append, progress_every=0.02) as crawler:
            summary = await asyncio.wait_for(crawler.run(["ok1", *faults]), 60)
        assert len(api.starts()) == 4  # (pass 2 sent none)
    assert (summary.ok, summary.unavailable) == (1, 3)
    assert not any(p.cooling_down for p in seen)


async def test_progress_total_counts_ids_not_duplicate_lines(state: Path) -> None:
    ids = [f"d{i}" for i in range(20)]
    seen: list[Progress] = []
    async with MockAPI(api_key=KEY, faults={}) as api:
        cfg = fast_config(api, state, second_pass=False)
        # 30 lines, 20 IDs: the bar ends at 20/20, not 20/30 (it stopped at 67 %)
        async with Crawler(cfg, on_progress=seen.append, progress_every=0.02,
                           total=30) as crawler:
            summary = await crawler.run(ids + ids[:10])
        final = crawler.progress()
    assert summary.duplicates == 10 and summary.ok == 20
    assert (final.done, final.total) == (20, 20)
    assert all(p.done <= (p.total or 0) for p in seen)


async def test_refused_connections_after_answers_are_an_outage_not_a_config_error(
        state: Path) -> None:
    server = TestServer(await _formats_app())
    await server.start_server()
    url = f"{server.make_url('/')}csv/{{id}}"
    refused: list[str] = []

    def attempt(item: str, status: int | None, error: str | None) -> None:
        if error and "connection refused" in error:
            refused.append(item)

    cfg = Config(url=url, state_dir=str(state), response_format="text", rate=50.0,
                 concurrency=2, backoff_base=0.01, backoff_max=0.05, cooldown=0.0)
    async with Crawler(cfg, on_attempt=attempt) as crawler:
        run = asyncio.create_task(crawler.run([f"o{i}" for i in range(200)]))
        deadline = asyncio.get_running_loop().time() + 30
        while crawler.ok < 5:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await server.close()  # the server goes away mid-run
        while len(refused) < 5:
            assert asyncio.get_running_loop().time() < deadline and not run.done()
            await asyncio.sleep(0.01)
        crawler.stop()
        summary = await asyncio.wait_for(run, 30)
    assert summary.halt is not None and summary.halt.reason == "signal"
    assert summary.ok >= 5


async def test_unparsable_paid_answers_are_no_outage_and_never_bought_uncharged(state: Path) -> None:
    """20 IDs that all answer an empty 2xx: the server answered (and billed), so the breaker
    does not open and hold them uncharged: each is bought exactly 1 + paid_retries times."""
    server = TestServer(await _formats_app())
    await server.start_server()
    calls: collections.Counter[str] = collections.Counter()
    try:
        cfg = Config(url=f"{server.make_url('/')}empty/{{id}}", state_dir=str(state),
                     cooldown=0.0, backoff_base=0.01, concurrency=16, rate=1000.0)

        def count(item: str, status: int | None, error: str | None) -> None:
            calls[item] += 1

        async with Crawler(cfg, on_attempt=count) as crawler:
            summary = await crawler.run([f"e{i:02d}" for i in range(20)])
    finally:
        await server.close()
    assert summary.unavailable == 20
    assert set(calls.values()) == {2}


# -- resuming a long IDs file --------------------------------------------------------------------


async def test_a_rerun_of_the_same_file_reads_on_from_its_frontier(
        api: MockAPI, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stopped job's rerun of the unchanged IDs file does not read again the blocks its state
    covers (every ID there settled or sent), takes what is unsettled there from the state, and
    still fetches every ID exactly once; once the file changes, it reads it all again."""
    from asyncrawl.source import IdsFile, prescan_file

    state = tmp_path / "state"
    ids = [f"{i:05d}-" + "x" * 890 for i in range(3000)]  # ~900 B a line: ~1,100 IDs per block
    path = tmp_path / "ids.txt"
    path.write_text("".join(f"{i}\n" for i in ids))
    cfg = fast_config(api, state, concurrency=8, rate=3000.0)
    lines = prescan_file(str(path))

    running: list[Crawler] = []

    def stop_half_way(r: Result) -> None:
        if running[0].ok >= 2400:
            running[0].stop()

    async with Crawler(cfg, on_result=stop_half_way) as crawler:
        running.append(crawler)
        first = await crawler.run(IdsFile(str(path), lines))
    assert first.halt is not None and 2400 <= first.ok < 3000
    frontier = json.loads(db_rows(state, "SELECT value FROM meta WHERE key = 'frontier'")[0][0])
    assert frontier["line"] >= 1000  # at least the first block is covered

    paid_before = len(api.paid())
    with caplog.at_level("INFO", logger="asyncrawl"):
        async with Crawler(cfg) as crawler:
            second = await crawler.run(IdsFile(str(path), lines))
    assert [m for m in caplog.messages if "reading it on from line" in m]
    assert second.halt is None and second.ok == 3000 and second.exit_code == 0
    assert second.skipped >= frontier["unique"] - 16  # what the state covers, not re-read
    assert sorted(api.paid()) == sorted(ids)  # every ID fetched exactly once, over both runs
    assert len(api.paid()) - paid_before == 3000 - first.ok

    with path.open("a") as f:  # the file changes: read all of it again
        f.write("new-id\n")
    caplog.clear()
    with caplog.at_level("INFO", logger="asyncrawl"):
        async with Crawler(cfg) as crawler:
            third = await crawler.run(IdsFile(str(path), lines + 1))
    assert not [m for m in caplog.messages if "reading it on from line" in m]
    assert third.ok == 3001 and third.skipped == 3000
    assert sorted(api.paid()) == sorted([*ids, "new-id"])


async def test_an_api_that_forbids_every_request_halts_the_job_instead_of_losing_it(
        state: Path) -> None:
    """403 for each of the first 20 requests and nothing else: the API refuses the crawler
    (a key without the permission, a wrong URL), not those IDs. The job halts like on a 401
    (exit 3) instead of giving every ID up as unavailable; a rerun, once the API takes the
    requests, fetches them all. A 403 after any other answer is about its own ID (a skip)."""
    seen: list[str] = []
    forbid = {"all"}

    async def handle(request: web.Request) -> web.Response:
        item = request.match_info["id"]
        seen.append(item)
        if "all" in forbid or item in forbid:
            return web.Response(status=403, text="forbidden")
        return web.json_response({"id": item})

    app = web.Application()
    app.router.add_get("/items/{id}", handle)
    ids = [f"f{i:03d}" for i in range(300)]
    async with TestServer(app) as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state),
                     rate=2000.0, concurrency=4, cooldown=0.0, timeout=10.0)
        async with Crawler(cfg) as c:
            s = await c.run(ids)
        assert s.halt is not None and s.halt.reason == "fatal" and s.exit_code == 3, s
        assert "403 for each of the first 20 requests" in (s.halt.message or "")
        assert s.unavailable == 0 and len(seen) <= 20 + 4  # (those in flight get their answer)
        forbid.clear()
        forbid.update(ids[100:130])  # the API takes the requests now; 30 IDs are forbidden
        async with Crawler(cfg) as c:
            s = await c.run(ids)
        assert (s.ok, s.unavailable, s.exit_code) == (270, 30, 0), s


async def test_the_budget_halts_a_run_with_ids_parked_for_a_retry(state: Path) -> None:
    """``max_requests`` is reached while IDs wait for their retry (a flaky server, 2-s
    backoff): the run stops then (exit 4), the parked IDs do not hold it, and a rerun with
    budget to spare fetches them and the rest."""
    from asyncrawl.testing import flaky_faults

    async with MockAPI(api_key=KEY, faults=flaky_faults) as api:
        cfg = fast_config(api, state, max_requests=60, concurrency=4, backoff_base=2.0,
                          backoff_max=2.0, max_tries=5)
        ids = [f"p{i}" for i in range(200)]
        async with Crawler(cfg) as c:
            s = await asyncio.wait_for(c.run(ids), 30)
        # (a call with no answer may have been billed: it spends its slot too)
        assert (s.exit_code, s.billable + s.unanswered) == (4, 60), s
        assert s.pending + s.failed > 0 and s.ok < 200  # some were parked, and are kept
        async with Crawler(fast_config(api, state, concurrency=16)) as c:
            s = await asyncio.wait_for(c.run(ids), 120)
        assert s.ok + s.unavailable == 200 and s.halt is None, s


async def test_a_rerun_of_ids_that_were_forbidden_before_does_not_halt(state: Path) -> None:
    """IDs that failed with 403 in an earlier run (each forbidden by itself: private items) are
    all a rerun sends: their 403s are about those IDs, not the API refusing the crawler, so
    the rerun does not halt (it used to, every time: exit 3 and an alert blaming the key)."""
    async def handle(request: web.Request) -> web.Response:
        item = request.match_info["id"]
        if item.startswith("private"):
            return web.Response(status=403, text="forbidden")
        return web.json_response({"id": item})

    app = web.Application()
    app.router.add_get("/items/{id}", handle)
    ids = [f"item{i}" for i in range(50)] + [f"private{i}" for i in range(30)]
    async with TestServer(app) as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state),
                     rate=2000.0, concurrency=4, second_pass=False, timeout=10.0)
        for _ in range(2):  # the rerun sends only the 30 forbidden IDs
            async with Crawler(cfg) as c:
                s = await c.run(ids)
            assert (s.halt, s.ok, s.failed, s.exit_code) == (None, 50, 30, 6), s


async def test_workers_take_no_new_id_while_the_store_is_behind(
        state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the state's writes held up (another connection holds the database's write lock:
    the intents are still logged, the results are not applied), the workers stop taking IDs
    once the writer's backlog reaches its limit, so the answered results a crash would cost
    stay within ``concurrency`` plus that limit (SPEC §5); once the store catches up the crawl
    goes on, and every ID is fetched once."""
    from asyncrawl import writer as writer_mod

    limit, concurrency, n = 8, 4, 300
    monkeypatch.setattr(writer_mod, "BACKLOG", limit)
    made: list[Any] = []  # the run's writer
    init = writer_mod._Reporting.__init__

    def noted(self: Any, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(writer_mod._Reporting, "__init__", noted)
    ids = [f"i{k}" for k in range(n)]
    async with MockAPI(api_key=KEY) as api:
        async with Crawler(fast_config(api, state, concurrency=concurrency)) as crawler:
            crawl = asyncio.create_task(crawler.run(ids))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not (state / "state.db").exists() or not db_rows(state, "SELECT 1 FROM items "
                                                                   "WHERE state = 'ok'"):
                assert loop.time() < deadline and not crawl.done()
                await asyncio.sleep(0.005)
            db = sqlite3.connect(state / "state.db", timeout=30, isolation_level=None)
            db.execute("BEGIN IMMEDIATE")  # the writing process applies nothing meanwhile
            try:
                applied = db.execute("SELECT count(*) FROM items WHERE state = 'ok'").fetchone()[0]
                (w,) = made
                while len(w._waiting) < concurrency:  # every worker waits for the store
                    assert loop.time() < deadline and len(api.starts()) < n, len(api.starts())
                    await asyncio.sleep(0.005)
                started = len(api.starts())
                assert started < n and len(api.paid()) - applied <= concurrency + limit
            finally:
                db.execute("ROLLBACK")
                db.close()
            summary = await asyncio.wait_for(crawl, 60)
        starts = api.starts()
    assert summary.ok == n and len(starts) == n and set(starts) == set(ids)


# -- embedding: what the application gets wrong, and leaving the block ---------------------------


async def test_leaving_the_block_stops_a_run_still_going_and_waits_for_it(state: Path) -> None:
    """A run in another task when the ``async with`` block is left (here by an error) is
    stopped, its requests in flight given the grace period, and has ended when the block is
    left: no crawl goes on, and spends, unwatched. A concurrent ``run()`` refused the state's
    lock does not take ``stop`` away from the run under way."""
    from asyncrawl import LockedError

    ids = [f"b{i}" for i in range(400)]
    async with MockAPI(api_key=KEY, latency=0.01) as api:
        cfg = fast_config(api, state, rate=400.0, concurrency=4)
        task = None
        with pytest.raises(ZeroDivisionError):
            async with Crawler(cfg) as crawler:
                task = asyncio.create_task(crawler.run(ids))
                deadline = asyncio.get_running_loop().time() + 30
                while crawler.ok < 20:
                    assert asyncio.get_running_loop().time() < deadline and not task.done()
                    await asyncio.sleep(0.02)
                with pytest.raises(LockedError, match="another run in this process"):
                    await crawler.run(["other"])
                1 / 0  # noqa: B018 (the application's error leaves the block)
        assert task is not None and task.done()
        summary = task.result()
        sent = len(api.starts())
        assert summary.halt is not None and summary.halt.reason == "cancelled"
        assert 20 <= summary.ok < len(ids) and summary.exit_code == 130
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("asyncrawl")]
        assert left == []
        async with Crawler(cfg) as crawler:  # the state is free again: the rest, once each
            assert (await crawler.run(ids)).ok == len(ids)
        assert len(api.starts()) - sent == len(ids) - summary.ok


async def test_what_an_application_passes_wrongly_is_a_config_error(state: Path) -> None:
    cfg = Config(url="http://127.0.0.1:9/items/{id}", state_dir=str(state))

    async def on_result(r: Result) -> None:
        pass

    class Later:
        async def __call__(self, p: Progress) -> None:
            pass

    bad: list[tuple[Any, dict[str, Any], str]] = [
        (None, {}, "config must be an asyncrawl.Config"),
        ("config.toml", {}, "config must be an asyncrawl.Config"),
        (cfg, {"on_result": on_result}, "on_result must be a plain function"),
        (cfg, {"on_progress": Later()}, "on_progress must be a plain function"),
        (cfg, {"on_failure": 5}, "on_failure must be a function"),
        (cfg, {"progress_every": 0}, "progress_every must be greater than 0"),
        (cfg, {"progress_every": float("nan")}, "progress_every must be greater than 0"),
        (cfg, {"total": -5}, "total must be"),
    ]
    for config, kw, said in bad:
        with pytest.raises(ConfigError, match=said):
            Crawler(config, **kw)
    async with Crawler(cfg) as crawler:
        with pytest.raises(ConfigError, match="ids is a str"):
            await crawler.run("abc")
    assert not await asyncio.to_thread(state.exists)  # nothing was begun


@pytest.mark.parametrize("hook", ["classify", "request_for"])
async def test_a_hook_that_returns_the_wrong_thing_stops_the_run_saying_which(
        api: MockAPI, state: Path, hook: str) -> None:
    kw: dict[str, Any] = ({"classify": lambda response: "bogus"} if hook == "classify"
                          else {"request_for": lambda item: None})
    async with Crawler(fast_config(api, state), **kw) as crawler:
        with pytest.raises(ConfigError, match=f"{hook} returned .* for ID 'h1'"):
            await crawler.run(["h1"])


async def test_an_on_halt_hook_that_raises_is_logged_and_the_summary_kept(state: Path) -> None:
    async with MockAPI(api_key=KEY) as api:
        def on_halt(halt: Any, summary: Any) -> None:
            raise RuntimeError("the pager is down")

        cfg = fast_config(api, state, headers={"X-Api-Key": "wrong"})
        with asyncrawl_log() as lines:
            async with Crawler(cfg, on_halt=on_halt) as crawler:
                summary = await crawler.run(["k1", "k2"])
    assert summary.halt is not None and summary.halt.reason == "fatal" and summary.exit_code == 3
    assert any("on_halt hook failed" in line for line in lines), lines


async def test_a_state_of_another_job_is_refused_in_the_library_s_terms(api: MockAPI,
                                                                       state: Path) -> None:
    """A library caller whose state holds another job's IDs is told what to change in its own
    terms (``Config(...)``), not only in the command line's flags; ``reuse_state`` runs it."""
    from dataclasses import replace

    from asyncrawl.errors import JobMismatch

    cfg = fast_config(api, state)
    async with Crawler(cfg) as crawler:
        await crawler.run(["a", "b"])
    other = replace(cfg, url=cfg.url.replace("/items/", "/items/v2-"))
    with pytest.raises(JobMismatch) as e:
        async with Crawler(other) as crawler:
            await crawler.run(["a", "c"])
    assert "Config(reuse_state=True)" in str(e.value) and "--reuse-state" in str(e.value)
    async with Crawler(replace(other, reuse_state=True)) as crawler:
        summary = await crawler.run(["a", "c"])
    assert summary.ok == 2  # ("a" was settled by the old job: kept; "c" fetched)


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
async def test_a_request_hook_that_exits_keeps_the_answers_in_flight(
        state: Path, exc: type[BaseException]) -> None:
    """A KeyboardInterrupt or SystemExit from a hook stops the run as any error of it does:
    the requests in flight get the grace period and their paid answers are kept, then it is
    raised. asyncio let it out of the event loop at once: the answers in flight were lost
    (in doubt), and a rerun bought them again."""
    async with MockAPI(api_key=KEY, latency=0.2) as api:
        def build(item: str) -> Request:
            if item == "x20":
                raise exc("the application wants out")
            return Request("GET", api.item_url.replace("{id}", item), {"X-Api-Key": KEY})

        with pytest.raises(exc, match="wants out"):
            await Crawler(fast_config(api, state), request_for=build).run(
                [f"x{i}" for i in range(100)])
        paid = api.paid()
    ok = {row[0] for row in db_rows(state, "SELECT id FROM results WHERE outcome = 'ok'")}
    assert len(paid) >= 8 and set(paid) == ok  # the 8 in flight among them, recorded
    assert db_rows(state, "SELECT count(*) FROM items WHERE doubt IS NOT NULL") == [(0,)]
    assert len(paid) < 100
    assert db_rows(state, "SELECT halt_reason FROM runs") == [("error",)]


async def test_a_result_hook_that_exits_stops_the_run_and_every_result_counts(
        state: Path) -> None:
    """It surfaced only once every ID had been fetched (a 10-M-ID job spending on), and the
    rest of its batch was neither counted nor shown to the hook."""
    seen: list[str] = []

    def on_result(r: Result) -> None:
        seen.append(r.id)
        if len(seen) == 1:
            raise SystemExit("enough")

    async with MockAPI(api_key=KEY, latency=0.01) as api:
        crawler = Crawler(fast_config(api, state, rate=200.0), on_result=on_result)
        with pytest.raises(SystemExit, match="enough"):
            await crawler.run([f"r{i}" for i in range(400)])
        paid = api.paid()
    ok = {row[0] for row in db_rows(state, "SELECT id FROM results WHERE outcome = 'ok'")}
    assert set(paid) == ok == set(seen) and len(seen) == crawler.ok
    assert len(paid) < 400


async def test_a_session_closed_by_the_application_mid_run(state: Path) -> None:
    """aiohttp's RuntimeError came out of the run (not an AsyncrawlError), and the IDs whose
    request it refused, never sent, were listed in doubt."""
    async with MockAPI(api_key=KEY, latency=0.05) as api:
        session = aiohttp.ClientSession()
        crawler = Crawler(fast_config(api, state, concurrency=4), session=session)
        run = asyncio.create_task(crawler.run([f"c{i}" for i in range(200)]))
        deadline = asyncio.get_running_loop().time() + 30
        while crawler.ok < 8:
            assert asyncio.get_running_loop().time() < deadline and not run.done()
            await asyncio.sleep(0.01)
        await session.close()
        with pytest.raises(ConfigError, match="session given to the Crawler was closed"):
            await run
        seen = set(api.starts())
    doubt = {row[0] for row in db_rows(state, "SELECT id FROM items WHERE doubt IS NOT NULL")}
    assert doubt <= seen  # (only requests that left)
    sent = {row[0] for row in db_rows(state, "SELECT id FROM items WHERE sends > 0")}
    assert sent == seen


async def test_the_calls_with_no_answer_known_are_those_cut_off_not_every_error_answer(
        state: Path) -> None:
    """Every call of an ID in doubt counted as possibly billed (``no_answer``), its error
    answers too: eight IDs answered 500 a dozen times, then cut off once each, showed ~100
    calls possibly billed and none not billed."""
    faults = {f"e{i}": Fault("gone") for i in range(8)}
    async with MockAPI(api_key=KEY, faults=faults, latency=0.1) as api:
        cfg = fast_config(api, state, max_tries=1000, backoff_base=0.001, backoff_max=0.002,
                          grace=0.01)
        s = await cut_off_after(Crawler(cfg), list(faults), api, 40)  # (~5 answers an ID)
    assert s.halt is not None and s.halt.reason == "signal"
    st = status(cfg)
    cut = len(exported(cfg, "in-doubt"))
    assert cut >= 1 and st["in_doubt"] == cut
    assert st["billable"] == 0 and st["requests_sent"] >= 40
    assert st["no_answer"] == cut  # one call each, the one cut off
    assert st["not_billed"] == st["requests_sent"] - cut


async def test_a_failed_webhook_is_logged_without_its_url(
        state: Path, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's error quoted the webhook's URL, a secret, in a form the redaction did not
    know (the host in lower case): its token went into the log."""
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 abc\r\n\r\n")
        await writer.drain()
        writer.close()

    hook = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = hook.sockets[0].getsockname()[1]
    try:
        async with MockAPI(api_key=KEY, balance=5) as api:
            cfg = fast_config(api, state, concurrency=1,
                              webhook=f"http://LOCALHOST:{port}/services/T0/B0/S3CRETTOKEN123")
            s = await Crawler(cfg).run([f"w{i}" for i in range(20)])
    finally:
        hook.close()
        await hook.wait_closed()
    assert s.halt is not None and s.halt.status == 402
    assert "alert webhook failed" in caplog.text
    assert "S3CRETTOKEN123" not in caplog.text


async def test_status_says_how_old_a_running_job_s_live_figures_are(api: MockAPI,
                                                                    state: Path) -> None:
    """A run frozen (SIGSTOP) or with its loop blocked: its last figures were shown as now."""
    cfg = fast_config(api, state)
    await Crawler(cfg).run(["a"])
    s = status(cfg)
    live = {"effective_rate": 10.0, "configured_rate": 10.0, "rate": 9.5, "pass_no": 1,
            "paused_for": 0.0, "breaker_open": False}
    s.update(running=123, in_flight=0, live={**live, "age_s": 0.4})
    assert "as of" not in status_text(s)
    s["live"] = {**live, "age_s": 60.0}
    assert "sending 9.5 req/s, pass 1, breaker closed (as of 60 s ago" in status_text(s)
    # how old: by the machine's monotonic clock, which no NTP step moves (the run's wall clock
    # stepped back an hour: a frozen run's figures looked new, or a healthy run's an hour old)
    from asyncrawl.live import live_age

    now, mono = time.time(), time.monotonic()
    assert live_age({"ts": now - 3600.0, "mono": mono - 1.0}) == pytest.approx(1.0, abs=0.5)
    assert live_age({"ts": now + 3600.0, "mono": mono - 20.0}) == pytest.approx(20.0, abs=0.5)
    assert live_age({"ts": now - 30.0}) == pytest.approx(30.0, abs=0.5)  # (an older run's file)


@pytest.mark.parametrize("fmt", ["json", "text", "bytes"])
async def test_a_head_request_is_a_result_with_a_null_payload_in_every_format(
        state: Path, fmt: str) -> None:
    """A HEAD's answer has no body: with the default format (json) it did not parse, and each
    ID was bought 1 + paid_retries times and ended unavailable (a README audit: -X HEAD)."""
    seen: list[str] = []

    async def item(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.match_info['id']}")
        return web.json_response({"id": request.match_info["id"]})  # (no body for a HEAD)

    app = web.Application()
    app.router.add_get("/items/{id}", item)  # (and HEAD)
    async with TestServer(app, host="127.0.0.1") as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state),
                     method="HEAD", response_format=fmt, cooldown=0.0)
        async with Crawler(cfg) as crawler:
            s = await crawler.run(["a", "b", "c"])
    assert (s.ok, s.unavailable, s.requests) == (3, 0, 3)
    assert sorted(seen) == ["HEAD a", "HEAD b", "HEAD c"]
    assert [r["data"] for r in exported(cfg)] == [None, None, None]


async def test_a_frozen_application_writes_its_state_in_its_own_process(
        api: MockAPI, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """In an application frozen by PyInstaller or Nuitka, ``sys.executable`` is the
    application: the writing process started it again (a second copy of the application),
    and the run halted on "the state writer process ended unexpectedly" (a library audit)."""
    marker = tmp_path / "started"
    app = tmp_path / "frozen-app"
    app.write_text(f"#!/bin/sh\ntouch {marker}\n")
    app.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(app))
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    caplog.set_level(logging.INFO, logger="asyncrawl")
    async with Crawler(fast_config(api, state)) as crawler:
        s = await crawler.run(["a", "b", "c"])
    assert (s.ok, s.halt) == (3, None)
    assert not marker.exists()  # the application was not started again
    assert "writes the state database in its own process" in caplog.text


def test_the_summary_counts_what_is_left_of_the_ids_not_of_the_lines() -> None:
    """A list of 123 lines with 2 duplicates, all read, 50 ok: 71 left of 121 IDs (it said
    "left 71 of 123 IDs", which do not add up: a README audit). With lines not read yet the
    duplicates among them are unknown: it says lines."""
    s = Summary(ok=50, failed=0, unavailable=0, pending=71, fetched=50, skipped=0,
                duplicates=2, retries=0, requests=50, billable=50, halt=None, elapsed=1.0,
                state_dir="s")
    assert "left         71 of 121 IDs\n" in summary_text(s, total=123)
    s = dataclasses.replace(s, pending=30)
    assert "up to 71 of a list of 123 lines (41 not read yet" in summary_text(s, total=123)


async def test_payloads_come_back_as_the_server_sent_them(state: Path) -> None:
    """JSON orjson reads inexactly or not at all comes back exact, from every way out: a
    pretty-printed body's integers past 64 bits (jsonl's export and on_result had floats),
    a lone surrogate's escape (a JavaScript backend cutting a string in an emoji) and
    nesting past 1,024 levels (refused: bought twice, then unavailable), CSV of a payload
    nested 1,100 deep (a RecursionError). NaN is still no JSON, nor UTF-16 (a payload-fidelity
    audit, and a review)."""
    bodies = {
        "pretty": b'{\n  "big": 100000000000000000000000000000,\r\n  "neg": -9223372036854775809\n}\n',
        "cut": b'{"text": "half an emoji \\ud83d"}',
        "deep": b"[" * 1100 + b"1" + b"]" * 1100,
        "nan": b"[NaN]",
        "utf16": '{"a": 1}'.encode("utf-16-le"),  # (no UTF-8: the stdlib's parser takes it)
    }

    async def item(request: web.Request) -> web.Response:
        return web.Response(body=bodies[request.match_info["id"]],
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/items/{id}", item)
    got: dict[str, Any] = {}
    async with TestServer(app, host="127.0.0.1") as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state),
                     cooldown=0.0)
        async with Crawler(cfg, on_result=lambda r: got.__setitem__(r.id, r.data)) as crawler:
            s = await crawler.run(list(bodies))
    assert (s.ok, s.unavailable) == (3, 2)
    want = {"pretty": {"big": 10**29, "neg": -2**63 - 1}, "cut": {"text": "half an emoji \ud83d"}}
    assert {k: got[k] for k in want} == want  # on_result
    deep, depth = got["deep"], 0
    while isinstance(deep, list):  # (compared by walking: == recurses as deep as the lists)
        deep, depth = deep[0], depth + 1
    assert (deep, depth) == (1, 1100)
    out = io.StringIO()
    export(cfg, fmt="jsonl", out=out)
    lines = {line.split('"', 4)[3]: line for line in out.getvalue().splitlines()}
    assert lines["deep"] == '{"id":"deep","data":' + bodies["deep"].decode() + "}"
    assert {k: json.loads(lines[k])["data"] for k in want} == want
    out = io.StringIO()
    export(cfg, fmt="csv", out=out)  # (the deep payload's cell: JSON text, no RecursionError)
    assert "100000000000000000000000000000,-9223372036854775809" in out.getvalue()


async def test_the_budget_counts_a_request_that_got_no_answer_as_spent(state: Path) -> None:
    """``max_requests`` caps the calls a server may bill: one that never answered (a stall
    past the timeout, billed by a server that bills what it received) kept no slot, and a
    run capped at 700 let the server bill 713 (a fault-mix audit). Now such a call spends
    its slot: the server receives no more than the cap."""
    received: list[str] = []

    async def item(request: web.Request) -> web.Response:
        item_id = request.match_info["id"]
        received.append(item_id)
        if item_id.startswith("stall"):
            await asyncio.sleep(2)
        return web.json_response({"id": item_id})

    app = web.Application()
    app.router.add_get("/items/{id}", item)
    ids = [f"{'stall' if i % 3 == 0 else 'ok'}{i}" for i in range(30)]
    async with TestServer(app, host="127.0.0.1") as server:
        cfg = Config(url=f"http://127.0.0.1:{server.port}/items/{{id}}", state_dir=str(state),
                     cooldown=0.0, timeout=0.3, max_tries=1, second_pass=False,
                     max_requests=10, concurrency=4)
        async with Crawler(cfg) as crawler:
            s = await crawler.run(ids)
    assert s.halt is not None and s.halt.reason == "budget"
    assert len(received) <= 10, received  # (each a call the server may bill)
    assert s.unanswered >= 1  # (the stalls, told as possibly billed)


def status_rows(state: Path, outcome: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    export(Config(url="http://unused/{id}", state_dir=str(state)), outcome=outcome, out=out)
    return [json.loads(line) for line in out.getvalue().splitlines()]
