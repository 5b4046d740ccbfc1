"""The command line: argument parsing, signals, logging, progress display and exit codes.

``main`` owns the event loop and installs the signal handlers; everything it runs is the same
library API an application would use (``Config``, ``Crawler``), which never does either.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import stat
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from ._version import __version__
from .config import MAX_CONCURRENCY, MAX_NUMBER, UNUSED_URL, Config, check_job, expand_env, is_url
from .errors import AsyncrawlError, ConfigError, InputError, StorageError, without_credentials
from .progress import ErrorTally, LiveView, line, summary_fields, summary_text
from .records import EXPORT_FORMATS, EXPORT_OUTCOMES, settled
from .types import Progress, Summary

if TYPE_CHECKING:
    from .crawler import Crawler

log = logging.getLogger("asyncrawl")
T = TypeVar("T")
GC_YOUNG_THRESHOLD = 10_000  # CPython's default is 700


def tune_gc() -> None:
    """The garbage-collector policy of the CLI's crawls (``run``, ``demo``): collect the young
    generation every 10,000 net allocations instead of CPython's 700.

    A crawl keeps thousands of objects in flight (each request's aiohttp objects), and the workers
    that one group commit releases start their requests together. With the default threshold
    every such burst trips a young collection (~900 per 20,000 requests where a bare aiohttp loop
    has ~10), and the in-flight objects those collections promote then trigger full collections:
    6-10 % of the run's CPU (bench/README.md). The CLI owns its process, so it sets this; the
    library never touches the collector, which is the embedding application's call. Left alone
    when the collector is off or already tuned higher."""
    young, *older = gc.get_threshold()
    if gc.isenabled() and 0 < young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory() -> Callable[[], Any] | None:
    """The event loop ``ASYNCRAWL_LOOP`` asks for (``run_loop``): uvloop's factory, or None
    for asyncio's; a ``ConfigError`` for a value it does not know, or uvloop missing."""
    choice = os.environ.get("ASYNCRAWL_LOOP", "auto").strip().lower() or "auto"
    if choice not in LOOPS:
        raise ConfigError(f"ASYNCRAWL_LOOP must be one of {', '.join(LOOPS)}, got {choice!r}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("ASYNCRAWL_LOOP=uvloop needs uvloop: pip install "
                                  "'asyncrawl[fast]'") from None
        else:
            return uvloop.new_event_loop
    return None


def run_loop(main: Coroutine[Any, Any, T], *, writer: bool = True) -> T:
    """Run ``main`` in the event loop of the CLI's crawls (``run``, ``demo``): uvloop's when the
    ``fast`` extra is installed (``pip install 'asyncrawl[fast]'``), else asyncio's.
    ``ASYNCRAWL_LOOP=asyncio`` keeps asyncio's; ``=uvloop`` insists on uvloop. The CLI owns its
    process, so it picks the loop, and forks the SQLite state's writing process ahead (where
    ``writer``: ``sqlproc.Zygote``); the library runs in whatever loop the application has,
    and spawns that process."""
    try:
        factory = loop_factory()
    except ConfigError:
        main.close()  # never run: not left to warn that it was never awaited
        raise
    import asyncio

    from .sqlproc import ZYGOTE, Zygote
    from .sqlstore import serve_writes

    zygote = None
    try:
        zygote = Zygote.start(serve_writes) if writer else None
        token = ZYGOTE.set(zygote)
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                return runner.run(main)
        finally:
            ZYGOTE.reset(token)
    finally:
        main.close()  # (where it never ran: not left to warn that it was never awaited)
        if zygote is not None:
            zygote.close()


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-c", "--config", help="config file (default: ./config.toml if present)")
    sp.add_argument("--state", metavar="DIR|URL",
                    help="state directory ([state] dir), or a postgresql:// URL for a job that "
                         "many processes share ([state] url)")
    sp.add_argument("--job", metavar="NAME",
                    help="the job's name in a postgresql:// state ([state] job; default: default)")


def _run_parser(run: argparse.ArgumentParser) -> None:
    _common(run)
    run.add_argument("--ids", metavar="PATH|-", help="IDs file, one per line; - for stdin")
    run.add_argument("--url", metavar="TEMPLATE", help="URL template with {id}")
    run.add_argument("--concurrency", type=int, metavar="N",
                     help="workers = most requests in flight ([limits] concurrency)")
    run.add_argument("--rate", type=float, metavar="R", help="requests per second")
    run.add_argument("--burst", type=int, metavar="B", help="token bucket size ([limits] burst)")
    run.add_argument("--max-tries", type=int, metavar="N",
                     help="tries per ID per pass for retryable errors ([retry] max_tries)")
    run.add_argument("--timeout", type=float, metavar="S",
                     help="seconds per attempt ([request] timeout)")
    run.add_argument("-H", "--header", action="append", default=[], metavar="'Name: value'",
                     help="a request header (repeatable); the value may use ${ENV_VAR}")
    run.add_argument("-X", "--method", metavar="METHOD",
                     help="GET, POST, PUT, PATCH or HEAD ([request] method)")
    run.add_argument("--json", metavar="JSON", dest="json_body",
                     help="a JSON body, {id} filled into its string values ([request] json); "
                          "needs -X POST, PUT or PATCH")
    run.add_argument("--data", metavar="TEXT",
                     help="a text body with {id} ([request] body; its type: [request] "
                          "content_type, default text/plain)")
    run.add_argument("--proxy", metavar="URL",
                     help="an HTTP(S) proxy for every request ([request] proxy); without it "
                          "HTTP_PROXY / HTTPS_PROXY / NO_PROXY apply")
    run.add_argument("--insecure", action="store_true",
                     help="do not verify TLS certificates (a warning is printed on every run)")
    run.add_argument("--no-second-pass", action="store_true",
                     help="do not retry failed IDs after the cool-down (exit 6 if any are left)")
    run.add_argument("--recheck-unavailable", action="store_true",
                     help="try the IDs confirmed unavailable by earlier runs again ([passes] "
                          "recheck_unavailable)")
    run.add_argument("--reuse-state", action="store_true",
                     help="use a state directory made by a job with another URL, method or "
                          "parameters: keep what it settled, fetch the rest from the new address")
    run.add_argument("--cooldown", type=float, metavar="S",
                     help="seconds between pass 1 and pass 2 ([passes] cooldown)")
    run.add_argument("--max-requests", type=int, metavar="N", help="stop after N billable calls")
    run.add_argument("--dry-run", action="store_true",
                     help="count the calls left and their cost; send nothing")
    run.add_argument("--no-progress", action="store_true",
                     help="no live view on a terminal, and no periodic progress lines elsewhere "
                          "(errors, the halt reason and the summary are still written)")
    run.add_argument("--log-format", choices=("text", "json"), default="text",
                     help="text (default) or one JSON object per line")
    run.add_argument("--log-file", metavar="FILE",
                     help="log here instead of stderr (reopened when logrotate moves it)")
    run.add_argument("--metrics", metavar="HOST:PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics during the run "
                          "(the 'metrics' extra)")



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrawl",
        description="Fetch every item of a huge ID list from a rate-limited, paid HTTP API: "
                    "once, fast, resumable.")
    p.add_argument("--version", action="version", version=f"asyncrawl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _run_parser(sub.add_parser("run", help="fetch every unsettled ID (resumes where it stopped)"))

    st = sub.add_parser("status", help="what the state directory holds")
    _common(st)
    st.add_argument("--json", action="store_true", help="one JSON object")

    ex = sub.add_parser("export", help="write results (streams; constant memory)")
    _common(ex)
    ex.add_argument("--outcome", choices=EXPORT_OUTCOMES, default="ok",
                    help="which IDs (default: ok)")
    ex.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl",
                    help="jsonl (default), csv, ids (one bare ID a line), or parquet (-o FILE; "
                         "the 'parquet' extra)")
    ex.add_argument("--fields", metavar="a,b,...",
                    help="CSV columns: top-level fields or dotted paths into the payload "
                         "(author.name); an unknown one is an error")
    ex.add_argument("-o", "--output", metavar="FILE",
                    help="write atomically to FILE (-: standard output, the default)")

    demo = sub.add_parser("demo", help="a complete crawl against a local fault-injecting mock API")
    demo.add_argument("--ids", type=int, default=5000, metavar="N", help="how many IDs (5000)")
    demo.add_argument("--rate", type=float, default=2500.0, help="requests per second (2500)")
    demo.add_argument("--concurrency", type=int, default=32, help="workers (32)")
    demo.add_argument("--state", metavar="DIR", help="state directory (default: a new temp dir); "
                      "run again with the same one, the demo resumes")
    demo.add_argument("--no-progress", action="store_true", help="no progress view or lines")
    return p


