"""pgstore.py and jobwide.py: one job in PostgreSQL, shared by several real processes.

Against the machine's PostgreSQL (``ASYNCRAWL_TEST_PG``, default
postgresql://postgres@127.0.0.1:5432/test); each test has a job of its own. Skipped, saying
why, only where no server answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from asyncrawl.records import Counts
from asyncrawl.store import read_store
from asyncrawl.testing import Fault, MockAPI, flaky_faults, most_in_window, no_faults

from .conftest import (
    KEY,
    answered_2xx,
    cli,
    cut_off_after,
    fast_config,
    stop_once_paid,
    write_config,
    write_ids,
)

PG = os.environ.get("ASYNCRAWL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
ENV = {"ASYNCRAWL_TEST_KEY": KEY}


def _server_answers() -> str | None:
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'asyncrawl[postgres]')"
    try:
        psycopg.connect(PG, connect_timeout=3).close()
    except psycopg.Error as e:
        return f"no PostgreSQL server answers at {PG}: {e}"
    return None


_WHY = _server_answers()
if _WHY is not None:
    if os.environ.get("ASYNCRAWL_TEST_PG_REQUIRED"):  # (.ci/run: its machine has the server)
        raise RuntimeError(f"test_pgstore: {_WHY}, and ASYNCRAWL_TEST_PG_REQUIRED is set")
    print(f"\ntest_pgstore: skipped: {_WHY}", file=sys.stderr)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


@pytest.fixture
def job() -> Iterator[str]:
    """A job of the test's own, deleted afterwards (the database is the machine's, shared)."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    import psycopg

    from asyncrawl.pgstore import JOB_TABLES

    with psycopg.connect(PG) as db:
        for table in JOB_TABLES:
            if db.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None:
                db.execute(f"DELETE FROM {table} WHERE job = %s", (name,))


def pg_rows(query: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(PG) as db:
        return db.execute(query, params).fetchall()


def outcomes(job: str) -> dict[str, str]:
    return dict(pg_rows("SELECT id, outcome FROM asyncrawl_results WHERE job = %s", job))  # type: ignore[arg-type]


async def test_library_crawl_into_a_job_and_a_rerun_adds_only_new_ids(job: str) -> None:
    faults = {"n404": Fault("not_found"), "f1": Fault("flaky", times=1)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job)
        from asyncrawl import Crawler

        ids = [f"a{i}" for i in range(299)] + ["f1", "n404", "a1", "a2"]  # duplicates: once
        async with Crawler(cfg) as c:
            s = await c.run(ids)
        assert (s.ok, s.unavailable, s.failed, s.pending, s.halt) == (300, 1, 0, 0, None)
        assert len(api.paid()) == 300 and len(set(api.paid())) == 300
        async with Crawler(cfg) as c:  # a rerun with more IDs: pays only for the new ones
            s = await c.run([f"a{i}" for i in range(349)])
        assert (s.ok, s.unavailable) == (350, 1)
        assert len(api.paid()) == 350 and len(set(api.paid())) == 350
    assert outcomes(job)["n404"] == "unavailable"
    store = read_store(PG, job=job)
    snap = store.snapshot()
    assert snap.counts == Counts(ok=350, failed=0, unavailable=1)
    assert snap.billable == 350 and snap.in_doubt == 0 and snap.running is None
    ok = {r.id: r.payload for r in store.records("ok")}
    assert len(ok) == 350 and ok["a7"]["id"] == "a7" and "f1" in ok
    assert sorted(x for b in store.ids("unavailable") for x in b) == ["n404"]
    payloads = list(store.payloads())  # what export --format jsonl writes
    assert [item for item, _ in payloads] == [r.id for r in store.records("ok")]
    assert {item: orjson.loads(raw) for item, raw in payloads} == ok


async def test_recheck_unavailable_in_a_shared_job(job: str) -> None:
    from .test_crawler import recheck_unavailable

    await recheck_unavailable(lambda api: fast_config(api, Path("unused"), state_url=PG, job=job))


async def test_pass_2_of_a_shared_job_waits_for_pass_1_s_failures_to_be_written(
        job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass 2 of a shared job claims the job's failures from the database, at once with no
    cool-down: this run's own must be written by then. (With the writer's commits of failures
    slowed down, pass 2 found nothing to do, and a 404 stayed failed instead of confirmed
    unavailable; it happened by itself on a loaded machine.)"""
    from asyncrawl import Crawler, pgstore

    commit = pgstore.PgStore.commit

    def slow(self: Any, records: Any) -> Any:  # (in the writer's thread)
        if any(r.kind == "failed" for r in records):
            time.sleep(0.5)
        return commit(self, records)

    monkeypatch.setattr(pgstore.PgStore, "commit", slow)
    async with MockAPI(api_key=KEY, faults={"n404": Fault("not_found")}) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job)
        assert cfg.cooldown == 0
        async with Crawler(cfg) as c:
            s = await c.run([f"a{i}" for i in range(20)] + ["n404"])
    assert (s.ok, s.unavailable, s.failed, s.halt) == (20, 1, 0, None)
    assert outcomes(job)["n404"] == "unavailable"


async def test_an_id_source_that_raises_stops_a_shared_run_and_its_ids_stay_in_the_job(
        job: str) -> None:
    """The merge caught only storage errors: what the source raised was dropped with the IDs
    it had given since the first chunk, and the run said it had finished (exit 0)."""
    from asyncrawl import Crawler

    async def ids() -> Any:
        yield "first"
        deadline = asyncio.get_running_loop().time() + 20
        while not api.paid():  # (the first chunk is merged and fetched at once)
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        for i in range(5):
            yield f"later{i}"
        raise RuntimeError("my ID source failed")

    async with MockAPI(api_key=KEY) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job)
        with pytest.raises(RuntimeError, match="my ID source failed"):
            async with Crawler(cfg) as c:
                await asyncio.wait_for(c.run(ids()), 60)
        assert c.halt is not None and c.halt.reason == "error"
        assert sorted(x for (x,) in pg_rows("SELECT id FROM asyncrawl_items WHERE job = %s "
                                            "UNION SELECT unnest(ids) FROM asyncrawl_blocks "
                                            "WHERE job = %s", job, job)) == \
            ["first"] + [f"later{i}" for i in range(5)]
        async with Crawler(cfg) as c:  # a rerun fetches what the job was given
            s = await c.run([])
        assert (s.ok, s.exit_code) == (6, 0)


async def test_a_slow_async_id_source_is_crawled_as_its_ids_come_in_a_shared_job(
        job: str) -> None:
    """After its first chunk, a library caller's IDs waited in the merge for 100,000 more (or
    the source's end) before the job had them: a queue fed over time was not crawled."""
    from asyncrawl import Crawler

    async with MockAPI(api_key=KEY) as api:
        async def ids() -> Any:
            yield "first"
            for i in range(3):
                deadline = asyncio.get_running_loop().time() + 20
                while len(api.paid()) < i + 1:  # (never, before: the next waited for more)
                    assert asyncio.get_running_loop().time() < deadline, "an ID waited"
                    await asyncio.sleep(0.01)
                yield f"then{i}"

        cfg = fast_config(api, Path("unused"), state_url=PG, job=job)
        async with Crawler(cfg) as c:
            s = await c.run(ids())
        assert (s.ok, s.exit_code) == (4, 0)

        fetched: list[int] = []

        async def trickle() -> Any:  # an ID every 50 ms: the merge's wait is never 0.2 s
            for i in range(60):
                yield f"t{i}"
                await asyncio.sleep(0.05)
            fetched.append(len([x for x in api.paid() if x.startswith("t")]))

        async with Crawler(cfg) as c:
            s = await c.run(trickle())
    assert (s.ok, s.exit_code) == (64, 0)
    assert fetched[0] >= 40  # (1 before: the rest waited for the source's end)


async def test_a_request_that_may_have_reached_the_server_unanswered_is_listed_in_a_job(
        job: str) -> None:
    """As on a local state (test_crawler): a dropped connection or a timeout after the
    connect lists the ID as unanswered; fetched since, it is possibly billed twice."""
    from asyncrawl import Crawler

    faults = {"dropped": Fault("drop", times=1), "late": Fault("slow", delay=1.0)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job, timeout=0.3, max_tries=2)
        async with Crawler(cfg) as c:
            s = await c.run(["fine", "dropped", "late"])
    assert (s.ok, s.unavailable) == (2, 1)
    assert sorted(pg_rows("SELECT id, doubt FROM asyncrawl_items WHERE job = %s AND doubt IS "
                          "NOT NULL", job)) == [("dropped", 3), ("late", 2)]
    snap = read_store(PG, job=job).snapshot()
    assert (snap.unanswered, snap.unanswered_refetched, snap.in_doubt, snap.unsure_calls) == (
        1, 1, 0, 5)
    assert dict(read_store(PG, job=job).unanswered()) == {"dropped": True, "late": False}
    assert list(read_store(PG, job=job).in_doubt()) == []


def _run(config: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(config),
                             "--no-progress", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})


def _config(tmp_path: Path, url: str, job: str, ids: Path | None, **sections: dict[str, Any]
            ) -> Path:
    path = write_config(tmp_path / f"config-{uuid.uuid4().hex[:6]}.toml", url,
                        tmp_path / "unused", ids or tmp_path / "none.txt", **sections)
    text = path.read_text().replace(f'dir = "{tmp_path / "unused"}"',
                                    f'url = "{PG}"\njob = "{job}"\nlease = 2')
    if ids is None:
        text = text.replace(f'ids = "{tmp_path / "none.txt"}"', "")
    path.write_text(text)
    return path


