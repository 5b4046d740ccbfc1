"""Kill -9 against a third-party server: httpbin under gunicorn, a flaky status mix.

The torture bench (``torture.py``) kills runs against the bundled mock API, whose log says
which answers were billed. This one does the same against a server asyncrawl's authors did not
write: httpbin (``/status/{mix}``, which answers each request with a status drawn from the
mix: 200s with an empty body, 429s, 503s, 404s), behind gunicorn, whose access log is the
server's record of every answer. ``--kills`` times, ``asyncrawl run`` starts on the same state
and is killed with SIGKILL at a random moment (the run's process alone, or its whole process
group: the SQLite writing process too); then a last run finishes the job. Checks:

* every ID ends in exactly one of ``export --outcome ok``, ``failed``, ``unavailable``;
* an ID the server answered 200 more than once was listed by ``export --outcome in-doubt``
  after one of the kills (nothing billed twice silently: the in-doubt list is exact or wider);
* the last run exits 0 (everything ok or unavailable) or 6 (failed left, no second pass).

httpbin and gunicorn are not dependencies of asyncrawl: they are installed in a venv of their
own (``--httpbin-venv``, default ``bench/.httpbin-venv``) the first time. Usage::

    .venv/bin/python bench/httpbin_kill.py [--ids 20000] [--kills 8] [--concurrency 16]
        [--mix 200:90,429:3,503:4,404:3] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def httpbin_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"installing httpbin and gunicorn into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv.resolve())], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "httpbin", "gunicorn"],
                       check=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"gunicorn did not listen on {port}")


def asyncrawl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncrawl", *args], capture_output=True,
                          text=True)


def export(state: Path, outcome: str) -> list[dict[str, object]]:
    r = asyncrawl("export", "--state", str(state), "--outcome", outcome)
    if r.returncode != 0:
        raise SystemExit(f"export --outcome {outcome} failed ({r.returncode}): {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines()]


def answers(log: Path) -> dict[str, collections.Counter[int]]:
    """ID -> the statuses the server answered it with (gunicorn's access log)."""
    out: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for line in log.read_text().splitlines():
        query, _, status = line.rpartition(" ")
        if query.startswith("id="):
            out[query[3:]][int(status)] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=20000)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mix", default="200:90,429:3,503:4,404:3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--httpbin-venv", default=str(BENCH / ".httpbin-venv"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    python = httpbin_python(Path(args.httpbin_venv))
    work = Path(tempfile.mkdtemp(prefix="asyncrawl-httpbin-"))
    access = work / "access.log"
    port = free_port()
    server = subprocess.Popen(
        [str(python), "-m", "gunicorn", "-w", "3", "-b", f"127.0.0.1:{port}",
         "--access-logfile", str(access), "--access-logformat", "%(q)s %(s)s", "httpbin:app"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    try:
        wait_listening(port, time.monotonic() + 60)
        ids = [f"h{i:07d}" for i in range(args.ids)]
        (work / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
        state = work / "state"
        cfg = work / "httpbin.toml"
        cfg.write_text(f'[source]\nids = "{work / "ids.txt"}"\n[request]\n'
                       f'url = "http://127.0.0.1:{port}/status/{args.mix}?id={{id}}"\n'
                       'timeout = 10\n[response]\nformat = "text"\n'
                       f'[limits]\nconcurrency = {args.concurrency}\nrate = 3000\n'
                       '[retry]\nbackoff_base = 0.05\nbackoff_max = 0.5\nretry_after_max = 1\n'
                       f'[passes]\ncooldown = 1\n[state]\ndir = "{state}"\n')
        print(f"httpbin (gunicorn) at 127.0.0.1:{port}, /status/{args.mix}; {args.ids:,} IDs, "
              f"{args.kills} kills; work dir {work}", flush=True)
        in_doubt: set[str] = set()
        for k in range(1, args.kills + 1):
            whole_group = k % 2 == 0
            proc = subprocess.Popen([sys.executable, "-m", "asyncrawl", "run", "-c", str(cfg),
                                     "--no-progress"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            at = rng.uniform(0.5, 3.0)
            try:
                proc.wait(at)  # (the moment of the kill: random, not a synchronisation)
            except subprocess.TimeoutExpired:
                if whole_group:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait()
            deadline = time.monotonic() + 30  # the writing process ends once its pipe does
            while time.monotonic() < deadline:
                r = asyncrawl("status", "--state", str(state), "--json")
                if r.returncode == 0 and json.loads(r.stdout).get("running") is None:
                    break
                time.sleep(0.05)
            doubt = {str(o["id"]) for o in export(state, "in-doubt")} if state.exists() else set()
            new = doubt - in_doubt
            in_doubt |= doubt
            ok = len(export(state, "ok")) if state.exists() else 0
            print(f"kill {k:2d} at {at:.2f} s ({'group' if whole_group else 'process'}): "
                  f"exit {proc.returncode}, ok {ok:,}, in doubt +{len(new)}", flush=True)
        final = asyncrawl("run", "-c", str(cfg), "--no-progress")
        ok = {str(o["id"]) for o in export(state, "ok")}
        failed = {str(o["id"]) for o in export(state, "failed")}
        unavailable = {str(o["id"]) for o in export(state, "unavailable")}
        seen = answers(access)
        twice = {i for i, c in seen.items() if c[200] > 1}
        problems = []
        if final.returncode not in (0, 6):
            problems.append(f"the last run exited {final.returncode}: {final.stderr[-500:]}")
        overlap = (ok & failed) | (ok & unavailable) | (failed & unavailable)
        missing = set(ids) - ok - failed - unavailable
        if overlap or missing:
            problems.append(f"{len(overlap)} IDs in two outcomes, {len(missing)} in none")
        if twice - in_doubt:
            problems.append(f"{len(twice - in_doubt)} IDs answered 200 twice, never in doubt: "
                            f"{sorted(twice - in_doubt)[:5]}")
        statuses = collections.Counter()
        for c in seen.values():
            statuses.update(c)
        print(f"last run: exit {final.returncode}; ok {len(ok):,}, failed {len(failed):,}, "
              f"unavailable {len(unavailable):,}; server answers {dict(sorted(statuses.items()))}")
        print(f"answered 200 more than once: {len(twice):,} IDs (all in doubt at a kill: "
              f"{twice <= in_doubt}); in doubt at the kills: {len(in_doubt):,} IDs")
        print("violations " + (str(len(problems)) if problems else "0"))
        for p in problems:
            print("  " + p)
        return 1 if problems else 0
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
