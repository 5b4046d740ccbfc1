"""The command line end to end: ``python -m asyncrawl`` subprocesses against the mock API running
in its own process (``python -m asyncrawl.testing``), which logs every request start and end.

Crash tests kill real processes; the API key always travels through ``ASYNCRAWL_TEST_KEY``,
referenced as ``${ASYNCRAWL_TEST_KEY}`` in the config (``write_config``).
"""

from __future__ import annotations

import asyncio
import collections
import csv
import gc
import inspect
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asyncrawl import Config, ConfigError
from asyncrawl.lockfile import lock_holder
from asyncrawl.testing import LogEntry, demo_faults, flaky_faults, payload_for, read_log
from asyncrawl.writer import Writer

from .conftest import KEY, cli, outcomes_of, write_config, write_ids

ENV = {"ASYNCRAWL_TEST_KEY": KEY}
BATCH_LIMIT: int = inspect.signature(Writer).parameters["batch_limit"].default


# -- helpers -----------------------------------------------------------------------------------


def answers(log: list[LogEntry], status: int = 200) -> collections.Counter[str]:
    """ID -> how many answers with ``status`` the mock gave (200: billed)."""
    return collections.Counter(e.id for e in log if e.event == "end" and e.status == status)


def starts(log: list[LogEntry]) -> collections.Counter[str]:
    return collections.Counter(e.id for e in log if e.event == "start")


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def status_json(cfg: Path, env: dict[str, str] = ENV) -> dict[str, Any]:
    r = cli("status", "-c", str(cfg), "--json", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout  # one JSON object
    return json.loads(lines[0])


def export(cfg: Path, *args: str, env: dict[str, str] = ENV) -> str:
    r = cli("export", "-c", str(cfg), *args, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def ok_count(state: Path) -> int:
    """Durable ``ok`` results in the state directory (read without the lock, like ``status``)."""
    return len(durable_ok_ids(state))


def durable_ok_ids(state: Path) -> set[str]:
    return {i for i, o in outcomes_of(state).items() if o == "ok"}


def popen_cli(tmp_path: Path, name: str, *args: str, env: dict[str, str] = ENV,
              session: bool = False) -> subprocess.Popen[str]:
    """``python -m asyncrawl ARGS`` in the background; stdout/stderr go to files (no pipe stalls).
    ``session``: in a session (and process group) of its own, as a terminal's job is."""
    out = (tmp_path / f"{name}.out").open("w")
    err = (tmp_path / f"{name}.err").open("w")
    try:
        return subprocess.Popen([sys.executable, "-m", "asyncrawl", *args], stdout=out, stderr=err,
                                env={**os.environ, **env}, text=True, start_new_session=session)
    finally:
        out.close()
        err.close()


@contextmanager
def reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc``, killed at the end if it still runs (a failed assertion leaves no run behind)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until(pred: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the condition held"
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def ids_of(kind: str, n: int, prefix: str = "x") -> list[str]:
    """``n`` IDs to which ``--faults demo`` gives the fault ``kind``."""
    out = []
    i = 0
    while len(out) < n:
        item = f"{prefix}{i}"
        if demo_faults(item).kind == kind:
            out.append(item)
        i += 1
    return out


@contextmanager
def webhook_receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A small aiohttp server in a thread that records every POST (headers and JSON body)."""
    posts: list[dict[str, Any]] = []
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.Response:
        posts.append({"headers": dict(request.headers), "raw": await request.read(),
                      "json": await request.json()})
        return web.Response(text="thanks")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/hook", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        box["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        box["loop"] = asyncio.get_running_loop()
        box["stop"] = stop = asyncio.Event()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield box["url"], posts
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


# -- 1. a normal run and the output formats ----------------------------------------------------


def test_normal_run_export_formats_and_status(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    ids = [f"n{i}" for i in range(200)]
    unfetchable = {i: demo_faults(i).kind for i in ids
                   if demo_faults(i).kind in ("not_found", "bad_request", "gone")}
    fetchable = [i for i in ids if i not in unfetchable]
    assert unfetchable and fetchable
    state = tmp_path / "state"
    idsf = write_ids(tmp_path / "ids.txt", ids + ids[:10])  # duplicates are fetched once
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, idsf)

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "asyncrawl: finished" in r.stdout
    log = read_log(mock.log_path)

    ok_lines = jsonl(export(cfg, "--outcome", "ok", "--format", "jsonl"))
    assert len(ok_lines) == len(fetchable)
    assert sorted(ok_lines, key=lambda o: o["id"]) == sorted(
        ({"id": i, "data": payload_for(i)} for i in fetchable), key=lambda o: o["id"])
    assert all(list(o) == ["id", "data"] for o in ok_lines)

    id_lines = export(cfg, "--format", "ids").splitlines()
    assert sorted(id_lines) == sorted(fetchable)

    bad = jsonl(export(cfg, "--outcome", "unavailable", "--format", "jsonl"))
    want_status = {"not_found": 404, "bad_request": 400, "gone": 500}
    assert {o["id"]: o["status"] for o in bad} == {i: want_status[k] for i, k in unfetchable.items()}
    assert all(set(o) == {"id", "status", "error"} and o["error"] for o in bad)
    assert export(cfg, "--outcome", "failed") == ""

    out = tmp_path / "out" / "ok.jsonl"
    out.parent.mkdir()
    r = cli("export", "-c", str(cfg), "-o", str(out), env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert sorted(out.read_text().splitlines()) == sorted(
        export(cfg, "--outcome", "ok", "--format", "jsonl").splitlines())
    assert [p.name for p in out.parent.iterdir()] == ["ok.jsonl"]  # no temp file left behind

    rows = list(csv.reader(io.StringIO(export(cfg, "--format", "csv"))))
    assert rows[0] == ["id", "data.id", "title", "value"]  # the payload's own id: data.id
    assert len(rows) == 1 + len(fetchable)
    by_id = {row[0]: row for row in rows[1:]}
    assert set(by_id) == set(fetchable)
    p = payload_for(fetchable[0])
    assert by_id[fetchable[0]] == [fetchable[0], p["id"], p["title"], str(p["value"])]
    rows = list(csv.reader(io.StringIO(export(cfg, "--format", "csv", "--fields", "value,id"))))
    assert rows[0] == ["value", "id"] and len(rows) == 1 + len(fetchable)
    assert [str(p["value"]), p["id"]] in rows

    # status --json: integer counts, no halt, billable calls by date = the mock's 200 answers
    s = status_json(cfg)
    for key in ("ok", "failed", "unavailable"):
        assert type(s[key]) is int
    assert (s["ok"], s["failed"], s["unavailable"]) == (len(fetchable), 0, len(unfetchable))
    assert s["halt"] is None
    paid = sum(answers(log).values())
    assert paid >= len(fetchable)
    by_date = s["billable_by_date"]
    assert by_date and all(re.fullmatch(r"\d{4}-\d\d-\d\d", d) for d in by_date)
    assert sum(by_date.values()) == paid == s["billable"]

    # status and export need only the state directory (no config, no key)
    r = cli("status", "--state", str(state), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == len(fetchable)
    r = cli("export", "--state", str(state), "--format", "ids", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == sorted(fetchable)

    # a rerun fetches nothing
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    assert len(read_log(mock.log_path)) == len(log)


# -- 2. kill -9 mid-run ------------------------------------------------------------------------


def crash_run(tmp_path: Path, mock_process: Any, threshold: int, n: int = 3000,
              concurrency: int = 16, faults: str = "none") -> dict[str, Any]:
    """Start a run, SIGKILL it once ``threshold`` ok records are durable; report what was on disk."""
    mock = mock_process("--api-key", KEY, "--faults", faults, "--latency", "0.005")
    ids = [f"k{i:05d}" for i in range(n)]
    state = tmp_path / "state"
    idsf = write_ids(tmp_path / "ids.txt", ids)
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, idsf,
                       limits={"concurrency": concurrency, "rate": 1000})
    proc = popen_cli(tmp_path, "killed", "run", "-c", str(cfg), "--no-progress")
    try:
        wait_until(lambda: ok_count(state) > threshold, proc)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The run's SQLite writing process outlives it: it applies what the pipe still held, then
    # exits and frees the state directory's lock. The state is read once it is settled (read
    # before, an ID answered and applied just after the kill looked sent and not in doubt).
    deadline = time.monotonic() + 30
    while lock_holder(state) is not None:
        assert time.monotonic() < deadline, "the writing process did not end after the kill"
        time.sleep(0.01)
    durable = durable_ok_ids(state)
    log_at_kill = mock.settled_log(timeout=10)
    return {"mock": mock, "ids": ids, "state": state, "cfg": cfg, "durable": durable,
            "log_at_kill": log_at_kill}


def test_a_state_database_held_locked_by_another_program_holds_new_requests_back(
        tmp_path: Path, mock_process: Any) -> None:
    """Another program holds the state's database (``BEGIN EXCLUSIVE``: a user's write in
    sqlite3): results cannot be applied, only the ``sent`` intents logged. Those logs counted
    as the store's progress: the run went on sending, and paying, at its full rate (40/s) until
    1,024 results waited, every one lost at a crash and bought again. Now no new request starts
    once the oldest result has waited ``APPLY_LAG`` (2 s); the run goes on when the lock goes."""
    import sqlite3

    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = [f"l{i:04d}" for i in range(400)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 8, "rate": 40})
    with reaped(popen_cli(tmp_path, "locked", "run", "-c", str(cfg), "--no-progress")) as proc:
        wait_until(lambda: ok_count(state) > 40, proc)
        db = sqlite3.connect(state / "state.db", timeout=30, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        held = time.time()
        time.sleep(6)  # (the lock held: the scenario, not a wait for something)
        db.execute("COMMIT")
        db.close()
        assert proc.wait(120) == 0, (tmp_path / "locked.err").read_text()
    starts = [e.t - held for e in read_log(mock.log_path) if e.event == "start"]
    # from 2 s of lag (plus an answer's way) to the lock's end, nothing new was sent
    assert [t for t in starts if 3.0 < t < 6.0] == []
    assert len([t for t in starts if t < 0]) < len(ids)  # (the run was not over before)
    assert durable_ok_ids(state) == set(ids)


def test_the_writing_process_ignores_the_working_directory(tmp_path: Path,
                                                          mock_process: Any) -> None:
    """A run started in a directory that holds an ``asyncrawl`` folder and a ``queue.py`` of
    the user's: the state's writing process runs the same asyncrawl as the run and the
    standard library's modules, not those (it once imported them and died: exit 5)."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cwd = tmp_path / "work"
    (cwd / "asyncrawl").mkdir(parents=True)
    (cwd / "asyncrawl" / "__init__.py").write_text("raise SystemExit('the wrong asyncrawl')\n")
    (cwd / "queue.py").write_text("raise SystemExit('the wrong queue')\n")
    ids = [f"w{i}" for i in range(30)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids))
    # (-P: the run itself, like an installed ``asyncrawl`` command, does not look in its cwd)
    r = subprocess.run([sys.executable, "-P", "-m", "asyncrawl", "run", "-c", str(cfg),
                        "--no-progress"], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, **ENV}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrong" not in r.stderr
    assert durable_ok_ids(state) == set(ids)


@pytest.mark.parametrize("threshold", [200, 1800])
def test_kill_9_then_rerun_refetches_only_what_was_in_flight(
        tmp_path: Path, mock_process: Any, threshold: int) -> None:
    concurrency = 16
    c = crash_run(tmp_path, mock_process, threshold, concurrency=concurrency)
    ids, durable = c["ids"], c["durable"]
    assert threshold < len(durable) < len(ids)  # killed mid-run
    # in doubt: every ID whose request reached the API without a durable result (possibly billed)
    unsettled_sent = set(starts(c["log_at_kill"])) - durable
    in_doubt = jsonl(export(c["cfg"], "--outcome", "in-doubt"))
    # Killed with requests out, or (the kill follows the commit that crossed the threshold) just
    # after a group commit, before the workers it released sent theirs: then those IDs are in
    # doubt by their durable "sent" record alone.
    assert unsettled_sent or in_doubt
    assert unsettled_sent <= {o["id"] for o in in_doubt}
    assert not {o["id"] for o in in_doubt} & durable
    assert not any(o["refetched"] for o in in_doubt)
    assert len(in_doubt) <= concurrency + BATCH_LIMIT
    killed = status_json(c["cfg"])  # the killed run wrote no end: status says it was cut short
    assert (killed["last_run_cut_short"], killed["halt"]) == (True, None)
    assert "ended without its end record" in cli("status", "-c", str(c["cfg"]), env=ENV).stdout

    r = cli("run", "-c", str(c["cfg"]), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = read_log(c["mock"].log_path)

    exported = export(c["cfg"], "--outcome", "ok", "--format", "ids").splitlines()
    assert sorted(exported) == ids  # every ID exactly once
    ok_lines = jsonl(export(c["cfg"], "--outcome", "ok"))
    assert len(ok_lines) == len(ids) and all(o["data"] == payload_for(o["id"]) for o in ok_lines)

    paid = answers(log)
    assert set(paid) == set(ids)
    refetched = {i for i, n in paid.items() if n > 1}
    print(f"kill -9 after {threshold}+ durable ok ({len(durable)} on disk): "
          f"{len(refetched)} IDs paid twice")
    assert len(refetched) <= concurrency + BATCH_LIMIT
    assert not refetched & durable  # nothing fsynced is ever fetched again
    # every re-fetched ID had been answered 200 to the killed run and was not yet durable
    paid_before = set(answers(c["log_at_kill"]))
    assert refetched <= paid_before - durable
    assert all(n <= 2 for n in paid.values())
    # ... and each of them is reported: in doubt, re-fetched since (possibly billed twice)
    in_doubt = {o["id"]: o["refetched"] for o in jsonl(export(c["cfg"], "--outcome", "in-doubt"))}
    assert refetched <= {i for i, twice in in_doubt.items() if twice}
    s = status_json(c["cfg"])
    assert (s["ok"], s["failed"], s["unavailable"], s["halt"]) == (len(ids), 0, 0, None)
    assert s["last_run_cut_short"] is False  # the rerun ended with its end record
    # the journal only knows what it recorded: the answers lost with the killed process are
    # exactly the re-fetched ones
    assert s["billable"] == len(ids) == sum(paid.values()) - len(refetched)
    assert s["possibly_billed_twice"] >= len(refetched)


# -- 3. SIGINT / SIGTERM -----------------------------------------------------------------------


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_flushes_and_rerun_refetches_nothing_that_succeeded(
        tmp_path: Path, mock_process: Any, sig: signal.Signals, code: int) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.005")
    ids = [f"s{i:05d}" for i in range(1500)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 16, "rate": 1000})
    proc = popen_cli(tmp_path, "first", "run", "-c", str(cfg), "--no-progress")
    try:
        wait_until(lambda: ok_count(state) > 300, proc)
        proc.send_signal(sig)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "first.out").read_text()
    assert rc == code, (tmp_path / "first.err").read_text()
    assert "asyncrawl: stopped early" in out and f"stopped by {sig.name}" in out
    first_log = mock.settled_log(timeout=10)
    paid_first = set(answers(first_log))
    assert 300 < len(paid_first) < len(ids)
    assert durable_ok_ids(state) == paid_first  # everything answered 200 was recorded

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    paid = answers(read_log(mock.log_path))
    assert set(paid) == set(ids)
    assert [i for i, n in paid.items() if n > 1] == []  # no ID answered 200 twice
    assert sorted(export(cfg, "--format", "ids").splitlines()) == ids


