"""kill -9 torture: a real ``asyncrawl run`` against the mock API, SIGKILLed at random instants.

What it does
------------
Starts the fault-injecting mock API in its own process (``python -m asyncrawl.testing --faults
demo --payload-bytes B --log LOG``: about 15 % of the IDs misbehave, every payload is padded to
``B`` bytes so that records are large and a kill often lands while the writer is writing or
fsyncing the WAL), then ``--kills`` times: starts ``python -m asyncrawl run`` in a fresh process on the
same state directory and SIGKILLs it

* ``startup`` (some of the kills): at a random instant in the first 0.7 s -- while Python starts,
  the state database is opened and recovered, or the first requests go out (sooner if records
  were committed as below);
* ``running``: once a random number of records were committed (on average about half of
  1/(kills left) of the records left to write), after a further random 0-50 ms -- so the kill
  falls anywhere in the write / fsync / request cycle, in pass 1, the cool-down or pass 2;
* ``on-write``: once that many records were committed, the instant the WAL is written again --
  while the writer is in the middle of a (large) transaction, or has just begun its fsync;
* ``cool-down`` / ``pass-2`` (the last tenth of the kills, alternately): once the run is in its
  cool-down (its ``live.json`` says so) or once pass 2 has begun (the mock sees an unfetchable ID
  again after its pass-1 tries), after a further random 0-100 ms. A run can only get there when
  its pass 1 has drained, so these runs first go through everything left.

After the kills, one last run is left to finish (it must exit 0).

What it checks (any violation is printed and makes the exit status 1)
---------------------------------------------------------------------
From the mock's own request log and the state database as the killed process left it (read
with ``sqlite3``, independently of asyncrawl's store):

* *in doubt* after each kill: ``export --outcome in-doubt`` lists exactly the IDs in doubt
  before, plus ``J`` = the IDs with a durable ``sent`` record in the killed run and no outcome
  record after it. ``E`` = the IDs the mock *received* in that run with no settled (outcome)
  record at the crash must all be in ``J`` ("missing" must be 0); ``J`` may exceed ``E`` only by
  IDs whose durable ``sent`` record was written but whose request never reached the mock
  ("never reached", counted separately);
* no run ever requests an ID that was durably ``ok`` or ``unavailable`` when it started;
* re-fetched after success: IDs the mock answered (billed) during a killed run whose result was
  not durable at the kill and that were billed again later; per kill at most ``concurrency`` +
  the writer's batch limit, and none of them durable at the kill;
* at the end: ``export --outcome ok`` holds every fetchable ID exactly once with its exact payload
  (``payload_for(id, pad=B)``); ``export --outcome unavailable`` is exactly the IDs the demo fault
  mix makes unfetchable (not_found 404, bad_request 400, gone 500 on every attempt) with that
  status; nothing is left ``failed``; every re-fetched ID is reported "possibly billed twice".

Usage::

    .venv/bin/python bench/torture.py --kills 60 --ids 4000 [--concurrency 16]
        [--payload-bytes 65536] [--seed S] [--workdir DIR] [--keep]

The state directory must be on a real disk (fsync is a no-op on tmpfs): by default a temporary
directory under ``/tmp``, or under ``bench/.work/`` when ``/tmp`` is a tmpfs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from asyncrawl.lockfile import lock_holder  # noqa: E402
from asyncrawl.sqlproc import pending_records  # noqa: E402
from asyncrawl.sqlstore import DB  # noqa: E402
from asyncrawl.testing import LogEntry, MockProcess, demo_faults, payload_for  # noqa: E402
from asyncrawl.writer import Writer  # noqa: E402

KEY = "torture-key"
ENV = {"ASYNCRAWL_TORTURE_KEY": KEY}
BATCH_LIMIT: int = inspect.signature(Writer).parameters["batch_limit"].default
RUN_LIMIT = 60.0  # seconds: a killed run that has not reached its kill point by then is killed
COOLDOWN = 1.5  # seconds: long enough to be seen in live.json (written every second)
MAX_TRIES = 3
PASS_1_TRIES = {"not_found": 1, "bad_request": 1, "gone": MAX_TRIES}  # then pass 2 asks again
UNFETCHABLE = {"not_found": 404, "bad_request": 400, "gone": 500}  # demo kinds that never succeed


# -- processes ---------------------------------------------------------------------------------


def asyncrawl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # cwd: a directory without a config.toml (status/export need only --state)
    return subprocess.run([sys.executable, "-m", "asyncrawl", *args], capture_output=True,
                          text=True, env={**os.environ, **ENV, "PYTHONPATH": str(REPO_ROOT)},
                          cwd=tempfile.gettempdir(), timeout=timeout)


def write_config(path: Path, *, url: str, ids: Path, state: Path, concurrency: int) -> None:
    # Retries and the cool-down are fast so that kills also land in pass 2 and the cool-down.
    path.write_text(f"""\
