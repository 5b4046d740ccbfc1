"""Every example in README.md runs here, so the documentation cannot drift from the behaviour.

How a fenced block is treated (an HTML comment on the line before it can say more):

- ``toml``: loaded and validated with ``Config`` (a fragment is merged into a minimal config);
  with ``<!-- file: NAME -->`` it is also written to NAME in the walk-through's directory.
- ``sh``: run by bash in the walk-through's directory, in document order, with ``asyncrawl`` on
  the PATH and the mock API (with faults) in place of the example API. Each command's exit code
  must be 0, or N when its comment says "exit N". ``make demo`` runs the demo at a smaller size;
  ``make test`` is this suite and is only checked to exist.
- ``python``: run as a script in the same directory against a fault-free mock API.
- ``text``: diagrams and sample output, not run; with ``<!-- sample-output -->`` its row labels
  must appear in the output of the sh block before it, and with
  ``<!-- sample-output: FILE -->`` its JSON lines must have the keys of FILE's lines of the same
  event.
- ``<!-- not-run: why -->``: not run. Kept to a few blocks (``MAX_NOT_RUN``).

``SUBSTITUTIONS`` turns the realistic example (8 requests per second, a five-minute cool-down)
into a fast one; each must apply at least once, so an edit of the README cannot silently slow
the test down or leave the real API in it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from asyncrawl import Config
from asyncrawl.alerts import alert_facts
from asyncrawl.cli import build_parser
from asyncrawl.config import TOML_KEYS
from asyncrawl.crawler import Halt, Summary
from asyncrawl.errors import AsyncrawlError
from asyncrawl.testing import demo_faults, read_log

from .conftest import KEY, ROOT, cli

README = ROOT / "README.md"
MAX_NOT_RUN = 3
EXAMPLE_URL = "https://api.example.com/v1/notes/{id}"
SUBSTITUTIONS: list[tuple[str, str, str]] = [  # (language, pattern, replacement)
    ("toml", r"\brate = 8\b", "rate = 100"),
    ("toml", r"\bcooldown = 300\b", "cooldown = 0.5"),
    ("toml", r"\bprogress_interval = 60\b", "progress_interval = 0.5"),
    ("sh", r"\bsleep 30\b", "sleep 1.5"),
    ("python", r"\brate=8\b", "rate=500"),
]


@dataclasses.dataclass
class Block:
    lang: str
    body: str
    line: int  # of the opening fence
    note: str | None  # the HTML comment right before it, without <!-- -->


def blocks() -> list[Block]:
    out: list[Block] = []
    lines = README.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)", lines[i])
        if m:
            prev = lines[i - 1].strip() if i else ""
            note = prev[4:-3].strip() if prev.startswith("<!--") and prev.endswith("-->") else None
            end = lines.index("```", i + 1)
            out.append(Block(m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1, note))
            i = end
        i += 1
    return out


def test_every_block_is_run_or_says_why_not() -> None:
    bs = blocks()
    assert {b.lang for b in bs} <= {"sh", "toml", "python", "text"}, [b.lang for b in bs]
    not_run = [b for b in bs if b.note and b.note.startswith("not-run:")]
    assert len(not_run) <= MAX_NOT_RUN
    assert all(len(b.note.removeprefix("not-run:").strip()) > 10 for b in not_run if b.note)
    assert sum(b.lang == "sh" and b not in not_run for b in bs) >= 5
    assert sum(b.lang == "python" and b not in not_run for b in bs) >= 3


# -- the walk-through --------------------------------------------------------------------------


def substitute(b: Block, url: str, used: collections.Counter[str]) -> str:
    body = b.body.replace(EXAMPLE_URL, url)
    for lang, pattern, repl in SUBSTITUTIONS:
        if lang == b.lang:
            body, n = re.subn(pattern, repl, body)
            used[pattern] += n
    assert "example.com/v1" not in body, f"README line {b.line}: the real API is still in it"
    return body


def shell_script(b: Block, body: str, outdir: str) -> tuple[str, list[str]]:
    """bash for one sh block: each command's output kept in a file, its exit code checked."""
    script = ["set -u"]
    outs = []
    for n, raw in enumerate(body.splitlines()):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        cmd, comment = [*re.split(r"\s+#\s", raw, maxsplit=1), ""][:2]
        cmd = cmd.strip()
        if cmd.endswith("&"):
            script.append(cmd)
            continue
        expect = int(m.group(1)) if (m := re.search(r"\bexit (\d+)", comment)) else 0
        out = f"{outdir}/{b.line}-{n}.out"
        outs.append(out)
        script.append(
            f"{{ {cmd} ; }} > {out} 2>&1; rc=$?; cat {out}\n"
            f'if [ "$rc" -ne {expect} ]; then echo "README line {b.line + 1 + n}: exit $rc, '
            f'expected {expect}: {cmd.replace(chr(34), chr(39))}" >&2; exit 97; fi')
    return "\n".join(script) + "\n", outs


