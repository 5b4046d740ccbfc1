"""[3] The worker loop: take an ID, wait for the governor, make one attempt, act on the verdict.

What an attempt leads to is a value, ``decide(...) -> Verdict``, which the loop acts on::

    OK     -> SETTLE "ok"
    FATAL  -> HALT: the job's stop switch is set (no new request starts anywhere); the ID stays
              unsettled. With several API keys: the key is retired and the ID tried again with
              another one (PARK, not charged); HALT once no key is left
    SKIP   -> SETTLE "failed" (permanent) in pass 1, "unavailable" in pass 2
    RETRY  -> PARK for retry_delay(...) while tries < max_tries, else SETTLE like SKIP (not
              permanent); a paid (2xx) answer that did not parse: SETTLE once it was bought
              more than paid_retries times; an upstream outage while the breaker is open: PARK
              at the gate, the try not charged

To SETTLE is to queue the ID's outcome record for the writer and note it in the pass's
``Ledger``; it counts only once the writer reports it durable. Before each request its ``sent``
intent is committed (a shared job's store may refuse it: another process holds the ID now,
this one stalled past its lease, and then the ID is left to that process, not sent), then
the request passes the governor's bucket a second time as it leaves (``Governor.leave``: the
wait for the intent does not bunch requests up). A worker takes no new ID while the writer is
``behind`` (a slow store: what a crash could cost of the answered results stays bounded). An
intent committed for a request that then does not leave (the job stopped meanwhile, or the
governor holds it back now: a pause, the breaker, its key refused) is taken back (``unsent``):
the state counts the calls that left.

The worker talks only to what is below it: the queue, the governor, the fetcher, the writer,
and the two plain objects its owner reads (``Ledger``, ``Stop``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from .config import Config, key_fingerprint
from .errors import SessionClosed
from .fetch import Attempt, Fetcher, Outcome, Request
from .governor import Budget, Governor
from .idqueue import IdQueue, Item, Parking
from .records import Commit, Record
from .retry import retry_delay
from .stop import Stop
from .types import ErrorKind, Halt

log = logging.getLogger("asyncrawl")

KEY_REFUSED = frozenset({401, 402})  # with several keys: the key's fault, it is retired


class Action(enum.Enum):
    SETTLE = "settle"
    PARK = "park"
    HALT = "halt"


class Verdict(NamedTuple):
    """What follows an attempt. ``kind``: the outcome to record (SETTLE); ``delay``: seconds
    until the next try (PARK); ``charged``: whether the try counts towards ``max_tries``."""

    action: Action
    kind: str = ""
    permanent: bool = False
    delay: float = 0.0
    charged: bool = True
    error: str | None = None  # replaces the attempt's error in the record


# the verdicts that depend on nothing but the outcome (made once: one a request otherwise)
_SETTLE_OK = Verdict(Action.SETTLE, "ok")
_ON_THE_WAY = (ErrorKind.TIMEOUT, ErrorKind.NETWORK)  # a paid answer's body lost on its way
_HALT = Verdict(Action.HALT)
_SKIPPED = Verdict(Action.SETTLE, "failed", permanent=True)  # in pass 1
_SKIPPED_AGAIN = Verdict(Action.SETTLE, "unavailable", permanent=True)  # in pass 2
_AT_GATE = Verdict(Action.PARK, charged=False)
LOCAL_WAIT = 0.2  # seconds a try that this machine could not make (no file left) waits
_LOCAL = Verdict(Action.PARK, delay=LOCAL_WAIT, charged=False)


def decide(item: Item, attempt: Attempt, config: Config, pass_no: int, *,
           outage: bool = False) -> Verdict:
    """The verdict on ``attempt`` for ``item`` (``item.tries`` and ``item.unusable`` do not
    count this attempt yet). ``outage``: the breaker is open and this was an upstream failure,
    not a probe."""
    outcome = attempt.outcome
    if outcome is Outcome.OK:
        return _SETTLE_OK
    if outcome is Outcome.FATAL:
        return _HALT
    if outcome is Outcome.SKIP:
        return _SKIPPED_AGAIN if pass_no > 1 else _SKIPPED
    final = "unavailable" if pass_no > 1 else "failed"
    bought = item.unusable + attempt.unusable
    if attempt.unusable and bought > config.paid_retries:
        # a paid answer that cannot be used is bought again at most paid_retries times, in an
        # outage too (one cut short while the breaker was open was bought a third time)
        return Verdict(Action.SETTLE, final, error=f"{attempt.error}; bought {bought} times, "
                       "not again ([retry] paid_retries)")
    if outage:  # not this ID's fault: no try charged; it waits at the gate
        return _AT_GATE
    if attempt.kind is ErrorKind.LOCAL:  # nor the API's: this machine's (no file left)
        return _LOCAL
    tries = item.tries + 1
    if tries < config.max_tries:
        return Verdict(Action.PARK, delay=retry_delay(
            tries, attempt.retry_after, base=config.backoff_base, cap=config.backoff_max,
            retry_after_max=config.retry_after_max, jitter=config.jitter))
    return Verdict(Action.SETTLE, final)


def budget_halt(budget: Budget) -> Halt:
    """The halt of a job whose request budget (``max_requests`` / ``max_spend``) is spent."""
    return Halt("budget", None, f"request budget of {budget.limit} billable calls reached")


class Ledger:
    """One pass's account of its IDs, kept by the producer and the workers and read by the
    pass's owner: ``done`` is set once the producer has finished and every ID it took in is
    settled. ``failed`` counts the pass's failures, ``again`` those of them that pass 2 would
    send (``again_if(permanent, unusable)``); pass 2 reads them back from the store (memory
    does not grow with them).

    Reading an IDs file, it also keeps the *frontier*: the end of the longest run of blocks of
    the file whose every ID is settled or has its durable ``sent`` intent (an ID already failed
    in an earlier run has its row). Each time it moves, a ``mark`` record goes to ``sink``: a
    later run of the same file reads on from there, and takes what the state holds unsettled
    before it from the state itself."""

    def __init__(self, sink: Sink | None = None,
                 again_if: Callable[[bool, int], bool] | None = None) -> None:
        self.outstanding = 0  # taken in, not settled
        self.feeding = True  # the producer may take in more
        self.unsent = 0  # taken in, never sent, not suspect: what the breaker is there to protect
        self.failed = 0
        self.again = 0
        self._again_if = again_if
        self.done = asyncio.Event()
        self._sink = sink
        self._uncovered: dict[int, int] = {}  # block -> IDs taken in, not yet sent
        self._marks: dict[int, dict[str, int]] = {}  # block -> where it ends, once all read
        self._next = 0  # the first block not yet covered

    def __repr__(self) -> str:
        return (f"<Ledger outstanding={self.outstanding} feeding={self.feeding} "
                f"unsent={self.unsent} failed={self.failed}>")

    def take(self, item: Item) -> None:
        self.outstanding += 1
        if not item.suspect:
            self.unsent += 1
            if item.block >= 0:
                self._uncovered[item.block] = self._uncovered.get(item.block, 0) + 1

    def sent_first(self, item: Item) -> None:
        """``item`` (not suspect) was sent for the first time: its intent is durable."""
        self.unsent -= 1
        if item.block >= 0:
            self._uncovered[item.block] -= 1
            if item.block == self._next and not self._uncovered[item.block]:
                self._advance()

    def block_read(self, block: int, mark: dict[str, int]) -> None:
        """The producer has taken in every ID of ``block``, which ends at ``mark``."""
        self._marks[block] = mark
        self._uncovered.setdefault(block, 0)
        if block == self._next:
            self._advance()

    def _advance(self) -> None:
        last = None
        while self._next in self._marks and not self._uncovered.get(self._next):
            last = self._marks.pop(self._next)
            self._uncovered.pop(self._next, None)
            self._next += 1
        if last is not None and self._sink is not None:
            self._sink.put(Record("mark", extra={"frontier": last}))

    def fed(self) -> None:
        """The producer has taken in its last ID."""
        self.feeding = False
        if self.outstanding == 0:
            self.done.set()

    def unsent_left(self) -> bool:
        """Whether IDs of this pass may still be sent for the first time (the governor asks)."""
        return self.feeding or self.unsent > 0

    def left(self, item: Item) -> None:
        """``item`` was left to another process of the job (its intent was refused): not
        this pass's to settle."""
        if not item.covered and not item.suspect:
            self.unsent -= 1
            if item.block >= 0:
                self._uncovered[item.block] -= 1
        self.outstanding -= 1
        if self.outstanding == 0 and not self.feeding:
            self.done.set()

    def settled(self, item: Item, rec: Record) -> None:
        if rec.kind == "failed":
            self.failed += 1
            if self._again_if is not None and self._again_if(rec.permanent, item.unusable):
                self.again += 1
        self.outstanding -= 1
        if self.outstanding == 0 and not self.feeding:
            self.done.set()


