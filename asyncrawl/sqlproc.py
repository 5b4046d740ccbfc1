"""[4b] The SQLite store's writing process, its pipe, and the intent log.

A run's ``SqliteStore`` does not write ``state.db`` in the crawl's own process: SQLite's work
there (its B-tree updates, WAL frames and fsyncs, beside the event loop) cost a crawl at the
stack's limit a quarter of its throughput, where the same work in another process costs it
nothing measurable (bench/README.md, 2026-12-03). So:

* a child process (``python -m asyncrawl.sqlchild``, ``serve``) owns the writes: it reads batches
  from a pipe, applies whatever has queued in one transaction (group commit) in the order sent,
  records the last batch's number in ``meta`` ('applied') in that same transaction, and
  answers with that number once it is durable;
* a batch of ``sent`` intents alone, which a request waits for, is made durable by the crawl
  process itself first: appended to ``intents.log`` with a synchronous write (``IntentLog``),
  like the journal of earlier releases; the child gets it with the next batch (one write to
  the pipe for both) and applies it like any batch. So is the run's
  ``run`` record, which its intents follow (they belong to that run, whether or not the child
  applied it before a crash). Everything else counts only once the child has answered for it;
* at the next open, records of the log numbered beyond 'applied' (the child died, or the
  machine, before applying them) are applied first (``pending_records``), then the crashed
  run's open intents are closed as usual: every request that left is known.

The child inherits the state directory's lock: a rerun cannot start while it still writes. It
ends when the pipe does (the run closed it, or died) after answering for what it read; it
ignores SIGINT and SIGTERM, which are the run's to handle. ``WriterProcess`` is the run's side.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import marshal
import os
import queue
import signal
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from .errors import StorageError
from .records import Record

INTENTS = "intents.log"
CUT_AT = 4 << 20  # bytes of intent log after which it is emptied, once all of it is applied
PIPE_BYTES = 1 << 20  # the pipe to the child's size, where the system allows it (Linux)
MERGE = 64  # batches queued in the pipe that the child applies in one transaction, at most
LOGGED = frozenset({"sent", "run"})  # the kinds of record a batch made durable by the log holds
_LEN = struct.Struct("<Q")
Done = Callable[[StorageError | None], None]


def wire(rec: Record) -> tuple[Any, ...]:
    """A record as sent down the pipe (``marshal``): its fields, without the parsed payload
    where the raw one is there (the store keeps the raw one)."""
    return tuple(rec) if rec.raw is None else (*rec[:5], None, *rec[6:])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(fd: int, obj: object) -> None:
    data = marshal.dumps(obj)
    _write_all(fd, _LEN.pack(len(data)) + data)


def _frames(fd: int) -> Iterator[Any]:
    """The frames read from ``fd`` as they come, then ``None`` at the pipe's end: every frame
    that one read brings, without a read (and the GIL taken back after it) for each."""
    buf = b""
    while True:
        try:
            chunk = os.read(fd, PIPE_BYTES)
        except OSError:
            chunk = b""
        if not chunk:
            yield None
            return
        buf += chunk
        at = 0
        while len(buf) - at >= _LEN.size:
            end = at + _LEN.size + _LEN.unpack_from(buf, at)[0]
            if end > len(buf):
                break
            yield marshal.loads(buf[at + _LEN.size:end])
            at = end
        buf = buf[at:]


# -- the intent log (the run's process) ----------------------------------------------------------

class IntentLog:
    """``intents.log``: one JSON line ``[batch number, id, ts, key]`` per ``sent`` intent, and
    ``[batch number, record]`` (``Record.encode``'s form) for a ``run`` record, appended by the
    writer's thread (``O_DSYNC``: on disk when the write returns) before they count as
    durable."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / INTENTS
        try:
            # O_DSYNC: a write returns once its bytes (and the file's new size) are on disk:
            # one system call a batch where a write and an fsync took two
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_DSYNC,
                               0o600)
        except OSError as e:
            raise StorageError(f"cannot open the intent log: {e.strerror}",
                               path=self.path) from None
        self.size = os.fstat(self._fd).st_size
        self.last = 0  # the number of the last batch appended

    def append(self, seq: int, records: Sequence[Record]) -> None:
        data = b"".join(orjson.dumps([seq, r.id, r.ts, r.key]) + b"\n" if r.kind == "sent"
                        else b"[%d," % seq + r.encode()[:-1] + b"]\n" for r in records)
        try:
            _write_all(self._fd, data)
        except OSError as e:
            raise StorageError(f"cannot write the intent log: {e.strerror}",
                               path=self.path) from None
        self.size += len(data)
        self.last = seq

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


