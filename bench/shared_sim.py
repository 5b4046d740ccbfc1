"""Several processes of one shared job against one quota, simulated: the governor's own
``RateController`` in each, on a simulated clock (seconds of CPU, not minutes of wall time).

What it models of a job shared through PostgreSQL (``jobwide.Heartbeat``):

* the server: a fixed 1-s window of ``quota`` requests (429 + ``Retry-After: 1`` beyond it),
  each answer ``latency`` seconds after its request, as ``asyncrawl.testing --quota``;
* process ``k`` starts ``k x stagger`` seconds in; at its start every process takes
  ``1 / processes`` of the job's rate (``reshare``), and the newcomer takes the job's published
  rate and waits two heartbeats before it sends (``Heartbeat.join``);
* each process paces at its controller's rate, with up to ``in_flight`` requests out;
* a 429 that its controller judges job-wide pauses that process at once, and the others at
  their next heartbeat (every ``beat`` seconds, each at its own phase);
* a cut of a process's rate is published at its next heartbeat as the job's rate (its rate
  x the processes), and the others adopt their share of it at theirs (``adopt``).

It leaves out the database's latency, claims and leases, and the event loop's delays, so
its figures are not ``bench/governor.py shared``'s; but it reproduces the loss a job shared
by several processes sees against a single one (stop 47: 0.81-0.86 of the quota against
0.94), in a second, with seeds: the bench to try a governor change on first.

Usage: ``.venv/bin/python bench/shared_sim.py [--seeds 6] [--seconds 90]``; ``TREE=DIR`` to
import asyncrawl from another tree (``git worktree add DIR REF``).
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys

sys.path.insert(0, os.environ.get("TREE", os.path.join(os.path.dirname(__file__), "..")))

from asyncrawl.governor import RateController

SEND, ANSWER, BEAT, JOIN = 0, 1, 2, 3


def shared(processes: int = 3, quota: int = 30, rate: float = 60.0, seconds: float = 90.0, *,
           latency: float = 0.05, beat: float = 0.3, in_flight: int = 8, stagger: float = 1.0,
           seed: int = 0) -> tuple[float, int, float]:
    """One simulated job. Returns (successful answers a second after the first 5 s, 429s
    after the first 5 s, the lowest 10-s window's successful answers a second)."""
    rnd = random.Random(seed)
    n = processes
    cs = [RateController(max_rate=rate, now=0.0) for _ in range(n)]
    begin = [k * stagger + rnd.random() * 0.05 for k in range(n)]
    started = [False] * n
    live = 0
    ready = list(begin)
    paused = [0.0] * n  # each process's pause, as it knows it
    inflight = [0] * n
    out: list[tuple[float, int, float, bool]] = []  # (answered at, process, sent at, limited)
    window, used = -1, 0
    job_pause = 0.0  # the pause published to the job
    cut: tuple[float, float, int] | None = None  # published: (job's rate, when, by whom)
    seen_cut = [0.0] * n
    published_cuts = [0] * n
    next_beat = [rnd.random() * beat for _ in range(n)]
    t = 0.0
    oks: list[float] = []
    refused: list[float] = []
    while t < seconds:
        events = []
        for k in range(n):
            if not started[k]:
                events.append((begin[k], JOIN, k))
                continue
            if inflight[k] < in_flight:
                events.append((max(ready[k], paused[k], t), SEND, k))
            events.append((next_beat[k], BEAT, k))
        if out:
            events.append((out[0][0], ANSWER, out[0][1]))
        at, kind, k = min(events)
        t = max(t, at)
        c = cs[k]
        if kind == ANSWER:
            _, k, sent, limited = heapq.heappop(out)
            c = cs[k]
            inflight[k] -= 1
            c.on_response(t, sent, limited, asked=limited)
            (refused if limited else oks).append(t)
            until = getattr(c, "resumed", None)  # (the server took what was sent after a
            if until:  # 429, a pause ends early; a tree before stop 51 has no such thing)
                c.resumed, paused[k] = None, min(paused[k], until)
            if limited and c.limiting(t) and t + 1.0 > paused[k]:
                if hasattr(c, "resumed"):
                    c.on_pause(max(t, paused[k]), t + 1.0, cause=sent)
                else:
                    c.on_pause(max(t, paused[k]), t + 1.0)
                paused[k] = t + 1.0
        elif kind == SEND:
            c.tick(t)
            c.on_send(t)
            if int(t) != window:
                window, used = int(t), 0
            limited = used >= quota
            used += not limited
            inflight[k] += 1
            heapq.heappush(out, (t + latency, k, t, limited))
            ready[k] = t + 1.0 / c.rate
        elif kind == JOIN:
            started[k] = True
            live += 1
            for j in range(n):
                if started[j]:
                    cs[j].reshare(rate / live)
                    if hasattr(cs[j], "shared"):  # (a tree before stop 47 has no such flag)
                        cs[j].shared = live > 1  # (as Governor.share sets it)
            if cut is not None:
                seen_cut[k] = cut[1]
                c.adopt(cut[0] / live, t)
            paused[k] = max(paused[k], job_pause)
            ready[k] = max(t + 2 * beat, job_pause)
            next_beat[k] = t + beat
        else:  # BEAT: publish this process's pause and cut; take the job's
            next_beat[k] = t + beat
            job_pause = max(job_pause, paused[k])
            if c.cuts > published_cuts[k]:
                published_cuts[k] = c.cuts
                cut = (c.rate * live, t, k)
            if job_pause > paused[k] + 0.05:
                c.on_pause(max(t, paused[k]), job_pause)
                paused[k] = job_pause
            if cut is not None and cut[2] != k and cut[1] > seen_cut[k]:
                seen_cut[k] = cut[1]
                c.adopt(cut[0] / live, t)
    late = [x for x in oks if x >= 5]
    windows = [sum(1 for x in late if a <= x < a + 10) / 10 for a in range(5, int(seconds) - 9, 10)]
    return len(late) / (seconds - 5), sum(1 for x in refused if x >= 5), min(windows)


CASES = [(30, 60.0, 1), (30, 60.0, 2), (30, 60.0, 3), (30, 90.0, 5), (100, 300.0, 3),
         (40, 200.0, 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=90.0)
    args = p.parse_args(argv)
    print(f"{'quota':>5} {'rate':>5} {'processes':>9}   {'ok/s':>6} {'/quota':>6} "
          f"{'429s':>5} {'lowest 10 s':>11}   (mean of {args.seeds} seeds; 429s a run)")
    for quota, rate, n in CASES:
        runs = [shared(n, quota, rate, args.seconds, seed=s) for s in range(args.seeds)]
        ok = sum(r[0] for r in runs) / len(runs)
        print(f"{quota:>5} {rate:>5g} {n:>9}   {ok:>6.1f} {ok / quota:>6.2f} "
              f"{sum(r[1] for r in runs) / len(runs):>5.0f} {min(r[2] for r in runs):>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
