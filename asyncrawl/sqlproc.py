"""[4b] The SQLite store's writing process, its pipe, and the intent log.

A run's ``SqliteStore`` does not write ``state.db`` in the crawl's own process: SQLite's work
there (its B-tree updates, WAL frames and fsyncs, beside the event loop) cost a crawl at the
stack's limit a quarter of its throughput, where the same work in another process costs it
nothing measurable (bench/README.md, 2026-12-03). Nor does the crawl's process keep a thread
for it: each thread that takes the GIL back after a system call makes the event loop wait for
it (bench/README.md, 2026-12-03, stop 34). So:

* the event loop writes each batch down a pipe (``WriterProcess.send``, non-blocking; what the
  pipe cannot take yet waits for it to drain) and reads the answers when the pipe has some
  (``loop.add_reader``): two system calls a batch, and no other thread;
* a child process (``sqlchild``, ``serve``) reads the batches as they come.
  The ``sent`` intents they hold, which a request waits for, and the run's ``run`` record,
  which its intents follow, it appends at once to ``intents.log`` with one synchronous write
  for all that one read brought (``IntentLog``), and answers ``logged``; then it applies the
  batches that have queued (up to ``MERGE``) in one transaction (group commit), in the order
  sent, records the last one's number in ``meta`` ('applied') in that same transaction, and
  answers ``applied`` with that number once it is durable. Everything but the logged records
  counts only then;
* at the next open, records of the log numbered beyond 'applied' (the child died, or the
  machine, before applying them) are applied first (``pending_records``), then the crashed
  run's open intents are closed as usual: every request that left is known.

The child inherits the state directory's lock: a rerun cannot start while it still writes. It
ends when the pipe does (the run closed it, or died) after answering for what it read; it
ignores the signals that stop a run (``RUN_SIGNALS``), which are the run's to handle.
"""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import queue
import select
import signal
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from .errors import StorageError
from .records import Record

if TYPE_CHECKING:  # (``status`` and ``export`` import this module, not asyncio)
    import asyncio
    import subprocess

INTENTS = "intents.log"
CUT_AT = 4 << 20  # bytes of intent log after which it is emptied, once all of it is applied
PIPE_BYTES = 1 << 20  # the pipes' size, where the system allows it (Linux)
MERGE = 1024  # batches queued in the pipe that the child applies in one transaction, at most
# (the writer's backlog gate, ``writer.BACKLOG``, bounds what they hold: ~1,024 records
# and a few for each request in flight)
# the kinds of record durable once in the intent log: intents (requests wait for them), the
# run (its intents belong to it), and paid answers that could not be used (rare; lost with a
# crash, a rerun would buy their IDs once more than paid_retries allows)
LOGGED = frozenset({"sent", "run", "unusable"})
LOG, APPLY = "logged", "applied"  # the child's two answers: (what, number, error)
_LEN = struct.Struct("<Q")
Answer = tuple[str, int, "str | None"]
PACKAGE = str(Path(__file__).resolve().parent)  # this copy of asyncrawl: the child runs it
# The child's start: ``python -P`` (the working directory is not put on its path, where an
# ``asyncrawl`` folder or a ``queue.py`` of the user's would be imported instead), then this
# very copy of the package by its path, whatever else its path holds; ``sqlchild.main``'s
# arguments follow the package's directory.
BOOT = ("import sys, importlib.util as u; p = sys.argv.pop(1); "
        "s = u.spec_from_file_location('asyncrawl', p + '/__init__.py', "
        "submodule_search_locations=[p]); m = sys.modules['asyncrawl'] = u.module_from_spec(s); "
        "s.loader.exec_module(m); import asyncrawl.sqlchild as c; c.run(sys.argv[1:])")


def wire(rec: Record) -> tuple[Any, ...]:
    """A record as sent down the pipe (``marshal``): its fields, without the parsed payload
    where the raw one is there (the store keeps the raw one)."""
    return tuple(rec) if rec.raw is None else (*rec[:5], None, *rec[6:])


