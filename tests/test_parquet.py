"""``export --format parquet``: written from a real state, read back with pyarrow."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrawl import Config, ConfigError
from asyncrawl.records import Record
from asyncrawl.report import export

from .conftest import settled_state

pq = pytest.importorskip("pyarrow.parquet", reason="the 'parquet' extra is not installed")

PAYLOADS = {
    "a": {"title": "Ünïcode ☃", "n": 1, "score": 0.5, "ok": True,
          "author": {"name": "Ann"}, "tags": ["x", "y"], "mixed": 1},
    "b": {"title": "two", "n": 2, "score": 2, "ok": False, "author": {"name": "Bob"},
          "tags": [], "mixed": "one"},
    "c": {"title": "three", "n": 3, "author": None},  # missing fields: nulls
}


def _state(tmp_path: Path) -> Path:
    return settled_state(tmp_path / "state", [
        *(Record("ok", k, status=200, data=v, paid=1, tries=1) for k, v in PAYLOADS.items()),
        Record("unavailable", "gone", status=404, error="HTTP 404", permanent=True, pass_no=2)])


def test_parquet_export_types_columns_and_reads_back(tmp_path: Path) -> None:
    cfg = Config(url="http://unused/{id}", state_dir=str(_state(tmp_path)))
    out = tmp_path / "notes.parquet"
    assert export(cfg, fmt="parquet", path=str(out)) == 3
    table = pq.read_table(out)
    assert table.column_names == ["id", "title", "n", "score", "ok", "author", "tags", "mixed"]
    types = {f.name: str(f.type) for f in table.schema}
    assert types == {"id": "string", "title": "string", "n": "int64", "score": "double",
                     "ok": "bool", "author": "string", "tags": "string", "mixed": "string"}
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["a"]["title"] == "Ünïcode ☃" and rows["a"]["n"] == 1 and rows["b"]["score"] == 2.0
    assert rows["a"]["author"] == '{"name":"Ann"}' and rows["b"]["tags"] == "[]"
    assert rows["a"]["mixed"] == "1" and rows["b"]["mixed"] == '"one"'  # mixed types: JSON
    assert rows["c"]["score"] is None and rows["c"]["author"] is None  # missing / null


def test_parquet_fields_take_dotted_paths_and_unknown_ones_fail(tmp_path: Path) -> None:
    cfg = Config(url="http://unused/{id}", state_dir=str(_state(tmp_path)))
    out = tmp_path / "f.parquet"
    export(cfg, fmt="parquet", path=str(out), fields=["id", "author.name", "n"])
    table = pq.read_table(out)
    assert table.column_names == ["id", "author.name", "n"]
    assert {r["id"]: r["author.name"] for r in table.to_pylist()} == {
        "a": "Ann", "b": "Bob", "c": None}
    with pytest.raises(ConfigError, match="--fields"):
        export(cfg, fmt="parquet", path=str(tmp_path / "x.parquet"), fields=["nope"])
    assert not (tmp_path / "x.parquet").exists()
    gone = tmp_path / "gone.parquet"
    assert export(cfg, outcome="unavailable", fmt="parquet", path=str(gone)) == 1
    assert pq.read_table(gone).to_pylist() == [{"id": "gone", "status": 404, "error": "HTTP 404"}]


def test_parquet_needs_an_output_file(tmp_path: Path) -> None:
    cfg = Config(url="http://unused/{id}", state_dir=str(_state(tmp_path)))
    with pytest.raises(ConfigError, match="-o FILE"):
        export(cfg, fmt="parquet", out=None, path=None)