[source]
ids = "{ids}"
[request]
url = "{url}"
timeout = 5
[request.headers]
X-Api-Key = "${{ASYNCRAWL_TORTURE_KEY}}"
[limits]
concurrency = {concurrency}
rate = 3000
burst = 300
[retry]
max_tries = {MAX_TRIES}
backoff_base = 0.05
backoff_max = 0.5
retry_after_max = 1
[passes]
cooldown = {COOLDOWN}
[state]
dir = "{state}"
[run]
grace = 2
progress_interval = 60
""", encoding="utf-8")


# -- the state, read independently -------------------------------------------------------------


class StateReader:
    """Reads the state database read-only, as the killed process left it (SQLite's WAL makes
    what was committed readable; nothing of an unfinished transaction)."""

    def __init__(self, state: Path) -> None:
        self.open_answered: set[str] = set()  # (``run_in_flight``'s)
        self.path = state / DB
        self.wal = state / (DB + "-wal")
        self.runs: list[tuple[int, float]] = []  # (pid, started) of each run

    def _rows(self, query: str) -> list[tuple[Any, ...]]:
        if not self.path.exists():
            return []
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            return db.execute(query).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []
            raise
        finally:
            db.close()

    def read(self) -> int:
        """Catch up with the runs; return the WAL's size (what the next open recovers from)."""
        self.runs = [(pid, started) for pid, started in self._rows(
            "SELECT pid, started FROM runs ORDER BY run")]
        # a run whose ``run`` record only the intent log holds (its writing process died first)
        self.runs += [((rec.extra or {}).get("pid"), rec.ts) for _, rec in self._logged()
                      if rec.kind == "run"]
        return self.wal.stat().st_size if self.wal.exists() else 0

    def written(self) -> int:
        """Records committed so far (intents and outcomes): grows with every commit."""
        rows = self._rows("SELECT total(sends) + count(state) FROM items")
        return int(rows[0][0]) if rows else 0

    def wal_changed_at(self) -> int:
        return self.wal.stat().st_mtime_ns if self.wal.exists() else 0

    def settled(self) -> set[str]:
        return {i for i, in self._rows("SELECT id FROM items WHERE state IN ('ok', 'unavailable')")}

    def logged_open(self) -> set[str]:
        """IDs whose ``sent`` intent only ``intents.log`` holds (beyond the database's
        'applied' batch: the run's writing process died before applying it), not settled."""
        return {str(rec.id) for _, rec in self._logged() if rec.kind == "sent"} - self.settled()

    def _logged(self) -> list[tuple[int, Any]]:
        """The records of ``intents.log`` the database has not applied."""
        applied = self._rows("SELECT value FROM meta WHERE key = 'applied'")
        return list(pending_records(self.path.parent, int(applied[0][0]) if applied else 0))

    def durable_ok(self) -> set[str]:
        return {i for i, in self._rows("SELECT id FROM items WHERE state = 'ok'")}

    def run_in_flight(self, index: int) -> tuple[set[str], set[str]]:
        """(sent, in flight) of the ``index``-th run (the last one, before the next run opens the
        state): IDs settled by it or with an open intent; those with an open intent and a call
        whose answer the state does not know (one answered 503 and waiting for its retry is
        sent, not in flight: not in doubt), or an intent only the log holds."""
        started = self.runs[index][1]
        open_ = {i for i, in self._rows("SELECT id FROM items WHERE sent_run IS NOT NULL")}
        flying = {i for i, in self._rows(
            "SELECT id FROM items WHERE sent_run IS NOT NULL AND sends > paid + answered")}
        flying |= self.logged_open()
        settled = {i for i, in self._rows(
            f"SELECT id FROM items WHERE state IS NOT NULL AND fetched_at >= {started!r}")}
        self.open_answered = open_ - flying  # (checked against the mock's log by the caller)
        return settled | open_ | flying, flying