class Sink(Protocol):
    """Where records go: the run's writer (``writer.Writer``, or ``writer.ProcessWriter``)."""

    def put(self, record: Record) -> None: ...

    def commit(self, record: Record) -> Awaitable[Commit]: ...

    def behind(self) -> bool: ...

    def caught_up(self) -> Awaitable[None]: ...


def outcome_record(item: Item, attempt: Attempt, kind: str, *, permanent: bool, pass_no: int,
                   keep_data: bool, error: str | None = None) -> Record:
    """The outcome record of ``item``. The store gets an ok answer's body as received; the
    parsed payload rides along only for the ``on_result`` hook (``keep_data``)."""
    body = attempt.body
    data = attempt.data if keep_data or body is None else None
    key, paid_by = paid_keys(item)
    return Record.outcome(kind, item.id, attempt.status, error or attempt.error, permanent, data,
                          pass_no, item.tries, item.paid, body, key, paid_by)


def billed_record(item: Item) -> Record:
    """The record of ``item``'s paid answers when it is left unsettled (``item.paid`` > 0)."""
    key, by = paid_keys(item)
    return Record("billed", item.id, paid=item.paid, key=key,
                  extra={"paid_by": by} if by else None)


def paid_keys(item: Item) -> tuple[str | None, dict[str, int] | None]:
    """The API key (fingerprint) that ``item``'s paid answers came with, or, if they came with
    several, how many with each (``Record.outcome``'s ``key`` and ``paid_by``)."""
    by = item.paid_by
    if not by:
        return None, None
    if len(by) == 1:
        return next(iter(by)), None
    return None, dict(by)


