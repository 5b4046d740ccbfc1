"""Storage faults: disk full (ENOSPC) and I/O errors (EIO) on the journal's write and fsync.

The faults are injected at the journal's file layer (``JournalFaults``: ``os.write`` and
``os.fsync`` of the journal's append descriptor), in this process for the library and in a real
``asyncrawl run`` process for the CLI; and once for real, on a 256 KiB tmpfs. Each time the job
halts with exit 5 / ``halt.reason == "storage"``, the message names the journal, every record
committed before the fault is still there (and nothing of the failed write: after a failed write
or fsync it is not known to be on disk), and a rerun after the fault is gone completes without
fetching anything that was committed.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrawl import Crawler
from asyncrawl.crawler import Result
from asyncrawl.journal import HEADER, JOURNAL, Journal, Record, good_length, load_state
from asyncrawl.testing import MockAPI, payload_for, read_log
from asyncrawl.writer import Writer

from .conftest import KEY, ROOT, cli, fast_config, write_config, write_ids
from .test_cli import ENV, answers, durable_ok_ids, export, jsonl, starts, status_json

ERRORS = [pytest.param(errno.ENOSPC, id="ENOSPC"), pytest.param(errno.EIO, id="EIO")]


class JournalFaults:
    """Make the journal's storage fail with ``err`` at the first append that goes beyond
    ``after_bytes`` bytes.

    ``where``: ``"write"`` (``os.write`` to the append descriptor writes half of the data, then fails: a short
    write, as on a full disk), ``"fsync"`` (``os.fsync`` of the append descriptor fails after the data
    was written), or ``"open"`` (every fsync of the journal file fails, from its creation on).
    Once tripped, every later write / fsync of the append file fails too; ``calls_after`` counts
    them (the writer must not try again after a failure).
    """

    def __init__(self, where: str, err: int, after_bytes: int = 0) -> None:
        assert where in ("write", "fsync", "open")
        self.where, self.err, self.after_bytes = where, err, after_bytes
        self.appended = 0
        self.tripped = 0
        self.calls_after = 0
        self.fd: int | None = None

    def error(self) -> OSError:
        return OSError(self.err, os.strerror(self.err))

    def install(self, setattr_: Callable[[Any, str, Any], None]) -> JournalFaults:
        """Patch with ``setattr_`` (``monkeypatch.setattr``, or ``setattr`` in a child process)."""
        faults = self
        real_start = Journal._start_appending_sync
        real_write = os.write
        real_fsync = os.fsync

        def start_appending(journal: Journal) -> None:
            real_start(journal)
            faults.fd = journal._fd

        real_cut, real_close = Journal._cut_uncommitted, Journal.close

        def cut(journal: Journal) -> None:
            faults.fd = None  # the descriptor is closed first: its number may be reused
            real_cut(journal)

        async def close(journal: Journal) -> None:
            faults.fd = None
            await real_close(journal)

        def appending(fd: int) -> bool:  # the journal's append descriptor (not a reused number)
            return fd == faults.fd and _is_journal(fd)

        def write(fd: int, data: Any) -> int:
            if faults.where != "write" or not appending(fd):
                return real_write(fd, data)
            if faults.tripped:
                faults.calls_after += 1
                raise faults.error()
            if faults.appended + len(data) > faults.after_bytes:
                faults.tripped += 1
                real_write(fd, data[: len(data) // 2])  # a short write, then the error
                raise faults.error()
            n = real_write(fd, data)
            faults.appended += n
            return n

        def fsync(fd: int) -> None:
            if faults.where == "open" and _is_journal(fd):
                faults.tripped += 1
                raise faults.error()
            if faults.where == "fsync" and appending(fd):
                if faults.tripped:
                    faults.calls_after += 1
                    raise faults.error()
                if faults.appended > faults.after_bytes:
                    faults.tripped += 1
                    raise faults.error()
            real_fsync(fd)

        if self.where == "fsync":  # count what is appended, to know when to trip
            def counting_write(fd: int, data: Any) -> int:
                n = real_write(fd, data)
                if appending(fd):
                    faults.appended += n
                return n
            setattr_(os, "write", counting_write)
        else:
            setattr_(os, "write", write)
        setattr_(Journal, "_start_appending_sync", start_appending)
        setattr_(Journal, "_cut_uncommitted", cut)
        setattr_(Journal, "close", close)
        setattr_(os, "fsync", fsync)
        return self


def _is_journal(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith("/" + JOURNAL)
    except OSError:
        return False


# Run the CLI in a child process with the faults installed (argv: where errno after_bytes ARGS).
FAULTY_CLI = """\
import os, sys
from tests.test_storage import JournalFaults
where, err, after = sys.argv[1], getattr(__import__("errno"), sys.argv[2]), int(sys.argv[3])
JournalFaults(where, err, after).install(setattr)
from asyncrawl.cli import main
sys.exit(main(sys.argv[4:]))
"""


def faulty_cli(where: str, err: int, after: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", FAULTY_CLI, where, errno.errorcode[err], str(after),
                           *args], capture_output=True, text=True, env={**os.environ, **ENV},
                          cwd=ROOT, timeout=120)


# -- the writer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("err", ERRORS)
@pytest.mark.parametrize("where", ["write", "fsync"])
async def test_a_failed_batch_is_never_reported_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, err: int) -> None:
    first = [Record("ok", f"a{i}", status=200, data={"n": i}, paid=1) for i in range(3)]
    run = Record("run")
    second = [Record("ok", f"b{i}", status=200, data={"n": i}, paid=1) for i in range(3)]
    size_first = sum(len(r.encode()) for r in [*first, run])  # the first batch fits, no more
    faults = JournalFaults(where, err, after_bytes=size_first).install(monkeypatch.setattr)
    state = tmp_path / "state"
    j = await Journal.open(state)
    await j.start_appending()
    committed: list[Record] = []
    errors: list[Exception] = []
    w = Writer(j, on_commit=committed.extend, on_error=errors.append)
    task = asyncio.create_task(w.run())
    for r in first:
        w.put(r)
    assert await w.commit(run) is True  # one batch: first + run
    for r in second[:-1]:
        w.put(r)
    assert await w.commit(second[-1]) is False  # its batch failed: not durable, and said so
    assert await w.commit(Record("end")) is False  # nothing is written after a failure
    w.close()
    await task
    await j.close()
    assert faults.tripped == 1 and faults.calls_after == 0  # tried once, never again
    assert len(errors) == 1 and str(state / JOURNAL) in str(errors[0])
    assert os.strerror(err) in str(errors[0])
    assert committed == [*first, run]
    assert w.written == 4
    # the journal holds exactly what was committed: the failed batch's bytes were cut off again
    monkeypatch.undo()
    assert (state / JOURNAL).read_bytes() == HEADER + b"".join(r.encode() for r in committed)
    assert load_state(state).outcome == {r.id: "ok" for r in first}


# -- the library ---------------------------------------------------------------------------------


@pytest.mark.parametrize("err", ERRORS)
@pytest.mark.parametrize("where", ["write", "fsync"])
async def test_storage_fault_halts_keeps_what_was_committed_and_a_rerun_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, err: int) -> None:
    state = tmp_path / "state"
    ids = [f"f{i:04d}" for i in range(400)]
    async with MockAPI(api_key=KEY, payload_bytes=4096) as api:
        cfg = fast_config(api, state, concurrency=8)
        faults = JournalFaults(where, err, after_bytes=120_000).install(monkeypatch.setattr)
        results: list[Result] = []
        async with Crawler(cfg, on_result=results.append) as crawler:
            summary = await crawler.run(ids)
        monkeypatch.undo()  # the disk is fixed

        assert summary.halt is not None and summary.halt.reason == "storage"
        assert summary.exit_code == 5
        assert str(state / JOURNAL) in summary.halt.message
        assert os.strerror(err) in summary.halt.message
        assert faults.tripped == 1 and faults.calls_after == 0  # a failed write is not retried
        handed_on = {r.id for r in results}
        assert all(r.outcome == "ok" for r in results)
        assert 10 < len(handed_on) < len(ids)
        assert summary.fetched == summary.ok == len(handed_on)
        # reloaded: exactly the committed records, nothing of the failed batch
        journal = state / JOURNAL
        st = load_state(state)
        durable = {i for i, o in st.outcome.items() if o == "ok"}
        assert durable == handed_on
        assert good_length(journal) == journal.stat().st_size  # no torn tail left behind
        lost = set(api.paid()) - durable  # answered (billed) but not committed
        assert lost and lost <= set(st.in_doubt)  # ... reported as possibly billed
        sent_before = len(api.starts())

        results2: list[Result] = []
        async with Crawler(cfg, on_result=results2.append) as crawler:
            summary2 = await crawler.run(ids)
        assert summary2.halt is None and summary2.exit_code == 0
        assert summary2.ok == len(ids) and summary2.skipped == len(durable)
        assert not set(api.starts()[sent_before:]) & durable  # nothing committed is fetched again
        assert handed_on.isdisjoint(r.id for r in results2)
        assert handed_on | {r.id for r in results2} == set(ids)
        assert {i for i, twice in load_state(state).in_doubt.items() if twice} >= lost


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("err", ERRORS)
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_cli_exits_5_naming_the_journal_and_a_rerun_completes(
        tmp_path: Path, mock_process: Any, where: str, err: int) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "4096")
    ids = [f"c{i:04d}" for i in range(300)]
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids))
    r = faulty_cli(where, err, 100_000, "run", "-c", str(cfg), "--no-progress")
    journal = state / JOURNAL
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "asyncrawl: stopped early" in r.stdout and "storage" in r.stdout
    message = f"{journal}: cannot write journal: {os.strerror(err)}"
    assert message in r.stdout  # the summary names the file and the error
    assert message in r.stderr  # ... and so does the log
    assert "free space or fix the disk" in r.stdout
    assert "Traceback" not in r.stderr

    durable = durable_ok_ids(state)  # the state is readable
    assert 0 < len(durable) < len(ids)
    assert good_length(journal) == journal.stat().st_size
    first_log = read_log(mock.log_path)
    assert durable <= set(answers(first_log))
    s = status_json(cfg)
    assert s["ok"] == len(durable) and s["in_doubt"] >= len(set(answers(first_log)) - durable)

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = read_log(mock.log_path)
    assert not set(starts(log[len(first_log):])) & durable
    ok = jsonl(export(cfg, "--outcome", "ok"))
    assert sorted(o["id"] for o in ok) == ids  # every ID exactly once
    assert all(o["data"] == payload_for(o["id"], pad=4096) for o in ok)


def test_cli_cannot_open_the_journal_exits_5_and_sends_nothing(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", ["a", "b", "c"]))
    r = faulty_cli("open", errno.EIO, 0, "run", "-c", str(cfg), "--no-progress")
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert f"asyncrawl: error: {state / JOURNAL}: cannot open journal: Input/output error" in r.stderr
    assert "Traceback" not in r.stderr
    assert read_log(mock.log_path) == []

    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    assert sorted(export(cfg, "--format", "ids").splitlines()) == ["a", "b", "c"]


# -- a real full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """A 256 KiB tmpfs mounted at a temporary directory (root only)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_full_disk_exits_5_and_a_rerun_after_freeing_space_completes(
        tmp_path: Path, mock_process: Any, small_tmpfs: Path) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none", "--payload-bytes", "8192")
    ids = [f"d{i:04d}" for i in range(200)]  # 200 x 8 KiB records: far more than 256 KiB
    state = small_tmpfs / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state, write_ids(tmp_path / "ids.txt", ids))
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    journal = state / JOURNAL
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "asyncrawl: stopped early" in r.stdout and "storage" in r.stdout
    assert f"{journal}: cannot write journal: No space left on device" in r.stdout
    assert f"{journal}: cannot write journal: No space left on device" in r.stderr
    assert "Traceback" not in r.stderr

    durable = durable_ok_ids(state)  # readable; what was committed is there
    assert 5 < len(durable) < len(ids)
    first_log = read_log(mock.log_path)
    assert durable <= set(answers(first_log))
    assert good_length(journal) == journal.stat().st_size

    # free space: the same directory, now with room
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = read_log(mock.log_path)
    assert not set(starts(log[len(first_log):])) & durable  # nothing saved is fetched again
    ok = jsonl(export(cfg, "--outcome", "ok"))
    assert sorted(o["id"] for o in ok) == ids
    assert all(o["data"] == payload_for(o["id"], pad=8192) for o in ok)
