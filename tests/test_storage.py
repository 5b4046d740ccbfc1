"""Storage faults: disk full (ENOSPC) and I/O errors (EIO) on the state database's writes and
fsyncs, in real processes.

The faults are injected below SQLite, at the C library (``tests/faults/faultfs.c``, loaded with
``LD_PRELOAD`` into a real ``asyncrawl run`` or library process: its ``write``/``pwrite``/
``fsync``/``fdatasync`` of the WAL fail, armed by the test once it has seen results committed,
so that how the records fell into transactions cannot decide whether anything was); and once
for real, on a tmpfs filled up while the run goes. Each time the job halts with exit 5 /
``halt.reason == "storage"``, the message names the database and the error, every result
handed on as committed is there, a paid answer whose record was lost is reported in doubt, and
a rerun after the fault is gone completes without fetching anything that was committed.

A writer that stalls (a slow disk, a paused process: the writing process stopped with
SIGSTOP) must not make the requests held back behind it leave together, over the rate.

After a failed *fsync*, whether the last transaction reached the disk is unknown (it may have:
its WAL frames were written). The run counts it as not committed; a rerun finds it either
there (its IDs are not fetched again) or not (its IDs were in doubt, and are fetched again).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrawl.sqlstore import DB
from asyncrawl.testing import most_in_window, read_log

from .conftest import KEY, ROOT, cli, write_config, write_ids
from .test_cli import ENV, answers, durable_ok_ids, export, jsonl, popen_cli, starts, status_json, wait_until

ERRORS = [pytest.param(errno.ENOSPC, id="ENOSPC"), pytest.param(errno.EIO, id="EIO")]
SQLITE_SAYS = {("write", errno.ENOSPC): "database or disk is full",
               ("write", errno.EIO): "disk I/O error",
               ("fsync", errno.ENOSPC): "disk I/O error",  # SQLITE_IOERR_FSYNC, whatever errno
               ("fsync", errno.EIO): "disk I/O error"}


@pytest.fixture(scope="session")
def faultfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-injecting shim, compiled for this machine."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build tests/faults/faultfs.c (install gcc)")
    out = tmp_path_factory.mktemp("faultfs") / "faultfs.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out),
                    str(ROOT / "tests" / "faults" / "faultfs.c"), "-ldl"], check=True)
    return out


def fault_env(shim: Path, state: Path, where: str, err: int, report: Path) -> dict[str, str]:
    """The shim in a child's environment: the WAL's next write (or fsync) fails (once armed,
    where the test arms it)."""
    return {**os.environ, **ENV, "LD_PRELOAD": str(shim),
            "FAULTFS_SUFFIX": f"/{state.name}/{DB}-wal", "FAULTFS_WHERE": where,
            "FAULTFS_AFTER": "0", "FAULTFS_ERRNO": str(err), "FAULTFS_REPORT": str(report)}


def run_until_committed(tmp_path: Path, cmd: list[str], env: dict[str, str], state: Path,
                        committed: int, then: Callable[[], None]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; once ``committed`` results are durable, call ``then`` (the fault comes);
    wait for the end."""
    out, err = tmp_path / "faulted.out", tmp_path / "faulted.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, text=True, cwd=ROOT, env=env)
    try:
        try:
            wait_until(lambda: len(durable_ok_ids(state)) >= committed, proc)
        except AssertionError as e:
            raise AssertionError(f"{e}; its stderr: {err.read_text()[-2000:]}") from None
        then()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())