def test_a_second_sigint_cuts_the_grace_period_short(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "10")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"g{i}" for i in range(20)]),
                       limits={"concurrency": 4}, run={"grace": 60})
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")
    try:
        wait_until(lambda: sum(starts(read_log(mock.log_path)).values()) == 4, proc)
        proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):  # waiting for the 4 requests in flight
            proc.wait(0.5)  # (10 s each)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, (tmp_path / "run.err").read_text()
    assert took < 6  # well before the in-flight answers (10 s) or the grace period (60 s)
    assert "stopped early" in (tmp_path / "run.out").read_text()
    assert sum(starts(read_log(mock.log_path)).values()) == 4  # nothing new after the signal
    assert status_json(cfg)["ok"] == 0


# -- 4. fatal responses and alerts -------------------------------------------------------------


def test_402_halts_keeps_what_was_paid_and_status_shows_it(tmp_path: Path, mock_process: Any) -> None:
    concurrency = 8
    mock = mock_process("--api-key", KEY, "--faults", "none", "--balance", "100")
    ids = [f"b{i}" for i in range(400)]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids), limits={"concurrency": concurrency})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 3, r.stderr
    assert "stopped early" in r.stdout and "HTTP 402" in r.stdout
    log = read_log(mock.log_path)
    first_402 = next(e.seq for e in log if e.event == "end" and e.status == 402)
    late = [e for e in log if e.event == "start" and e.seq > first_402]
    assert len(late) <= concurrency - 1
    billed = set(answers(log))
    assert len(billed) == 100
    assert set(export(cfg, "--format", "ids").splitlines()) == billed
    s = status_json(cfg)
    assert s["ok"] == 100
    assert s["halt"] is not None and s["halt"]["status"] == 402 and s["halt"]["message"]
    assert s["billable"] == 100
    # the calls the state counts are those the server saw: an intent committed while the
    # 402 came, whose request then did not leave, is not one (108 against 103-105 before)
    assert s["requests_sent"] == sum(starts(log).values()), (s, sum(starts(log).values()))
    assert s["in_doubt"] == 0


def test_401_halts_with_at_most_concurrency_requests(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", "the-right-key", "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"u{i}" for i in range(300)]),
                       limits={"concurrency": 6})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 3, r.stderr
    assert "HTTP 401" in r.stdout
    log = read_log(mock.log_path)
    assert 1 <= sum(starts(log).values()) <= 6
    assert answers(log) == collections.Counter()
    s = status_json(cfg)
    assert s["halt"]["status"] == 401
    assert s["requests_sent"] == sum(starts(log).values()), s


def test_a_webhook_that_cannot_be_reached_is_logged_in_plain_words() -> None:
    """A webhook whose host refuses the connection: the warning says so (host, port, why),
    without aiohttp's "ssl:default" for an http:// URL that has no TLS at all."""
    import socket

    import aiohttp

    from asyncrawl.alerts import send_alerts
    from asyncrawl.types import Halt

    from .conftest import asyncrawl_log

    with socket.socket() as s:  # a port nobody listens on (bound, not listening: refused)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        cfg = Config(url="http://h.example/{id}", webhook=f"http://127.0.0.1:{port}/hook")

        async def go() -> None:
            async with aiohttp.ClientSession() as session:
                await send_alerts(cfg, Halt("fatal", 402, "payment required"),
                                  _summary(), session)

        with asyncrawl_log() as lines:
            asyncio.run(go())
    (line,) = [x for x in lines if "webhook" in x]
    assert line.startswith(f"alert webhook failed: cannot connect to 127.0.0.1:{port} ("), line
    assert "ssl" not in line, line


def _summary() -> Any:
    from asyncrawl.types import Summary

    return Summary(ok=0, failed=0, unavailable=0, pending=0, fetched=0, skipped=0, duplicates=0,
                   retries=0, requests=0, billable=0, halt=None, elapsed=0.0, state_dir="state")