# -- config ------------------------------------------------------------------------------------


def _headers(raw: list[str], secrets: set[str], need_env: bool = True) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in raw:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ConfigError("-H expects 'Name: value' (a header name, a colon, the value)")
        name = name.strip()
        out = _without(out, name)  # (a later -H of the same name, in any case, replaces it)
        out[name] = expand_env(value.strip(), "-H", None, secrets, need_env)
    return out


def _without(headers: dict[str, str], *names: str) -> dict[str, str]:
    """``headers`` less any of ``names``, matched as HTTP does: without regard to case."""
    drop = {n.lower() for n in names}
    return {k: v for k, v in headers.items() if k.lower() not in drop}


def load_config(args: argparse.Namespace, *, need_env: bool = True, need_url: bool = True,
                **overrides: Any) -> Config:
    """The config file (``-c`` or ./config.toml) with command-line flags on top.
    ``need_env=False`` for commands that only read the state: they never need the secrets;
    ``need_url=False`` for those that read nothing else (``Config.load``)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if getattr(args, "state", None) == "":  # (taken for no --state: ./state used instead)
        raise ConfigError("is empty: give a directory (or a postgresql:// URL)", key="--state")
    local = bool(getattr(args, "state", None)) and not is_url(args.state)
    if getattr(args, "state", None):
        overrides["state_url" if not local else "state_dir"] = args.state
    if getattr(args, "job", None):
        overrides["job"] = args.job
    path = args.config or ("config.toml" if Path("config.toml").is_file() else None)
    if path is None:
        if "url" not in overrides:
            if not need_url and overrides.keys() <= {"state_dir", "state_url", "job"}:
                # status/export need only the state (a run needs its URL: it said "no IDs",
                # or joined a shared job to fetch from a placeholder URL)
                return Config(url=UNUSED_URL, **overrides)
            raise ConfigError("no config: pass -c CONFIG, create ./config.toml, or give --url")
        return Config.from_dict({}, **overrides)  # every value is a flag: errors name the flag
    cfg = Config.load(path, need_env=need_env, need_url=need_url, **overrides)
    if local and cfg.state_url is not None:  # --state DIR replaces the file's [state] url
        cfg = dataclasses.replace(cfg, state_url=None)
    return cfg


def _run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    secrets: set[str] = set()
    need_env = not args.dry_run
    headers = _headers(args.header, secrets, need_env=need_env)

    def env(value: Any, flag: str) -> Any:  # ``${NAME}`` in a flag, as in the config's keys
        return None if value is None else expand_env(value, flag, None, secrets, need_env)

    return {
        "ids": args.ids, "url": env(args.url, "--url"), "concurrency": args.concurrency,
        "rate": args.rate,
        "burst": args.burst, "max_tries": args.max_tries, "timeout": args.timeout,
        "second_pass": False if args.no_second_pass else None, "cooldown": args.cooldown,
        "max_requests": args.max_requests, "verify_tls": False if args.insecure else None,
        "reuse_state": True if args.reuse_state else None,
        "recheck_unavailable": True if args.recheck_unavailable else None,
        "method": args.method, "json": env(_json_flag(args.json_body), "--json"),
        "body": env(args.data, "--data"), "proxy": args.proxy and env(args.proxy, "--proxy"),
        "_headers": headers, "_secrets": secrets,
    }


def _json_flag(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"is not JSON: {e}", key="--json") from None
    except RecursionError:
        raise ConfigError("is nested too deeply", key="--json") from None


def _config_for_run(args: argparse.Namespace) -> Config:
    o = _run_overrides(args)
    headers, secrets = o.pop("_headers"), o.pop("_secrets")
    cfg = load_config(args, need_env=not args.dry_run, **o)
    if headers or secrets:
        try:
            cfg = cfg.with_overrides(headers={**_without(dict(cfg.headers), *headers), **headers},
                                     secrets=cfg.secrets | frozenset(secrets))
        except ConfigError as e:  # (a header of -H's: the flag's error)
            if e.key != "request.headers" or not any(n in e.message for n in map(repr, headers)):
                raise
            raise ConfigError(e.message, key="-H") from None
    return cfg


# -- logging -----------------------------------------------------------------------------------


class _Redact(logging.Filter):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.config.redact(record.getMessage())
        record.args = None
        return True


class _JsonFormatter(logging.Formatter):
    """One JSON object per line. Stable keys: ``ts`` (Unix time), ``level``, ``event``
    (``progress``, ``errors``, ``halt``, ``summary`` or ``log``) and ``msg``, then the event's
    own fields (``progress``: an object; ``errors``: ``reason``, ``count``, ``window_s``,
    ``recorded``, ``example_id``; ``halt``: ``reason``, ``status``, ``message``; ``summary``:
    the final counts). Every line is redacted as a whole."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(),
            "event": getattr(record, "event", "log"), "msg": record.getMessage(),
        }
        obj.update(getattr(record, "fields", {}))
        return self.config.redact(json.dumps(obj, ensure_ascii=False))