def labels(sample: str) -> list[str]:
    """The row labels of a sample (text before two spaces), without rows that start with a date."""
    found = []
    for line in sample.splitlines():
        m = re.match(r"\s*([a-z][a-z ]*?[a-z])\s{2,}", line)
        if m:
            found.append(m.group(1))
    return found


def check_sample(b: Block, last_output: str, work: Path) -> None:
    target = b.note.split(":", 1)[1].strip() if b.note and ":" in b.note else None
    if target is None:
        first = b.body.splitlines()[0]
        if first.startswith("asyncrawl: "):
            assert first in last_output, f"README line {b.line}: {first!r} not in:\n{last_output}"
        for label in labels(b.body):
            assert re.search(rf"^\s*{re.escape(label)}\s", last_output, re.M), \
                f"README line {b.line}: row {label!r} is not in the real output:\n{last_output}"
        return
    real: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in (work / target).read_text().splitlines():
        obj = json.loads(line)
        real[obj["event"]].append(obj)
    for line in b.body.splitlines():
        sample = json.loads(line)
        assert real[sample["event"]], f"README line {b.line}: no {sample['event']} event in {target}"
        got = real[sample["event"]][0]
        assert list(sample) == list(got), f"README line {b.line}: keys differ from {got}"
        if "progress" in sample:
            assert list(sample["progress"]) == list(got["progress"]), f"README line {b.line}"


def walkthrough_ids() -> list[str]:
    """IDs for the walk-through: mostly fine, some slow, some 404/400 (unavailable after two
    passes). No retryable faults: their backoff (seconds) would only slow the test down (the
    walk-through with flaky, dropped, gone and unparsable IDs among these ran 7 times in ~50 s
    each, without a hang); a budget that halts the run while IDs are parked for a retry is
    ``test_crawler.py::test_the_budget_halts_a_run_with_ids_parked_for_a_retry``."""
    want = {"ok": 280, "not_found": 6, "bad_request": 2, "slow": 3}
    out: list[str] = []
    i = 0
    while any(want.values()):
        item = f"n-{i}"
        kind = demo_faults(item).kind
        if want.get(kind, 0):
            want[kind] -= 1
            out.append(item)
        i += 1
    return out