def frame(obj: Any) -> bytes:
    """``obj`` as one frame of the pipe: its length, then its ``marshal`` form."""
    data = marshal.dumps(obj)
    return _LEN.pack(len(data)) + data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Frames:
    """Cuts what is read from a pipe into its frames: ``feed(chunk)`` returns every frame it
    completes."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Any]:
        buf = self._buf + chunk if self._buf else chunk
        out = []
        at = 0
        while len(buf) - at >= _LEN.size:
            end = at + _LEN.size + _LEN.unpack_from(buf, at)[0]
            if end > len(buf):
                break
            out.append(marshal.loads(buf[at + _LEN.size:end]))
            at = end
        self._buf = buf[at:]
        return out


def _reads(fd: int) -> Iterator[list[Any]]:
    """The frames of each read of ``fd`` (blocking), until the pipe ends."""
    frames = Frames()
    while True:
        try:
            chunk = os.read(fd, PIPE_BYTES)
        except OSError:
            chunk = b""
        if not chunk:
            return
        got = frames.feed(chunk)
        if got:
            yield got


# -- the intent log (the writing process) --------------------------------------------------------

class IntentLog:
    """``intents.log``: one JSON line ``[batch number, id, ts, key]`` per ``sent`` intent, and
    ``[batch number, record]`` (``Record.encode``'s form) for the other logged kinds, appended
    (``O_DSYNC``: on disk when the write returns) before they count as durable."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / INTENTS
        try:
            # O_DSYNC: a write returns once its bytes (and the file's new size) are on disk:
            # one system call where a write and an fsync took two
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_DSYNC,
                               0o600)
        except OSError as e:
            raise StorageError(f"cannot open the intent log: {e.strerror}",
                               path=self.path) from None
        self.size = os.fstat(self._fd).st_size
        self.last = 0  # the number of the last batch appended

    def append(self, batches: Sequence[tuple[int, Sequence[Record]]]) -> None:
        """Append the records of ``batches`` (number, records), in one write."""
        data = b"".join(orjson.dumps([seq, r.id, r.ts, r.key]) + b"\n" if r.kind == "sent"
                        else b"[%d," % seq + r.encode()[:-1] + b"]\n"
                        for seq, records in batches for r in records)
        try:
            _write_all(self._fd, data)
        except OSError as e:
            raise StorageError(f"cannot write the intent log: {e.strerror}",
                               path=self.path) from None
        self.size += len(data)
        self.last = batches[-1][0]

    def cut(self) -> None:
        """Empty the log (everything in it is applied to the database)."""
        try:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
        except OSError as e:
            raise StorageError(f"cannot write the intent log: {e.strerror}",
                               path=self.path) from None
        self.size = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def pending_records(state_dir: Path, applied: int) -> Iterator[tuple[int, Record]]:
    """The records of ``intents.log`` (intents, and the ``run`` record before a run's first)
    in batches numbered beyond ``applied``, in order, with their batch's number. A torn last
    line (the run died while appending it: never acked) ends the log."""
    try:
        data = (state_dir / INTENTS).read_bytes()
    except FileNotFoundError:
        return
    except OSError as e:
        raise StorageError(f"cannot read the intent log: {e.strerror}",
                           path=state_dir / INTENTS) from None
    for line in data.split(b"\n"):
        try:
            seq, *rest = orjson.loads(line)
            rec = (Record.decode(rest[0]) if len(rest) == 1
                   else Record("sent", rest[0], ts=rest[1], key=rest[2]))
        except (orjson.JSONDecodeError, ValueError, TypeError, IndexError, KeyError):
            return  # (the torn tail, or the empty string after the last newline)
        if seq > applied:
            yield seq, rec


# -- the run's side of the pipe (the event loop's thread) ----------------------------------------

