"""config.py: the example config loads, ${VAR} expansion and secrets, and every invalid value is a
ConfigError that names its key (never a TypeError or ValueError from deep inside)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrawl import Config, ConfigError
from asyncrawl.config import DEFAULT_FATAL, DEFAULT_RETRYABLE, DEFAULT_SKIP, TOML_KEYS

from .conftest import ROOT

URL = "https://api.example.com/v1/notes/{id}"
SECRET = "s3cr3t-value-9f8e7d"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text, encoding="utf-8")
    return p


def load(tmp_path: Path, body: str) -> Config:
    return Config.load(write(tmp_path, f'[request]\nurl = "{URL}"\n{body}'))


# -- the example ---------------------------------------------------------------------------------


def test_repo_config_toml_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEY", SECRET)
    cfg = Config.load(ROOT / "config.toml")
    assert cfg.url == URL
    assert cfg.ids == str(ROOT / "ids.txt")  # relative to the config file
    assert cfg.state_dir == str(ROOT / "state")
    assert cfg.method == "GET"
    assert cfg.timeout == 30
    assert cfg.max_body_bytes == 8388608
    assert cfg.follow_redirects == "same-origin"
    assert cfg.max_redirects == 5
    assert cfg.verify_tls is True
    assert dict(cfg.headers) == {"X-Api-Key": SECRET, "Accept": "application/json"}
    assert dict(cfg.params) == {}
    assert (cfg.concurrency, cfg.rate, cfg.burst) == (16, 10, 10)
    assert cfg.max_requests is None
    assert (cfg.max_tries, cfg.backoff_base, cfg.backoff_max) == (5, 1, 60)
    assert cfg.jitter == "full"
    assert cfg.retry_after_max == 600
    assert cfg.retryable == DEFAULT_RETRYABLE
    assert cfg.skip == DEFAULT_SKIP
    assert cfg.fatal == DEFAULT_FATAL
    assert (cfg.second_pass, cfg.cooldown, cfg.recheck_permanent) == (True, 60, True)
    assert (cfg.grace, cfg.progress_interval) == (10, 10)
    assert cfg.currency == "USD"
    assert cfg.price_per_call is None and cfg.max_spend is None
    assert cfg.on_halt is None and cfg.webhook is None
    assert SECRET in cfg.secrets
    assert SECRET not in repr(cfg)


def test_repo_config_toml_without_api_key_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("API_KEY", raising=False)
    with pytest.raises(ConfigError) as e:
        Config.load(ROOT / "config.toml")
    assert "request.headers.X-Api-Key" in str(e.value)
    assert "API_KEY" in str(e.value)
    assert str(ROOT / "config.toml") in str(e.value)


# -- ${VAR} and secrets --------------------------------------------------------------------------


def test_env_expansion_becomes_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRAWL_T_TRACE", SECRET)
    cfg = load(tmp_path, '[request.headers]\nX-Trace = "pre-${ASYNCRAWL_T_TRACE}-post"\n'
                         'Accept = "application/json"\n')
    assert cfg.headers["X-Trace"] == f"pre-{SECRET}-post"
    assert SECRET in cfg.secrets
    assert cfg.redact(f"sent X-Trace: pre-{SECRET}-post") == "sent X-Trace: pre-***-post"
    assert SECRET not in repr(cfg)
    assert "application/json" in repr(cfg)  # non-secret values still shown


def test_env_expansion_in_url_and_nested_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRAWL_T_HOST", "api.internal.example")
    monkeypatch.setenv("ASYNCRAWL_T_FIELDS", "title,body")
    p = write(tmp_path, '[request]\nurl = "https://${ASYNCRAWL_T_HOST}/n/{id}"\n'
                        '[request.params]\nfields = "${ASYNCRAWL_T_FIELDS}"\n')
    cfg = Config.load(p)
    assert cfg.url == "https://api.internal.example/n/{id}"
    assert cfg.params["fields"] == "title,body"
    assert cfg.redact("title,body") == "***"


def test_unset_env_var_names_key_and_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCRAWL_T_UNSET", raising=False)
    p = write(tmp_path,
              f'[request]\nurl = "{URL}"\n[request.headers]\nX-Api-Key = "${{ASYNCRAWL_T_UNSET}}"\n')
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert e.value.key == "request.headers.X-Api-Key"
    assert "ASYNCRAWL_T_UNSET" in str(e.value)
    assert str(p) in str(e.value)


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({"Authorization": "Bearer tok-123456"}, {}),
        ({"authorization": "Bearer tok-123456"}, {}),
        ({"X-Api-Key": "tok-123456"}, {}),
        ({"Api-Key": "tok-123456"}, {}),
        ({"Cookie": "session=tok-123456"}, {}),
        ({}, {"key": "tok-123456"}),
        ({}, {"token": "tok-123456"}),
        ({}, {"api_key": "tok-123456"}),
        ({}, {"access_token": "tok-123456"}),
    ],
)
def test_auth_like_headers_and_params_are_secret(headers: dict[str, str], params: dict[str, str]) -> None:
    cfg = Config(url=URL, headers=headers, params=params)
    (value,) = {**headers, **params}.values()
    assert value in cfg.secrets
    assert "tok-123456" not in cfg.redact(f"GET {URL}?x={value} headers={headers}")
    assert "tok-123456" not in repr(cfg)


def test_numeric_auth_values_are_secret(tmp_path: Path) -> None:
    cfg = load(tmp_path, "[request.headers]\nX-Api-Key = 123456789\n[request.params]\ntoken = 987654\n")
    assert {"123456789", "987654"} <= cfg.secrets
    assert "123456789" not in repr(cfg) and "987654" not in repr(cfg)


def test_ordinary_headers_and_params_are_not_secret() -> None:
    cfg = Config(url=URL, headers={"Accept": "application/json"}, params={"fields": "title"})
    assert cfg.secrets == frozenset()
    assert cfg.redact("application/json title") == "application/json title"


# -- numbers -------------------------------------------------------------------------------------


def test_toml_int_accepted_for_float(tmp_path: Path) -> None:
    cfg = load(tmp_path, "[limits]\nrate = 5\n[retry]\nbackoff_max = 30\n")
    assert cfg.rate == 5.0
    assert cfg.backoff_max == 30.0
    assert cfg.burst == 5  # derived from rate


def test_whole_float_accepted_for_int(tmp_path: Path) -> None:
    cfg = load(tmp_path, "[limits]\nconcurrency = 8.0\nburst = 3.0\n[retry]\nmax_tries = 2.0\n")
    assert cfg.concurrency == 8 and type(cfg.concurrency) is int
    assert cfg.burst == 3 and type(cfg.burst) is int
    assert cfg.max_tries == 2 and type(cfg.max_tries) is int
    cfg = load(tmp_path, "[retry]\nskip = [400.0, 404, 410]\n")  # a status is a number too
    assert cfg.skip == {400, 404, 410} and all(type(c) is int for c in cfg.skip)


@pytest.mark.parametrize(("body", "key", "told"), [
    # one list set, clashing with another's default: the one set is named, and the default
    ("[retry]\nfatal = [401, 402, 407, 410]\n", "retry.fatal",
     "status 410 is in retry.skip too, by default (400, 404, 410): set retry.skip without it"),
    ("[retry]\nretryable = [429, 503, 404]\n", "retry.retryable", "retry.skip too, by default"),
    ("[retry]\nskip = [400, 404, 503]\n", "retry.skip", "retry.retryable too, by default"),
    # both set
    ("[retry]\nskip = [404]\nfatal = [401, 404]\n", "retry.", "status 404 is in retry."),
])
def test_a_status_in_two_classes_names_the_list_that_was_set(
        tmp_path: Path, body: str, key: str, told: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, body)
    assert e.value.key.startswith(key) and told in str(e.value), str(e.value)


# -- errors name the key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("[limits]\nrate = \"fast\"\n", "limits.rate"),
        ("[limits]\nrate = -1\n", "limits.rate"),
        ("[limits]\nrate = 0\n", "limits.rate"),
        ("[limits]\nrate = nan\n", "limits.rate"),
        ("[limits]\nrate = inf\n", "limits.rate"),
        ("[limits]\nrate = true\n", "limits.rate"),
        ("[limits]\nconcurrency = 0\n", "limits.concurrency"),
        ("[limits]\nconcurrency = 2.5\n", "limits.concurrency"),
        ("[limits]\nconcurrency = \"8\"\n", "limits.concurrency"),
        ("[limits]\nmax_requests = 0\n", "limits.max_requests"),
        ("[request.timeout]\nx = 1\n", "request.timeout"),
        ("[retry]\njitter = \"some\"\n", "retry.jitter"),
        ("[retry]\nretryable = [429, 99]\n", "retry.retryable"),
        ("[retry]\nretryable = 429\n", "retry.retryable"),
        ("[retry]\nretryable = [[429]]\n", "retry.retryable"),
        ("[retry]\nskip = \"404\"\n", "retry.skip"),
        ("[retry]\nfatal = [true]\n", "retry.fatal"),
        ("[retry]\nbackoff_base = -1\n", "retry.backoff_base"),
        ("[response]\nsuccess_values = 0\n", "response.success_values"),
        ("[passes]\nsecond_pass = \"yes\"\n", "passes.second_pass"),
        ("[billing]\nmax_spend = 50\n", "billing.max_spend"),
        ("[billing]\nprice_per_call = 0\nmax_spend = 50\n", "billing.max_spend"),
        ("[billing]\nprice_per_call = -0.1\n", "billing.price_per_call"),
        ("[state]\nlease = 0.5\n", "state.lease"),  # shorter than a few heartbeats
        ("[request.headers]\nX-A = \"a\\nb\"\n", "request.headers"),
        ("[request.headers]\nX-A = [\"a\"]\n", "request.headers"),
        ("[request.params]\ntoken = [\"a\"]\n", "request.params"),
    ],
)
def test_invalid_value_names_key(tmp_path: Path, body: str, key: str) -> None:
    p = write(tmp_path, f'[request]\nurl = "{URL}"\n{body}')
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert key in str(e.value)
    assert str(p) in str(e.value)


def test_a_wrong_value_in_the_file_is_an_error_even_where_a_flag_replaces_it(
        tmp_path: Path) -> None:
    p = write(tmp_path, f'[request]\nurl = "{URL}"\n[state]\ndir = 5\n')
    with pytest.raises(ConfigError) as e:
        Config.load(p, state_dir=str(tmp_path / "s"))
    assert "state.dir" in str(e.value) and str(p) in str(e.value)
    with pytest.raises(ConfigError, match=r"limits\.rate"):
        Config.load(write(tmp_path, f'[request]\nurl = "{URL}"\n[limits]\nrate = "fast"\n'),
                    rate=5.0)
    assert Config.load(write(tmp_path, f'[request]\nurl = "{URL}"\n[limits]\nrate = 3\n'),
                       rate=5.0).rate == 5.0  # a good value is replaced as before


@pytest.mark.parametrize(
    "text",
    [
        f'[request]\nurl = "{URL}"\nmethod = 5\n',
        f'[request]\nurl = "{URL}"\nmethod = "DELETE"\n',
        f'[request]\nurl = "{URL}"\nheaders = "X-Api-Key: k"\n',
        f'[request]\nurl = "{URL}"\nparams = ["a", "b"]\n',
        f'[request]\nurl = "{URL}"\nfollow_redirects = "always"\n',
    ],
)
def test_wrong_type_in_request_names_key(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config.load(write(tmp_path, text))
    assert "request." in str(e.value)


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "[limitz]\nrate = 5\n")
    assert "[limitz]" in str(e.value)
    assert "limits" in str(e.value)  # the known sections are listed


def test_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "[limits]\nrates = 5\n")
    assert e.value.key == "limits.rates"
    assert "rate" in str(e.value).split("limits.rates", 1)[1]  # the known keys are listed


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[limits\]"):
        Config.load(write(tmp_path, f'limits = 5\n[request]\nurl = "{URL}"\n'))


def test_missing_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"request\.url"):
        Config.load(write(tmp_path, "[limits]\nrate = 5\n"))


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com/v1/notes",  # no {id}
        "ftp://api.example.com/{id}",
        "file:///etc/{id}",
        "api.example.com/{id}",
        "https://{id}.example.com/x",
        "https://api.example.com{id}/x",
        "https://user:{id}@api.example.com/x",
        "https:///{id}",
        "https://api.example.com/{id}#frag",
        "https://api.example.com/{id}/{other}",
        "https://[::1/{id}",
    ],
)
def test_bad_url_template(url: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config(url=url)
    assert e.value.key == "request.url"


def test_id_may_be_only_in_a_param() -> None:
    cfg = Config(url="https://api.example.com/notes", params={"id": "{id}"})
    assert cfg.url == "https://api.example.com/notes"


def test_max_spend_with_price_gives_budget() -> None:
    cfg = Config(url=URL, price_per_call=0.001, max_spend=5, max_requests=10_000)
    assert cfg.request_budget == 5000


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    p = write(tmp_path, '[request]\nurl = "unterminated\n')
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert str(p) in str(e.value)
    assert "TOML" in str(e.value)


def test_missing_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found") as e:
        Config.load(tmp_path / "nope.toml")
    assert str(tmp_path / "nope.toml") in str(e.value)


@pytest.mark.parametrize(("body", "where"), [
    ('[request]\nurl = "URL"\n\n[limits]\nconcurrency = 8\nrate = -5  # per second\n',
     ":6: limits.rate: must be greater than 0"),
    ('[request]\nurl = "URL"\n[ limits ]\n  "burst" = 0\n', ":4: limits.burst:"),
    ('[request]\nurl = "URL"\n[limit]\nrate = 1\n', ":3: [limit]: unknown section"),
    ('# c\nurl = "URL"\n[limits]\nrate = 1\n',
     ":2: url: a key outside any section; write it under [request]"),
    ('nothing = 1\n[request]\nurl = "URL"\n', ":1: nothing: a key outside any section (sections: "),
    ('[request]\nurl = "URL"\nretries = 3\n', ":3: request.retries: unknown key"),
    ('[request]\nurl = "URL"\n[request.headers]\nX = [1]\n', ":3: request.headers:"),
])
def test_an_error_in_the_file_names_its_line(tmp_path: Path, body: str, where: str) -> None:
    p = write(tmp_path, body.replace("URL", URL))
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert str(e.value).startswith(f"{p}{where}"), str(e.value)


def test_overrides_win_and_are_validated(tmp_path: Path) -> None:
    p = write(tmp_path, f'[request]\nurl = "{URL}"\n[limits]\nrate = 5\n')
    assert Config.load(p, rate=7.0, concurrency=None).rate == 7.0
    with pytest.raises(ConfigError, match=r"^--rate: must be greater than 0") as e:
        Config.load(p, rate=-7.0)  # the value came from the flag: the flag is named, not the file
    assert e.value.path is None


# -- fuzz ----------------------------------------------------------------------------------------

_KEYS: dict[str, list[str]] = defaultdict(list)
for _dotted in TOML_KEYS:
    _section, _key = _dotted.split(".", 1)
    _KEYS[_section].append(_key)

_scalars = (
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=12)
    | st.sampled_from([URL, "https://h.example/q?i={id}", "full", "GET", "any", 404, 8.0, 0, -1,
                       "${HOME}", "${ASYNCRAWL_T_SURELY_UNSET}", "{id}"])
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def _docs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid base (so validation gets deep) with a few known keys set to arbitrary values."""
    doc: dict[str, Any] = {"request": {"url": draw(st.sampled_from([URL, "http://127.0.0.1/{id}"]))}}
    for dotted in draw(st.lists(st.sampled_from(sorted(TOML_KEYS)), max_size=4)):
        section, key = dotted.split(".", 1)
        doc.setdefault(section, {})[key] = draw(_values)
    if draw(st.booleans()):  # sometimes: a whole section (or the document shape) is garbage
        doc[draw(st.sampled_from(sorted(_KEYS)))] = draw(_values)
    return doc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs())
