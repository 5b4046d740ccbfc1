"""SIGINT / SIGTERM at every stage of a run: pass 1 (in-flight requests finishing within the grace
period, or cut off by it or by a second signal), the cool-down, and pass 2.

Each time the run exits with 130 / 143 within the grace period, sends nothing new after the
signal, keeps every answer it got, reports exactly the requests it cut off as in doubt, and the
rerun fetches no ID that had succeeded. ``test_cli.py`` has the basic pass-1 case and two SIGINTs.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrawl.testing import LogEntry, read_log

from .conftest import KEY, cli, live_processes, outcomes_of, write_config, write_ids
from .test_cli import (
    ENV,
    answers,
    durable_ok_ids,
    export,
    ids_of,
    jsonl,
    popen_cli,
    reaped,
    starts,
    status_json,
    wait_until,
)

SIGNALS = [pytest.param(signal.SIGINT, 130, id="SIGINT"), pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
           pytest.param(signal.SIGHUP, 129, id="SIGHUP")]


def signal_and_wait(proc: Any, *sigs: signal.Signals, between: float = 0.5,
                    timeout: float = 60) -> tuple[int, float, float]:
    """Send the signals (``between`` seconds apart); return (exit code, seconds from the last
    signal to the exit, wall-clock time of the first signal)."""
    sent_at = time.time()
    for i, sig in enumerate(sigs):
        if i:
            time.sleep(between)
            assert proc.poll() is None, "the run ended before the second signal"
        proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, time.monotonic() - t0, sent_at


def started_after(log: list[LogEntry], t: float) -> list[str]:
    return [e.id for e in log if e.event == "start" and e.t > t]


def rerun_fetches_nothing_that_succeeded(cfg: Path, mock: Any, durable: set[str],
                                         *flags: str) -> list[LogEntry]:
    before = len(mock.settled_log(timeout=10))
    r = cli("run", "-c", str(cfg), "--no-progress", *flags, env=ENV)
    assert r.returncode == 0, r.stderr
    log = read_log(mock.log_path)
    assert not set(starts(log[before:])) & durable
    return log


# -- pass 1 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_signal_in_pass_1_lets_requests_in_flight_finish_and_keeps_them(
        tmp_path: Path, mock_process: Any, sig: signal.Signals, code: int, loop: str) -> None:
    """Answers take 1 s, the grace period is 5 s: the requests in flight at the signal finish,
    are recorded, and are neither in doubt nor fetched again; on either event loop the CLI
    may run in (asyncio's, or uvloop's with the ``fast`` extra)."""
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="the fast extra is not installed")
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "1")
    ids = [f"p{i:04d}" for i in range(80)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 8}, run={"grace": 5})
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress",
                     env={**ENV, "ASYNCRAWL_LOOP": loop})
    wait_until(lambda: sum(starts(read_log(mock.log_path)).values()) >= 20, proc)
    rc, took, sent_at = signal_and_wait(proc, sig)
    assert rc == code, (tmp_path / "run.err").read_text()
    assert took < 5 + 2  # within the grace period
    log = mock.settled_log(timeout=10)
    assert started_after(log, sent_at + 0.5) == []  # nothing new after the signal
    in_flight_at_signal = {e.id for e in log if e.event == "start" and e.t <= sent_at} - {
        e.id for e in log if e.event == "end" and e.t <= sent_at}
    assert 1 <= len(in_flight_at_signal) <= 8
    durable = durable_ok_ids(state)
    assert durable == set(answers(log))  # every answer, those given in the grace period too
    assert in_flight_at_signal <= durable
    assert export(cfg, "--outcome", "in-doubt") == ""  # nothing was cut off
    s = status_json(cfg)
    assert s["halt"] is not None and s["halt"]["reason"] == "signal"

    log = rerun_fetches_nothing_that_succeeded(cfg, mock, durable, "--concurrency", "40")
    assert answers(log) == collections.Counter(ids)  # each ID billed exactly once


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_a_signal_to_the_whole_process_group_stops_the_run_cleanly(
        tmp_path: Path, mock_process: Any, sig: signal.Signals, code: int) -> None:
    """Ctrl-C, or a terminal or SSH session that closes, signals the job's whole process group,
    the state's writing process too: that process leaves the stop to the run and writes what
    it is sent to the end (it does not die of SIGHUP, which would make a clean stop a storage
    error, exit 5); nothing of the group is left afterwards."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "1")
    ids = [f"g{i:04d}" for i in range(80)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 8}, run={"grace": 5})
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress", session=True)
    wait_until(lambda: sum(starts(read_log(mock.log_path)).values()) >= 20, proc)
    os.killpg(proc.pid, sig)
    assert proc.wait(60) == code, (tmp_path / "run.err").read_text()

    wait_until_gone = time.monotonic() + 30
    while live_processes(pgrp=proc.pid):
        assert time.monotonic() < wait_until_gone, "a process of the group is left"
        time.sleep(0.01)
    log = mock.settled_log(timeout=10)
    assert durable_ok_ids(state) == set(answers(log))
    assert export(cfg, "--outcome", "in-doubt") == ""
    assert status_json(cfg)["halt"]["reason"] == "signal"


