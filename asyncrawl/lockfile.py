"""The state directory and its lock: ``lock`` is flock()ed by the run that owns the directory
and holds its pid, so that two runs never share one state, and ``status`` can say who runs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import time
from pathlib import Path

from .errors import ConfigError, LockedError, StorageError

LOCK = "lock"
DYING_WAIT = 10.0  # seconds to wait for the lock of a run that was killed and is still exiting

# a state directory that cannot be where it is asked to be (not a failing disk: exit 2, not 5)
_NOT_THERE = frozenset({errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                        errno.ENAMETOOLONG})


def _dying(pid: int) -> bool:
    """Whether process ``pid`` has been killed and is exiting. A ``kill -9`` takes effect once
    the system call the process is in returns (an fsync on a busy disk can take a while), and
    its lock is held until then: a rerun started at once waits for that instead of refusing.
    Linux (``/proc``); elsewhere, or for a process that is gone, ``False``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip()[:1] in ("Z", "X"):  # exited: its files are closing
        return True
    kill = 1 << (signal.SIGKILL - 1)
    with contextlib.suppress(ValueError):
        return any(int(fields.get(k, "0").strip(), 16) & kill for k in ("SigPnd", "ShdPnd"))
    return False


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (Linux: ``/proc``; elsewhere ``False``). A run that
    is gone while its lock is still held leaves its SQLite writing process (``sqlproc``, which
    inherits the lock) applying what it had read: it exits then, and a rerun waits for that."""
    return Path("/proc/self").exists() and not Path(f"/proc/{pid}").exists()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_state_dir(d: Path) -> int:
    """Create ``d`` if needed and take its lock; the descriptor (closing it releases the lock).
    ``LockedError`` if another run holds it."""
    try:
        if not d.is_dir():
            d.mkdir(parents=True, mode=0o700)
            fsync_dir(d.parent)
    except FileExistsError:  # (a file there; or another run made it meanwhile: its lock says)
        if not d.is_dir():
            raise ConfigError("the state directory (--state, [state] dir) is a file here, "
                              "not a directory", path=d) from None
    except OSError as e:
        if e.errno in _NOT_THERE:  # (where it cannot be: a usage error, not a failing disk)
            raise ConfigError(f"cannot create the state directory (--state, [state] dir): "
                              f"{e.strerror}", path=d) from None
        raise StorageError(f"cannot create state directory: {e.strerror}", path=d) from None
    try:
        lock_fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StorageError(f"cannot open the state directory's lock: {e.strerror}",
                           path=d) from None
    deadline = time.monotonic() + DYING_WAIT
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            pid = ""
            with contextlib.suppress(OSError, ValueError):
                pid = os.pread(lock_fd, 32, 0).decode().strip()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(lock_fd)
                raise StorageError(f"cannot lock state directory: {e.strerror}",
                                   path=d) from None
            if pid.isdigit() and (_dying(int(pid)) or _gone(int(pid))) \
                    and time.monotonic() < deadline:
                time.sleep(0.02)  # its files close once the call it is stuck in returns
                continue
            os.close(lock_fd)
            if pid.isdigit() and _gone(int(pid)):  # (its writing process outlives it)
                raise LockedError(
                    f"the state directory {d} is held, and the run that took it (pid {pid}) is "
                    "no process here: it ended and its writing process still holds it (it lets "
                    "go once it has written what the run sent it; if it was stopped, `kill "
                    "-CONT` it), or it runs on another machine or in another container that "
                    "shares the directory (stop it first)") from None
            if pid == str(os.getpid()):  # (a library's: two Crawlers of one application)
                raise LockedError(
                    f"another run in this process (pid {pid}: a Crawler of this application) is "
                    f"using the state directory {d}; wait for it to finish or stop it first"
                ) from None
            raise LockedError(
                f"another asyncrawl run{f' (pid {pid})' if pid else ''} is using the state "
                f"directory {d}; wait for it to finish or stop it first") from None
    try:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(lock_fd)
        raise StorageError(f"cannot write the lock file: {e.strerror}", path=d / LOCK) from None
    return lock_fd


def lock_holder(state_dir: Path) -> int | None:
    """The pid of the run holding the state directory's lock (0: unknown), or ``None``."""
    try:
        fd = os.open(state_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            try:
                return int(os.pread(fd, 32, 0).decode().strip() or 0)
            except (OSError, ValueError):
                return 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
