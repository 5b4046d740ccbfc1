"""Configuration: one frozen dataclass, TOML loading, and validation that names the key.

The TOML file has sections (``[request]``, ``[limits]`` ...); the ``Config`` object is flat, so a
library user writes ``Config(url=..., rate=...)``. ``TOML_KEYS`` is the one table that maps
``section.key`` to a field. Strings in the file may use ``${ENV_VAR}``; every value that came
from the environment, and every auth-like header or query value, is a *secret*: ``Config.redact``
removes secrets from any text before it is printed, logged or written.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError

DEFAULT_RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
DEFAULT_SKIP = frozenset({400, 404, 410})
DEFAULT_FATAL = frozenset({401, 402})
MAX_ID_LENGTH = 1024

_SECRET_HEADER = re.compile(r"(authorization|cookie|token|secret|password|(^|[-_])key$|api[-_]?key)", re.I)
_SECRET_PARAM = re.compile(
    r"^(key|token|api[-_]?key|apikey|access[-_]?token|secret|password|sig(nature)?)$", re.I)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _frozen_map(m: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Everything a crawl needs. All fields are keyword-only; see ``config.toml`` for meanings."""

    url: str
    ids: str | None = None
    method: str = "GET"
    timeout: float = 30.0
    headers: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    max_body_bytes: int = 8 * 1024 * 1024
    follow_redirects: str = "same-origin"
    max_redirects: int = 5
    verify_tls: bool = True
    ca_bundle: str | None = None
    error_field: str | None = None
    success_values: tuple[Any, ...] = ()
    concurrency: int = 16
    rate: float = 10.0
    burst: int | None = None
    max_requests: int | None = None
    adaptive: bool = True
    retry_budget: float = 0.1
    retry_budget_floor: float = 1.0
    breaker: bool = True
    breaker_probe_max: float = 10.0
    max_tries: int = 5
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    jitter: str = "full"
    retry_after_max: float = 600.0
    retryable: frozenset[int] = DEFAULT_RETRYABLE
    skip: frozenset[int] = DEFAULT_SKIP
    fatal: frozenset[int] = DEFAULT_FATAL
    second_pass: bool = True
    cooldown: float = 60.0
    recheck_permanent: bool = True
    state_dir: str = "state"
    grace: float = 10.0
    progress_interval: float = 10.0
    on_halt: str | None = None
    webhook: str | None = None
    price_per_call: float | None = None
    currency: str = "USD"
    max_spend: float | None = None
    secrets: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        _check_shapes(self)
        set_ = object.__setattr__
        set_(self, "headers", _frozen_map(self.headers))
        set_(self, "params", _frozen_map(self.params))
        for name in ("retryable", "skip", "fatal"):
            set_(self, name, frozenset(getattr(self, name)))
        set_(self, "success_values", tuple(self.success_values))
        set_(self, "method", self.method.upper())
        if self.burst is None:
            set_(self, "burst", max(1, math.ceil(self.rate)) if _is_num(self.rate) else 1)
        secrets = set(self.secrets)
        # str(): TOML may give a number (sent as text), and a wrong type must not fail here
        secrets.update(str(v) for k, v in self.headers.items() if _SECRET_HEADER.search(k))
        secrets.update(str(v) for k, v in self.params.items() if _SECRET_PARAM.match(k))
        set_(self, "secrets", frozenset(s for s in secrets if isinstance(s, str) and len(s) >= 3))
        _validate(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return self.redact(f"Config({shown})")

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], **overrides: Any) -> Config:
        """Read a TOML file; ``overrides`` (e.g. from CLI flags) win over the file."""
        p = Path(path)
        try:
            with p.open("rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("config file not found", path=p) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file: {e.__class__.__name__}", path=p) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML: {e}", path=p) from None
        return cls.from_dict(doc, path=p, **overrides)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, path: Path | None = None, **overrides: Any) -> Config:
        """Build from a parsed TOML document (sections and keys as in ``config.toml``)."""
        kwargs: dict[str, Any] = {}
        secrets: set[str] = set()
        base = path.parent if path else Path.cwd()
        for section, body in doc.items():
            if section not in TOML_SECTIONS:
                raise ConfigError(
                    f"unknown section; expected one of {', '.join(sorted(TOML_SECTIONS))}",
                    key=f"[{section}]", path=path,
                )
            if not isinstance(body, dict):
                raise ConfigError("must be a table", key=f"[{section}]", path=path)
            for key, value in body.items():
                dotted = f"{section}.{key}"
                if dotted not in TOML_KEYS:
                    known = ", ".join(k.split(".", 1)[1] for k in TOML_KEYS if k.startswith(section + "."))
                    raise ConfigError(f"unknown key; [{section}] takes {known}", key=dotted, path=path)
                name = TOML_KEYS[dotted]
                value = _expand(value, dotted, path, secrets)
                if name in ("ids", "state_dir", "ca_bundle") and isinstance(value, str) and value != "-":
                    value = str(base / value)
                kwargs[name] = value
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        kwargs["secrets"] = frozenset(secrets) | frozenset(kwargs.get("secrets", ()))
        if "url" not in kwargs:
            raise ConfigError("is required (the URL template with {id})", key="request.url", path=path)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if path is not None and e.path is None:
                raise ConfigError(str(e).split(": ", 1)[-1], key=e.key, path=path) from None
            raise

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    # -- derived -------------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``."""
        for s in self.secrets:
            if s in text:
                text = text.replace(s, "***")
        return text

    @property
    def request_budget(self) -> int | None:
        """Billable calls allowed this run: ``max_requests`` and ``max_spend`` combined."""
        caps = []
        if self.max_requests is not None:
            caps.append(self.max_requests)
        if self.max_spend is not None and self.price_per_call:
            caps.append(math.floor(self.max_spend / self.price_per_call + 1e-9))
        return min(caps) if caps else None


