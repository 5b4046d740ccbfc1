"""[4c] The entry point of the SQLite store's writing process (``sqlproc``) where it is spawned
(a forked one runs ``sqlstore.serve_writes`` directly): ``run([STATE_DIR, READ_FD, ANSWER_FD])``,
called by ``sqlproc.BOOT`` in the process a run's store starts (or
``python -m asyncrawl.sqlchild STATE_DIR READ_FD ANSWER_FD``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .alloc import fix_mmap_threshold
from .sqlstore import serve_writes


def main(argv: list[str]) -> int:
    fix_mmap_threshold()  # (a forked one has it from the run: its big payloads' blocks)
    return serve_writes(Path(argv[0]), int(argv[1]), int(argv[2]))


def run(argv: list[str]) -> None:
    """``main``, then exit at once: everything is closed and on disk by then, and the run
    waits for this process to end (it holds the state directory's lock). The interpreter's
    teardown would add ~25 ms to the end of every run (bench/README.md, stop 35)."""
    code = main(argv)
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run(sys.argv[1:])