def test_readme_examples_run(tmp_path: Path, mock_process: Any,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTES_API_KEY", KEY)  # for the config blocks checked in this process
    for n in (1, 2, 3):  # the several-keys example
        monkeypatch.setenv(f"NOTES_KEY_{n}", f"{KEY}-{n}")
    faulty = mock_process("--api-key", KEY, "--faults", "demo", "--latency", "0.05")
    clean = mock_process("--api-key", KEY, "--faults", "none")
    work = tmp_path / "work"
    (work / ".out").mkdir(parents=True)
    ids = walkthrough_ids()
    (work / "notes-ids.txt").write_text("\n".join([*ids, *ids[:3]]) + "\n")  # 3 duplicates
    env = {**os.environ, "NOTES_API_KEY": KEY,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    used: collections.Counter[str] = collections.Counter()
    last_output = ""
    ran = collections.Counter()

    for b in blocks():
        if b.note and b.note.startswith("not-run:"):
            continue
        if b.lang == "toml":
            body = substitute(b, faulty.item_url, used)
            doc = tomllib.loads(body)
            if "request" not in doc:  # a fragment
                doc["request"] = {"url": "https://api.example.com/{id}"}
            Config.from_dict(doc)  # valid, every key known
            if b.note and b.note.startswith("file:"):
                (work / b.note.split(":", 1)[1].strip()).write_text(body)
            ran["toml"] += 1
        elif b.lang == "sh":
            if b.body.lstrip().startswith("make "):
                continue  # the quick start: test_quick_start
            body = substitute(b, faulty.item_url, used)
            script, outs = shell_script(b, body, ".out")
            r = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, f"README line {b.line}:\n{r.stdout}\n{r.stderr}"
            last_output = "".join((work / out).read_text() for out in outs)
            ran["sh"] += 1
        elif b.lang == "python":
            body = substitute(b, clean.item_url, used)
            r = subprocess.run([sys.executable, "-c", body], cwd=work, env=env,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"README line {b.line}:\n{r.stdout}\n{r.stderr}"
            last_output = r.stdout + r.stderr
            ran["python"] += 1
        elif b.note and b.note.startswith("sample-output"):
            check_sample(b, last_output, work)
            ran["sample"] += 1

    assert ran["toml"] >= 2 and ran["sh"] >= 5 and ran["python"] >= 3 and ran["sample"] >= 3
    for _, pattern, _ in SUBSTITUTIONS:
        assert used[pattern], f"substitution {pattern!r} no longer applies: update SUBSTITUTIONS"

    # what the walk-through promises, checked against the API's own log
    log = read_log(faulty.log_path)
    paid = collections.Counter(e.id for e in log if e.event == "end" and e.status == 200)
    fetchable = {i for i in ids if demo_faults(i).kind not in ("not_found", "bad_request")}
    exported = [json.loads(x) for x in (work / "notes.jsonl").read_text().splitlines()]
    assert sorted(o["id"] for o in exported) == sorted(fetchable)  # each exactly once
    in_doubt = set((work / "in-doubt.txt").read_text().split())
    paid_twice = {i for i, n in paid.items() if n > 1}
    assert paid_twice <= in_doubt  # "billed twice" only ever for what the in-doubt list names
    st = json.loads(cli("status", "-c", str(work / "notes.toml"), "--json", env=env).stdout)
    # the provider's count exceeds status's by at most the in-doubt calls
    assert 0 <= sum(paid.values()) - st["billable"] <= len(in_doubt)
    assert st["unavailable"] == 8 and st["ok"] == len(fetchable)
    statuses = {row.split(",")[1] for row in (work / "unavailable.csv").read_text().splitlines()[1:]}
    assert statuses == {"404", "400"}
    # the SQLite example stored every note of the list (the fault-free API)
    import sqlite3

    with sqlite3.connect(work / "notes.db") as db:
        assert db.execute("SELECT count(*) FROM notes").fetchone()[0] == len(set(ids))


def test_quick_start(tmp_path: Path) -> None:
    quick = next(b for b in blocks() if b.lang == "sh" and b.body.lstrip().startswith("make "))
    targets = [line.split()[1] for line in quick.body.splitlines() if line.strip()]
    assert targets == ["demo", "test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t\$\(BIN\)/asyncrawl demo$", makefile, re.M)
    assert re.search(r"^test:.*\n(\t.*\n)*\t\$\(BIN\)/python -m pytest", makefile, re.M)
    # make demo, at a twentieth of its size (make test is this suite)
    r = cli("demo", "--ids", "250", "--no-progress", "--state", str(tmp_path / "demo"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "asyncrawl: finished" in r.stdout and "(= ok fetched: yes)" in r.stdout
    assert "(= billable: yes)" in r.stdout  # the bad-JSON 2xx answers billed on both sides
    # again on its state: it resumes (its mock API listens on another port: the same job)
    r = cli("demo", "--ids", "250", "--no-progress", "--state", str(tmp_path / "demo"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mock API   0 requests seen" in r.stdout, r.stdout
    # but it never writes into a directory that holds anything else (a real job's state)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "state.db").write_bytes(b"")
    r = cli("demo", "--ids", "5", "--no-progress", "--state", str(tmp_path / "real"))
    assert r.returncode == 2 and "--state" in r.stderr, r.stderr
    assert [p.name for p in (tmp_path / "real").iterdir()] == ["state.db"]


# -- tables that must match the code -----------------------------------------------------------


def _table(heading: str) -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # without the header


def _render_default(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, frozenset | tuple | list):
        return f"`[{', '.join(str(v) for v in sorted(value))}]`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value}`"


def test_config_reference_lists_every_key_with_its_default() -> None:
    rows = _table("## Configuration reference")
    documented = {r[0].strip("`"): r for r in rows}
    assert len(documented) == len(rows)  # no key twice
    assert set(documented) == set(TOML_KEYS)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for key, name in TOML_KEYS.items():
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            want = _render_default(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            want = _render_default(f.default_factory())
        else:
            want = "required"
        assert documented[key][1] == want, f"{key}: README says {documented[key][1]}, code {want}"
        assert len(documented[key][2]) > 15, f"{key}: say what it means"


def test_repo_config_toml_shows_every_key() -> None:
    section = ""
    shown: set[str] = set()
    for line in (ROOT / "config.toml").read_text().splitlines():
        if m := re.fullmatch(r"#?\s*\[([\w.]+)\].*", line.strip()):
            section = m.group(1)
        elif m := re.match(r"#?\s*([A-Za-z_][\w-]*)\s*=", line.strip()):
            shown.add(f"{section}.{m.group(1)}")
    tables = {"request.headers", "request.params"}  # shown as [request.headers] ...
    missing = set(TOML_KEYS) - shown - tables
    assert not missing, f"config.toml does not show {sorted(missing)}"
    text = (ROOT / "config.toml").read_text()
    assert all(f"[{t}]" in text for t in tables)


def test_exit_code_table_matches_the_code() -> None:
    documented = set()
    for code, _ in _table("### Exit codes"):
        documented |= {int(c) for c in code.split("/")}
    errors = {cls.exit_code for cls in _subclasses(AsyncrawlError)}
    base = dict(ok=0, failed=0, unavailable=0, pending=0, fetched=0, skipped=0, duplicates=0,
                retries=0, requests=0, billable=0, elapsed=0.0, state_dir="s")
    halts = {Summary(**base, halt=h).exit_code for h in (
        Halt("fatal", 402), Halt("budget"), Halt("storage"), Halt("signal", signal=2),
        Halt("signal", signal=15), Halt("signal", signal=1), Halt("cancelled"))}
    finished = {Summary(**base, halt=None).exit_code, Summary(**{**base, "failed": 1}, halt=None).exit_code}
    assert errors | halts | finished | {1} == documented


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


def test_command_line_synopsis_matches_the_parser() -> None:
    synopsis = next(b.body for b in blocks() if b.lang == "text" and b.body.startswith("asyncrawl run "))
    per_command: dict[str, set[str]] = collections.defaultdict(set)
    command = ""
    for line in synopsis.splitlines():
        if line.startswith("asyncrawl "):
            command = line.split()[1]
        per_command[command] |= set(re.findall(r"\[(-{1,2}[\w-]+)", line))
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():  # type: ignore[union-attr]
        # the README shows -c, -H, -o and -X by their short names, every other by its long one
        flags = {a.option_strings[0] if a.option_strings[0] in ("-c", "-H", "-o", "-X")
                 else a.option_strings[-1]
                 for a in parser._actions if a.option_strings and a.dest != "help"}
        assert per_command[name] == flags, f"asyncrawl {name}: README {per_command[name]} vs {flags}"


def test_alert_variables_are_the_ones_set() -> None:
    summary = Summary(ok=1, failed=0, unavailable=0, pending=0, fetched=1, skipped=0, duplicates=0,
                      retries=0, requests=1, billable=1, halt=None, elapsed=1.0, state_dir="s")
    facts = alert_facts(Config(url="https://a.example/{id}"), Halt("fatal", 402, "x"), summary)
    text = README.read_text(encoding="utf-8")
    documented = set(re.findall(r"`ASYNCRAWL_([A-Z_]+)`", text))
    assert documented == {k.upper() for k in facts}


def test_not_run_python_still_compiles() -> None:
    for b in blocks():
        if b.lang == "python":
            compile(b.body, f"README.md:{b.line}", "exec")
