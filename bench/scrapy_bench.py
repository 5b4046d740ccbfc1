"""asyncrawl against Scrapy on the same job: fetch N IDs from a local nginx, parse, keep.

What it measures
----------------
The job of ``bench/throughput.py`` (``/items/{id}`` for ``--requests`` IDs, ~1 KB JSON each,
from one local nginx worker, ``--concurrency`` requests in flight, no rate limit):

* ``cli``: ``asyncrawl run`` (durability and in-doubt on: every result committed to SQLite);
* ``scrapy``: a Scrapy spider (``SPIDER`` below, run with ``scrapy runspider``) that requests
  every ID, parses each body with ``json.loads`` and yields it to a JSON-lines feed, with
  ``CONCURRENT_REQUESTS`` and ``CONCURRENT_REQUESTS_PER_DOMAIN`` = concurrency, no download
  delay, no AutoThrottle, no robots.txt, no cookies, no telnet console, logging at WARNING:
  Scrapy at its fastest for this job. Without ``JOBDIR`` (Scrapy's resumable mode, which
  asyncrawl's state corresponds to, and which would only slow it down further).

Each run in a fresh process, alternating, ``--rounds`` rounds; the time is the whole command
(interpreter start-up included, for both: Scrapy has no in-process entry that excludes it).
The figure is ``median(cli req/s) / median(scrapy req/s)``.

Scrapy is not a dependency of asyncrawl: this bench installs it in a venv of its own
(``--scrapy-venv``, default ``bench/.scrapy-venv``) the first time.

Usage::

    .venv/bin/python bench/scrapy_bench.py [--requests 20000] [--concurrency 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from throughput import cli_files, nginx_server  # noqa: E402

SPIDER = '''
import json
import scrapy


class Items(scrapy.Spider):
    name = "items"
    custom_settings = {
        "ROBOTSTXT_OBEY": False, "COOKIES_ENABLED": False, "TELNETCONSOLE_ENABLED": False,
        "AUTOTHROTTLE_ENABLED": False, "DOWNLOAD_DELAY": 0, "LOG_LEVEL": "WARNING",
    }

    async def start(self):
        for i in range(int(self.n)):
            yield scrapy.Request(f"{self.base}/items/{i}", callback=self.parse)

    def start_requests(self):  # Scrapy before 2.13
        for i in range(int(self.n)):
            yield scrapy.Request(f"{self.base}/items/{i}", callback=self.parse)

    def parse(self, response):
        yield json.loads(response.body)
'''


def scrapy_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"installing Scrapy into {venv} (once)", file=sys.stderr)
        # (where a symlink points: one left dangling, its target gone with /tmp, is made again)
        subprocess.run([sys.executable, "-m", "venv", str(venv.resolve())], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "scrapy"], check=True)
    return python


def run_scrapy(python: Path, base: str, n: int, concurrency: int, work: Path) -> float:
    spider = work / "spider.py"
    spider.write_text(SPIDER)
    out = work / "items.jsonl"
    cmd = [str(python), "-m", "scrapy", "runspider", str(spider), "-a", f"base={base}",
           "-a", f"n={n}", "-s", f"CONCURRENT_REQUESTS={concurrency}",
           "-s", f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}", "-O", f"{out}:jsonlines"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    elapsed = time.perf_counter() - t0
    got = sum(1 for _ in out.open()) if out.exists() else 0
    if proc.returncode != 0 or got != n:
        raise SystemExit(f"scrapy: {got} of {n} items (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return n / elapsed


def run_cli(base: str, n: int, concurrency: int, work: Path) -> float:
    argv = cli_files(base, n, concurrency, str(work / "state"))
    env = {**os.environ, "ASYNCRAWL_LOOP": os.environ.get("ASYNCRAWL_LOOP", "asyncio")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "asyncrawl", *argv, "--no-progress"],
                          capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"asyncrawl run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return n / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrapy-venv", default=str(BENCH / ".scrapy-venv"))
    args = ap.parse_args()
    python = scrapy_python(Path(args.scrapy_venv))
    from throughput import compile_package

    compile_package()  # (as an installed asyncrawl is: its modules not compiled at each start)
    version = subprocess.run([str(python), "-m", "scrapy", "version"], capture_output=True,
                             text=True).stdout.strip()
    got: dict[str, list[float]] = {"cli": [], "scrapy": []}
    with tempfile.TemporaryDirectory(prefix="scrapy-bench-") as tmp:
        (Path(tmp) / "nginx").mkdir()
        with nginx_server(Path(tmp) / "nginx") as server:
            for rnd in range(1, args.rounds + 1):
                for kind in got:
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    rps = (run_cli(server.base, args.requests, args.concurrency, work)
                           if kind == "cli" else
                           run_scrapy(python, server.base, args.requests, args.concurrency, work))
                    got[kind].append(rps)
                    print(f"  round {rnd} {kind:<7} {rps:7.0f} req/s", file=sys.stderr)
    cli, scrapy = statistics.median(got["cli"]), statistics.median(got["scrapy"])
    print(f"{args.requests} requests, concurrency {args.concurrency}; {version}")
    print(f"median asyncrawl run  {cli:7.0f} req/s")
    print(f"median scrapy         {scrapy:7.0f} req/s")
    print(f"asyncrawl / scrapy = {cli / scrapy:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