def test_alerts_on_halt_command_and_webhook(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--balance", "30")
    env_file = tmp_path / "alert-env.txt"
    with webhook_receiver() as (hook_url, posts):
        cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                           write_ids(tmp_path / "ids.txt", [f"a{i}" for i in range(3000)]),
                           alerts={"on_halt": f"env > '{env_file}'; echo ALERT-SAID",
                                   "webhook": hook_url})
        r = cli("run", "-c", str(cfg), "--no-progress",
                env={**ENV, "PGPASSWORD": "pg-secret-9c1",  # (libpq's, never the config's)
                     # a variable that holds a secret in part (it went through whole)
                     "HTTPS_PROXY": "http://u:prx-pw-5e1@127.0.0.1:1", "NO_PROXY": "127.0.0.1"})
        assert r.returncode == 3, r.stderr
    # what the command prints is not in the summary's stream (it came ahead of it)
    assert "ALERT-SAID" in r.stderr and "ALERT-SAID" not in r.stdout
    assert "pg-secret-9c1" not in env_file.read_text()
    assert "prx-pw-5e1" not in env_file.read_text()
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert env["ASYNCRAWL_REASON"] == "fatal"
    assert env["ASYNCRAWL_STATUS"] == "402"
    assert env["ASYNCRAWL_OK"] == "30"
    assert env["ASYNCRAWL_PENDING"] == "2970"  # (was the IDs read ahead and not settled: ~1,000)
    assert env["ASYNCRAWL_STATE_DIR"] == str(tmp_path / "state")
    assert "ASYNCRAWL_MESSAGE" in env
    assert KEY not in env_file.read_text()  # not even through the caller's own environment

    assert len(posts) == 1
    body = posts[0]["json"]
    assert body["reason"] == "fatal" and body["status"] == 402 and body["ok"] == 30
    assert body["pending"] == 2970
    assert KEY.encode() not in posts[0]["raw"]
    assert KEY not in json.dumps(posts[0]["headers"])


# -- 5. the lock -------------------------------------------------------------------------------


def test_second_run_on_a_locked_state_dir_exits_2_at_once(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.05")
    ids = [f"l{i}" for i in range(160)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 4})
    first = popen_cli(tmp_path, "first", "run", "-c", str(cfg), "--no-progress")
    try:
        wait_until(lambda: ok_count(state) > 4, first)
        t0 = time.monotonic()
        r = cli("run", "-c", str(cfg), "--no-progress", env=ENV, timeout=30)
        took = time.monotonic() - t0
        assert first.poll() is None  # the first run was still going
        assert r.returncode == 2, r.stderr
        assert "another asyncrawl run" in r.stderr and str(state) in r.stderr
        assert f"pid {first.pid}" in r.stderr
        assert took < 15
        assert first.wait(60) == 0, (tmp_path / "first.err").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    log = read_log(mock.log_path)
    assert starts(log) == collections.Counter(ids)  # the refused run sent nothing
    assert status_json(cfg)["ok"] == len(ids)


# -- 6. config and input errors ----------------------------------------------------------------


def _bad_utf8_ids(path: Path) -> Path:
    path.write_bytes(b"a1\na2\na3\na4\nbad-\xff-id\na6\n")
    return path


def _long_line_ids(path: Path) -> Path:
    path.write_bytes(b"a1\na2\n" + b"x" * 5000 + b"\na4\n")
    return path


BAD_INPUTS: dict[str, tuple[dict[str, Any], Callable[[Path], Path] | None, list[str]]] = {
    # name: (config sections, IDs file maker, what stderr must name)
    "unknown key": ({"limits": {"concurency": 8}}, None, ["limits.concurency", "unknown key"]),
    "wrong type": ({"limits": {"concurrency": "eight"}}, None, ["limits.concurrency", "whole number"]),
    "wrong type bool": ({"passes": {"second_pass": "yes"}}, None, ["passes.second_pass"]),
    "missing env var": ({"request__headers": {"X-Api-Key": "${ASYNCRAWL_TEST_UNSET_VAR}"}}, None,
                        ["request.headers.X-Api-Key", "ASYNCRAWL_TEST_UNSET_VAR"]),
    "url without id": ({"request": {"url": "URL/fixed"}}, None, ["request.url", "{id}"]),
    "invalid utf-8": ({}, _bad_utf8_ids, ["ids.txt:5", "UTF-8"]),
    "over-long line": ({}, _long_line_ids, ["ids.txt:3", "limit"]),
    "missing ids file": ({}, None, ["no-such-ids.txt", "not found"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_config_and_input_errors_exit_2_and_send_nothing(
        tmp_path: Path, mock_process: Any, case: str) -> None:
    sections, make_ids, expected = BAD_INPUTS[case]
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = tmp_path / "ids.txt"
    if make_ids is not None:
        make_ids(ids)
    elif case == "missing ids file":
        ids = tmp_path / "no-such-ids.txt"
    else:
        write_ids(ids, ["a1", "a2", "a3"])
    sections = {name: {k: (v.replace("URL", mock.url) if isinstance(v, str) else v)
                       for k, v in values.items()} for name, values in sections.items()}
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids, **sections)
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 2, (r.stdout, r.stderr)
    for text in expected:
        assert text in r.stderr, r.stderr
    if make_ids is None and case != "missing ids file":
        assert str(cfg) in r.stderr  # config errors name the file too
    assert "Traceback" not in r.stderr
    assert mock.settled_log() == []  # nothing was sent


# -- 7. budget, dry run, no second pass, stdin -------------------------------------------------


def test_max_requests_dry_run_and_resume(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = [f"m{i:03d}" for i in range(120)]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids),
                       billing={"price_per_call": 0.002, "currency": "EUR"})

    r = cli("run", "-c", str(cfg), "--no-progress", "--max-requests", "37", env=ENV)
    assert r.returncode == 4, r.stderr
    log = read_log(mock.log_path)
    assert sum(answers(log).values()) == 37
    assert len(export(cfg, "--format", "ids").splitlines()) == 37
    s = status_json(cfg)
    assert s["ok"] == 37 and s["billable"] == 37 and s["cost"] == pytest.approx(0.074)

    r = cli("run", "-c", str(cfg), "--dry-run", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "calls left: 83" in r.stdout
    assert "already done: 37" in r.stdout
    assert "0.1660 EUR" in r.stdout  # 83 calls at 0.002
    assert len(read_log(mock.log_path)) == len(log)  # the dry run sent nothing

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    paid = answers(read_log(mock.log_path))
    assert set(paid) == set(ids) and max(paid.values()) == 1  # nothing fetched twice
    assert sorted(export(cfg, "--format", "ids").splitlines()) == ids


def test_dry_run_without_price_sends_nothing(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ["a", "b", "c", "a"]))
    r = cli("run", "-c", str(cfg), "--dry-run", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "calls left: 3" in r.stdout and "price_per_call" in r.stdout
    assert mock.settled_log() == []


def test_no_second_pass_exits_6_and_ids_from_stdin(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    good = ids_of("ok", 20)
    gone, missing = ids_of("gone", 1)[0], ids_of("not_found", 1)[0]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       tmp_path / "not-this-file.txt")
    stdin = "\r\n".join([*good, gone, "", f"  {missing}  ", good[0]]) + "\n"

    r = cli("run", "-c", str(cfg), "--ids", "-", "--no-progress", "--no-second-pass",
            env=ENV, stdin=stdin)
    assert r.returncode == 6, r.stderr
    assert "rerun" in r.stdout
    assert sorted(export(cfg, "--format", "ids").splitlines()) == sorted(good)
    failed = {o["id"]: o for o in jsonl(export(cfg, "--outcome", "failed"))}
    assert {i: o["status"] for i, o in failed.items()} == {gone: 500, missing: 404}
    s = status_json(cfg)
    assert (s["ok"], s["failed"], s["unavailable"]) == (20, 2, 0)
    n_gone = starts(read_log(mock.log_path))[gone]
    assert n_gone == 3  # max_tries

    # a rerun retries what failed, and only that
    r = cli("run", "-c", str(cfg), "--ids", "-", "--no-progress", "--no-second-pass",
            env=ENV, stdin=stdin)
    assert r.returncode == 6, r.stderr
    after = starts(read_log(mock.log_path))
    assert after[gone] == 2 * n_gone and after[missing] == 2
    assert all(after[i] == 1 for i in good)

    # a bad line on stdin is named as stdin's (not as the copy asyncrawl reads it from)
    r = cli("run", "-c", str(cfg), "--ids", "-", "--no-progress", env=ENV,
            stdin="a\nb\n" + "x" * 2000 + "\n")
    assert r.returncode == 2 and "<stdin>:3: " in r.stderr, r.stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_ids_from_an_endless_device_are_an_input_error_not_a_full_disk(
        tmp_path: Path, device: str) -> None:
    """IDs read once are copied to a file first: --ids /dev/zero copied gigabytes (until the
    disk was full) before any line was checked."""
    spools = set(Path(tempfile.gettempdir()).glob("asyncrawl-ids-*"))
    r = cli("run", "--ids", device, "--url", "http://127.0.0.1:9/items/{id}", "--state",
            str(tmp_path / "s"), "--no-progress", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and f"{device}:" in r.stderr, r.stderr
    assert set(Path(tempfile.gettempdir()).glob("asyncrawl-ids-*")) == spools  # (removed)
    if device == "/dev/zero":  # (and a blank line that long on stdin: its IDs after it were
        #                        dropped, the copy cut short there)
        r = cli("run", "--ids", "-", "--url", "http://127.0.0.1:9/items/{id}", "--dry-run",
                "--state", str(tmp_path / "s"), cwd=tmp_path, stdin="a\n" + " " * 3_000_000
                + "\nb\nc\n")
        assert r.returncode == 2 and "<stdin>:2: a line over" in r.stderr, r.stderr


def test_the_stdin_copy_of_a_killed_run_is_removed_by_the_next(tmp_path: Path,
                                                               mock_process: Any) -> None:
    """IDs from stdin are copied to a temporary file, which a run removes at its end; a run
    killed with ``kill -9`` cannot: the next run given stdin removes that copy (nobody holds
    its lock any more), and leaves the copy of a run that still lives."""
    import fcntl

    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.2")
    spools = tmp_path / "tmp"
    spools.mkdir()
    env = {**ENV, "TMPDIR": str(spools)}
    ids = write_ids(tmp_path / "ids.txt", [f"k{i}" for i in range(200)])
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, tmp_path / "unused.txt",
                       limits={"concurrency": 4, "rate": 100})
    with ids.open() as stdin:
        victim = subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                                   "--ids", "-", "--no-progress"], stdin=stdin,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, **env})
    wait_until(lambda: bool(state.exists() and outcomes_of(state)), victim)
    victim.kill()
    victim.wait(timeout=30)
    left = list(spools.glob("asyncrawl-ids-*"))
    assert len(left) == 1  # what kill -9 leaves behind
    old = time.time() - 120  # (a copy is taken for a leftover only once a minute old)
    os.utime(left[0], (old, old))
    alive = spools / "asyncrawl-ids-of-a-live-run"
    alive.write_text("x\n")
    os.utime(alive, (old, old))
    fifo = spools / "asyncrawl-ids-not-a-file"  # (someone else's: opening it would hang)
    os.mkfifo(fifo)
    os.utime(fifo, (old, old))
    held = os.open(alive, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # held, as a live run holds its copy
        r = cli("run", "-c", str(cfg), "--ids", "-", "--no-progress", "--concurrency", "40",
                env=env, stdin=ids.read_text())  # (the rest in ~1 s, not ~10)
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in spools.iterdir()) == sorted([alive.name, fifo.name])
    finally:
        os.close(held)


