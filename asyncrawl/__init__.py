"""asyncrawl: fetch every item of a huge ID list from a rate-limited, paid HTTP API — once, fast,
and without ever dying halfway.

::

    config = asyncrawl.Config.load("config.toml")
    async with asyncrawl.Crawler(config) as crawler:
        summary = await crawler.run(ids)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config
from .crawler import Crawler, Halt, Progress, Result, Summary
from .errors import (
    AsyncrawlError,
    ConfigError,
    InputError,
    JobMismatch,
    JournalCorrupt,
    LockedError,
    StorageError,
)
from .fetch import Outcome, Request, Response, new_session

__all__ = [
    "AsyncrawlError",
    "Config",
    "ConfigError",
    "Crawler",
    "Halt",
    "InputError",
    "JobMismatch",
    "JournalCorrupt",
    "LockedError",
    "Outcome",
    "Progress",
    "Request",
    "Response",
    "Result",
    "StorageError",
    "Summary",
    "__version__",
    "new_session",
]
