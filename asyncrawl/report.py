"""Reading a state directory without locking it: ``status`` figures and ``export`` streams.

Both read the journal through ``journal.scan`` (a torn tail of a running or crashed job is simply
not read). ``export`` streams: memory holds each ID's latest state, never the payloads, except
for failed/unavailable exports, which keep one small record per failed ID.
"""

from __future__ import annotations

import csv
import itertools
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import orjson

from .config import Config
from .crawler import Halt
from .errors import ConfigError, StorageError
from .journal import JOURNAL, State, load_state, lock_holder, scan
from .progress import halt_text

EXPORT_OUTCOMES = ("ok", "failed", "unavailable", "in-doubt")
EXPORT_FORMATS = ("jsonl", "csv", "ids")


def endpoint_of(url: str) -> str:
    """The endpoint of a URL template as a provider's billing page names it: host (and port) and
    path, ID placeholder kept, no scheme, credentials or query: ``api.example.com/v1/notes/{id}``."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{host}{f':{port}' if port else ''}{parts.path or '/'}"


def _day(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def status(config: Config, *, endpoint: str | None = "") -> dict[str, Any]:
    """The figures ``asyncrawl status`` prints (the ``--json`` object).

    The billing ledger counts billable (2xx) calls by the UTC date of their record and by
    endpoint, derived from ``config.url`` (``endpoint=None``: unknown, e.g. no config was given;
    a string: that endpoint). ``not_billed`` counts the calls sent without a 2xx answer (error
    answers, timeouts, dropped connections), from the journal's note written before each send,
    minus the calls whose answer was lost in a crash (``in_doubt``: possibly billed).
    """
    d = Path(config.state_dir)
    _require_state(d)
    running = lock_holder(d)
    # one read of the journal: the state (as load_state replays it) and the calls sent
    st = State()
    sent_by_day: Counter[str] = Counter()
    for _, rec in scan(d / JOURNAL):
        st.apply(rec)
        if rec["k"] == "sent":
            sent_by_day[_day(rec["ts"])] += 1
    if running is None:
        st.close_run(crashed=True)
    counts = st.counts()
    billable = sum(st.billable_by_day.values())
    in_doubt = len(st.in_doubt) + (len(st.in_flight) if running is not None else 0)
    sent = sum(sent_by_day.values())
    if st.job is not None:  # what the state says it fetched, not what today's config says
        endpoint = endpoint_of(st.job["url"])
    elif endpoint == "":
        endpoint = config.redact(endpoint_of(config.url))
    price = config.price_per_call
    ledger = []
    for day, n in sorted(st.billable_by_day.items()):
        row: dict[str, Any] = {"date": day, "endpoint": endpoint, "billable": n}
        if price is not None:
            row["cost"] = round(n * price, 6)
        ledger.append(row)
    halt = None
    if st.halt is not None:
        halt = {"status": st.halt.get("s"), "message": config.redact(st.halt.get("e") or ""),
                "reason": st.halt.get("reason")}
    out: dict[str, Any] = {
        **counts,
        "halt": halt,
        "billable": billable,
        "billable_by_date": dict(sorted(st.billable_by_day.items())),
        "ledger": ledger,
        "requests_sent": sent,
        "not_billed": max(0, sent - billable - in_doubt) if sent else None,
        "in_doubt": sum(1 for twice in st.in_doubt.values() if not twice),
        "possibly_billed_twice": sum(st.in_doubt.values()),
        "in_flight": len(st.in_flight) if running is not None else 0,
        "running": running,
        "runs": st.runs,
        "state_dir": str(d),
    }
    if running is not None:
        try:
            out["live"] = orjson.loads((d / "live.json").read_bytes())
        except (OSError, orjson.JSONDecodeError):
            out["live"] = None
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
    if s["not_billed"] is not None:
        lines.append(f"not billed   {s['not_billed']:,} calls  (error answers, timeouts, dropped "
                     f"connections; {s['requests_sent']:,} calls sent in all)")
    if s["in_doubt"] or s["possibly_billed_twice"]:
        lines.append(f"in doubt     {s['in_doubt']:,} sent when a run was cut off, no result kept "
                     f"(possibly billed); {s['possibly_billed_twice']:,} of those re-fetched since "
                     "(possibly billed twice): asyncrawl export --outcome in-doubt")
    if s["running"] is not None:
        lines.append(f"running      yes (pid {s['running']}), "
                     f"{s['in_flight']:,} IDs sent and not settled yet")
        live = s.get("live")
        if live:
            gov = (f"rate limit {live['effective_rate']:,.1f}/{live['configured_rate']:,.0f} req/s, "
                   f"sending {live['rate']:,.1f} req/s, pass {live['pass_no']}")
            if live["paused_for"] > 0:
                gov += f", paused {live['paused_for']:.0f}s (Retry-After)"
            gov += ", breaker OPEN (upstream down, probing)" if live["breaker_open"] else ", breaker closed"
            lines.append(f"governor     {gov}")
    if s["halt"]:
        h = s["halt"]
        what, then = halt_text(Halt(h["reason"] or "fatal", h["status"], h["message"]))
        lines.append(f"last run     halted: {what} — {then}")
    return "\n".join(lines)


def _require_state(d: Path) -> None:
    """A state directory that does not exist, or where nothing has run, is a usage error (a
    wrong ``--state``), not a storage failure."""
    if not (d / JOURNAL).exists():
        what = "does not exist" if not d.exists() else "holds no asyncrawl state"
        raise ConfigError(f"{d} {what}: nothing has run with this state directory (check "
                          "--state, or [state] dir in the config)")


def _records(state_dir: Path, outcome: str) -> Iterator[dict[str, Any]]:
    """The records to export, from one read of the journal."""
    path = state_dir / JOURNAL
    _require_state(state_dir)
    if outcome == "in-doubt":
        st = load_state(state_dir, running=lock_holder(state_dir) is not None)
        for item, twice in st.in_doubt.items():
            yield {"id": item, "refetched": twice}
        return
    if outcome == "ok":  # ok is final: an ID's first ok record is its result
        exported: set[str] = set()
        for _, rec in scan(path):
            if rec["k"] == "ok" and rec["id"] not in exported:
                exported.add(rec["id"])  # never two ok lines for one ID
                yield rec
        return
    want = {"failed": ("failed", "perm"), "unavailable": ("unavailable",)}[outcome]
    st = State()
    latest: dict[str, dict[str, Any]] = {}
    for _, rec in scan(path):
        st.apply(rec)
        if rec["k"] in ("failed", "unavailable"):
            latest[rec["id"]] = rec
    for item, rec in latest.items():
        if st.outcome.get(item) in want:
            yield rec


def export(config: Config, *, outcome: str = "ok", fmt: str = "jsonl",
           fields: list[str] | None = None, out: TextIO | None = None,
           path: str | None = None) -> int:
    """Write the records of ``outcome`` to ``out`` or (atomically) to ``path``; return the count."""
    if outcome not in EXPORT_OUTCOMES:
        raise ConfigError(f"--outcome must be one of {', '.join(EXPORT_OUTCOMES)}")
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(EXPORT_FORMATS)}")
    records = _records(Path(config.state_dir), outcome)
    if path is None:
        assert out is not None
        return _write(records, outcome, fmt, fields, out)
    # atomic: a temp file next to the target, fsynced, then renamed over it; readers of the
    # target see the old file or the complete new one, never a partial export
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise StorageError(f"cannot write the export: {e.strerror}", path=target) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            n = _write(records, outcome, fmt, fields, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise StorageError(f"cannot write the export: {e.strerror}", path=target) from None
        raise
    return n


_MISSING = object()
LOOKAHEAD = 100  # records a --fields name is looked for in before it is called unknown


def _get(row: dict[str, Any], name: str) -> Any:
    """A CSV column's value: a top-level field, or a dotted path into the payload
    (``title``, ``author.name``, ``data.author.name``); ``_MISSING`` when there is none."""
    if name in row:
        return row[name]
    parts = name.split(".")
    if parts[0] == "data" and len(parts) > 1:
        parts = parts[1:]
    value: Any = row
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _check_fields(records: Iterator[dict[str, Any]], fields: list[str],
                  row_of: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``records`` again, once every field was found in one of the first ``LOOKAHEAD`` rows:
    a misspelt column is an error, not an empty column."""
    head: list[dict[str, Any]] = []  # held only until every field has shown up (usually 1)
    missing = list(fields)
    first: dict[str, Any] | None = None
    for rec in itertools.islice(records, LOOKAHEAD):
        head.append(rec)
        row = row_of(rec)
        first = first or row
        missing = [name for name in missing if _get(row, name) is _MISSING]
        if not missing:
            break
    if missing and first is not None:
        raise ConfigError(f"--fields: {missing[0]!r} is in none of the first {len(head):,} records "
                          f"(they have: {', '.join(first)}; use a dotted path such as "
                          "author.name for a nested field)")
    return itertools.chain(head, records)