def _wait_for(pred: Any, timeout: float, what: str) -> None:
    """Poll ``pred`` until it holds (a table that is not there yet: the process watched has
    not created it yet, on a database where no test has run before)."""
    import psycopg

    deadline = time.monotonic() + timeout

    def holds() -> bool:
        try:
            return bool(pred())
        except psycopg.errors.UndefinedTable:
            return False

    while not holds():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_three_processes_share_a_job_and_fetch_each_id_once(tmp_path: Path, job: str,
                                                            mock_process: Any) -> None:
    """One process is given the IDs, two join with none; all three work, each ID is paid
    for once, and the job-wide rate holds: 3 processes at 300/s together within the bound."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.02")
    ids = write_ids(tmp_path / "ids.txt", [f"x{i}" for i in range(3000)])
    rate = {"limits": {"concurrency": 8, "rate": 300, "burst": 10}}
    giver = _run(_config(tmp_path, mock.item_url, job, ids, **rate))
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s", job)[0][0],
              30, "the first IDs merged")
    joiners = [_run(_config(tmp_path, mock.item_url, job, None, **rate)) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in (giver, *joiners)]
    codes = [p.returncode for p in (giver, *joiners)]
    assert codes == [0, 0, 0], outs
    log = [e for e in mock.settled_log() if e.event == "end" and e.status == 200]
    assert collections.Counter(e.id for e in log) == {f"x{i}": 1 for i in range(3000)}
    assert len(pg_rows("SELECT run FROM asyncrawl_runs WHERE job = %s", job)) == 3
    # the job-wide rate: in any 1-s window, at most rate x 1.05 + burst answers started
    starts = sorted(e.t for e in mock.settled_log() if e.event == "start")
    worst = max(sum(1 for t in starts[i:i + 400] if t < s + 1.0) for i, s in enumerate(starts))
    assert worst <= 300 * 1.05 + 10, worst
    out = cli("status", "--state", PG, "--job", job, "--json")
    assert out.returncode == 0, out.stderr
    assert '"ok": 3000' in out.stdout


def test_a_process_waiting_for_its_second_pass_leaves_the_rate_to_one_at_work(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    """A process whose pass 1 is over waits out the cool-down of its failures; another joins
    the job with new IDs: the waiting one is idle (it holds and sends nothing), so the one at
    work takes the job's whole rate, not half of it (before: 50 of 100 req/s). When the
    first has work again (its pass 2, then the joiner's IDs: it takes part in their pass 1
    rather than end while the job has work, which it did with exit 6, "IDs still failed"),
    it takes its share back before it sends: the job stays within its rate all along."""
    mock = mock_process("--api-key", KEY, "--faults", "flaky", "--latency", "0.02")
    rate = {"limits": {"concurrency": 32, "rate": 100, "burst": 5},
            "passes": {"cooldown": 10}}
    a_ids = write_ids(tmp_path / "a.txt", [f"a{i}" for i in range(200)])
    first = _run(_config(tmp_path, mock.item_url, job, a_ids, retry={"max_tries": 1}, **rate))
    procs = [first]
    try:
        # its pass 1 is over (every ID has an outcome, some failed: pass 2 after 10 s)
        _wait_for(lambda: pg_rows("SELECT count(*) FILTER (WHERE state IS NOT NULL), "
                                  "count(*) FILTER (WHERE state = 'failed') FROM "
                                  "asyncrawl_items WHERE job = %s", job)[0]
                  in [(200, n) for n in range(1, 201)], 30, "the first process's pass 1")
        over = time.time()
        # (IDs the flaky mix answers at once: its per-ID 429s would pause the joiner)
        clean = [f"b{i}" for i in range(6000) if flaky_faults(f"b{i}") == no_faults(f"b{i}")]
        b_ids = write_ids(tmp_path / "b.txt", clean[:2000])
        procs.append(_run(_config(tmp_path, mock.item_url, job, b_ids, **rate)))
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], (outs[0][1], outs[1][1][-1500:])
    assert "the job has new IDs" in outs[0][1]  # the first took part in the joiner's pass 1
    log = [e for e in mock.settled_log() if e.event == "start"]
    joiner = sorted(e.t for e in log if e.id.startswith("b"))
    back = min(e.t for e in log if e.id.startswith("a") and e.t > over)  # its pass 2
    t0 = joiner[0]
    assert back > t0 + 5  # (the window below is the joiner's alone)
    window = [t for t in joiner if t0 + 1 <= t < t0 + 5]  # 4 s, its join and first second out
    assert len(window) >= 0.85 * 100 * 4, (len(window), outs[1][1][-2000:])
    starts = sorted(e.t for e in log)
    worst = most_in_window(starts)
    assert worst <= 100 * 1.05 + 5, worst


def test_two_idle_processes_resuming_together_keep_to_the_job_s_rate(job: str) -> None:
    """Two processes of a job, both idle (both waiting out the cool-down before pass 2): each
    sees itself alone at work and takes the whole job's rate and burst, its bucket filling
    while it sends nothing. Both given work 50 ms apart: a process that resumes re-joins as a
    newcomer does (its buckets used up, then its share), so together they keep to rate x 1.05
    + burst in any 1 s (rate 100, burst 100: 219-233 starts before, against 205)."""
    from asyncrawl.governor import Governor
    from asyncrawl.jobwide import Heartbeat
    from asyncrawl.stop import Stop

    rate, burst = 100.0, 100

    async def go() -> list[float]:
        loop = asyncio.get_running_loop()
        stores = [await _run_of(job, pid) for pid in (1, 2)]
        govs = [Governor(rate=rate, burst=burst, adaptive=False) for _ in stores]
        beats = [Heartbeat(s, Stop(), (lambda g=g: g)) for s, g in zip(stores, govs, strict=True)]
        for h, g in zip(beats, govs, strict=True):
            await h.join()
            g._sent = True  # (both at work a while: their buckets spent as they send)
        tasks = [asyncio.create_task(h.run()) for h in beats]
        starts: list[float] = []
        try:
            await asyncio.sleep(0.5)
            for h in beats:
                h.waiting = True  # pass 1 over: the cool-down, idle
            # until each has published itself idle and seen the other so (whole buckets)
            deadline = loop.time() + 10
            while any(g.runs != 1 for g in govs):
                assert loop.time() < deadline, [g.runs for g in govs]
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # their buckets fill

            async def send(h: Heartbeat, g: Governor, delay: float) -> None:
                await asyncio.sleep(delay)
                await h.at_work()  # a batch claimed: re-join first
                end = loop.time() + 3.0
                while loop.time() < end:
                    await g.acquire()
                    starts.append(loop.time())

            await asyncio.gather(send(beats[0], govs[0], 0.0), send(beats[1], govs[1], 0.05))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in stores:
                await s.close()
        return sorted(starts)

    starts = asyncio.run(go())
    worst = most_in_window(starts)
    assert worst <= rate * 1.05 + burst, worst


def test_kill_9_of_one_process_loses_nothing_and_its_leases_return(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = write_ids(tmp_path / "ids.txt", [f"k{i}" for i in range(2000)])
    cfg = _config(tmp_path, mock.item_url, job, ids, limits={"concurrency": 16, "rate": 400})
    victim = _run(cfg)
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s", job)[0][0],
              30, "the first IDs merged")  # (a process given no IDs ends if the job has none)
    other = _run(_config(tmp_path, mock.item_url, job, None, limits={"concurrency": 16,
                                                                     "rate": 400}))
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s AND "
                              "state = 'ok'", job)[0][0] >= 300, 60, "300 IDs ok")
    held = pg_rows("SELECT count(*) FROM asyncrawl_items i JOIN asyncrawl_runs r ON "
                   "i.lease_owner = r.run WHERE i.job = %s AND r.pid = %s AND i.state IS NULL",
                   job, victim.pid)[0][0]
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    _, err = other.communicate(timeout=120)
    assert other.returncode == 0, err
    log = [e for e in mock.settled_log() if e.event == "end" and e.status == 200]
    paid = collections.Counter(e.id for e in log)
    by = pg_rows("SELECT coalesce(state, 'none'), count(*) FROM asyncrawl_items WHERE job = %s "
                 "GROUP BY 1", job)
    assert set(paid) == {f"k{i}" for i in range(2000)}, (by, err[-3000:])  # nothing lost
    twice = [i for i, n in paid.items() if n > 1]
    assert len(twice) <= max(held, 16 + 256), (len(twice), held)  # at most what it held
    snap = read_store(PG, job=job).snapshot()
    assert snap.counts == Counts(ok=2000, failed=0, unavailable=0)
    # what the dead process had sent without a result kept is reported in doubt
    assert snap.in_doubt + snap.billed_twice >= len(twice)


def test_a_connection_to_a_server_gone_silent_fails_in_seconds() -> None:
    """A network cut that drops packets (a host gone, a firewall): libpq's connection waited
    for TCP to give up, ~15 min while sending and for ever while idle, the run hung (a stalled
    store). Each connection now probes an idle server after 5 s and gives up on unacknowledged
    data after 20 s (the socket's options, as the kernel has them)."""
    import socket

    from asyncrawl.pgstore import _connect

    for run in (True, False):
        db = _connect(PG, "test", run)
        try:
            s = socket.socket(fileno=db.pgconn.socket)
            try:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
            finally:
                s.detach()
        finally:
            db.close()


def test_a_heartbeat_connection_the_server_ends_is_opened_again_not_a_halt(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    """The server ends the run's heartbeat connection (an administrator, a pooler, a failover):
    the next beat opens another and the run finishes. The first failed beat stopped the run,
    exit 5, though the database answered. A heartbeat that fails for 3 s still stops it (the
    cool-down test above)."""
    n = 1500
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = write_ids(tmp_path / "ids.txt", [f"h{i}" for i in range(n)])
    cfg = _config(tmp_path, mock.item_url, job, ids, limits={"concurrency": 8, "rate": 400})
    since = pg_rows("SELECT now()")[0][0]
    run = _run(cfg)
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s AND "
                              "state = 'ok'", job)[0][0] >= 200, 60, "200 IDs ok")
    ended: set[int] = set()
    for _ in range(3):  # (the connection is the heartbeat's and the live figures': the
        # heartbeat, every 0.3 s, is the likelier to meet the ended one first)
        def control() -> list[tuple[Any, ...]]:
            return [row for row in pg_rows(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                "AND backend_start >= %s", f"asyncrawl control {run.pid}", since)
                if row[0] not in ended]
        _wait_for(control, 30, "the run's control connection (made again)")
        (pid,), = control()
        assert pg_rows("SELECT pg_terminate_backend(%s)", pid) == [(True,)]
        ended.add(pid)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, (out, err)
    if "the job's heartbeat failed" in err:
        assert "goes through again" in err
    assert read_store(PG, job=job).snapshot().counts == Counts(ok=n, failed=0, unavailable=0)