@pytest.mark.parametrize(("sigs", "grace"), [
    pytest.param((signal.SIGTERM,), 1, id="grace-expires"),
    pytest.param((signal.SIGTERM, signal.SIGINT), 60, id="second-signal"),
])
def test_requests_cut_off_by_the_grace_period_are_exactly_the_in_doubt_ones(
        tmp_path: Path, mock_process: Any, sigs: tuple[signal.Signals, ...], grace: float) -> None:
    """Answers take 4 s: the grace period (1 s), or a second signal, cuts the 4 requests in flight
    off. Those, and only those, are in doubt; the rerun fetches them again and reports them as
    possibly billed twice."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "4")
    ids = [f"c{i}" for i in range(6)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 4}, run={"grace": grace})
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")
    wait_until(lambda: sum(starts(read_log(mock.log_path)).values()) == 4, proc, timeout=30)
    rc, took, sent_at = signal_and_wait(proc, *sigs)
    assert rc == 143, (tmp_path / "run.err").read_text()  # the first signal decides the code
    assert took < 3.5  # the grace period (1 s) or the second signal ended it, not the answers
    if grace == 1:
        assert took > 0.5  # ... after waiting for the grace period
    log = mock.settled_log(timeout=10)
    assert started_after(log, sent_at + 0.5) == []
    assert durable_ok_ids(state) == set()
    cut_off = set(starts(log))
    assert len(cut_off) == 4
    in_doubt = jsonl(export(cfg, "--outcome", "in-doubt"))
    assert {o["id"]: o["refetched"] for o in in_doubt} == dict.fromkeys(cut_off, False)
    s = status_json(cfg)
    assert s["in_doubt"] == 4 and s["halt"]["reason"] == "signal"
    # (its summary said only "nothing that succeeded is fetched again")
    assert "4 cut off in flight: in doubt" in (tmp_path / "run.out").read_text()

    rerun_fetches_nothing_that_succeeded(cfg, mock, set(), "--concurrency", "8")
    in_doubt = jsonl(export(cfg, "--outcome", "in-doubt"))
    assert {o["id"]: o["refetched"] for o in in_doubt} == dict.fromkeys(cut_off, True)
    assert sorted(export(cfg, "--format", "ids").splitlines()) == ids


# -- the cool-down and pass 2 ------------------------------------------------------------------


def _two_pass_job(tmp_path: Path, mock_process: Any, failing: list[str], **retry: Any) -> tuple[
        Any, Path, Path, list[str]]:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    good = ids_of("ok", 100)
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", good + failing),
                       passes={"cooldown": 5}, retry=retry)
    return mock, state, cfg, good


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_signal_during_the_cool_down_skips_pass_2_at_once(
        tmp_path: Path, mock_process: Any, sig: signal.Signals, code: int) -> None:
    missing = ids_of("not_found", 1)[0]  # 404: failed in pass 1, so pass 2 is pending
    mock, state, cfg, good = _two_pass_job(tmp_path, mock_process, [missing])
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")

    def pass_1_done() -> bool:
        return sorted(outcomes_of(state).values()) == ["failed"] + ["ok"] * len(good)

    wait_until(pass_1_done, proc)
    t_pass_1 = time.monotonic()
    rc, took, _ = signal_and_wait(proc, sig)
    assert rc == code, (tmp_path / "run.err").read_text()
    assert time.monotonic() - t_pass_1 < 5  # well before the cool-down (5 s) was over
    assert took < 2 + 1.5  # within the grace period (nothing was in flight)
    assert "stopped early" in (tmp_path / "run.out").read_text()
    log = mock.settled_log(timeout=10)
    assert starts(log)[missing] == 1  # pass 2 never started
    durable = durable_ok_ids(state)
    assert durable == set(good)
    s = status_json(cfg)
    assert (s["ok"], s["failed"], s["unavailable"]) == (len(good), 1, 0)
    assert s["halt"]["reason"] == "signal"

    log = rerun_fetches_nothing_that_succeeded(cfg, mock, durable, "--cooldown", "0")
    assert starts(log)[missing] == 3  # the rerun's pass 1 and pass 2
    assert [o["id"] for o in jsonl(export(cfg, "--outcome", "unavailable"))] == [missing]


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_signal_during_pass_2(tmp_path: Path, mock_process: Any, sig: signal.Signals, code: int) -> None:
    gone = ids_of("gone", 3)  # 500 on every attempt: retried with backoff in both passes
    mock, state, cfg, good = _two_pass_job(tmp_path, mock_process, gone, max_tries=3,
                                           backoff_base=0.5, backoff_max=1, jitter="none")
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress", "--cooldown", "0.5")
    # pass 2 has begun once a failing ID got its 4th request (3 tries in pass 1)
    wait_until(lambda: max(starts(read_log(mock.log_path))[g] for g in gone) >= 4, proc)
    rc, took, sent_at = signal_and_wait(proc, sig)
    assert rc == code, (tmp_path / "run.err").read_text()
    assert took < 2 + 1.5  # within the grace period: parked retries are not waited for
    log = mock.settled_log(timeout=10)
    assert started_after(log, sent_at + 0.5) == []
    assert all(starts(log)[g] < 3 + 3 for g in gone)  # pass 2 was cut short
    durable = durable_ok_ids(state)
    assert durable == set(good)
    s = status_json(cfg)
    assert (s["ok"], s["failed"], s["unavailable"]) == (len(good), 3, 0)  # still failed

    rerun_fetches_nothing_that_succeeded(cfg, mock, durable, "--cooldown", "0")
    unavailable = jsonl(export(cfg, "--outcome", "unavailable"))
    assert {o["id"]: o["status"] for o in unavailable} == dict.fromkeys(gone, 500)
    assert sorted(export(cfg, "--format", "ids").splitlines()) == sorted(good)


def test_a_second_signal_ends_a_run_whose_store_answers_nothing(
        tmp_path: Path, mock_process: Any) -> None:
    """The state's writing process stopped (SIGSTOP; a hung disk does the same): a signal's
    stop waited for it for ever, and so did a second signal's; only ``kill -9`` ended the run.
    The second signal now ends it once the store is known stalled (~10 s), saying so, with the
    first signal's exit code; what the store had committed is kept and not fetched again."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "0.2")
    ids = [f"h{i:04d}" for i in range(200)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"concurrency": 4}, run={"grace": 2})
    proc = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")
    with reaped(proc):
        wait_until(lambda: sum(starts(read_log(mock.log_path)).values()) >= 8, proc)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "no writing process"
        for pid in children:
            os.kill(int(pid), signal.SIGSTOP)
        try:
            rc, took, _ = signal_and_wait(proc, signal.SIGINT, signal.SIGINT, timeout=45)
        finally:
            for pid in children:
                os.kill(int(pid), signal.SIGCONT)
    err = (tmp_path / "run.err").read_text()
    assert rc == 130, err
    assert "the state store does not answer" in err and "Traceback" not in err
    assert took < 30
    gone = time.monotonic() + 30  # (the writing process ends at its pipe's end)
    while {int(pid) for pid in children} & live_processes():
        assert time.monotonic() < gone, "the writing process is left"
        time.sleep(0.01)
    durable = durable_ok_ids(state)
    log = rerun_fetches_nothing_that_succeeded(cfg, mock, durable)
    assert set(answers(log)) == set(ids)