def _write(records: Iterator[dict[str, Any]], outcome: str, fmt: str,
           fields: list[str] | None, out: TextIO) -> int:
    n = 0
    writer = None
    if fmt == "csv" and fields:
        records = _check_fields(records, fields, lambda rec: _row(rec, outcome))
    for rec in records:
        n += 1
        if fmt == "ids":
            out.write(rec["id"] + "\n")
        elif fmt == "jsonl":
            if outcome == "in-doubt":
                obj = rec
            elif outcome == "ok":
                obj = {"id": rec["id"], "data": rec.get("data")}
            else:
                obj = {"id": rec["id"], "status": rec.get("s"), "error": rec.get("e")}
            out.write(orjson.dumps(obj).decode() + "\n")
        else:
            row = _row(rec, outcome)
            if writer is None:
                cols = fields or list(row)
                writer = csv.writer(out)
                writer.writerow(cols)
            writer.writerow([_cell(_get(row, c)) for c in cols])
    return n


def _row(rec: dict[str, Any], outcome: str) -> dict[str, Any]:
    """One exported record as CSV sees it: ``id`` and the payload's top-level fields (ok), or
    ``id``, ``status``, ``error``."""
    if outcome == "in-doubt":
        return rec
    if outcome == "ok":
        data = rec.get("data")
        return {"id": rec["id"], **(data if isinstance(data, dict) else {"data": data})}
    return {"id": rec["id"], "status": rec.get("s"), "error": rec.get("e")}


def _cell(v: Any) -> str:
    if v is None or v is _MISSING:
        return ""
    if isinstance(v, dict | list):
        return orjson.dumps(v).decode()
    return str(v)


