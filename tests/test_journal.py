"""journal.py: creation, group commit, replay, torn-tail repair at every byte offset, damage that
must not be "repaired", the format version, and the lock (in this process and another one)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from asyncrawl import JournalCorrupt, LockedError, StorageError
from asyncrawl.journal import HEADER, JOURNAL, LOCK, Journal, Record, State, load_state, scan
from asyncrawl.writer import Writer

TS = 1_700_000_000.0  # 2023-11-14 UTC

RECORDS = [
    Record("run", ts=TS),
    Record("ok", "a", status=200, data={"title": "Ünïcode ☃", "n": 1}, paid=1, tries=1, ts=TS),
    Record("failed", "b", status=404, error="HTTP 404", permanent=True, tries=1, ts=TS),
    Record("failed", "c", status=503, error="HTTP 503", tries=5, ts=TS),
    Record("ok", "d/ü", status=200, data=[1, "two", None], paid=1, tries=2, ts=TS + 86_400),
]


def body(records: list[Record]) -> bytes:
    return b"".join(r.encode() for r in records)


def write_raw(state: Path, data: bytes) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / JOURNAL
    path.write_bytes(data)
    return path


def ids_in(path: Path) -> list[str | None]:
    return [rec.get("id") for _, rec in scan(path)]


async def reopen(state: Path) -> Journal:
    j = await Journal.open(state)
    await j.close()
    return j


def test_ok_record_keeps_the_body_as_received() -> None:
    raw = b'{"b": 1.50, "a":[1 ,2], "big": 123456789012345678901234567890}'
    line = Record("ok", "x", status=200, raw=raw, data={"ignored": True}, ts=TS).encode()
    assert raw in line and line.endswith(b"}\n") and line.count(b"\n") == 1
    assert orjson.loads(line)["data"] == orjson.loads(raw)
    # a body with line breaks (pretty-printed JSON) is written again on one line
    pretty = b'{\n  "a": [1,\n 2]\n}\n'
    line = Record("ok", "y", status=200, raw=pretty, ts=TS).encode()
    assert line.count(b"\n") == 1 and orjson.loads(line)["data"] == {"a": [1, 2]}
    # without a body, the parsed payload
    assert orjson.loads(Record("ok", "z", data=[1], ts=TS).encode())["data"] == [1]


async def test_raw_bodies_replay_and_repair(tmp_path: Path) -> None:
    state = tmp_path / "state"
    raws = [b'{"n":1}', b' [ "sp aced" ] ', b'{"s":"a\\nb"}', b'{\n"multi":\n"line"}']
    recs = [Record("ok", f"r{i}", status=200, raw=r, ts=TS) for i, r in enumerate(raws)]
    full = HEADER + body(recs)
    write_raw(state, full[:-3])  # the last record torn
    j = await Journal.open(state)
    await j.close()
    assert [r["data"] for _, r in scan(state / JOURNAL)] == [orjson.loads(r) for r in raws[:-1]]


# -- creation and the writer ---------------------------------------------------------------------


async def test_open_creates_dir_with_header(tmp_path: Path) -> None:
    state = tmp_path / "deep" / "state"
    j = await Journal.open(state)
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert (state / JOURNAL).read_bytes() == HEADER
        assert orjson.loads(HEADER) == {"asyncrawl_journal": 1}
        assert (state / LOCK).read_text().strip() == str(os.getpid())
        assert j.state.outcome == {} and j.state.runs == 0
    finally:
        await j.close()
    assert (state / JOURNAL).read_bytes() == HEADER  # reopening an empty journal keeps it as is
    await reopen(state)
    assert (state / JOURNAL).read_bytes() == HEADER


async def test_open_on_a_file_is_storage_error(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        await Journal.open(tmp_path / "state")


async def test_writer_group_commits_and_reports_after_append(tmp_path: Path) -> None:
    state = tmp_path / "state"
    j = await Journal.open(state)
    await j.start_appending()
    committed: list[list[Record]] = []
    on_disk_at_commit: list[bytes] = []

    def on_commit(batch: list[Record]) -> None:
        on_disk_at_commit.append((state / JOURNAL).read_bytes())  # must already be written
        committed.append(batch)

    errors: list[StorageError] = []
    w = Writer(j, on_commit=on_commit, on_error=errors.append)
    for r in RECORDS:
        w.put(r)
    w.close()
    await w.run()
    await j.close()

    assert errors == []
    assert committed == [RECORDS]  # everything queued before the writer ran: one commit
    assert (w.commits, w.written) == (1, len(RECORDS))
    assert on_disk_at_commit == [HEADER + body(RECORDS)]

    j2 = await Journal.open(state)
    try:
        st = j2.state
        assert st.runs == 1
        assert st.outcome == {"a": "ok", "b": "perm", "c": "failed", "d/ü": "ok"}
        assert st.counts() == {"ok": 2, "failed": 2, "unavailable": 0}
        assert st.billable_by_day == {"2023-11-14": 1, "2023-11-15": 1}
    finally:
        await j2.close()
    assert load_state(state).outcome == j2.state.outcome


async def test_writer_commits_while_running(tmp_path: Path) -> None:
    j = await Journal.open(tmp_path / "state")
    await j.start_appending()
    committed: list[Record] = []
    errors: list[StorageError] = []
    w = Writer(j, on_commit=committed.extend, on_error=errors.append, batch_limit=2)
    task = asyncio.create_task(w.run())
    for r in RECORDS:
        w.put(r)
        await asyncio.sleep(0.01)
    w.close()
    await task
    await j.close()
    assert errors == []
    assert committed == RECORDS
    assert w.commits >= 3  # batch_limit 2 for 5 records
    assert (tmp_path / "state" / JOURNAL).read_bytes() == HEADER + body(RECORDS)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_writer_storage_error_stops_writing(tmp_path: Path) -> None:
    j = await Journal.open(tmp_path / "state")
    j._fd = os.open("/dev/full", os.O_WRONLY)  # every write fails with ENOSPC
    committed: list[Record] = []
    errors: list[StorageError] = []
    w = Writer(j, on_commit=committed.extend, on_error=errors.append)
    w.put(RECORDS[0])
    task = asyncio.create_task(w.run())
    deadline = asyncio.get_running_loop().time() + 30
    while not errors:
        assert asyncio.get_running_loop().time() < deadline and not task.done()
        await asyncio.sleep(0.01)
    w.put(RECORDS[1])
    w.close()
    await task
    await j.close()
    assert len(errors) == 1 and w.failed is errors[0]
    assert committed == [] and w.written == 0


def test_state_replay_rules() -> None:
    st = State()
    for rec in [
        {"k": "run", "ts": TS},
        {"k": "ok", "id": "x", "paid": 1, "ts": TS},
        {"k": "failed", "id": "x", "ts": TS},  # ok is final
        {"k": "failed", "id": "y", "perm": True, "ts": TS},
        {"k": "unavailable", "id": "y", "ts": TS},
        {"k": "failed", "id": "z", "ts": TS},
        {"k": "ok", "id": "z", "ts": TS},
        {"k": "halt", "s": 402, "ts": TS},
    ]:
        st.apply(Record.decode(rec))
    assert st.outcome == {"x": "ok", "y": "unavailable", "z": "ok"}
    assert st.is_settled("x") and st.is_settled("y") and not st.is_settled("nope")
    assert st.halt is not None and st.halt.status == 402
    st.apply(Record("run", ts=TS))
    assert st.halt is None and st.runs == 2


# -- torn tails ----------------------------------------------------------------------------------


async def test_every_cut_inside_the_records_is_repaired(tmp_path: Path) -> None:
    full = HEADER + body(RECORDS)
    ends = []  # byte offset at which each record's line ends
    pos = len(HEADER)
    for r in RECORDS:
        pos += len(r.encode())
        ends.append(pos)
    state = tmp_path / "state"
    # every offset after the header, so inside the last record whatever the last write held
    for cut in range(len(HEADER), len(full)):
        path = write_raw(state, full[:cut])
        kept = [e for e in ends if e <= cut]
        j = await Journal.open(state)
        try:
            assert len(j.state.outcome) + j.state.runs == len(kept), cut
            await j.start_appending()
            await j.append(Record("unavailable", "new", ts=TS).encode())
        finally:
            await j.close()
        good = max(kept, default=len(HEADER))
        assert path.read_bytes() == full[:good] + Record("unavailable", "new", ts=TS).encode(), cut
        assert ids_in(path)[-1] == "new"
        assert len(list(scan(path))) == len(kept) + 1


async def test_cut_only_the_final_newline(tmp_path: Path) -> None:
    full = HEADER + body(RECORDS)
    path = write_raw(tmp_path / "s", full[:-1])  # the last record is valid JSON but unterminated
    j = await reopen(tmp_path / "s")
    assert "d/ü" not in j.state.outcome
    assert path.read_bytes() == HEADER + body(RECORDS[:-1])


@pytest.mark.parametrize(
    "garbage",
    [
        b"garbage\n",
        b"garbage",
        b"\x00" * 300,  # a crash can leave a run of zeros at the end of a file
        b"\x00" * 10 + b"\n",
        b'{"k": "ok", "id": "e", "da',
        b'{"id": "e"}\n',  # JSON, but not a record
        b"[1, 2]\n",
        b"\xff\xfe\n\xff",
        b"junk\nmore junk\n{\"k\":",  # several invalid lines, none valid after them
        b"\n",
        b"\n\n",
    ],
)
async def test_garbage_tail_is_repaired(tmp_path: Path, garbage: bytes) -> None:
    good = HEADER + body(RECORDS)
    path = write_raw(tmp_path / "s", good + garbage)
    j = await reopen(tmp_path / "s")
    assert path.read_bytes() == good
    assert j.state.outcome == {"a": "ok", "b": "perm", "c": "failed", "d/ü": "ok"}


@pytest.mark.parametrize("cut", range(1, len(HEADER)))
async def test_torn_header_is_rewritten(tmp_path: Path, cut: int) -> None:
    path = write_raw(tmp_path / "s", HEADER[:cut])
    await reopen(tmp_path / "s")
    assert path.read_bytes() == HEADER


async def test_load_state_ignores_torn_tail_without_modifying(tmp_path: Path) -> None:
    full = HEADER + body(RECORDS)
    torn = full[: len(full) - 7] + b"\x00\x00"
    path = write_raw(tmp_path / "s", torn)
    st = load_state(tmp_path / "s")
    assert st.outcome == {"a": "ok", "b": "perm", "c": "failed"}
    assert path.read_bytes() == torn


def test_load_state_of_missing_dir_is_empty(tmp_path: Path) -> None:
    st = load_state(tmp_path / "nothing")
    assert st.outcome == {} and st.runs == 0
    assert not (tmp_path / "nothing").exists()


# -- damage that must not be repaired ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [b"garbage\n", b'{"k": "ok", "id": "a", "da\n', b"\n", b'{"no_kind": 1}\n', b"\x00" * 50 + b"\n"],
)
async def test_damage_in_the_middle_is_corrupt_and_untouched(tmp_path: Path, bad: bytes) -> None:
    before = HEADER + body(RECORDS[:2])
    data = before + bad + body(RECORDS[2:])
    path = write_raw(tmp_path / "s", data)
    for _ in range(2):  # the lock is released after the failure: the same error again
        with pytest.raises(JournalCorrupt) as e:
            await Journal.open(tmp_path / "s")
        assert e.value.offset == len(before)
        assert f"offset {len(before)}" in str(e.value)
        assert str(path) in str(e.value)
        assert path.read_bytes() == data
    with pytest.raises(JournalCorrupt):
        load_state(tmp_path / "s")
    assert path.read_bytes() == data


async def test_torn_record_glued_to_a_valid_one_is_corrupt(tmp_path: Path) -> None:
    r3 = RECORDS[3].encode()
    before = HEADER + body(RECORDS[:3])
    data = before + r3[:20] + RECORDS[4].encode() + RECORDS[1].encode()
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(JournalCorrupt) as e:
        await Journal.open(tmp_path / "s")
    assert e.value.offset == len(before)
    assert path.read_bytes() == data


@pytest.mark.parametrize("header", [b'{"something": 1}\n', b"hello\n", b"[1]\n"])
async def test_not_a_journal(tmp_path: Path, header: bytes) -> None:
    data = header + body(RECORDS)
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(JournalCorrupt, match="not an asyncrawl journal") as e:
        await Journal.open(tmp_path / "s")
    assert e.value.offset == 0
    assert path.read_bytes() == data


async def test_other_format_version(tmp_path: Path) -> None:
    data = b'{"asyncrawl_journal": 2}\n' + body(RECORDS)
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(StorageError) as e:
        await Journal.open(tmp_path / "s")
    assert not isinstance(e.value, JournalCorrupt)
    msg = str(e.value)
    assert "format 2" in msg and "format 1" in msg and "incompatible" in msg
    assert str(path) in msg
    assert path.read_bytes() == data
    with pytest.raises(StorageError, match="incompatible"):
        load_state(tmp_path / "s")


# -- the lock ------------------------------------------------------------------------------------


async def test_lock_in_this_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = await Journal.open(state)
    try:
        with pytest.raises(LockedError) as e:
            await Journal.open(state)
        assert f"pid {os.getpid()}" in str(e.value)
        assert str(state) in str(e.value)
        assert e.value.exit_code == 2
    finally:
        await first.close()
    second = await Journal.open(state)
    await second.close()


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from asyncrawl.journal import Journal

    async def main():
        j = await Journal.open(sys.argv[1])
        print("locked", flush=True)
        await asyncio.sleep(60)
        await j.close()

    asyncio.run(main())
""")


