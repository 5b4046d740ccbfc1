"""asyncrawl: fetch every item of a huge ID list from a rate-limited, paid HTTP API — once, fast,
and without ever dying halfway.

::

    config = asyncrawl.Config.load("config.toml")
    async with asyncrawl.Crawler(config) as crawler:
        summary = await crawler.run(ids)

``Crawler`` and the names of ``fetch`` (which need aiohttp) are imported when first used, so
that the read-only commands (``status``, ``export``) start without loading the HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .config import Config
from .errors import (
    AsyncrawlError,
    ConfigError,
    InputError,
    JobMismatch,
    JournalCorrupt,
    LockedError,
    StorageError,
)
from .types import ErrorKind, Halt, Progress, Result, Summary

if TYPE_CHECKING:
    from .crawler import Crawler
    from .fetch import Outcome, Request, Response, new_session

_LAZY = {"Crawler": "crawler", "Outcome": "fetch", "Request": "fetch", "Response": "fetch",
         "new_session": "fetch"}

__all__ = [
    "AsyncrawlError",
    "Config",
    "ConfigError",
    "Crawler",
    "ErrorKind",
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


def __getattr__(name: str) -> Any:  # PEP 562: the names that need aiohttp, on first use
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrawl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