class _Console(logging.StreamHandler):
    """stderr, shared with the live view: a log line first erases the view, and the next frame
    draws it again below the line."""

    live: LiveView | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.live is not None:
            self.live.clear()
        super().emit(record)


def _log_file(path: str) -> logging.Handler:
    """``--log-file``: logging's WatchedFileHandler (it reopens the file when logrotate moves
    it away), which says once on stderr that it cannot write (a full disk: a traceback a line,
    then exit 1 at its close) and lets the run go on."""
    import logging.handlers

    class LogFile(logging.handlers.WatchedFileHandler):
        failed = False

        def _open(self) -> Any:  # (logging's name) a new log file is owner-only: it holds
            return open(self.baseFilename, self.mode, encoding=self.encoding,  # IDs, errors
                        errors=self.errors, opener=lambda p, flags: os.open(p, flags, 0o600))

        def handleError(self, record: logging.LogRecord) -> None:  # (logging's name)
            self._failed(sys.exc_info()[1])

        def close(self) -> None:
            try:
                super().close()
            except OSError as e:
                self._failed(e)

        def _failed(self, e: BaseException | None) -> None:
            if not self.failed:
                self.failed = True
                why = e.strerror if isinstance(e, OSError) and e.strerror else e
                print(f"asyncrawl: warning: cannot write the log file {path}: {why} (the run "
                      "goes on)", file=sys.stderr, flush=True)

    return LogFile(path, encoding="utf-8")


