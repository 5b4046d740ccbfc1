"""Tell someone when a job halts: the ``[alerts] on_halt`` command and the ``webhook`` POST.

Both get the same facts (reason, status, message, counts, state directory), never a secret: the
message is redacted, and the command's environment is the caller's own, less the variables that
hold a secret of the job (the API key, ``PGPASSWORD``), plus ``ASYNCRAWL_*``.
An alert that fails is logged; it never changes the run's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

import aiohttp

from .config import Config
from .types import Halt, Summary

log = logging.getLogger("asyncrawl")
COMMAND_TIMEOUT = 30.0  # seconds the on_halt command may take (then it is killed, its children too)
WEBHOOK_TIMEOUT = 10.0  # seconds the webhook's POST may take
LIBPQ_SECRETS = frozenset({"PGPASSWORD"})  # a PostgreSQL state's password, read by libpq


def alert_facts(config: Config, halt: Halt, summary: Summary, *,
                left: int | None = None) -> dict[str, Any]:
    """What an alert says. ``pending``: the IDs left to fetch (``left``, as the summary counts
    them), else those of the run's list not settled."""
    return {
        "reason": halt.reason,
        "status": halt.status,
        "message": config.redact(halt.message),
        "ok": summary.ok,
        "failed": summary.failed,
        "unavailable": summary.unavailable,
        "pending": summary.pending if left is None else left,
        "state_dir": summary.state_dir,
    }


async def send_alerts(config: Config, halt: Halt, summary: Summary,
                      session: aiohttp.ClientSession, *, left: int | None = None,
                      hurry: asyncio.Event | None = None) -> None:
    """The ``on_halt`` command and the webhook, at once, each bounded in time (the command
    ``COMMAND_TIMEOUT``, the webhook ``WEBHOOK_TIMEOUT``), both cut short by ``hurry`` (set by a
    signal while they are sent: the operator wants out now)."""
    facts = alert_facts(config, halt, summary, left=left)
    sends = []
    if config.on_halt:
        sends.append(_command(config, config.on_halt, facts))
    if config.webhook:
        sends.append(_webhook(config, config.webhook, facts, session))
    if not sends:
        return
    sending = asyncio.gather(*sends, return_exceptions=True)
    stop = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
    waited: list[asyncio.Future[Any]] = [sending, *([stop] if stop is not None else [])]
    try:
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut = not sending.done()
        for t in waited:
            t.cancel()
        await asyncio.wait(waited)
    if cut:
        if not sending.cancelled():
            sending.exception()  # (the cancellation it holds: retrieved)
        log.warning("the alerts were cut short by a signal")
        return
    for failed in sending.result():
        if isinstance(failed, Exception):  # (each send logs the failures it expects)
            log.error("an alert failed: %s", type(failed).__name__, exc_info=failed)


def _holds_secret(value: str, config: Config) -> bool:
    """Whether an environment variable holds a secret: one whole, or a URL with one in it
    (HTTPS_PROXY's password: it went through whole); not any value a short secret is part
    of (a password "postgres" would take PATH away)."""
    return value in config.secrets or ("://" in value and config.redact(value) != value)


def _has_fileno(stream: Any) -> bool:
    """Whether ``stream`` is a real file (not an application's StringIO, say)."""
    try:
        return stream is not None and stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


async def _command(config: Config, command: str, facts: dict[str, Any]) -> None:
    """Run ``on_halt`` in a session of its own: killed with whatever it started if it takes
    longer than ``COMMAND_TIMEOUT`` or the alerts are cut short (a child left behind held the
    run's stdout open until it ended)."""
    # the caller's environment minus variables holding a secret (e.g. the API key), and the
    # database's password that libpq takes from the environment itself
    env = {k: v for k, v in os.environ.items() if not _holds_secret(v, config)
           and k not in LIBPQ_SECRETS}
    env.update({f"ASYNCRAWL_{k.upper()}": "" if v is None else str(v) for k, v in facts.items()})
    try:
        # (what it prints goes to stderr, the log's stream: the run's stdout is its summary,
        # which a script may read; 3 MB of a command's output came ahead of it)
        proc = await asyncio.create_subprocess_shell(
            command, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=sys.stderr.fileno()
            if _has_fileno(sys.stderr) else asyncio.subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        log.warning("on_halt command could not run: %s", e)
        return
    try:
        rc = await asyncio.wait_for(proc.wait(), COMMAND_TIMEOUT)
    except TimeoutError:
        log.warning("on_halt command timed out after %gs: killed", COMMAND_TIMEOUT)
        return
    finally:
        if proc.returncode is None:  # (timed out, or cut short)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
    if rc:
        log.warning("on_halt command exited with %s", rc)


async def _webhook(config: Config, url: str, facts: dict[str, Any],
                   session: aiohttp.ClientSession) -> None:
    """POST the facts to the webhook. Its URL is a secret, and aiohttp's errors quote it (in
    a form redaction may not know: a host in lower case, %7e as ~): only their kind is said."""
    try:
        async with session.post(url, json=facts,
                                timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT)) as resp:
            if resp.status >= 300:
                log.warning("alert webhook answered HTTP %s", resp.status)
    except aiohttp.ClientConnectorError as e:  # (its text says "ssl:default" for http://)
        why = e.os_error.strerror or type(e.os_error).__name__
        log.warning("alert webhook failed: cannot connect to %s:%s (%s)", e.host, e.port,
                    config.redact(why))
    except aiohttp.ClientResponseError as e:
        log.warning("alert webhook failed: %s (an answer that could not be read%s)",
                    type(e).__name__, f", HTTP {e.status}" if e.status else "")
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning("alert webhook failed: %s", type(e).__name__)
