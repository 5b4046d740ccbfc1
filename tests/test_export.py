"""``export``'s rows for CSV and Parquet, from a real state: the ID crawled is the ``id``
column whatever the payloads hold, and cells are spelt as JSON spells them."""

from __future__ import annotations

import csv
import io
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from asyncrawl import Config, ConfigError
from asyncrawl.records import Record
from asyncrawl.report import export

from .conftest import cli, settled_state

# an API that keys its objects by numbers of its own, fetched by slug
PAYLOADS = {
    "slug-a": {"id": 7, "title": "x", "draft": False, "tags": ["a"]},
    "slug-b": {"id": 8, "title": "y", "draft": True, "tags": []},
    "slug-c": {"title": "z"},  # no id of its own
}


def _state(tmp_path: Path) -> Config:
    state = settled_state(tmp_path / "state", [Record("ok", k, status=200, data=v, paid=1,
                                                      tries=1) for k, v in PAYLOADS.items()])
    return Config(url="http://unused/{id}", state_dir=str(state))


def _csv(cfg: Config, fields: list[str] | None = None) -> list[list[str]]:
    out = io.StringIO()
    export(cfg, fmt="csv", fields=fields, out=out)
    return list(csv.reader(io.StringIO(out.getvalue())))


def test_csv_keeps_the_crawled_id_and_the_payload_s_own_id_beside_it(tmp_path: Path) -> None:
    cfg = _state(tmp_path)
    rows = _csv(cfg)
    assert rows[0] == ["id", "data.id", "title", "draft", "tags"]
    by_id = {r[0]: r for r in rows[1:]}
    assert sorted(by_id) == sorted(PAYLOADS)  # (the payload's 7 and 8 took their place before)
    assert by_id["slug-a"] == ["slug-a", "7", "x", "false", '["a"]']  # JSON's spelling
    assert by_id["slug-b"][1:4] == ["8", "y", "true"]
    rows = _csv(cfg, ["data.id", "title"])
    assert rows[0] == ["id", "data.id", "title"]
    assert sorted(rows[1:]) == [["slug-a", "7", "x"], ["slug-b", "8", "y"], ["slug-c", "", "z"]]


@pytest.mark.parametrize(("outcome", "fields", "header"), [
    ("failed", None, ["id", "status", "error"]),
    ("in-doubt", None, ["id", "refetched"]),
    ("ok", ["title"], ["id", "title"]),
])
def test_an_empty_csv_export_still_has_its_header(
        tmp_path: Path, outcome: str, fields: list[str] | None, header: list[str]) -> None:
    cfg = Config(url="http://unused/{id}", state_dir=str(settled_state(tmp_path / "state", [])))
    out = io.StringIO()
    assert export(cfg, outcome=outcome, fmt="csv", fields=fields, out=out) == 0
    assert list(csv.reader(io.StringIO(out.getvalue()))) == [header]


def test_parquet_keeps_the_crawled_id_and_the_payload_s_own_id_beside_it(
        tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    cfg = _state(tmp_path)
    out = tmp_path / "notes.parquet"
    assert export(cfg, fmt="parquet", path=str(out)) == 3
    table = pq.read_table(out)
    assert table.column_names[:2] == ["id", "data.id"]
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == sorted(PAYLOADS)
    assert rows["slug-a"]["data.id"] == 7 and rows["slug-c"]["data.id"] is None
    assert rows["slug-b"]["draft"] is True


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_an_export_file_has_a_new_file_s_mode_or_keeps_the_one_it_replaces(
        tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    cfg = _state(tmp_path)
    umask = os.umask(0o027)  # (a umask of this test's own: what a new file gets is known)
    try:
        new = tmp_path / f"new.{fmt}"
        assert export(cfg, fmt=fmt, path=str(new)) == 3
        assert stat.S_IMODE(new.stat().st_mode) == 0o640  # 0666 less the umask, as with >
        kept = tmp_path / f"kept.{fmt}"
        kept.write_text("old")
        kept.chmod(0o644)
        assert export(cfg, fmt=fmt, path=str(kept)) == 3
        assert stat.S_IMODE(kept.stat().st_mode) == 0o644  # (mkstemp's 0600 before)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["state", f"new.{fmt}", f"kept.{fmt}"])  # no temp file left


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "ids", "parquet"])
def test_an_export_into_a_fifo_a_device_or_a_link_leaves_them_what_they_are(
        tmp_path: Path, fmt: str) -> None:
    """-o renamed a regular file over its target: /dev/null, /dev/stdout or a named pipe
    became a regular file (its reader got nothing), a symbolic link a file of its own."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    import threading

    cfg = _state(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    null = tmp_path / "null"
    os.symlink("/dev/null", null)  # (writing through it; /dev/null itself is the machine's)
    if fmt == "parquet":  # (pyarrow seeks in what it writes: a regular file only)
        for special in (fifo, null):
            with pytest.raises(ConfigError, match="parquet writes a regular file"):
                export(cfg, fmt=fmt, path=str(special))
    got: list[bytes] = []
    if fmt != "parquet":
        reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
        reader.start()
        assert export(cfg, fmt=fmt, path=str(fifo)) == 3
        reader.join(10)
        assert stat.S_ISFIFO(fifo.lstat().st_mode) and got and len(got[0]) > 10
        assert export(cfg, fmt=fmt, path=str(null)) == 3
        assert null.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    target = tmp_path / f"target.{fmt}"
    link = tmp_path / "link"
    os.symlink(target.name, link)
    assert export(cfg, fmt=fmt, path=str(link)) == 3
    assert link.is_symlink() and target.stat().st_size > 10


def _raw_state(tmp_path: Path, bodies: dict[str, bytes]) -> Config:
    state = settled_state(tmp_path / "state", [Record("ok", k, status=200, raw=v, paid=1, tries=1)
                                               for k, v in bodies.items()])
    return Config(url="http://unused/{id}", state_dir=str(state))


def test_csv_columns_hold_every_payload_of_the_first_records_and_big_integers_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The columns were the first record's fields only: a payload that is no object after one
    that is (or the other way round) lost its whole row, with exit 0 and nothing said; and an
    integer past 64 bits came out as 1.2345678901234568e+22."""
    cfg = _raw_state(tmp_path, {"c": b"[1, 2, 3]", "a": b'{"name": "a", "n": 12345678901234567890123}',
                                "e": b'"just a string"', "m": b'{"n": -9223372036854775809}'})
    rows = _csv(cfg)
    assert rows[0] == ["id", "data", "name", "n"]
    assert sorted(rows[1:]) == [["a", "", "a", "12345678901234567890123"],
                                ["c", "[1,2,3]", "", ""], ["e", "just a string", "", ""],
                                ["m", "", "", "-9223372036854775809"]]  # (19 digits, below -2**63)
    assert "no column holds" not in caplog.text


