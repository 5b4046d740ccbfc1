"""Governor scenarios: asyncrawl against the mock API running in its own process.

Each scenario starts ``python -m asyncrawl.testing`` with a server-side behaviour, runs a crawl
with the library, then judges the run from the *server's* request log (what the server saw is
what counts), and prints the figures with PASS/FAIL against the acceptance criteria:

* quota     the server enforces 40 req/s (429 + Retry-After: 1 beyond it); asyncrawl is set to
            200 req/s, concurrency 32, 1,500 IDs. After the first 5 s: 429s < 5% of requests
            and successful throughput >= 36 req/s; every ID ends ok.
* outage    4,000 IDs at 300 req/s; the server answers 503 to everything for 8 s starting 2 s
            in. < 50 requests during the outage, no ID deferred to pass 2, every ID ok.
* accuracy  rate 50, 600 IDs: every 1-second window holds <= rate x 1.05 + burst requests, and
            the mean rate is >= 97% of the configured one.
* tail      issue 11's flaky mix (``--faults flaky``: ~17% of IDs need retries), 3,000 IDs,
            concurrency 32, rate 400, timeout 1.5, max_tries 5, backoff_max 4, cool-down 2:
            the whole job within 1.3 x its ideal time, and every pass-1 retry starts within its
            own backoff cap (+ 1 s) of the answer before it.
* background the flaky mix's per-item 429s (0.3 % of IDs, ``Retry-After: 1``, whatever the rate)
            at rate 60, concurrency 16, 12,000 IDs: each may pause the job, but the rate must
            not ratchet down: until 90 % of IDs have had a first try, every 10-s window after the
            first holds >= 60 % of rate x 10 requests and the mean is >= 75 % of the rate
            (the pauses, up to 1 s a 429, are in: ~15 % at this rate).
* shared    three processes (``asyncrawl run``) on one PostgreSQL job against a 30 req/s quota
            (a fixed 1-s window, ``Retry-After: 1``, answers after 50 ms), each given rate 60,
            concurrency 8, lease 3, 1,500 IDs, started 1 s apart: the job-wide governor (pauses
            and cuts published, each process a share) must hold the quota as one process does:
            after the first 5 s, 429s < 5 % of requests and successful req/s >= 27 in every
            10-s window and on average; every ID ok. Needs the PostgreSQL server
            (``ASYNCRAWL_BENCH_PG``, default ``postgresql://postgres@127.0.0.1:5432/test``).
            Run by name only: its target is not met yet (bench/README.md, stop 47), and
            ``bench/shared_sim.py`` is the quicker first check of a change.
            ``ASYNCRAWL_BENCH_KEEP=DIR`` keeps the mock's and the processes' logs.

Usage: ``.venv/bin/python bench/governor.py [quota|outage|accuracy ...]`` (default: all but
``shared``).
Exit status 0 when every scenario passed.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrawl import Config, Crawler, Summary
from asyncrawl.store import read_store
from asyncrawl.testing import LogEntry, MockProcess, most_in_window, read_log, requests_by_id


def crawl(url: str, state: Path, n: int, **kw: Any) -> Summary:
    config = Config(url=url + "/items/{id}", state_dir=str(state), **{"cooldown": 1.0, "timeout": 10.0, **kw})

    async def main() -> Summary:
        async with Crawler(config) as crawler:
            return await crawler.run([f"id{i:05d}" for i in range(n)])

    return asyncio.run(main())


def run_scenario(mock_args: list[str], n: int, judge: Callable[[list[LogEntry], Summary, Path], list[
        tuple[str, float, str, bool]]], **kw: Any) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        log, state = Path(tmp) / "mock.log", Path(tmp) / "state"
        with MockProcess(log, "--no-auth", "--faults", "none", *mock_args) as mock:  # last wins
            summary = crawl(mock.url, state, n, **kw)
        rows = judge(read_log(log), summary, state)
    ok = True
    for name, value, target, passed in rows:
        ok &= passed
        print(f"  {name:<42} {value:>10.2f}   {target:<18} {'PASS' if passed else 'FAIL'}")
    return ok


def starts(log: list[LogEntry]) -> list[float]:
    return sorted(e.t for e in log if e.event == "start")


def quota() -> bool:
    print("quota: server 40 req/s hard, asyncrawl 200 req/s, concurrency 32, 1,500 IDs")

    def judge(log: list[LogEntry], s: Summary, state: Path) -> list[tuple[str, float, str, bool]]:
        ends = sorted((e.t, e.status) for e in log if e.event == "end")
        t0 = starts(log)[0]
        late = [st for t, st in ends if t >= t0 + 5]
        span = ends[-1][0] - (t0 + 5)
        share429 = sum(1 for st in late if st == 429) / max(len(late), 1)
        ok_rate = sum(1 for st in late if st == 200) / span if span > 0 else 0.0
        early429 = sum(1 for t, st in ends if st == 429 and t < t0 + 5)
        return [
            ("429 share after the first 5 s (%)", 100 * share429, "< 5", share429 < 0.05),
            ("successful req/s after the first 5 s", ok_rate, ">= 36", ok_rate >= 36),
            ("429s in the first 5 s (for information)", early429, "-", True),
            ("IDs ok (of 1,500)", s.ok, "= 1500", s.ok == 1500),
        ]

    return run_scenario(["--quota", "40"], 1500, judge, rate=200.0, concurrency=32)


def outage() -> bool:
    print("outage: 4,000 IDs at 300 req/s; server answers 503 to all from 2 s to 10 s")

    def judge(log: list[LogEntry], s: Summary, state: Path) -> list[tuple[str, float, str, bool]]:
        t = starts(log)
        t0 = t[0]
        during = sum(1 for x in t if t0 + 2 <= x < t0 + 10)
        deferred = len(list(read_store(state).records("unavailable"))) + sum(
            1 for r in read_store(state).records("ok") if r.pass_no > 1)  # settled in pass 2
        return [
            ("requests sent during the outage", during, "< 50", during < 50),
            ("IDs deferred to pass 2", deferred, "= 0", deferred == 0),
            ("IDs ok (of 4,000)", s.ok, "= 4000", s.ok == 4000),
            ("run time, s (for information)", s.elapsed, "-", True),
        ]

    return run_scenario(["--outage", "2,8"], 4000, judge, rate=300.0, concurrency=32,
                        breaker_probe_max=2.0)


def accuracy() -> bool:
    rate, burst = 50.0, 50
    print(f"accuracy: rate {rate:g}, burst {burst}, 600 IDs")

    def judge(log: list[LogEntry], s: Summary, state: Path) -> list[tuple[str, float, str, bool]]:
        t = starts(log)
        most = most_in_window(t)
        # The mean over the steady part: after the initial burst has been spent.
        steady = t[burst:]
        mean = (len(steady) - 1) / (steady[-1] - steady[0])
        return [
            ("most requests in any 1-second window", most, f"<= {rate * 1.05 + burst:g}",
             most <= rate * 1.05 + burst),
            ("mean req/s after the initial burst", mean, f">= {0.97 * rate:g}", mean >= 0.97 * rate),
            ("IDs ok (of 600)", s.ok, "= 600", s.ok == 600),
        ]

    return run_scenario([], 600, judge, rate=rate, burst=burst, concurrency=16)


def tail() -> bool:
    print("tail: flaky mix, 3,000 IDs, rate 400, concurrency 32, max_tries 5, backoff_max 4")
    job: dict[str, Any] = dict(rate=400.0, concurrency=32, timeout=1.5, max_tries=5,
                               backoff_max=4.0, cooldown=2.0)

    def cap(k: int) -> float:
        return min(4.0, 2.0 ** (k - 1))

    def judge(log: list[LogEntry], s: Summary, state: Path) -> list[tuple[str, float, str, bool]]:
        t = starts(log)
        span = max(e.t for e in log) - t[0]
        chain = sum(cap(k) for k in range(1, 5))
        ideal = len(t) / 400 + 2 * chain + 2.0
        # pass-1 retries: an ID's requests before its count reaches max_tries, answered 5xx/429
        late = []
        for reqs in requests_by_id(log).values():
            for k in range(1, min(len(reqs), 5)):
                end, status = reqs[k - 1][1], reqs[k - 1][2]
                if end is None or status not in (0, 429, 500, 502, 503, 504):
                    break
                late.append(reqs[k][0] - end - max(cap(k), 1.0 if status == 429 else 0.0))
        worst = max(late) if late else 0.0
        return [
            ("whole job / ideal", span / ideal, "<= 1.3", span / ideal <= 1.3),
            ("run time, s (for information)", span, "-", True),
            ("pass-1 retry started late by at most, s", worst, "< 1", worst < 1.0),
            ("IDs failed at the end", s.failed, "= 0", s.failed == 0),
        ]

    return run_scenario(["--faults", "flaky"], 3000, judge, **job)


def background() -> bool:
    rate = 60.0
    print(f"background: flaky mix (0.3 % per-item 429s), rate {rate:g}, concurrency 16, 12,000 IDs")

    def judge(log: list[LogEntry], s: Summary, state: Path) -> list[tuple[str, float, str, bool]]:
        t = starts(log)
        refused = sorted(e.t for e in log if e.event == "end" and e.status == 429)
        # while fresh IDs wait (until 90 % have had a first try): the rate binds, not the tail
        busy = sorted(reqs[0][0] for reqs in requests_by_id(log).values())[int(0.9 * 12000)]
        t0, bins = t[0], []
        t = t[:bisect.bisect_left(t, busy)]
        for k in range(1, int((t[-1] - t0) // 10)):  # whole 10-s windows after the first
            lo, hi = t0 + 10 * k, t0 + 10 * (k + 1)
            bins.append((bisect.bisect_left(t, hi) - bisect.bisect_left(t, lo)) / (rate * 10))
        mean = (len(t) - 1) / (t[-1] - t0) / rate
        held = bisect.bisect_left(refused, t[-1])
        return [
            ("lowest 10-s window / rate", min(bins), ">= 0.60", min(bins) >= 0.6),
            ("mean req/s / rate", mean, ">= 0.75", mean >= 0.75),
            ("429s while busy (each may pause the job 1 s)", held, "-", True),
            ("IDs failed at the end", s.failed, "= 0", s.failed == 0),
        ]

    return run_scenario(["--faults", "flaky"], 12000, judge, rate=rate, concurrency=16,
                        timeout=5.0, max_tries=5, backoff_max=4.0, cooldown=2.0)


def shared(runs: int = 3) -> bool:
    """``runs`` processes (1: the same job by one process, for comparison)."""
    quota_rate, n = 30, 1500
    pg = os.environ.get("ASYNCRAWL_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
    print(f"shared: {runs} processes on one PostgreSQL job, server {quota_rate} req/s (1-s window), "
          f"each rate 60, concurrency 8, {n:,} IDs")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(os.environ.get("ASYNCRAWL_BENCH_KEEP", tmp))  # a directory to keep the logs in
        work.mkdir(parents=True, exist_ok=True)
        log = work / "mock.log"
        ids = work / "ids.txt"
        ids.write_text("".join(f"id{i:05d}\n" for i in range(n)))
        job = f"bench-shared-{uuid.uuid4().hex[:8]}"
        with MockProcess(log, "--no-auth", "--faults", "none", "--latency", "0.05",
                         "--quota", str(quota_rate)) as mock:
            cfg = work / "job.toml"
            cfg.write_text(f'[request]\nurl = "{mock.item_url}"\n[limits]\nrate = 60\nconcurrency = 8\n'
                           f'[passes]\ncooldown = 3\n[state]\nlease = 3\n')
            procs = []
            for k in range(runs):
                if k:
                    time.sleep(1.0)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg), "--ids", str(ids),
                     "--state", pg, "--job", job, "--no-progress", "--log-file",
                     str(work / f"run{k}.log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            codes = []
            for proc in procs:
                _, err = proc.communicate(timeout=600)
                (work / f"run{len(codes)}.err").write_text(err)
                codes.append(proc.returncode)
                if proc.returncode:
                    print(f"  a process exited {proc.returncode}: {err.strip()[-400:]}")
        entries = read_log(log)
    ends = sorted((e.t, e.status) for e in entries if e.event == "end")
    t0 = starts(entries)[0]
    late = [(t, st) for t, st in ends if t >= t0 + 5]
    span = late[-1][0] - (t0 + 5) if late else 0.0
    share429 = sum(1 for _, st in late if st == 429) / max(len(late), 1)
    ok_rate = sum(1 for _, st in late if st == 200) / span if span > 0 else 0.0
    oks = sorted(t for t, st in late if st == 200)
    windows = [bisect.bisect_left(oks, t0 + 5 + 10 * (k + 1)) - bisect.bisect_left(oks, t0 + 5 + 10 * k)
               for k in range(int(span // 10))]
    lowest = min(windows) / 10 if windows else 0.0
    ok_ids = {e.id for e in entries if e.event == "end" and e.status == 200}
    rows = [
        ("429 share after the first 5 s (%)", 100 * share429, "< 5", share429 < 0.05),
        ("successful req/s after the first 5 s", ok_rate, ">= 27", ok_rate >= 27),
        ("lowest 10-s window, successful req/s", lowest, ">= 27", lowest >= 27),
        ("429s in all (for information)", sum(1 for _, st in ends if st == 429), "-", True),
        ("job time, s (for information)", ends[-1][0] - t0, "-", True),
        (f"IDs answered 200 (of {n:,})", len(ok_ids), f"= {n}", len(ok_ids) == n),
        ("processes exited 0", sum(1 for c in codes if c == 0), f"= {runs}", codes == [0] * runs),
    ]
    ok = True
    for name, value, target, passed in rows:
        ok &= passed
        print(f"  {name:<42} {value:>10.2f}   {target:<18} {'PASS' if passed else 'FAIL'}")
    return ok


SCENARIOS = {"quota": quota, "outage": outage, "accuracy": accuracy, "tail": tail,
             "background": background, "shared": shared}
DEFAULT = ("quota", "outage", "accuracy", "tail", "background")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"any of {', '.join(SCENARIOS)} (default: {', '.join(DEFAULT)})")
    args = p.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario {sorted(unknown)[0]!r}; choose from {', '.join(SCENARIOS)}")
    results = {name: SCENARIOS[name]() for name in args.scenarios or DEFAULT}
    print("\n" + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
