"""The journal of earlier releases (``journal.jsonl``): its format, and ``scan``, the reader that
``sqlstore`` imports it with. Nothing writes this format any more.

One record (``records.Record.encode``) per line; the first line is the header
``{"asyncrawl_journal": 1}``. A crash could only tear the last write: ``scan`` stops quietly at
a torn tail; an invalid line *followed by* a valid record is damage (``JournalCorrupt``, with
its offset), never skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from .errors import JournalCorrupt, StorageError
from .records import Record

__all__ = ["FORMAT_VERSION", "HEADER", "JOURNAL", "Record", "scan"]

FORMAT_VERSION = 1
JOURNAL = "journal.jsonl"
HEADER = orjson.dumps({"asyncrawl_journal": FORMAT_VERSION}) + b"\n"


def scan(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(offset, record)`` for every complete record; stop quietly at a torn tail.

    Raises ``JournalCorrupt`` for a bad header, or for an invalid line followed by a valid one.
    """
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    except OSError as e:
        raise StorageError(f"cannot read journal: {e.strerror}", path=path) from None
    with f:
        first = f.readline()
        if not first:
            return
        try:
            header = orjson.loads(first)
        except orjson.JSONDecodeError:
            header = None
        if not first.endswith(b"\n") and header is None:
            return  # torn while writing the header: nothing was recorded yet
        if not isinstance(header, dict) or "asyncrawl_journal" not in header:
            raise JournalCorrupt("not an asyncrawl journal (bad header)", path=path, offset=0)
        if header["asyncrawl_journal"] != FORMAT_VERSION:
            raise StorageError(
                f"journal format {header['asyncrawl_journal']} was written by an incompatible "
                f"asyncrawl version (this one reads format {FORMAT_VERSION}); use a new state "
                "directory or the matching asyncrawl version", path=path)
        offset = len(first)
        bad_at: int | None = None
        for line in f:
            rec = None
            if line.endswith(b"\n"):
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    rec = None
            if isinstance(rec, dict) and "k" in rec:
                if bad_at is not None:
                    raise JournalCorrupt("damaged record inside the journal", path=path,
                                         offset=bad_at)
                yield offset, rec
            elif bad_at is None:
                bad_at = offset
            offset += len(line)