def setup_logging(config: Config, fmt: str, log_file: str | None) -> logging.Handler:
    try:
        handler: logging.Handler = _log_file(log_file) if log_file else _Console(sys.stderr)
    except OSError as e:  # (a missing directory, a directory, no permission: before any work)
        raise ConfigError(f"cannot open {log_file}: {e.strerror or e}", key="--log-file") from None
    handler.setFormatter(_JsonFormatter(config) if fmt == "json"
                         else logging.Formatter(PLAIN))
    handler.addFilter(_Redact(config))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    for early in [h for h in log.handlers if h.name == EARLY]:  # (``main``'s: now this one's)
        log.removeHandler(early)
        _said_early(early, handler)
    return handler


EARLY = "asyncrawl-early"  # what logs before a command's own logging: ``main``, ``setup_logging``
PLAIN = "asyncrawl: %(levelname)s: %(message)s"


def _early_logging(command: str) -> logging.Handler:
    """What the package logs before the command has set up its own logging (the config's
    load: a removed key's warning): for ``run`` and ``demo``, held for ``setup_logging``, to
    go where their log goes (``--log-file``, ``--log-format json``); for the others, to stderr
    as their lines. It went to Python's last-resort handler: stderr, without the prefix,
    past the log file and its format."""
    if command in ("run", "demo"):
        from logging.handlers import BufferingHandler

        handler: logging.Handler = BufferingHandler(10_000)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(PLAIN))
    handler.name = EARLY
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return handler


# -- commands ----------------------------------------------------------------------------------


async def _run(config: Config, *, ids_path: str | None, progress: bool, total: int | None,
               metrics_at: str | None = None, noted: _Noted | None = None
               ) -> tuple[Summary, list[tuple[str, int]]]:
    """Run the crawl with the operator's view of it: the live view on a terminal (or a progress
    line every ``progress_interval`` s), and error reasons logged once per kind per interval."""
    import asyncio

    from .source import IdsFile

    errors = ErrorTally(attempts=True)
    live = LiveView(sys.stderr, errors) if progress and sys.stderr.isatty() else None
    every = 0.25 if live is not None else config.progress_interval
    consoles = [h for h in log.handlers if isinstance(h, _Console)]
    for h in consoles:
        h.live = live
    last_drain = time.monotonic()

    def drain_errors() -> None:
        nonlocal last_drain
        last_drain = time.monotonic()
        for burst in errors.drain():
            log.warning("%s", burst.message(), extra={"event": "errors", "fields": burst.fields()})

    def show(p: Progress) -> None:
        if live is not None:
            live(p)
        elif progress:
            text = line(p)
            top = errors.top(2)
            if top:  # why it is slow or stuck, counted by attempt, on the line itself
                text += " | errors " + " · ".join(f"{k} × {n:,}" for k, n in top)
            log.info("%s", text, extra={"event": "progress",
                                        "fields": {"progress": _progress_fields(p)}})
        if time.monotonic() - last_drain >= config.progress_interval * 0.99:
            drain_errors()

    from .crawler import Crawler  # the HTTP stack: loaded only by the commands that send

    # the error log lines need the failures only: no Result is made for an ok ID
    on_result = None
    on_attempt: Callable[[str, int | None, str | None], None] = errors.attempt
    metrics = None
    if metrics_at is not None:
        from .metrics import Metrics

        metrics = Metrics(config, lambda: crawler.progress())
        on_result = metrics.result  # (it counts every outcome)

        def both(item: str, status: int | None, error: str | None) -> None:
            errors.attempt(item, status, error)
            metrics.attempt(item, status, error)

        on_attempt = both

    crawler = Crawler(config, on_progress=show, progress_every=every, total=total,
                      on_result=on_result, on_failure=errors.result, on_attempt=on_attempt)
    loop = asyncio.get_running_loop()
    signals: list[int] = []
    leaving: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        signals.append(signum)
        crawler.stop("signal", signum=signum)
        if len(signals) == 2:  # (cut short: a store that answers nothing is not waited for)
            leaving.append(loop.create_task(_leave_a_stalled_store(crawler, signals[0],
                                                                   before=last_words)))

    def last_words() -> None:
        """The live view closed and the last interval's errors logged, before the summary
        and the halt line (or before an exit that skips them: ``_leave_a_stalled_store``)."""
        for h in consoles:
            h.live = None
        if live is not None:
            live.close()
        drain_errors()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if metrics is not None and metrics_at is not None:
                from .metrics import serving

                url = await stack.enter_async_context(serving(metrics, metrics_at))
                log.info("metrics at %s", url)
            async with crawler:
                if noted is not None:  # (those that came before: the run stops at once; as
                    # its ``run()`` starts in this very turn of the loop, ``stop`` holds for it)
                    early, noted.signals[:] = list(noted.signals), []
                    for signum in early:
                        on_signal(signum)
                summary = await crawler.run(IdsFile(ids_path, total) if ids_path else [])
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if noted is not None:  # (through the summary: noted, not the process's end)
            noted.install()
        for task in leaving:
            task.cancel()
        await asyncio.gather(*leaving, return_exceptions=True)
        last_words()
    return summary, errors.top(3)