def test_ids_from_a_pipe_path_are_read_once_and_fetched(tmp_path: Path,
                                                        mock_process: Any) -> None:
    """``--ids <(command)`` or a FIFO: the IDs can be read only once, so they are copied first
    (the IDs file is read more than once: counted, then fetched). They used to be counted,
    and then none was left to fetch: exit 0 having fetched nothing."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    fifo = tmp_path / "ids.fifo"
    os.mkfifo(fifo)
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", fifo)

    def feed() -> None:
        with fifo.open("w") as f:  # (blocks until the run opens it)
            f.write("".join(f"q{i}\n" for i in range(40)) + "q1\n")

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    r = cli("run", "-c", str(cfg), "--no-progress", env={**ENV, "TMPDIR": str(tmp_path)})
    writer.join(timeout=10)
    assert r.returncode == 0, r.stderr
    assert sorted(export(cfg, "--format", "ids").splitlines()) == sorted(f"q{i}" for i in range(40))
    assert not list(tmp_path.glob("asyncrawl-ids-*"))  # the copy is gone with the run


def one_ok_state(state: Path) -> None:
    """A state directory of one run that fetched one ID, "a", ok (written by the store)."""
    from asyncrawl.records import Record
    from asyncrawl.store import open_store

    async def make() -> None:
        store = await open_store(state)
        store.commit([Record("run", extra={"version": "t", "pid": 1, "job": None}),
                      Record("ok", "a", status=200, data={"v": 1}, paid=1, tries=1)])
        await store.close()

    asyncio.run(make())


def test_status_and_export_need_only_the_state(tmp_path: Path) -> None:
    """A config that names only the state will do for ``status`` and ``export`` (they send
    nothing)."""
    one_ok_state(tmp_path / "state")
    cfg = tmp_path / "only-state.toml"
    cfg.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    r = cli("status", "-c", str(cfg), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] == 1, r.stderr
    r = cli("export", "-c", str(cfg), "--format", "ids")
    assert (r.returncode, r.stdout) == (0, "a\n"), r.stderr
    # -o /dev/stdout: into the pipe (its path through /proc was no file: exit 2), and into a
    # file the shell opened to append to (a rename, or a reopening, lost what it held)
    r = cli("export", "-c", str(cfg), "--format", "ids", "-o", "/dev/stdout")
    assert (r.returncode, r.stdout) == (0, "a\n"), r.stderr
    kept = tmp_path / "kept.txt"
    kept.write_text("old\n")
    with kept.open("a") as out:
        subprocess.run([sys.executable, "-m", "asyncrawl", "export", "-c", str(cfg), "--format",
                        "ids", "-o", "/dev/stdout"], stdout=out, check=True, timeout=60)
    assert kept.read_text() == "old\na\n"
    r = cli("run", "-c", str(cfg), "--ids", "-", stdin="a\n")
    assert r.returncode == 2 and "request.url" in r.stderr  # a run does need it


def test_the_commands_that_send_nothing_load_neither_the_http_stack_nor_asyncio(
        tmp_path: Path) -> None:
    """``--help``, ``status`` and ``export`` of a state directory import neither aiohttp nor
    asyncio (nor ssl): they start in about half the time (bench/startup.py)."""
    one_ok_state(tmp_path / "state")
    probe = ("import sys, contextlib, io\n"
             "from asyncrawl.cli import main\n"
             "code = 0\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    try:\n"
             "        code = main(sys.argv[1:])\n"
             "    except SystemExit as e:\n"
             "        code = e.code\n"
             "print(code, len(out.getvalue()) > 0,\n"
             "      sorted(m for m in ('aiohttp', 'asyncio', 'ssl') if m in sys.modules))\n")
    state = str(tmp_path / "state")
    for argv in (["--help"], ["status", "--state", state, "--json"],
                 ["export", "--state", state, "--format", "jsonl"]):
        r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                           text=True, cwd=tmp_path)
        # (the command did its work: exit 0 and something printed)
        assert (r.returncode, r.stdout.strip()) == (0, "0 True []"), (argv, r.stdout, r.stderr)


def test_recheck_unavailable_tries_the_unavailable_ids_again_and_nothing_else(
        tmp_path: Path, mock_process: Any) -> None:
    """SPEC §4: later runs skip ok and unavailable IDs "unless asked to recheck": there was no
    way to ask (a new state directory would buy every ok ID again). A rerun of the same file
    reads on from its frontier: the unavailable IDs before it come from the state."""
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    ids = [f"r{i}" for i in range(300)]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids))
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    gone = {line.strip() for line in cli("export", "-c", str(cfg), "--outcome", "unavailable",
                                         "--format", "ids", env=ENV).stdout.splitlines()}
    ok = status_json(cfg)["ok"]
    assert gone and ok + len(gone) == len(ids)
    seen = len(mock.settled_log())
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)  # (not asked: nothing to do)
    assert r.returncode == 0 and len(mock.settled_log()) == seen, r.stderr
    r = cli("run", "-c", str(cfg), "--dry-run", "--recheck-unavailable", env=ENV)
    assert f"calls left: {len(gone)}" in r.stdout, r.stdout + r.stderr
    r = cli("run", "-c", str(cfg), "--no-progress", "--recheck-unavailable", env=ENV)
    assert r.returncode == 0, r.stderr
    again = starts(mock.settled_log()[seen:])
    assert set(again) == gone  # each of them tried again (the mock's still fail), no ok ID
    assert status_json(cfg)["ok"] == ok


# -- 8. secrets --------------------------------------------------------------------------------


def test_url_data_and_json_flags_read_env_references_as_the_config_does(
        tmp_path: Path, mock_process: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--url '...?api_key=${KEY}'`` was refused ("the only placeholder allowed is {id}"),
    and ``--data 'token=${TOK}'`` sent the text ``${TOK}`` itself, where the config's keys,
    ``-H`` and ``--proxy`` read the environment. Now each reads it, and the value is a secret:
    never printed."""
    from asyncrawl.cli import _config_for_run, build_parser

    key = "sk-flag-" + secrets.token_hex(8)
    mock = mock_process("--no-auth", "--faults", "none")  # (its key goes in a header only)
    ids = write_ids(tmp_path / "ids.txt", ["u1", "u2"])
    r = cli("run", "--url", mock.item_url + "?api_key=${ASYNCRAWL_TEST_KEY}", "--ids", str(ids),
            "--state", str(tmp_path / "state"), "--no-progress",
            env={"ASYNCRAWL_TEST_KEY": key}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout + r.stderr and "2" in r.stdout
    args = build_parser().parse_args([
        "run", "--url", "http://api.example/{id}", "-X", "POST",
        "--data", "token=${ASYNCRAWL_TEST_KEY}&id={id}"])
    monkeypatch.setenv("ASYNCRAWL_TEST_KEY", key)
    monkeypatch.chdir(tmp_path)  # (no ./config.toml)
    cfg = _config_for_run(args)
    assert cfg.body == f"token={key}&id={{id}}" and key in cfg.secrets
    args = build_parser().parse_args([
        "run", "--url", "http://api.example/{id}", "-X", "POST",
        "--json", '{"auth": {"key": "${ASYNCRAWL_TEST_KEY}"}, "id": "{id}"}'])
    cfg = _config_for_run(args)
    assert cfg.json == {"auth": {"key": key}, "id": "{id}"} and key in cfg.secrets
    r = cli("run", "--url", "http://api.example/{id}", "--ids", str(ids), "--state", "",
            cwd=tmp_path)
    assert r.returncode == 2 and "--state" in r.stderr and "empty" in r.stderr, r.stderr
    for extra in ([], ["--state", "postgresql://127.0.0.1/test", "--job", "j"]):
        r = cli("run", *extra, cwd=tmp_path)  # no config, no --url: says so (not "no IDs")
        assert r.returncode == 2 and "no config" in r.stderr, r.stderr


def test_a_removed_key_s_warning_goes_where_the_log_goes(tmp_path: Path,
                                                        mock_process: Any) -> None:
    """The config's load logs before the command's logging is set up: a removed key's warning
    went to Python's last-resort handler (stderr, without the ``asyncrawl: WARNING:`` prefix,
    past ``--log-file`` and ``--log-format json``). Now ``run`` logs it as it logs the rest;
    ``status`` says it on stderr as its own lines; a run that stops on an error still says it."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ["r1"]))
    cfg.write_text(cfg.read_text().replace("[limits]\n", "[limits]\nretry_budget = 3\n"))
    assert "retry_budget" in cfg.read_text()
    log_file = tmp_path / "run.log"
    r = cli("run", "-c", str(cfg), "--no-progress", "--log-file", str(log_file),
            "--log-format", "json", env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "retry_budget" not in r.stderr
    (said,) = [json.loads(line) for line in log_file.read_text().splitlines()
               if "retry_budget" in line]
    assert said["level"] == "warning" and "is ignored (removed" in said["msg"]
    r = cli("status", "-c", str(cfg), env=ENV, cwd=tmp_path)
    assert r.returncode == 0 and "asyncrawl: WARNING:" in r.stderr and "retry_budget" in r.stderr
    r = cli("run", "-c", str(cfg), "--ids", str(tmp_path / "missing.txt"), env=ENV, cwd=tmp_path)
    assert r.returncode == 2 and "asyncrawl: WARNING:" in r.stderr and "retry_budget" in r.stderr
    assert r.stderr.index("retry_budget") < r.stderr.index("asyncrawl: error:")  # (in order)
    r = cli("demo", "--state", "", cwd=tmp_path)  # (as run's: not taken for no --state)
    assert r.returncode == 2 and "--state" in r.stderr and "empty" in r.stderr, r.stderr


def test_the_key_is_never_written_anywhere(tmp_path: Path, mock_process: Any) -> None:
    key = "sk-live-" + secrets.token_hex(16)
    env = {"ASYNCRAWL_TEST_KEY": key}
    mock = mock_process("--api-key", key, "--faults", "demo")
    state = tmp_path / "state"
    ids = [f"z{i}" for i in range(250)]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       request__params={"api_key": "${ASYNCRAWL_TEST_KEY}", "q": "{id}"})
    log_file = tmp_path / "asyncrawl.log"
    outputs: list[str] = []

    r = cli("run", "-c", str(cfg), "--log-file", str(log_file), "--log-format", "json",
            "-H", "Authorization: Bearer ${ASYNCRAWL_TEST_KEY}", env=env)
    outputs += [r.stdout, r.stderr]
    assert r.returncode == 0, r.stderr
    for args in (["status"], ["status", "--json"]):
        r = cli(*args, "-c", str(cfg), env=env)
        assert r.returncode == 0, r.stderr
        outputs += [r.stdout, r.stderr]
    for outcome in ("ok", "failed", "unavailable"):
        for fmt in ("jsonl", "csv", "ids"):
            r = cli("export", "-c", str(cfg), "--outcome", outcome, "--format", fmt, env=env)
            assert r.returncode == 0, r.stderr
            outputs += [r.stdout, r.stderr]
    exported = tmp_path / "export.jsonl"
    r = cli("export", "-c", str(cfg), "-o", str(exported), env=env)
    assert r.returncode == 0, r.stderr
    outputs += [r.stdout, r.stderr]
    # a 401 (wrong key in the mock) makes asyncrawl talk about the key
    wrong = mock_process("--api-key", "something-else", "--faults", "none")
    cfg401 = write_config(tmp_path / "c401.toml", wrong.item_url, tmp_path / "state401",
                          tmp_path / "ids.txt")
    r = cli("run", "-c", str(cfg401), env=env)
    assert r.returncode == 3
    outputs += [r.stdout, r.stderr]

    files = [log_file, exported, *(p for d in (state, tmp_path / "state401")
                                   for p in d.rglob("*") if p.is_file())]
    assert len(files) >= 5
    blobs = [o.encode() for o in outputs] + [p.read_bytes() for p in files]
    assert sum(map(len, blobs)) > 10_000  # there was plenty to look through
    for secret in (key, key.removeprefix("sk-live-")):
        assert not any(secret.encode() in b for b in blobs)

    lines = log_file.read_text().splitlines()
    assert lines
    parsed = [json.loads(line) for line in lines]
    assert all({"ts", "level", "msg"} <= set(p) for p in parsed)
    assert any(p.get("event") == "summary" for p in parsed)  # the run's own record of itself


# -- 9. progress off a terminal ----------------------------------------------------------------


def test_periodic_progress_lines_off_a_terminal(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"p{i}" for i in range(160)])

    def run(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
        cfg = write_config(tmp_path / f"{name}.toml", mock.item_url, tmp_path / name, ids,
                           limits={"rate": 80, "burst": 1, "concurrency": 4},
                           run={"progress_interval": 0.5})
        r = cli("run", "-c", str(cfg), *flags, env=ENV)
        assert r.returncode == 0, r.stderr
        assert "asyncrawl: finished" in r.stdout  # the final summary either way
        return r

    r = run("with")
    progress = [ln for ln in r.stderr.splitlines() if "req/s" in ln]
    assert len(progress) >= 2, r.stderr
    assert all(re.search(r"\bok \d+", ln) for ln in progress)
    # the first line's rate is the run's so far (it said 0 req/s, with requests done)
    assert re.search(r"\b[1-9][\d,]* req/s", progress[0]), progress[0]
    assert "\r" not in r.stderr and "\x1b[" not in r.stderr  # no terminal redraws in a pipe

    r = run("without", "--no-progress")
    assert "req/s" not in r.stderr and not re.search(r"\bok \d+", r.stderr)


# -- 10. the CLI's garbage-collector policy ----------------------------------------------------


def test_tune_gc_raises_only_a_lower_young_threshold() -> None:
    from asyncrawl.cli import GC_YOUNG_THRESHOLD, tune_gc

    saved, enabled = gc.get_threshold(), gc.isenabled()
    try:
        gc.set_threshold(700, 10, 10)
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
        gc.set_threshold(GC_YOUNG_THRESHOLD * 5, 3, 4)  # an operator's own, higher setting stays
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD * 5, 3, 4)
        gc.set_threshold(700, 10, 10)
        gc.disable()  # a collector switched off stays off and untouched
        tune_gc()
        assert gc.get_threshold() == (700, 10, 10) and not gc.isenabled()
    finally:
        gc.set_threshold(*saved)
        if enabled:
            gc.enable()


def test_run_applies_the_gc_policy_and_library_use_does_not(
        tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"g{i}" for i in range(20)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids)
    probe = ("import gc, sys\n"
             "from asyncrawl.cli import main\n"
             "code = main(sys.argv[1:])\n"
             "print('young threshold', gc.get_threshold()[0])\n"
             "sys.exit(code)\n")
    r = subprocess.run([sys.executable, "-c", probe, "run", "-c", str(cfg), "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, **ENV}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "young threshold 10000" in r.stdout

    library = ("import asyncio, gc\n"
               "from asyncrawl import Config, Crawler\n"
               "async def main():\n"
               f"    cfg = Config(url={mock.item_url!r}, state_dir={str(tmp_path / 'lib')!r},\n"
               f"                 headers={{'X-Api-Key': {KEY!r}}})\n"
               "    async with Crawler(cfg) as c:\n"
               "        s = await c.run(['a', 'b'])\n"
               "    print('ok', s.ok, 'young threshold', gc.get_threshold()[0])\n"
               "asyncio.run(main())\n")
    r = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ok 2 young threshold 700" in r.stdout


# -- reading state never needs the secrets ---------------------------------------------------


def test_status_export_and_dry_run_work_without_the_api_key(tmp_path: Path, mock_process: Any) -> None:
    assert "ASYNCRAWL_TEST_KEY" not in os.environ
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = [f"k{i:02d}" for i in range(30)]
    # (a variable in a parameter not named as a secret: the dry run took its placeholder for
    # another job's parameter, exit 2)
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids), billing={"price_per_call": 0.01},
                       request__params={"tenant": "${ASYNCRAWL_TEST_TENANT}"})
    r = cli("run", "-c", str(cfg), "--no-progress", "--max-requests", "10",
            env={**ENV, "ASYNCRAWL_TEST_TENANT": "acme"})
    assert r.returncode == 4, r.stderr
    sent = len(read_log(mock.log_path))

    # a fresh terminal: the key is not exported
    r = cli("status", "-c", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == 10
    r = cli("status", "-c", str(cfg))
    assert r.returncode == 0 and "10" in r.stdout, r.stderr
    r = cli("export", "-c", str(cfg), "--format", "ids")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 10
    r = cli("run", "-c", str(cfg), "--dry-run", "-H", "X-Other: ${ASYNCRAWL_TEST_OTHER}")
    assert r.returncode == 0, r.stderr
    assert "calls left: 20" in r.stdout
    assert len(read_log(mock.log_path)) == sent  # reading sent nothing

    # running still needs it, and says so before any request
    r = cli("run", "-c", str(cfg), "--no-progress")
    assert r.returncode == 2
    assert "ASYNCRAWL_TEST_KEY" in r.stderr and "not set" in r.stderr
    assert len(read_log(mock.log_path)) == sent


# -- every request that leaves has its durable "sent" record ------------------------------------


def sent_records(state: Path) -> collections.Counter[str]:
    """ID -> requests the state records sent: the database's, and the intents that only
    ``intents.log`` holds (a killed run's, not yet piped to its writing process or applied by
    it; the next open applies them), read against one snapshot of the database."""
    import sqlite3

    from asyncrawl.sqlproc import pending_records

    db = sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True, isolation_level=None)
    try:
        db.execute("BEGIN")
        sends = collections.Counter(dict(db.execute(
            "SELECT id, sends FROM items WHERE sends > 0").fetchall()))
        applied = db.execute("SELECT value FROM meta WHERE key = 'applied'").fetchone()
        db.execute("COMMIT")
    finally:
        db.close()
    sends.update(str(rec.id) for _, rec in pending_records(state, int(applied[0]) if applied else 0)
                 if rec.kind == "sent")
    return sends


def test_the_server_sees_exactly_the_requests_recorded_sent_even_with_drops(
        tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "flaky")
    ids = [f"d{i:04d}" for i in range(1500)]
    dropped = [i for i in ids if flaky_faults(i).kind == "drop"]
    assert len(dropped) >= 5
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids), request={"timeout": 1.0})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    seen = starts(read_log(mock.log_path))
    assert all(seen[i] == 2 for i in dropped)  # the drop, then asyncrawl's own retry
    assert seen == sent_records(tmp_path / "state")  # per ID: no request nobody recorded
    assert status_json(cfg)["requests_sent"] == sum(seen.values())


def test_after_kill_9_every_request_the_server_saw_was_recorded_sent(
        tmp_path: Path, mock_process: Any) -> None:
    c = crash_run(tmp_path, mock_process, 400, faults="flaky")
    seen = starts(c["log_at_kill"])
    sent = sent_records(c["state"])
    assert seen and all(sent[i] >= n for i, n in seen.items()), {
        i: (n, sent[i]) for i, n in seen.items() if sent[i] < n}
    # a durable "sent" whose bytes had not left yet at the kill: at most the requests in flight
    assert sum(sent.values()) - sum(seen.values()) <= 16
    in_doubt = {o["id"] for o in jsonl(export(c["cfg"], "--outcome", "in-doubt"))}
    assert set(answers(c["log_at_kill"])) - c["durable"] <= in_doubt  # billed, not kept


# -- a state directory belongs to one job -------------------------------------------------------


def test_a_state_directory_refuses_another_job_unless_told(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = [f"j{i:02d}" for i in range(20)]
    state, idsf = tmp_path / "state", write_ids(tmp_path / "ids.txt", ids)
    cfg = write_config(tmp_path / "a.toml", mock.item_url, state, idsf)
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    sent = len(read_log(mock.log_path))

    other = write_config(tmp_path / "b.toml", mock.url + "/items/v2-{id}", state, idsf)
    r = cli("run", "-c", str(other), "--no-progress", env=ENV)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "belongs to another job" in r.stderr and "--reuse-state" in r.stderr
    assert "/items/{id}" in r.stderr and "/items/v2-{id}" in r.stderr
    assert len(read_log(mock.log_path)) == sent  # nothing sent
    r = cli("run", "-c", str(other), "--dry-run", env=ENV)  # (not a count of the other job's)
    assert r.returncode == 2 and "belongs to another job" in r.stderr, r.stdout + r.stderr
    r = cli("run", "-c", str(other), "--dry-run", "--reuse-state", env=ENV)
    assert r.returncode == 0 and "already done: 20" in r.stdout, r.stdout + r.stderr
    params = write_config(tmp_path / "c.toml", mock.item_url, state, idsf,
                          request__params={"lang": "de"})
    assert cli("run", "-c", str(params), "--no-progress", env=ENV).returncode == 2

    # the same job again is fine (nothing left to fetch), and so is a deliberate reuse
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    r = cli("run", "-c", str(other), "--no-progress", "--reuse-state", env=ENV)
    assert r.returncode == 0, r.stderr
    assert len(read_log(mock.log_path)) == sent  # the old job's results are kept, not refetched
    # ... and from then on the state belongs to the new job
    assert cli("run", "-c", str(other), "--no-progress", env=ENV).returncode == 0
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 2


def test_log_file_survives_logrotate(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.2")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"r{i:03d}" for i in range(60)]),
                       limits={"concurrency": 2, "rate": 100}, run={"progress_interval": 0.3})
    logf, rotated = tmp_path / "run.log", tmp_path / "run.log.1"
    proc = popen_cli(tmp_path, "rot", "run", "-c", str(cfg), "--log-file", str(logf))
    try:
        wait_until(lambda: logf.exists() and "[pass 1]" in logf.read_text(), proc)
        logf.rename(rotated)  # what logrotate does (without copytruncate)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "[pass 1]" in rotated.read_text()
    assert logf.exists(), "the log was not reopened after the rotation"
    assert "[pass" in logf.read_text()  # progress after the move went to the new file


def test_status_of_a_missing_state_is_a_usage_error_and_the_ledger_names_the_job(
        tmp_path: Path, mock_process: Any) -> None:
    for cmd in ("status", "export"):
        r = cli(cmd, "--state", str(tmp_path / "nonexistent"), cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert "does not exist" in r.stderr and "--state" in r.stderr
    mock = mock_process("--api-key", KEY, "--faults", "none")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", ["l1", "l2"]))
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    # a config for another API in the working directory (the demo run from the repo root)
    other = write_config(tmp_path / "other.toml", "https://api.example.com/v1/notes/{id}", state,
                         tmp_path / "ids.txt")
    host = mock.url.removeprefix("http://")
    for args in (["-c", str(other)], ["--state", str(state)]):
        s = json.loads(cli("status", *args, "--json", cwd=tmp_path).stdout)
        assert [row["endpoint"] for row in s["ledger"]] == [f"{host}/items/{{id}}"]


def test_csv_fields_take_dotted_paths_and_an_unknown_field_is_an_error(
        tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "4")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ["f1", "f2"]))
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    rows = list(csv.reader(io.StringIO(export(cfg, "--format", "csv", "--fields",
                                              "id,data.title,value"))))
    assert rows[0] == ["id", "data.title", "value"]
    assert sorted(rows[1:]) == sorted([i, payload_for(i)["title"], str(payload_for(i)["value"])]
                                      for i in ("f1", "f2"))
    rows = list(csv.reader(io.StringIO(export(cfg, "--format", "csv", "--fields", "value"))))
    assert rows[0] == ["id", "value"]  # a row is no use without its ID
    r = cli("export", "-c", str(cfg), "--fields", "value", env=ENV)  # jsonl: no columns
    assert r.returncode == 2 and "--fields" in r.stderr and r.stdout == ""
    r = cli("export", "-c", str(cfg), "--format", "csv", "--fields", "id,data.url", env=ENV)
    assert r.returncode == 2 and "'data.url'" in r.stderr and "title" in r.stderr, r.stderr
    assert r.stdout == ""
    for fields, said in (("", "an empty name"), ("value,,id", "an empty name"),
                         ("value,value", "'value' is given twice")):
        r = cli("export", "-c", str(cfg), "--format", "csv", "--fields", fields, env=ENV)
        assert r.returncode == 2 and f"--fields: {said}" in r.stderr and r.stdout == "", r.stderr


def test_an_error_in_a_flag_names_the_flag_not_the_config_file(tmp_path: Path) -> None:
    idsf = write_ids(tmp_path / "ids.txt", ["a"])
    cfg = write_config(tmp_path / "c.toml", "http://127.0.0.1:9/{id}", tmp_path / "s", idsf)
    for args in (["-c", str(cfg)], ["--url", "http://127.0.0.1:9/{id}", "--ids", str(idsf)]):
        r = cli("run", *args, "--rate", "0", "--dry-run", env=ENV)
        assert r.returncode == 2
        assert "--rate: must be greater than 0" in r.stderr and "c.toml" not in r.stderr, r.stderr
    write_config(cfg, "http://127.0.0.1:9/{id}", tmp_path / "s", idsf, limits={"rate": 0})
    r = cli("run", "-c", str(cfg), "--dry-run", env=ENV)
    assert r.returncode == 2 and "c.toml" in r.stderr and "limits.rate" in r.stderr, r.stderr
    for flag, value in (("--ids", "-5"), ("--rate", "0"), ("--concurrency", "0"),
                        ("--rate", "inf")):  # (inf: OverflowError, exit 1)
        r = cli("demo", "--state", str(tmp_path / "demo"), flag, value, env=ENV)
        assert r.returncode == 2 and f"{flag}: must be greater than 0" in r.stderr, r.stderr
        assert not (tmp_path / "demo").exists()  # nothing made
    for where in (idsf, tmp_path / ("x" * 5000)):  # (a file; a name too long: exit 1)
        r = cli("demo", "--state", str(where), "--ids", "5", env=ENV)
        assert r.returncode == 2 and "--state: cannot make" in r.stderr, r.stderr


def test_a_header_flag_replaces_the_header_in_any_case(tmp_path: Path, mock_process: Any) -> None:
    """-H replaces the file's header of the same name in any case, and an earlier -H (both
    were sent: the file's revoked key first, which the server took: exit 3)."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    idsf = write_ids(tmp_path / "ids.txt", ["a", "b"])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "s", idsf)
    r = cli("run", "-c", str(cfg), "--no-progress", "-H", "x-api-key: wrong",
            "-H", f"X-API-KEY: {KEY}", env={**ENV, "ASYNCRAWL_TEST_KEY": "revoked"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert status_json(cfg)["ok"] == 2
    with pytest.raises(ConfigError, match="'X-Api-Key' and 'x-api-key' are one header"):
        Config(url="http://h.example/{id}", headers={"X-Api-Key": "a", "x-api-key": "b"})


def test_a_header_or_a_proxy_no_request_could_carry_stops_the_run_before_any(
        tmp_path: Path, mock_process: Any) -> None:
    """-H with a name that is no header name, and a proxy in the environment that is no URL:
    each request failed (400s, or InvalidURL for ~15 s), and every ID ended unavailable with
    exit 0, so that later runs skipped them."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "s",
                       write_ids(tmp_path / "ids.txt", ["a", "b"]))
    r = cli("run", "-c", str(cfg), "--no-progress", "-H", "X-é: 1", env=ENV)
    assert r.returncode == 2 and "-H: 'X-é' is not a header name" in r.stderr, r.stderr
    r = cli("run", "-c", str(cfg), "--no-progress",
            env={**ENV, "HTTP_PROXY": "http://[::1", "NO_PROXY": "", "no_proxy": ""})
    assert r.returncode == 2 and "HTTP_PROXY" in r.stderr and "[::1" not in r.stderr, r.stderr
    assert read_log(mock.log_path) == []


def test_a_webhook_that_is_not_an_http_url_is_a_config_error_that_does_not_show_it() -> None:
    for hook in ("not a url", "ftp://h.example/x", "https://", "http://h.example:99999/x"):
        with pytest.raises(ConfigError) as e:
            Config(url="http://h.example/{id}", webhook=hook)
        assert e.value.key == "alerts.webhook" and hook not in str(e.value)
    assert Config(url="http://h.example/{id}", webhook="https://hooks.example/T0/x").webhook


# -- a stuck job says why ---------------------------------------------------------------------


def test_a_short_list_that_never_reaches_the_api_is_the_same_error(tmp_path: Path) -> None:
    """Two IDs, one try each, no pass 2: fewer tries than the three that stop a run at its
    start, so the IDs ended failed, exit 6, and the message was about them, not the URL's
    port (a security audit's aside). Every try failed alike with no answer: exit 2."""
    cfg = write_config(tmp_path / "c.toml", "http://127.0.0.1:9/items/{id}", tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ["a", "b"]), retry={"max_tries": 1})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "connection refused to 127.0.0.1:9 on each of the 2 requests" in r.stderr
    assert "[request] url" in r.stderr
    # stopped before pass 2: the IDs are failed, for a rerun, not confirmed unavailable
    failed = cli("export", "-c", str(cfg), "--outcome", "failed", "--format", "ids", env=ENV)
    assert sorted(failed.stdout.split()) == ["a", "b"]


@pytest.mark.parametrize(("url", "said"), [
    ("http://127.0.0.1:9/items/{id}", "connection refused to 127.0.0.1:9"),
    ("http://nohost.invalid/items/{id}", "name nohost.invalid does not resolve"),
])
def test_an_error_waiting_cannot_cure_stops_the_job_at_once_with_the_fix(
        tmp_path: Path, url: str, said: str) -> None:
    cfg = write_config(tmp_path / "c.toml", url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"u{i}" for i in range(50)]))
    t0 = time.monotonic()
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30  # not minutes of probing
    assert said in r.stderr and "[request] url" in r.stderr
    assert re.search(rf"errors +{re.escape(said)} × \d+", r.stdout), r.stdout
    s = status_json(cfg)
    assert s["halt"]["reason"] == "unreachable" and s["ok"] == 0
    # no request left: none is counted as sent, none is in doubt (a refused connect counted
    # as a call sent, and as an "error answer")
    assert s["requests_sent"] == 0 and s["in_doubt"] == 0, s


def test_a_log_file_that_cannot_be_written_is_said_once_and_the_run_goes_on(
        tmp_path: Path, mock_process: Any) -> None:
    """A full disk under --log-file: a traceback for every line, then one at the handler's
    close, and exit 1 after a crawl that had finished."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "s",
                       write_ids(tmp_path / "ids.txt", ["a", "b"]))
    r = cli("run", "-c", str(cfg), "--no-progress", "--log-file", "/dev/full", env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("cannot write the log file /dev/full") == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("where", ["no-such-dir/run.log", "."])
def test_a_log_file_that_cannot_be_opened_is_a_usage_error(tmp_path: Path, where: str) -> None:
    idsf = write_ids(tmp_path / "ids.txt", ["a"])
    cfg = write_config(tmp_path / "c.toml", "http://127.0.0.1:9/{id}", tmp_path / "s", idsf)
    r = cli("run", "-c", str(cfg), "--log-file", str(tmp_path / where), env=ENV)
    assert r.returncode == 2 and "--log-file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "s").exists()  # nothing begun


def test_https_to_a_plain_http_port_stops_the_job_at_once_with_the_fix(
        tmp_path: Path, mock_process: Any) -> None:
    """A TLS handshake that fails (here the server speaks plain HTTP) on the first requests is
    a mistake in the URL, not an outage: exit 2 with the fix, the IDs not given up on (before:
    minutes of retries, every ID recorded unavailable, exit 0)."""
    mock = mock_process("--api-key", KEY, "--faults", "none")
    url = mock.item_url.replace("http://", "https://")
    cfg = write_config(tmp_path / "c.toml", url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"u{i}" for i in range(50)]))
    for client in ("auto", "aiohttp"):  # (asyncrawl's own client, then aiohttp's)
        r = cli("run", "-c", str(cfg), "--no-progress", env={**ENV, "ASYNCRAWL_HTTP": client},
                timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "TLS handshake with 127.0.0.1" in r.stderr and "https://" in r.stderr, r.stderr
        s = status_json(cfg)
        assert s["halt"]["reason"] == "unreachable"
        assert (s["ok"], s["failed"], s["unavailable"]) == (0, 0, 0)
        assert s["requests_sent"] == 0, s  # (a handshake is no request)


def test_error_lines_count_every_attempt_not_every_id(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    gone = ids_of("gone", 4)  # always 500
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", gone), passes={"second_pass": False},
                       run={"progress_interval": 30})
    r = cli("run", "-c", str(cfg), "--no-progress", "--log-format", "json", env=ENV)
    assert r.returncode == 6, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines()]
    burst = [e for e in events if e["event"] == "errors" and e["reason"] == "HTTP 500"]
    tries = sum(1 for e in read_log(mock.log_path) if e.event == "end" and e.status == 500)
    assert tries == 4 * 3  # max_tries = 3
    assert sum(e["count"] for e in burst) == tries and burst[0]["recorded"] == {"failed": 4}
    assert "HTTP 500 × 12" in r.stdout  # the summary says so too


# -- the event loop of the CLI's crawls ----------------------------------------------------


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(("choice", "want"), [("asyncio", "asyncio"), ("auto", "uvloop"),
                                              ("uvloop", "uvloop"), ("", "uvloop")])
def test_the_cli_runs_its_crawls_on_uvloop_when_the_fast_extra_is_installed(
        monkeypatch: pytest.MonkeyPatch, choice: str, want: str) -> None:
    from asyncrawl.cli import run_loop

    if want == "uvloop":
        pytest.importorskip("uvloop", reason="the fast extra is not installed")
    monkeypatch.setenv("ASYNCRAWL_LOOP", choice)
    assert run_loop(_loop_module()).split(".")[0] == want


def test_a_wrong_loop_choice_is_an_input_error(tmp_path: Path) -> None:
    r = cli("demo", env={"ASYNCRAWL_LOOP": "twisted", "TMPDIR": str(tmp_path)})
    assert r.returncode == 2 and "ASYNCRAWL_LOOP must be one of auto, asyncio, uvloop" in r.stderr
    assert list(tmp_path.iterdir()) == []  # (a demo state it never named was left behind)


def test_a_wrong_http_client_choice_is_an_input_error() -> None:
    r = cli("demo", env={"ASYNCRAWL_HTTP": "curl"})
    assert r.returncode == 2, r.stderr
    assert "ASYNCRAWL_HTTP must be one of auto, aiohttp, got 'curl'" in r.stderr


def test_state_dir_on_the_command_line_replaces_the_config_s_state_url(tmp_path: Path) -> None:
    """``--state DIR`` was ignored beside a config's ``[state] url``: the run, ``status`` and
    ``export`` used the PostgreSQL job (the README's recheck into a directory of its own
    merged the IDs into the job and sent nothing)."""
    conf = tmp_path / "c.toml"
    conf.write_text('[request]\nurl = "http://127.0.0.1:9/items/{id}"\n[state]\n'
                    'url = "postgresql://nobody@127.0.0.1:9/none"\njob = "j"\n')
    local = tmp_path / "local"
    for args in (["status"], ["export", "--format", "ids"]):
        r = cli(*args, "-c", str(conf), "--state", str(local))
        assert r.returncode == 2 and str(local) in r.stderr and "postgresql" not in r.stderr


# -- this machine's limits -----------------------------------------------------------------------


def _with_open_files(soft: int, hard: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m asyncrawl ARGS`` in a process that may open ``soft`` (``hard``) files."""
    script = ("import resource, runpy, sys; "
              f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
              f"sys.argv = ['asyncrawl', *{list(args)!r}]; "
              "runpy.run_module('asyncrawl', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=120)


def test_a_limit_on_open_files_below_the_concurrency_is_raised_or_refused(
        tmp_path: Path, mock_process: Any) -> None:
    """At `ulimit -n 32` and concurrency 100, the tries the limit refused (no socket) were
    charged as the ID's failures: 361 of 2,000 healthy IDs ended unavailable, exit 0."""
    mock = mock_process("--faults", "none", "--api-key", KEY, "--latency", "0.05")
    ids = write_ids(tmp_path / "ids.txt", [f"f{i}" for i in range(600)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids,
                       limits={"concurrency": 100, "rate": 5000})
    r = _with_open_files(48, 48, "run", "-c", str(cfg), "--no-progress")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "open files" in r.stderr and "limits.concurrency" in r.stderr
    assert read_log(mock.log_path) == []
    r = _with_open_files(48, 4096, "run", "-c", str(cfg), "--no-progress")  # (raised: it may)
    assert r.returncode == 0, r.stdout + r.stderr
    assert collections.Counter(outcomes_of(tmp_path / "state").values()) == {"ok": 600}


def test_tries_this_machine_cannot_make_wait_and_are_not_charged(
        tmp_path: Path, mock_process: Any) -> None:
    """A library run (which leaves the process's limits alone) with fewer files than its
    concurrency: a try refused a socket waits for connections to close; no ID fails for it.
    The application hears of it once (it crawled at a fraction of its concurrency, unsaid)."""
    mock = mock_process("--faults", "none", "--api-key", KEY, "--latency", "0.05")
    script = f"""
import asyncio, logging, resource
logging.basicConfig()
resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))
from asyncrawl import Config, Crawler
cfg = Config(url={mock.item_url!r}, state_dir={str(tmp_path / "state")!r},
             headers={{"X-Api-Key": {KEY!r}}}, concurrency=100, rate=5000.0, max_tries=2,
             cooldown=0.0)
s = asyncio.run(Crawler(cfg).run([f"m{{i}}" for i in range(600)]))
print(s.ok, s.failed, s.unavailable, s.exit_code)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["600", "0", "0", "0"], r.stdout + r.stderr
    assert r.stderr.count("fewer requests are in flight") == 1, r.stderr


# -- standard output and error that cannot be written ---------------------------------------------


def _shell(command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``command`` in bash (``$PY``: this Python), its exit status the pipeline's first."""
    return subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, **ENV, "PY": sys.executable})


def test_a_halted_run_keeps_its_exit_code_when_its_summary_cannot_be_printed(
        tmp_path: Path, mock_process: Any) -> None:
    """A 402 halt is exit 3: it was exit 0 into a pipe whose reader had gone (`| true`), and
    exit 1 with a traceback into a full disk, without the halt's log line."""
    mock = mock_process("--faults", "none", "--api-key", KEY, "--balance", "30")
    ids = write_ids(tmp_path / "ids.txt", [f"h{i}" for i in range(200)])
    for n, sink in enumerate(("| (exec 0<&-; sleep 0.1)", "> /dev/full")):
        cfg = write_config(tmp_path / f"c{n}.toml", mock.item_url, tmp_path / f"state{n}", ids,
                           limits={"concurrency": 1, "rate": 2000})
        r = _shell(f'"$PY" -m asyncrawl run -c {cfg} --no-progress {sink}')
        assert r.returncode == 3, (sink, r.stderr)
        assert "stopped: fatal" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_run_with_stdout_and_stderr_closed_finishes(tmp_path: Path,
                                                      mock_process: Any) -> None:
    """With stderr closed (`2>&-`) it waited for ever for its writing process, which held its
    own socket as its stderr; with both closed, uvloop aborted at the end (exit 134)."""
    mock = mock_process("--faults", "none", "--api-key", KEY)
    ids = write_ids(tmp_path / "ids.txt", [f"c{i}" for i in range(100)])
    for n, closed in enumerate(("2>&-", ">&- 2>&-")):
        state = tmp_path / f"state{n}"
        cfg = write_config(tmp_path / f"c{n}.toml", mock.item_url, state, ids)
        r = _shell(f'"$PY" -m asyncrawl run -c {cfg} {closed}')
        assert r.returncode == 0, (closed, r.stdout)
        assert lock_holder(state) is None  # (its writing process ended too)
        assert collections.Counter(outcomes_of(state).values()) == {"ok": 100}


def test_status_into_a_full_disk_is_an_error_not_a_bug(tmp_path: Path,
                                                       mock_process: Any) -> None:
    mock = mock_process("--faults", "none", "--api-key", KEY)
    ids = write_ids(tmp_path / "ids.txt", ["a", "b"])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids)
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    for command in ("status", "export"):
        r = _shell(f'"$PY" -m asyncrawl {command} -c {cfg} > /dev/full')
        assert r.returncode == 5, (command, r.stderr)
        assert "cannot write to standard output: No space left on device" in r.stderr
        assert "Traceback" not in r.stderr


