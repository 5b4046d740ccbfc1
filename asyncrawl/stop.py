"""The job's stop switch (``Stop``): what every task of a run looks at before it starts anything,
set once by what ends the run (a fatal answer, the budget, a storage error, a signal, a
cancellation, an error), with the reason that wins."""

from __future__ import annotations

import asyncio
import logging

from .types import Halt

log = logging.getLogger("asyncrawl")

OVERRIDES = {"storage": 2, "fatal": 1}  # halts that take over from a lesser earlier one


class Stop:
    """The job's stop switch: set by a fatal answer, the budget, a storage error, a signal, a
    cancellation or an error; no request starts after it. The first reason wins, except that
    a storage error wins over any earlier reason (what came after it is not durable, which is
    what the operator must hear first: exit 5) and a fatal answer over any but a storage error
    or an earlier fatal one (a 402 met by a request in its grace period, after a signal or
    a failing hook stopped the run, still halts with exit 3 and sends the alert: the key or
    the balance needs the operator before a rerun can work)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.hurry = asyncio.Event()  # a second stop: cut the grace period short
        self.halt: Halt | None = None

    def __repr__(self) -> str:
        return f"<Stop halt={self.halt and self.halt.reason}>"

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self, halt: Halt) -> None:
        first = self.halt
        if first is None:
            self.halt = halt
        elif OVERRIDES.get(halt.reason, 0) > OVERRIDES.get(first.reason, 0):
            self.halt = Halt(halt.reason, halt.status, f"{halt.message} (the run was stopping: "
                             f"{first.message})")
            log.warning("%s", self.halt.message)
        self.event.set()


__all__ = ["OVERRIDES", "Stop"]