class WriterProcess:
    """The child that writes ``state.db``, seen from the run's event loop: ``send`` numbers a
    batch and writes it down the pipe, ``attach`` has the loop hand each answer to a callback
    (``None`` once the child is gone)."""

    logged = LOGGED

    def __init__(self, state_dir: Path, lock_fd: int, seq: int,
                 zygote: Zygote | None = None) -> None:
        """Start the child: hand the run to ``zygote`` where given (``Zygote.serves``), else
        spawn a new interpreter that runs ``sqlchild``."""
        self.path = state_dir
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # (Linux; the default is 64 KiB)
            fcntl.fcntl(self._out, fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # a batch of results fits
        try:
            forked = zygote.take(state_dir, to_child, from_child, lock_fd) if zygote else None
            if forked is not None:
                self._proc: Forked | subprocess.Popen[bytes] = forked
            else:
                import subprocess  # (here: ``status`` and ``export`` import this module)

                if getattr(sys, "frozen", False) or not sys.executable:
                    # (a frozen application, PyInstaller's or Nuitka's: its executable is the
                    # application, which would start again, not a Python to run ``sqlchild``)
                    raise OSError(0, f"{sys.executable or 'this process'} is no Python "
                                     "interpreter (a frozen application)")
                self._proc = subprocess.Popen(
                    [sys.executable, "-P", "-c", BOOT, PACKAGE, str(state_dir), str(to_child),
                     str(from_child)], pass_fds=(to_child, from_child, lock_fd),
                    stdin=subprocess.DEVNULL)
        except OSError as e:
            for fd in (to_child, from_child, self._out, self._in):
                os.close(fd)
            raise StorageError(f"cannot start the state writer process: {e.strerror}",
                               path=state_dir) from None
        os.close(to_child)
        os.close(from_child)
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self.seq = seq  # the number of the last batch sent
        self._unsent = bytearray()  # what the pipe could not take yet
        self._frames = Frames()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_answer: Callable[[Answer | None], None] | None = None

    def __repr__(self) -> str:
        return f"<WriterProcess pid={self._proc.pid} seq={self.seq}>"

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_answer: Callable[[Answer | None], None]) -> None:
        """Hand the child's answers to ``on_answer`` (on ``loop``), and ``None`` at its end."""
        self._loop, self._on_answer = loop, on_answer
        loop.add_reader(self._in, self._readable)

    def detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._in)
            self._loop.remove_writer(self._out)
            self._loop = None

    def send(self, records: Iterable[Record]) -> int:
        """Write a batch down the pipe (what it cannot take now goes once it can); its
        number."""
        self.seq += 1
        data = frame((self.seq, [wire(r) for r in records]))
        if self._unsent:
            self._unsent += data
        else:
            try:
                n = os.write(self._out, data)
            except BlockingIOError:
                n = 0
            except OSError:  # the child is gone: its answers' end says so
                return self.seq
            if n < len(data):
                self._unsent += data[n:]
                if self._loop is not None:  # (else ``commit`` waits for the pipe itself)
                    self._loop.add_writer(self._out, self._writable)
        return self.seq

    def _writable(self) -> None:
        try:
            n = os.write(self._out, self._unsent)
        except BlockingIOError:
            return
        except OSError:
            n = len(self._unsent)  # the child is gone: its answers' end says so
        del self._unsent[:n]
        if not self._unsent and self._loop is not None:
            self._loop.remove_writer(self._out)

    def _read(self) -> bytes | None:
        """What the answers' pipe holds (``b""`` at its end; ``None``: nothing yet)."""
        try:
            return os.read(self._in, PIPE_BYTES)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _readable(self) -> None:
        chunk = self._read()
        if chunk is None:
            return
        assert self._on_answer is not None
        if not chunk:
            self.detach()
            self._on_answer(None)
            return
        for answer in self._frames.feed(chunk):
            self._on_answer(answer)

    def commit(self, records: Sequence[Record]) -> None:
        """Send a batch and wait until it is applied (blocks: not while ``attach``ed; for a
        store used without ``writer.ProcessWriter``). ``StorageError`` if it cannot be."""
        seq = self.send(records)
        while self._unsent:
            select.select([], [self._out], [])
            self._writable()
        while True:
            select.select([self._in], [], [])
            chunk = self._read()
            if chunk is None:
                continue
            if not chunk:
                raise self.gone()
            for what, n, error in self._frames.feed(chunk):
                if error is not None:
                    raise StorageError(error)
                if what == APPLY and n >= seq:
                    return

    @property
    def pid(self) -> int:
        return self._proc.pid

    def gone(self) -> StorageError:
        """The error of a child that ended before answering for everything."""
        code = self._proc.poll()
        how = f" (exit {code})" if code is not None else ""
        return StorageError(f"the state writer process ended unexpectedly{how}", path=self.path)

    def close(self) -> None:
        """End the pipe, and wait for the child to apply what it holds and exit (blocks: not
        on the event loop)."""
        self.detach()
        with contextlib.suppress(OSError):
            os.close(self._out)
        self._proc.wait()
        with contextlib.suppress(OSError):
            os.close(self._in)


# -- the child -----------------------------------------------------------------------------------