async def _leave_a_stalled_store(crawler: Crawler, signum: int, *,
                                 before: Callable[[], None]) -> None:
    """After a second signal: once the state store is known to answer nothing
    (``Progress.store_stalled``: ~10 s with records waiting), exit at once instead of waiting
    for it for ever, as ``kill -9`` would and with the same effect (what it committed is
    kept), but saying so and with the first signal's exit code."""
    import asyncio

    while not crawler.progress().store_stalled:
        await asyncio.sleep(STALL_LOOK)
    with contextlib.suppress(Exception):
        before()
    log.error("the state store does not answer (a hung disk, a database holding its locks): "
              "exiting without waiting for it, as the second signal asks; what it committed is "
              "kept, and the next run fetches again what it had not committed")
    for handler in (*log.handlers, *logging.getLogger().handlers):
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(128 + signum)  # (a clean exit would wait for the store's thread or process)


STALL_LOOK = 0.5  # seconds between two looks, after a second signal, at whether the store stalled

# SIGHUP: a closed terminal or SSH session stops the job like SIGTERM (summary, halt record,
# exit 129), instead of killing it mid-write with nothing said.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _progress_fields(p: Progress) -> dict[str, Any]:
    return {"pass": p.pass_no, "done": p.done, "total": p.total, "ok": p.ok, "failed": p.failed,
            "unavailable": p.unavailable, "retries": p.retries, "rate": round(p.rate, 1),
            "limit": round(p.effective_rate, 1), "paused_s": round(p.paused_for, 1),
            "breaker_open": p.breaker_open, "eta_s": None if p.eta is None else round(p.eta)}


def _report_end(summary: Summary, config: Config, *, total: int | None, to_log: bool,
                errors: list[tuple[str, int]]) -> None:
    """The final summary on stdout; in the log (``to_log``: a file or JSON) a ``summary`` event;
    and the halt reason as the log's last line, after every aggregated error line. Stdout that
    cannot be written (a reader gone, a full disk) is said in the log; the rest goes on, and the
    run's exit code stays its own."""
    try:
        print(summary_text(summary, total=total, price=config.price_per_call,
                           currency=config.currency, errors=errors), flush=True)
    except OSError as e:
        _stdout_gone()
        log.warning("cannot print the summary on standard output (%s); `asyncrawl status` "
                    "shows it", e.strerror or e)
    if to_log:
        log.info("finished: exit %s", summary.exit_code,
                 extra={"event": "summary", "fields": summary_fields(summary, total=total)})
    if summary.halt is not None:
        log.warning("stopped: %s: %s", summary.halt.reason, summary.halt.message,
                    extra={"event": "halt", "fields": summary.halt.as_dict()})


FILES_RESERVE = 64  # open files a run needs beside its connections: state, log, pipes, the loop


def enough_files(connections: int, key: str = "limits.concurrency") -> None:
    """Raise this process's soft limit on open files (``ulimit -n``, often 1,024) to what
    ``connections`` and the rest of a run need, up to the hard limit; a ``ConfigError`` (exit
    2) if even that is too low. (Tries the limit refuses send nothing and wait for connections
    to close: the run would go at a fraction of the concurrency asked for.)"""
    import resource

    need = connections + FILES_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
        except (ValueError, OSError):  # (macOS: above kern.maxfilesperproc, whatever hard says)
            pass
    raise ConfigError(f"{connections:,} connections at once need about {need:,} open files, and "
                      f"this process may not open more than {soft:,} (`ulimit -n`, `ulimit -Hn`)"
                      ": lower the concurrency, or raise the limit", key=key)


SPOOL = "asyncrawl-ids-"  # IDs read once (stdin, a pipe) are copied to a file of that name
SPOOL_LINE = 1 << 20  # bytes of one line past which the copy stops (the check says what is wrong)
STALE_SPOOL = 60.0  # seconds: a copy at least this old that nobody holds was a killed run's


