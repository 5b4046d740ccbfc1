"""``python -m asyncrawl``: the command line."""

from .cli import main

raise SystemExit(main())
