"""Reading a job's state without taking its lock: ``status`` figures and ``export`` streams.

Both read through the store's interface (``store.read_store``): ``status`` from its
``snapshot()``, ``export`` from its ``records()``, ``payloads()``, ``ids()``, ``in_doubt()``
and ``unanswered()`` streams, so a run may be going meanwhile. Exports stream: memory never
holds the payloads (Parquet spools them to a file, ``parquet.py``).
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from .config import Config, endpoint_of, is_url
from .errors import ConfigError, StorageError, temp_beside
from .jsontext import json_text, one_line, writable
from .live import live_age, read_live
from .progress import halt_text
from .records import EXPORT_FORMATS, EXPORT_OUTCOMES, Record
from .store import STATE_FILES, read_store
from .types import Halt

__all__ = ["export", "status", "status_text"]
log = logging.getLogger("asyncrawl")

STALE_LIVE = 5.0  # seconds after which a running job's live figures are said to be old


def status(config: Config, *, endpoint: str | None = "") -> dict[str, Any]:
    """The figures ``asyncrawl status`` prints (the ``--json`` object).

    The billing ledger counts billable (2xx) calls by the UTC date of their record and by
    endpoint, both as recorded with each call (state imported from a journal that did not
    record its endpoint: the state's job's, else one derived from ``config.url``;
    ``endpoint=None``: unknown, e.g. no config was given; a string: that endpoint).
    ``not_billed`` counts the calls answered without a 2xx (error answers), from the store's
    note written before each send: the calls sent, minus the billable ones, minus those whose
    answer is not known (``no_answer``: sent when a run was cut off, timed out after the
    connect or cut by a dropped connection, or in flight; possibly billed).
    """
    store = read_store(config.state, job=config.job)
    snap = store.snapshot()
    billable = snap.billable
    if snap.job is not None:  # what the state says it fetched, not what today's config says
        endpoint = endpoint_of(snap.job["url"])
    elif endpoint == "":
        endpoint = config.redact(endpoint_of(config.url))
    price = config.price_per_call
    ledger = []
    for day, recorded, n in snap.ledger:
        row: dict[str, Any] = {"date": day, "endpoint": recorded or endpoint, "billable": n}
        if price is not None:
            row["cost"] = round(n * price, 6)
        ledger.append(row)
    # calls per API key ([request] keys), by the key's fingerprint
    keys = [{"date": day, "key": key, "sent": n_sent, "billable": n_billable}
            for day, key, n_sent, n_billable in snap.keys]
    halt = None
    if snap.halt is not None:
        halt = {"status": snap.halt.status, "message": config.redact(snap.halt.message),
                "reason": snap.halt.reason}
    out: dict[str, Any] = {
        **snap.counts.as_dict(),
        "halt": halt,
        "last_run_cut_short": snap.cut_short,
        "billable": billable,
        "billable_by_date": dict(snap.billable_by_day),
        "ledger": ledger,
        "keys": keys,
        "requests_sent": snap.sent,
        "not_billed": max(0, snap.sent - billable - snap.unsure_calls) if snap.sent else None,
        "no_answer": snap.unsure_calls,
        "in_doubt": snap.in_doubt,
        "possibly_billed_twice": snap.billed_twice,
        "unanswered": snap.unanswered,
        "unanswered_refetched": snap.unanswered_refetched,
        "in_flight": snap.in_flight,
        "running": snap.running,  # a shared job: how many processes work on it
        "shared": config.state_url is not None,
        "runs": snap.runs,
        "state_dir": config.state_shown,
    }
    if snap.running is not None and config.state_url is None:
        live = out["live"] = read_live(Path(config.state_dir))
        if live is not None and "ts" in live:  # (how old its figures are)
            live["age_s"] = round(live_age(live), 1)
            live.pop("mono", None)
    if is_url(config.state):  # a shared job: each working process's progress
        from .pgstore import PgStore

        assert isinstance(store, PgStore)
        out["live_runs"] = store.live()
    if price is not None:
        out["cost"] = round(billable * price, 6)
        out["currency"] = config.currency
        out["price_per_call"] = price
    return out


def status_text(s: dict[str, Any]) -> str:
    cur = f" {s['currency']}" if "cost" in s else ""
    lines = [
        f"state        {s['state_dir']}",
        f"ok           {s['ok']:,}",
        f"failed       {s['failed']:,}  (retried by the next run)",
        f"unavailable  {s['unavailable']:,}  (confirmed after two passes)",
        f"billable     {s['billable']:,} calls"
        + (f" = {s['cost']:,.4f}{cur} at {s['price_per_call']:g} per call" if "cost" in s else "")
        + "  (2xx answers: what the provider bills)",
    ]
    for row in s["ledger"]:
        where = row["endpoint"] or "(endpoint: pass -c CONFIG)"
        cost = f" = {row['cost']:,.4f}{cur}" if "cost" in row else ""
        lines.append(f"  {row['date']} UTC  {where}  {row['billable']:,}{cost}")
    for row in s.get("keys", ()):
        lines.append(f"  {row['date']} UTC  key {row['key']}  {row['billable']:,} billable of "
                     f"{row['sent']:,} calls sent")
    if s["not_billed"] is not None:
        lines.append(f"not billed   {s['not_billed']:,} calls  (error answers; "
                     f"{s['requests_sent']:,} calls sent in all, {s['no_answer']:,} with no answer "
                     "known: possibly billed)")
    if s.get("last_run_cut_short") and s.get("halt") is None:
        lines.append("last run     ended without its end record: killed, or its state could not "
                     "be written (a full disk: the run said so, exit 5); a rerun resumes")
    if s["in_doubt"] or s["possibly_billed_twice"]:
        lines.append(f"in doubt     {s['in_doubt']:,} sent when a run was cut off, no result kept "
                     f"(possibly billed), and {s['possibly_billed_twice']:,} more fetched again "
                     "since (possibly billed twice): asyncrawl export --outcome in-doubt")
    if s.get("unanswered") or s.get("unanswered_refetched"):
        lines.append(f"unanswered   {s['unanswered']:,} sent with no answer (a timeout after "
                     "the connect, a dropped connection: possibly billed), and "
                     f"{s['unanswered_refetched']:,} more fetched since (possibly billed twice): "
                     "asyncrawl export --outcome unanswered")
    if s["running"] is not None:
        who = (f"{s['running']} process{'es' if s['running'] != 1 else ''}"
               if s.get("shared") else f"pid {s['running']}")
        lines.append(f"running      yes ({who}), {s['in_flight']:,} IDs sent and not settled yet")
        live = s.get("live")
        if live:
            gov = (f"rate limit {live['effective_rate']:,.1f}/{live['configured_rate']:,.0f} req/s, "
                   f"sending {live['rate']:,.1f} req/s, pass {live['pass_no']}")
            if live["paused_for"] > 0:
                gov += f", paused {live['paused_for']:.0f}s (Retry-After)"
            gov += ", breaker OPEN (upstream down, probing)" if live["breaker_open"] else ", breaker closed"
            age = live.get("age_s", 0.0)
            if age >= STALE_LIVE:  # (written every second: a run frozen, or its loop blocked)
                gov += f" (as of {age:,.0f} s ago: the run has not said more since)"
            lines.append(f"governor     {gov}")
        for r in s.get("live_runs", ()):
            if "pass_no" not in r:
                continue  # no progress published yet
            lines.append(f"  process {r['host']}:{r['pid']}  pass {r['pass_no']}, "
                         f"{r['ok']:,} ok, sending {r['rate']:,.1f} req/s (limit "
                         f"{r['effective_rate']:,.1f}), {r['in_flight']} in flight")
    if s["halt"]:
        h = s["halt"]
        what, then = halt_text(Halt(h["reason"] or "fatal", h["status"], h["message"]))
        lines.append(f"last run     halted: {what} — {then}")
    return "\n".join(lines)


# the outcomes that are lists of IDs the store streams as (id, refetched): its method for each
_ID_LISTS = {"in-doubt": "in_doubt", "unanswered": "unanswered"}


def _records(config: Config, outcome: str) -> Iterator[dict[str, Any]]:
    """The rows to export, streamed from the store (opened now: a wrong --state fails here)."""
    store = read_store(config.state, job=config.job)
    if outcome in _ID_LISTS:
        pairs = getattr(store, _ID_LISTS[outcome])()
        return ({"id": item, "refetched": twice} for item, twice in pairs)
    return (_plain(rec, outcome) for rec in store.records(outcome))


def _plain(rec: Record, outcome: str) -> dict[str, Any]:
    """An exported record as JSON lines and CSV see it: ``id`` and ``data`` (ok), or ``id``,
    ``status``, ``error``."""
    if outcome == "ok":
        return {"id": rec.id, "data": rec.payload}
    return {"id": rec.id, "status": rec.status, "error": rec.error}


def export(config: Config, *, outcome: str = "ok", fmt: str = "jsonl",
           fields: list[str] | None = None, out: TextIO | None = None,
           path: str | None = None) -> int:
    """Write the records of ``outcome`` to ``out`` or (atomically) to ``path``; return the count."""
    if outcome not in EXPORT_OUTCOMES:
        raise ConfigError(f"--outcome must be one of {', '.join(EXPORT_OUTCOMES)}")
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(EXPORT_FORMATS)}")
    if fields:
        if fmt not in ("csv", "parquet"):
            raise ConfigError(f"--fields chooses the columns of --format csv or parquet; "
                              f"--format {fmt} has none to choose")
        if "id" not in fields:  # a row without its ID is no use: id first, unless placed
            fields = ["id", *fields]
    if path is not None and not is_url(config.state):
        _not_the_state(Path(config.state_dir), path)
    if fmt == "parquet":
        if path is None:
            raise ConfigError("--format parquet writes a file: give -o FILE (e.g. -o notes.parquet)")
        from .parquet import check, write_parquet

        check()

        target, special = _output(path)
        if special:  # (pyarrow seeks in what it writes)
            raise ConfigError(f"--format parquet writes a regular file; {path} is not one",
                              key="--output")
        rows: Iterator[dict[str, Any]] = (_row(rec, outcome) for rec in _records(config, outcome))
        if fields:  # a misspelt field is an error, not an empty column
            rows = _check_fields(rows, fields, lambda row: row)
        return write_parquet(rows, target, fields, _get, _MISSING,
                             empty=_COLUMNS.get(outcome, ["id"]))
    if fmt == "ids" and outcome not in _ID_LISTS:
        blocks = read_store(config.state, job=config.job).ids(outcome)
        return _emit(lambda f: _write_ids(blocks, f), out, path)
    if fmt == "jsonl" and outcome == "ok":
        payloads = read_store(config.state, job=config.job).payloads()
        return _emit(lambda f: _write_ok_jsonl(payloads, f), out, path)
    records = _records(config, outcome)
    return _emit(lambda f: _write(records, outcome, fmt, fields, f), out, path)


def _not_the_state(state_dir: Path, path: str) -> None:
    """``ConfigError`` where ``-o`` names a file of the state itself (``-o state/state.db``
    replaced the database with the export: the job, and a running run's writes, lost)."""
    target = Path(os.path.realpath(path))
    if target.name in STATE_FILES and target.parent == Path(os.path.realpath(state_dir)):
        raise ConfigError(f"{path} is a file of the state directory {state_dir} (the export "
                          "would replace it): write the export elsewhere", key="--output")


def _write_ok_jsonl(payloads: Iterator[tuple[str, bytes | None]], out: TextIO) -> int:
    """``{"id": ..., "data": ...}`` lines, the payload spliced in as stored (it is the JSON the
    API sent, and it parsed) rather than parsed and serialised again; to the binary stream
    under ``out`` when there is one. A line's parts are joined once, with its block's."""
    binary = getattr(out, "buffer", None)
    if binary is not None:
        out.flush()
    dumps = orjson.dumps
    n = size = 0
    parts: list[bytes] = []
    for item, raw in payloads:
        n += 1
        if not raw:
            line = dumps({"id": item, "data": None}) + b"\n"
            parts.append(line)
            size += len(line)
        else:  # (on one line: parsed and dumped again, a pretty-printed body's integers past
            # 64 bits became floats)
            parts += (b'{"id":', dumps(item), b',"data":', one_line(raw).strip(), b"}\n")
            size += len(raw)
        if size >= 1 << 18:  # written in blocks of 256 KiB: memory stays flat
            _put(parts, out, binary)
            size = 0
    _put(parts, out, binary)
    return n


def _put(parts: list[bytes], out: TextIO, binary: Any) -> None:
    if parts:
        data = b"".join(parts)
        if binary is not None:
            binary.write(data)
        else:
            out.write(data.decode("utf-8"))
        parts.clear()


def _write_ids(blocks: Iterator[list[str]], out: TextIO) -> int:
    n = 0
    for block in blocks:
        n += len(block)
        out.write("\n".join(block) + "\n")
    return n


def _output(path: str) -> tuple[Path, bool]:
    """Where ``-o PATH`` writes, and whether straight into it: a device, a FIFO or a socket,
    or a descriptor's name (``/dev/stdout``, ``/dev/fd/N``, ``>(command)``: a pipe, or a file
    the shell opened, maybe to append) is written into as it is, at the path given (a rename
    would put a regular file in its place); a regular file, or the one a symbolic link names
    (the link stays a link), is written beside and renamed over."""
    try:
        st = os.stat(path)  # (through links)
    except OSError:
        return Path(os.path.realpath(path)), False
    if (not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode)) or path.startswith(
            ("/dev/", "/proc/")):
        return Path(path), True
    return Path(os.path.realpath(path)), False