# section.key in TOML -> Config field
TOML_KEYS: dict[str, str] = {
    "source.ids": "ids",
    "request.url": "url",
    "request.method": "method",
    "request.timeout": "timeout",
    "request.headers": "headers",
    "request.params": "params",
    "request.max_body_bytes": "max_body_bytes",
    "request.follow_redirects": "follow_redirects",
    "request.max_redirects": "max_redirects",
    "request.verify_tls": "verify_tls",
    "request.ca_bundle": "ca_bundle",
    "response.error_field": "error_field",
    "response.success_values": "success_values",
    "limits.concurrency": "concurrency",
    "limits.rate": "rate",
    "limits.burst": "burst",
    "limits.max_requests": "max_requests",
    "limits.adaptive": "adaptive",
    "limits.retry_budget": "retry_budget",
    "limits.retry_budget_floor": "retry_budget_floor",
    "limits.breaker": "breaker",
    "limits.breaker_probe_max": "breaker_probe_max",
    "retry.max_tries": "max_tries",
    "retry.backoff_base": "backoff_base",
    "retry.backoff_max": "backoff_max",
    "retry.jitter": "jitter",
    "retry.retry_after_max": "retry_after_max",
    "retry.retryable": "retryable",
    "retry.skip": "skip",
    "retry.fatal": "fatal",
    "passes.second_pass": "second_pass",
    "passes.cooldown": "cooldown",
    "passes.recheck_permanent": "recheck_permanent",
    "state.dir": "state_dir",
    "run.grace": "grace",
    "run.progress_interval": "progress_interval",
    "alerts.on_halt": "on_halt",
    "alerts.webhook": "webhook",
    "billing.price_per_call": "price_per_call",
    "billing.currency": "currency",
    "billing.max_spend": "max_spend",
}
TOML_SECTIONS = frozenset(k.split(".")[0] for k in TOML_KEYS)
FIELD_KEYS = {v: k for k, v in TOML_KEYS.items()}


