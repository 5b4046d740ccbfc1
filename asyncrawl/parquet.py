"""``export --format parquet``: the results as one Parquet file (pyarrow, the ``parquet``
extra), for pandas, Polars and DuckDB.

Columns: ``id``, then each top-level field of the payloads (or the ``--fields``, dotted paths
allowed: a column named ``author.name``; a payload's own ``id`` field is ``data.id``, ``id``
being the ID crawled). A column whose values are all of one JSON scalar type
gets that type (booleans; integers as int64; numbers as float64 when any is fractional;
strings); an object, an array, or values of mixed types are written as JSON text. Missing
values are nulls. For ``failed`` / ``unavailable``: ``id``, ``status``, ``error``.

The records are read once from the store (one snapshot, a run may be writing it), spooled to
a temporary file while their columns and types are found, then written a row group at a time
(memory stays flat). The file appears atomically.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import StorageError, require_extra, temp_beside
from .jsontext import deep_room, json_text, writable

ROW_GROUP = 65_536
_INT64 = (-(2**63), 2**63 - 1)


def _pyarrow() -> tuple[Any, Any]:
    return (require_extra("pyarrow", "parquet", "--format parquet"),
            require_extra("pyarrow.parquet", "parquet", "--format parquet"))


def check() -> None:
    """``ConfigError`` without pyarrow (before the state is read)."""
    _pyarrow()


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if _INT64[0] <= v <= _INT64[1] else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"


def _column_type(kinds: set[str]) -> str:
    if kinds in ({"int", "float"}, {"float"}):
        return "float"
    if len(kinds) == 1:
        return next(iter(kinds))
    return "json" if kinds else "str"


def write_parquet(rows: Iterator[dict[str, Any]], path: Path,
                  columns: list[str] | None, get: Callable[[dict[str, Any], str], Any],
                  missing: object, *, empty: list[str]) -> int:
    """Write ``rows`` to ``path``; return how many. ``empty``: the columns where there are no
    rows and no ``columns`` (a file with no column at all, not even ``id``, broke what reads
    it by name).

    The rows are read from the store once: the columns and their types are found while they
    are spooled to a temporary file beside ``path``, which is then written out. (Read twice
    from the store, as before, the second read of a state a run was writing held rows the
    first had not seen: their fields were dropped without a word, or a new type in a column
    stopped the export.)"""
    pa, pq = _pyarrow()
    kinds: dict[str, set[str]] = {}
    if columns is not None:
        kinds = {c: set() for c in columns}
    n = 0
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        with tempfile.TemporaryFile(dir=path.parent) as spool:
            for row in rows:
                n += 1
                spool.write(_pickled(row))
                if columns is None:
                    for k, v in row.items():
                        if v is not None:
                            kinds.setdefault(k, set()).add(_kind(v))
                        else:
                            kinds.setdefault(k, set())
                else:
                    for c in columns:
                        v = get(row, c)
                        if v is not missing and v is not None:
                            kinds[c].add(_kind(v))
            if not kinds:
                kinds = {c: set() for c in empty}
            types = {c: _column_type(k) for c, k in kinds.items()}
            _write(pa, pq, spool, n, tmp, types, columns, get, missing)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise StorageError(f"cannot write the export: {e.strerror}", path=path) from None
        raise
    return n


def _pickled(row: dict[str, Any]) -> bytes:
    """``row`` for the spool: pickled, with room for a payload as deep as ``parse_json``
    reads (pickle stopped at ~500 levels: RecursionError, the export with it)."""
    try:
        return pickle.dumps(row, pickle.HIGHEST_PROTOCOL)
    except RecursionError:
        with deep_room:
            return pickle.dumps(row, pickle.HIGHEST_PROTOCOL)


def _write(pa: Any, pq: Any, spool: IO[bytes], n: int, tmp: str, types: dict[str, str],
           columns: list[str] | None, get: Callable[[dict[str, Any], str], Any],
           missing: object) -> None:
    """The ``n`` rows of ``spool`` into the Parquet file ``tmp``, a row group at a time."""
    arrow = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string(),
             "json": pa.string()}
    schema = pa.schema([(writable(c), arrow[t]) for c, t in types.items()])

    def cell(v: Any, t: str) -> Any:
        if v is missing or v is None:
            return None
        if t == "json":
            return json_text(v)
        if t == "float":
            return float(v)
        if t == "str":
            return writable(v)
        return v

    spool.seek(0)
    load = pickle.Unpickler(spool)
    with pq.ParquetWriter(tmp, schema) as writer:
        left = n
        while True:
            batch = [load.load() for _ in range(min(ROW_GROUP, left))]
            left -= len(batch)
            data = {writable(c): [cell(row.get(c, missing) if columns is None else get(row, c), t)
                                  for row in batch] for c, t in types.items()}
            writer.write_table(pa.table(data, schema=schema))
            if not left:
                break