def run_faulted(tmp_path: Path, cmd: list[str], env: dict[str, str], state: Path,
                committed: int) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` under the shim and arm its fault once ``committed`` results are durable."""
    arm = tmp_path / "arm"
    return run_until_committed(tmp_path, cmd, {**env, "FAULTFS_ARM": str(arm)}, state,
                               committed, arm.touch)


def tripped(report: Path) -> list[str]:
    """The shim's report of each process it was loaded in that hit the fault (a run's SQLite
    writing process, ``sqlproc``, loads it too: the run's own process never writes the WAL)."""
    lines = report.read_text().splitlines() if report.exists() else []
    return [line for line in lines if not line.startswith("tripped 0 ")]


# -- the library ---------------------------------------------------------------------------------

LIBRARY_RUN = """\
import asyncio, json, sys
from asyncrawl import Config, Crawler

async def main():
    url, state, key, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = Config(url=url, state_dir=state, headers={"X-Api-Key": key}, rate=100.0, burst=10,
                 concurrency=8, max_tries=3, backoff_base=0.01, backoff_max=0.05, cooldown=0.0,
                 timeout=5.0, grace=2.0)
    results = []
    async with Crawler(cfg, on_result=results.append) as crawler:
        s = await crawler.run([f"f{i:04d}" for i in range(n)])
    print(json.dumps({"halt": s.halt and s.halt.as_dict(), "exit": s.exit_code, "ok": s.ok,
                      "fetched": s.fetched, "handed": [r.id for r in results],
                      "outcomes": sorted({r.outcome for r in results})}))

asyncio.run(main())
"""


@pytest.mark.parametrize("err", ERRORS)
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_storage_fault_halts_keeps_what_was_committed_and_a_rerun_completes(
        tmp_path: Path, mock_process: Any, faultfs: Path, where: str, err: int) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "4096")
    state = tmp_path / "state"
    n = 400
    report = tmp_path / "faults.txt"
    r = run_faulted(tmp_path, [sys.executable, "-c", LIBRARY_RUN, mock.item_url, str(state), KEY,
                               str(n)], fault_env(faultfs, state, where, err, report), state, 11)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["halt"]["reason"] == "storage" and out["exit"] == 5
    assert str(state / DB) in out["halt"]["message"]
    assert SQLITE_SAYS[(where, err)] in out["halt"]["message"]
    assert tripped(report)[0].startswith("tripped 1 ")  # the fault hit once ...
    if where == "write":  # ... and the store never wrote again (SQLite may still fsync on close)
        assert tripped(report) == ["tripped 1 after 0"]
    handed_on = set(out["handed"])
    assert out["outcomes"] == ["ok"] and 10 < len(handed_on) < n
    assert out["fetched"] == out["ok"] == len(handed_on)

    durable = durable_ok_ids(state)  # reopened without the fault
    assert handed_on <= durable  # every result handed on as committed is there
    log = mock.settled_log()
    lost = set(answers(log)) - durable  # answered (billed) but not committed
    in_doubt = {o["id"] for o in jsonl(export_state(state, "--outcome", "in-doubt"))}
    assert lost <= in_doubt  # ... reported as possibly billed
    if where == "write":
        assert durable == handed_on  # the failed transaction is not there

    first = len(log)
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", [f"f{i:04d}" for i in range(n)]))
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = mock.settled_log()
    assert not set(starts(log[first:])) & durable  # nothing committed is fetched again
    assert len(durable_ok_ids(state)) == n


def export_state(state: Path, *args: str) -> str:
    r = cli("export", "--state", str(state), *args, env=ENV, cwd=state.parent)
    assert r.returncode == 0, r.stderr
    return r.stdout


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("err", ERRORS)
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_cli_exits_5_naming_the_database_and_a_rerun_completes(
        tmp_path: Path, mock_process: Any, faultfs: Path, where: str, err: int) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "4096")
    ids = [f"c{i:04d}" for i in range(300)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"rate": 100, "burst": 10})  # ~3 s: the arm comes well before the end
    report = tmp_path / "faults.txt"
    r = run_faulted(tmp_path, [sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                               "--no-progress"], fault_env(faultfs, state, where, err, report),
                    state, 1)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "asyncrawl: stopped early" in r.stdout and "storage" in r.stdout
    message = f"{state / DB}: cannot write the state database: {SQLITE_SAYS[(where, err)]}"
    assert message in r.stdout  # the summary names the file and the error
    assert message in r.stderr  # ... and so does the log
    assert "free space or fix the disk" in r.stdout
    assert "Traceback" not in r.stderr

    durable = durable_ok_ids(state)  # the state is readable
    assert 0 < len(durable) < len(ids)
    first_log = mock.settled_log()
    assert durable <= set(answers(first_log))
    s = status_json(cfg)
    assert s["ok"] == len(durable) and s["in_doubt"] >= len(set(answers(first_log)) - durable)
    # the run could write no end (nor its halt): status says it was cut short
    assert (s["last_run_cut_short"], s["halt"]) == (True, None)

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = mock.settled_log()
    assert not set(starts(log[len(first_log):])) & durable
    ok = jsonl(export(cfg, "--outcome", "ok"))
    assert sorted(o["id"] for o in ok) == ids  # every ID exactly once
    from asyncrawl.testing import payload_for
    assert all(o["data"] == payload_for(o["id"], pad=4096) for o in ok)


def test_cli_cannot_create_the_database_exits_5_and_sends_nothing(
        tmp_path: Path, mock_process: Any, faultfs: Path) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", ["a", "b", "c"]))
    env = {**fault_env(faultfs, state, "fsync", errno.EIO, tmp_path / "faults.txt"),
           "FAULTFS_SUFFIX": f"/{state.name}/{DB}.new"}  # the new database's first fsync fails
    r = subprocess.run([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg), "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert f"asyncrawl: error: {state / DB}" in r.stderr and "disk I/O error" in r.stderr
    assert "Traceback" not in r.stderr
    assert mock.settled_log() == []
    assert not (state / DB).exists()  # no database without its tables

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    assert sorted(export(cfg, "--format", "ids").splitlines()) == ["a", "b", "c"]


def test_a_storage_failure_while_stopping_on_a_signal_exits_5(
        tmp_path: Path, mock_process: Any, faultfs: Path) -> None:
    """SIGINT, then the last flush (the grace period's results, the halt) fails: the disk is
    what the exit code and the message are about (5), not the signal (130, "state flushed")."""
    mock = mock_process("--api-key", KEY, "--faults", "none", "--latency", "1.0")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", [f"s{i:04d}" for i in range(200)]))
    arm = tmp_path / "arm"
    env = {**fault_env(faultfs, state, "write", errno.ENOSPC, tmp_path / "faults.txt"),
           "FAULTFS_ARM": str(arm)}
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                                 "--no-progress"], stdout=o, stderr=e, cwd=ROOT, env=env)
    try:
        wait_until(lambda: len(durable_ok_ids(state)) >= 1, proc)
        proc.send_signal(signal.SIGINT)  # 8 requests are out, each answered after 1 s ...
        # (once the run has taken the signal: armed before, a flush of what it had queued
        # could fail first, and the disk, not the signal, was the first reason to stop)
        wait_until(lambda: "SIGINT: stopping" in err.read_text(), proc)
        arm.touch()  # ... and the flush that follows them fails
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 5, (stdout, stderr)
    message = f"{state / DB}: cannot write the state database: database or disk is full"
    assert message in stdout and "stopped by SIGINT" in stdout
    assert "Traceback" not in stderr


# -- a real full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """A 16 MiB tmpfs mounted at a temporary directory (root only)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the file system is full (big blocks, then the rest)."""
    with path.open("wb", buffering=0) as f:
        for block in (bytes(1 << 16), bytes(512)):
            try:
                while True:
                    f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def test_a_real_full_disk_exits_5_and_a_rerun_after_freeing_space_completes(
        tmp_path: Path, mock_process: Any, small_tmpfs: Path) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "8192")
    ids = [f"d{i:04d}" for i in range(400)]  # 400 x 8 KiB records
    state = small_tmpfs / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids),
                       limits={"rate": 100, "burst": 10})  # ~4 s: the fill comes well before the end
    # The disk fills up (something else takes the space) once results are committed. Filled
    # this early, the WAL is far below its first restart (1,000 frames of 8 KiB): every later
    # frame needs new space, and the database cannot grow by a checkpoint either.
    ballast = small_tmpfs / "ballast"
    r = run_until_committed(tmp_path, [sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                                       "--no-progress"], {**os.environ, **ENV}, state, 1,
                            lambda: fill(ballast))
    stdout, stderr = r.stdout, r.stderr
    assert r.returncode == 5, (stdout, stderr)
    assert "asyncrawl: stopped early" in stdout and "storage" in stdout
    message = f"{state / DB}: cannot write the state database: database or disk is full"
    assert message in stdout and message in stderr
    assert "Traceback" not in stderr

    durable = durable_ok_ids(state)  # readable; what was committed is there
    assert 1 <= len(durable) < len(ids)
    first_log = mock.settled_log()
    assert durable <= set(answers(first_log))

    ballast.unlink()  # free space: the same directory, now with room
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = mock.settled_log()
    assert not set(starts(log[len(first_log):])) & durable  # nothing saved is fetched again
    ok = jsonl(export(cfg, "--outcome", "ok"))
    assert sorted(o["id"] for o in ok) == ids
    from asyncrawl.testing import payload_for
    assert all(o["data"] == payload_for(o["id"], pad=8192) for o in ok)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's ``/proc``, every thread's)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def test_requests_held_back_by_a_stalled_writer_leave_within_the_rate(
        tmp_path: Path, mock_process: Any) -> None:
    """The state's writing process stalls for 0.6 s (SIGSTOP) while a crawl is bound by its
    rate: the requests whose tickets came meanwhile wait for their ``sent`` intents, then
    leave within the rate (rate x 1.05 + burst in any second), not all together at the
    stall's end (they did: 70 in a second at 50/s with a burst of 5)."""
    rate, burst = 50, 5
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = write_ids(tmp_path / "ids.txt", [f"s{i}" for i in range(250)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids,
                       limits={"concurrency": 16, "rate": rate, "burst": burst})
    run = popen_cli(tmp_path, "run", "run", "-c", str(cfg), "--no-progress")
    try:
        wait_until(lambda: mock.log_path.exists() and len(read_log(mock.log_path)) >= 120, run)
        stalled = children(run.pid)  # (the state's writing process: the run's only child)
        assert stalled
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(0.6)  # (the stall's length, not a wait for something)
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
        assert run.wait(timeout=60) == 0, (tmp_path / "run.err").read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    t = sorted(e.t for e in mock.settled_log() if e.event == "start")
    assert len(t) == 250
    worst = most_in_window(t)
    assert worst <= rate * 1.05 + burst, worst
