"""Awaiting what a run owns to its end, through a cancellation of the one who waits: a task
(``finish``) or a blocking call in a thread (``in_thread``). Either is waited for until it has
ended, then the cancellation is raised (SPEC §8: it propagates, never swallowed); nothing the
run holds (its writer, its store's lock and writing process) is left behind half-done."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def _cancelling() -> int:
    """How many cancellations of the current task are pending (``Task.cancelling``)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


async def finish(task: asyncio.Future[Any]) -> None:
    """Await a task we own to its end, even if our caller is cancelled meanwhile (a second
    cancellation is passed on to the task, to cut its own wait short); then raise what it
    raised, or else our caller's cancellation, which must propagate. The caller's counts as
    such also when the task ended cancelled (by its owner: us) in the same turn of the loop
    (it was once taken for the task's own, and the caller's dropped)."""
    before = _cancelling()
    cancelled = False
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        # (the task itself cancelled, by its owner, is no error; the caller's cancellation is)
        cancelled = not task.cancelled() or _cancelling() > before
        if not task.done():  # we were cancelled while it still ran: wait once more, then let go
            with contextlib.suppress(asyncio.CancelledError):
                await task
    exc = task.exception() if task.done() and not task.cancelled() else None
    if exc is not None:
        raise exc
    if cancelled:
        raise asyncio.CancelledError


async def in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the loop's default executor, run to its end: cancelled
    meanwhile, this waits for it (a thread cannot be stopped; a call still queued behind the
    application's own would be dropped, never run: a store's ``close`` that never ran left the
    state locked, its writing process alive) and then raises the cancellation. Cancelled
    again, it stops waiting (a call stuck on a server that never answers is not waited for
    for ever), and the call still runs, to its end, in its thread."""
    done = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))
    done.add_done_callback(_retrieved)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        if not done.done():
            await asyncio.wait([done])  # (a second cancellation: raised from here)
        raise


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Its outcome looked at: one nobody waits for any more is not logged as never retrieved."""
    if not fut.cancelled():
        fut.exception()