def test_from_dict_raises_only_config_error(doc: dict[str, Any]) -> None:
    try:
        cfg = Config.from_dict(doc)
    except ConfigError as e:
        assert e.key is None or e.key.split(".")[0].strip("[]") in _KEYS
    else:
        assert isinstance(cfg, Config)
        assert cfg.rate > 0 and cfg.concurrency > 0 and "{id}" not in cfg.url.split("/")[2]


@pytest.mark.parametrize(("kw", "key", "said"), [
    ({"headers": {"X-é": "1"}}, "request.headers", "is not a header name"),
    ({"headers": {"a b": "1"}}, "request.headers", "is not a header name"),
    ({"headers": {"": "1"}}, "request.headers", "is not a header name"),
    ({"url": "http://h.example:0/{id}"}, "request.url", "port 0"),
    ({"proxy": "http://[::1"}, "request.proxy", "with a host"),
    ({"proxy": "http://127.0.0.1:99999"}, "request.proxy", "with a host"),
    ({"proxy": "http://"}, "request.proxy", "with a host"),
    ({"url": "http://u:p@h.example/{id}", "headers": {"Authorization": "Bearer x"}},
     "request.url", "give the credentials one way"),
    ({"url": "http://u:p@h.example/{id}", "keys": ["k1"]}, "request.url", "one way"),
])
def test_what_no_request_could_carry_is_a_config_error(kw: dict, key: str, said: str) -> None:
    """Each passed the checks, then every request failed: a header name HTTP has no room for
    (the server answered 400 to all: every ID unavailable, exit 0; or the client refused it
    after the ID's intent: exit 1 and every ID in doubt), a proxy that is no URL (every ID
    unavailable), port 0 (sent to port 80)."""
    with pytest.raises(ConfigError) as e:
        Config(**{"url": "http://h.example/{id}", **kw})
    assert e.value.key == key and said in str(e.value), e.value