class Forked:
    """A child forked from this process: ``subprocess.Popen``'s ``pid``, ``poll``, ``wait`` and
    ``kill`` for it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # (reaped by someone else: SIGCHLD ignored, say)
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self) -> int:
        code = self._reaped(0)
        assert code is not None  # (a blocking waitpid returns only once the child has ended)
        return code

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """A writing process forked ahead, before the crawl has an event loop, a thread or a
    database connection (``cli.run_loop``), that waits to be handed a run's pipes and its state
    directory's lock (``take``) and then serves it (``target(state_dir, read_fd, answer_fd)``:
    ``sqlstore.serve_writes``).

    Spawned instead, a new interpreter and its imports take 60-100 ms that the run's first
    requests wait for (their ``sent`` intents are the child's to log): ~6 % of a 20,000-request
    crawl at the stack's limit (bench/README.md, stops 39-40). A fork copies what is the
    parent's at that instant, so it is done only where nothing of that can harm the child:

    * with no other thread in the process (``start``: they could hold locks the child needs,
      held forever in its copy), so not at the run's open, which has its executor's;
    * not for a database that the process had open at the fork (``serves``): SQLite keeps a
      per-process record of each database file a connection has open (by its inode), and the
      child's connection would take the parent's as its own (its locks on a descriptor the
      child has closed, which another file then reuses);
    * the child closes every descriptor but its socket and the standard streams, and first
      points everything that writes by number at those (``sys.stdout``, ``sys.stderr``,
      ``faulthandler``, its handlers of signals too), ignores the signals that stop the run
      (the run's to handle), and ends at the socket's end if it is never handed a run
      (``close``).

    Where any of that does not hold, the writing process is spawned as before."""

    def __init__(self, target: Callable[[Path, int, int], int]) -> None:
        import socket
        import warnings

        self._files = _open_files()  # (device, inode) of each regular file open now
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):  # (not written twice by a copy of its buffer)
            with contextlib.suppress(Exception):
                stream.flush()
        # no signal handler of the parent's runs in the child before it has its own
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            with warnings.catch_warnings():  # (3.12's warning of a fork beside threads: there
                warnings.simplefilter("ignore", DeprecationWarning)  # are none, see start)
                pid = os.fork()
            if pid == 0:
                _zygote(target, theirs.fileno(), mask)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        self._socket: socket.socket | None = ours
        self._taking = threading.Lock()
        self.process = Forked(pid)

    @classmethod
    def start(cls, target: Callable[[Path, int, int], int]) -> Zygote | None:
        """A zygote, where this platform allows one and the process has no other thread
        (else ``None``: the writing process is spawned)."""
        import socket

        if not hasattr(os, "fork") or not hasattr(socket, "send_fds") or _threads() != 1:
            return None
        try:
            return cls(target)
        except OSError:
            return None

    def serves(self, database: Path) -> bool:
        """Whether the child may serve a run of ``database``: not if this process had it open
        when the child was forked (nor if that cannot be told: it cannot be looked at)."""
        try:
            st = os.stat(database)  # (the file itself, if a link leads to it)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) not in self._files

    def take(self, state_dir: Path, rfd: int, wfd: int, lock_fd: int) -> Forked | None:
        """Hand the child a run (copies of the descriptors): it is that run's writing process
        from now on. ``None`` (and the child ended) if it was handed one already, or is
        gone."""
        import socket

        with self._taking:
            ours, self._socket = self._socket, None
        if ours is None:
            return None
        try:
            socket.send_fds(ours, [os.fsencode(state_dir)], [rfd, wfd, lock_fd])
        except OSError:
            ours.close()
            self.process.wait()  # (it ends at its socket's end)
            return None
        ours.close()
        return self.process

    def close(self) -> None:
        """If it was never handed a run: end it and wait for it (a few ms)."""
        with self._taking:
            ours, self._socket = self._socket, None
        if ours is not None:
            ours.close()
            self.process.wait()


# a zygote for this context's runs, if any: ``cli.run_loop`` sets it
ZYGOTE: ContextVar[Zygote | None] = ContextVar("asyncrawl_zygote", default=None)

# the signals that stop a run: ``cli.STOP_SIGNALS``, which the run handles (then it closes the
# pipe), and Ctrl-\ (SIGQUIT), which kills it as kill -9 does; its writing process ignores
# them and applies what it was sent
RUN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _threads() -> int:
    """The threads of this process, the system's own included (``/proc``), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _fds() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(os.sysconf("SC_OPEN_MAX")))


def _open_files() -> set[tuple[int, int]]:
    """(device, inode) of each regular file this process has open."""
    out = set()
    for fd in _fds():
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                out.add((st.st_dev, st.st_ino))
    return out


def _zygote(target: Callable[[Path, int, int], int], sock_fd: int,
            mask: set[int | signal.Signals]) -> None:
    """The forked child: shed what is the parent's, wait for a run, serve it; never returns
    (it would run on in the parent's code)."""
    code = 70
    try:
        import faulthandler
        import gc
        import io
        import logging
        import socket

        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
        for sig in RUN_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        gc.freeze()  # the parent's objects are never collected (finalized) here
        logging.disable(logging.CRITICAL)  # its handlers' files are the parent's
        # what writes to a descriptor by its number writes to the standard streams, not to
        # whatever file would reuse the number of a descriptor closed below
        faulthandler.cancel_dump_traceback_later()
        for sig in signal.valid_signals():  # (``faulthandler.register``'s: C handlers)
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                faulthandler.unregister(sig)
        enabled = faulthandler.is_enabled()
        faulthandler.disable()
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), errors="replace",
                                      line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                      errors="backslashreplace", line_buffering=True)
        if enabled:
            faulthandler.enable(sys.stderr)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd in _fds():
            if fd > 2 and fd != sock_fd:
                with contextlib.suppress(OSError):
                    os.close(fd)
        from .alloc import fix_mmap_threshold  # (while it waits: its big payloads' blocks)

        fix_mmap_threshold()
        with socket.socket(fileno=sock_fd) as sock:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if len(fds) != 3:  # (the socket's end: no run for it)
            code = 0
            return
        rfd, wfd, _lock = fds  # (the lock: held while this process lives)
        code = target(Path(os.fsdecode(msg)), rfd, wfd)
    except BaseException:
        with contextlib.suppress(BaseException):
            import traceback

            os.write(2, traceback.format_exc().encode(errors="replace"))
    finally:
        os._exit(code)


