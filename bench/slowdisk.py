"""A slower disk for the benchmarks: every fsync/fdatasync made to take ``ms`` longer.

``preload(ms, work)`` builds ``bench/slowsync.c`` (an LD_PRELOAD shim, needs a C compiler) into
``work`` and returns the environment variables that load it into a child process: what a
network volume's 1–10 ms commits cost asyncrawl, measured on a machine with a fast local disk.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "slowsync.c"


def preload(ms: float, work: Path) -> dict[str, str]:
    lib = work / "slowsync.so"
    if not lib.exists():
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(SOURCE), "-ldl"],
                       check=True)
    return {"LD_PRELOAD": str(lib), "SLOWSYNC_US": str(int(ms * 1000))}
