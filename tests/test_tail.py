"""A realistic fault mix against the mock API in its own process, judged from the server's log:
the whole job finishes near its ideal time, every retry waits for its own backoff and nothing
else, and an outage is ridden out by the breaker. Bounds carry generous slack: these are
benchmark-style checks of mechanisms (a starved retry tail misses them by minutes), not timings.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from asyncrawl import Config, Crawler, Summary
from asyncrawl.retry import backoff_delay
from asyncrawl.testing import LogEntry, MockProcess, flaky_faults, requests_by_id

from .conftest import db_rows

# issue 11's job: 3,000 IDs, ~17 % need retries, 7 % are bad
N = 3000
RATE = 400.0
JOB: dict[str, Any] = dict(concurrency=32, rate=RATE, timeout=1.5, max_tries=5, backoff_max=4.0,
                          cooldown=2.0)


def cap(tries: int) -> float:
    """The longest backoff after ``tries`` failed tries (full jitter draws below it)."""
    return backoff_delay(tries, base=1.0, cap=JOB["backoff_max"], jitter="none")


def crawl(url: str, state: Path, ids: list[str], **kw: Any) -> tuple[Summary, dict[str, float]]:
    marks: dict[str, float] = {}

    def progress(p: Any) -> None:
        if p.cooling_down:
            marks.setdefault("cooldown", time.time())

    async def main() -> Summary:
        config = Config(url=url, state_dir=str(state), **{**JOB, **kw})
        async with Crawler(config, on_progress=progress, progress_every=0.05) as crawler:
            return await asyncio.wait_for(crawler.run(ids), 300)

    return asyncio.run(main()), marks


def test_flaky_mix_finishes_near_ideal_and_retries_wait_only_for_their_backoff(
        tmp_path: Path) -> None:
    ids = [f"id{i:06d}" for i in range(N)]
    with MockProcess(tmp_path / "mock.log", "--no-auth", "--faults", "flaky") as mock:
        summary, marks = crawl(mock.item_url, tmp_path / "state", ids)
        log: list[LogEntry] = mock.settled_log()
    gone = {i for i in ids if flaky_faults(i).kind == "gone"}
    assert summary.failed == 0 and summary.halt is None
    assert summary.ok + summary.unavailable == N
    assert summary.unavailable >= len(gone)

    starts = sorted(e.t for e in log if e.event == "start")
    span = max(e.t for e in log) - starts[0]
    chain = sum(cap(k) for k in range(1, JOB["max_tries"]))  # 1 + 2 + 4 + 4
    ideal = len(starts) / RATE + chain + JOB["cooldown"] + chain  # pass 1, cool-down, pass 2
    assert span <= 1.3 * ideal, f"job took {span:.1f} s, ideal {ideal:.1f} s"

    # Pass 1's retries: each starts within its own backoff (or its Retry-After) of the answer
    # before it, plus a little for the queue ahead of it at the rate. A retry budget or a
    # breaker holding the tail makes this seconds to minutes.
    cool = marks["cooldown"]
    late: list[tuple[float, str, int]] = []
    for item, reqs in requests_by_id(log).items():
        for k in range(1, len(reqs)):
            start, (_, prev_end, prev_status) = reqs[k][0], reqs[k - 1]
            if start >= cool or prev_end is None:
                break
            wait = max(cap(k), 1.0 if prev_status == 429 else 0.0)
            late.append((start - prev_end - wait, item, k))
    assert len(late) > 500
    assert max(late)[0] < 1.0, sorted(late)[-5:]

    # The tail made only of IDs that always answer 503 takes max_tries x backoff, not probes.
    by_id = requests_by_id(log)
    for item in gone:
        first_pass = [r for r in by_id[item] if r[0] < cool]
        assert len(first_pass) == JOB["max_tries"]
        assert first_pass[-1][0] - first_pass[0][0] <= chain + JOB["max_tries"] * 1.0


def test_an_outage_is_ridden_out_with_few_requests_and_nothing_failed(tmp_path: Path) -> None:
    n = 3000
    with MockProcess(tmp_path / "mock.log", "--no-auth", "--faults", "none",
                     "--outage", "2,8") as mock:
        summary, _ = crawl(mock.item_url, tmp_path / "state", [f"o{i:05d}" for i in range(n)],
                           rate=300.0, breaker_probe_max=2.0)
        log = mock.settled_log()
    t = sorted(e.t for e in log if e.event == "start")
    during = sum(1 for x in t if t[0] + 2.2 <= x < t[0] + 9.8)
    assert during < 50, during
    assert summary.ok == n and summary.failed == 0 and summary.unavailable == 0
    assert summary.halt is None
    # no ID was recorded failed because of the outage (which would have settled it in pass 2)
    deferred = db_rows(tmp_path / "state", "SELECT id FROM results WHERE outcome != 'ok' OR id IN "
                       "(SELECT id FROM items WHERE pass > 1)")
    assert deferred == []


def test_a_rerun_of_only_failed_ids_takes_backoff_time_not_probe_time(tmp_path: Path) -> None:
    """A rerun's leftovers are the IDs that failed before: their failing first tries say nothing
    about the upstream, so they neither open the breaker nor wait on its probes."""
    gone = [i for i in (f"g{n:05d}" for n in range(20000)) if flaky_faults(i).kind == "gone"][:30]
    assert len(gone) == 30
    state = tmp_path / "state"
    with MockProcess(tmp_path / "mock.log", "--no-auth", "--faults", "flaky") as mock:
        first, _ = crawl(mock.item_url, state, gone, second_pass=False)
        assert first.failed == 30
        t0 = time.monotonic()
        again, _ = crawl(mock.item_url, state, gone, second_pass=False)
        took = time.monotonic() - t0
    chain = sum(cap(k) for k in range(1, JOB["max_tries"]))
    assert again.failed == 30 and again.requests == 30 * JOB["max_tries"]
    assert took <= chain + 5.0, f"{took:.1f} s for a {chain:.0f} s backoff chain"