def test_a_state_directory_removed_mid_run_stops_it_with_exit_5(tmp_path: Path,
                                                                 mock_process: Any) -> None:
    """`rm -rf` of the state directory during a run: the run went on writing into the
    deleted files, paid for every ID, and said "done"; its rerun paid for all of them again."""
    import shutil

    mock = mock_process("--faults", "none", "--api-key", KEY, "--latency", "0.02")
    ids = write_ids(tmp_path / "ids.txt", [f"r{i}" for i in range(3000)])
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, ids,
                       limits={"concurrency": 8, "rate": 2000})
    proc = popen_cli(tmp_path, "removed", "run", "-c", str(cfg), "--no-progress")
    with reaped(proc):
        wait_until(lambda: ok_count(state) >= 100, proc)
        shutil.rmtree(state)
        assert proc.wait(60) == 5
    err = (tmp_path / "removed.err").read_text()
    assert "was deleted while the run went on" in err, err
    assert len(read_log(mock.log_path)) // 2 < 2000  # (it stopped: not every ID bought)

    # a state directory moved mid-run is the same state: the run goes on into it
    moved = tmp_path / "moved"
    proc = popen_cli(tmp_path, "moved", "run", "-c", str(cfg), "--no-progress")
    with reaped(proc):
        wait_until(lambda: ok_count(state) >= 100, proc)
        state.rename(moved)
        assert proc.wait(120) == 0, (tmp_path / "moved.err").read_text()
    assert collections.Counter(outcomes_of(moved).values()) == {"ok": 3000}


