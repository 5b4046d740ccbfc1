"""Progress for people: the live view on a terminal, periodic one-line summaries elsewhere, error
reasons counted and aggregated for the log, and the final summary. Everything here formats
``Progress`` / ``Summary`` values and counts what the hooks report; it never decides anything.

::

    on_attempt ─► ErrorTally ──► top reasons (LiveView)
    on_result ──┘      └───────► drain(): one log line per error kind per interval
    on_progress ──► LiveView (terminal) | line() (logs, pipes)
    Summary ──────► summary_text(): what happened, and what to do next

The numbers themselves (rate, ETA, ``live.json``) are computed by ``live.py``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from .types import Halt, Progress, Result, Summary, ids_left


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _flags(p: Progress) -> list[str]:
    """What holds the job back right now, in words."""
    flags = []
    if p.paused_for > 0:
        flags.append(f"paused {p.paused_for:.0f}s (server asked)")
    if p.breaker_open:
        flags.append("upstream down: probing")
    return flags


def line(p: Progress) -> str:
    """One compact line (the periodic progress lines off a terminal, and the logs)."""
    total = f"/{p.total:,}" if p.total is not None else ""
    phase = "cool-down" if p.cooling_down else f"pass {p.pass_no}"
    parts = [
        f"[{phase}] {p.done:,}{total}",
        f"ok {p.ok:,}",
        f"failed {p.failed:,}",
        f"unavailable {p.unavailable:,}",
        f"retries {p.retries:,}",
        f"{p.rate:,.0f} req/s",
    ]
    if p.skipped:
        parts.insert(2, f"already done {p.skipped:,}")
    if p.effective_rate and p.effective_rate < p.configured_rate:
        parts.append(f"limit {p.effective_rate:,.1f}/{p.configured_rate:,.0f} req/s (adapted)")
    parts += _flags(p)
    if p.total is not None and p.pass_no == 1:
        parts.append(f"ETA {_duration(p.eta)}")
    return " | ".join(parts)


# -- error reasons -----------------------------------------------------------------------------


def answer_kind(status: int, body_ok: bool) -> str | None:
    """The error kind of one HTTP answer, or ``None`` for a good one (2xx with a parsable body)."""
    if 200 <= status < 300:
        return None if body_ok else f"HTTP {status} (2xx body is not valid JSON)"
    return f"HTTP {status}"


def result_kind(status: int | None, error: str | None) -> str:
    """The error kind of a recorded failure: its status, or the first part of its error
    ("timeout", "ServerDisconnectedError") — never the per-ID details, so that kinds repeat."""
    if error and error.startswith("HTTP "):
        return error.split(":", 1)[0]  # "HTTP 404", "HTTP 200, body code 402"
    head = (error or "unknown error").split(": ", 1)[0]
    if head.count("(") > head.count(")") and " (" in head:  # the ": " was inside a cause in
        head = head[:head.rindex(" (")]  # parentheses ("the proxy h:p (OSError: ...)"): before it
    return f"HTTP {status} ({head})" if status is not None else head


@dataclass(slots=True)
class _Window:
    count: int = 0
    recorded: Counter[str] = field(default_factory=Counter)
    example: tuple[str, str | None] | None = None


@dataclass(frozen=True, slots=True)
class ErrorBurst:
    """One error kind over one interval: what a single aggregated log line says."""

    kind: str
    count: int  # answers (or, for kinds with no answer such as timeouts, recorded IDs)
    seconds: float
    recorded: dict[str, int]  # outcome -> IDs recorded with this kind in the interval
    example_id: str | None = None
    example_error: str | None = None

    def message(self) -> str:
        span = f"in the last {self.seconds:.0f} s" if self.seconds >= 10 else \
            f"in the last {self.seconds:.1f} s"
        text = f"{self.kind} × {self.count:,} {span}" if self.count else f"{self.kind} {span}"
        if self.recorded:
            ids = ", ".join(f"{n:,} recorded {o}" for o, n in sorted(self.recorded.items()))
            text += f"; {ids}"
            if self.example_id is not None:
                text += f" (e.g. ID {self.example_id!r}"
                if self.example_error and self.example_error != self.kind:
                    text += f": {self.example_error}"
                text += ")"
        return text

    def fields(self) -> dict[str, Any]:
        return {"reason": self.kind, "count": self.count, "window_s": round(self.seconds, 1),
                "recorded": dict(self.recorded), "example_id": self.example_id}


class ErrorTally:
    """Error reasons by kind: in total (the live view's top reasons) and since the last
    ``drain`` (the log: one line per kind per interval, however many errors — a storm of 503s
    is one line, and never buries the line saying why the job stopped).

    ``attempt`` counts every failed attempt as it comes back (``Crawler(on_attempt=...)``):
    "connection refused to 127.0.0.1:9 × 300" means 300 tries, not 300 IDs. ``result`` then
    only notes which outcome IDs were recorded with. (Without attempts: ``answer`` counts each
    error answer seen by an observing classifier and ``result`` counts the kinds no classifier
    sees, such as timeouts, once recorded; with ``answers=False`` every recorded failure counts.)
    """

    MAX_KINDS = 8  # log lines per interval; the rest are summed into one

    def __init__(self, *, answers: bool = True, attempts: bool = False) -> None:
        self.answers = answers
        self.attempts = attempts
        self.total: Counter[str] = Counter()
        self._window: dict[str, _Window] = {}
        self._since = time.monotonic()

    def __repr__(self) -> str:
        return f"<ErrorTally kinds={len(self.total)} pending={len(self._window)} top={self.top(2)}>"

    def _at(self, kind: str) -> _Window:
        w = self._window.get(kind)
        if w is None:
            w = self._window[kind] = _Window()
        return w

    def answer(self, status: int, body_ok: bool = True) -> None:
        kind = answer_kind(status, body_ok)
        if kind is not None:
            self._at(kind).count += 1
            self.total[kind] += 1

    def attempt(self, item_id: str, status: int | None, error: str | None) -> None:
        if error is None:
            return
        kind = result_kind(status, error)
        w = self._at(kind)
        w.count += 1
        self.total[kind] += 1
        if w.example is None:
            w.example = (item_id, error)

    def result(self, r: Result) -> None:
        if r.outcome == "ok":
            return
        kind = result_kind(r.status, r.error)
        w = self._at(kind)
        w.recorded[r.outcome] += 1
        if w.example is None:
            w.example = (r.id, r.error)
        seen = self.attempts or (self.answers and r.status is not None
                and kind in (answer_kind(r.status, True), answer_kind(r.status, False)))
        if not seen:
            w.count += 1
            self.total[kind] += 1

    def top(self, n: int = 3) -> list[tuple[str, int]]:
        return self.total.most_common(n)

    def drain(self) -> list[ErrorBurst]:
        """What happened since the last drain, one ``ErrorBurst`` per kind, most frequent first."""
        now = time.monotonic()
        seconds, self._since = now - self._since, now
        window, self._window = self._window, {}
        bursts = [ErrorBurst(k, w.count, seconds, dict(w.recorded),
                             w.example[0] if w.example else None,
                             w.example[1] if w.example else None)
                  for k, w in sorted(window.items(), key=lambda kv: -kv[1].count)]
        if len(bursts) > self.MAX_KINDS:
            rest = bursts[self.MAX_KINDS - 1:]
            recorded: Counter[str] = Counter()
            for b in rest:
                recorded.update(b.recorded)
            bursts = [*bursts[:self.MAX_KINDS - 1],
                      ErrorBurst(f"{len(rest)} other kinds", sum(b.count for b in rest), seconds,
                                 dict(recorded))]
        return bursts


# -- displays ----------------------------------------------------------------------------------


class LiveView:
    """A compact multi-line view redrawn in place on a terminal (plain ANSI, no dependency)::

        asyncrawl  pass 1  ██████████░░░░░░░░░░░░░░  42%  4,212/10,000  0:42  ETA 0:57
          ok 4,100   failed 80   unavailable 0   retried 312
          rate 98.4 req/s   limit 100.0/100 req/s   in flight 16   waiting to retry 5
          state running
          errors HTTP 503 × 290 · HTTP 404 × 61 · timeout × 4

    ``clear()`` erases it (before a log line is printed, and at the end); the next frame draws
    it again below whatever was printed.
    """

    def __init__(self, stream: TextIO, errors: ErrorTally | None = None, *, bar: int = 24) -> None:
        self.stream = stream
        self.errors = errors
        self.bar = bar
        self.height = 0  # lines on screen now
        self._pass1: Progress | None = None  # the last pass-1 snapshot: pass 2's starting point
        self._pass2_start: tuple[float, int] | None = None

    def __repr__(self) -> str:
        return f"<LiveView height={self.height}>"

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return 100

    def frame(self, p: Progress) -> list[str]:
        """The lines of one frame (without ANSI codes)."""
        if p.pass_no == 1:
            self._pass1 = p
        total, done, eta = p.total, p.done, p.eta
        if p.pass_no > 1 and self._pass1 is not None:
            # pass 2 runs the IDs pass 1 recorded failed; each ends ok or unavailable
            total = self._pass1.failed
            done = min(total, p.unavailable + max(0, p.ok - self._pass1.ok))
            if self._pass2_start is None:
                self._pass2_start = (p.elapsed, done)
            t0, d0 = self._pass2_start
            eta = (total - done) / ((done - d0) / (p.elapsed - t0)) if done > d0 else None
        phase = "cool-down before pass 2" if p.cooling_down else f"pass {p.pass_no}"
        head = f"asyncrawl  {phase}"
        if total:
            frac = min(1.0, done / total)
            fill = int(frac * self.bar)
            head += (f"  {'█' * fill}{'░' * (self.bar - fill)} {frac:4.0%}  {done:,}/{total:,}")
        else:
            head += f"  {done:,} settled"
        head += f"  {_duration(p.elapsed)}"
        if total and not p.cooling_down:
            head += f"  ETA {_duration(eta)}"
        failed = f"failed {p.failed:,}" if p.pass_no == 1 else f"failed, left to retry {p.failed:,}"
        counts = (f"  ok {p.ok:,}   {failed}   unavailable {p.unavailable:,}"
                  f"   retried {p.retries:,}")
        if p.skipped:
            counts += f"   already done {p.skipped:,}"
        limit = p.effective_rate or p.configured_rate
        rate = f"  rate {p.rate:,.1f} req/s   limit {limit:,.1f}/{p.configured_rate:,.0f} req/s"
        if p.effective_rate and p.effective_rate < p.configured_rate:
            rate += " (adapted)"
        rate += f"   in flight {p.in_flight:,}   waiting to retry {p.parked:,}"
        lines = [head, counts, rate, f"  state {', '.join(_flags(p)) or 'running'}"]
        top = self.errors.top(3) if self.errors is not None else []
        if top:
            lines.append("  errors " + " · ".join(f"{k} × {n:,}" for k, n in top))
        return lines

    def __call__(self, p: Progress) -> None:
        cols = max(20, self._columns() - 1)  # a line that wraps would break the redraw
        lines = [ln[:cols] for ln in self.frame(p)]
        out = [self._up()]
        out.append("\n".join("\x1b[2K" + ln for ln in lines))
        out.append("\x1b[J")  # anything left below from a taller frame
        self.stream.write("".join(out))
        self.stream.flush()
        self.height = len(lines)

    def _up(self) -> str:
        """Back to the first column of the view's first line."""
        return "\r" + (f"\x1b[{self.height - 1}A" if self.height > 1 else "")

    def clear(self) -> None:
        if self.height:
            self.stream.write(self._up() + "\x1b[J")
            self.stream.flush()
            self.height = 0

    def close(self) -> None:
        self.clear()


# -- the final summary -------------------------------------------------------------------------


def halt_text(h: Halt) -> tuple[str, str]:
    """(what stopped the run, what to do next) in the operator's words."""
    if h.reason == "fatal":
        if h.status == 402:
            return ("HTTP 402 insufficient balance (Payment Required)",
                    "top up, then rerun the same command: nothing is fetched twice")
        if h.status == 401:
            return ("HTTP 401 the API key was refused (Unauthorized)",
                    "fix the key (where the config puts it: [request.headers] or -H, "
                    "[request.params], [request] keys), then rerun the same command")
        if h.status == 403:
            return ("HTTP 403 forbidden: the key may not use this endpoint",
                    "fix the key's permissions, then rerun the same command")
        code = f"HTTP {h.status} " if h.status else ""
        return (f"{code}fatal response: {h.message}",
                "fix the cause, then rerun the same command: nothing is fetched twice")
    if h.reason == "budget":
        return (h.message or "request budget reached",
                "raise --max-requests or [billing] max_spend, then rerun the same command "
                "to go on: nothing is fetched twice")
    if h.reason == "storage" and "held up past its lease" in h.message:  # (RunEndedError)
        return (f"the job went on without this process: {h.message}",
                "rerun the same command to resume: what was committed is kept")
    if h.reason == "storage" and ("PostgreSQL" in h.message  # (pgstore's errors say so)
                                  or h.message.startswith(("postgresql://", "postgres://"))):
        return (f"the job's database failed: {h.message}",
                "once the database answers again, rerun the same command: what was committed "
                "is kept")
    if h.reason == "storage":
        return (f"local storage failure: {h.message}",
                "free space or fix the disk, then rerun the same command: what was saved is kept")
    if h.reason == "signal":
        return (h.message, "rerun the same command to resume; nothing that succeeded is fetched again")
    if h.reason == "unreachable":
        return (f"the API cannot be reached: {h.message}",
                "fix the config, then rerun the same command")
    return (h.message or h.reason, "rerun to resume; nothing that succeeded is fetched again")


def summary_text(s: Summary, *, total: int | None = None, price: float | None = None,
                 currency: str = "USD", errors: list[tuple[str, int]] | None = None) -> str:
    """The final summary: what happened, and what to do next.

    Args:
        s: the run's summary.
        total: the number of (non-blank) lines of the IDs list, when known: says how much is left.
        price: ``[billing] price_per_call``: adds the cost of this run and of what is left.
        currency: the price's currency.
        errors: the most frequent error kinds of the run, counted by attempt.
    """
    rows = [
        ("ok", f"{s.ok:,}" + (f"  ({s.fetched:,} fetched now)" if s.fetched != s.ok else "")),
        ("failed", f"{s.failed:,}" + ("  (retried by the next run)" if s.failed else "")),
        ("unavailable", f"{s.unavailable:,}" + ("  (confirmed: export --outcome unavailable)"
                                                if s.unavailable else "")),
    ]
    left, unread = ids_left(s, total)
    if left:
        text = f"{'up to ' if unread else ''}{left:,}"
        if total is None:
            text += " IDs"
        elif unread:  # (the duplicates among the lines not read yet are not known)
            text += f" of a list of {total:,} lines"
        else:
            text += f" of {total - s.duplicates:,} IDs"  # (a duplicate line is no ID to fetch)
        if price is not None:
            text += f" ≈ {left * price:,.4f} {currency}"
        if unread:
            text += f" ({unread:,} not read yet; `asyncrawl run --dry-run` counts exactly)"
        rows.append(("left", text))
    if s.skipped:
        rows.append(("already done", f"{s.skipped:,} (skipped, not fetched again)"))
    if s.duplicates:
        rows.append(("duplicates", f"{s.duplicates:,} (fetched once)"))
    rows.append(("requests", f"{s.requests:,} ({s.billable:,} billable, {s.retries:,} retries"
                             + (f", {s.unanswered:,} unanswered: possibly billed; the IDs: "
                                "`asyncrawl export --outcome unanswered`" if s.unanswered
                                else "")
                             + (f", {s.cut_off:,} cut off in flight: in doubt, possibly billed; "
                                "the IDs: `asyncrawl export --outcome in-doubt`" if s.cut_off
                                else "") + ")"))
    if errors:
        rows.append(("errors", " · ".join(f"{k} × {n:,}" for k, n in errors)))
    if price is not None:
        rows.append(("cost", f"{s.billable * price:,.4f} {currency} this run "
                             f"({s.billable:,} billable calls at {price:g})"))
    rows += [
        ("time", f"{_duration(s.elapsed)} ({s.elapsed:.1f}s)"),
        ("state", s.state_dir),
    ]
    head = "asyncrawl: finished"
    if s.halt is not None:
        what, then = halt_text(s.halt)
        head = f"asyncrawl: stopped early: {what}"
        rows.append(("halted", f"{what} — {then}"))
    elif s.failed or s.pending:
        rows.append(("next", "rerun the same command to retry what failed"))
    else:
        rows.append(("next", "done: `asyncrawl export` writes the results"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def summary_fields(s: Summary, *, total: int | None = None) -> dict[str, Any]:
    """The summary as one flat object (the ``summary`` event of ``--log-format json``)."""
    left, unread = ids_left(s, total)
    return {"ok": s.ok, "failed": s.failed, "unavailable": s.unavailable, "left": left,
            "left_is_upper_bound": unread > 0, "fetched": s.fetched, "skipped": s.skipped,
            "duplicates": s.duplicates, "requests": s.requests, "billable": s.billable,
            "retries": s.retries, "unanswered": s.unanswered, "cut_off": s.cut_off,
            "elapsed_s": round(s.elapsed, 3),
            "exit_code": s.exit_code,
            "halt": s.halt.as_dict() if s.halt is not None else None, "state_dir": s.state_dir}
