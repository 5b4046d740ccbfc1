"""The worker's decision as a table (``decide``), and the queue between producer and workers."""

from __future__ import annotations

import asyncio

import pytest

from asyncrawl import Config
from asyncrawl.fetch import Attempt, Outcome
from asyncrawl.idqueue import IdQueue, Item
from asyncrawl.types import ErrorKind
from asyncrawl.worker import Action, Verdict, decide

CFG = Config(url="http://unused/{id}", max_tries=3, paid_retries=1, backoff_base=1.0,
             backoff_max=4.0, jitter="none", retry_after_max=30.0)

OK = Attempt(Outcome.OK, 200, data={}, billable=True)
E404 = Attempt(Outcome.SKIP, 404, error="HTTP 404", kind=ErrorKind.HTTP)
E402 = Attempt(Outcome.FATAL, 402, error="HTTP 402", kind=ErrorKind.HTTP)
E503 = Attempt(Outcome.RETRY, 503, error="HTTP 503", kind=ErrorKind.HTTP)
E429 = Attempt(Outcome.RETRY, 429, error="HTTP 429", retry_after=120.0, kind=ErrorKind.HTTP)
TIMEOUT = Attempt(Outcome.RETRY, None, error="timeout", kind=ErrorKind.TIMEOUT)
UNPARSABLE = Attempt(Outcome.RETRY, 200, error="2xx body is not valid JSON", billable=True,
                     kind=ErrorKind.BODY)
BOUGHT = "2xx body is not valid JSON; bought 2 times, not again ([retry] paid_retries)"

TABLE = [
    # item (tries so far, unusable so far), attempt, pass, outage -> verdict
    ((0, 0), OK, 1, False, Verdict(Action.SETTLE, "ok")),
    ((2, 0), OK, 2, False, Verdict(Action.SETTLE, "ok")),
    ((0, 0), E402, 1, False, Verdict(Action.HALT)),
    ((0, 0), E404, 1, False, Verdict(Action.SETTLE, "failed", permanent=True)),
    ((0, 0), E404, 2, False, Verdict(Action.SETTLE, "unavailable", permanent=True)),
    ((0, 0), E503, 1, False, Verdict(Action.PARK, delay=1.0)),  # backoff 1, 2, 4 ... (no jitter)
    ((1, 0), TIMEOUT, 1, False, Verdict(Action.PARK, delay=2.0)),
    ((2, 0), E503, 1, False, Verdict(Action.SETTLE, "failed")),  # the last of max_tries
    ((2, 0), E503, 2, False, Verdict(Action.SETTLE, "unavailable")),
    ((0, 0), E429, 1, False, Verdict(Action.PARK, delay=30.0)),  # Retry-After, capped
    ((0, 0), E503, 1, True, Verdict(Action.PARK, charged=False)),  # outage: waits at the gate
    ((2, 0), E503, 1, True, Verdict(Action.PARK, charged=False)),  # ... even on its last try
    ((0, 0), UNPARSABLE, 1, False, Verdict(Action.PARK, delay=1.0)),  # bought once: once more
    ((1, 1), UNPARSABLE, 1, False, Verdict(Action.SETTLE, "failed", error=BOUGHT)),
    ((1, 1), UNPARSABLE, 2, False, Verdict(Action.SETTLE, "unavailable", error=BOUGHT)),
    ((0, 0), E404, 1, True, Verdict(Action.SETTLE, "failed", permanent=True)),  # not an outage
    # a paid answer cut short while the breaker is open: at the gate, uncharged, unless it
    # was the last one paid_retries allows (it was bought a third time: a fault-mix audit)
    ((0, 0), UNPARSABLE, 1, True, Verdict(Action.PARK, charged=False)),
    ((1, 1), UNPARSABLE, 1, True, Verdict(Action.SETTLE, "failed", error=BOUGHT)),
]


@pytest.mark.parametrize(("before", "attempt", "pass_no", "outage", "verdict"), TABLE)
def test_decide(before: tuple[int, int], attempt: Attempt, pass_no: int, outage: bool,
                verdict: Verdict) -> None:
    item = Item("x", tries=before[0], unusable=before[1])
    assert decide(item, attempt, CFG, pass_no, outage=outage) == verdict
    assert (item.tries, item.unusable) == before  # deciding changes nothing


def test_decide_backoff_is_jittered_below_its_cap() -> None:
    cfg = Config(url="http://unused/{id}", max_tries=10, backoff_base=1.0, backoff_max=4.0)
    delays = {decide(Item("x", tries=5), E503, cfg, 1).delay for _ in range(200)}
    assert all(0 <= d <= 4.0 for d in delays) and len(delays) > 100


async def test_id_queue_push_passes_the_bound_and_a_cancelled_getter_loses_nothing() -> None:
    q = IdQueue(maxsize=4)
    for i in range(4):
        await q.put(Item(f"p{i}"))
    assert q.full()
    blocked = asyncio.create_task(q.put(Item("p4")))
    await asyncio.sleep(0)
    assert not blocked.done()  # the producer waits for room ...
    q.push(Item("retry"))  # ... a due retry does not
    assert q.qsize() == 5
    got = [(await q.get()).id for _ in range(3)]  # drained to half: the producer goes on
    await asyncio.wait_for(blocked, 5)
    got += [(await q.get()).id for _ in range(3)]
    assert got == ["p0", "p1", "p2", "p3", "retry", "p4"]

    # two getters wait; the first is woken by a put and cancelled before it runs: the item
    # goes to the second
    first = asyncio.create_task(q.get())
    second = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    await q.put(Item("only"))
    first.cancel()
    assert (await asyncio.wait_for(second, 5)).id == "only"
    assert first.cancelled() and q.qsize() == 0

    # get_nowait (what a worker asks first): None when empty, else the next item, waking a
    # waiting producer once drained to half, as get does
    assert q.get_nowait() is None
    for i in range(4):
        await q.put(Item(f"n{i}"))
    blocked = asyncio.create_task(q.put(Item("n4")))
    await asyncio.sleep(0)
    taken = [q.get_nowait(), q.get_nowait()]
    await asyncio.wait_for(blocked, 5)
    taken += [q.get_nowait() for _ in range(4)]
    assert [i.id if i else None for i in taken] == ["n0", "n1", "n2", "n3", "n4", None]
