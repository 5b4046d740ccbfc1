"""The record schema: every fact a run writes to its state, as one type, and what it means.

A run writes records; a store keeps them and answers from them. Kinds:

=============  ==================================================================================
``run``        a run started (``extra``: version, pid, the job's identity)
``sent``       a request for the ID is about to leave: durable *before* it does (exact in-doubt)
``unsent``     that intent's request did not leave after all (the run stopped, or its key was
               refused, while the intent was being committed): its call is taken back
               (``ts`` and ``key``: the intent's; ``permanent``: an earlier request for the
               ID left in this run, so its intent stays open)
``ok``         the ID's result (``raw``: the body as received, or ``data``)       } outcome
``failed``     the ID failed in this pass (``permanent``: a 4xx, not a give-up)   } records:
``unavailable`` the ID failed again in pass 2 (confirmed)                         } an ID's state
``unanswered`` a request for the ID left and no answer came (a timeout after the connect, a
               dropped connection): it may have reached the server, possibly billed
``answered``   a request for the ID got an answer that is not billable (an error status): a
               call known not to be billed, wherever the ID ends (in doubt, say)
``unusable``   a request for the ID got a paid (2xx) answer that cannot be used (its body did
               not parse, came cut short or too large): counted against ``paid_retries``
               across runs
``billed``     2xx answers of an ID left unsettled at the end of a pass (``paid``)
``halt``       why a run stopped early (``status``, ``error``; ``extra``: reason)
``mark``       how far into its IDs file the run has got: every ID before ``extra["frontier"]``
               (byte offset, line, unique IDs and duplicates so far) is settled or sent
``end``        a run ended (``extra``: the IDs whose request was cut off in flight)
``sync``       nothing: committed (and waited for) to know that every record queued before it
               is durable; the stores ignore it
=============  ==================================================================================

An ID's *state* is that of its latest outcome record (``failed`` with ``permanent`` is
``perm``), except that ``ok`` is final. ``ok`` and ``unavailable`` are *settled*: a rerun skips
them. ``Record.encode`` / ``Record.decode`` are the record's JSON form (one journal line).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from .jsontext import LONG_DIGITS, one_line, parse_json
from .types import Halt, Result

OUTCOME_KINDS = ("ok", "failed", "unavailable")
# what ``export --outcome X`` takes: the states of each outcome
EXPORT_STATES = {"ok": ("ok",), "failed": ("failed", "perm"), "unavailable": ("unavailable",)}
# ``export``'s choices (here, beside the states they read, so that the command line offers them
# without importing the report module and the stores behind it)
EXPORT_OUTCOMES = ("ok", "failed", "unavailable", "in-doubt", "unanswered")
EXPORT_FORMATS = ("jsonl", "csv", "ids", "parquet")
SETTLED = frozenset({"ok", "unavailable"})  # states a rerun does not fetch again
COUNTED = ("answered", "unusable")  # records that add one to the item's column of their name


def settled(recheck_unavailable: bool) -> frozenset[str]:
    """The states a run does not fetch again: ``SETTLED``, less ``unavailable`` when it is to
    be checked again (``recheck_unavailable``)."""
    return _OK_ONLY if recheck_unavailable else SETTLED


_OK_ONLY = frozenset({"ok"})
# An item's ``doubt`` in both stores: NULL, 0 (in doubt: sent when a run was cut off, no result
# kept), 1 (in doubt and fetched ok since: possibly billed twice), 2 (``unanswered``: a request
# got no answer after its connect, possibly billed) or 3 (unanswered and fetched ok since). An
# ID a run is cut off on becomes in doubt where it is not already: this SQL condition.
NOT_IN_DOUBT = "(doubt IS NULL OR doubt = 2)"
# an ID with a call whose answer the state does not know (schema 5: every answer counted, 2xx
# in ``paid``, the rest in ``answered``): of a crashed run's open intents, only those are in
# doubt (one waiting for its retry after a 503 has its answer, and is not possibly billed)
UNANSWERED_CALL = "sends > paid + answered"
I_NOT_IN_DOUBT = NOT_IN_DOUBT.replace("doubt", "i.doubt")  # (beside an upsert's ``excluded``)


class Commit(enum.Enum):
    """What became of a record a caller waited for (``writer.Writer.commit``)."""

    DURABLE = "durable"  # committed: it counts
    FAILED = "failed"  # the state could not be written (the run is stopping: exit 5)
    REFUSED = "refused"  # a ``sent`` intent for an ID that another process of the job holds
    #                      now (this one's lease ran out): the request must not leave


def state_of(kind: str, permanent: bool) -> str:
    """The state an outcome record gives its ID."""
    return "perm" if permanent and kind == "failed" else kind


class _RecordFields(NamedTuple):
    kind: str
    id: str | None
    status: int | None
    error: str | None
    permanent: bool
    data: Any
    pass_no: int
    tries: int
    paid: int
    ts: float
    extra: dict[str, Any] | None
    raw: bytes | None
    key: str | None


_KEYS = frozenset({"k", "id", "s", "e", "perm", "p", "n", "paid", "ts", "data"})


class Record(_RecordFields):
    """One record (immutable; a tuple, because a run makes two per request).

    The payload of an ``ok`` record is ``raw``, the answer's body as received (written as is:
    it parsed as JSON and has no line break), or else ``data``, the parsed payload, which is
    serialised again. ``data`` may also ride along for the ``on_result`` hook."""

    __slots__ = ()

    def __new__(cls, kind: str, id: str | None = None, *, status: int | None = None,
                error: str | None = None, permanent: bool = False, data: Any = None,
                pass_no: int = 1, tries: int = 0, paid: int = 0, ts: float | None = None,
                extra: dict[str, Any] | None = None, raw: bytes | None = None,
                key: str | None = None) -> Record:
        return tuple.__new__(cls, (kind, id, status, error, permanent, data, pass_no, tries,
                                   paid, time.time() if ts is None else ts, extra, raw, key))

    @classmethod
    def outcome(cls, kind: str, id: str, status: int | None, error: str | None, permanent: bool,
                data: Any, pass_no: int, tries: int, paid: int, raw: bytes | None,
                key: str | None = None, paid_by: dict[str, int] | None = None) -> Record:
        """An outcome record, made without keyword handling (two records per request).
        ``key``: the fingerprint of the API key its paid calls went out with (``[request]
        keys``), or ``paid_by``: fingerprint -> paid calls, when they went out with several."""
        return tuple.__new__(cls, (kind, id, status, error, permanent, data, pass_no, tries,
                                   paid, time.time(), {"paid_by": paid_by} if paid_by else None,
                                   raw, key))

    @classmethod
    def sent(cls, id: str, key: str | None = None) -> Record:
        """The record that a request for ``id`` is about to leave (with the API key of
        fingerprint ``key``, when there are ``[request] keys``)."""
        return tuple.__new__(cls, ("sent", id, None, None, False, None, 1, 0, 0, time.time(),
                                   None, None, key))

    @classmethod
    def unanswered(cls, id: str) -> Record:
        """The record that a request for ``id`` left and got no answer (a timeout after the
        connect, a dropped connection): it may have reached the server, possibly billed
        (possibly billed twice once the ID is fetched)."""
        return cls._of("unanswered", id)

    @classmethod
    def answered(cls, id: str) -> Record:
        """The record that a request for ``id`` got an answer that is not billable (an error
        status): the call is known answered, not billed, even where the ID ends in doubt."""
        return cls._of("answered", id)

    @classmethod
    def unusable(cls, id: str) -> Record:
        """The record that a request for ``id`` got a paid answer that cannot be used."""
        return cls._of("unusable", id)

    @classmethod
    def _of(cls, kind: str, id: str) -> Record:
        """A record of ``kind`` that says nothing but its ID and time (a request's fate)."""
        return tuple.__new__(cls, (kind, id, None, None, False, None, 1, 0, 0, time.time(),
                                   None, None, None))

    def unsent(self, earlier: bool = False) -> Record:
        """The record that this ``sent`` intent's request did not leave (``unsent``).
        ``earlier``: another request for the ID left in this run, unanswered for the state
        (a retry's earlier try): the ID's intent stays open (in doubt after a crash)."""
        return tuple.__new__(Record, ("unsent", self.id, None, None, earlier, None, 1, 0, 0,
                                      self.ts, None, None, self.key))

    def paid_keys(self) -> dict[str, int]:
        """The record's paid calls by API key fingerprint (empty without ``[request] keys``)."""
        if self.extra and "paid_by" in self.extra:
            return dict(self.extra["paid_by"])
        return {self.key: self.paid} if self.key and self.paid else {}

    @property
    def state(self) -> str:
        """The state this outcome record gives its ID (unless the ID is ``ok`` already: final)."""
        return state_of(self.kind, self.permanent)

    @property
    def payload(self) -> Any:
        """A record's payload: the parsed ``raw`` body of an ``ok`` one where there is no
        ``data``, or where it holds a number orjson may not have read exactly (kept whole:
        CSV and Parquet exports wrote ``1.2345678901234568e+22`` for
        ``12345678901234567890123``, ``on_result`` had floats); else ``data``."""
        raw = self.raw
        if raw is not None and (self.data is None or LONG_DIGITS.search(raw)):
            return parse_json(raw)  # (a fetch's ``data`` is orjson's, to check that it parses)
        return self.data

    def stored_payload(self) -> bytes | None:
        """An ``ok`` record's payload as a store keeps it (JSON, UTF-8): the body as received,
        or ``data`` serialised."""
        if self.raw is not None:
            return self.raw
        return orjson.dumps(self.data) if self.data is not None else None

    def result(self) -> Result:
        """The ``Result`` an outcome record stands for (what ``on_result`` receives), its
        payload exact (``payload``)."""
        return Result(self.id or "", self.kind, self.status, self.payload, self.error,
                      self.permanent, self.pass_no, self.tries)

    def encode(self) -> bytes:
        """The record's JSON form, one line (the journal's line format)."""
        kind = self.kind
        d: dict[str, Any] = {"k": kind}
        if self.id is not None:
            d["id"] = self.id
        if self.status is not None:
            d["s"] = self.status
        if kind in OUTCOME_KINDS:
            d["p"] = self.pass_no
            d["n"] = self.tries
            d["paid"] = self.paid
        elif kind == "billed":
            d["paid"] = self.paid
        if self.error is not None:
            d["e"] = self.error
        if self.permanent:
            d["perm"] = True
        d["ts"] = round(self.ts, 3)
        if self.extra:
            d.update(self.extra)
        if kind == "ok":
            raw = self.raw
            if raw is not None:  # valid JSON (it parsed): spliced in, on one line (a line
                # break in JSON is whitespace: parsed and dumped again, a big integer was lost)
                return orjson.dumps(d)[:-1] + b',"data":' + one_line(raw) + b"}\n"
            d["data"] = self.data
        return orjson.dumps(d) + b"\n"

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Record:
        """The record of a decoded JSON line (``encode``'s inverse; ``raw`` is not restored:
        the payload is ``data``)."""
        extra = {k: v for k, v in obj.items() if k not in _KEYS} or None
        return tuple.__new__(cls, (obj["k"], obj.get("id"), obj.get("s"), obj.get("e"),
                                   bool(obj.get("perm")), obj.get("data"), obj.get("p", 1),
                                   obj.get("n", 0), obj.get("paid", 0), obj.get("ts", 0.0),
                                   extra, None, None))


class Bought(NamedTuple):
    """What the state holds of an ID's paid answers that could not be used (``unusable``
    records), with its latest outcome's status, error and tries."""

    unusable: int
    status: int | None
    error: str | None
    tries: int


@dataclass(frozen=True, slots=True)
class Counts:
    """IDs by state: ``failed`` includes permanent failures; ``pending`` (no outcome yet) is
    only counted where the IDs asked about are known (a run's own list)."""

    ok: int = 0
    failed: int = 0
    unavailable: int = 0
    pending: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"ok": self.ok, "failed": self.failed, "unavailable": self.unavailable}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a store holds, in figures (``asyncrawl status``): every field a store can answer
    from its indexes, without reading payloads."""

    counts: Counts
    sent: int  # requests sent (``sent`` records)
    in_doubt: int  # sent when a run was cut off, no result kept, not re-fetched since
    billed_twice: int  # of the in-doubt IDs, those fetched ok since: possibly billed twice
    in_flight: int  # sent, no outcome yet, in a run that is still going
    runs: int
    halt: Halt | None  # why the last run halted, if it did
    job: dict[str, Any] | None  # the job's identity (method, url, params) per its last run
    running: int | None  # pid of the run holding the state now (0: unknown pid), or None
    ledger: tuple[tuple[str, str, int], ...] = ()  # (UTC date, endpoint, billable) as recorded
    # (UTC date, API key fingerprint, sent, billable): calls per key ([request] keys)
    keys: tuple[tuple[str, str, int, int], ...] = ()
    # IDs with a request that left and got no answer (a timeout after the connect, a dropped
    # connection: possibly billed), not in doubt; and of those, the ones fetched ok since
    # (possibly billed twice)
    unanswered: int = 0
    unanswered_refetched: int = 0
    # calls sent whose answer is not known (of the IDs in doubt or unanswered, those not
    # answered 2xx; in flight): at most this many more than ``billable`` may be billed
    unsure_calls: int = 0
    # the last run ended without its end record (killed, or a storage failure that let it
    # write no more: its halt unsaid); None where the store does not say (a shared job's)
    cut_short: bool | None = None

    @property
    def billable_by_day(self) -> dict[str, int]:
        """UTC date -> billable (2xx) calls recorded that day, every endpoint together."""
        by: dict[str, int] = {}
        for day, _, n in self.ledger:
            by[day] = by.get(day, 0) + n
        return by

    @property
    def billable(self) -> int:
        return sum(n for _, _, n in self.ledger)


def call_rows(counts: Mapping[tuple[str, str, str], int]) -> list[tuple[str, str, int, int]]:
    """A batch's calls ``(UTC date, endpoint or key, "sent" | "billable") -> n`` as ledger rows
    ``(date, endpoint or key, sent, billable)``, in order (both stores add them up so)."""
    rows: dict[tuple[str, str], list[int]] = {}
    for (day, what, kind), n in sorted(counts.items()):
        rows.setdefault((day, what), [0, 0])[kind == "billable"] += n
    return [(day, what, sent, billable) for (day, what), (sent, billable) in rows.items()]


def in_order_parts(records: Sequence[Record]) -> list[Sequence[Record]]:
    """A batch of records, cut before every ``sent`` that follows an outcome of the same ID.
    The stores apply a part grouped by kind, intents before outcomes: right within a run,
    where an ID's intent is committed (an earlier batch) before its request leaves, but not
    across passes, where pass 1's ``failed`` (queued without a wait) and pass 2's intent for
    the same ID can share one group commit; there the outcome must not close the intent of a
    request that is out. Nearly every batch is one part."""
    parts: list[Sequence[Record]] = []
    start, settled = 0, set[str | None]()
    for i, rec in enumerate(records):
        if rec.kind == "sent" and rec.id in settled:
            parts.append(records[start:i])
            start, settled = i, set()
        elif rec.kind in OUTCOME_KINDS:
            settled.add(rec.id)
    parts.append(records[start:])
    return parts


def utc_day(ts: float) -> str:
    """The UTC date of a timestamp, as the ledger keys it."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