def test_a_process_stopped_by_a_signal_does_not_halt_the_job_the_others_finish(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    """The job's halt (``status``) is the one of the run that ended last: a process stopped
    by SIGTERM while another finishes the job leaves it finished, not halted."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.02")
    ids = write_ids(tmp_path / "ids.txt", [f"t{i}" for i in range(600)])
    limits = {"concurrency": 4, "rate": 200}
    other = _run(_config(tmp_path, mock.item_url, job, ids, limits=limits))
    done = "SELECT count(*) FROM asyncrawl_items WHERE job = %s AND state = 'ok'"
    _wait_for(lambda: pg_rows(done, job)[0][0] >= 50, 60, "50 IDs ok")
    quitter = _run(_config(tmp_path, mock.item_url, job, None, limits=limits))  # (the later)
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_runs WHERE job = %s AND "
                              "ended IS NULL", job)[0][0] == 2, 60, "both runs going")
    quitter.send_signal(signal.SIGTERM)
    _, err = quitter.communicate(timeout=60)
    assert quitter.returncode == 143, err
    _, err = other.communicate(timeout=120)
    assert other.returncode == 0, err
    snap = read_store(PG, job=job).snapshot()
    assert snap.counts == Counts(ok=600, failed=0, unavailable=0)
    assert snap.halt is None, snap.halt


def test_a_process_stopped_past_its_leases_does_not_send_what_another_took(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    """A process frozen (SIGSTOP: a stopped VM, a long pause) past its 2-s leases while another
    takes its IDs and fetches them: once it runs again, it does not send the IDs it held and
    had not sent (their intents are refused); only what it had out when it froze may be paid
    twice, and that is in doubt. It was every ID it held."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = write_ids(tmp_path / "ids.txt", [f"s{i}" for i in range(300)])
    victim = _run(_config(tmp_path, mock.item_url, job, ids,
                          limits={"concurrency": 4, "rate": 20, "burst": 1}))
    done = "SELECT count(*) FROM asyncrawl_items WHERE job = %s AND state = 'ok'"
    _wait_for(lambda: pg_rows(done, job)[0][0] >= 20, 60, "20 IDs ok")
    victim.send_signal(signal.SIGSTOP)
    try:
        held = pg_rows("SELECT count(*) FROM asyncrawl_items i JOIN asyncrawl_runs r ON "
                       "i.lease_owner = r.run WHERE i.job = %s AND r.pid = %s AND "
                       "i.state IS NULL", job, victim.pid)[0][0]
        assert held > 4 * 4  # far more than it can have in flight: the test can tell
        other = _run(_config(tmp_path, mock.item_url, job, None,
                             limits={"concurrency": 16, "rate": 400}))
        _, err = other.communicate(timeout=120)
        assert other.returncode == 0, err
        assert pg_rows(done, job)[0][0] == 300
    finally:
        victim.send_signal(signal.SIGCONT)
    _, err = victim.communicate(timeout=60)
    assert victim.returncode == 0, err
    paid = collections.Counter(e.id for e in mock.settled_log()
                               if e.event == "end" and e.status == 200)
    assert set(paid) == {f"s{i}" for i in range(300)}
    twice = sorted(i for i, n in paid.items() if n > 1)
    assert len(twice) <= 4, (twice, held)  # what it had in flight (concurrency 4)
    snap = read_store(PG, job=job).snapshot()
    assert snap.counts == Counts(ok=300, failed=0, unavailable=0)
    assert snap.in_doubt + snap.billed_twice >= len(twice)
    assert "lost the lease" in err


def test_a_402_seen_by_one_process_halts_all_within_a_second(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05",
                        "--balance", "400")
    ids = write_ids(tmp_path / "ids.txt", [f"h{i}" for i in range(5000)])
    limits = {"limits": {"concurrency": 8, "rate": 500}}
    alerts = tmp_path / "alerts.txt"
    on_halt = {"alerts": {"on_halt": f"echo $ASYNCRAWL_REASON >> {alerts}"}}
    # the second process does not take a 402 for fatal itself: it halts because the first did
    blind = {"retry": {"max_tries": 3, "backoff_base": 0.01, "backoff_max": 0.05,
                       "retry_after_max": 2, "fatal": [401]}}
    first = _run(_config(tmp_path, mock.item_url, job, ids, **limits, **on_halt))
    _wait_for(lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s", job)[0][0],
              30, "the first IDs merged")
    procs = [first, _run(_config(tmp_path, mock.item_url, job, None, **limits, **on_halt,
                                 **blind))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs[1][1]
    assert "halted by another process of the job" in outs[1][1]
    entries = mock.settled_log()
    first_402 = min(e.t for e in entries if e.event == "end" and e.status == 402)
    last_start = max(e.t for e in entries if e.event == "start")
    assert last_start - first_402 < 1.0 + 0.5  # within 1 s (+ the heartbeat's own read)
    assert alerts.read_text().split() == ["fatal"]  # sent once, by the process that met it
    ok = pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s AND state = 'ok'", job)
    assert ok[0][0] == 400  # every paid answer kept
    # the calls counted are those that left (an intent whose request the halt kept back is
    # taken back), and both processes ended cleanly: nothing in doubt
    s = orjson.loads(cli("status", "--state", PG, "--job", job, "--json").stdout)
    assert s["requests_sent"] == sum(1 for e in entries if e.event == "start"), s
    assert s["in_doubt"] == 0


def test_status_and_export_of_a_job_that_does_not_exist_say_so(job: str) -> None:
    out = cli("status", "--state", PG, "--job", job)
    assert out.returncode == 2
    assert f"no job {job!r}" in out.stderr


def _cut_the_database(tmp_path: Path, cfg: Path, ready: Any, what: str
                      ) -> tuple[str, str, Path]:
    """Run ``cfg`` (a JSON log, an ``on_halt`` alert to ``alert.txt``) through a TCP proxy in
    front of PostgreSQL, killed once ``ready()``: its output and its log."""
    log = tmp_path / "run.jsonl"
    proxy = subprocess.Popen([sys.executable, "-c", PROXY], stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        text = cfg.read_text().replace(PG, PG.replace("127.0.0.1:5432", f"127.0.0.1:{port}"))
        cfg.write_text(text + f"[alerts]\non_halt = \"echo $ASYNCRAWL_REASON >> "
                              f"'{tmp_path / 'alert.txt'}'\"\n")
        run = _run(cfg, "--log-format", "json", "--log-file", str(log))
        _wait_for(ready, 60, what)
        proxy.kill()
        proxy.wait()
        out, err = run.communicate(timeout=60)
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
        if proxy.stdout is not None:
            proxy.stdout.close()
    assert run.returncode == 5, (out, err)
    # a halt like the others (it could escape the run, which then skipped its summary, its
    # halt line and its alerts)
    assert (tmp_path / "alert.txt").read_text().split() == ["storage"]
    events = [orjson.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["event"] == "halt" and events[-1]["reason"] == "storage"
    assert any(e["event"] == "summary" for e in events)
    return out, err, log


def test_a_wrong_database_or_user_in_the_url_is_a_usage_error_not_a_server_gone(
        tmp_path: Path, job: str) -> None:
    """A URL naming a database or a role the server does not have: the server answered, so
    no rerun cures it; exit 2 with the server's words and what to check, for ``run`` and for
    ``status`` (it was exit 5, "the server is unreachable or went away ... rerun to resume")."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(PG)
    no_db = urlunsplit(parts._replace(path="/asyncrawl_no_such_database"))
    no_role = urlunsplit(parts._replace(netloc=f"asyncrawl_no_such_role@{parts.hostname}"
                                                f":{parts.port or 5432}"))
    # (and URLs libpq cannot read: they were exit 5, "unreachable ... rerun to resume")
    bad_port = urlunsplit(parts._replace(netloc=f"{parts.netloc.rsplit(':', 1)[0]}:99999"))
    bad_mode = PG + ("&" if "?" in PG else "?") + "sslmode=bogus"
    ids = write_ids(tmp_path / "ids.txt", ["a"])
    for url, said in ((no_db, 'database "asyncrawl_no_such_database" does not exist'),
                      (no_role, 'role "asyncrawl_no_such_role" does not exist'),
                      (bad_port, 'invalid port number: "99999"'),
                      (bad_mode, 'invalid sslmode value: "bogus"')):
        run = subprocess.run([sys.executable, "-m", "asyncrawl", "run", "--url",
                              "http://127.0.0.1:9/items/{id}", "--ids", str(ids), "--state", url,
                              "--job", job, "--no-progress"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **ENV}, cwd=tmp_path)
        status = subprocess.run([sys.executable, "-m", "asyncrawl", "status", "--state", url,
                                 "--job", job], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path)
        for r in (run, status):
            assert r.returncode == 2, r.stderr
            assert said in r.stderr and ("refused the connection" in r.stderr
                                         or "no PostgreSQL URL libpq can read" in r.stderr)
            assert "rerun" not in r.stderr


def test_the_database_going_away_stops_the_run_with_exit_5(tmp_path: Path, job: str,
                                                          mock_process: Any) -> None:
    """A TCP proxy in front of PostgreSQL, cut mid-run: the run stops, exit 5, saying the
    server went away; a rerun through the server resumes and finishes."""
    n = 1000  # (~6 s of crawl at 8 requests of 50 ms in flight: cut after the first 200)
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = write_ids(tmp_path / "ids.txt", [f"g{i}" for i in range(n)])
    cfg = _config(tmp_path, mock.item_url, job, ids, limits={"concurrency": 8, "rate": 500})
    _, err, log = _cut_the_database(
        tmp_path, cfg, lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s "
                                       "AND state = 'ok'", job)[0][0] >= 200, "200 IDs ok")
    said = err + log.read_text()  # (the log file has the messages)
    assert "PostgreSQL server is unreachable or went away" in said
    assert "nothing committed is lost" in said
    kept = pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s AND state = 'ok'", job)
    rerun = _run(_config(tmp_path, mock.item_url, job, ids, limits={"concurrency": 8,
                                                                    "rate": 500}))
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    paid = collections.Counter(e.id for e in mock.settled_log()
                               if e.event == "end" and e.status == 200)
    assert set(paid) == {f"g{i}" for i in range(n)}
    assert sum(paid.values()) - n <= 8 + 256  # re-fetched: at most what was in flight
    assert kept[0][0] >= 200


def test_the_database_lost_in_the_cool_down_halts_with_a_summary_and_the_alert(
        tmp_path: Path, job: str, mock_process: Any) -> None:
    """The database goes away while the run waits out the cool-down: the heartbeat stops the
    run, and the pass's own read of the job then raised out of the run: exit 5 with one error
    line, no summary, no halt line, no alert."""
    n = 200
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    ids = write_ids(tmp_path / "ids.txt", [f"c{i}" for i in range(n)])
    cfg = _config(tmp_path, mock.item_url, job, ids, passes={"cooldown": 60})
    out, err, log = _cut_the_database(  # (pass 1 is over once every ID has a state)
        tmp_path, cfg, lambda: pg_rows("SELECT count(*) FROM asyncrawl_items WHERE job = %s "
                                       "AND state IS NOT NULL", job)[0][0] == n, "pass 1 done")
    events = [orjson.loads(line) for line in log.read_text().splitlines()]
    summary = next(e for e in events if e["event"] == "summary")
    assert summary["ok"] + summary["failed"] == n
    assert "the job's database failed" in out + err and "free space" not in out + err


# A TCP forwarder to PostgreSQL that the test can cut (kill) mid-run.
PROXY = """
import asyncio, sys
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def handle(r, w):
    ur, uw = await asyncio.open_connection("127.0.0.1", 5432)
    await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def test_merge_is_idempotent_and_its_ids_are_taken_in_once(job: str) -> None:
    """Merging IDs into a job: blocks the job has already (the same IDs merged again) add
    nothing (the rate is in bench/); blocks that overlap the job's IDs (another run's, a
    rerun's extended file, an ID twice in one chunk) add only the IDs it lacks once taken in,
    whether a plain insert of all-new IDs meets them first or not. Two runs claiming at once
    take each ID in once and claim it once, and the counts know the IDs not taken in yet."""
    from asyncrawl.pgstore import BLOCK, PgStore
    from asyncrawl.records import Record

    async def opened() -> PgStore:
        store = await PgStore.open(PG, job)
        store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
        return store

    open_blocks = "SELECT count(*) FROM asyncrawl_blocks WHERE job = %s AND ids IS NOT NULL"

    async def drain(store: PgStore) -> list[str]:
        """Claim until nothing is left to claim or take in (a claim finds nothing while the
        other run takes in the last block: it asks again)."""
        got: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batch = await store.claim(1, 700)
            got += [row[0] for row in batch]
            if not batch and not pg_rows(open_blocks, job)[0][0]:
                break
            await asyncio.sleep(0)
        return got

    async def go() -> tuple[tuple[int, ...], int, list[str], list[str]]:
        store, other = await opened(), await opened()
        try:
            a = await store.merge([f"m{i}" for i in range(2 * BLOCK)])
            again = await store.merge([f"m{i}" for i in range(2 * BLOCK)])
            b = await store.merge([f"m{i}" for i in range(BLOCK, 3 * BLOCK)])
            c = await store.merge(["m1", "new-1", "new-1"])
            # another run: its first block overlaps the job's IDs at its end only
            d = await other.merge([f"o{i}" for i in range(5_000)] + [f"m{3 * BLOCK - 1}"])
            e = await other.merge(["new-2", "new-2"])
            pending = (await store.run_counts()).pending
            mine, theirs = await asyncio.gather(drain(store), drain(other))
            return (a, again, b, c, d, e), pending, mine, theirs
        finally:
            await store.close()
            await other.close()

    added, pending, mine, theirs = asyncio.run(go())
    assert added == (2 * BLOCK, 0, BLOCK, 3, 5_001, 2)  # (m10000… is a block the job has)
    every = {f"m{i}" for i in range(3 * BLOCK)} | {f"o{i}" for i in range(5_000)} \
        | {"new-1", "new-2"}
    assert pending == len(every)
    assert sorted(mine + theirs) == sorted(every)  # each claimed once, none lost
    assert pg_rows("SELECT count(*), count(DISTINCT id) FROM asyncrawl_items WHERE job = %s",
                   job) == [(len(every), len(every))]
    assert pg_rows(open_blocks, job) == [(0,)]


def test_two_runs_merging_the_same_blocks_in_another_order_do_not_deadlock(job: str) -> None:
    """Two processes given files that share whole blocks in another order insert those blocks
    at once: each merge locks them in the digests' order, so neither is rolled back by a
    deadlock (which stopped a run: exit 5). Before: a deadlock in 4 trials of 10."""
    from asyncrawl.pgstore import BLOCK, PgStore
    from asyncrawl.records import Record

    async def go(trial: int) -> tuple[int, int]:
        a, b = await PgStore.open(PG, job), await PgStore.open(PG, job)
        try:
            for s in (a, b):
                s.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            blocks = [[f"t{trial}-{k}-{i}" for i in range(BLOCK)] for k in range(4)]
            return await asyncio.gather(a.merge([i for blk in blocks for i in blk]),
                                        b.merge([i for blk in blocks[::-1] for i in blk]))
        finally:
            await a.close()
            await b.close()

    for trial in range(8):
        assert sum(asyncio.run(go(trial))) == 4 * BLOCK  # each block once, by one of the two


def test_a_claim_that_meets_blocks_the_job_has_settled_answers_in_time(
        job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun's file edited at its top: every block is new, its IDs settled already but two.
    A claim takes such blocks in for ``TAKE_IN_FOR`` seconds at most (not all of them before
    it answers: the run's end and its merge wait for the claim), and the run asks again at
    once until it reaches the new IDs."""
    from asyncrawl import pgstore
    from asyncrawl.jobwide import claimed
    from asyncrawl.stop import Stop

    monkeypatch.setattr(pgstore, "TAKE_IN_FOR", 0.0)  # a block a claim

    async def go() -> tuple[list[Any], bool, list[str]]:
        store = await _run_of(job, 1)
        try:
            old = [f"s{i}" for i in range(3 * pgstore.BLOCK)]
            await store.merge(old)
            await store.take_in()
            pg_rows("UPDATE asyncrawl_items SET state = 'ok' WHERE job = %s RETURNING 1", job)
            await store.merge([*old[1:], "new-1", "new-2"])  # its first line gone: new blocks
            first = await store.claim(1, 10)
            pending = store.taking_in
            got = []
            async for batch in claimed(store, 1, Stop(), lambda: False, 10):
                got += [row[0] for row in batch]
            return first, pending, sorted(got)
        finally:
            await store.close()

    first, pending, got = asyncio.run(go())
    assert first == [] and pending  # one block of settled IDs taken in, then the answer
    assert got == ["new-1", "new-2"]


def test_the_readme_commands_for_several_machines_run(tmp_path: Path, job: str,
                                                      mock_process: Any) -> None:
    """The README's "Several machines" commands, against this machine's PostgreSQL."""
    import re

    from .conftest import ROOT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Several machines"):text.index("## Budget caps")]
    body = re.search(r"<!-- not-run: needs a PostgreSQL server.*?-->\n```sh\n(.*?)```", section,
                     re.S)
    assert body is not None
    script = body.group(1).replace("postgresql://crawler@db.internal:5432/crawls", PG)
    script = script.replace("--job notes", f"--job {job}")
    mock = mock_process("--api-key", KEY, "--faults", "demo", "--latency", "0.02")
    ids = write_ids(tmp_path / "notes-ids.txt", [f"n-{i}" for i in range(400)])
    write_config(tmp_path / "notes.toml", mock.item_url, tmp_path / "notes-state", ids)
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}"
                                                         f"{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    assert re.search(r"^ok\s+\d", r.stdout, re.M), r.stdout
    paid = collections.Counter(e.id for e in mock.settled_log()
                               if e.event == "end" and e.status == 200)
    from asyncrawl.testing import demo_faults

    again = {i for i, n in paid.items() if n > 1}  # a paid answer that did not parse: bought
    assert paid and all(demo_faults(i).kind == "invalid_json" for i in again)  # again, once
    assert not (tmp_path / "notes-state").exists()  # the state was the database's


def test_the_job_signals_reach_every_run(job: str) -> None:
    """Two runs of one job, through the store: a pause and a halt published by one are seen
    by the other's heartbeat (not by its own), the first halt wins, and both count as live."""
    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record
    from asyncrawl.types import Halt

    async def go() -> None:
        a, b = await PgStore.open(PG, job), await PgStore.open(PG, job)
        try:
            for s in (a, b):
                s.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            assert (await a.heartbeat()).live == 2
            await a.publish_pause(5.0)
            seen = await b.heartbeat()
            assert 4.0 < seen.pause_for <= 5.0 and seen.halt is None
            assert await a.publish_halt(Halt("fatal", 402, "HTTP 402"))
            assert not await b.publish_halt(Halt("fatal", 401, "HTTP 401"))  # a's came first
            got = await b.heartbeat()
            assert got.halt is not None and got.halt.status == 402
            assert (await a.heartbeat()).halt is None  # its own halt: it knows already
            b.commit([Record("end", extra={})])
            assert (await a.heartbeat()).live == 1
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_a_run_counts_as_merging_from_its_registration(job: str) -> None:
    """A joining run does not take the job for done while another run is registered but has
    not merged its first IDs yet; it does once that run's merge is through."""
    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record

    async def go() -> None:
        giver, joiner = await PgStore.open(PG, job), await PgStore.open(PG, job)
        try:
            giver.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            joiner.commit([Record("run", extra={"version": "t", "pid": 2, "job": None})])
            await joiner.set_merging(False)  # the joiner brought no IDs
            assert await joiner.claim(1, 10) == []
            assert await joiner.pass_left(1)  # the giver is still to merge: wait
            await giver.merge(["a", "b"])
            await giver.set_merging(False)
            assert sorted(r[0] for r in await joiner.claim(1, 10)) == ["a", "b"]
            assert not await joiner.pass_left(1)  # everything is in the joiner's hands
        finally:
            await giver.close()
            await joiner.close()

    asyncio.run(go())


async def test_calls_per_api_key_in_a_shared_job(job: str) -> None:
    from asyncrawl import Crawler
    from asyncrawl.config import key_fingerprint

    wrong = "revoked-key-0f0f"
    async with MockAPI(api_key=KEY) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job, headers={},
                          keys=[KEY, wrong])
        async with Crawler(cfg) as c:
            s = await c.run([f"k{i}" for i in range(120)])
        assert s.ok == 120 and s.halt is None
    snap = read_store(PG, job=job).snapshot()
    by_key: dict[str, list[int]] = {}
    for _, key, sent, billable in snap.keys:
        by_key.setdefault(key, [0, 0])
        by_key[key][0] += sent
        by_key[key][1] += billable
    assert set(by_key) == {key_fingerprint(KEY), key_fingerprint(wrong)}
    assert by_key[key_fingerprint(KEY)][1] == 120 == snap.billable
    assert by_key[key_fingerprint(wrong)][1] == 0 and by_key[key_fingerprint(wrong)][0] >= 1
    assert sum(sent for sent, _ in by_key.values()) == snap.sent


def test_of_two_first_runs_with_different_configs_the_second_is_refused(job: str) -> None:
    """The job's identity is claimed in one statement: the second first run sees the first's."""
    from asyncrawl import Config, JobMismatch
    from asyncrawl.config import check_job

    a = Config(url="http://127.0.0.1:1/a/{id}", state_url=PG, job=job)
    b = Config(url="http://127.0.0.1:1/b/{id}", state_url=PG, job=job)

    async def both() -> tuple[Any, Any]:
        from asyncrawl.store import open_store

        sa = await open_store(PG, job)
        sb = await open_store(PG, job)
        try:
            assert sa.job is None and sb.job is None  # neither has run: no identity yet
            return await sa.claim_identity(a.job_identity()), \
                await sb.claim_identity(b.job_identity())
        finally:
            await sa.close()
            await sb.close()

    first, second = asyncio.run(both())
    assert first is None  # the first claim records its identity
    assert second == a.job_identity()  # the second sees the first's ...
    check_job(a, second)
    with pytest.raises(JobMismatch):  # ... and is refused
        check_job(b, second)


def test_a_commit_rolled_back_by_a_deadlock_is_written_again(job: str) -> None:
    """PostgreSQL breaks a deadlock by rolling one transaction back (40P01); when that is the
    writer's, the writer writes the batch again instead of stopping the run (exit 5)."""
    import threading

    import psycopg

    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record

    async def go() -> None:
        store = await PgStore.open(PG, job)
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            await store.merge(["a", "b"])
            assert await store.take_in() == 2
            other = psycopg.connect(PG)  # a transaction that locks b, then wants a
            other.execute("UPDATE asyncrawl_items SET sends = sends WHERE job = %s AND id = 'b'",
                          (job,))
            errors: list[BaseException] = []

            def write() -> None:  # locks a, then waits for b: a deadlock once other wants a
                try:
                    store.commit([Record.sent("a"), Record.sent("b")])
                except BaseException as e:
                    errors.append(e)

            writer = threading.Thread(target=write)
            writer.start()
            deadline = time.monotonic() + 10
            while not other.execute(  # the writer waits for other's lock on b
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = "
                    "'transactionid'").fetchone()[0]:
                assert time.monotonic() < deadline, "the writer never waited for the lock"
                await asyncio.sleep(0.01)
            # the writer waited first: its deadlock check (after deadlock_timeout) finds the
            # cycle, and its transaction is the one rolled back; other's UPDATE then goes on
            other.execute("UPDATE asyncrawl_items SET sends = sends WHERE job = %s AND id = 'a'",
                          (job,))
            other.commit()
            other.close()
            writer.join(30)
            assert not writer.is_alive() and errors == []
            rows = dict(other_rows(job))
            assert rows == {"a": 1, "b": 1}  # written once, by the second try
        finally:
            await store.close()

    asyncio.run(go())


def test_a_process_stopped_inside_a_transaction_keeps_no_ids_locked(
        job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped inside its writer's transaction (a paused VM, SIGSTOP) would keep that
    transaction's row locks for as long as it stays stopped, and every other process would
    wait for those IDs: the server ends such a session after ``IDLE_IN_TRANSACTION`` (here
    0.5 s), so the IDs can be claimed again; once the run goes on, its writer writes its next
    batch on a new connection, and a batch it was stopped in the middle of again."""
    import psycopg

    from asyncrawl import pgstore
    from asyncrawl.records import Record

    monkeypatch.setattr(pgstore, "IDLE_IN_TRANSACTION", 0.5)

    async def go() -> None:
        store = await pgstore.PgStore.open(PG, job, lease=0.5)
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            await store.merge(["a", "b"])
            assert await store.take_in() == 2
            writer = store._conns["writer"]
            other = psycopg.connect(PG, autocommit=True)
            with contextlib.suppress(psycopg.Error), writer.transaction():  # stopped inside
                writer.execute("UPDATE asyncrawl_items SET sends = sends WHERE job = %s AND "
                               "id = 'a'", (job,))
                deadline = time.monotonic() + 30
                while not other.execute("SELECT id FROM asyncrawl_items WHERE job = %s AND "
                                        "id = 'a' FOR UPDATE SKIP LOCKED", (job,)).fetchall():
                    assert time.monotonic() < deadline, "the stopped transaction kept its lock"
                    await asyncio.sleep(0.05)
            other.close()
            assert writer.broken
            store.commit([Record.sent("a")])  # it goes on, on a new connection
            # stopped between two statements of the writer's own transaction: the batch is
            # written again, once, on a new connection (nothing of it was committed)
            stalls: list[int] = []
            apply = store._apply

            def stalled(records: Any) -> None:
                if not stalls:
                    stalls.append(store._conns["writer"].info.backend_pid)
                    store._conns["writer"].execute("SELECT 1")  # (the transaction is begun)
                    deadline = time.monotonic() + 30
                    while pg_rows("SELECT 1 FROM pg_stat_activity WHERE pid = %s", stalls[0]):
                        assert time.monotonic() < deadline, "the session was never ended"
                        time.sleep(0.05)
                apply(records)

            store._apply = stalled  # type: ignore[method-assign]
            store.commit([Record.sent("b")])
            assert len(stalls) == 1 and store._conns["writer"].info.backend_pid != stalls[0]
            assert dict(other_rows(job)) == {"a": 1, "b": 1}
            # stopped after its batch's last statement, before its COMMIT reached the server
            # (which ended the session meanwhile): the server says it did not commit, and
            # the batch is written again, once
            def stalled_at_commit(records: Any) -> None:
                apply(records)
                if len(stalls) == 1:
                    stalls.append(store._conns["writer"].info.backend_pid)
                    deadline = time.monotonic() + 30
                    while pg_rows("SELECT 1 FROM pg_stat_activity WHERE pid = %s", stalls[1]):
                        assert time.monotonic() < deadline, "the session was never ended"
                        time.sleep(0.05)

            store._apply = stalled_at_commit  # type: ignore[method-assign]
            store.commit([Record.sent("a")])
            assert len(stalls) == 2 and store._conns["writer"].info.backend_pid != stalls[1]
            assert dict(other_rows(job)) == {"a": 2, "b": 1}
        finally:
            await store.close()

    asyncio.run(go())


def test_a_commit_whose_answer_was_lost_is_asked_about_not_written_twice(
        job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection lost after the server committed a batch, before its answer arrived: the
    writer asks the server (on a new connection) whether that transaction committed, and does
    not write the batch again; the same for a grant of the job's budget (the loss is
    simulated on the client's side: the connection is closed once the COMMIT is answered)."""
    import psycopg

    from asyncrawl import pgstore
    from asyncrawl.records import Record

    class AnswerLost:
        """The writer's connection, lost right after each transaction commits."""

        def __init__(self, conn: Any) -> None:
            self.conn, self.broken = conn, False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.conn, name)

        @contextlib.contextmanager
        def transaction(self) -> Iterator[Any]:
            with self.conn.transaction() as t:
                yield t
            self.broken = True
            self.conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    async def go() -> None:
        store = await pgstore.PgStore.open(PG, job)
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            await store.merge(["a"])
            assert await store.take_in() == 1
            store._conns["writer"] = AnswerLost(store._conns["writer"])
            assert store.commit([Record.sent("a")]) == frozenset()
            assert dict(other_rows(job)) == {"a": 1}
            store.commit([Record("failed", "a", status=500, error="HTTP 500", tries=1)])
            assert not isinstance(store._conns["writer"], AnswerLost)  # a new connection
            store._conns["control"] = AnswerLost(store._conns["control"])
            # (the server refusing the first connection after the loss: asked again)
            connect, refused = pgstore._connect, []

            def refusing(url: str, name: str, run: bool) -> Any:
                if name == "status" and not refused:
                    refused.append(name)
                    raise psycopg.OperationalError("the database system is starting up")
                return connect(url, name, run)

            monkeypatch.setattr(pgstore, "_connect", refusing)
            assert await store.grant_budget(5, 8) == 5
            assert refused
            assert await store.grant_budget(5, 8) == 3
            assert pg_rows("SELECT budget_taken FROM asyncrawl_jobs WHERE job = %s",
                           job) == [(8,)]
        finally:
            await store.close()

    asyncio.run(go())


async def _run_of(job: str, pid: int, cooldown: float = 0.0) -> Any:
    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record

    store = await PgStore.open(PG, job, cooldown=cooldown)
    store.commit([Record("run", extra={"version": "t", "pid": pid, "job": None})])
    return store


def test_a_dead_run_s_open_intents_are_in_doubt_while_another_run_goes_on(job: str) -> None:
    """Run a is killed with a request out; run b goes on. a's open intent was left out of the
    in-doubt list (and counted in flight) for as long as any run of the job was live: right
    after a kill of them all (the last heartbeats still fresh), or while b worked, until a's
    lease ran out and b took the ID. Now a run's own heartbeat decides."""
    import psycopg

    from asyncrawl.records import Record

    async def go() -> None:
        a, b = await _run_of(job, 1), await _run_of(job, 2)
        try:
            await a.merge(["x", "y"])
            a.commit([Record.sent("x")])  # a's request out
            b.commit([Record.sent("y")])  # b's, in flight
            await a.heartbeat(False)
            await b.heartbeat(False)
            snap = read_store(PG, job=job).snapshot()
            assert (snap.in_doubt, snap.in_flight) == (0, 2)  # both live: both in flight
            with psycopg.connect(PG, autocommit=True) as db:  # a killed: no heartbeat since
                db.execute("UPDATE asyncrawl_runs SET heartbeat = heartbeat - 3600 "
                           "WHERE run = %s", (a._run,))
            await b.heartbeat(False)  # (b goes on)
            reader = read_store(PG, job=job)
            assert [i for i, _ in reader.in_doubt()] == ["x"]
            assert [i for i, _ in reader.unanswered()] == []
            snap = reader.snapshot()
            assert (snap.in_doubt, snap.in_flight, snap.running) == (1, 1, 1)
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_an_intent_after_its_id_s_outcome_in_one_batch_stays_open(job: str) -> None:
    """As in the SQLite store (test_store.py): the later record of a batch wins."""
    from asyncrawl.records import Record

    async def go() -> None:
        store = await _run_of(job, 1)
        try:
            await store.merge(["x"])
            store.commit([Record.sent("x")])
            store.commit([Record("failed", "x", status=500, error="HTTP 500", tries=1),
                          Record.sent("x")])
        finally:
            await store.close()

    asyncio.run(go())
    assert pg_rows("SELECT state, sent_run IS NOT NULL, sends FROM asyncrawl_items "
                   "WHERE job = %s", job) == [("failed", True, 2)]


def test_a_halt_from_before_a_run_started_does_not_silence_its_own(job: str) -> None:
    """Runs restarted into a generation whose halt they ignore (it was older than them): the
    next fatal answer of one of them halts them all, and that run sends the alerts."""
    from asyncrawl.records import Record
    from asyncrawl.types import Halt

    async def go() -> None:
        a, b = await _run_of(job, 1), await _run_of(job, 2)
        assert await a.publish_halt(Halt("fatal", 402, "HTTP 402"))
        assert not await b.publish_halt(Halt("fatal", 402, "HTTP 402"))  # one halt, one alert
        # asked again (a publication cut short by a cancellation is made again): the same
        # answers, so that neither a second alert nor none at all is sent
        assert await a.publish_halt(Halt("fatal", 402, "HTTP 402"))
        assert not await b.publish_halt(Halt("fatal", 402, "HTTP 402"))
        a.commit([Record("end", extra={})])
        c, d = await _run_of(job, 3), await _run_of(job, 4)  # b lives on: the same generation
        assert (c._gen, d._gen) == (a._gen, a._gen) and (await d.heartbeat()).halt is None
        assert await c.publish_halt(Halt("fatal", 401, "HTTP 401"))
        seen = (await d.heartbeat()).halt
        assert seen is not None and seen.status == 401
        for s in (b, c, d):
            s.commit([Record("end", extra={})])
        for s in (a, b, c, d):
            await s.close()

    asyncio.run(go())


def test_a_run_that_stalled_past_its_lease_is_refused_the_send(job: str) -> None:
    """A run that stalled past its lease (a long GC pause, a stopped VM) wakes up to send an ID
    another run has claimed meanwhile: its intent is refused (the request does not leave), the
    ID is the other's, and only the other's call is in the ledger. An ID whose lease ran out
    while nobody claimed it is still the stalled run's to send."""
    import psycopg

    from asyncrawl.records import Record

    async def go() -> None:
        a, b = await _run_of(job, 1), await _run_of(job, 2)
        await a.merge(["x", "y"])
        assert sorted(r[0] for r in await a.claim(1, 10)) == ["x", "y"]
        with psycopg.connect(PG, autocommit=True) as db:  # what a 30-s stall does to the lease
            db.execute("UPDATE asyncrawl_items SET lease_until = 0 WHERE job = %s", (job,))
        (taken,) = [r[0] for r in await b.claim(1, 1)]  # the other is left unclaimed
        left = "y" if taken == "x" else "x"  # (the two expired leases: either comes first)
        assert b.commit([Record.sent(taken)]) == frozenset()
        assert a.commit([Record.sent("x"), Record.sent("y")]) == {taken}  # a wakes up: one
        b.commit([Record("ok", taken, status=200, data={"v": 1}, paid=1)])
        a.commit([Record("ok", left, status=200, data={"v": 2}, paid=1)])
        async def taken_over(item: str) -> None:
            """b's request for ``item`` is out when b stalls past its lease; a takes it over."""
            await a.merge([item])
            assert [r[0] for r in await b.claim(1, 10)] == [item]
            assert b.commit([Record.sent(item)]) == frozenset()
            with psycopg.connect(PG, autocommit=True) as db:
                db.execute("UPDATE asyncrawl_items SET lease_until = 0 WHERE job = %s "
                           "AND id = %s", (job, item))
            assert [r[0] for r in await a.claim(1, 10)] == [item]

        # the other way round: b's answer for "z" comes in: "z" is ok, and a, its lease
        # holder now, must not send it again
        await taken_over("z")
        b.commit([Record("ok", "z", status=200, data={"v": 3}, paid=1)])
        assert a.commit([Record.sent("z")]) == {"z"}
        # ... and if a's request for "w" had left before b's answer came: possibly paid twice
        await taken_over("w")
        assert a.commit([Record.sent("w")]) == frozenset()
        b.commit([Record("ok", "w", status=200, data={"v": 4}, paid=1)])
        a.commit([Record("ok", "w", status=200, data={"v": 5}, paid=1)])
        for s in (a, b):
            s.commit([Record("end", extra={})])
            await s.close()

    asyncio.run(go())
    assert pg_rows("SELECT id, sends, doubt FROM asyncrawl_items WHERE job = %s ORDER BY id",
                   job) == [("w", 2, 1), ("x", 1, None), ("y", 1, None), ("z", 1, None)]
    # (z: b's request, the only one, answered after a took z over: paid once, not in doubt;
    # it was reported billed twice)
    assert pg_rows("SELECT sum(sent)::int, sum(billable)::int FROM asyncrawl_ledger "
                   "WHERE job = %s", job) == [(5, 5)]


def test_pass_2_takes_a_failure_only_after_its_cool_down(job: str) -> None:
    """A run in pass 2 (its own pass 1 over) meets the pass-1 failures of a run that joined the
    job late: it takes each of them only once the failure has cooled down, as its own; a new
    generation of the job (a rerun) takes earlier failures in its pass 1 at once."""
    import psycopg

    from asyncrawl.records import Record

    async def go() -> None:
        a, b = await _run_of(job, 1, cooldown=60), await _run_of(job, 2, cooldown=60)
        await b.merge(["x", "y"])
        assert sorted(r[0] for r in await b.claim(1, 10)) == ["x", "y"]
        b.commit([Record.sent("x"), Record.sent("y")])
        b.commit([Record("failed", "x", status=500, error="HTTP 500", pass_no=1, tries=3),
                  Record("ok", "y", status=200, data={"v": 1}, paid=1, pass_no=1, tries=1)])
        assert await a.claim(2, 10) == []  # cooling down (60 s)
        assert await a.pass_left(2)  # but there: pass 2 waits for it
        with psycopg.connect(PG, autocommit=True) as db:  # what a minute does
            db.execute("UPDATE asyncrawl_items SET lease_until = lease_until - 61 "
                       "WHERE job = %s AND id = 'x'", (job,))
        assert [r[0] for r in await a.claim(2, 10)] == ["x"]
        a.commit([Record.sent("x"), Record("failed", "x", status=500, error="HTTP 500",
                                           pass_no=1, tries=3)])  # (as if in pass 1 again)
        for s in (a, b):
            s.commit([Record("end", extra={})])
            await s.close()
        c = await _run_of(job, 3, cooldown=60)  # no run at work: a new generation
        try:
            assert [r[0] for r in await c.claim(1, 10)] == ["x"]  # at once
        finally:
            c.commit([Record("end", extra={})])
            await c.close()

    asyncio.run(go())


def test_a_claim_under_way_when_its_run_ends_leaves_no_lease_behind(job: str) -> None:
    """A claim in a thread of its own (a producer cancelled at a stop) meets the run's end being
    committed: it waits for it and takes nothing, instead of leasing IDs to an ended run for
    a lease's time."""
    import threading

    from asyncrawl.records import Record

    async def go() -> None:
        a = await _run_of(job, 1)
        await a.merge([f"i{k}" for k in range(5)])
        inside, release = threading.Event(), threading.Event()

        def end() -> None:  # the writer's commit of the end record, held before its COMMIT
            with a._locks["writer"], a._conns["writer"].transaction():
                a._end_run(Record("end", extra={"in_doubt": []}), [], [])
                inside.set()
                release.wait(30)

        t = threading.Thread(target=end)
        t.start()
        assert inside.wait(30)
        claim = asyncio.create_task(a.claim(1, 10))
        deadline = time.monotonic() + 30
        while not claim.done() and not pg_rows(  # it waits for the end ...
                "SELECT 1 FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"):
            assert time.monotonic() < deadline, "the claim neither ended nor waited"
            await asyncio.sleep(0.01)
        release.set()
        assert await asyncio.wait_for(claim, 30) == []  # ... and takes nothing after it
        t.join(30)
        await a.close()
        b = await _run_of(job, 2)
        assert len(await b.claim(1, 10)) == 5  # nothing held by the ended run
        b.commit([Record("end", extra={})])
        await b.close()

    asyncio.run(go())


def other_rows(job: str) -> list[tuple[Any, ...]]:
    return pg_rows("SELECT id, sends FROM asyncrawl_items WHERE job = %s ORDER BY id", job)


def test_the_adaptive_rate_and_the_breaker_act_job_wide(job: str) -> None:
    """Two runs of one job, each with its heartbeat and governor: a cut of one run's adaptive
    rate becomes the other's (its share of the job's rate); while one run's breaker is open,
    the other holds its requests and the open one does not (it probes); once it closes, the
    hold is not renewed."""
    from asyncrawl.governor import Breaker, Governor, Ticket
    from asyncrawl.jobwide import Heartbeat
    from asyncrawl.pgstore import BREAKER_HOLD, PgStore
    from asyncrawl.records import Record
    from asyncrawl.stop import Stop

    async def go() -> None:
        a, b = await PgStore.open(PG, job), await PgStore.open(PG, job)
        try:
            a.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            b.commit([Record("run", extra={"version": "t", "pid": 2, "job": None})])
            ga = Governor(rate=100.0, burst=10, breaker=Breaker())
            gb = Governor(rate=100.0, burst=10, breaker=Breaker())
            ha, hb = Heartbeat(a, Stop(), lambda: ga), Heartbeat(b, Stop(), lambda: gb)
            loop = asyncio.get_running_loop()
            for h in (ha, hb, ha):
                await h.beat(loop.time())
            assert ga.effective_rate == gb.effective_rate == 50.0  # two runs: half each

            c = ga.controller
            assert c is not None
            c.rate, c.cuts = 20.0, 1  # a's adaptive rate found the quota: 20/s of its 50
            await ha.beat(loop.time())  # published: the job's rate is 40/s
            await hb.beat(loop.time())
            assert gb.effective_rate == pytest.approx(20.0)  # b's share of the job's 40
            assert gb.controller is not None and gb.controller.cuts == 0  # not b's own cut

            now = loop.time()
            for i in range(10):  # an outage: a's first tries fail, every ID alike
                ga.on_response(Ticket(now, False), f"x{i}", limited=False, failed=True,
                               retry_after=None)
            assert ga.breaker_open
            await ha.beat(loop.time())  # published: a probes, the others hold
            await hb.beat(loop.time())
            assert 0.5 < gb.paused_for <= BREAKER_HOLD
            assert ga.paused_for == 0.0  # the prober itself is not held
            await ha.beat(loop.time())
            assert ga.paused_for == 0.0  # nor by its own hold, read back

            ga.breaker.stand_down()  # a's probe got through: closed
            await ha.beat(loop.time())  # the hold is withdrawn, not renewed
            signal = await b.heartbeat()
            assert signal.hold_for == 0.0

            # a newcomer takes the job's latest cut before its first request (its join)
            n = await PgStore.open(PG, job)
            try:
                n.commit([Record("run", extra={"version": "t", "pid": 3, "job": None})])
                gn = Governor(rate=100.0, burst=10, breaker=Breaker())
                await Heartbeat(n, Stop(), lambda: gn).join()
                assert gn.effective_rate == pytest.approx(40.0 / 3)  # a third of the job's 40
            finally:
                await n.close()
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_max_requests_is_the_job_s_budget_not_each_process_s(tmp_path: Path, job: str,
                                                            mock_process: Any) -> None:
    """Two processes, ``--max-requests 200``: together they buy at most 200 answers (each
    takes its calls from the job's budget a chunk at a time), and both stop with exit 4."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.02")
    ids = write_ids(tmp_path / "ids.txt", [f"m{i}" for i in range(1000)])
    limits = {"limits": {"concurrency": 8, "rate": 2000}}
    procs = [_run(_config(tmp_path, mock.item_url, job, ids, **limits), "--max-requests", "200")
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [4, 4], outs
    paid = [e for e in mock.settled_log() if e.event == "end" and e.status == 200]
    assert 200 - 2 * 16 <= len(paid) <= 200  # never over; short by at most a chunk each
    assert read_store(PG, job=job).snapshot().billable == len(paid)
    # a rerun is a new generation of the job, with a budget of its own
    again = _run(_config(tmp_path, mock.item_url, job, ids, **limits), "--max-requests", "50")
    out = again.communicate(timeout=120)
    assert again.returncode == 4, out
    paid_again = [e for e in mock.settled_log() if e.event == "end" and e.status == 200]
    assert len(paid_again) - len(paid) == 50


def test_status_of_a_shared_job_shows_each_working_process(tmp_path: Path, job: str,
                                                          mock_process: Any) -> None:
    """While two processes work on a job, ``status`` lists each one's progress (what a state
    directory's live.json gives for one process)."""
    import json

    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.2")
    ids = write_ids(tmp_path / "ids.txt", [f"s{i}" for i in range(400)])
    limits = {"limits": {"concurrency": 4, "rate": 2000}}
    procs = [_run(_config(tmp_path, mock.item_url, job, ids, **limits)) for _ in range(2)]
    try:
        def two_live() -> bool:
            out = cli("status", "--state", PG, "--job", job, "--json")
            runs = json.loads(out.stdout).get("live_runs", []) if out.returncode == 0 else []
            return len([r for r in runs if "pass_no" in r]) == 2

        _wait_for(two_live, 60, "two processes with their progress in status")
        text = cli("status", "--state", PG, "--job", job).stdout
        assert text.count("  process ") == 2 and "req/s (limit" in text
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_fresh_database_gets_the_whole_schema() -> None:
    """The first open on a database without asyncrawl's tables creates all of them (the
    machine's database already has them: a schema of the test's own stands for a new one)."""
    import psycopg

    from asyncrawl.pgstore import JOB_TABLES, PgStore
    from asyncrawl.records import Record

    schema = f"fresh_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG else "?"
    url = f"{PG}{sep}options=-csearch_path%3D{schema}"

    async def go() -> int:
        store = await PgStore.open(url, "fresh")
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            return await store.merge(["a", "b"])
        finally:
            await store.close()

    try:
        assert asyncio.run(go()) == 2
        # a database of a release before the blocks: the next run adds them
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"DROP TABLE {schema}.asyncrawl_blocks")
        assert asyncio.run(go()) == 2
        with psycopg.connect(PG) as db:
            tables = {r[0] for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,))}
        assert set(JOB_TABLES) <= tables
    finally:
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")


async def test_the_calls_with_no_answer_known_are_those_cut_off_in_a_job(job: str) -> None:
    """As on a local state (test_crawler): an ID's error answers are known not billed, also
    when the ID ends in doubt; only the call cut off counts as possibly billed."""
    from asyncrawl import Crawler

    faults = {f"e{i}": Fault("gone") for i in range(8)}
    async with MockAPI(api_key=KEY, faults=faults, latency=0.1) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job, max_tries=1000,
                          backoff_base=0.001, backoff_max=0.002, grace=0.01)
        await cut_off_after(Crawler(cfg), list(faults), api, 40)
    snap = read_store(PG, job=job).snapshot()
    cut = len(list(read_store(PG, job=job).in_doubt()))
    assert cut >= 1 and snap.in_doubt == cut and snap.sent >= 40
    assert snap.unsure_calls == cut


async def test_a_2xx_that_does_not_parse_is_bought_at_most_twice_in_a_job(job: str) -> None:
    """A shared job's pass 2 claims its IDs from the database, with no count of what pass 1
    bought: an answer that never parses was bought 2 more times there (4 in a run, not 2),
    and 2 more in each later run."""
    from asyncrawl import Crawler

    faults = {"junk": Fault("invalid_json", times=1000)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        cfg = fast_config(api, Path("unused"), state_url=PG, job=job, lease=2.0)
        s = await Crawler(cfg).run(["a", "junk"])
        assert (s.ok, s.unavailable, answered_2xx(api, "junk")) == (1, 1, 2)
        s = await Crawler(fast_config(api, Path("unused"), state_url=PG, job=job, lease=2.0,
                                      recheck_unavailable=True)).run(["junk"])
        assert (s.unavailable, answered_2xx(api, "junk")) == (1, 3)  # (one more: the recheck asked)


async def test_a_paid_answer_cut_off_before_its_retry_counts_in_the_next_run_of_a_job(
        job: str) -> None:
    """As on a local state (test_crawler): the claim gives an ID with no outcome its count."""
    from asyncrawl import Crawler

    faults = {"junk": Fault("invalid_json", times=1000)}
    async with MockAPI(api_key=KEY, faults=faults) as api:
        crawler = Crawler(fast_config(api, Path("unused"), state_url=PG, job=job, lease=2.0,
                                      backoff_base=60.0, backoff_max=60.0, jitter="none"))
        await stop_once_paid(crawler, ["junk"], api, "junk")
        assert pg_rows("SELECT state, unusable FROM asyncrawl_items WHERE job = %s",
                       job) == [(None, 1)]
        s = await Crawler(fast_config(api, Path("unused"), state_url=PG, job=job,
                                      lease=2.0)).run(["junk"])
        assert (s.unavailable, answered_2xx(api, "junk")) == (1, 2)


def test_a_job_of_the_release_before_gets_the_calls_answered_counted() -> None:
    """The tables of a release before ``answered`` and ``unusable``: the next run adds the
    columns, and an ID never cut off nor unanswered had an answer to each of its calls but
    an open one (its error answers are known again: not possibly billed)."""
    import psycopg

    from asyncrawl.pgstore import PgStore

    schema = f"fresh_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    url = f"{PG}{'&' if '?' in PG else '?'}options=-csearch_path%3D{schema}"

    async def opened() -> None:
        await (await PgStore.open(url, "old")).close()

    try:
        asyncio.run(opened())
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"ALTER TABLE {schema}.asyncrawl_items DROP COLUMN answered, "
                       "DROP COLUMN unusable")
            db.execute(f"INSERT INTO {schema}.asyncrawl_items (job, id, state, sends, paid, "
                       "doubt, sent_run) VALUES ('old', 'ok-after-a-500', 'ok', 2, 1, NULL, "
                       "NULL), ('old', 'cut', NULL, 3, 0, 0, NULL), "
                       "('old', 'open', NULL, 2, 0, NULL, 7)")
        asyncio.run(opened())
        with psycopg.connect(PG) as db:
            rows = db.execute(f"SELECT id, answered, unusable FROM {schema}.asyncrawl_items "
                              "ORDER BY id").fetchall()
        assert rows == [("cut", 0, 0), ("ok-after-a-500", 1, 0), ("open", 1, 0)]
    finally:
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")


def test_a_dry_run_on_a_database_that_refuses_says_so(tmp_path: Path, job: str) -> None:
    """A wrong password or user (or a malformed URL) read as "no such job": the dry run said
    nothing was done and priced every ID, where run and status exit 2."""
    from urllib.parse import urlsplit

    ids = write_ids(tmp_path / "ids.txt", ["a", "b"])
    parts = urlsplit(PG)
    refused = parts._replace(netloc=f"no_such_role_x@{parts.hostname}:{parts.port or 5432}").geturl()
    args = ("run", "--url", "http://127.0.0.1:9/{id}", "--ids", str(ids), "--job", job, "--dry-run")
    r = cli(*args, "--state", refused, cwd=tmp_path)
    assert r.returncode == 2 and "refused the connection" in r.stderr, r.stdout + r.stderr
    r = cli(*args, "--state", PG, cwd=tmp_path)  # (no such job: nothing done yet)
    assert r.returncode == 0 and "calls left: 2" in r.stdout, r.stdout + r.stderr


def test_a_run_taken_for_dead_by_the_next_generation_stops_at_its_heartbeat(job: str) -> None:
    """A process held up past its lease while no other run was at work (SIGSTOP) was taken for
    dead by the next run, which began a new generation; resumed, its claims came back empty
    and the job's halts were of another generation: it waited for ever, a zombie."""
    import psycopg

    from asyncrawl.errors import RunEndedError
    from asyncrawl.progress import halt_text
    from asyncrawl.types import Halt

    async def go() -> None:
        a = await _run_of(job, 1)
        with psycopg.connect(PG, autocommit=True) as db:  # (a stopped: no heartbeat since)
            db.execute("UPDATE asyncrawl_runs SET heartbeat = heartbeat - 3600 WHERE run = %s",
                       (a._run,))
        b = await _run_of(job, 2)  # no run at work: a new generation, a ended as dead
        try:
            assert b._gen == a._gen + 1
            await b.heartbeat(False)  # (b's own goes on)
            with pytest.raises(RunEndedError, match="held up past its lease") as e:
                await a.heartbeat(False)
            # (its summary's words: not "local storage failure ... free space")
            what, then = halt_text(Halt("storage", None, str(e.value)))
            assert what.startswith("the job went on without this process") and "rerun" in then
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_a_run_joining_runs_at_work_leaves_the_job_s_identity(job: str) -> None:
    """A run joining with --reuse-state and another URL set the job's identity to its own
    while the others went on with theirs: one of them, restarted, was refused as another
    job's. The identity changes when a new generation starts, with no run at work."""
    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record

    def first(url: str) -> Record:
        return Record("run", extra={"version": "t", "pid": 1, "job": {"url": url}})

    async def go() -> None:
        a = await PgStore.open(PG, job)
        a.commit([first("http://one/{id}")])
        c = await PgStore.open(PG, job)
        c.commit([first("http://two/{id}")])  # (--reuse-state: a is at work)
        try:
            assert pg_rows("SELECT identity->>'url' FROM asyncrawl_jobs WHERE job = %s",
                           job) == [("http://one/{id}",)]
        finally:
            await a.close()
            await c.close()

    asyncio.run(go())


def test_a_dead_run_s_id_whose_calls_were_all_answered_is_not_in_doubt(job: str) -> None:
    """As in the SQLite store: an ID answered 503 and waiting for its retry when its run died
    had every call answered, none billed; it was listed in doubt ("possibly billed")."""
    import psycopg

    from asyncrawl.records import Record

    async def go() -> None:
        a = await _run_of(job, 1)
        await a.merge(["waits", "out"])
        assert len(await a.claim(1, 10)) == 2
        a.commit([Record.sent("waits"), Record.sent("out"), Record.answered("waits")])
        with psycopg.connect(PG, autocommit=True) as db:  # (a dies: no heartbeat since)
            db.execute("UPDATE asyncrawl_runs SET heartbeat = heartbeat - 3600 WHERE run = %s",
                       (a._run,))
        await a.close()
        reader = read_store(PG, job=job)
        assert dict(reader.in_doubt()) == {"out": False} and reader.snapshot().in_doubt == 1
        b = await _run_of(job, 2)  # a new generation closes the dead run's intents
        await b.close()
        reader = read_store(PG, job=job)
        assert dict(reader.in_doubt()) == {"out": False} and reader.snapshot().in_doubt == 1

    asyncio.run(go())


def test_a_dry_run_reads_a_job_of_an_earlier_release(tmp_path: Path) -> None:
    """The dry run asks how often each ID's paid answer was unusable: on a job whose tables
    have no such column yet (no run of this release has opened it), the query failed (exit 5)."""
    import psycopg

    from asyncrawl.pgstore import PgStore
    from asyncrawl.records import Record

    schema = f"older_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    url = f"{PG}{'&' if '?' in PG else '?'}options=-csearch_path%3D{schema}"

    async def go() -> None:
        store = await PgStore.open(url, "older")
        try:
            store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None})])
            await store.merge(["a", "b"])
        finally:
            await store.close()

    try:
        asyncio.run(go())
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"ALTER TABLE {schema}.asyncrawl_items DROP COLUMN answered, "
                       "DROP COLUMN unusable")
        ids = write_ids(tmp_path / "ids.txt", ["a", "b", "c"])
        r = cli("run", "--url", "http://127.0.0.1:9/{id}", "--ids", str(ids), "--state", url,
                "--job", "older", "--dry-run", cwd=tmp_path)
        assert r.returncode == 0 and "calls left: 3" in r.stdout, r.stdout + r.stderr
    finally:
        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")