def test_lock_held_by_another_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(state)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError) as e:
            asyncio.run(Journal.open(state))
        assert f"pid {proc.pid}" in str(e.value)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    # the holder died without closing: the kernel released its flock
    asyncio.run(reopen(state))
    assert (state / LOCK).read_text().strip() == str(os.getpid())


async def test_writer_lets_unwaited_records_gather_but_not_waited_ones(tmp_path: Path) -> None:
    """A batch nobody waits for lingers for company (fewer wake-ups of the writer's thread); a
    record somebody waits for cuts the lingering short."""
    j = await Journal.open(tmp_path / "state")
    await j.start_appending()
    batches: list[list[str | None]] = []
    w = Writer(j, on_commit=lambda b: batches.append([r.id for r in b]), on_error=print, linger=30)
    task = asyncio.create_task(w.run())
    w.put(Record("ok", "a", ts=TS))
    deadline = asyncio.get_running_loop().time() + 30
    while not w._lingering:  # the thread took "a" and waits for company
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)
    w.put(Record("ok", "b", ts=TS))
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await w.commit(Record("sent", "c", ts=TS)) is True
    assert loop.time() - started < 15  # not the 30 s linger: the commit woke the writer
    w.close()
    await task
    await j.close()
    assert batches == [["a", "b", "c"]]  # one write for the three
