"""The backend registry: `make_backend` turns a spec into a backend (DESIGN 9).

The registry sits above the backend modules and imports each one only when a spec names it,
so no optional package (wandb, trackio, httpx) is imported before a run asks for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from expr_tracker.backends.base import Backend

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Which keys each backend type accepts in a mapping spec; "type" is always allowed.
_SPEC_KEYS: dict[str, frozenset[str]] = {
    "wandb": frozenset({"entity", "project", "mode"}),
    "trackio": frozenset({"project"}),
    "http": frozenset({"url", "token_env", "batch", "timeout", "retries", "backoff"}),
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
    for key in ("entity", "project", "mode", "url", "token_env"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise ValueError(f"backend {kind!r}: {key} must be a string")
    if kind == "wandb" and kwargs.get("mode") not in (None, "online", "offline", "disabled"):
        raise ValueError(
            f"backend 'wandb': mode must be online, offline or disabled, not {kwargs['mode']!r}"
        )
    if kind == "http":
        url = kwargs.get("url")
        if not url:
            raise ValueError("backend 'http': url is required")
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"backend 'http': url must start with http:// or https://, not {url!r}"
            )
        if "token_env" in kwargs and not _ENV_NAME.match(kwargs["token_env"]):
            raise ValueError(
                f"backend 'http': token_env {kwargs['token_env']!r} is not a variable name"
            )
        for key, lo in (("batch", 1), ("retries", 0)):
            value = kwargs.get(key, lo)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"backend 'http': {key} must be an integer >= {lo}")
        for key in ("timeout", "backoff"):
            value = kwargs.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"backend 'http': {key} must be a positive number")
    return kwargs


def make_backend(spec: str | Mapping[str, Any] | Backend) -> Backend:
    """Build a backend from `"wandb"`, `"trackio"` or a mapping with a `type` key.

    For example `{"type": "http", "url": ..., "token_env": "EXPR_HTTP_TOKEN", "batch": 100}`.

    Raises ValueError naming the field for an unknown type or key. Imports no
    optional package: a missing one is reported when the backend is opened.
    """
    options: Mapping[str, Any]
    if isinstance(spec, str):
        kind, options = spec, {}
    elif isinstance(spec, Mapping):
        spec_type = spec.get("type")
        if not isinstance(spec_type, str):
            raise ValueError("backend spec: type is required (wandb, trackio or http)")
        kind, options = spec_type, spec
    elif all(callable(getattr(spec, m, None)) for m in ("open", "log", "alert", "finish")):
        return spec  # a user's own backend object (direct mode only)
    else:
        raise TypeError(
            "backend spec must be 'wandb', 'trackio', a mapping with a type, or an object with "
            f"open/log/alert/finish methods; got {type(spec).__name__}"
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
    from expr_tracker.backends.http import HttpBackend

    return HttpBackend(**kwargs)
