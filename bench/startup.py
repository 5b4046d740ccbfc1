"""How fast the commands that send nothing start: ``asyncrawl --help`` and ``asyncrawl status``.

For each command: the median wall time of ``--runs`` runs of the installed console script (a
fresh interpreter each time, as a user's shell starts it), and, from one run under
``python -X importtime``, the cumulative import time of the package and whether aiohttp was
imported at all (it must not be: those commands send no request), nor asyncio (they run no
event loop: it and the ssl it imports cost ~20 ms). ``status`` reads a small
state made first by a crawl of the bundled mock API. The package is byte-compiled first, as an
installed one is (an editable install where ``PYTHONDONTWRITEBYTECODE`` is set, as on this
machine, would otherwise compile asyncrawl's modules from their source at every start: ~60 ms).

Usage::

    .venv/bin/python bench/startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def script() -> str:
    return str(Path(sys.executable).parent / "asyncrawl")


def make_state(state: Path) -> None:
    from asyncrawl import Config, Crawler
    from asyncrawl.testing import MockAPI

    async def crawl() -> None:
        async with MockAPI(faults=None, api_key=None) as api:
            cfg = Config(url=api.item_url, state_dir=str(state), rate=1000.0, cooldown=0.0)
            async with Crawler(cfg) as c:
                await c.run([str(i) for i in range(200)])

    asyncio.run(crawl())


def imports(args: list[str]) -> tuple[float, list[str]]:
    """(seconds importing asyncrawl and what it pulls in, which of aiohttp and asyncio were
    imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "asyncrawl", *args],
                          capture_output=True, text=True)
    total, heavy = 0, []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if name.startswith(" asyncrawl"):  # a top-level import of asyncrawl's (the commands
            total += int(cumulative)         # import some of their modules when they run)
        if name.strip() in ("aiohttp", "asyncio"):
            heavy.append(name.strip())
    return total / 1e6, heavy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import compile_package

    compile_package()
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        state = Path(tmp) / "state"
        make_state(state)
        commands = {"--help": ["--help"], "status": ["status", "--state", str(state)]}
        print(f"{'command':<10} {'median wall':>12} {'imports':>9}  aiohttp, asyncio imported")
        for name, argv in commands.items():
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                subprocess.run([script(), *argv], capture_output=True, check=True)
                times.append(time.perf_counter() - t0)
            imp, heavy = imports(argv)
            print(f"{name:<10} {statistics.median(times) * 1000:9.0f} ms {imp * 1000:6.0f} ms  "
                  f"{', '.join(heavy) or 'neither'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
