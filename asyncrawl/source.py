"""[1] Where IDs come from: a file (streamed in chunks), or any iterable / async iterable.

An IDs file is UTF-8 text, one ID per line. A BOM, CRLF line ends, surrounding whitespace and
blank lines are ignored. A line that is not UTF-8, holds a control character (e.g. NUL) or is
longer than ``MAX_ID_LENGTH`` is an ``InputError`` naming the file and line. ``prescan_file``
checks the whole file (and counts it, for the ETA) before any request is sent; ``file_ids`` then
streams it, so memory does not grow with the file, up to the size it had when the run began.
The crawler takes IDs a chunk (list) at a time. IDs from an iterable are taken as given, but
checked alike; one with whitespace around it is an ``InputError`` too (a file strips it).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import sqlite3
import stat
import tempfile
import unicodedata
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import aiofiles
import orjson

from .config import MAX_ID_LENGTH
from .errors import InputError

CHUNK = 1 << 20  # bytes read from an IDs file at a time
CHUNK_IDS = 1024  # IDs handed on at a time
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
    if raw.startswith(BOM):  # (the file's, or a file's joined on: cat a.txt b.txt)
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


def parse_block(block: bytes, *, path: str, first: int) -> list[str]:
    """The IDs on a block of whole lines joined by ``\\n``, the first of them line ``first`` of
    the file (blank lines dropped), or ``InputError`` naming the first bad line: ``parse_line``
    on each line, a block at a time. The common block (UTF-8, no control character, no ID too
    long) is decoded, split and checked in a few calls that loop in C; any other goes line by
    line, which finds the bad line and says what is wrong with it."""
    text = None
    with contextlib.suppress(UnicodeDecodeError):
        text = (block[3:] if first == 1 and block.startswith(BOM) else block).decode("utf-8")
    if text is not None:
        if "\r" in text:  # CRLF line ends
            text = text.replace("\r\n", "\n")
        if text.replace("\n", "").isprintable():  # (spaces are the only whitespace left)
            lines = text.split("\n")
            items = ([item for item in map(str.strip, lines) if item] if " " in text
                     else list(filter(None, lines)))
            if max(map(len, items), default=0) <= MAX_ID_LENGTH:
                return items
    return [item for n, raw in enumerate(block.split(b"\n"), first)
            if (item := parse_line(raw, path=path, line=n)) is not None]


def _cut(data: bytes) -> tuple[bytes | None, bytes]:
    """``data`` cut after its last newline: its whole lines (``None``: none) and the rest."""
    end = data.rfind(b"\n")
    return (data[:end], data[end + 1:]) if end >= 0 else (None, data)


def _raw_blocks(path: str) -> Iterator[bytes]:
    """The whole lines of a file (``parse_block``'s blocks), about ``CHUNK`` bytes at a time:
    bounded memory even for a file with no newline."""
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
        line = 0  # lines yielded
        while True:
            try:
                chunk = f.read(CHUNK)
            except OSError as e:
                raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
            if not chunk:
                break
            block, rest = _cut(rest + chunk)
            if block is not None:
                yield block
                line += block.count(b"\n") + 1
            if len(rest) > LONGEST:  # a line longer than any ID's, unless it is mostly blanks
                rest = _unbuffered(rest, path=path, line=line + 1)
        if rest:
            yield rest


LONGEST = 4 * MAX_ID_LENGTH + 8  # bytes of the longest ID (4 a character), a BOM and a CR


def _unbuffered(rest: bytes, *, path: str, line: int) -> bytes:
    """The start of line ``line`` read so far (``rest``, longer than ``LONGEST``), as little
    of it as tells what it holds: ``InputError`` once its ID is longer than any can be (not
    held in memory whole: a file with no newline), else the ID with the blanks around it cut
    to what still says so (blanks before an ID are nothing; after it, as many as would make
    the line too long if more of its ID came). A valid line may be long with its blanks, a
    cut through a character is no invalid UTF-8, and the lines before keep their numbers."""
    core = rest.lstrip(b" \t")
    body = core.rstrip(b" \t")
    if len(body) <= LONGEST:
        return body + b" " * min(len(core) - len(body), MAX_ID_LENGTH + 1)
    try:  # (a character cut at the end of what was read is no error yet)
        codecs.getincrementaldecoder("utf-8")().decode(body)
    except UnicodeDecodeError:
        parse_line(body, path=path, line=line)  # (names the byte)
        raise
    # (at 4 bytes a character at most, more than MAX_ID_LENGTH characters: parse_line's first
    # complaint too, before any control character)
    raise InputError(f"ID is more than {MAX_ID_LENGTH} characters long; the limit is "
                     f"{MAX_ID_LENGTH}", path=path, line=line)


def prescan_file(path: str) -> int:
    """Validate every line of an IDs file; return the number of non-blank lines."""
    if os.path.isdir(path):
        raise InputError("is a directory, not an IDs file", path=path)
    if is_stream(path):
        raise InputError("is a pipe, not a file: the IDs file is read more than once (the "
                         "command line copies a pipe's IDs first: --ids PATH or --ids -)",
                         path=path)
    n = line = 0
    for block in _raw_blocks(path):
        n += len(parse_block(block, path=path, first=line + 1))
        line += block.count(b"\n") + 1
    return n


def is_stream(path: str) -> bool:
    """Whether ``path`` is a pipe or another file that can be read only once (``--ids
    <(command)``, a FIFO), rather than a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # (a missing file is reported where it is opened)
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def file_identity(path: str) -> dict[str, Any]:
    """What tells one IDs file from another, or from itself after a change: its real path,
    size, modification and change times, and inode. A resumed job may skip the part of the file
    its state has covered only while this is unchanged. (The change time, which no one can set:
    a file rewritten in place at the same size, its modification time set back with `touch -r`,
    was taken for unchanged, and its new IDs skipped.)"""
    try:
        st = os.stat(path)
    except OSError as e:  # gone or changed since it was checked
        raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


class IdsFile:
    """The IDs of a file (already checked by ``prescan_file``), streamed without blocking the
    loop: an async iterable of IDs, and ``chunks()``, the same IDs a list at a time.
    ``lines``: its number of IDs, if known (``prescan_file``'s count)."""

    __slots__ = ("lines", "path")

    def __init__(self, path: str, lines: int | None = None) -> None:
        self.path = path
        self.lines = lines

    def __repr__(self) -> str:
        return f"IdsFile({self.path!r})"

    def __aiter__(self) -> AsyncIterator[str]:
        return _flatten(self.chunks())

    def chunks(self) -> AsyncIterator[list[str]]:
        return _drop_marks(_file_chunks(self.path))

    def marked_chunks(self, start: int = 0, line: int = 0, end: int | None = None
                      ) -> AsyncIterator[tuple[list[str], tuple[int, int] | None]]:
        """``(chunk, mark)`` from byte ``start`` (the start of line ``line`` + 1) on, up to
        byte ``end`` (the file's size when the run began: lines added meanwhile, unchecked,
        are the next run's, and a line cut there is left whole to it): ``mark`` is ``(offset,
        line)`` just after the chunk when the chunk ends a block read from the file (about
        1 MB), else ``None``: where a later run may resume reading."""
        return _file_chunks(self.path, start, line, end)


def file_ids(path: str) -> IdsFile:
    """Stream the IDs of a file (already checked by ``prescan_file``)."""
    return IdsFile(path)


async def _drop_marks(chunks: AsyncIterator[tuple[list[str], Any]]) -> AsyncIterator[list[str]]:
    async for chunk, _ in chunks:
        if chunk:
            yield chunk


async def _file_chunks(path: str, start: int = 0, line: int = 0, end: int | None = None
                       ) -> AsyncIterator[tuple[list[str], tuple[int, int] | None]]:
    try:
        opened = aiofiles.open(path, "rb")
        f = await opened.__aenter__()
    except OSError as e:
        raise InputError(f"cannot read IDs file: {e.strerror}", path=path) from None
    try:
        if start:
            await f.seek(start)
        rest = b""
        offset = start  # of the first byte not yet split into lines
        while True:
            chunk = await f.read(CHUNK if end is None else min(CHUNK, end - offset))
            if not chunk:
                break
            block, rest = _cut(rest + chunk)
            offset += len(chunk)
            items: list[str] = []
            if block is not None:
                items = parse_block(block, path=path, first=line + 1)
                line += block.count(b"\n") + 1
            mark = (offset - len(rest), line)  # just after the block's last complete line
            parts = [items[i:i + CHUNK_IDS] for i in range(0, len(items), CHUNK_IDS)] or [[]]
            for i, part in enumerate(parts):
                yield part, mark if i == len(parts) - 1 else None
        # the last line: whole where the file ends there, or goes on with its line end (else it
        # is a line cut by ``end``, being written: left whole to the next run)
        if rest and (end is None or offset < end or await f.read(1) in (b"", b"\n", b"\r")):
            item = parse_line(rest, path=path, line=line + 1)
            yield ([item] if item is not None else []), None
    finally:
        await opened.__aexit__(None, None, None)


async def id_chunks(ids: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[list[str]]:
    """IDs from a library caller's iterable or async iterable, each checked, a list at a time
    (the IDs before a bad one are handed on before its ``InputError``). An async iterable
    is read as it yields: what has come is handed on whenever it is waited for (up to
    ``CHUNK_IDS`` at a time), so that a slow source (a queue fed over time) is crawled as
    its IDs come, not once a whole list of them has."""
    n = 0
    chunk: list[str] = []
    try:
        if isinstance(ids, AsyncIterable):
            async with contextlib.aclosing(_as_they_come(ids)) as lists:
                async for got in lists:
                    for item in got:
                        n += 1
                        chunk.append(_check(item, n))
                    yield chunk
                    chunk = []
        else:
            for item in ids:
                n += 1
                chunk.append(_check(item, n))
                if len(chunk) >= CHUNK_IDS:
                    yield chunk
                    chunk = []
    except Exception:  # (the IDs before what the source raised go on first, as a file's do)
        if chunk:
            yield chunk
        raise
    except BaseException as e:
        if not _raised_by_source(e):
            raise
        if chunk:
            yield chunk
        raise InputError("the ID source raised CancelledError, though nothing cancelled the "
                         f"run, after {n} IDs", line=n + 1) from e
    if chunk:
        yield chunk


def _raised_by_source(e: BaseException) -> bool:
    """Whether ``e`` is a ``CancelledError`` the ID source raised of itself (an iterator that
    ends that way), not the cancellation of the task reading it. Let through, it would end
    that task as if cancelled by its owner, and the run would wait for it for ever."""
    import asyncio

    task = asyncio.current_task() if isinstance(e, asyncio.CancelledError) else None
    return task is not None and not task.cancelling()


async def _as_they_come(ids: AsyncIterable[str]) -> AsyncGenerator[list[str], None]:
    """The items of ``ids``, in lists of what has come by the time the list is asked for
    (at least one, at most ``CHUNK_IDS``): a task of its own reads ``ids`` ahead by up to
    that many; what ``ids`` raises is raised after the items before it."""
    import asyncio  # (here: ``status`` and ``export`` import this module, not asyncio)

    buf: list[str] = []
    came = asyncio.Event()  # buf has items, or the source has ended
    room = asyncio.Event()  # buf has room
    room.set()
    end: list[BaseException | None] = []  # the source's end: None, or what it raised

    async def read() -> None:
        it = None
        try:
            it = aiter(ids)
            async for item in it:
                buf.append(item)
                came.set()
                if len(buf) >= CHUNK_IDS:
                    room.clear()
                    await room.wait()
            end.append(None)
        except BaseException as e:  # (handed on to the reader of the lists)
            end.append(e)
        finally:
            came.set()
            # closed here too: cancelled while it waits for room, the application's iterator
            # is left suspended at its yield, its ``finally`` not run (an async generator)
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):  # (its error on closing: not the run's)
                    await aclose()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            if not buf and not end:
                came.clear()
                await came.wait()
            if buf:
                got = buf[:]
                buf.clear()
                room.set()
                yield got
            elif end:
                if end[0] is not None:
                    raise end[0]
                return
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


def iter_ids(ids: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    """IDs from a library caller's iterable or async iterable, each checked."""
    return _flatten(id_chunks(ids))


async def _flatten(chunks: AsyncIterator[list[str]]) -> AsyncIterator[str]:
    async for chunk in chunks:
        for item in chunk:
            yield item


def _check(item: object, n: int) -> str:
    if not isinstance(item, str) or not item:
        raise InputError(f"ID must be a non-empty str, got {type(item).__name__} {item!r:.40}",
                         path="<ids>", line=n)
    problem = _problem(item)
    if problem:
        raise InputError(problem, path="<ids>", line=n)
    # (an IDs file strips it: the same ID read back from one, an export's, would be another)
    if item[0].isspace() or item[-1].isspace():
        raise InputError(f"ID {item!r:.40} starts or ends with whitespace (an IDs file "
                         "strips it): strip it, or give the ID as the API spells it",
                         path="<ids>", line=n)
    return item if type(item) is str else str.__str__(item)  # (a StrEnum's: the plain text)


class SeenIds:
    """The IDs seen so far, on disk: a temporary SQLite file (deleted as soon as it is open),
    so that dedup without a state (``run --dry-run``) keeps memory flat however long the
    list. ``fresh(chunk)``: the IDs of the chunk not seen before, in order, each once."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="asyncrawl-seen-", suffix=".db")
        os.close(fd)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False)
        finally:
            os.unlink(path)  # the open connection keeps the file; nothing is left behind
        self._db.execute("PRAGMA journal_mode = OFF")  # scratch data: no journal, no fsync
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.execute("PRAGMA cache_size = -4000")  # 4 MB
        self._db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY) WITHOUT ROWID")

    def fresh(self, chunk: list[str]) -> list[str]:
        new = {row[0] for row in self._db.execute(
            "INSERT INTO seen (id) SELECT value FROM json_each(?) WHERE true "
            "ON CONFLICT DO NOTHING RETURNING id", (orjson.dumps(chunk).decode(),))}
        out: list[str] = []
        for item in chunk:
            if item in new:
                new.discard(item)  # (a repeat within the chunk: once)
                out.append(item)
        return out

    def close(self) -> None:
        self._db.close()