# -- the mock's log ----------------------------------------------------------------------------


def billed_answers(log: list[LogEntry], start: int, end: int | None = None,
                   seen_200: set[str] | None = None) -> collections.Counter[str]:
    """ID -> billed answers among ``log[start:end]``. A 200 is billed unless it is the first
    answer to an ``invalid_json`` ID (a truncated body); ``seen_200`` carries that across calls."""
    seen = set() if seen_200 is None else seen_200
    out: collections.Counter[str] = collections.Counter()
    for e in log[start:end]:
        if e.event != "end" or e.status != 200:
            continue
        if demo_faults(e.id).kind == "invalid_json" and e.id not in seen:
            seen.add(e.id)
            continue
        out[e.id] += 1
    return out


# -- the torture -------------------------------------------------------------------------------


@dataclass
class Kill:
    n: int
    mode: str
    after: float  # seconds from spawn to SIGKILL
    exit: int | None
    torn: int  # bytes of WAL left by the killed process (recovered by the next open)
    new_ok: int  # ok records made durable by this run
    durable_ok: int
    received: int  # distinct IDs the mock received during this run
    in_doubt_new: int  # J: in flight at the crash per the state
    unsettled_received: int  # E: received by the mock, no settled record at the crash
    missing: int  # E - J: must be 0
    never_reached: int  # J - E: durable "sent", the request never reached the mock
    lost_answers: int  # billed by the mock during this run, not durable at the kill
    refetched: int = 0  # of those, billed again later (filled in at the end)
    export_in_doubt: int = 0


@dataclass
class Report:
    concurrency: int
    kills: list[Kill] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    final_exit: int | None = None
    fetchable: int = 0
    unavailable: int = 0
    billed_total: int = 0
    refetched_total: int = 0
    possibly_billed_twice: int = 0
    elapsed: float = 0.0

    def check(self, cond: bool, message: str) -> None:
        if not cond:
            self.violations.append(message)


