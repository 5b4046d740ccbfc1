"""What the operator of a long, paid job sees: the live view on a terminal (a real pseudo-terminal),
the aggregated error log, the billing ledger of ``status``, the spend cap, the library's halt
callback, and an export that streams.

CLI tests run ``python -m asyncrawl`` against the mock API in its own process, which logs every
request; the figures asserted are the mock's own counts.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import re
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pexpect
import pytest

from asyncrawl import Config, Crawler, Halt, Summary
from asyncrawl.config import endpoint_of
from asyncrawl.crawler import Result
from asyncrawl.progress import ErrorTally, LiveView, answer_kind, result_kind
from asyncrawl.records import Record
from asyncrawl.report import export
from asyncrawl.store import open_store
from asyncrawl.testing import LogEntry, MockAPI, demo_faults, payload_for, read_log

from .conftest import KEY, cli, fast_config, write_config, write_ids

ENV = {"ASYNCRAWL_TEST_KEY": KEY}


def ends(log: list[LogEntry]) -> collections.Counter[int | None]:
    """Answer status -> how many answers the mock gave (0: a dropped connection)."""
    return collections.Counter(e.status for e in log if e.event == "end")


def ids_of(kinds: dict[str, int], prefix: str) -> list[str]:
    """IDs to which ``--faults demo`` gives each fault kind, ``kinds[kind]`` of each, spread
    evenly through the list."""
    found: dict[str, list[str]] = {k: [] for k in kinds}
    i = 0
    while any(len(found[k]) < n for k, n in kinds.items()):
        item = f"{prefix}{i}"
        kind = demo_faults(item).kind
        if kind in found and len(found[kind]) < kinds[kind]:
            found[kind].append(item)
        i += 1
    spread = [((j + 0.5) / len(items), item) for items in found.values()
              for j, item in enumerate(items)]
    return [item for _, item in sorted(spread)]


def status_json(cfg: Path, *extra: str) -> dict[str, Any]:
    r = cli("status", "-c", str(cfg), "--json", *extra, env=ENV)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# -- 1. the live view on a terminal ------------------------------------------------------------

FRAME = re.compile(
    r"asyncrawl  pass (?P<pass>\d) +\S* +(?P<pct>\d+)%  (?P<done>[\d,]+)/(?P<total>[\d,]+).*?\r\n"
    r"\x1b\[2K  ok (?P<ok>[\d,]+)   failed (?:in pass 1 )?(?P<failed>[\d,]+)   "
    r"unavailable (?P<unavailable>[\d,]+)   retried (?P<retried>[\d,]+)\r\n"
    r"\x1b\[2K  rate (?P<rate>[\d,.]+) req/s   limit (?P<limit>[\d,.]+)/(?P<conf>[\d,]+) req/s")


def _n(text: str) -> float:
    return float(text.replace(",", ""))


def test_live_view_under_a_pseudo_terminal(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo", "--latency", "0.01")
    ids = ids_of({"ok": 330, "not_found": 12, "flaky": 8}, "t")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids),
                       limits={"rate": 150, "burst": 5, "concurrency": 8},
                       run={"progress_interval": 30})
    child = pexpect.spawn(sys.executable, ["-m", "asyncrawl", "run", "-c", str(cfg)],
                          env={**ENV, "PATH": "/usr/bin:/bin", "TERM": "xterm"},
                          dimensions=(30, 120), encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 0, out[-2000:]

    frames = [m.groupdict() for m in FRAME.finditer(out) if m.group("pass") == "1"]
    assert len(frames) >= 4, out[:2000]  # redrawn several times during a ~3 s run
    assert "\x1b[4A" in out  # redrawn in place: back up to the view's first line
    assert {f["total"] for f in frames} == {"350"}
    assert {f["conf"] for f in frames} == {"150"}
    oks = [_n(f["ok"]) for f in frames]
    assert oks == sorted(oks) and oks[-1] > 0  # counts grow
    # the rate shown is the real one: the job is held at 150 req/s
    rates = [_n(f["rate"]) for f in frames[1:]]
    assert any(40 <= r <= 200 for r in rates), rates
    # error reasons are named, most frequent first: the 404s given up on
    assert re.search(r"errors [^\r]*HTTP 404 × \d+", out)
    # the view is erased before the final summary, whose counts the view led up to
    tail = out[out.rindex("asyncrawl  pass"):]
    assert "\x1b[J" in tail[:tail.index("asyncrawl: finished")]
    final_ok = int(re.search(r"\n  ok +([\d,]+)", tail).group(1).replace(",", ""))
    assert final_ok == 338  # 330 ok + 8 flaky; the 12 404s are unavailable
    assert max(oks) <= final_ok


def test_live_view_frames_say_what_holds_the_job_back() -> None:
    from asyncrawl.crawler import Progress

    errors = ErrorTally()
    for _ in range(30):
        errors.answer(503)
    errors.answer(404)
    buf = io.StringIO()
    view = LiveView(buf, errors)
    base = dict(pass_no=1, total=1000, done=250, ok=240, failed=10, unavailable=0, skipped=0,
                retries=31, requests=300, in_flight=16, parked=7, rate=42.5, paused_for=0.0,
                elapsed=10.0, eta=30.0, effective_rate=50.0, configured_rate=100.0)
    lines = view.frame(Progress(**{**base, "paused_for": 4.2, "breaker_open": True}))
    text = "\n".join(lines)
    assert "25%" in lines[0] and "250/1,000" in lines[0] and "ETA 0:30" in lines[0]
    assert "ok 240   failed 10   unavailable 0   retried 31" in text
    assert "rate 42.5 req/s   limit 50.0/100 req/s (adapted)" in text
    assert "paused 4s (server asked)" in text and "upstream down: probing" in text
    assert lines[-1] == "  errors HTTP 503 × 30 · HTTP 404 × 1"
    view(Progress(**base))
    view(Progress(**base))
    assert buf.getvalue().count("\x1b[4A") == 1  # the second frame went back over the first
    view.close()
    assert buf.getvalue().endswith("\r\x1b[4A\x1b[J") and view.height == 0

    # pass 2 measures itself against what pass 1 left failed
    view(Progress(**{**base, "done": 1000, "ok": 960, "failed": 40, "eta": None,
                     "cooling_down": True}))
    p2 = view.frame(Progress(**{**base, "pass_no": 2, "done": 1010, "ok": 965, "failed": 30,
                                "unavailable": 5, "eta": None}))
    assert "pass 2" in p2[0] and "10/40" in p2[0] and "failed, left to retry 30" in p2[1]


# -- 2. logs: aggregated error lines, JSON with stable keys, the halt last ---------------------


def test_error_storm_is_aggregated_and_the_halt_is_the_last_line(
        tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo", "--balance", "40")
    ids = ids_of({"not_found": 240, "ok": 80}, "e")
    log_file = tmp_path / "run.log"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids),
                       limits={"rate": 200, "burst": 5, "concurrency": 4},
                       run={"progress_interval": 0.3})
    t0 = time.monotonic()
    r = cli("run", "-c", str(cfg), "--log-format", "json", "--log-file", str(log_file), env=ENV)
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert r.stderr == ""  # everything went to the log file
    answered = ends(read_log(mock.log_path))
    assert answered[404] >= 50 and answered[200] == 40 and answered[402] >= 1

    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    for e in events:
        assert list(e)[:4] == ["ts", "level", "event", "msg"], e
        assert e["event"] in ("progress", "errors", "halt", "summary", "log")
    errors = [e for e in events if e["event"] == "errors"]
    for e in errors:
        assert set(e) == {"ts", "level", "event", "msg", "reason", "count", "window_s",
                          "recorded", "example_id"}
        assert e["level"] == "warning"
    by_reason = collections.defaultdict(list)
    for e in errors:
        by_reason[e["reason"]].append(e)
    # every 404 answer is counted, in a handful of lines rather than one line each
    lines_404 = by_reason["HTTP 404"]
    assert sum(e["count"] for e in lines_404) == answered[404]
    assert len(lines_404) <= took / 0.3 + 2 and len(lines_404) < answered[404] / 5
    recorded = sum(e["recorded"].get("failed", 0) for e in lines_404)
    assert recorded == answered[404]  # each 404 ID recorded failed once (pass 1; no pass 2)
    assert all(re.fullmatch(r"HTTP 404 × [\d,]+ in the last [\d.]+ s; [\d,]+ recorded failed "
                            r"\(e\.g\. ID 'e\d+'\)", e["msg"]) for e in lines_404 if e["count"])
    assert sum(e["count"] for e in by_reason["HTTP 402"]) == answered[402]
    progress = [e["progress"] for e in events if e["event"] == "progress"]
    assert progress and all(p["total"] == len(ids) and p["pass"] == 1 and 0 <= p["ok"] <= 40
                            and p["done"] <= len(ids) for p in progress)
    assert [p["done"] for p in progress] == sorted(p["done"] for p in progress)  # it only grows
    # the end: the summary, then why it stopped, as the very last line
    summary, halt = events[-2], events[-1]
    assert summary["event"] == "summary" and summary["ok"] == 40 and summary["exit_code"] == 3
    assert summary["halt"]["status"] == 402
    assert halt["event"] == "halt" and halt["reason"] == "fatal" and halt["status"] == 402
    assert halt["level"] == "warning"


def test_text_log_lines_aggregate_too(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    ids = ids_of({"not_found": 60, "ok": 20}, "w")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids), passes={"second_pass": False},
                       run={"progress_interval": 30})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 6, r.stderr
    lines = r.stderr.splitlines()
    assert lines == ["asyncrawl: WARNING: HTTP 404 × 60 in the last "
                     + lines[0].split("in the last ")[1]]  # one line for the 60 failures
    assert re.search(r"; 60 recorded failed \(e\.g\. ID 'w\d+'\)$", lines[0])


def test_error_kinds_repeat_across_ids_and_are_not_counted_twice() -> None:
    assert result_kind(404, "HTTP 404") == answer_kind(404, True) == "HTTP 404"
    assert result_kind(200, "2xx body is not valid JSON") == answer_kind(200, False)
    assert result_kind(None, "ServerDisconnectedError: Server disconnected") == \
        "ServerDisconnectedError"
    assert result_kind(302, "redirect not followed: Location https://elsewhere/x") == \
        "HTTP 302 (redirect not followed)"
    assert result_kind(402, "HTTP 200, body code 402") == "HTTP 200, body code 402"
    # a cause in parentheses holds the first ": " (it was cut there, its bracket left open)
    assert result_kind(None, "cannot connect to the proxy 127.0.0.1:9 (ConnectionRefusedError: "
                       "[Errno 111] Connect call failed ('127.0.0.1', 9))") == \
        "cannot connect to the proxy 127.0.0.1:9"
    t = ErrorTally()
    t.answer(503)
    t.answer(503)
    t.answer(200)  # a good answer: not an error
    t.result(Result("a", "failed", 503, None, "HTTP 503", False, 1, 2))  # seen as answers
    t.result(Result("b", "failed", None, None, "timeout", False, 1, 5))  # seen only here
    t.result(Result("c", "failed", None, None, "timeout", False, 1, 5))
    assert t.top() == [("HTTP 503", 2), ("timeout", 2)]
    bursts = {b.kind: b for b in t.drain()}
    assert bursts["HTTP 503"].count == 2 and bursts["HTTP 503"].recorded == {"failed": 1}
    assert bursts["timeout"].message().startswith("timeout × 2 in the last")
    assert bursts["timeout"].example_id == "b"
    assert t.drain() == []  # drained
    for i in range(20):
        t.answer(500 + i)
    drained = t.drain()
    assert len(drained) == ErrorTally.MAX_KINDS and drained[-1].kind == "13 other kinds"
    assert sum(b.count for b in drained) == 20


# -- 3. the billing ledger ---------------------------------------------------------------------


def test_status_ledger_reconciles_with_the_api(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo")
    # every kind but "drop": aiohttp resends a dropped GET by itself, so the API sees two
    # requests where asyncrawl sent one
    ids = ids_of({"ok": 120, "not_found": 6, "bad_request": 3, "gone": 2, "flaky": 10,
                  "invalid_json": 4}, "L")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", mock.item_url, state,
                       write_ids(tmp_path / "ids.txt", ids),
                       billing={"price_per_call": 0.0025, "currency": "EUR"})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 0, r.stderr
    log = read_log(mock.log_path)
    answered = ends(log)
    paid = answered[200]  # 2xx: billed (an invalid-JSON 2xx too)
    assert paid == 120 + 10 + 2 * 4
    not_paid = sum(n for s, n in answered.items() if s != 200)
    assert not_paid > 20

    s = status_json(cfg)
    port = mock.url.rsplit(":", 1)[1]
    endpoint = f"127.0.0.1:{port}/items/{{id}}"
    days = collections.Counter(time.strftime("%Y-%m-%d", time.gmtime(e.t))
                               for e in log if e.event == "end" and e.status == 200)
    assert s["ledger"] == [{"date": d, "endpoint": endpoint, "billable": n,
                            "cost": pytest.approx(n * 0.0025)} for d, n in sorted(days.items())]
    assert s["billable"] == paid and s["cost"] == pytest.approx(paid * 0.0025)
    assert s["currency"] == "EUR"
    assert s["not_billed"] == not_paid
    assert s["requests_sent"] == sum(1 for e in log if e.event == "start")

    r = cli("status", "-c", str(cfg), env=ENV)
    assert r.returncode == 0, r.stderr
    day = max(days)
    assert f"billable     {paid:,} calls = {paid * 0.0025:,.4f} EUR at 0.0025 per call" in r.stdout
    assert re.search(rf"  {day} UTC  {re.escape(endpoint)}  {days[day]:,} = [\d.]+ EUR", r.stdout)
    assert f"not billed   {not_paid:,} calls" in r.stdout
    # without the config, the state still knows the endpoint it fetched from
    r = cli("status", "--state", str(state), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"UTC  {endpoint}  " in r.stdout and f"{paid:,} calls" in r.stdout


def test_endpoint_names_host_and_path_only() -> None:
    assert endpoint_of("https://api.example.com/v1/notes/{id}") == "api.example.com/v1/notes/{id}"
    assert endpoint_of("https://user:pw@API.Example.com:8443/v1/n/{id}?key=s&x={id}") == \
        "api.example.com:8443/v1/n/{id}"


# -- 4. the spend cap --------------------------------------------------------------------------


def test_max_spend_stops_with_exit_4_and_keeps_every_paid_result(
        tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    ids = [f"m{i:03d}" for i in range(100)]
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ids),
                       billing={"price_per_call": 0.01, "currency": "EUR", "max_spend": 0.25})
    r = cli("run", "-c", str(cfg), "--no-progress", env=ENV)
    assert r.returncode == 4, r.stderr
    billed = [e.id for e in read_log(mock.log_path) if e.event == "end" and e.status == 200]
    assert len(billed) == 25  # 0.25 EUR at 0.01
    r2 = cli("export", "-c", str(cfg), "--format", "ids", env=ENV)
    assert sorted(r2.stdout.splitlines()) == sorted(billed)  # every paid result kept
    out = r.stdout
    assert out.startswith("asyncrawl: stopped early: request budget of 25 billable calls reached")
    assert re.search(r"\n  left +(75 of 100 IDs|up to 75 of a list of 100 lines) ≈ 0\.7500 EUR",
                     out), out
    assert re.search(r"\n  cost +0\.2500 EUR this run \(25 billable calls at 0\.01\)", out), out
    assert "raise --max-requests or [billing] max_spend, then rerun the same command" in out
    s = status_json(tmp_path / "c.toml")
    assert s["ok"] == 25 and s["cost"] == pytest.approx(0.25) and s["halt"]["reason"] == "budget"

    r = cli("run", "-c", str(cfg), "--dry-run", env=ENV)
    assert "calls left: 75" in r.stdout and "0.7500 EUR" in r.stdout


# -- 5. alerts through the library -------------------------------------------------------------


async def test_library_on_halt_callback_gets_the_halt_and_the_summary(state: Path) -> None:
    calls: list[tuple[Halt, Summary]] = []
    async with MockAPI(api_key=KEY, balance=7) as api:
        cfg = fast_config(api, state, concurrency=1)
        async with Crawler(cfg, on_halt=lambda h, s: calls.append((h, s))) as crawler:
            summary = await crawler.run([f"h{i}" for i in range(30)])
        assert len(api.paid()) == 7
    assert len(calls) == 1
    halt, seen = calls[0]
    assert (halt.reason, halt.status) == ("fatal", 402)
    assert seen is summary and summary.ok == 7 and summary.exit_code == 3

    # the request budget too; a run that finishes calls nothing
    calls.clear()
    async with MockAPI(api_key=KEY) as api:
        cfg = fast_config(api, state.parent / "s2", max_requests=4, concurrency=1)
        async with Crawler(cfg, on_halt=lambda h, s: calls.append((h, s))) as crawler:
            summary = await crawler.run([f"b{i}" for i in range(10)])
            assert [h.reason for h, _ in calls] == ["budget"] and summary.ok == 4
            calls.clear()
            await crawler.run([f"c{i}" for i in range(3)])
    assert calls == []


# -- 6. export streams -------------------------------------------------------------------------


class _Sink(io.TextIOBase):
    def __init__(self) -> None:
        self.chars = 0
        self.lines = 0

    def write(self, s: str) -> int:
        self.chars += len(s)
        self.lines += s.count("\n")
        return len(s)


def test_export_streams_in_constant_memory(tmp_path: Path) -> None:
    n, size = 1500, 20_000  # 30 MB of payloads

    async def build() -> None:
        store = await open_store(tmp_path / "state")
        for start in range(0, n, 100):
            store.commit([Record("ok", f"big{i}", status=200, paid=1, tries=1,
                                 data={"id": f"big{i}", "body": "x" * size, "n": i})
                          for i in range(start, start + 100)])
        await store.close()

    asyncio.run(build())
    cfg = Config(url="http://unused/{id}", state_dir=str(tmp_path / "state"))
    for fmt, fields in (("jsonl", None), ("csv", ["id", "n"])):
        sink = _Sink()
        tracemalloc.start()
        try:
            count = export(cfg, outcome="ok", fmt=fmt, fields=fields, out=sink)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert count == n
        assert sink.lines == n + (fmt == "csv")
        assert peak < 3_000_000, f"{fmt}: peak {peak:,} bytes for {n * size:,} bytes of payloads"
    assert sink.chars < 30_000  # --fields id,n: the bodies were not written


def test_export_to_a_missing_directory_is_a_clear_error(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "none")
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state",
                       write_ids(tmp_path / "ids.txt", ["a", "b"]))
    assert cli("run", "-c", str(cfg), "--no-progress", env=ENV).returncode == 0
    target = tmp_path / "no-such-dir" / "out.jsonl"
    r = cli("export", "-c", str(cfg), "-o", str(target), env=ENV)
    # the flag's fault (exit 2, usage), not the state's (exit 5)
    assert r.returncode == 2 and str(target) in r.stderr and "Traceback" not in r.stderr
    for fmt in ("jsonl", "parquet"):  # a directory: said before the export is made
        r = cli("export", "-c", str(cfg), "--format", fmt, "-o", str(tmp_path), env=ENV)
        assert r.returncode == 2 and "Is a directory" in r.stderr, r.stderr
    good = tmp_path / "out.jsonl"
    good.write_text("old\n")
    r = cli("export", "-c", str(cfg), "-o", str(good), env=ENV)
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(x)["data"]["id"] for x in good.read_text().splitlines()) == ["a", "b"]
    assert json.loads(good.read_text().splitlines()[0])["data"] == payload_for(
        json.loads(good.read_text().splitlines()[0])["id"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []
