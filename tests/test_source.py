"""source.py: IDs files (BOM, CRLF, blanks, whitespace, bad lines named by file and line) and
library iterables."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrawl import InputError
from asyncrawl.config import MAX_ID_LENGTH
from asyncrawl.source import file_ids, iter_ids, parse_block, parse_line, prescan_file


async def collect(it: AsyncIterator[str]) -> list[str]:
    return [x async for x in it]


def ids_file(tmp_path: Path, data: bytes) -> str:
    p = tmp_path / "ids.txt"
    p.write_bytes(data)
    return str(p)


async def both(path: str) -> tuple[int, list[str]]:
    """What prescan counts and what file_ids streams, for one file."""
    return prescan_file(path), await collect(file_ids(path))


# -- valid files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"a\nb\nc\n", ["a", "b", "c"]),
        (b"a\nb\nc", ["a", "b", "c"]),  # no trailing newline
        (b"\n\na\n\n\nb\n\n", ["a", "b"]),  # blank lines
        (b"  a  \n\tb\t\n   \n", ["a", "b"]),  # surrounding whitespace; whitespace-only line
        (b"\xef\xbb\xbfa\nb\n", ["a", "b"]),  # BOM
        (b"\xef\xbb\xbf\na\n", ["a"]),  # BOM on a blank first line
        (b"a\r\nb\r\nc\r\n", ["a", "b", "c"]),  # CRLF
        (b"\xef\xbb\xbf a \r\n\r\n b\r\nc", ["a", "b", "c"]),  # all at once
        (b"a\na\nb\na\n", ["a", "a", "b", "a"]),  # duplicates are kept: dedup is the crawler's job
        (b"sp ace\n\xc3\xbcn\xc3\xaf\n", ["sp ace", "ünï"]),  # inner space and UTF-8 are kept
        (b"", []),
        (b"\n\n\n", []),
        (b"\xef\xbb\xbf", []),
        # two files joined (cat a.txt b.txt): the second's BOM starts a line (it was kept in
        # the ID: "\ufeffb" fetched and exported)
        (b"\xef\xbb\xbfa\n\xef\xbb\xbfb\nc\n", ["a", "b", "c"]),
    ],
)
async def test_valid_files(tmp_path: Path, data: bytes, expected: list[str]) -> None:
    path = ids_file(tmp_path, data)
    n, got = await both(path)
    assert got == expected
    assert n == len(expected)


async def test_id_of_exactly_max_length_is_accepted(tmp_path: Path) -> None:
    long_id = "é" * MAX_ID_LENGTH  # the limit is in characters, not bytes
    path = ids_file(tmp_path, f"a\n{long_id}\nb\n".encode())
    assert await both(path) == (3, ["a", long_id, "b"])


async def test_many_lines_across_chunks(tmp_path: Path) -> None:
    ids = [f"id-{i:07d}" for i in range(120_000)]  # > 1 MiB: several read chunks
    path = ids_file(tmp_path, "".join(f"{i}\r\n" for i in ids).encode())
    n, got = await both(path)
    assert n == len(ids)
    assert got == ids


_id_chars = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters="\ufeff")
_ids = st.text(_id_chars, min_size=1, max_size=30).filter(lambda s: s == s.strip() and s != "")


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(_ids, max_size=20),
    bom=st.booleans(),
    eol=st.sampled_from(["\n", "\r\n"]),
    pad=st.sampled_from(["", " ", "\t", "  \t "]),
    blank_every=st.integers(0, 4),
    trailing=st.booleans(),
)
def test_roundtrip_any_ids(ids: list[str], bom: bool, eol: str, pad: str, blank_every: int,
                           trailing: bool) -> None:
    lines = []
    for i, item in enumerate(ids):
        if blank_every and i % blank_every == 0:
            lines.append(pad)
        lines.append(f"{pad}{item}{pad}")
    text = eol.join(lines) + (eol if trailing else "")
    data = (b"\xef\xbb\xbf" if bom else b"") + text.encode()
    with tempfile.TemporaryDirectory() as d:
        path = ids_file(Path(d), data)
        n, got = asyncio.run(both(path))
    assert got == ids
    assert n == len(ids)


def _line_by_line(block: bytes, first: int) -> list[str] | tuple[int | None, str]:
    out = []
    for n, raw in enumerate(block.split(b"\n"), first):
        try:
            item = parse_line(raw, path="f", line=n)
        except InputError as e:
            return e.line, e.message
        if item is not None:
            out.append(item)
    return out


_pieces = st.sampled_from(["a", "id-7", " ", "\t", "\r", "\n", "\n", "\r\n", "\ufeff",
                           "\x00", "\x85", "\u00a0", "\u3000", "\u2028", "ü", "x" * 600])


@settings(max_examples=300, deadline=None)
@given(text=st.lists(_pieces, max_size=40).map("".join), junk=st.sampled_from([b"", b"\xff"]),
       bom=st.booleans(), first=st.sampled_from([1, 2, 57]))
def test_a_block_parses_as_its_lines_do(text: str, junk: bytes, bom: bool, first: int) -> None:
    """``parse_block``'s fast path gives what ``parse_line`` gives line by line: the same IDs,
    or the same error on the same line."""
    block = (b"\xef\xbb\xbf" if bom else b"") + text.encode() + junk
    want = _line_by_line(block, first)
    try:
        got: list[str] | tuple[int | None, str] = parse_block(block, path="f", first=first)
    except InputError as e:
        got = (e.line, e.message)
    assert got == want


# -- invalid files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        b"\xff\xfe",  # not UTF-8 at all
        b"ab\xc3",  # truncated sequence
        b"\xed\xa0\x80",  # an encoded surrogate
        b"\xc0\xaf",  # overlong encoding of "/"
    ],
)
async def test_invalid_utf8_names_line(tmp_path: Path, bad: bytes) -> None:
    path = ids_file(tmp_path, b"a\n\n" + bad + b"\nd\n")  # line 2 is blank: lines are counted raw
    with pytest.raises(InputError) as e:
        prescan_file(path)
    assert e.value.line == 3
    assert e.value.path == path
    assert f"{path}:3" in str(e.value)
    assert "UTF-8" in str(e.value)
    with pytest.raises(InputError) as e2:
        await collect(file_ids(path))
    assert e2.value.line == 3


async def test_invalid_utf8_on_last_line_without_newline(tmp_path: Path) -> None:
    path = ids_file(tmp_path, b"a\nb\n\xff")
    with pytest.raises(InputError) as e:
        prescan_file(path)
    assert e.value.line == 3
    with pytest.raises(InputError) as e2:
        await collect(file_ids(path))
    assert e2.value.line == 3


async def test_line_too_long_names_line(tmp_path: Path) -> None:
    path = ids_file(tmp_path, b"a\nb\n" + b"x" * (MAX_ID_LENGTH + 1) + b"\nc\n")
    with pytest.raises(InputError) as e:
        prescan_file(path)
    assert e.value.line == 3
    assert f"{path}:3" in str(e.value)
    assert str(MAX_ID_LENGTH) in str(e.value)


def test_huge_line_without_newline_fails_on_its_line(tmp_path: Path) -> None:
    path = ids_file(tmp_path, b"a\n" + b"x" * (3 << 20))  # 3 MiB, no newline at all
    with pytest.raises(InputError) as e:
        prescan_file(path)
    assert e.value.line == 2


def _to_the_first_read_s_end(room: int) -> tuple[bytes, int]:
    """Lines that fill the first 1 MiB read of a file but for ``room`` bytes, and their count."""
    from asyncrawl.source import CHUNK

    head = b"".join(b"id%07d\n" % i for i in range((CHUNK - room - 200) // 10))
    head += b"z" * (CHUNK - room - len(head) - 1) + b"\n"
    return head, head.count(b"\n")


async def test_a_long_line_of_blanks_around_an_id_across_a_read_is_valid(tmp_path: Path) -> None:
    """A line may be longer than any ID with the blanks around it: cut by the end of a read
    past 4 KiB, its first part was taken for a whole line (a character cut there: "not valid
    UTF-8"), and each later line was named one too far on."""
    head, n = _to_the_first_read_s_end(4106)
    emoji = "\U0001f600" * MAX_ID_LENGTH
    path = ids_file(tmp_path, head + b" " * 500 + emoji.encode() + b" " * 7000 + b"\ntail\n")
    count, got = await both(path)
    assert count == n + 2 and got[-2:] == [emoji, "tail"]
    path = ids_file(tmp_path, head + b" " * 6000 + b"abc\nok1\nbad\x00x\n")
    with pytest.raises(InputError, match="control character") as e:
        prescan_file(path)
    assert e.value.line == n + 3


@pytest.mark.parametrize("tail", [b"q" * 9000, b"abc" + b" " * 6000 + b"def",
                                  b"\xf0\x9f\x98\x80" * 2000])
def test_an_id_too_long_across_a_read_is_named_on_its_line(tmp_path: Path, tail: bytes) -> None:
    head, n = _to_the_first_read_s_end(4106)
    path = ids_file(tmp_path, head + tail + b"\nok\n")
    with pytest.raises(InputError, match="characters long") as e:
        prescan_file(path)
    assert e.value.line == n + 1


def test_stdin_names_the_line_of_a_bad_byte_after_a_character_cut_by_a_read(
        tmp_path: Path) -> None:
    """``--ids -`` counted the lines up to a bad byte from the start of the bytes the decoder
    held over from the read before: a line too far."""
    import subprocess
    import sys

    head, n = _to_the_first_read_s_end(2)
    data = head + "\u20ac".encode() + b"\n\xff\n"  # (the euro sign: cut by the first read)
    r = subprocess.run([sys.executable, "-m", "asyncrawl", "run", "--url",
                        "http://127.0.0.1:9/{id}", "--ids", "-", "--state",
                        str(tmp_path / "state"), "--dry-run"], input=data, capture_output=True,
                       cwd=tmp_path, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and f"<stdin>:{n + 2}: not valid UTF-8" in err, err


@pytest.mark.parametrize("item", [b"a\x00b", b"\x00", b"a\x07b", b"a\x1bb", b"a\rb", b"a\xc2\x85b"])
async def test_control_character_names_line(tmp_path: Path, item: bytes) -> None:
    path = ids_file(tmp_path, b"ok\n" + item + b"\n")
    with pytest.raises(InputError) as e:
        prescan_file(path)
    assert e.value.line == 2
    assert "control character" in str(e.value)
    with pytest.raises(InputError, match="control character"):
        await collect(file_ids(path))


async def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.txt")
    with pytest.raises(InputError, match="not found") as e:
        prescan_file(path)
    assert path in str(e.value)
    with pytest.raises(InputError) as e2:
        await collect(file_ids(path))
    assert path in str(e2.value)


async def test_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="directory") as e:
        prescan_file(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    with pytest.raises(InputError):
        await collect(file_ids(str(tmp_path)))


# -- iterables -----------------------------------------------------------------------------------


async def agen(items: Iterable[object]) -> AsyncIterator[object]:
    for item in items:
        await asyncio.sleep(0)
        yield item


async def test_iter_ids_sync_and_async() -> None:
    items = ["a", "b", "a", "ünï", "x/y"]
    assert await collect(iter_ids(items)) == items
    assert await collect(iter_ids(iter(items))) == items
    assert await collect(iter_ids(agen(items))) == items  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [5, None, b"bytes", "", "a\x00b", "x" * (MAX_ID_LENGTH + 1), ["a"],
                                 " a", "a ", "\u00a0a"])
@pytest.mark.parametrize("make", [list, agen], ids=["sync", "async"])
async def test_iter_ids_rejects(bad: object, make: object) -> None:
    got: list[str] = []
    with pytest.raises(InputError) as e:
        async for item in iter_ids(make(["a", "b", bad, "c"])):  # type: ignore[operator]
            got.append(item)
    assert got == ["a", "b"]  # the good ones before it were yielded, nothing after
    assert e.value.line == 3


async def test_an_async_source_waiting_for_room_is_closed_with_its_chunks() -> None:
    """The task reading an async source ahead, cancelled while it waited for room (1,024
    IDs read and not taken), left the application's generator suspended: its ``finally``
    had not run when the run ended (a review)."""
    from asyncrawl.source import CHUNK_IDS, id_chunks

    closed = []

    async def ids() -> AsyncIterator[str]:
        try:
            for i in range(10 * CHUNK_IDS):
                yield f"x{i}"
        finally:
            closed.append(True)

    chunks = id_chunks(ids())
    assert len(await chunks.__anext__()) == CHUNK_IDS
    for _ in range(50):  # (the reader fills its buffer again, then waits for room)
        await asyncio.sleep(0)
    await chunks.aclose()
    assert closed == [True]


@pytest.mark.parametrize(("added", "read"), [(b"\nc\n", ["a", "b"]), (b"c\nd\n", ["a"]),
                                             (b"", ["a", "b"]), (b"\r\nc\r\n", ["a", "b"])])
async def test_a_run_reads_the_file_as_it_was_when_it_began(
        tmp_path: Path, added: bytes, read: list[str]) -> None:
    """Up to the size the file had (``end``): its last line whole if the file ended there or
    went on with its line end (``b`` was dropped when ``\\nc\\n`` was appended), and left to the
    next run if it went on (``bc``: a line still being written)."""
    from asyncrawl.source import IdsFile

    path = ids_file(tmp_path, b"a\nb" + added)  # (3 bytes when the run began)
    got = [item async for chunk, _ in IdsFile(path).marked_chunks(0, 0, 3) for item in chunk]
    assert got == read