def torture(*, kills: int, n_ids: int, concurrency: int = 16, payload_bytes: int = 65536,
            seed: int | None = None, workdir: Path | None = None, keep: bool = False,
            out: Callable[[str], None] = print) -> Report:
    """Run the torture; return the figures and every violation found (see the module docstring)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="asyncrawl-torture-", dir=workdir or _work_parent()))
    out(f"torture: {kills} kills, {n_ids:,} IDs, concurrency {concurrency}, payload "
        f"{payload_bytes:,} B, writer batch limit {BATCH_LIMIT}, seed {seed}, dir {base}")
    t0 = time.monotonic()
    report = Report(concurrency)
    ids = [f"t{i:06d}" for i in range(n_ids)]
    unfetchable = {i: UNFETCHABLE[demo_faults(i).kind] for i in ids
                   if demo_faults(i).kind in UNFETCHABLE}
    fetchable = [i for i in ids if i not in unfetchable]
    report.fetchable, report.unavailable = len(fetchable), len(unfetchable)
    state = base / "state"
    ids_file = base / "ids.txt"
    ids_file.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")
    mock = MockProcess(base / "mock.log", "--api-key", KEY, "--faults", "demo",
                       "--payload-bytes", str(payload_bytes), cwd=REPO_ROOT)
    cfg = base / "torture.toml"
    write_config(cfg, url=mock.item_url, ids=ids_file, state=state, concurrency=concurrency)
    journal = StateReader(state)
    windows: list[tuple[int, int, set[str]]] = []  # (log start, log end, durable ok at the kill)
    seen_200: set[str] = set()
    prev_export: set[str] = set()
    try:
        log = mock.settled_log()
        for k in range(1, kills + 1):
            start = len(log)
            settled_before = journal.settled()
            ok_before = len(journal.durable_ok())
            journal.read()
            written0 = journal.written()
            runs_before = len(journal.runs)
            # each run may write about half of 1/(kills left) of the records left (an ok result
            # and its intent per fetchable ID)
            ok_left = len(fetchable) - ok_before
            slice_records = max(ok_left, 1) * 2 / ((kills - k + 1) * 2)
            x = rng.random()
            mode = "startup" if x < 0.15 else "running" if x < 0.6 else "on-write"
            if k > kills - max(2, kills // 10):
                mode = "cool-down" if (kills - k) % 2 else "pass-2"
            proc, after, mode = _run_and_kill(base, cfg, journal, mock.log_path, mode, written0,
                                              slice_records, rng)
            exit_code = proc.returncode
            log = mock.settled_log()
            torn = journal.read()
            durable_ok = journal.durable_ok()
            received = {e.id for e in log[start:] if e.event == "start"}
            report.check(not received & settled_before,
                         f"kill {k}: the run requested IDs settled before it started: "
                         f"{sorted(received & settled_before)[:5]}")
            new_runs = [pid for pid, _ in journal.runs[runs_before:]]
            report.check(new_runs in ([], [proc.pid]), f"kill {k}: unexpected run records {new_runs}")
            sent, flying = journal.run_in_flight(-1) if new_runs else (set(), set())
            unsettled_received = received - (sent - flying)  # E
            missing = unsettled_received - flying
            report.check(not missing, f"kill {k}: the mock received {len(missing)} IDs with no "
                                      f"durable 'sent' record / not in doubt: {sorted(missing)[:5]}")
            # an open intent left out of doubt as answered: every request of it this run must
            # have had an answer from the mock that is no 2xx (the state's own count, checked)
            asked = collections.Counter(e.id for e in log[start:] if e.event == "start")
            refused = collections.Counter(e.id for e in log[start:] if e.event == "end"
                                          and e.status and not 200 <= e.status < 300)
            wrong = sorted(i for i in (journal.open_answered if new_runs else ())
                           if asked[i] != refused[i])
            report.check(not wrong, f"kill {k}: open intents taken for answered that the mock "
                                    f"did not answer, or answered 2xx: {wrong[:5]}")
            billed = billed_answers(log, start, None, seen_200)
            lost = set(billed) - durable_ok
            report.check(lost <= flying, f"kill {k}: billed answers lost with the process are not "
                                         f"in doubt: {sorted(lost - flying)[:5]}")
            exported = _export_in_doubt(state) if journal.path.exists() else {}
            report.check(set(exported) == prev_export | flying,
                         f"kill {k}: export --outcome in-doubt lists {len(exported)} IDs, expected "
                         f"the {len(prev_export)} before plus the {len(flying)} in flight at the "
                         f"crash (extra {sorted(set(exported) - prev_export - flying)[:5]}, missing "
                         f"{sorted((prev_export | flying) - set(exported))[:5]})")
            report.check(not any(exported.get(i) for i in flying),
                         f"kill {k}: IDs in flight at the crash reported as re-fetched")
            prev_export = set(exported)
            windows.append((start, len(log), durable_ok))
            kill = Kill(k, mode, after, exit_code, torn, len(durable_ok) - ok_before,
                        len(durable_ok), len(received), len(flying), len(unsettled_received),
                        len(missing), len(flying - unsettled_received), len(lost),
                        export_in_doubt=len(exported))
            report.kills.append(kill)
            out(_kill_line(kill))
            if exit_code is not None and exit_code >= 0:
                report.check(False, f"kill {k}: the run ended by itself (exit {exit_code}) before "
                                    "the kill; use more IDs or fewer kills")
                break

        # -- the last run finishes --------------------------------------------------------------
        start = len(log)
        settled_before = journal.settled()
        r = asyncrawl("run", "-c", str(cfg), "--no-progress", timeout=900)
        report.final_exit = r.returncode
        report.check(r.returncode == 0, f"final run exit {r.returncode}: {r.stderr[-2000:]}")
        log = mock.settled_log()
        journal.read()
        requested = {e.id for e in log[start:] if e.event == "start"} & settled_before
        report.check(not requested, f"the final run requested settled IDs: {sorted(requested)[:5]}")
        _final_checks(report, log, windows, journal, state, fetchable, unfetchable, payload_bytes)
    finally:
        mock.stop()
        report.elapsed = time.monotonic() - t0
        if keep or report.violations:
            out(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return report


def _work_parent() -> str | None:
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            tmpfs = any(line.split()[1] == "/tmp" and line.split()[2] == "tmpfs" for line in f)
    except OSError:
        tmpfs = False
    if not tmpfs:
        return None
    work = BENCH_DIR / ".work"
    work.mkdir(exist_ok=True)
    return str(work)


def _run_and_kill(base: Path, cfg: Path, state: StateReader, mock_log: Path, mode: str,
                  written0: int, slice_records: float,
                  rng: random.Random) -> tuple[subprocess.Popen[str], float, str]:
    """Start a run, SIGKILL it as ``mode`` says; return it, when it was killed, and the phase
    hit (``mode``, except that a ``cool-down`` kill may find pass 2 begun already)."""
    tail = LogTail(mock_log)
    with (base / "run.out").open("a") as so, (base / "run.err").open("a") as se:
        t = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                                 "--no-progress"], stdout=so, stderr=se, text=True,
                                env={**os.environ, **ENV}, cwd=REPO_ROOT,
                                start_new_session=True)
    try:
        target = written0 + rng.uniform(0.1, 1.5) * slice_records
        if mode == "startup":
            deadline = t + rng.uniform(0.0, 0.7)
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.002)
                if state.written() >= target:
                    break
        elif mode in ("cool-down", "pass-2"):
            mode = _wait_for_pass_2(proc, tail, state.path.parent / "live.json", mode, t + RUN_LIMIT)
            time.sleep(rng.uniform(0.0, 0.1))
        else:
            give_up = t + RUN_LIMIT
            while proc.poll() is None and state.written() < target and time.monotonic() < give_up:
                time.sleep(0.002)
            if mode == "running":
                time.sleep(rng.uniform(0.0, 0.05))
            else:  # busy-wait for the next commit to begin writing the WAL, and kill at once
                changed = state.wal_changed_at()
                while proc.poll() is None and time.monotonic() < give_up:
                    if state.wal_changed_at() != changed:
                        break
        after = time.monotonic() - t
        if proc.poll() is None:  # the run's process alone (its SQLite writing process then
            #                       applies what it had read, and exits), or with it
            if rng.random() < 0.5:
                proc.send_signal(signal.SIGKILL)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30  # the writing process gone: the lock free, the state still
    while lock_holder(state.path.parent) is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    return proc, after, mode


class LogTail:
    """The entries appended to the mock's log since the last call (from its end at creation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [orjson.loads(line) for line in data[:end].splitlines()]