def test_an_ids_file_rewritten_in_place_with_its_time_set_back_is_read_again(
        tmp_path: Path, mock_process: Any) -> None:
    """The same size and modification time (`touch -r`): taken for unchanged, read on from
    its end, and none of its new IDs fetched."""
    mock = mock_process("--faults", "none", "--api-key", KEY)
    ids = write_ids(tmp_path / "ids.txt", [f"a-{i:03d}" for i in range(200)])
    before = os.stat(ids)
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids)
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    write_ids(ids, [f"b-{i:03d}" for i in range(200)])
    os.utime(ids, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(ids).st_size, os.stat(ids).st_mtime_ns) == (before.st_size,
                                                                before.st_mtime_ns)
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    assert collections.Counter(outcomes_of(tmp_path / "state").values()) == {"ok": 400}


def test_a_hung_on_halt_command_is_cut_short_by_a_second_signal_with_what_it_started(
        tmp_path: Path, mock_process: Any) -> None:
    """The alerts held the run's end for 30 s (the command's timeout) plus the webhook's 10,
    one after the other, deaf to Ctrl-C; a killed command's own child lived on."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--balance", "10")
    pids = tmp_path / "pids"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"a{i}" for i in range(100)]),
                       alerts={"on_halt": f"sleep 100 & echo $! > '{pids}'; wait"})
    proc = popen_cli(tmp_path, "alerting", "run", "-c", str(cfg), "--no-progress")
    with reaped(proc):
        wait_until(lambda: pids.exists() and pids.read_text().strip().isdigit(), proc)
        child = int(pids.read_text())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # (the run has halted: one signal is a second stop)
        assert proc.wait(20) == 3
        assert time.monotonic() - t0 < 10
    err = (tmp_path / "alerting.err").read_text()
    assert "alerts were cut short" in err, err
    deadline = time.monotonic() + 10
    while _alive(child):  # (killed with its group)
        assert time.monotonic() < deadline, "the command's child lives on"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not reaped yet, does not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return False


def test_a_limit_on_open_files_the_system_will_not_raise_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS refuses a soft limit above kern.maxfilesperproc whatever the hard limit says:
    setrlimit's ValueError came out as a bug's traceback."""
    import resource

    from asyncrawl import cli as cli_mod

    def refuse(which: int, limits: tuple[int, int]) -> None:
        raise ValueError("current limit exceeds maximum limit")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    with pytest.raises(ConfigError, match="open files") as e:
        cli_mod.enough_files(20_000, "--concurrency")
    assert e.value.key == "--concurrency"
    cli_mod.enough_files(100)  # (256 are enough: nothing asked)


