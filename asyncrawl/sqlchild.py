"""[4c] The entry point of the SQLite store's writing process (``sqlproc``):
``python -m asyncrawl.sqlchild STATE_DIR READ_FD ANSWER_FD``, started by a run's store."""

from __future__ import annotations

import sys
from pathlib import Path

from .sqlproc import serve
from .sqlstore import DB, SqliteStore, _connect


def main(argv: list[str]) -> int:
    state_dir = Path(argv[0])
    store = SqliteStore(state_dir, _connect(state_dir / DB))
    return serve(store.apply_batch, int(argv[1]), int(argv[2]), state_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
