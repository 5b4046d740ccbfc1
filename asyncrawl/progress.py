"""Progress for people: a live line on a terminal, periodic one-line summaries elsewhere, and the
final summary. Everything here only formats ``Progress`` / ``Summary`` values; it never decides.
"""

from __future__ import annotations

from typing import TextIO

from .crawler import Progress, Summary

WHAT_NEXT = {
    "fatal": "fix the cause (API key, balance), then rerun the same command: nothing is fetched twice",
    "budget": "the request budget is spent; rerun (with a new --max-requests) to go on",
    "storage": "free space or fix the disk, then rerun the same command: what was saved is kept",
    "signal": "rerun the same command to resume; nothing that succeeded is fetched again",
    "cancelled": "rerun to resume; nothing that succeeded is fetched again",
}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def line(p: Progress) -> str:
    """One compact line (used both live and in logs)."""
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
    if p.paused_for > 0:
        parts.append(f"paused {p.paused_for:.0f}s (server asked)")
    if p.breaker_open:
        parts.append("upstream down: probing")
    if p.retry_budget_waiting:
        parts.append("retries held (retry budget)")
    if p.total is not None and p.pass_no == 1:
        parts.append(f"ETA {_duration(p.eta)}")
    return " | ".join(parts)


class LiveLine:
    """Redraws one status line on a terminal, with a bar when the total is known."""

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        bar = ""
        if p.total:
            frac = min(1.0, p.done / p.total)
            fill = int(frac * self.width)
            bar = f"{'█' * fill}{'░' * (self.width - fill)} {frac:4.0%} "
        self.stream.write(f"\r\x1b[K{bar}{line(p)}")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class PeriodicLines:
    """One line per call, for logs and pipes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, p: Progress) -> None:
        self.stream.write(f"asyncrawl: {line(p)}\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def summary_text(s: Summary) -> str:
    """The final summary: what happened, and what to do next."""
    rows = [
        ("ok", f"{s.ok:,}" + (f"  ({s.fetched:,} fetched now)" if s.fetched != s.ok else "")),
        ("failed", f"{s.failed:,}"),
        ("unavailable", f"{s.unavailable:,}"),
    ]
    if s.pending:
        rows.append(("not tried yet", f"{s.pending:,}"))
    if s.skipped:
        rows.append(("already done", f"{s.skipped:,} (skipped, not fetched again)"))
    if s.duplicates:
        rows.append(("duplicates", f"{s.duplicates:,} (fetched once)"))
    rows += [
        ("requests", f"{s.requests:,} ({s.billable:,} billable, {s.retries:,} retries)"),
        ("time", f"{_duration(s.elapsed)} ({s.elapsed:.1f}s)"),
        ("state", s.state_dir),
    ]
    if s.halt is not None:
        status = f" (HTTP {s.halt.status})" if s.halt.status else ""
        rows.append(("halted", f"{s.halt.reason}{status}: {s.halt.message}"))
        rows.append(("next", WHAT_NEXT.get(s.halt.reason, "rerun the same command to resume")))
    elif s.failed or s.pending:
        rows.append(("next", "rerun the same command to retry what failed"))
    else:
        rows.append(("next", "done: `asyncrawl export` writes the results"))
    width = max(len(k) for k, _ in rows)
    head = "asyncrawl: finished" if s.halt is None else "asyncrawl: stopped early"
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])
