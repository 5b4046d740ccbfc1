"""The exception tree. Every error asyncrawl raises on purpose is an ``AsyncrawlError``.

::

    AsyncrawlError
    ├── ConfigError        bad config file, key, value or flag       (CLI exit 2)
    │   └── SessionClosed  the aiohttp session given to a Crawler was closed under it
    ├── InputError         bad IDs file: unreadable, bad line        (CLI exit 2)
    ├── LockedError        another run holds the state directory     (CLI exit 2)
    ├── JobMismatch        the state directory belongs to another job (CLI exit 2)
    └── StorageError       the state cannot be written or read       (CLI exit 5)
        └── JournalCorrupt damage inside the journal (not a torn tail)

Network and HTTP problems are *not* exceptions: they are outcomes (see ``fetch.py``), recorded in
the state. aiohttp's exceptions are mapped to outcomes (an ``Outcome`` and an ``ErrorKind``) at
exactly one place, ``fetch.Fetcher._attempt``, so callers never see a backend's exceptions.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

# (userinfo holds no unencoded "/", "?" or "#": a port, then a path with an "@", is no password)
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^\s/?#:@'\"]*):[^\s/?#'\"]*@")
_PASSWORD_PARAM = re.compile(r"((?:password|passwd|pwd)\s*=\s*)('[^']*'|[^&\s'\"]*)",
                             re.IGNORECASE)


def without_credentials(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:password@``, a
    ``password=`` parameter) replaced by ``***``: for messages that quote a URL the config
    could not read (its secrets then unknown to ``Config.redact``), or that a library quotes
    (libpq quotes the URI it refuses)."""
    if "@" in text:
        text = _URL_PASSWORD.sub(r"\1:***@", text)
    if "=" in text:
        text = _PASSWORD_PARAM.sub(r"\1***", text)
    return text


def password_params(text: str) -> list[str]:
    """The values of the ``password=`` parameters in ``text`` (unquoted)."""
    return [m[2].strip("'") for m in _PASSWORD_PARAM.finditer(text)]


class AsyncrawlError(Exception):
    """Root of every error asyncrawl raises on purpose."""

    exit_code = 1


class ConfigError(AsyncrawlError):
    """The configuration (file, keyword or command-line flag) is invalid. Names the key."""

    exit_code = 2

    def __init__(self, message: str, *, key: str | None = None, path: Path | str | None = None,
                 line: int | None = None):
        self.message = message
        self.key = key
        self.path = str(path) if path is not None else None
        self.line = line  # of the key in the file, where it was found
        where = []
        if self.path:
            where.append(self.path if line is None else f"{self.path}:{line}")
        if key:
            where.append(key)
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class InputError(AsyncrawlError):
    """The ID source is unreadable or holds an invalid line. Names the file and line."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        self.message = message
        self.path = path
        self.line = line
        where = path or "<ids>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")


class LockedError(AsyncrawlError):
    """Another run holds the state directory."""

    exit_code = 2


class JobMismatch(AsyncrawlError):
    """The state directory was made by a job with another URL template, method or parameters."""

    exit_code = 2


# errno values that say a path given for a file to write is wrong (not that the disk failed)
_BAD_PLACE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                        errno.EISDIR, errno.ENAMETOOLONG})


class SessionClosed(ConfigError):
    """The application closed the session it gave the Crawler while the run went on: the run
    stops, then raises this. ``sent``: a request of the try left (a redirect's) before it."""

    def __init__(self, message: str, *, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent


class StorageError(AsyncrawlError):
    """The state directory cannot be written, fsynced or read. Names the path."""

    exit_code = 5

    def __init__(self, message: str, *, path: Path | str | None = None):
        self.path = str(path) if path is not None else None
        super().__init__(f"{self.path}: {message}" if self.path else message)


class RunEndedError(StorageError):
    """This run of a shared job was ended by the others (held up past its lease, it was taken
    for dead): nothing it does counts any more, however well the database answers."""


def output_error(e: OSError, path: Path | str) -> AsyncrawlError:
    """The error for an export file that cannot be made at ``path``: the flag's fault (a
    directory that does not exist, no permission: exit 2), else the disk's (exit 5)."""
    if e.errno in _BAD_PLACE:
        return ConfigError(f"cannot write the export there: {e.strerror}", key="--output",
                           path=path)
    return StorageError(f"cannot write the export: {e.strerror}", path=path)


def temp_beside(target: Path) -> tuple[int, str]:
    """A new file next to ``target`` for an export to be written to and renamed over it (open
    for writing: its descriptor and path): with ``target``'s permissions if it exists, else a
    new file's (0666 less the umask, as a shell's ``>`` makes it), not ``mkstemp``'s 0600.
    ``output_error`` if it cannot be made."""
    try:
        st = os.stat(target)
    except OSError:
        mode = None
    else:
        if stat.S_ISDIR(st.st_mode):  # (found now, not at the rename after the whole export)
            raise output_error(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)),
                               target)
        mode = st.st_mode & 0o777
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise output_error(e, target) from None
        if mode is not None:
            with contextlib.suppress(OSError):  # (best effort, as cp: vfat, some CIFS mounts)
                os.fchmod(fd, mode)
        return fd, str(tmp)


class JournalCorrupt(StorageError):
    """The journal is damaged before its last record, so repairing it would drop records."""

    def __init__(self, message: str, *, path: Path | str, offset: int):
        self.offset = offset
        super().__init__(f"{message} at byte offset {offset}", path=path)


def require_extra(module: str, extra: str, feature: str) -> Any:
    """Import the optional ``module``, or ``ConfigError`` (exit 2) saying which extra the
    ``feature`` needs."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and (
            module == e.name or module.startswith(f"{e.name}."))
        if missing:
            raise ConfigError(f"{feature} needs the '{extra}' extra: "
                              f"pip install 'asyncrawl[{extra}]'") from None
        # installed, and broken (pyarrow 14 beside NumPy 2, psycopg without a libpq): the
        # extra's install command would change nothing, what the import said is the cause
        raise ConfigError(f"{feature} needs {module} (the '{extra}' extra), which is installed "
                          f"but cannot be imported: {e}") from None
