"""The backend registry: `make_backend` turns a spec into a backend (DESIGN 9).

The registry sits above the backend modules and imports each one only when a spec names it,
so no optional package (wandb, trackio, httpx) is imported before a run asks for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from expr_tracker.backends.base import Backend
from expr_tracker.backends.legacy import LegacyBackend, is_legacy

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Which keys each backend type accepts in a mapping spec; "type" is always allowed.
_SPEC_KEYS: dict[str, frozenset[str]] = {
    "wandb": frozenset({"entity", "project", "mode"}),
    "trackio": frozenset({"project"}),
    "http": frozenset({"url", "token_env", "batch", "timeout", "retries", "backoff"}),
    "clickhouse": frozenset({"url", "database", "user_env", "password_env", "create", "batch",
                             "timeout", "retries", "backoff", "exit_timeout", "queue_mb"}),
}


def _check_spec(kind: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the keys and values of a mapping spec; return the keyword arguments."""
    allowed = _SPEC_KEYS[kind]
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "type":
            continue
        if key not in allowed:
            raise ValueError(
                f"backend {kind!r}: unknown key {key!r}; allowed: {', '.join(sorted(allowed))}"
            )
        kwargs[key] = value
    for key in ("entity", "project", "mode", "url", "token_env", "database", "user_env",
                "password_env"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise ValueError(f"backend {kind!r}: {key} must be a string")
    if kind == "wandb" and kwargs.get("mode") not in (None, "online", "offline", "disabled"):
        raise ValueError(
            f"backend 'wandb': mode must be online, offline or disabled, not {kwargs['mode']!r}"
        )
    if kind in ("http", "clickhouse"):
        _check_remote(kind, kwargs)
    return kwargs


# query parameters ClickHouse's HTTP interface reads as credentials
CLICKHOUSE_SECRET_PARAMS = frozenset({"user", "password"})


def check_url(url: Any, what: str, secret_params: frozenset[str] = frozenset()) -> str:
    """`url` if it is a well-formed http(s) URL without credentials, else ValueError
    starting with `what` (a URL is logged and shown; credentials belong in the
    environment, whether as `user:password@` or as query parameters the server reads as
    credentials, `secret_params`: ClickHouse's `?user=&password=`)."""
    import urllib.parse

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{what} must start with http:// or https://, not {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{what} {url!r} is not a valid URL: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{what} {url!r} has no host")
    secret = sorted({k.lower() for k, _ in urllib.parse.parse_qsl(parts.query, True)}
                    & secret_params)
    if "@" in parts.netloc or secret:
        where = "user:password@" if "@" in parts.netloc else "?" + "=, ?".join(secret) + "="
        raise ValueError(f"{what} must not hold credentials ({where}); name environment "
                         "variables with user_env/password_env or token_env")
    return url


def _check_remote(kind: str, kwargs: dict[str, Any]) -> None:
    """The keys of the backends that send to a URL (http, clickhouse)."""
    url = kwargs.get("url")
    if not url:
        raise ValueError(f"backend {kind!r}: url is required")
    check_url(url, f"backend {kind!r}: url",
              CLICKHOUSE_SECRET_PARAMS if kind == "clickhouse" else frozenset())
    for key in ("token_env", "user_env", "password_env"):
        if key in kwargs and not _ENV_NAME.match(kwargs[key]):
            raise ValueError(f"backend {kind!r}: {key} {kwargs[key]!r} is not a variable name")
    if "database" in kwargs:
        from expr_tracker.backends.clickhouse import DATABASE_RE

        if not DATABASE_RE.match(kwargs["database"]):
            raise ValueError(f"backend {kind!r}: database {kwargs['database']!r} must be letters, "
                             "digits and _, not starting with a digit")
    if "create" in kwargs and not isinstance(kwargs["create"], bool):
        raise ValueError(f"backend {kind!r}: create must be true or false")
    for key, lo in (("batch", 1), ("retries", 0)):
        value = kwargs.get(key, lo)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"backend {kind!r}: {key} must be an integer >= {lo}")
    for key in ("timeout", "backoff", "exit_timeout", "queue_mb"):
        value = kwargs.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"backend {kind!r}: {key} must be a positive number")


def check_environment(backend: Any) -> None:
    """ValueError naming the variable if `backend` names a credentials variable
    (`user_env`, `password_env`, `token_env`) that is not set in this process: the process
    that connects (a direct-mode run, exprd) checks it at start, not the first send."""
    missing = getattr(backend, "missing_environment", None)
    if callable(missing):
        for key, var in missing():
            raise ValueError(f"backend {getattr(backend, 'name', '?')!r}: {key} names "
                             f"{var}, which is not set in the environment")


BACKEND_TYPES = tuple(sorted(_SPEC_KEYS))


def named_spec(name: str, spec: Any) -> Any:
    """A configuration table `[backends.NAME]` as a spec: without `type`, a NAME that is a
    backend type (`[backends.clickhouse]`) is the type; anything else is returned as is."""
    if isinstance(spec, Mapping) and "type" not in spec and name in _SPEC_KEYS:
        return {"type": name, **spec}
    return spec


def make_backend(spec: str | Mapping[str, Any] | Backend) -> Backend:
    """Build a backend from `"wandb"`, `"trackio"` or a mapping with a `type` key.

    For example `{"type": "http", "url": ..., "token_env": "EXPR_HTTP_TOKEN", "batch": 100}`
    or `{"type": "clickhouse", "url": "http://ch:8123", "database": "expr"}`.

    Raises ValueError naming the field for an unknown type or key. Imports no
    optional package: a missing one is reported when the backend is opened.
    """
    options: Mapping[str, Any]
    if isinstance(spec, str):
        kind, options = spec, {}
    elif isinstance(spec, Mapping):
        spec_type = spec.get("type")
        if not isinstance(spec_type, str):
            raise ValueError("backend spec: type is required (wandb, trackio, http or "
                             "clickhouse; a [backends.NAME] table named after its type may "
                             "leave it out)")
        kind, options = spec_type, spec
    elif all(callable(getattr(spec, m, None)) for m in ("open", "log", "alert", "finish")):
        return spec  # a user's own backend object (direct mode only)
    elif is_legacy(spec):
        return LegacyBackend(spec)  # an expr-tracker 0.4 plugin: init(run_info), log(row), finish()
    else:
        raise TypeError(
            "backend spec must be 'wandb', 'trackio', a mapping with a type, or an object with "
            "open/log/alert/finish methods (or 0.4's init/log/finish); "
            f"got {type(spec).__name__}"
        )
    if kind not in _SPEC_KEYS:
        raise ValueError(
            f"backend type {kind!r} is unknown; expected one of: {', '.join(sorted(_SPEC_KEYS))}"
        )
    kwargs = _check_spec(kind, options)
    if kind == "wandb":
        from expr_tracker.backends.wandb import WandbBackend

        return WandbBackend(**kwargs)
    if kind == "trackio":
        from expr_tracker.backends.trackio import TrackioBackend

        return TrackioBackend(**kwargs)
    if kind == "clickhouse":
        from expr_tracker.backends.clickhouse import ClickHouseBackend

        return ClickHouseBackend(**kwargs)
    from expr_tracker.backends.http import HttpBackend

    return HttpBackend(**kwargs)