@pytest.mark.parametrize(("kw", "key", "said"), [
    ({"rate": 10**400}, "limits.rate", "and 10^15"),  # (a float of it overflowed)
    ({"timeout": 10**400}, "request.timeout", "and 10^15"),
    ({"burst": 10**400}, "limits.burst", "and 10^15"),
    ({"concurrency": 10**8}, "limits.concurrency", "at most 10,000"),  # (never started)
    ({"keys": ["k"], "key_header": 5, "headers": {"X": "1"}}, "request.key_header", "string"),
    ({"method": "POST", "json": {"a": __import__("datetime").date(1979, 5, 27)}},
     "request.json", "holds a date"),
])
def test_values_that_raised_past_the_checks_are_config_errors(kw: dict, key: str,
                                                              said: str) -> None:
    """Each raised OverflowError, AttributeError or TypeError (exit 1) after the checks."""
    with pytest.raises(ConfigError) as e:
        Config(**{"url": "http://h.example/{id}", **kw})
    assert e.value.key == key and said in str(e.value), e.value


def test_a_price_too_small_for_a_budget_caps_nothing_and_deep_nesting_is_an_error(
        tmp_path: Path) -> None:
    assert Config(url=URL, price_per_call=5e-324, max_spend=1.0).request_budget is None
    body: dict = {}
    body["self"] = body
    with pytest.raises(ConfigError, match="nested too deeply"):
        Config(url=URL, method="POST", json=body)
    p = write(tmp_path, f'[request]\nurl = "{URL}"\nx = {"[" * 5000}{"]" * 5000}\n')
    with pytest.raises(ConfigError, match="nested too deeply"):
        Config.load(p)


