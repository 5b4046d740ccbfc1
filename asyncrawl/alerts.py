"""Tell someone when a job halts: the ``[alerts] on_halt`` command and the ``webhook`` POST.

Both get the same facts (reason, status, message, counts, state directory), never a secret: the
message is redacted, and the command's environment is the caller's own, less the variables that
hold a secret of the job (the API key, ``PGPASSWORD``), plus ``ASYNCRAWL_*``.
An alert that fails is logged; it never changes the run's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aiohttp

from .config import Config
from .types import Halt, Summary

log = logging.getLogger("asyncrawl")
ALERT_TIMEOUT = 30.0
LIBPQ_SECRETS = frozenset({"PGPASSWORD"})  # a PostgreSQL state's password, read by libpq


def alert_facts(config: Config, halt: Halt, summary: Summary) -> dict[str, Any]:
    return {
        "reason": halt.reason,
        "status": halt.status,
        "message": config.redact(halt.message),
        "ok": summary.ok,
        "failed": summary.failed,
        "unavailable": summary.unavailable,
        "pending": summary.pending,
        "state_dir": summary.state_dir,
    }


async def send_alerts(config: Config, halt: Halt, summary: Summary,
                      session: aiohttp.ClientSession) -> None:
    facts = alert_facts(config, halt, summary)
    if config.on_halt:
        # the caller's environment minus variables holding a secret (e.g. the API key), and
        # the database's password that libpq takes from the environment itself
        env = {k: v for k, v in os.environ.items()
               if v not in config.secrets and k not in LIBPQ_SECRETS}
        env.update({f"ASYNCRAWL_{k.upper()}": "" if v is None else str(v) for k, v in facts.items()})
        try:
            proc = await asyncio.create_subprocess_shell(
                config.on_halt, env=env, stdin=asyncio.subprocess.DEVNULL)
            try:
                rc = await asyncio.wait_for(proc.wait(), ALERT_TIMEOUT)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                log.warning("on_halt command timed out after %gs", ALERT_TIMEOUT)
            else:
                if rc:
                    log.warning("on_halt command exited with %s", rc)
        except OSError as e:
            log.warning("on_halt command could not run: %s", e)
    if config.webhook:
        try:
            async with session.post(config.webhook, json=facts,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status >= 300:
                    log.warning("alert webhook answered HTTP %s", resp.status)
        except aiohttp.ClientConnectorError as e:  # (its text says "ssl:default" for http://)
            why = e.os_error.strerror or type(e.os_error).__name__
            log.warning("alert webhook failed: cannot connect to %s:%s (%s)", e.host, e.port,
                        config.redact(why))
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("alert webhook failed: %s", config.redact(str(e)) or type(e).__name__)
