"""Configuration: one frozen dataclass, TOML loading, and validation that names the key.

The TOML file has sections (``[request]``, ``[limits]`` ...); the ``Config`` object is flat, so a
library user writes ``Config(url=..., rate=...)``. ``TOML_KEYS`` is the one table that maps
``section.key`` to a field. Strings in the file may use ``${ENV_VAR}``; every value that came
from the environment, every auth-like header or query value (and those named in
``secret_names``), the token inside ``Bearer``/``Basic`` credentials and cookies, a URL's
password and the webhook URL are *secrets*: ``Config.redact`` removes them (as written and
percent-encoded) from any text before it is printed, logged or written, and no ``ConfigError``
quotes one. See SECURITY.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, quote_plus, urlsplit

from .errors import ConfigError, JobMismatch

log = logging.getLogger("asyncrawl")

PG_SCHEMES = ("postgresql://", "postgres://")  # a [state] url: a PostgreSQL store


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether a ``--state`` / ``[state]`` location names a PostgreSQL database."""
    return isinstance(location, str) and location.startswith(PG_SCHEMES)


DEFAULT_RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
DEFAULT_SKIP = frozenset({400, 404, 410})
DEFAULT_FATAL = frozenset({401, 402, 407})  # 407: the proxy refuses our credentials
MAX_ID_LENGTH = 1024
MAX_NUMBER = 10**15  # the largest number a setting holds, either way (a float of more overflows)
MAX_CONCURRENCY = 10_000  # requests in flight: more is no rate-limited API's
MIN_LEASE = 1.2  # seconds: four of a shared job's heartbeats (pgstore.HEARTBEAT, 0.3 s)
UNUSED_URL = "http://unused/{id}"  # the URL of a config that only reads the state (status, export)

# a header's name that says it carries a credential (sent to no other origin, its value
# redacted): as the query parameters' names below, a word auth, sig, signature or credential
_SECRET_HEADER = re.compile(r"(authorization|cookie|token|secret|password|(^|[-_])key$|api[-_]?key"
                            r"|credential|signature|(^|[-_])(auth|sig)([-_]|$))", re.I)
# a query parameter's name that says it carries a credential: a word of it (between - _ .) is
# secret, password, credential, signature or auth (client_secret, X-Amz-Signature, auth), or
# it holds api/access/private/client/... key or token (access_key, private_token, apiKey), or
# it is key, token or sig. Not max_tokens, page_token or sort_key: the job's identity in the
# state keeps those, so that a run with another value of one is told it is another job.
_W = r"[A-Za-z0-9_.\-]"
_PARAM_NAMES = (
    rf"(?:{_W}*[-_.])?(?:secret|passw(?:or)?d|pwd|credentials?|signature|auth)(?:[-_.]{_W}*)?"
    rf"|(?:{_W}*[-_.])?(?:api|access|private|secret|client|app|subscription|auth|refresh|id"
    rf"|session|bearer|oauth|licen[cs]e)[-_.]?(?:key|token)(?:[-_.]{_W}*)?"
    r"|key|token|sig|appid|jwt")