def serve(apply: Callable[[list[Record], int], None], rfd: int, wfd: int,
          state_dir: Path) -> int:
    """The child's loop. A thread reads the batches as they come, appends the logged records
    of all that one read brought to the intent log in one write and answers ``(LOG, number of
    the last of them, error)``, then queues the batches. This thread applies what has queued
    (up to ``MERGE`` batches: ``apply(records, number of the last batch)``, one transaction)
    and answers ``(APPLY, that number, error)``; once one failed, nothing is applied or logged
    after it, and every answer carries its error. The log is emptied whenever it has grown
    past ``CUT_AT`` and everything in it is applied, and at the end. Returns at the pipe's
    end."""
    for sig in RUN_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    intents = IntentLog(state_dir)
    closing = False
    inbox: queue.SimpleQueue[list[tuple[int, list[Record]]] | None] = queue.SimpleQueue()
    answering = threading.Lock()
    state = threading.Condition()
    applied = 0
    failed: list[str] = []  # the first error

    def answer(what: str, seq: int) -> bool:
        try:
            with answering:
                _write_all(wfd, frame((what, seq, failed[0] if failed else None)))
            return True
        except OSError:  # the run is gone: nobody to answer
            return False

    def read() -> None:
        try:
            for got in _reads(rfd):
                batches = [(seq, [tuple.__new__(Record, r) for r in batch]) for seq, batch in got]
                logged = [(seq, kept) for seq, batch in batches
                          if (kept := [r for r in batch if r.kind in LOGGED])]
                if logged:
                    with state:
                        if intents.size > CUT_AT:  # emptied once what it holds is applied
                            state.wait_for(lambda: applied >= intents.last or bool(failed)
                                           or closing)
                        try:
                            if not failed:
                                if intents.size > CUT_AT and applied >= intents.last:
                                    intents.cut()
                                intents.append(logged)
                        except StorageError as e:
                            failed.append(str(e))
                    answer(LOG, logged[-1][0])
                inbox.put(batches)
        finally:
            inbox.put(None)

    reader = threading.Thread(target=read, name="asyncrawl-sqlproc-reader", daemon=True)
    reader.start()
    ended = False
    while not ended:
        batches = inbox.get()
        if batches is None:
            break
        while len(batches) < MERGE:
            try:
                more = inbox.get_nowait()
            except queue.Empty:
                break
            if more is None:
                ended = True
                break
            batches += more
        seq = batches[-1][0]
        if not failed:
            try:
                apply([r for _, batch in batches for r in batch], seq)
            except StorageError as e:
                failed.append(str(e))
        with state:
            applied = seq
            state.notify_all()
        if not answer(APPLY, seq):
            break
    with state:
        closing = True
        state.notify_all()
    reader.join()
    with contextlib.suppress(StorageError):
        if not failed and intents.last <= applied and intents.size:
            intents.cut()  # (all applied: nothing for the next start to do)
    intents.close()
    return 0