def _emit(write: Callable[[TextIO], int], out: TextIO | None, path: str | None) -> int:
    """``write`` the export to ``out``, or to the file ``path``."""
    if path is None:
        assert out is not None
        return write(out)
    return _to_file(path, write)


def _to_file(path: str, write: Callable[[TextIO], int]) -> int:
    """``write`` to ``path``: atomically (``_atomically``), or straight into a special file."""
    target, special = _output(path)
    if not special:
        return _atomically(target, write)
    try:
        with open(target, "a", encoding="utf-8", newline="") as f:  # (a file the shell opened
            return write(f)  # to append to, through /dev/stdout: not truncated by a reopening)
    except OSError as e:
        raise StorageError(f"cannot write the export: {e.strerror}", path=target) from None


def _atomically(target: Path, write: Callable[[TextIO], int]) -> int:
    """``write`` to a temp file next to ``target``, fsync it, rename it over the target:
    readers of the target see the old file or the complete new one, never a partial export."""
    fd, tmp = temp_beside(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f, _synced_meanwhile(fd):
            n = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise StorageError(f"cannot write the export: {e.strerror}", path=target) from None
        raise
    return n


@contextlib.contextmanager
def _synced_meanwhile(fd: int, every: float = 0.25) -> Iterator[None]:
    """While the body writes to ``fd``, a thread of its own syncs what is written so far every
    ``every`` s, so that the disk writes while the export reads and formats, and the last
    fsync has little left: a 1-GB export took 5.7-6.1 s to a file against 3.4 s to
    /dev/null, most of the difference its final fsync."""
    done = threading.Event()

    def sync() -> None:
        while not done.wait(every):
            try:
                os.fdatasync(fd)
            except OSError:  # (the body's own writes and fsync report the disk's errors)
                return

    thread = threading.Thread(target=sync, name="asyncrawl-export-sync", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


_MISSING = object()
LOOKAHEAD = 100  # records CSV takes its columns from; a --fields name not in them is warned of


def _get(row: dict[str, Any], name: str) -> Any:
    """A CSV column's value: a top-level field, or a dotted path into the payload
    (``title``, ``author.name``, ``data.author.name``); ``_MISSING`` when there is none."""
    if name in row:
        return row[name]
    parts = name.split(".")
    if parts[0] == "data" and len(parts) > 1:
        parts = parts[1:]
        if parts[0] == "id":  # the payload's own ``id`` (``_row``), not the crawled one
            parts[0] = PAYLOAD_ID
    value: Any = row
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _check_fields(records: Iterator[dict[str, Any]], fields: list[str],
                  row_of: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``records`` again, each looked at for the ``fields`` not yet found in one: a misspelt
    column is an error, not an empty column. The first ``LOOKAHEAD`` records are looked at
    before any is written (an export of fewer fails before it writes anything); a field still
    missing after them is warned of, and an error once every record has gone by (``-o`` then
    leaves no file): a field that only later records have is exported (the warning for CSV's
    own columns tells one to name it; it was refused)."""
    head: list[dict[str, Any]] = []  # held only until every field has shown up (usually 1)
    missing = list(fields)
    first: dict[str, Any] | None = None

    def look(rec: dict[str, Any]) -> None:
        nonlocal missing, first
        row = row_of(rec)
        first = first or row
        missing = [name for name in missing if _get(row, name) is _MISSING]

    def unknown() -> ConfigError:
        assert first is not None
        return ConfigError(f"--fields: {missing[0]!r} is in none of the records (the first has: "
                           f"{', '.join(first)}; use a dotted path such as author.name for a "
                           "nested field)")

    for rec in itertools.islice(records, LOOKAHEAD):
        head.append(rec)
        look(rec)
        if not missing:
            break
    if missing and first is not None and len(head) < LOOKAHEAD:  # (every record looked at)
        raise unknown()
    if missing and first is not None:
        log.warning("--fields: %r is in none of the first %s records; the export goes on (an "
                    "error at its end if no record has it)", missing[0], f"{LOOKAHEAD:,}")
    yield from head
    for rec in records:
        if missing:
            look(rec)
        yield rec
    if missing and first is not None:
        raise unknown()


def _write(records: Iterator[dict[str, Any]], outcome: str, fmt: str,
           fields: list[str] | None, out: TextIO) -> int:
    n = 0
    writer = None
    cols: list[str] = []
    left_out = 0  # rows with fields that no column holds (``_csv_columns``)
    if fmt == "csv" and fields:
        records = _check_fields(records, fields, lambda rec: _row(rec, outcome))
    elif fmt == "csv":
        cols, records = _csv_columns(records, outcome)
    for rec in records:
        n += 1
        if fmt == "ids":
            out.write(rec["id"] + "\n")
        elif fmt == "jsonl":
            out.write(orjson.dumps(rec).decode() + "\n")
        else:
            row = _row(rec, outcome)
            if writer is None:
                cols = fields or cols
                col_set = set(cols)
                writer = csv.writer(out)
                writer.writerow([writable(c) for c in cols])
            if not fields and not row.keys() <= col_set:
                left_out += 1
            writer.writerow([_cell(_get(row, c)) for c in cols])
    if left_out:
        log.warning("--format csv: %s of %s records had fields that no column holds (the columns "
                    "are the fields of the first %s records): those fields are left out; name "
                    "them with --fields, or use --format jsonl", f"{left_out:,}", f"{n:,}",
                    LOOKAHEAD)
    if fmt == "csv" and writer is None:  # no rows: still the header, for what reads it
        csv.writer(out).writerow(fields or _COLUMNS.get(outcome, ["id"]))
    return n


def _csv_columns(records: Iterator[dict[str, Any]], outcome: str
                 ) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The columns of a CSV export without ``--fields``: the top-level fields of the first
    ``LOOKAHEAD`` records in the order they first come (those of the first record only, before:
    a payload that is no object, after one that is, lost its whole row, and the other way
    round), and ``records`` again."""
    head = list(itertools.islice(records, LOOKAHEAD))
    cols: dict[str, None] = {}
    for rec in head:
        cols.update(dict.fromkeys(_row(rec, outcome)))
    return list(cols), itertools.chain(head, records)


# the columns of each outcome's rows where they do not depend on the payloads (_plain, _records)
_COLUMNS = {**{o: ["id", "refetched"] for o in _ID_LISTS}, "failed": ["id", "status", "error"],
            "unavailable": ["id", "status", "error"]}


PAYLOAD_ID = "data.id"  # the column of a payload's own ``id`` field: ``id`` is the crawled ID


def _row(rec: dict[str, Any], outcome: str) -> dict[str, Any]:
    """One exported record as CSV and Parquet see it: for ok, ``id`` (the ID crawled) and the
    payload's top-level fields, its own ``id`` field (an API's numeric key, say) as ``data.id``:
    it must not take the crawled ID's place. A field of the payload named ``data.id`` itself
    then moves to ``data.data.id`` (and on, while that name is taken): no field's value is
    dropped for another's."""
    if outcome != "ok":
        return rec
    data = rec["data"]
    if not isinstance(data, dict):
        return {"id": rec["id"], "data": data}
    if "id" not in data:
        return {"id": rec["id"], **data}
    row = {"id": rec["id"]}
    for k, v in data.items():
        if k == "id":
            k = PAYLOAD_ID
        elif k == PAYLOAD_ID:
            while k in data or k == PAYLOAD_ID:
                k = "data." + k
        row[k] = v
    return row


def _cell(v: Any) -> str:
    """A CSV cell: JSON's spelling for what is not a string or a number (``true``, ``false``,
    objects and arrays as JSON text), empty for a missing value or a null."""
    if v is None or v is _MISSING:
        return ""
    if isinstance(v, dict | list | bool):
        return json_text(v)
    if isinstance(v, str):
        return writable(v)
    return str(v)