_SECRET_PARAM = re.compile(rf"^(?:{_PARAM_NAMES})$", re.I)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# the shell's forms that are no ${NAME}: ``${KEY:-default}`` (``-=?+``, with or without ``:``),
# ``${}``, and ``${KEY`` left open at the end (other text with a ``${`` is taken as written)
_SHELL_FORM = re.compile(r"\$\{(?:([A-Za-z_][A-Za-z0-9_]*)(:?[-=?+]|$)|\})")
# "Bearer abc", "Token abc", "Basic dXNlcjpwYXNz": the credential after an auth scheme word
_SCHEME_VALUE = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)\s+(\S.*)$", re.S)
MIN_SECRET_LENGTH = 3  # shorter values would redact ordinary text everywhere


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
    connect_timeout: float | None = None
    read_timeout: float | None = None
    verify_tls: bool = True
    ca_bundle: str | None = None
    proxy: str | None = None  # an HTTP(S) forward proxy; else HTTP(S)_PROXY / NO_PROXY apply
    json: Any = None  # a JSON body (TOML table or array), "{id}" filled in string values
    body: str | None = None  # a text body ("{id}" filled in), sent as ``content_type``
    content_type: str | None = None
    secret_names: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()  # several API keys, each with its share of the rate
    key_header: str = "Authorization"  # where a key goes ...
    key_format: str = "Bearer {key}"  # ... and how
    key_param: str | None = None  # or: the query parameter it goes in
    error_field: str | None = None
    success_values: tuple[Any, ...] = ()
    response_format: str = "json"
    concurrency: int = 16
    rate: float = 10.0
    burst: int | None = None
    max_requests: int | None = None
    adaptive: bool = True
    breaker: bool = True
    breaker_probe_max: float = 10.0
    max_tries: int = 5
    paid_retries: int = 1
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
    recheck_unavailable: bool = False  # this run tries the IDs confirmed unavailable again
    state_dir: str = "state"
    state_url: str | None = None  # a PostgreSQL database, for a job shared by many processes
    job: str = "default"  # the job's name in that database
    lease: float = 30.0  # seconds a dead process's claimed IDs stay with it
    reuse_state: bool = False
    grace: float = 10.0
    progress_interval: float = 10.0
    on_halt: str | None = None
    webhook: str | None = None
    price_per_call: float | None = None
    currency: str = "USD"
    max_spend: float | None = None
    secrets: frozenset[str] = field(default=frozenset(), repr=False)
    # derived in __post_init__: every form of every secret (longest first), and the pattern
    # that blanks secret-named query parameters in URLs
    _needles: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _param_re: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        given = self.secrets if isinstance(self.secrets, set | frozenset | list | tuple) else ()
        set_(self, "_needles", _forms_of(s for s in given if isinstance(s, str)))
        # A ConfigError quotes the offending value, which may hold a secret (a wrong-typed
        # value that came from ${ENV}): every message is redacted before it leaves.
        with self._redacting_errors():
            _check_shapes(self)
        set_(self, "headers", _frozen_map(self.headers))
        set_(self, "params", _frozen_map(self.params))
        for name in ("retryable", "skip", "fatal"):  # (404.0 is 404: TOML floats are numbers)
            set_(self, name, frozenset(int(v) if isinstance(v, float) else v
                                       for v in getattr(self, name)))
        set_(self, "success_values", tuple(self.success_values))
        set_(self, "secret_names", tuple(self.secret_names))
        set_(self, "keys", tuple(self.keys))
        set_(self, "method", self.method.upper())
        if self.burst is None:
            set_(self, "burst", max(1, math.ceil(self.rate)) if _is_num(self.rate) else 1)
        secrets = {s for s in given if isinstance(s, str)}
        # str(): TOML may give a number (sent as text), and a wrong type must not fail here
        for k, v in self.headers.items():
            if self.is_secret_header(k):
                secrets.update(_credential_parts(str(v), cookie=k.lower() == "cookie"))
        secrets.update(str(v) for k, v in self.params.items() if self.is_secret_param(k))
        for key in self.keys:  # each key is a secret wherever it goes
            if isinstance(key, str):
                secrets.add(key)
                if isinstance(self.key_format, str) and self.key_param is None:
                    secrets.update(_credential_parts(self.key_value(key), cookie=False))
        if isinstance(self.url, str):
            secrets.update(_userinfo(self.url))
        if isinstance(self.state_url, str):  # postgresql://user:password@host/db
            secrets.update(_userinfo(self.state_url))
        for proxy in (self.proxy, *_env_proxies()):  # http://user:password@proxy:3128
            if isinstance(proxy, str):
                secrets.update(_userinfo(proxy))
        if isinstance(self.webhook, str):  # e.g. a Slack webhook URL is itself a credential
            secrets.add(self.webhook)
            secrets.update(_userinfo(self.webhook))
        secrets = {s for s in secrets if len(s) >= MIN_SECRET_LENGTH}
        set_(self, "secrets", frozenset(secrets))
        set_(self, "_needles", _forms_of(secrets))
        names = "|".join([_PARAM_NAMES, *(re.escape(n) for n in self.secret_names),
                          *([re.escape(self.key_param)] if isinstance(self.key_param, str) else [])])
        set_(self, "_param_re", re.compile(rf"([?&;](?:{names})=)[^&#\s'\"<>]+", re.I))
        with self._redacting_errors():
            _validate(self)

    @contextlib.contextmanager
    def _redacting_errors(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as e:
            e.args = tuple(self.redact(a) if isinstance(a, str) else a for a in e.args)
            e.message = self.redact(e.message)  # (what a caller may raise again)
            raise

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return self.redact(f"Config({shown})")

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, need_env: bool = True, need_url: bool = True,
             **overrides: Any) -> Config:
        """Read a TOML file; ``overrides`` (e.g. from CLI flags) win over the file.

        ``need_env=False`` is for reading state (``status``, ``export``, ``--dry-run``): a
        ``${VAR}`` that is not set is no error then (the value is never sent anywhere).
        ``need_url=False``: for ``status`` and ``export``, which read only the state, a file
        without ``[request] url`` is no error (a file that names just the state will do)."""
        import tomllib  # (here, as ssl, hashlib and base64 below: what --help never needs)

        p = Path(path)
        try:
            text = p.read_bytes().decode()  # (as tomllib.load reads it: no newline translation)
            doc = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError("config file not found", path=p) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file: {e.__class__.__name__}", path=p) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML: {e}", path=p) from None
        except RecursionError:
            raise ConfigError("invalid TOML: nested too deeply", path=p) from None
        try:
            return cls.from_dict(doc, path=p, need_env=need_env, need_url=need_url, **overrides)
        except ConfigError as e:  # about a key of the file: its line too
            line = _line_of(text, e.key) if e.path == str(p) and e.line is None else None
            if line is None:
                raise
            raise ConfigError(e.message, key=e.key, path=p, line=line) from None

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, path: Path | None = None, need_env: bool = True,
                  need_url: bool = True, **overrides: Any) -> Config:
        """Build from a parsed TOML document (sections and keys as in ``config.toml``);
        ``need_env`` and ``need_url`` as in :meth:`load`."""
        kwargs: dict[str, Any] = {}
        secrets: set[str] = set()
        base = path.parent if path else Path.cwd()
        for section, body in doc.items():
            if section not in TOML_SECTIONS and not isinstance(body, dict):
                # a key before any [section] header: say which section takes it, if one does
                homes = sorted(k.split(".")[0] for k in TOML_KEYS if k.split(".", 1)[1] == section)
                where = f"; write it under [{homes[0]}]" if homes else ""
                raise ConfigError(f"a key outside any section{where} (sections: "
                                  f"{', '.join(sorted(TOML_SECTIONS))})", key=section, path=path)
            if section not in TOML_SECTIONS:
                raise ConfigError(
                    f"unknown section; expected one of {', '.join(sorted(TOML_SECTIONS))}",
                    key=f"[{section}]", path=path,
                )
            if not isinstance(body, dict):
                raise ConfigError("must be a table", key=f"[{section}]", path=path)
            for key, value in body.items():
                dotted = f"{section}.{key}"
                if dotted in REMOVED_KEYS:
                    log.warning("%s: %s is ignored (removed: %s); delete it",
                                path or "config", dotted, REMOVED_KEYS[dotted])
                    continue
                if dotted not in TOML_KEYS:
                    known = ", ".join(k.split(".", 1)[1] for k in TOML_KEYS if k.startswith(section + "."))
                    raise ConfigError(f"unknown key; [{section}] takes {known}", key=dotted, path=path)
                name = TOML_KEYS[dotted]
                value = expand_env(value, dotted, path, secrets, need_env)
                if name in ("ids", "state_dir", "ca_bundle") and isinstance(value, str) and value != "-":
                    value = str(base / value)
                kwargs[name] = value
        in_file = dict(kwargs)
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        kwargs["secrets"] = frozenset(secrets) | frozenset(kwargs.get("secrets", ()))
        if "url" not in kwargs:
            if need_url:
                raise ConfigError("is required (the URL template with {id})", key="request.url",
                                  path=path)
            kwargs["url"] = UNUSED_URL
        replaced = {k for k, v in overrides.items() if v is not None and k in in_file}
        if replaced:  # a value a flag replaces is checked all the same: the file is wrong
            try:
                cls(**{**kwargs, **{k: in_file[k] for k in replaced}})
            except ConfigError as e:
                if TOML_KEYS.get(e.key or "") in replaced:
                    raise ConfigError(e.message, key=e.key, path=path) from None
        try:
            return cls(**kwargs)
        except ConfigError as e:
            field_name = TOML_KEYS.get(e.key or "")
            given = {k for k, v in overrides.items() if v is not None}
            if field_name is not None and field_name in given:  # the value came from the
                raise ConfigError(e.message, key=flag_for(field_name)) from None  # command line
            if path is not None and e.path is None:
                raise ConfigError(e.message, key=e.key, path=path) from None
            raise

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    # -- derived -------------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``: the value as configured, its
        percent-encoded forms (as it appears in a URL), the credential after an auth scheme
        word (``Bearer``/``Basic``/``Token`` ...), and the value of any secret-named query
        parameter in a URL (``?api_key=...``) even when it is not a known secret."""
        for s in self._needles:
            if s in text:
                text = text.replace(s, "***")
        if self._param_re is not None and "=" in text:
            text = self._param_re.sub(r"\1***", text)
        return text

    def is_secret_header(self, name: str) -> bool:
        """Whether a header of this name carries a credential (auth-like, or in ``secret_names``)."""
        return (bool(_SECRET_HEADER.search(name)) or name.lower() in _lower(self.secret_names)
                or (bool(self.keys) and self.key_param is None
                    and name.lower() == self.key_header.lower()))

    @property
    def state(self) -> str:
        """Where the job's state is: the PostgreSQL URL (``[state] url``), else the state
        directory."""
        return self.state_url or self.state_dir

    @property
    def state_shown(self) -> str:
        """``state`` as messages show it: a URL without its password, with the job's name."""
        if self.state_url is None:
            return self.state_dir
        return f"{self.redact(self.state_url)} (job {self.job!r})"

    def job_identity(self) -> dict[str, Any]:
        """What the state directory remembers of the job it belongs to: the URL template,
        method and query parameters, secrets redacted (never the headers: keys rotate)."""
        ident: dict[str, Any] = {
            "url": self.redact(self.url), "method": self.method,
            "params": {k: "***" if self.is_secret_param(k) else self.redact(str(v))
                       for k, v in sorted(self.params.items())}}
        if self.json is not None:  # (only when set: a GET job's identity stays as it was)
            ident["json"] = self.redact(json.dumps(self.json, sort_keys=True))
        if self.body is not None:
            ident["body"] = self.redact(self.body)
        address = self._address_print()
        if address is not None:
            ident["address"] = address
        return ident

    def _address_print(self) -> str | None:
        """A fingerprint of the URL's host and port where the identity holds them redacted
        (an ``${ENV}`` value, ``http://${API_HOST}/...``): without it, the state of a job
        against staging took production's for its own (``***`` both). Not of parameters,
        whose ``${ENV}`` values may be keys under names not known as secret (``user_key``,
        ``code``): another key is the same job. ``None`` where the host is in clear, or an
        ``${ENV}`` of it is unset (``status``, ``--dry-run``: nothing to compare)."""
        try:
            origin = urlsplit(self.url).netloc.rpartition("@")[2]  # (as written: a secret
        except ValueError:                                        # redacts in its case)
            return None
        if self.redact(origin) == origin or UNSET_ENV in origin:
            return None
        return hashlib.sha256(origin.lower().encode("utf-8", "surrogateescape")).hexdigest()[:16]

    def key_value(self, key: str) -> str:
        """What the ``key_header`` of a request carries for one of ``[request] keys``."""
        return self.key_format.replace("{key}", key)

    def is_secret_param(self, name: str) -> bool:
        """Whether a query parameter of this name carries a credential."""
        return (bool(_SECRET_PARAM.match(name)) or name.lower() in _lower(self.secret_names)
                or (bool(self.keys) and self.key_param is not None
                    and name.lower() == self.key_param.lower()))

    @property
    def request_budget(self) -> int | None:
        """Billable calls allowed this run: ``max_requests`` and ``max_spend`` combined."""
        caps = []
        if self.max_requests is not None:
            caps.append(self.max_requests)
        if self.max_spend is not None and self.price_per_call:
            calls = self.max_spend / self.price_per_call + 1e-9
            if calls < 2**62:  # (more is no cap: a tiny price made it infinite)
                caps.append(math.floor(calls))
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
    "request.connect_timeout": "connect_timeout",
    "request.read_timeout": "read_timeout",
    "request.verify_tls": "verify_tls",
    "request.ca_bundle": "ca_bundle",
    "request.proxy": "proxy",
    "request.json": "json",
    "request.body": "body",
    "request.content_type": "content_type",
    "request.secret_names": "secret_names",
    "request.keys": "keys",
    "request.key_header": "key_header",
    "request.key_format": "key_format",
    "request.key_param": "key_param",
    "response.error_field": "error_field",
    "response.success_values": "success_values",
    "response.format": "response_format",
    "limits.concurrency": "concurrency",
    "limits.rate": "rate",
    "limits.burst": "burst",
    "limits.max_requests": "max_requests",
    "limits.adaptive": "adaptive",
    "limits.breaker": "breaker",
    "limits.breaker_probe_max": "breaker_probe_max",
    "retry.max_tries": "max_tries",
    "retry.paid_retries": "paid_retries",
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
    "passes.recheck_unavailable": "recheck_unavailable",
    "state.dir": "state_dir",
    "state.url": "state_url",
    "state.job": "job",
    "state.lease": "lease",
    "state.reuse": "reuse_state",
    "run.grace": "grace",
    "run.progress_interval": "progress_interval",
    "alerts.on_halt": "on_halt",
    "alerts.webhook": "webhook",
    "billing.price_per_call": "price_per_call",
    "billing.currency": "currency",
    "billing.max_spend": "max_spend",
}
TOML_SECTIONS = frozenset(k.split(".")[0] for k in TOML_KEYS)
# Keys of earlier versions that no longer do anything: accepted with a warning, so that an
# upgrade does not stop a job whose config still has them.
REMOVED_KEYS: dict[str, str] = {
    "limits.retry_budget": "retries now share the job's rate limit like first tries",
    "limits.retry_budget_floor": "retries now share the job's rate limit like first tries",
}
FIELD_KEYS = {v: k for k, v in TOML_KEYS.items()}