@pytest.mark.parametrize("name", ["ids", "state_dir", "job", "ca_bundle"])
def test_a_nul_in_a_path_or_a_name_is_a_config_error(name: str) -> None:
    """It raised ValueError ("embedded null byte") from the system's calls: exit 1."""
    with pytest.raises(ConfigError, match="contains a NUL character"):
        Config(url=URL, **{name: "a\x00b"})


def test_an_at_sign_in_the_query_is_no_user_and_a_key_header_is_a_token() -> None:
    cfg = Config(url="https://api.example.com?owner=me@example.com&id={id}",
                 headers={"Authorization": "Bearer x"})  # (it was refused as user:password@)
    assert cfg.url.startswith("https://api.example.com?owner=me@")
    with pytest.raises(ConfigError, match="must be a header name"):
        Config(url=URL, keys=["k1"], key_header="X-Clé")  # (400s for every request)


@pytest.mark.parametrize("value", ["${KEY:-sk_live_4f9a8b7c}", "${KEY-x}", "${}", "ab-${HOME"])
def test_a_reference_that_is_no_env_name_is_refused(tmp_path: Path, value: str) -> None:
    """It went out as it was written: a header carried "${KEY:-dflt}" as the API key. The
    message never quotes the default (a key, as often as not); other text with a ``${`` is
    taken as written."""
    p = tmp_path / "c.toml"
    p.write_text(f'[request]\nurl = "http://h/{{id}}"\n[request.headers]\nX-Api-Key = "{value}"\n'
                 '[alerts]\non_halt = "echo ${ASYNCRAWL_T_UNSET:-none}"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r":4: request\.headers\.X-Api-Key.*is no \$\{NAME\} "
                       "reference") as e:  # (the line of a key of a table of its own, too)
        Config.load(p)
    assert "sk_live" not in str(e.value)
    p.write_text(p.read_text().replace(value, "plain"), encoding="utf-8")
    assert Config.load(p).on_halt == "echo ${ASYNCRAWL_T_UNSET:-none}"  # (the shell's own)
    p.write_text(p.read_text().replace("plain", "Hello ${user.name} ab${9Zq"), encoding="utf-8")
    assert Config.load(p).headers["X-Api-Key"] == "Hello ${user.name} ab${9Zq"