class Worker:
    """Shared state of the worker tasks of one pass; ``run`` is one worker's loop."""

    def __init__(self, *, config: Config, pass_no: int, queue: IdQueue, parking: Parking,
                 ledger: Ledger, governor: Governor, budget: Budget, fetcher: Fetcher,
                 sink: Sink, stop: Stop, keep_data: bool,
                 on_retire: Callable[[int, Attempt, int], None] | None = None) -> None:
        self.config = config
        self.pass_no = pass_no
        self.queue = queue
        self.parking = parking
        self.ledger = ledger
        self.governor = governor
        self.budget = budget
        self.fetcher = fetcher
        self.sink = sink
        self.stop = stop
        self.keep_data = keep_data
        # [request] keys: their fingerprints (the ledger's), and who hears of a retired key
        self.fingerprints: list[str | None] = [key_fingerprint(k) for k in config.keys] or [None]
        self.on_retire = on_retire
        self.in_flight = 0
        self.flying: set[str] = set()  # IDs whose request is out; left here if cut off
        self.held: dict[int, Item] = {}  # items a worker has taken and not yet passed on
        self.idle = asyncio.Event()
        self.idle.set()
        self.requests = 0
        self.retries = 0  # requests for an ID sent before in this pass
        self.unanswered = 0  # tries that may have reached the server, with no answer
        self.left = 0  # IDs left to another process of the job (``_leave``)

    def __repr__(self) -> str:
        return (f"<Worker pass={self.pass_no} queued={self.queue.qsize()} "
                f"parked={len(self.parking)} in_flight={self.in_flight}>")

    async def run(self) -> None:
        gov, budget, stop, held, queue = (self.governor, self.budget, self.stop, self.held,
                                          self.queue)
        limited_budget = budget.limit is not None
        stopped = stop.event.is_set  # (looked up once: asked three times a request)
        hooked = self.fetcher.request_for is not None
        sink = self.sink
        while not stopped():
            if sink.behind():  # no new request until the store catches up: what a crash
                await sink.caught_up()  # loses of what was answered stays bounded (SPEC §5)
                continue
            item = queue.get_nowait() or await queue.get()
            held[id(item)] = item
            ticket = gov.ready() or await gov.acquire()
            if limited_budget and not await budget.reserve():
                stop.set(budget_halt(budget))
                return
            lane = ticket.lane
            request = None
            if hooked:  # (before its intent: a hook that raises has sent nothing)
                try:
                    request = self.fetcher.hooked(item.id, lane)
                except BaseException as e:
                    budget.release(False)
                    gov.unused(ticket)
                    if isinstance(e, asyncio.CancelledError):  # (a plain call: not our own)
                        raise RuntimeError(f"the request_for hook raised CancelledError for "
                                           f"ID {item.id!r}") from e
                    raise
            # Durably note that the request is about to leave, so that after a crash the ID is
            # known to be in doubt (possibly billed). Group-committed with other records.
            sent = Record.sent(item.id, self.fingerprints[lane])
            if stopped():
                budget.release(False)
                return
            try:
                commit = await self.sink.commit(sent)
                if commit is Commit.DURABLE and not gov.may_leave(ticket):
                    await gov.leave(ticket)  # (the wait for the intent bunched requests up)
            except asyncio.CancelledError:  # (the pass ends: its request does not leave)
                self._withdraw(item, sent)
                raise
            if commit is Commit.FAILED or stopped():  # (no await between this and the send)
                if commit is Commit.DURABLE:  # (the stop came while it was being committed)
                    self._withdraw(item, sent)
                else:
                    budget.release(False)
                return
            if commit is Commit.REFUSED:  # another process of the job holds the ID now
                budget.release(False)
                gov.unused(ticket)
                del held[id(item)]
                self._leave(item)
                continue
            if gov.holds(ticket):
                # while the intent was being committed, or it waited to leave, a pause began,
                # the breaker opened or its key was refused: not sent now (nor with that key);
                # the ID goes again, and waits for the governor as any other
                self._withdraw(item, sent)
                gov.unused(ticket)
                del held[id(item)]
                self.parking.park(item, 0.0)
                continue
            first = self._first(item)  # (what this try says of the API: before it counts)
            earlier = item.sent
            try:
                attempt = await self._send(item, lane, first, request)
            except SessionClosed as e:  # (the run stops, then raises it; the ID stays held)
                if not e.sent:  # (else its request is in doubt: cut off)
                    self.flying.discard(item.id)
                    self._sent_nothing(item, sent, earlier)
                    budget.release(False)
                    gov.unused(ticket)
                raise
            del held[id(item)]  # no await from here on: it is parked or settled below
            if attempt.sent_nothing:  # (failed before it had its connection: not a request)
                self._sent_nothing(item, sent, earlier)
            if attempt.unanswered:  # possibly billed, whatever comes of the ID now
                self.unanswered += 1
                self.sink.put(Record.unanswered(item.id))
            elif attempt.status is not None and not attempt.billable:  # (an error answer: not
                self.sink.put(Record.answered(item.id))  # lost, wherever the ID ends)
            # (an unanswered request may have been billed: it keeps its slot, or a server that
            # bills what it could not deliver billed past --max-requests: 713 for 700)
            budget.release(attempt.billable or attempt.unanswered)
            retry = attempt.outcome is Outcome.RETRY
            limited = retry and attempt.status == 429
            # a retryable failure of the upstream; a paid (2xx) answer that did not parse is not
            # one (the server answered, and billed it), but one cut short or stalled on its way
            down = retry and not limited and (not attempt.unusable or attempt.kind in _ON_THE_WAY)
            retry_after = attempt.retry_after
            if retry_after is not None:
                retry_after = min(retry_after, self.config.retry_after_max)
            if attempt.kind is ErrorKind.LOCAL:  # (no file for a socket: nothing was sent, and
                gov.unused(ticket)  # nothing said of the API; a probe's ticket goes back)
                down = False
            else:
                # Only first tries in pass 1 of IDs with no failure behind them tell an outage
                # from bad IDs (pass 2, and a rerun's leftovers from earlier runs, are mostly
                # bad IDs).
                gov.on_response(ticket, item.id, limited=limited, failed=down,
                                retry_after=retry_after, evidence=first)
            # (A failed probe is charged, so an ID that is bad by itself cannot probe forever.)
            outage = down and gov.breaker_open and not ticket.probe
            verdict = decide(item, attempt, self.config, self.pass_no, outage=outage)
            if verdict.action is Action.HALT and self._retire(lane, attempt):
                verdict = Verdict(Action.PARK, charged=False)  # again, with another key
            self.act(item, attempt, verdict, lane)
            if budget.exhausted and not self.ledger.done.is_set():  # (the pass's last ID:
                stop.set(budget_halt(budget))  # finished; a pass 2 is halted before it starts)

    def _sent_nothing(self, item: Item, sent: Record, earlier: bool) -> None:
        """The try whose intent is ``sent`` ended before a request left (``earlier``: one for
        the ID left before in this pass): it is no request, nor a retry (the ID's next try
        is, if one left), and its intent is taken back."""
        self.requests -= 1
        self.retries -= earlier
        item.sent = earlier
        self.sink.put(sent.unsent(earlier))

    def _withdraw(self, item: Item, sent: Record) -> None:
        """``sent`` was committed (or may yet be) but its request does not leave: its budget
        reservation is given back and the intent taken back (``unsent``; ``item.sent``: an
        earlier request for the ID left in this pass, so the ID's intent stays open)."""
        self.budget.release(False)
        self.sink.put(sent.unsent(item.sent))

    def _leave(self, item: Item) -> None:
        """``item``'s intent was refused: this process stalled past its lease (a pause of the
        process, of its machine, of its link to the database) and another process of the job
        claimed the ID. It is that one's to send; its answers billed here are recorded."""
        self.left += 1
        if self.left == 1:
            log.warning("this process lost the lease of ID %r to another process of the job "
                        "(it was held up for longer than the lease): that one fetches it",
                        item.id)
        if item.paid:
            self.sink.put(billed_record(item))
        self.ledger.left(item)

    def _retire(self, lane: int, attempt: Attempt) -> bool:
        """A fatal answer with the key of ``lane``: with several keys, a 401/402 retires that
        key; ``True`` while another key is left to go on with."""
        gov = self.governor
        if len(gov.lanes) == 1 or attempt.status not in KEY_REFUSED:
            return False  # one key, or not the key's fault (a 403 made fatal, a hook): halt
        if gov.lanes[lane].retired:  # refused again, by a request already out with it
            return bool(gov.live)
        left = gov.retire(lane)
        if self.on_retire is not None:
            self.on_retire(lane, attempt, left)
        return left > 0

    def _first(self, item: Item) -> bool:
        """Whether ``item`` is on its first try in pass 1 with no failure behind it (from an
        earlier run), or on its first try in pass 2 after a skip-class answer in pass 1 (a
        404 that now fails otherwise says so of the API): only such tries tell something of
        the API rather than of the ID. (Pass 2's tries told nothing: an outage that lasted
        into pass 2 ended every one of its IDs confirmed unavailable, a 404's as a 503.)"""
        return item.tries == 0 and not item.suspect and (self.pass_no == 1 or item.witness)

    async def _send(self, item: Item, lane: int = 0, first: bool = True,
                    request: Request | None = None) -> Attempt:
        self.in_flight += 1
        if not item.covered:
            item.covered = True
            if not item.suspect:
                self.ledger.sent_first(item)
        if item.sent:  # a retry: what a try is not charged for too (the breaker's gate, a key)
            self.retries += 1
        item.sent = True
        self.flying.add(item.id)
        self.idle.clear()
        self.requests += 1
        try:  # (raises CancelledError, or what a request_for or classify hook raised)
            attempt = await self.fetcher.attempt(item.id, lane, first=first, request=request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
        self.flying.discard(item.id)
        return attempt

    def act(self, item: Item, attempt: Attempt, verdict: Verdict, lane: int = 0) -> None:
        """Carry out ``verdict`` (no await: nothing else runs in between)."""
        action = verdict.action
        if attempt.billable:
            item.paid += 1
            fp = self.fingerprints[lane]
            if fp is not None:
                by = item.paid_by
                if by is None:
                    by = item.paid_by = {}
                by[fp] = by.get(fp, 0) + 1
        if action is Action.HALT:
            gov = self.governor
            every = " (every API key has been refused)" if len(gov.lanes) > 1 and not gov.live \
                else ""
            self.stop.set(Halt("fatal", attempt.status, self.config.redact(
                f"fatal response {attempt.error or attempt.status}{every}")))
            if item.paid:  # unsettled, billed now or by an earlier try: recorded at the pass's end
                self.held[id(item)] = item
            return
        if attempt.unusable:  # (bought, not usable: as many more as paid_retries, in all runs;
            item.unusable += 1  # charged as a try or not: one at the breaker's gate is bought)
            self.sink.put(Record.unusable(item.id))
        if not verdict.charged:
            self.parking.park(item, verdict.delay)
            return
        item.tries += 1
        if action is Action.PARK:
            self.parking.park(item, verdict.delay)
            return
        rec = outcome_record(item, attempt, verdict.kind, permanent=verdict.permanent,
                             pass_no=self.pass_no, keep_data=self.keep_data, error=verdict.error)
        self.sink.put(rec)
        self.ledger.settled(item, rec)

    def holds(self) -> bool:
        """Whether the pass holds IDs (queued, in a worker's hand, parked for a retry)."""
        return bool(self.held or len(self.parking) or self.queue.qsize())

    def unsettled(self) -> list[Item]:
        """Items this pass still holds (parked, queued, in a worker's hand): after its end,
        the ones that were answered 2xx without being settled need their bill recorded."""
        return [*self.parking.items(), *self.queue.items(), *self.held.values()]