def _expand(value: Any, key: str, path: Path | None, secrets: set[str]) -> Any:
    """Replace ``${VAR}`` in strings (recursively); remember the values as secrets."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            var = m.group(1)
            if var not in os.environ:
                raise ConfigError(f"environment variable ${{{var}}} is not set (export it first)",
                                  key=key, path=path)
            secrets.add(os.environ[var])
            return os.environ[var]
        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{key}.{k}", path, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, key, path, secrets) for v in value]
    return value


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_shapes(c: Config) -> None:
    """The fields ``__post_init__`` converts, checked before it does: a wrong type is a
    ``ConfigError`` naming the key, not a ``TypeError`` from ``dict()`` or ``frozenset()``."""
    def bad(name: str, msg: str) -> ConfigError:
        return ConfigError(msg, key=FIELD_KEYS.get(name, name))

    for name in ("headers", "params"):
        v = getattr(c, name)
        if v is not None and not (isinstance(v, Mapping) and all(isinstance(k, str) for k in v)):
            raise bad(name, f"must be a table of name = value, got {type(v).__name__}")
    for name in ("retryable", "skip", "fatal", "success_values"):
        v = getattr(c, name)
        if not isinstance(v, list | tuple | set | frozenset):
            raise bad(name, f"must be a list, got {type(v).__name__}")
    for name in ("retryable", "skip", "fatal"):
        for code in getattr(c, name):
            if not isinstance(code, int) or isinstance(code, bool) or not 100 <= code <= 599:
                raise bad(name, f"must be a list of HTTP status codes (100-599), got {code!r}")
    if not isinstance(c.method, str):
        raise bad("method", f"must be a string, got {type(c.method).__name__}")


def _validate(c: Config) -> None:
    def bad(name: str, msg: str) -> ConfigError:
        return ConfigError(msg, key=FIELD_KEYS.get(name, name))

    types: dict[str, Any] = {f.name: f.type for f in fields(c)}
    for name in types:
        v = getattr(c, name)
        if name in ("timeout", "rate", "backoff_base", "backoff_max", "cooldown", "grace",
                    "retry_after_max", "progress_interval", "price_per_call", "max_spend",
                    "retry_budget", "retry_budget_floor", "breaker_probe_max"):
            if v is None and name in ("price_per_call", "max_spend"):
                continue
            if not _is_num(v):
                raise bad(name, f"must be a number, got {type(v).__name__} {v!r}")
        elif name in ("concurrency", "burst", "max_tries", "max_body_bytes", "max_redirects",
                      "max_requests"):
            if v is None and name == "max_requests":
                continue
            if isinstance(v, float) and v.is_integer():
                object.__setattr__(c, name, int(v))
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(name, f"must be a whole number, got {type(v).__name__} {v!r}")
        elif name in ("second_pass", "recheck_permanent", "verify_tls", "adaptive", "breaker"):
            if not isinstance(v, bool):
                raise bad(name, f"must be true or false, got {v!r}")
        elif name in ("url", "method", "state_dir", "jitter", "currency", "follow_redirects"):
            if not isinstance(v, str):
                raise bad(name, f"must be a string, got {type(v).__name__}")
        elif name in ("ids", "ca_bundle", "on_halt", "webhook", "error_field"):
            if v is not None and not isinstance(v, str):
                raise bad(name, f"must be a string, got {type(v).__name__}")
        elif name in ("headers", "params"):
            for k, hv in v.items():
                if not isinstance(hv, str | int | float) or isinstance(hv, bool):
                    raise bad(name, f"value of {k!r} must be a string")
                if any(ch in str(hv) for ch in "\r\n\0"):
                    raise bad(name, f"value of {k!r} contains a line break or NUL")
        elif name in ("retryable", "skip", "fatal"):
            for code in v:
                if not isinstance(code, int) or isinstance(code, bool) or not 100 <= code <= 599:
                    raise bad(name, f"must be a list of HTTP status codes (100-599), got {code!r}")

    positive = ("timeout", "rate", "concurrency", "burst", "max_tries", "max_body_bytes",
                "progress_interval", "retry_after_max", "retry_budget_floor", "breaker_probe_max")
    for name in positive:
        if getattr(c, name) <= 0:
            raise bad(name, f"must be greater than 0, got {getattr(c, name)!r}")
    for name in ("backoff_base", "backoff_max", "cooldown", "grace", "max_redirects",
                 "retry_budget"):
        if getattr(c, name) < 0:
            raise bad(name, f"must not be negative, got {getattr(c, name)!r}")
    for name in ("max_requests",):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise bad(name, "must be greater than 0 (leave it out for no limit)")
    for name in ("price_per_call", "max_spend"):
        if getattr(c, name) is not None and getattr(c, name) < 0:
            raise bad(name, "must not be negative")
    if c.max_spend is not None and not c.price_per_call:
        raise bad("max_spend", "needs [billing] price_per_call to be set")
    if c.jitter not in ("full", "equal", "none"):
        raise bad("jitter", f"must be one of full, equal, none; got {c.jitter!r}")
    if c.follow_redirects not in ("none", "same-origin", "any"):
        raise bad("follow_redirects", "must be one of none, same-origin, any")
    if c.method not in ("GET", "POST", "HEAD", "PUT"):
        raise bad("method", f"must be GET, POST, HEAD or PUT; got {c.method!r}")
    overlap = (c.retryable & c.skip) | (c.retryable & c.fatal) | (c.skip & c.fatal)
    if overlap:
        raise bad("retryable", f"status {sorted(overlap)[0]} is in more than one of retryable, skip, fatal")
    validate_url_template(c.url, c.params)


def validate_url_template(url: str, params: Mapping[str, str]) -> None:
    """The template must be http(s), name a host, and use ``{id}`` in the path or a parameter."""
    key = "request.url"
    probe = url.replace("{id}", "ID")
    try:
        parts = urlsplit(probe)
    except ValueError as e:
        raise ConfigError(f"invalid URL: {e}", key=key) from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"must start with http:// or https://, got {url!r}", key=key)
    if not parts.hostname:
        raise ConfigError("has no host", key=key)
    if "{id}" in urlsplit(url).netloc:
        raise ConfigError("{id} may not be part of the host", key=key)
    if "#" in url:
        raise ConfigError("may not contain a #fragment", key=key)
    if "{" in url.replace("{id}", "") or "}" in url.replace("{id}", ""):
        raise ConfigError("the only placeholder allowed is {id}", key=key)
    if "{id}" not in url and not any("{id}" in str(v) for v in params.values()):
        raise ConfigError(
            "must contain {id} (e.g. https://api.example.com/items/{id}), "
            "or a [request.params] value must", key=key)