# -- the run's side of the pipe ------------------------------------------------------------------

class WriterProcess:
    """The child that writes ``state.db``, and the thread that reads its answers.

    ``send`` is called by one thread (the writer's); ``done(None)`` is called (by the reader
    thread) once the batch is durable, ``done(error)`` if it cannot be, in the order sent."""

    def __init__(self, state_dir: Path, lock_fd: int) -> None:
        self.path = state_dir
        import subprocess  # (here: ``status`` and ``export`` import this module, not it)

        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # (Linux; the default is 64 KiB)
            fcntl.fcntl(self._out, fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # a batch of results
            # fits: the writer's thread does not wait for the child to read it
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "asyncrawl.sqlchild", str(state_dir), str(to_child),
                 str(from_child)], pass_fds=(to_child, from_child, lock_fd),
                stdin=subprocess.DEVNULL)
        except OSError as e:
            for fd in (to_child, from_child, self._out, self._in):
                os.close(fd)
            raise StorageError(f"cannot start the state writer process: {e.strerror}",
                               path=state_dir) from None
        os.close(to_child)
        os.close(from_child)
        self._pending: collections.deque[tuple[int, Done | None]] = collections.deque()
        self._idle = threading.Condition()
        self.applied = 0  # the number of the last batch the child has made durable
        self.failed: StorageError | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read_answers, name="asyncrawl-writer-acks",
                                        daemon=True)
        self._reader.start()

    def send(self, seq: int, records: Sequence[Record], done: Done | None) -> None:
        if self.failed is not None:
            if done is not None:
                done(self.failed)
            return
        with self._idle:
            self._pending.append((seq, done))
        with contextlib.suppress(OSError):  # (the child is gone: its reader thread says so)
            _send(self._out, (seq, [wire(r) for r in records]))

    def drain(self) -> None:
        """Wait until the child has answered for everything sent (or failed)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending)

    def close(self) -> None:
        """End the pipe, and wait for the child to apply what it holds and exit."""
        self._closing = True
        with contextlib.suppress(OSError):
            os.close(self._out)
        self._proc.wait()
        self._reader.join()
        with contextlib.suppress(OSError):
            os.close(self._in)

    def _read_answers(self) -> None:
        for answer in _frames(self._in):
            if answer is None and self._closing and not self._pending:
                return  # (it has answered for everything, and ended as asked)
            if answer is None:
                error = StorageError("the state writer process ended unexpectedly "
                                     f"(exit {self._proc.wait()})", path=self.path)
            else:
                seq, message = answer
                error = StorageError(message) if message else None  # (it names the path)
            with self._idle:
                if answer is not None:
                    self.applied = max(self.applied, seq)
                ready = []
                while self._pending and (answer is None or error is not None
                                         or self._pending[0][0] <= seq):
                    ready.append(self._pending.popleft()[1])
                if error is not None and self.failed is None:
                    self.failed = error
            for done in ready:
                if done is not None:
                    done(error)
            with self._idle:
                self._idle.notify_all()
            if answer is None:
                return


# -- the child -----------------------------------------------------------------------------------

def serve(apply: Callable[[list[Record], int], None], rfd: int, wfd: int) -> int:
    """The child's loop: apply (``apply(records, number of the last batch)``, one transaction)
    the batches read from ``rfd``, as many as have queued (up to ``MERGE``) at once, and
    answer on ``wfd`` with the number of the last one, and the error once one failed (nothing
    is applied after it). A thread reads the pipe all the while, so that the run's writer never
    waits for a transaction to hand over the next batch. Returns at the pipe's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def read() -> None:
        for frame in _frames(rfd):
            inbox.put(frame)

    reader = threading.Thread(target=read, name="asyncrawl-sqlproc-reader", daemon=True)
    reader.start()
    failed = ""
    ended = False
    while not ended:
        frame = inbox.get()
        if frame is None:
            break
        frames = [frame]
        while len(frames) < MERGE:
            try:
                frame = inbox.get_nowait()
            except queue.Empty:
                break
            if frame is None:
                ended = True
                break
            frames.append(frame)
        seq = frames[-1][0]
        if not failed:
            try:
                apply([tuple.__new__(Record, r) for _, batch in frames for r in batch], seq)
            except StorageError as e:
                failed = str(e)
        try:
            _send(wfd, (seq, failed or None))
        except OSError:  # the run is gone: nobody to answer
            break
    return 0