def _spool(source: BinaryIO, shown: str) -> tuple[str, int]:
    """Copy IDs that can be read only once (stdin, a pipe) to a temporary file (a run reads its
    IDs file more than once): its path and an open descriptor, flock()ed while the run lives.
    The run removes it at its end; one that was killed (``kill -9``) could not: the next run
    that copies IDs removes such leftovers. Bytes that are not UTF-8, or a line longer than
    ``SPOOL_LINE``, are an ``InputError`` naming the line (``shown``: the source's name), at
    once: not the copy of ``/dev/zero`` or ``/dev/urandom`` until the disk is full."""
    import codecs
    import fcntl
    import tempfile

    for old in Path(tempfile.gettempdir()).glob(f"{SPOOL}*"):
        with contextlib.suppress(OSError):
            st = os.lstat(old)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                    or time.time() - st.st_mtime < STALE_SPOOL:
                continue  # not one of ours, or one just made (perhaps not locked yet)
            held = os.open(old, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: its run is gone
                old.unlink()
            finally:
                os.close(held)
    fd, path = tempfile.mkstemp(prefix=SPOOL)
    fcntl.flock(fd, fcntl.LOCK_EX)
    utf8 = codecs.getincrementaldecoder("utf-8")()
    lines = tail = 0  # line ends copied; bytes since the last one
    try:
        with os.fdopen(os.dup(fd), "wb") as f:  # (the lock stays with ``fd``)
            while chunk := source.read(1 << 20):
                cut = utf8.getstate()[0]  # (a character's start, cut by the last read)
                try:
                    utf8.decode(chunk)
                except UnicodeDecodeError as e:  # (its start counts from the held bytes)
                    at = lines + (cut + chunk).count(b"\n", 0, e.start) + 1
                    raise InputError("not valid UTF-8", path=shown, line=at) from None
                end = chunk.rfind(b"\n")
                tail = len(chunk) - end - 1 if end >= 0 else tail + len(chunk)
                lines += chunk.count(b"\n")
                if tail > SPOOL_LINE:
                    raise InputError(f"a line over {SPOOL_LINE:,} bytes", path=shown,
                                     line=lines + 1)
                f.write(chunk)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return path, fd


def cmd_run(args: argparse.Namespace) -> int:
    from .source import is_stream, prescan_file

    config = _config_for_run(args)
    handler = setup_logging(config, args.log_format, args.log_file)
    try:
        if not config.ids and config.state_url is None:
            raise ConfigError("no IDs: pass --ids PATH (or - for stdin) or set [source] ids")
        spooled, spool_fd, shown = None, -1, ""  # shown: the IDs' name in messages
        ids_path = config.ids  # None: join a shared job and work on the IDs it has
        if ids_path == "-":
            ids_path, spool_fd = _spool(sys.stdin.buffer, "<stdin>")
            spooled, shown = ids_path, "<stdin>"
        elif ids_path and is_stream(ids_path):  # --ids <(command), a FIFO: read once
            with open(ids_path, "rb") as pipe:
                spooled, spool_fd = _spool(pipe, ids_path)
            ids_path, shown = spooled, ids_path
        try:
            # an IDs file the state has read before, unchanged, is not checked and counted again
            total = None if spooled or not ids_path else _known_lines(config, ids_path)
            if total is None and ids_path:
                try:
                    total = prescan_file(ids_path)
                except InputError as e:
                    if not spooled:
                        raise
                    raise InputError(e.message, path=shown, line=e.line) from None
            if config.state_url is not None:
                total = None  # a shared job's size is the job's, not this file's
            if spooled:
                config = config.with_overrides(ids=None)
            if args.dry_run:
                if not ids_path:
                    raise ConfigError("--dry-run needs the IDs to price: pass --ids PATH")
                return _dry_run(config, ids_path)
            enough_files(config.concurrency)
            tune_gc()
            if args.metrics is not None:
                from .metrics import Metrics, parse_address

                parse_address(args.metrics)
                Metrics.check()
            with _Noted() as noted:
                summary, errors = run_loop(_run(config, ids_path=ids_path, total=total,
                                                metrics_at=args.metrics,
                                                progress=not args.no_progress, noted=noted),
                                           writer=config.state_url is None)
                _report_end(summary, config, total=total, errors=errors,
                            to_log=args.log_format == "json" or args.log_file is not None)
        finally:
            if spooled:
                os.unlink(spooled)
                os.close(spool_fd)
        return summary.exit_code
    finally:
        log.removeHandler(handler)
        handler.close()


class _Noted:
    """The stop signals (``STOP_SIGNALS``) that come while the run's own handlers are not
    installed: before (the loop's start, the crawl's imports, the store's open), handed to the
    run once they are (``signals``); after (the writing process's end, the summary), noted and
    left: the run's summary and exit code stand. They ended the process there: SIGINT as a
    ``KeyboardInterrupt`` (exit 130), SIGTERM and SIGHUP by their default, with nothing said
    and the run's own exit code (a 402's 3, say) lost. A context (the main thread only)."""

    def __init__(self) -> None:
        self.signals: list[int] = []  # noted and not yet handed to a run
        self._before: dict[int, Any] = {}

    def note(self, signum: int, frame: Any = None) -> None:
        self.signals.append(signum)

    def install(self) -> None:
        """(Again:) note the stop signals (the run's loop took them over, then gave them back
        to their defaults)."""
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # (not the main thread: left as they are)
                before = signal.signal(sig, self.note)
                self._before.setdefault(sig, before)

    def __enter__(self) -> _Noted:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, before in self._before.items():
            signal.signal(sig, before)


def _known_lines(config: Config, ids_path: str) -> int | None:
    from .source import file_identity
    from .sqlstore import DB, SqliteStore

    try:
        if config.state_url is not None or not (Path(config.state_dir) / DB).exists():
            return None
        store = SqliteStore.reader(config.state_dir)
    except (AsyncrawlError, OSError):  # (a name too long, say)
        return None  # checked again below, with the error a user can act on
    try:  # (closed at once: the run's writing process is forked from this process, and a
        #    connection to the state left open here would make it spawn one; sqlproc.Zygote)
        return store.source_lines(file_identity(ids_path))
    except (AsyncrawlError, OSError):
        return None
    finally:
        store.close_sync()


def _dry_run(config: Config, ids_path: str) -> int:
    import asyncio

    from .source import CHUNK_IDS, SeenIds, file_ids
    from .store import read_store

    store = read_store(config.state, missing_ok=True, job=config.job)
    if store is not None:  # (another job's state: its run would refuse it, and so does this)
        check_job(config, store.job)

    final = settled(config.recheck_unavailable)  # (what the run would skip)

    async def count() -> tuple[int, int, int]:
        seen = SeenIds()  # on disk: flat memory for any length of list
        unique = left = done = 0
        chunk: list[str] = []

        async def settle(chunk: list[str]) -> None:
            nonlocal unique, left, done
            fresh = await asyncio.to_thread(seen.fresh, chunk)
            unique += len(fresh)
            states = await store.lookup(fresh) if store is not None and fresh else {}
            settled = sum(1 for item in fresh if states.get(item) in final)
            open_ = [item for item in fresh if states.get(item) not in final]  # (an ID cut
            if open_ and store is not None and not config.recheck_unavailable:  # off: no state)
                # (bought unusable 1 + paid_retries times: the run settles them without a call)
                bought = await store.unusable(open_)
                settled += sum(1 for b in bought.values() if b.unusable > config.paid_retries)
            done, left = done + settled, left + len(fresh) - settled

        try:
            async for item in file_ids(ids_path):
                chunk.append(item)
                if len(chunk) >= CHUNK_IDS:
                    await settle(chunk)
                    chunk = []
            await settle(chunk)
        finally:
            seen.close()
        return unique, done, left

    unique, done, left = asyncio.run(count())
    print(f"IDs: {unique:,} unique; already done: {done:,}; calls left: {left:,} "
          f"(at least one each; retries may add more)")
    if config.price_per_call is not None:
        print(f"cost of the calls left: {left * config.price_per_call:,.4f} {config.currency} "
              f"at {config.price_per_call:g} per call")
    else:
        print("set [billing] price_per_call to see the cost")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .report import status, status_text

    config = load_config(args, need_env=False, need_url=False)
    has_config = bool(args.config) or Path("config.toml").is_file()
    s = status(config, endpoint="" if has_config else None)  # "": from the config's URL
    with _to_stdout():
        print(json.dumps(s) if args.json else status_text(s))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .report import export

    config = load_config(args, need_env=False, need_url=False)
    fields = None
    if args.fields is not None:
        fields = [f.strip() for f in args.fields.split(",")]
        if not all(fields):
            raise ConfigError(f"an empty name in {args.fields!r}: give the columns as a,b,...",
                              key="--fields")
        if len(set(fields)) < len(fields):
            twice = next(f for f in fields if fields.count(f) > 1)
            raise ConfigError(f"{twice!r} is given twice", key="--fields")
    output = None if args.output == "-" else args.output  # (-o -: stdout, as --ids - is stdin)
    with _to_stdout() if output is None else contextlib.nullcontext():
        export(config, outcome=args.outcome, fmt=args.format, fields=fields,
               out=sys.stdout, path=output)
    return 0


@contextlib.contextmanager
def _to_stdout() -> Iterator[None]:
    """Around what writes to stdout: an OSError there (a full disk: `> /dev/full`) is the
    output's, exit 5 saying so, not a bug's traceback (a reader gone: ``main`` exits 0)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        if e.filename is not None:
            raise
        _stdout_gone()
        raise StorageError(f"cannot write to standard output: {e.strerror or e}") from None


DEMO_QUOTA = 1200  # the mock's requests per second; past it: 429 + Retry-After


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    for flag, value in (("--ids", args.ids), ("--rate", args.rate),
                        ("--concurrency", args.concurrency)):
        if not 0 < value <= MAX_NUMBER:  # (before anything is made: nan and inf too)
            raise ConfigError(f"must be greater than 0 (and at most 10^15), got {value:g}",
                              key=flag)
    if args.concurrency > MAX_CONCURRENCY:
        raise ConfigError(f"must be at most {MAX_CONCURRENCY:,}, got {args.concurrency:,}",
                          key="--concurrency")
    loop_factory()  # (an ASYNCRAWL_LOOP it cannot have: said before a temporary state is made)
    if args.state == "":  # (as for the other commands: not taken for no --state)
        raise ConfigError("is empty: give a directory", key="--state")
    state = args.state or tempfile.mkdtemp(prefix="asyncrawl-demo-")
    ids_file = Path(state) / "demo-ids.txt"
    try:
        again = ids_file.is_file()
        if not again and Path(state).is_dir() and any(Path(state).iterdir()):
            raise ConfigError(f"{state} is not empty and holds no demo's state: give the demo a "
                              "directory of its own", key="--state")
        Path(state).mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:  # (a file there, no permission, a name too long, NUL)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot make the demo's state directory {state[:200]}: {why}",
                          key="--state") from None
    return _demo(args, state, ids_file, again)


def _demo(args: argparse.Namespace, state: str, ids_file: Path, again: bool) -> int:
    from .source import prescan_file
    from .testing import MockAPI, demo_faults

    # A demo's state again (its IDs file is there): it resumes, though its mock API listens on
    # another port than the last time, which makes its URL another job's. A directory that
    # holds anything else is not the demo's to write into (a real job's state, say).
    with ids_file.open("w") as f:
        for i in range(args.ids):
            f.write(f"note-{i:06d}\n")
        for i in range(0, args.ids, 50):  # some duplicates: fetched once
            f.write(f"note-{i:06d}\n")
    api_key = "demo-key"
    print(f"asyncrawl demo: {args.ids:,} IDs against a local mock API with injected faults "
          f"(404, 400, 5xx, a {DEMO_QUOTA:,} req/s quota enforced with 429 + Retry-After, slow "
          "and dropped connections, bad JSON)")

    handler = setup_logging(Config(url="http://demo/{id}"), "text", None)

    async def main() -> Summary:
        async with MockAPI(faults=demo_faults, api_key=api_key, quota=DEMO_QUOTA) as api:
            config = Config(url=api.item_url, ids=str(ids_file), state_dir=state,
                            reuse_state=again,
                            headers={"X-Api-Key": api_key}, rate=args.rate,
                            burst=max(1, int(args.rate / 10)), concurrency=args.concurrency,
                            # the defaults a user gets, on a demo's clock: backoff 0.2 s .. 2 s
                            # instead of 1 s .. 60 s, a 2 s cool-down instead of 60 s
                            backoff_base=0.2, backoff_max=2.0, cooldown=2.0,
                            timeout=5.0, retry_after_max=2.0, progress_interval=2.0)
            total = prescan_file(str(ids_file))
            summary, errors = await _run(config, ids_path=str(ids_file), total=total,
                                         progress=not args.no_progress)
            paid = len(api.paid())
            # what a provider that bills every 2xx bills: the answers whose JSON did not parse
            # too (asyncrawl counts them billable), though only the others carry a payload
            billed = sum(1 for e in api.log if e.event == "end" and 200 <= (e.status or 0) < 300)
        print(summary_text(summary, total=total, errors=errors))
        def same(a: int, b: int) -> str:
            return "yes" if a == b else "NO"

        print(f"  mock API   {len(api.log) // 2:,} requests seen, {billed:,} answered 2xx "
              f"(= billable: {same(billed, summary.billable)}),\n             {paid:,} of them "
              f"with a payload (= ok fetched: {same(paid, summary.fetched)})")
        db = Path(state) / "state.db"
        print(f"  state file {db} (SQLite; its results view: one row per settled ID)")
        print(f"\ntry: asyncrawl status --state {state}\n     "
              f"asyncrawl export --state {state} --outcome unavailable\n     "
              f"sqlite3 -readonly {db} \"SELECT outcome, count(*) FROM results GROUP BY 1\"")
        return summary

    t0 = time.monotonic()
    enough_files(2 * args.concurrency, "--concurrency")  # (the mock API's side of each, too)
    tune_gc()
    try:
        summary = run_loop(main())
    finally:
        log.removeHandler(handler)
        handler.close()
    print(f"demo took {time.monotonic() - t0:.1f}s")
    return summary.exit_code


COMMANDS = {"run": cmd_run, "status": cmd_status, "export": cmd_export, "demo": cmd_demo}


def _standard_fds() -> None:
    """Open /dev/null onto a closed stdin, stdout or stderr (``2>&-``): else the first file or
    socket the run opens gets that number, and what is printed goes into it (a run with stderr
    closed waited for ever for its writing process, which held its own socket as stderr)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, "r" if fd == 0 else "w",  # noqa: SIM115
                                        closefd=False))  # (the process's, for its lifetime)