def _keywords_checked(init: Any) -> Any:
    """``Config.__init__`` that raises a ``ConfigError`` naming the keyword (and the field it
    may have meant) for a misspelt, positional or missing argument, where the dataclass's own
    ``__init__`` raises a bare ``TypeError`` that no ``except AsyncrawlError`` catches."""
    import functools

    names = tuple(f.name for f in fields(Config) if f.init)

    @functools.wraps(init)
    def checked(self: Config, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(f"Config takes keyword arguments only (Config(url=..., rate=...)), "
                              f"got {len(args)} positional")
        for name in kwargs:
            if name not in names:
                import difflib

                near = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"unknown Config field{hint}", key=name)
        if "url" not in kwargs:
            raise ConfigError("is required (the URL template with {id})", key=FIELD_KEYS["url"])
        init(self, **kwargs)

    return checked


Config.__init__ = _keywords_checked(Config.__init__)  # type: ignore[method-assign]


_FLAGS = {"state_dir": "--state", "state_url": "--state", "verify_tls": "--insecure",
          "second_pass": "--no-second-pass", "headers": "-H", "body": "--data"}


def flag_for(name: str) -> str:
    """The command-line flag that sets the Config field ``name``."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _lower(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(n.lower() for n in names if isinstance(n, str))


def _credential_parts(value: str, *, cookie: bool = False) -> set[str]:
    """A credential header's value and the secret parts inside it: the token after a scheme word
    (``Bearer tok`` -> ``tok``), Basic auth's decoded ``user:password`` and password, and each
    cookie's value."""
    parts = {value}
    m = _SCHEME_VALUE.match(value)
    if m:
        token = m.group(2).strip()
        parts.add(token)
        if m.group(1).lower() == "basic":
            import base64

            try:
                decoded = base64.b64decode(token, validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                decoded = ""
            if decoded:
                parts.add(decoded)
                parts.add(decoded.partition(":")[2])
    if cookie:  # session cookies are long; short values (theme=dark) would redact ordinary words
        for pair in value.split(";"):
            v = pair.partition("=")[2].strip()
            if len(v) >= 8:
                parts.add(v)
    return parts


def _env_proxies() -> list[str]:
    """The proxies the environment names (aiohttp's ``trust_env`` uses them)."""
    names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
    return [v for n in names if (v := os.environ.get(n))]


def _userinfo(url: str) -> set[str]:
    """The password (and whole ``user:password``) of a URL with userinfo."""
    try:
        parts = urlsplit(url)
    except ValueError:  # (malformed: ``http://u:pw@[::1``, quoted back in its error)
        userinfo = url.partition("://")[2].rpartition("@")[0]
        if ":" not in userinfo or any(c in userinfo for c in "/?#[]"):  # (no userinfo: an
            return set()                                                 # "@" past the host)
        return {userinfo, userinfo.partition(":")[2]}
    if parts.password:
        return {parts.password, parts.netloc.rpartition("@")[0]}
    return set()


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (not so: bytes that were none, in an argument or an
    environment variable, read back as surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _forms_of(secrets: Iterable[str]) -> tuple[str, ...]:
    """Every form in which a secret may show up in text, longest first (so that a secret that
    contains another is replaced whole): as is, percent-encoded as in a URL path or query, and
    escaped as Python and JSON quote it (a parser's error that quotes the bytes of a header
    echoed back: ``\\xc3\\xa9`` for an ``é``, ``\\\\`` for a ``\\``)."""
    forms: set[str] = set()
    for s in secrets:
        if len(s) < MIN_SECRET_LENGTH:
            continue
        b = s.encode("utf-8", "surrogateescape")  # (bytes that are no UTF-8: refused later)
        forms.update((s, quote(b, safe=""), quote(b), quote_plus(b), quote(b, safe="/:@!$'()*+,;="),
                      repr(b)[2:-1], repr(s)[1:-1], json.dumps(s)[1:-1],
                      json.dumps(s, ensure_ascii=False)[1:-1]))
    return tuple(sorted(forms, key=len, reverse=True))


UNSET_ENV = "unset-env-"  # what an unset ${VAR} reads as when the secrets are not needed


def expand_env(value: Any, key: str, path: Path | None, secrets: set[str], need_env: bool) -> Any:
    """Replace ``${VAR}`` in strings (recursively); remember the values as secrets. An unset
    variable is an error, unless ``need_env`` is false (reading state sends nothing): then it
    reads as ``unset-env-VAR``."""
    if isinstance(value, str):
        wrong = _SHELL_FORM.search(value) if key != "alerts.on_halt" else None  # (the
        if wrong:  # shell reads its own ${VAR:-x}; sent as it is, a header carried it as a key)
            shown = ("${}" if wrong[1] is None else  # (never what follows: a default key)
                     f"${{{wrong[1]}" + (f"{wrong[2]}...}}" if wrong[2] else " (not closed)"))
            raise ConfigError(f"{shown} is no ${{NAME}} reference: only ${{NAME}} is read from "
                              "the environment (no default, no other form)", key=key, path=path)

        def sub(m: re.Match[str]) -> str:
            var = m.group(1)
            if var not in os.environ:
                if not need_env:  # (a secret as the value would be: the job's identity,
                    secrets.add(UNSET_ENV + var)  # redacted, is the same without it)
                    return UNSET_ENV + var
                raise ConfigError(f"environment variable ${{{var}}} is not set (export it first)",
                                  key=key, path=path)
            got = os.environ[var]
            if not _utf8(got):
                raise ConfigError(f"environment variable ${{{var}}} is not valid UTF-8",
                                  key=key, path=path)
            secrets.add(got)
            return got
        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: expand_env(v, f"{key}.{k}", path, secrets, need_env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, key, path, secrets, need_env) for v in value]
    return value


_IN_RANGE = "between -10^15 and 10^15"  # (MAX_NUMBER in words)


def _is_num(v: Any) -> bool:
    """A number a setting can hold: finite, and no more than 10^15 either way (a 400-digit
    TOML integer is no float: its checks raised ``OverflowError``)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and -MAX_NUMBER <= v <= MAX_NUMBER


def _is_status(v: Any) -> bool:
    """An HTTP status code (100-599), written as a TOML integer or a whole float."""
    return _is_num(v) and v == int(v) and 100 <= v <= 599


def _check_shapes(c: Config) -> None:
    """The fields ``__post_init__`` converts, checked before it does: a wrong type is a
    ``ConfigError`` naming the key, not a ``TypeError`` from ``dict()`` or ``frozenset()``."""
    bad = _bad

    for name in ("headers", "params"):
        v = getattr(c, name)
        if v is not None and not (isinstance(v, Mapping) and all(isinstance(k, str) for k in v)):
            raise bad(name, f"must be a table of name = value, got {type(v).__name__}")
    for name in ("retryable", "skip", "fatal", "success_values", "secret_names", "keys"):
        v = getattr(c, name)
        if not isinstance(v, list | tuple | set | frozenset):
            raise bad(name, f"must be a list, got {type(v).__name__}")
    if not all(isinstance(n, str) and n for n in c.secret_names):
        raise bad("secret_names", "must be a list of header or query parameter names")
    for name in ("retryable", "skip", "fatal"):
        for code in getattr(c, name):
            if not _is_status(code):
                raise bad(name, f"must be a list of HTTP status codes (100-599), got {code!r}")
    for name in ("method", "key_header", "key_format"):  # (used as text just after)
        if not isinstance(getattr(c, name), str):
            raise bad(name, f"must be a string, got {type(getattr(c, name)).__name__}")
    if c.json is not None:
        try:
            odd = _not_json(c.json)
        except RecursionError:
            raise bad("json", "is nested too deeply (or holds itself)") from None
        if odd is not None:
            raise bad("json", f"holds a {odd}, which JSON has not: write it as a string")


def _not_json(value: Any) -> str | None:
    """The name of a type in a JSON body template that JSON has not (a TOML date), if any."""
    if isinstance(value, Mapping):
        return next((t for v in value.values() if (t := _not_json(v))), None)
    if isinstance(value, list | tuple):
        return next((t for v in value if (t := _not_json(v))), None)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # (sent as null)
    if value is None or isinstance(value, str | bool | int | float):
        return None
    return type(value).__name__


def _bad(name: str, msg: str) -> ConfigError:
    """A ConfigError naming the TOML key of the field ``name``."""
    return ConfigError(msg, key=FIELD_KEYS.get(name, name))


def _validate(c: Config) -> None:
    _check_types(c)
    _check_values(c)


def _check_types(c: Config) -> None:
    bad = _bad
    types: dict[str, Any] = {f.name: f.type for f in fields(c)}
    for name in types:
        v = getattr(c, name)
        if name in ("timeout", "rate", "backoff_base", "backoff_max", "cooldown", "grace", "lease",
                    "retry_after_max", "progress_interval", "price_per_call", "max_spend",
                    "breaker_probe_max", "connect_timeout",
                    "read_timeout"):
            if v is None and name in ("price_per_call", "max_spend", "connect_timeout", "read_timeout"):
                continue
            if not _is_num(v):
                what = _IN_RANGE if isinstance(v, int | float) and not isinstance(v, bool) \
                    and v == v else "a number"
                raise bad(name, f"must be {what}, got {type(v).__name__} {c.redact(str(v))[:40]}")
        elif name in ("concurrency", "burst", "max_tries", "max_body_bytes", "max_redirects",
                      "max_requests", "paid_retries"):
            if v is None and name == "max_requests":
                continue
            if isinstance(v, float) and v.is_integer():
                object.__setattr__(c, name, int(v))
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(name, f"must be a whole number, got {type(v).__name__} {v!r}")
            if abs(v) > MAX_NUMBER:
                raise bad(name, f"must be {_IN_RANGE}, got {c.redact(str(v))[:40]}")
        elif name in ("second_pass", "recheck_permanent", "recheck_unavailable", "verify_tls",
                      "adaptive", "breaker", "reuse_state"):
            if not isinstance(v, bool):
                raise bad(name, f"must be true or false, got {v!r}")
        elif name in ("url", "method", "state_dir", "jitter", "currency", "follow_redirects",
                      "response_format", "job", "key_header", "key_format"):
            if not isinstance(v, str):
                raise bad(name, f"must be a string, got {type(v).__name__}")
        elif name in ("ids", "ca_bundle", "on_halt", "webhook", "error_field", "state_url",
                      "proxy", "body", "content_type", "key_param"):
            if v is not None and not isinstance(v, str):
                raise bad(name, f"must be a string, got {type(v).__name__}")
        elif name in ("headers", "params"):
            for k, hv in v.items():
                if not isinstance(hv, str | int | float) or isinstance(hv, bool):
                    raise bad(name, f"value of {k!r} must be a string")
                if any(ch in str(hv) for ch in "\r\n\0"):
                    raise bad(name, f"value of {k!r} contains a line break or NUL")
                if not _utf8(str(hv)) or not _utf8(k):
                    raise bad(name, f"{k!r:.40} or its value is not valid UTF-8")
        elif name == "keys":
            for key in v:
                if not isinstance(key, str) or not key:
                    raise bad(name, "must be a list of non-empty strings (the API keys, each "
                                    "best as \"${ENV_VAR}\")")
                if any(ch in key for ch in "\r\n\0"):
                    raise bad(name, "a key contains a line break or NUL")
                if not _utf8(key):
                    raise bad(name, "a key is not valid UTF-8")
        elif name in ("retryable", "skip", "fatal"):
            for code in v:
                if not _is_status(code):
                    raise bad(name, f"must be a list of HTTP status codes (100-599), got {code!r}")



def _check_values(c: Config) -> None:
    bad = _bad
    positive = ("timeout", "rate", "concurrency", "burst", "lease", "max_tries", "max_body_bytes",
                "progress_interval", "retry_after_max", "breaker_probe_max")
    for name in positive:
        if getattr(c, name) <= 0:
            raise bad(name, f"must be greater than 0, got {getattr(c, name)!r}")
    for name in ("ids", "state_dir", "state_url", "job", "ca_bundle"):  # (no path or name has
        if "\x00" in (getattr(c, name) or ""):  # one: ValueError from the system's calls)
            raise bad(name, "contains a NUL character")
    if c.concurrency > MAX_CONCURRENCY:  # (a task each: 10^8 of them never started)
        raise bad("concurrency", f"must be at most {MAX_CONCURRENCY:,}, got {c.concurrency!r}")
    if c.lease < MIN_LEASE:
        raise bad("lease", f"must be at least {MIN_LEASE:g} s (several heartbeats: a live "
                  f"process must keep its IDs), got {c.lease!r}")
    for name in ("backoff_base", "backoff_max", "cooldown", "grace", "max_redirects",
                 "paid_retries"):
        if getattr(c, name) < 0:
            raise bad(name, f"must not be negative, got {getattr(c, name)!r}")
    for name in ("max_requests",):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise bad(name, "must be greater than 0 (leave it out for no limit)")
    for name in ("price_per_call", "max_spend"):
        if getattr(c, name) is not None and getattr(c, name) < 0:
            raise bad(name, "must not be negative")
    for name in ("connect_timeout", "read_timeout"):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise bad(name, "must be greater than 0 (leave it out to use [request] timeout)")
    if c.ca_bundle is not None:
        _check_ca_bundle(c.ca_bundle)
    if c.max_spend is not None and not c.price_per_call:
        raise bad("max_spend", "needs [billing] price_per_call to be set" if c.price_per_call
                  is None else "needs a [billing] price_per_call above 0 (calls that cost "
                  "nothing cannot spend a budget; use [limits] max_requests to cap them)")
    if c.response_format not in ("json", "text", "bytes"):
        raise bad("response_format", f"must be one of json, text, bytes; got {c.response_format!r}")
    if c.state_url is not None and not c.state_url.startswith(PG_SCHEMES):
        raise bad("state_url", f"must be a postgresql:// URL, got {c.redact(c.state_url)!r}")
    if not c.job.strip() or len(c.job) > 200:
        raise bad("job", f"must be a name of 1 to 200 characters, got {c.job!r}")
    if c.jitter not in ("full", "equal", "none"):
        raise bad("jitter", f"must be one of full, equal, none; got {c.jitter!r}")
    if c.follow_redirects not in ("none", "same-origin", "any"):
        raise bad("follow_redirects", "must be one of none, same-origin, any")
    if c.method not in ("GET", "POST", "HEAD", "PUT", "PATCH"):
        raise bad("method", f"must be GET, POST, HEAD, PUT or PATCH; got {c.method!r}")
    if c.proxy is not None and not _is_http_url(c.proxy):
        raise bad("proxy", f"must be an http:// or https:// URL with a host (and a port "
                           f"1-65535), got {c.redact(c.proxy)!r}")
    if c.webhook is not None and not _is_http_url(c.webhook):  # (found now, not at a halt)
        raise bad("webhook", "must be an http:// or https:// URL with a host (not shown: "
                  "a webhook's URL is a secret)")
    if c.json is not None and c.body is not None:
        raise bad("body", "give [request] json or [request] body, not both")
    if c.json is not None and not isinstance(c.json, Mapping | list | tuple):
        raise bad("json", f"must be a table or an array, got {type(c.json).__name__}")
    if (c.json is not None or c.body is not None) and c.method in ("GET", "HEAD"):
        raise bad("method", f"a request body needs POST, PUT or PATCH, not {c.method} "
                            "(set [request] method, or -X)")
    if c.content_type is not None and c.body is None:
        raise bad("content_type", "is the type of [request] body, which is not set")
    framing = [k for k in c.headers if k.strip().lower() in ("content-length", "transfer-encoding")]
    if framing:
        raise bad("headers", f"{framing[0]!r} is the HTTP client's to set (it frames the "
                             "request body): remove it from [request.headers]")
    seen: dict[str, str] = {}  # lower-case name -> the name as written
    for k in c.headers:
        if not _TOKEN(k):
            raise bad("headers", f"{k!r} is not a header name (letters, digits and "
                                 "!#$%&'*+-.^_`|~ only)")
        if k.lower() in seen:
            raise bad("headers", f"{seen[k.lower()]!r} and {k!r} are one header (a "
                                 "header's name has no case): keep one")
        seen[k.lower()] = k
        if "{id}" in k or "{id}" in str(c.headers[k]):  # (every request got the same "{id}")
            raise bad("headers", f"{k!r}: {{id}} is not filled in a header; headers are the "
                                 "same for every request (the ID goes in the URL, a query "
                                 "parameter's value or the body)")
    if c.content_type is not None and "content-type" in seen and _media(c.content_type) != \
            _media(str(c.headers[seen["content-type"]])):
        raise bad("content_type", f"and the header {seen['content-type']!r} give the body two "
                                  "types: give it once")
    for k in c.params:
        if "{id}" in str(k):
            raise bad("params", f"{k!r}: {{id}} is filled in a parameter's value, not its name")
    _check_keys(c)
    authorized = "authorization" in seen or (
        bool(c.keys) and c.key_param is None and c.key_header.lower() == "authorization")
    try:
        credentials = urlsplit(c.url.replace("{id}", "ID")).username is not None
    except ValueError:  # (validate_url_template says what is wrong with it)
        credentials = False
    if authorized and credentials:
        raise bad("url", "has a user and password (user:password@host), and the requests an "
                         "Authorization header too: give the credentials one way")
    overlap = (c.retryable & c.skip) | (c.retryable & c.fatal) | (c.skip & c.fatal)
    if overlap:
        raise _overlap(c, min(overlap))
    in_body = (c.body is not None and "{id}" in c.body) or _has_id(c.json)
    validate_url_template(c.url, c.params, in_body=in_body)


def _overlap(c: Config, code: int) -> ConfigError:
    """The error of a status in two classes, naming the list that was set (not one left at
    its default, which the user may not know holds it)."""
    defaults = {"retryable": DEFAULT_RETRYABLE, "skip": DEFAULT_SKIP, "fatal": DEFAULT_FATAL}
    lists = [n for n in defaults if code in getattr(c, n)]
    name = next((n for n in lists if getattr(c, n) != defaults[n]), lists[0])
    other = next(n for n in lists if n != name)
    key = FIELD_KEYS.get(other, other)
    where = (f"{key} too, by default ({', '.join(map(str, sorted(defaults[other])))}): set "
             f"{key} without it" if getattr(c, other) == defaults[other] else f"{key} too")
    return _bad(name, f"status {code} is in {where}; a status belongs to one class")


_DEFAULT_KEY_HEADER, _DEFAULT_KEY_FORMAT = (
    Config.__dataclass_fields__[name].default for name in ("key_header", "key_format"))


def _check_keys(c: Config) -> None:
    if not c.keys:
        return
    if len(set(c.keys)) != len(c.keys):
        raise _bad("keys", "lists the same key twice")
    if c.key_param is not None:
        if not c.key_param.strip():
            raise _bad("key_param", "must be a query parameter name")
        if any(k.lower() == c.key_param.lower() for k in c.params):
            raise _bad("key_param", f"{c.key_param!r} is in [request.params] too: a key goes "
                                    "in one place")
        if (c.key_header, c.key_format) != (_DEFAULT_KEY_HEADER, _DEFAULT_KEY_FORMAT):
            raise _bad("key_param", "is set, and key_header or key_format too: a key goes in "
                                    "one place (a query parameter, or a header)")
        return
    if "{key}" not in c.key_format:
        raise _bad("key_format", f"must contain {{key}}, got {c.key_format!r}")
    if not _TOKEN(c.key_header):
        raise _bad("key_header", f"must be a header name, got {c.key_header!r}")
    if any(k.lower() == c.key_header.lower() for k in c.headers):
        raise _bad("key_header", f"{c.key_header!r} is in [request.headers] too: with [request] "
                                 "keys, each request carries one of the keys there")


def _media(content_type: str) -> str:
    """A content type's media type, as compared (``Application/JSON; charset=x``: ``application/json``)."""
    return content_type.split(";")[0].strip().lower()


def key_fingerprint(key: str) -> str:
    """What the ledger and the logs call an API key: the first 8 hex digits of its SHA-256
    (``printf %s "$KEY" | sha256sum | cut -c1-8``), never the key."""
    import hashlib

    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


def _has_id(value: Any) -> bool:
    """Whether a JSON body template has ``{id}`` in a string value."""
    if isinstance(value, str):
        return "{id}" in value
    if isinstance(value, Mapping):
        return any(_has_id(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_id(v) for v in value)
    return False


def validate_url_template(url: str, params: Mapping[str, str], *, in_body: bool = False) -> None:
    """The template must be http(s), name a host (and a valid port), use ``{id}`` in the path,
    the query or a parameter (never the host, userinfo or a fragment), and hold no whitespace,
    control character or broken ``%`` escape (each would make an invalid request line)."""
    key = "request.url"
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ConfigError("contains whitespace or a control character; percent-encode it "
                          "(a space is %20)", key=key)
    probe = url.replace("{id}", "ID")
    try:
        parts = urlsplit(probe)
        port = parts.port  # (raises ValueError for a port that is not a number 0-65535)
    except ValueError as e:
        raise ConfigError(f"invalid URL: {e}", key=key) from None
    if port == 0:
        raise ConfigError("port 0 is no port a server listens on (1-65535)", key=key)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"must start with http:// or https://, got {url!r}", key=key)
    if not parts.hostname:
        raise ConfigError("has no host", key=key)
    if not parts.netloc.isascii():
        raise ConfigError("the host must be ASCII; write an international domain name in its "
                          "xn-- (punycode) form", key=key)
    if "{id}" in urlsplit(url).netloc:
        raise ConfigError("{id} may not be part of the host", key=key)
    if "#" in url:
        raise ConfigError("may not contain a #fragment", key=key)
    if "{" in url.replace("{id}", "") or "}" in url.replace("{id}", ""):
        raise ConfigError("the only placeholder allowed is {id}", key=key)
    if _BAD_ESCAPE.search(url):
        raise ConfigError("has a % that is not followed by two hex digits; write a literal % "
                          "as %25", key=key)
    if "{id}" not in url and not any("{id}" in str(v) for v in params.values()) and not in_body:
        raise ConfigError(
            "must contain {id} (e.g. https://api.example.com/items/{id}), "
            "or a [request.params] value, or the body ([request] json or body) must", key=key)


_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+").fullmatch  # RFC 9110 §5.6.2


def _check_ca_bundle(path: str) -> None:
    """The CA bundle must load (a PEM file, or a directory of hashed certificates)."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if os.path.isdir(path):
            ctx.load_verify_locations(capath=path)
        else:
            ctx.load_verify_locations(cafile=path)
    except FileNotFoundError:
        raise ConfigError(f"CA bundle {path} not found", key="request.ca_bundle") from None
    except (OSError, ssl.SSLError, ValueError) as e:
        raise ConfigError(f"cannot load CA bundle {path} ({e.__class__.__name__}); it must be "
                          "PEM certificates (-----BEGIN CERTIFICATE-----)",
                          key="request.ca_bundle") from None


def endpoint_of(url: str) -> str:
    """The endpoint of a URL template as a provider's billing page names it: host (and port) and
    path, ID placeholder kept, no scheme, credentials or query: ``api.example.com/v1/notes/{id}``."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{host}{f':{port}' if port else ''}{parts.path or '/'}"


def check_job(cfg: Config, job: dict[str, Any] | None) -> None:
    """Refuse a state made by another job: its settled IDs would be skipped, and the new job
    would fetch nothing and say it had finished."""
    now = cfg.job_identity()
    if job is None or cfg.reuse_state:
        return
    job = _as_redacted_now(cfg, job)
    if "address" not in job or "address" not in now:  # (a state of an earlier release, or an
        job.pop("address", None)                         # ${ENV} of the host unset: nothing to
        now.pop("address", None)                         # tell apart)
    if job == now:
        return
    keys = [k for k in ("method", "url", "params", "json", "body") if job.get(k) != now.get(k)]
    differ = [f"{k} {job.get(k)!r}" for k in keys]
    if job.get("address") != now.get("address"):
        differ.append("the ${ENV} values in its URL's host")
    raise JobMismatch(
        f"the state {cfg.state_shown} belongs to another job ("
        + ", ".join(differ) + (("; this run has " + ", ".join(f"{k} {now[k]!r}" for k in keys))
                               if keys else ": this run's differ")
        + "). Start the new job with its own state (--state DIR; Config(state_dir=...)), or, "
        "to fetch from the new address what the old job had not settled and keep what it had, "
        "pass --reuse-state ([state] reuse = true; Config(reuse_state=True))")


def _as_redacted_now(cfg: Config, job: dict[str, Any]) -> dict[str, Any]:
    """A stored job identity with what ``cfg`` holds secret now redacted as it would be (a
    state written when fewer parameter names counted as secret kept such values in clear)."""
    params = job.get("params")
    fixed = {**job}
    if isinstance(job.get("url"), str):
        fixed["url"] = cfg.redact(job["url"])
    if isinstance(params, dict):
        fixed["params"] = {k: "***" if cfg.is_secret_param(k) else v for k, v in params.items()}
    return fixed


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (
            parts.port is None or parts.port > 0)
    except ValueError:  # (a port that is not a number, a bad IPv6 literal)
        return False


_TABLE = re.compile(r"\s*\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?$")


def _line_of(text: str, key: str | None) -> int | None:
    """The line of a config file's ``text`` where ``key`` (``section.name``, or ``[section]``)
    is written, if it is written plainly there (``name = ...`` under ``[section]``), else
    ``None``."""
    if not key:
        return None
    if key.startswith("["):
        table, name = key.strip("[]"), None
    elif "." in key:
        table, name = key.split(".", 1)
        if "." in name:  # a key of a table of its own: [request.headers] X-Api-Key = ...
            line = _find_line(text, *key.rsplit(".", 1))
            if line is not None:
                return line
    else:
        table, name = "", key  # a key outside any section
    return _find_line(text, table, name)


def _find_line(text: str, table: str, name: str | None) -> int | None:
    """``_line_of``'s search: ``name = ...`` under ``[table]`` (or ``[table]`` itself)."""
    current = ""
    for number, line in enumerate(text.splitlines(), 1):
        header = _TABLE.match(line)
        if header:
            current = header.group(1).replace('"', "").replace(" ", "")
            if current == (table if name is None else f"{table}.{name}"):
                return number  # ([section], or a key that is a table: [request.headers])
            continue
        if name is not None and current == table and re.match(
                rf'\s*"?{re.escape(name)}"?\s*=', line):
            return number
    return None