def test_a_signal_in_a_halt_s_grace_period_does_not_cut_its_alerts(
        tmp_path: Path, mock_process: Any) -> None:
    """A 402 halted the run; the operator's one Ctrl-C while the requests in flight finished
    had set the second stop's flag, and the alerts, sent after, were cut short at once."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--balance", "5",
                        "--latency", "1")
    told = tmp_path / "told"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", [f"g{i}" for i in range(100)]),
                       limits={"concurrency": 4, "rate": 4, "burst": 1},  # (a request a 0.25 s:
                       alerts={"on_halt": f"sleep 0.2; echo $ASYNCRAWL_REASON > '{told}'"})
    # the first 402 comes while 3 more are in flight, for up to 0.75 s: the grace period)
    proc = popen_cli(tmp_path, "graced", "run", "-c", str(cfg), "--no-progress")
    with reaped(proc):
        wait_until(lambda: any(e.status == 402 for e in read_log(mock.log_path)), proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 3
    assert told.read_text().strip() == "fatal", (tmp_path / "graced.err").read_text()


def test_lines_added_to_the_ids_file_during_a_run_are_the_next_run_s(
        tmp_path: Path, mock_process: Any) -> None:
    """A bad line appended while the run went on (after the file was checked) stopped it with
    exit 2, no summary, after it had paid for calls (exit 2 says nothing was fetched). A run
    reads the file as it was when it began; what is added meanwhile, the next run checks."""
    mock = mock_process("--faults", "none", "--api-key", KEY)
    ids = write_ids(tmp_path / "ids.txt", [f"a-{i:03d}" for i in range(300)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids,
                       limits={"concurrency": 4, "rate": 150, "burst": 1})
    with reaped(popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")) as proc:
        wait_until(lambda: mock.log_path.exists() and mock.log_path.stat().st_size > 0, proc)
        with ids.open("ab") as f:
            f.write(b"b-new\nbad\x00line\nb-last")  # (and a last line cut: still being written)
        assert proc.wait(120) == 0, (tmp_path / "run.err").read_text()
    assert collections.Counter(outcomes_of(tmp_path / "state").values()) == {"ok": 300}
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 2 and "ids.txt:302: ID contains the control character" in r.stderr
