"""journal.py, the format of earlier releases: its records, its replay rules, and its import into
the state database on first open: once, with a message, the file kept as
``journal.jsonl.imported``; a torn tail (a crash mid-write) imported without it; damage, a bad
header or another format version refused with the file left as it was and no database made."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from asyncrawl import JournalCorrupt, StorageError
from asyncrawl.journal import HEADER, JOURNAL, Record
from asyncrawl.sqlstore import DB, _import_journal
from asyncrawl.store import open_store, read_store

from .conftest import outcomes_of

TS = 1_700_000_000.0  # 2023-11-14 UTC

RECORDS = [
    Record("run", ts=TS),
    Record("ok", "a", status=200, data={"title": "Ünïcode ☃", "n": 1}, paid=1, tries=1, ts=TS),
    Record("failed", "b", status=404, error="HTTP 404", permanent=True, tries=1, ts=TS),
    Record("failed", "c", status=503, error="HTTP 503", tries=5, ts=TS),
    Record("ok", "d/ü", status=200, data=[1, "two", None], paid=1, tries=2, ts=TS + 86_400),
]
STATES = {"a": "ok", "b": "failed", "c": "failed", "d/ü": "ok"}  # as the results view says


def body(records: list[Record]) -> bytes:
    return b"".join(r.encode() for r in records)


def write_raw(state: Path, data: bytes) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / JOURNAL
    path.write_bytes(data)
    return path


async def reopen(state: Path) -> None:
    store = await open_store(state)
    await store.close()


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


async def test_raw_bodies_are_imported(tmp_path: Path) -> None:
    state = tmp_path / "state"
    raws = [b'{"n":1}', b' [ "sp aced" ] ', b'{"s":"a\\nb"}', b'{\n"multi":\n"line"}']
    recs = [Record("ok", f"r{i}", status=200, raw=r, ts=TS) for i, r in enumerate(raws)]
    write_raw(state, (HEADER + body(recs))[:-3])  # the last record torn
    await reopen(state)
    payloads = {r.id: r.payload for r in read_store(state).records("ok")}
    assert payloads == {f"r{i}": orjson.loads(r) for i, r in enumerate(raws[:-1])}


async def test_import_happens_once_with_a_message_and_keeps_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    data = HEADER + body([*RECORDS, Record.sent("e")])  # the last run crashed with "e" in flight
    write_raw(state, data)
    with caplog.at_level("WARNING", logger="asyncrawl"):
        snap = read_store(state).snapshot()  # status before any run: read, not imported
        assert snap.counts.ok == 2 and (state / JOURNAL).exists() and not (state / DB).exists()
        await reopen(state)
    assert [m for m in caplog.messages if "imported the journal" in m and "(6 records)" in m]
    assert not (state / JOURNAL).exists()
    assert (state / (JOURNAL + ".imported")).read_bytes() == data
    assert outcomes_of(state) == STATES
    snap = read_store(state).snapshot()
    assert snap.billable_by_day == {"2023-11-14": 1, "2023-11-15": 1}
    assert dict(read_store(state).in_doubt()) == {"e": False}
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrawl"):
        await reopen(state)  # once only
    assert not [m for m in caplog.messages if "imported" in m]
    assert outcomes_of(state) == STATES


async def test_replay_rules_of_an_imported_journal(tmp_path: Path) -> None:
    recs = [
        Record("run", ts=TS),
        Record("ok", "x", paid=1, ts=TS),
        Record("failed", "x", ts=TS),  # ok is final
        Record("failed", "y", permanent=True, ts=TS),
        Record("unavailable", "y", ts=TS),
        Record("failed", "z", ts=TS),
        Record("ok", "z", ts=TS),
        Record("halt", status=402, ts=TS, extra={"reason": "fatal"}),
    ]
    write_raw(tmp_path / "s", HEADER + body(recs))
    snap = read_store(tmp_path / "s").snapshot()
    assert snap.halt is not None and snap.halt.status == 402 and snap.runs == 1
    await reopen(tmp_path / "s")
    assert outcomes_of(tmp_path / "s") == {"x": "ok", "y": "unavailable", "z": "ok"}
    write_raw(tmp_path / "t", HEADER + body([*recs, Record("run", ts=TS)]))
    snap = read_store(tmp_path / "t").snapshot()
    assert snap.halt is None and snap.runs == 2  # a new run clears the last one's halt


# -- torn tails ----------------------------------------------------------------------------------


def test_every_cut_inside_the_records_imports_the_complete_ones(tmp_path: Path) -> None:
    full = HEADER + body(RECORDS)
    ends = []  # byte offset at which each record's line ends
    pos = len(HEADER)
    for r in RECORDS:
        pos += len(r.encode())
        ends.append((pos, r.id))
    # Every offset after the header, so inside the last record whatever the last write held:
    # the import itself (what the store's open runs first: ``_import_journal``) at each of
    # them, and the whole open of a run's store (its writing process too: ~20 times the
    # cost) on both sides of each record's end.
    whole = {cut for end, _ in ends for cut in (end - 1, end, end + 1)}
    for cut in range(len(HEADER), len(full)):
        state = tmp_path / f"s{cut}"
        write_raw(state, full[:cut])
        if cut in whole:
            asyncio.run(reopen(state))
        else:
            _import_journal(state)
        kept = {i for e, i in ends if e <= cut and i is not None}
        assert set(outcomes_of(state)) == kept, cut
        assert (state / (JOURNAL + ".imported")).read_bytes() == full[:cut]


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
async def test_garbage_tail_is_left_out_of_the_import(tmp_path: Path, garbage: bytes) -> None:
    write_raw(tmp_path / "s", HEADER + body(RECORDS) + garbage)
    await reopen(tmp_path / "s")
    assert outcomes_of(tmp_path / "s") == STATES


@pytest.mark.parametrize("cut", range(1, len(HEADER)))
async def test_torn_header_imports_nothing(tmp_path: Path, cut: int) -> None:
    write_raw(tmp_path / "s", HEADER[:cut])
    await reopen(tmp_path / "s")
    assert outcomes_of(tmp_path / "s") == {}


async def test_reading_a_torn_journal_ignores_the_tail_without_modifying(tmp_path: Path) -> None:
    full = HEADER + body(RECORDS)
    torn = full[: len(full) - 7] + b"\x00\x00"
    path = write_raw(tmp_path / "s", torn)
    store = read_store(tmp_path / "s")  # status / export before any run of this release
    assert {r.id for r in store.records("ok")} == {"a"}
    assert {r.id: r.permanent for r in store.records("failed")} == {"b": True, "c": False}
    assert path.read_bytes() == torn and not (tmp_path / "s" / DB).exists()


def test_reading_a_missing_dir_finds_nothing(tmp_path: Path) -> None:
    assert read_store(tmp_path / "nothing", missing_ok=True) is None
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
            await open_store(tmp_path / "s")
        assert e.value.offset == len(before)
        assert f"offset {len(before)}" in str(e.value)
        assert str(path) in str(e.value)
        assert path.read_bytes() == data
        assert not (tmp_path / "s" / DB).exists()  # no half-imported database
    with pytest.raises(JournalCorrupt):
        read_store(tmp_path / "s")
    assert path.read_bytes() == data


async def test_torn_record_glued_to_a_valid_one_is_corrupt(tmp_path: Path) -> None:
    r3 = RECORDS[3].encode()
    before = HEADER + body(RECORDS[:3])
    data = before + r3[:20] + RECORDS[4].encode() + RECORDS[1].encode()
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(JournalCorrupt) as e:
        await open_store(tmp_path / "s")
    assert e.value.offset == len(before)
    assert path.read_bytes() == data


@pytest.mark.parametrize("header", [b'{"something": 1}\n', b"hello\n", b"[1]\n"])
async def test_not_a_journal(tmp_path: Path, header: bytes) -> None:
    data = header + body(RECORDS)
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(JournalCorrupt, match="not an asyncrawl journal") as e:
        await open_store(tmp_path / "s")
    assert e.value.offset == 0
    assert path.read_bytes() == data


async def test_other_format_version(tmp_path: Path) -> None:
    data = b'{"asyncrawl_journal": 2}\n' + body(RECORDS)
    path = write_raw(tmp_path / "s", data)
    with pytest.raises(StorageError) as e:
        await open_store(tmp_path / "s")
    assert not isinstance(e.value, JournalCorrupt)
    msg = str(e.value)
    assert "format 2" in msg and "format 1" in msg and "incompatible" in msg
    assert str(path) in msg
    assert path.read_bytes() == data
    with pytest.raises(StorageError, match="incompatible"):
        read_store(tmp_path / "s")
