"""JSON as the API sent it, exactly: read (``parse_json``), written back as text
(``json_text``), and put on one line (``one_line``) without changing a value.

orjson does the work where it is exact. It reads an integer past 64 bits as a float
(10**30 came back 1e+30), and refuses some JSON that RFC 8259 allows: a lone surrogate's
escape (a JavaScript backend that cut a string in an emoji sends one), nesting past 1,024
levels. The stdlib's ``json`` takes over there, strictly UTF-8, with no NaN or Infinity.
Used by the fetch (is a body JSON?), the records (a payload for ``on_result``) and the
exports (jsonl lines, CSV and Parquet cells).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
from typing import Any

import orjson

# a number of 19 digits or more, which orjson may not read exactly (below -2**63 too): one
# after what can come before a number in JSON (not inside a string, mostly: an id_str)
LONG_DIGITS = re.compile(rb"(?:^|[:,\[])\s*-?\d{19}")
MAX_DEPTH = 4000  # JSON nesting the stdlib may go to here, past orjson's 1,024 (3.12: ~1,500)


def parse_json(raw: bytes) -> Any:
    """A JSON body's value, exactly (see the module's docstring). ``ValueError`` for no
    JSON: NaN and Infinity, bytes that are no UTF-8, nesting past ~``MAX_DEPTH`` levels."""
    if not LONG_DIGITS.search(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        text = raw.decode()  # (UTF-8, strictly: the stdlib's would take UTF-16 and -32 too)
        with _room:
            return json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ValueError("JSON that is no UTF-8") from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than ~{MAX_DEPTH} levels") from None


def json_text(value: Any) -> str:
    """``value`` as compact JSON text, whatever orjson refuses of what ``parse_json`` reads:
    an integer past 64 bits, nesting past 254 levels, a lone surrogate (escaped then)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        pass
    with _room:  # (a payload nested ~1,000 deep: its CSV and Parquet cells crashed the export)
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        try:
            text.encode()
        except UnicodeEncodeError:  # (a lone surrogate: as JSON escapes it, not unwritable)
            text = json.dumps(value, separators=(",", ":"))
        return text


def writable(text: str) -> str:
    """``text`` as UTF-8 can hold it: a lone surrogate (a JSON string's ``\\ud83d`` escape, which
    ``parse_json`` keeps) spelt as that escape, where writing it stopped a CSV or Parquet
    export (UnicodeEncodeError)."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def one_line(raw: bytes) -> bytes:
    """Valid JSON on one line: its line breaks are whitespace (a string holds them escaped)."""
    if b"\n" in raw or b"\r" in raw:
        return raw.replace(b"\r", b" ").replace(b"\n", b" ")
    return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON")


class _Room(contextlib.AbstractContextManager["_Room"]):
    """Room for the stdlib's JSON parser and encoder, which recurse once a level, to go
    ``MAX_DEPTH`` levels deep beyond the caller's own frames. The recursion limit is the
    process's: raised by the first thread in, set back by the last one out (two threads that
    each set back what they found could leave it raised, or lower it under the other)."""

    def __init__(self, limit: int = MAX_DEPTH + 1000) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._inside = 0
        self._found = 0

    def __enter__(self) -> _Room:
        with self._lock:
            if not self._inside:
                self._found = sys.getrecursionlimit()
                sys.setrecursionlimit(max(self._found, self._limit))
            self._inside += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                sys.setrecursionlimit(self._found)


_room = _Room()
# what ``pickle`` needs to write a payload that deep (two of its calls a level): ``parquet``'s
# spool, one thread's (a run's threads never export)
deep_room = _Room(2 * MAX_DEPTH + 1000)