def _stdout_gone() -> None:
    """Stdout failed (a reader gone, a full disk): what is left in its buffer, and anything
    printed later, goes to /dev/null (else its flush at exit fails once more: exit 120)."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def main(argv: list[str] | None = None) -> int:
    _standard_fds()
    args = build_parser().parse_args(argv)
    early = _early_logging(args.command)
    try:
        return COMMANDS[args.command](args)
    except AsyncrawlError as e:  # (a URL's password quoted in it: one the config could not read)
        _said_early(early)  # (what was logged before it, first)
        print(f"asyncrawl: error: {without_credentials(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before the loop's own handler was installed
        return 130
    except BrokenPipeError:  # (status, export: the reader has what it wanted, as `head` does)
        _stdout_gone()
        return 0
    except Exception:
        traceback.print_exc()
        print("asyncrawl: internal error (a bug, please report it with the traceback above); "
              "what was recorded is safe: rerun to resume", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(early)
        _said_early(early)


def _said_early(early: logging.Handler, handler: logging.Handler | None = None) -> None:
    """What ``_early_logging`` held, once: to the command's own ``handler``, or (the command
    stopped before its logging took it over) to stderr as the console writes it."""
    held = getattr(early, "buffer", [])
    plain = logging.Formatter(PLAIN)
    for record in held:
        if handler is not None:
            handler.handle(record)
        else:
            print(plain.format(record), file=sys.stderr)
    held.clear()
