"""``asyncrawl run --metrics``: Prometheus scrapes a running job (a real CLI process, a real
mock API process, the endpoint read over loopback while the job runs)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from .conftest import KEY, write_config, write_ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def _value(text: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


def test_metrics_are_served_while_the_job_runs(tmp_path: Path, mock_process: Any) -> None:
    mock = mock_process("--api-key", KEY, "--faults", "demo", "--latency", "0.02")
    ids = write_ids(tmp_path / "ids.txt", [f"m-{i}" for i in range(600)])
    cfg = write_config(tmp_path / "c.toml", mock.item_url, tmp_path / "state", ids,
                       limits={"concurrency": 4, "rate": 200})
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    proc = subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                             "--no-progress", "--metrics", f"127.0.0.1:{port}"],
                            env={"ASYNCRAWL_TEST_KEY": KEY, "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        text = _scrape(url)
        if text is not None:
            seen.append(text)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    running = [t for t in seen if _value(t, "asyncrawl_requests_total") > 0]
    assert running, f"no scrape saw requests: {len(seen)} scrapes"
    text = running[-1]
    for name in ("asyncrawl_requests_total", "asyncrawl_billable_calls_total",
                 "asyncrawl_results_total", "asyncrawl_in_flight", "asyncrawl_parked",
                 "asyncrawl_rate_limit", "asyncrawl_paused_seconds", "asyncrawl_breaker_open",
                 "asyncrawl_eta_seconds", "asyncrawl_pass"):
        assert f"\n{name}" in text or text.startswith(name), name
    assert 'outcome="ok",status="200"' in text
    # counts only grow, scrape after scrape
    totals = [_value(t, "asyncrawl_requests_total") for t in seen]
    assert totals == sorted(totals)
    # every 2xx is billable: the ok ones, and those whose body could not be used (a retry)
    assert _value(text, "asyncrawl_billable_calls_total") == _value(
        text, 'asyncrawl_requests_total{outcome="ok"') + _value(
        text, 'asyncrawl_requests_total{outcome="retry",status="2')


def test_a_2xx_whose_body_cannot_be_used_counts_as_a_retry() -> None:
    """It was labelled ok (2,886 ok requests for 2,864 ok results): the class of its status,
    not of the answer."""
    from asyncrawl import Config, Progress
    from asyncrawl.metrics import Metrics

    idle = Progress(pass_no=1, total=None, done=0, ok=0, failed=0, unavailable=0, skipped=0,
                    retries=0, requests=0, in_flight=0, parked=0, rate=0.0, paused_for=0.0,
                    elapsed=0.0, eta=None)
    m = Metrics(Config(url="http://x/{id}"), lambda: idle)
    m.attempt("a", 200, None)
    m.attempt("b", 200, "2xx body is not valid JSON")
    text = m.text().decode()
    assert _value(text, 'asyncrawl_requests_total{outcome="ok",status="200"}') == 1
    assert _value(text, 'asyncrawl_requests_total{outcome="retry",status="200"}') == 1
    assert _value(text, "asyncrawl_billable_calls_total") == 2


def test_metrics_address_is_checked_before_anything_is_sent(tmp_path: Path) -> None:
    ids = write_ids(tmp_path / "ids.txt", ["a"])
    cfg = write_config(tmp_path / "c.toml", "http://127.0.0.1:9/items/{id}", tmp_path / "s", ids)
    r = subprocess.run([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg), "--metrics",
                        "nowhere"], capture_output=True, text=True, timeout=60,
                       env={"ASYNCRAWL_TEST_KEY": KEY, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "--metrics" in r.stderr and "HOST:PORT" in r.stderr