def _wait_for_pass_2(proc: subprocess.Popen[str], tail: LogTail, live: Path, mode: str,
                     give_up: float) -> str:
    """Wait until the run is in its cool-down (``mode == "cool-down"``, seen in live.json) or
    pass 2 has begun; return which."""
    starts: collections.Counter[str] = collections.Counter()
    while proc.poll() is None and time.monotonic() < give_up:
        for e in tail.new():
            if e["event"] == "start":
                starts[e["id"]] += 1
                kind = demo_faults(e["id"]).kind
                if kind in PASS_1_TRIES and starts[e["id"]] > PASS_1_TRIES[kind]:
                    return "pass-2"
        if mode == "cool-down":
            try:
                view = orjson.loads(live.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                view = {}
            if view.get("pid") == proc.pid and view.get("cooling_down"):
                return "cool-down"
        time.sleep(0.005)
    return mode


def _export_in_doubt(state: Path) -> dict[str, bool]:
    r = asyncrawl("export", "--state", str(state), "--outcome", "in-doubt")
    if r.returncode != 0:
        raise RuntimeError(f"export --outcome in-doubt failed ({r.returncode}): {r.stderr}")
    return {o["id"]: o["refetched"] for o in map(json.loads, r.stdout.splitlines())}


def _final_checks(report: Report, log: list[LogEntry], windows: list[tuple[int, int, set[str]]],
                  journal: StateReader, state: Path, fetchable: list[str],
                  unfetchable: dict[str, int], payload_bytes: int) -> None:
    check = report.check
    # billed answers per kill window, and which of them were billed again later
    seen_200: set[str] = set()
    per_window = [billed_answers(log, a, b, seen_200) for a, b, _ in windows]
    later = billed_answers(log, windows[-1][1] if windows else 0, None, seen_200)
    billed_after: collections.Counter[str] = collections.Counter(later)
    refetched_all: set[str] = set()
    for k in range(len(windows) - 1, -1, -1):
        durable = windows[k][2]
        refetched = {i for i in per_window[k] if billed_after[i]}
        report.kills[k].refetched = len(refetched)
        refetched_all |= refetched
        check(not refetched & durable, f"kill {k + 1}: durable IDs were fetched again: "
                                       f"{sorted(refetched & durable)[:5]}")
        bound = report.concurrency + BATCH_LIMIT
        check(len(refetched) <= bound, f"kill {k + 1}: {len(refetched)} IDs re-fetched after "
                                       f"success > concurrency + batch limit ({bound})")
        billed_after.update(per_window[k])
    total_billed = billed_answers(log, 0, None, set())
    report.billed_total = sum(total_billed.values())
    report.refetched_total = sum(n - 1 for n in total_billed.values() if n > 1)
    check(set(total_billed) == set(fetchable),
          f"billed IDs != fetchable IDs ({len(set(total_billed) ^ set(fetchable))} differ)")

    r = asyncrawl("export", "--state", str(state), "--outcome", "ok", "--format", "jsonl")
    check(r.returncode == 0, f"export ok: {r.stderr}")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    exported_ids = [o["id"] for o in lines]
    check(len(exported_ids) == len(set(exported_ids)), "export --outcome ok repeats IDs")
    check(sorted(exported_ids) == sorted(fetchable),
          f"export --outcome ok: {len(exported_ids)} IDs, expected the {len(fetchable)} fetchable")
    bad = [o["id"] for o in lines if o["data"] != payload_for(o["id"], pad=payload_bytes)]
    check(not bad, f"wrong payload exported for {len(bad)} IDs: {bad[:5]}")

    r = asyncrawl("export", "--state", str(state), "--outcome", "unavailable")
    check(r.returncode == 0, f"export unavailable: {r.stderr}")
    unavailable = {o["id"]: o["status"] for o in map(json.loads, r.stdout.splitlines())}
    check(unavailable == unfetchable,
          f"confirmed-unavailable set wrong: {len(set(unavailable) ^ set(unfetchable))} IDs differ, "
          f"or a wrong status")
    r = asyncrawl("export", "--state", str(state), "--outcome", "failed", "--format", "ids")
    check(r.returncode == 0 and r.stdout == "", f"IDs left failed: {r.stdout[:200]}")

    in_doubt = _export_in_doubt(state)
    report.possibly_billed_twice = sum(in_doubt.values())
    check(refetched_all <= {i for i, twice in in_doubt.items() if twice},
          f"re-fetched IDs not reported as possibly billed twice: "
          f"{sorted(refetched_all - {i for i, t in in_doubt.items() if t})[:5]}")
    r = asyncrawl("status", "--state", str(state), "--json")
    check(r.returncode == 0, f"status --json: {r.stderr}")
    s = json.loads(r.stdout) if r.returncode == 0 else {}
    check((s.get("ok"), s.get("failed"), s.get("unavailable"), s.get("halt")) ==
          (len(fetchable), 0, len(unfetchable), None), f"status --json: {s}")
    check(s.get("possibly_billed_twice", 0) >= len(refetched_all), f"status --json: {s}")


def _kill_line(k: Kill) -> str:
    return (f"kill {k.n:3d} {k.mode:9s} at {k.after:5.2f}s  WAL {k.torn:8d} B  "
            f"ok +{k.new_ok:4d} = {k.durable_ok:5d}  received {k.received:4d}  "
            f"in doubt {k.in_doubt_new:3d} (server-unsettled {k.unsettled_received:3d}, "
            f"missing {k.missing}, never reached {k.never_reached:2d})  "
            f"answers lost {k.lost_answers:3d}")


def summary(report: Report) -> str:
    concurrency = report.concurrency
    ks = report.kills
    lines = ["", "per kill: re-fetched after success (billed again later) / bound "
             f"{concurrency + BATCH_LIMIT} (concurrency {concurrency} + batch limit {BATCH_LIMIT})"]
    lines.append("  " + " ".join(f"{k.refetched}" for k in ks))
    n = len(ks)
    lines += [
        "",
        f"kills                      {n} ("
        + ", ".join(f"{sum(k.mode == m for k in ks)} {m}"
                    for m in ("startup", "running", "on-write", "cool-down", "pass-2")) + ")",
        f"kills with a WAL to recover {sum(k.torn > 0 for k in ks)} (committed transactions not "
        "yet checkpointed; an unfinished one is ignored by the next open)",
        f"kills with requests in flight  {sum(k.in_doubt_new > 0 for k in ks)}",
        f"in doubt at the crashes    {sum(k.in_doubt_new for k in ks)} IDs in total "
        f"(server-unsettled {sum(k.unsettled_received for k in ks)}, missing "
        f"{sum(k.missing for k in ks)}, never reached the server {sum(k.never_reached for k in ks)})",
        f"answers lost with a kill   {sum(k.lost_answers for k in ks)}",
        f"re-fetched after success   {sum(k.refetched for k in ks)} IDs in total, max "
        f"{max((k.refetched for k in ks), default=0)} per kill (bound {concurrency + BATCH_LIMIT})",
        f"billed answers             {report.billed_total:,} for {report.fetchable:,} fetchable IDs "
        f"(+{report.refetched_total} re-fetched); possibly billed twice reported: "
        f"{report.possibly_billed_twice}",
        f"final run                  exit {report.final_exit}",
        f"export ok / unavailable    every one of {report.fetchable:,} fetchable IDs once with its "
        f"payload / exactly the {report.unavailable} unfetchable IDs"
        + ("" if not report.violations else " -- see violations"),
        f"elapsed                    {report.elapsed:.0f}s",
        f"violations                 {len(report.violations)}",
    ]
    lines += [f"  VIOLATION: {v}" for v in report.violations]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=60)
    p.add_argument("--ids", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--payload-bytes", type=int, default=65536,
                   help="padding per payload: large records widen the write/fsync window")
    p.add_argument("--seed", type=int)
    p.add_argument("--workdir", type=Path, help="parent of the temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the state directory and logs")
    args = p.parse_args(argv)
    report = torture(kills=args.kills, n_ids=args.ids, concurrency=args.concurrency,
                     payload_bytes=args.payload_bytes, seed=args.seed, workdir=args.workdir,
                     keep=args.keep)
    print(summary(report))
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