def test_parquet_keeps_big_integers_and_an_empty_export_its_columns(tmp_path: Path) -> None:
    """Past 64 bits: '1.2345678901234568e+22'; with no rows, a file with no column at all."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    cfg = _raw_state(tmp_path, {"a": b'{"n": 12345678901234567890123, "deep": [98765432109876543210987]}'})
    out = tmp_path / "x.parquet"
    assert export(cfg, fmt="parquet", path=str(out)) == 1
    assert pq.read_table(out).to_pylist() == [
        {"id": "a", "n": "12345678901234567890123", "deep": "[98765432109876543210987]"}]
    assert export(cfg, outcome="failed", fmt="parquet", path=str(out)) == 0
    assert pq.read_table(out).column_names == ["id", "status", "error"]


def test_csv_says_when_fields_past_the_first_records_are_left_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from asyncrawl.report import LOOKAHEAD

    bodies = {f"k{i:03d}": b'{"a": 1}' for i in range(LOOKAHEAD)} | {"late": b'{"a": 1, "b": 2}'}
    with caplog.at_level("WARNING", logger="asyncrawl"):
        rows = _csv(_raw_state(tmp_path, bodies))
    assert rows[0] == ["id", "a"] and len(rows) == LOOKAHEAD + 2
    assert "1 of 101 records had fields that no column holds" in caplog.text


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_fields_that_only_later_records_have_can_be_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: str) -> None:
    """CSV's warning says to name a field its columns left out with ``--fields``; named, it
    was refused ("in none of the first 100 records"). Now it is exported (warned of at the
    101st record); a name no record has is still an error, at the end, and ``-o`` then
    leaves no file."""
    from asyncrawl.report import LOOKAHEAD

    bodies = {f"k{i:03d}": b'{"a": 1}' for i in range(LOOKAHEAD)} | {"late": b'{"a": 1, "b": 2}'}
    cfg = _raw_state(tmp_path, bodies)
    out = tmp_path / f"x.{fmt}"
    with caplog.at_level("WARNING", logger="asyncrawl"):
        assert export(cfg, fmt=fmt, fields=["b"], path=str(out)) == LOOKAHEAD + 1
    assert "'b' is in none of the first 100 records; the export goes on" in caplog.text
    if fmt == "csv":
        rows = list(csv.reader(io.StringIO(out.read_text())))
    else:
        pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
        table = pq.read_table(out).to_pylist()
        rows = [["id", "b"], *([r["id"], "" if r["b"] is None else str(r["b"])] for r in table)]
    assert rows[0] == ["id", "b"] and {r[0]: r[1] for r in rows[1:]}["late"] == "2"
    assert sum(1 for r in rows[1:] if r[1] == "") == LOOKAHEAD
    out.unlink()
    with pytest.raises(ConfigError, match="'nope' is in none of the records"):
        export(cfg, fmt=fmt, fields=["nope"], path=str(out))
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_payload_field_named_data_id_beside_its_own_id_keeps_its_value(
        tmp_path: Path, fmt: str) -> None:
    """The payload's ``id`` is the column ``data.id``: a field of that very name lost its value
    to it (or took its place), whichever came last, and nothing said so."""
    payloads = {"a": {"data.id": "literal", "id": 7, "data.data.id": "deeper"},
                "b": {"id": 8, "data.id": "other"}}
    state = settled_state(tmp_path / "state", [Record("ok", k, status=200, data=v, paid=1, tries=1)
                                               for k, v in payloads.items()])
    cfg = Config(url="http://unused/{id}", state_dir=str(state))
    if fmt == "csv":
        rows = _csv(cfg)
        got = {r[0]: dict(zip(rows[0], r, strict=True)) for r in rows[1:]}
    else:
        pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
        export(cfg, fmt="parquet", path=str(tmp_path / "x.parquet"))
        got = {r["id"]: {k: str(v) if v is not None else "" for k, v in r.items()}
               for r in pq.read_table(tmp_path / "x.parquet").to_pylist()}
    assert got["a"]["data.id"] == "7" and got["b"]["data.id"] == "8"
    assert got["a"]["data.data.data.id"] == "literal" and got["a"]["data.data.id"] == "deeper"
    assert got["b"]["data.data.id"] == "other"


def test_a_parquet_export_is_one_read_of_the_state(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Parquet's columns were found in one read of the store and the rows written from a
    second: results a run committed in between came without their fields (dropped without
    a word), or with a new type that stopped the export. Here a run commits new results with
    a field of their own while the export reads."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    from asyncrawl import report

    cfg = _state(tmp_path)
    real, added = report._row, []

    def row(rec: dict[str, Any], outcome: str) -> dict[str, Any]:
        if not added:  # (a run's commit, while the export is under way)
            added.append(settled_state(tmp_path / "state", [
                Record("ok", f"new{i}", status=200, data={"only_new": i}, paid=1, tries=1)
                for i in range(3)]))
        return real(rec, outcome)

    monkeypatch.setattr(report, "_row", row)
    n = export(cfg, fmt="parquet", path=str(tmp_path / "x.parquet"))
    table = pq.read_table(tmp_path / "x.parquet")
    rows = table.to_pylist()
    assert added and n == len(rows) >= len(PAYLOADS)
    new = [r for r in rows if r["id"].startswith("new")]
    assert all(r["only_new"] is not None for r in new), rows


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_lone_surrogate_in_a_payload_string_is_written_as_its_escape(
        tmp_path: Path, fmt: str) -> None:
    """JSON allows ``"\\ud83d"`` (a JavaScript backend that cut a string in an emoji), and the
    payload keeps it; written to a file or stdout (strict UTF-8), a CSV or Parquet export
    stopped at it (UnicodeEncodeError: exit 1, "internal error")."""
    if fmt == "parquet":
        pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    state = settled_state(tmp_path / "state", [
        Record("ok", "a", status=200, data={"title": "cut \ud83d here", "k\udc00": 1}, paid=1,
               tries=1, raw=b'{"title": "cut \\ud83d here", "k\\udc00": 1}')])
    out = tmp_path / f"x.{fmt}"
    r = cli("export", "--state", str(state), "--format", fmt, "-o", str(out))
    assert r.returncode == 0, r.stderr
    if fmt == "csv":
        rows = list(csv.reader(io.StringIO(out.read_text(encoding="utf-8"))))
        assert rows == [["id", "title", "k\\udc00"], ["a", "cut \\ud83d here", "1"]]
    else:
        assert pq.read_table(out).to_pylist() == [
            {"id": "a", "title": "cut \\ud83d here", "k\\udc00": 1}]


def test_an_export_does_not_replace_a_file_of_the_state(tmp_path: Path) -> None:
    """``-o state/state.db`` replaced the database with the export, exit 0: the job gone (and
    a running run's writes, into the file's old inode)."""
    state = settled_state(tmp_path / "state", [Record("ok", "a", status=200, data={"x": 1},
                                                      paid=1, tries=1)])
    before = (state / "state.db").read_bytes()
    for name in ("state.db", "state.db-wal", "intents.log", "lock"):
        r = cli("export", "--state", str(state), "-o", str(state / name))
        assert r.returncode == 2 and "file of the state directory" in r.stderr, r.stderr
    assert (state / "state.db").read_bytes() == before
    r = cli("export", "--state", str(state), "-o", str(state / "results.jsonl"))
    assert r.returncode == 0 and (state / "results.jsonl").read_text().startswith('{"id":"a"')
    r = cli("export", "--state", str(state), "-o", "-", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith('{"id":"a"') and not (tmp_path / "-").exists()


@pytest.mark.parametrize("depth", [600, 3000])
def test_a_parquet_export_of_a_deeply_nested_payload(tmp_path: Path, depth: int) -> None:
    """The rows are spooled with pickle, which stopped at ~500 levels (RecursionError: the
    whole export failed, exit 1) where the JSON reader takes ~4,000 (review of the day's
    changes: the one-read spool)."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")
    body = b'{"tree": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    cfg = _raw_state(tmp_path, {"a": body, "b": b'{"tree": 2}'})
    assert export(cfg, fmt="parquet", path=str(tmp_path / "x.parquet")) == 2
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "x.parquet").to_pylist()}
    assert rows["a"]["tree"].count('{"a":') == depth and rows["b"]["tree"] == "2"