def test_a_missing_extra_is_named_and_a_broken_one_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An extra that is installed but cannot be imported (pyarrow 14 beside NumPy 2, psycopg
    without a libpq) was reported as not installed: its install command changed nothing, and
    the cause was hidden (a packaging audit)."""
    from asyncrawl.errors import require_extra

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # (not installed)
    with pytest.raises(ConfigError, match=r"needs the 'parquet' extra: pip install "):
        require_extra("pyarrow", "parquet", "export --format parquet")
    (tmp_path / "brokenextra").mkdir()
    (tmp_path / "brokenextra" / "__init__.py").write_text(
        "raise ImportError('compiled against NumPy 1.x, cannot run with NumPy 2')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"needs brokenextra \(the 'parquet' extra\), which "
                       r"is installed but cannot be imported: compiled against NumPy 1\.x"):
        require_extra("brokenextra", "parquet", "export --format parquet")
    (tmp_path / "halfextra").mkdir()  # (installed, and needing a module that is not)
    (tmp_path / "halfextra" / "__init__.py").write_text("import no_such_dependency_here\n")
    with pytest.raises(ConfigError, match="cannot be imported: No module named"):
        require_extra("halfextra", "parquet", "export --format parquet")


# -- the library's keywords ----------------------------------------------------------------------


def test_a_misspelt_missing_or_positional_argument_is_a_config_error() -> None:
    """The dataclass's own __init__ raised a bare TypeError: no ``except AsyncrawlError``
    caught it, and it named no field the user may have meant."""
    from dataclasses import replace

    with pytest.raises(ConfigError, match="did you mean 'concurrency'") as e:
        Config(url=URL, concurency=8)  # type: ignore[call-arg]
    assert e.value.key == "concurency"
    with pytest.raises(ConfigError, match="did you mean 'rate'"):
        replace(Config(url=URL), ratee=3)
    with pytest.raises(ConfigError, match="is required") as e:
        Config()  # type: ignore[call-arg]
    assert e.value.key == "request.url"
    with pytest.raises(ConfigError, match="keyword arguments only"):
        Config(URL)  # type: ignore[call-arg]
    assert replace(Config(url=URL, rate=3), rate=5).rate == 5


@pytest.mark.parametrize(("kwargs", "key", "says"), [
    ({"headers": {"X-Note": "{id}"}}, "request.headers", "not filled in a header"),
    ({"params": {"{id}": "x"}}, "request.params", "value, not its name"),
    ({"method": "POST", "body": "a={id}", "content_type": "text/plain",
      "headers": {"content-type": "application/x-www-form-urlencoded"}},
     "request.content_type", "two types"),
])
def test_an_id_where_it_is_never_filled_in_or_a_body_typed_twice_is_refused(
        kwargs: dict[str, Any], key: str, says: str) -> None:
    """Each was sent as written: every request of the crawl the same literal ``{id}``, paid
    for; or a body encoded for one type and labelled with the other."""
    with pytest.raises(ConfigError, match=says) as e:
        Config(url=URL, **kwargs)
    assert e.value.key == key
    # (the same type both ways is no conflict: a config's content_type and -H's header)
    Config(url=URL, method="POST", body="a={id}", content_type="application/json",
           headers={"Content-Type": "Application/JSON; charset=utf-8"})
