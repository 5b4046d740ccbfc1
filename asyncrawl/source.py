"""[1] Where IDs come from: a file (streamed in chunks), or any iterable / async iterable.

An IDs file is UTF-8 text, one ID per line. A BOM, CRLF line ends, surrounding whitespace and
blank lines are ignored. A line that is not UTF-8, holds a control character (e.g. NUL) or is
longer than ``MAX_ID_LENGTH`` is an ``InputError`` naming the file and line. ``prescan_file``
checks the whole file (and counts it, for the ETA) before any request is sent; ``file_ids`` then
streams it, so memory does not grow with the file.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

import aiofiles

from .config import MAX_ID_LENGTH
from .errors import InputError

CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"


def _problem(item: str) -> str | None:
    if len(item) > MAX_ID_LENGTH:
        return f"ID is {len(item)} characters long; the limit is {MAX_ID_LENGTH}"
    if not item.isprintable():
        for ch in item:
            if unicodedata.category(ch) in ("Cc", "Cs") or ch == "\x00":
                return f"ID contains the control character U+{ord(ch):04X}"
    return None


def parse_line(raw: bytes, *, path: str, line: int) -> str | None:
    """The ID on one raw line (``None`` if blank), or ``InputError``."""
    if line == 1 and raw.startswith(BOM):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"not valid UTF-8 (byte {e.start + 1} of the line)", path=path,
                         line=line) from None
    item = text.strip()
    if not item:
        return None
    problem = _problem(item)
    if problem:
        raise InputError(problem, path=path, line=line)
    return item


def _raw_lines(path: str) -> Iterator[bytes]:
    """Raw lines of a file, read in chunks (bounded memory even for a file with no newline)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except IsADirectoryError:
        raise InputError("is a directory, not an IDs file", path=path) from None
    except FileNotFoundError:
        raise InputError("IDs file not found", path=path) from None
    except OSError as e:
        raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
    with f:
        rest = b""
        while True:
            try:
                chunk = f.read(CHUNK)
            except OSError as e:
                raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            if len(rest) > 4 * MAX_ID_LENGTH + 8:  # a monster line: fail fast, do not buffer it
                lines.append(rest)
                rest = b""
            yield from lines
        if rest:
            yield rest


def prescan_file(path: str) -> int:
    """Validate every line of an IDs file; return the number of non-blank lines."""
    if os.path.isdir(path):
        raise InputError("is a directory, not an IDs file", path=path)
    n = 0
    for i, raw in enumerate(_raw_lines(path), 1):
        if parse_line(raw, path=path, line=i) is not None:
            n += 1
    return n


async def file_ids(path: str) -> AsyncIterator[str]:
    """Stream the IDs of a file (already checked by ``prescan_file``) without blocking the loop."""
    try:
        opened = aiofiles.open(path, "rb")
        f = await opened.__aenter__()
    except OSError as e:
        raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
    try:
        rest = b""
        line = 0
        while True:
            chunk = await f.read(CHUNK)
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                line += 1
                item = parse_line(raw, path=path, line=line)
                if item is not None:
                    yield item
        if rest:
            item = parse_line(rest, path=path, line=line + 1)
            if item is not None:
                yield item
    finally:
        await opened.__aexit__(None, None, None)


async def iter_ids(ids: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    """IDs from a library caller's iterable or async iterable, each checked."""
    n = 0
    if isinstance(ids, AsyncIterable):
        async for item in ids:
            n += 1
            yield _check(item, n)
    else:
        for item in ids:
            n += 1
            yield _check(item, n)


def _check(item: object, n: int) -> str:
    if not isinstance(item, str) or not item:
        raise InputError(f"ID must be a non-empty str, got {type(item).__name__} {item!r:.40}",
                         path="<ids>", line=n)
    problem = _problem(item)
    if problem:
        raise InputError(problem, path="<ids>", line=n)
    return item