# A run whose own process signals itself at one moment (``WHERE``, patched in): as if the
# operator's Ctrl-C or a service manager's SIGTERM came exactly then.
SIGNALLED_AT = """
import os, signal, sys
import asyncrawl.cli as cli, asyncrawl.sqlproc as sqlproc
where, sigs = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
def signalled(module, name):
    real = getattr(module, name)
    def at(*a, **k):
        for s in sigs:
            os.kill(os.getpid(), s)
        return real(*a, **k)
    setattr(module, name, at)
signalled(*{"summary": (cli, "_report_end"), "start": (sqlproc.Zygote, "start")}[where])
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("where", ["summary", "start"])
def test_a_signal_outside_the_run_s_own_handlers_ends_nothing_unsaid(
        tmp_path: Path, mock_process: Any, where: str) -> None:
    """A stop signal as the summary is written (after the run's loop gave its handlers back)
    ended the process: SIGINT as a KeyboardInterrupt (exit 130), SIGTERM by its default,
    the summary and the run's own exit code lost. One at the start (before the loop's
    handlers) exited 130 with nothing said. Now the summary and the exit code stand; the
    early one stops the run before it sends anything, and it says so."""
    import subprocess
    import sys

    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"q{i}" for i in range(20)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids)
    r = subprocess.run([sys.executable, "-c", SIGNALLED_AT, where,
                        f"{signal.SIGTERM.value},{signal.SIGINT.value}", "run", "-c", str(cfg),
                        "--no-progress"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**os.environ, **ENV})
    if where == "summary":
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "asyncrawl: finished" in r.stdout and "ok           20" in r.stdout
    else:
        assert r.returncode == 143, (r.stdout, r.stderr)  # (the first signal's code)
        assert "asyncrawl: stopped early" in r.stdout, (r.stdout, r.stderr)
        assert read_log(mock.log_path) == []  # nothing sent
