"""Alert configuration: parse and check the channels and delivery policy (DESIGN 7).

The configuration is the `alert=` dict of `et.init` merged over the TOML or JSON file
named by `$EXPR_ALERT_CONFIG` (`.json` is JSON, anything else TOML). Tables merge
key by key and the dict wins; a channel whose `type` changes is replaced whole::

    [channels.ops]                  # names: letters, digits, _ - .
    type = "webhook"                # log | webhook | slack | command
    url_env = "OPS_WEBHOOK_URL"     # or url = "https://..." (prefer env: URLs carry tokens)
    secret_env = "OPS_HMAC"         # optional: X-Expr-Signature: sha256=<hex HMAC-SHA256 of body>
    min_level = "warning"           # debug | info | warning | error | critical (default debug)
    rate = 2                        # any [policy] key may be overridden per channel

    [channels.slack]
    type = "slack"                  # Slack incoming webhook: text + coloured attachment
    url_env = "SLACK_WEBHOOK_URL"

    [channels.pager]
    type = "command"                # argv runs without a shell, alert JSON on stdin;
    argv = ["/usr/local/bin/page-me", "--team", "ml"]
    timeout = 10                    # its process group is killed after it; exit != 0 fails

    [policy]                        # defaults
    rate = 10                       # alerts per minute per channel (token bucket), 0 = unlimited
    burst = 5                       # bucket size
    dedup_seconds = 300             # same (rule or title, kind, level) on a channel: suppressed
    max_queue = 1000                # alerts waiting per channel; beyond it new ones are dropped
    retries = 5                     # attempts after the first
    backoff = 0.5                   # first retry delay, doubled each time, capped at 30 s
    timeout = 10                    # seconds per attempt
    exit_timeout = 5                # seconds finish() waits for delivery; what is still
                                    # pending then is counted as undelivered

With no channel configured, alerts go to one `log` channel named "log". A literal
`secret` is refused in the `alert=` dict (it travels in the spool); `url_env` and
`secret_env` are read only when `build_channel` makes the channel.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from expr_tracker.errors import unknown_key

LEVELS = ("debug", "info", "warning", "error", "critical")
CHANNEL_TYPES = ("log", "webhook", "slack", "command", "callable")
CONFIG_ENV = "EXPR_ALERT_CONFIG"

_RANK = {level: i for i, level in enumerate(LEVELS)}
_CHANNEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "log": (),
    "webhook": ("url", "url_env", "secret", "secret_env"),
    "slack": ("url", "url_env"),
    "command": ("argv",),
    "callable": ("fn",),
}


@dataclass(frozen=True)
class Policy:
    """Delivery policy of one channel (see the module docstring for each field)."""

    rate: float = 10.0
    burst: int = 5
    dedup_seconds: float = 300.0
    max_queue: int = 1000
    retries: int = 5
    backoff: float = 0.5
    timeout: float = 10.0
    exit_timeout: float = 5.0


# key -> (integer only, lower bound, bound excluded)
_POLICY_RULES: dict[str, tuple[bool, float, bool]] = {
    "rate": (False, 0.0, False),
    "burst": (True, 1.0, False),
    "dedup_seconds": (False, 0.0, False),
    "max_queue": (True, 1.0, False),
    "retries": (True, 0.0, False),
    "backoff": (False, 0.0, False),
    "timeout": (False, 0.0, True),
    "exit_timeout": (False, 0.0, False),
}


@dataclass(frozen=True)
class ChannelConfig:
    """One parsed channel; env-named secrets are resolved later by `build_channel`."""

    name: str
    type: str
    min_level: str = "debug"
    policy: Policy = field(default_factory=Policy)
    url: str | None = field(default=None, repr=False)
    url_env: str | None = None
    secret: str | None = field(default=None, repr=False)
    secret_env: str | None = None
    argv: tuple[str, ...] = ()
    fn: Any = field(default=None, repr=False, compare=False)  # a callable channel's function


@dataclass(frozen=True)
class AlertConfig:
    """The parsed alert configuration: channels, the global policy, and the file it came from."""

    channels: tuple[ChannelConfig, ...]
    policy: Policy
    source: str | None = None
    # no channel was configured: `channels` is the default "log" one (a config of rule
    # policy or `[health]` thresholds only)
    default_channels: bool = False


def _policy(where: str, raw: Mapping[str, Any], base: Policy) -> Policy:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        integer, low, strict = _POLICY_RULES[key]
        ok_type = int if integer else (int, float)
        bad = isinstance(value, bool) or not isinstance(value, ok_type)
        if bad or (isinstance(value, float) and not math.isfinite(value)):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{where}: key {key!r} must be {kind}, got {value!r}")
        if value < low or (strict and value == low):
            raise ValueError(f"{where}: key {key!r} must be {'>' if strict else '>='} {low:g}")
        if value > 1e9:  # keeps the limiter's float arithmetic finite
            raise ValueError(f"{where}: key {key!r} must be at most 1e9")
        values[key] = value
    return replace(base, **values)


def _check_url(where: str, key: str, url: object) -> str:
    # the value is never echoed: it is a secret
    if not isinstance(url, str):
        raise ValueError(f"{where}: key {key!r} must be a string")
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{where}: key {key!r} must be an http(s) URL with a host")
    return url


def _env_name(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not _ENV_NAME.match(value):
        raise ValueError(f"{where}: key {key!r} must name an environment variable, got {value!r}")
    return value


def _channel(name: object, raw: object, base: Policy) -> ChannelConfig:
    if not isinstance(name, str) or not _CHANNEL_NAME.match(name):
        raise ValueError(f"alert config: channel name {name!r} must be 1-64 of letters, digits, _ - .")
    where = f"alert channel {name!r}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a table of keys, got {type(raw).__name__}")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _TYPE_KEYS:
        raise ValueError(f"{where}: key 'type' must be one of {', '.join(CHANNEL_TYPES)}, got {kind!r}")
    allowed = ("type", "min_level", *_TYPE_KEYS[kind], *_POLICY_RULES)
    for key in raw:
        if key not in allowed:
            raise ValueError(unknown_key(f"{where} (type {kind!r})", key, allowed))
    level = raw.get("min_level", "debug")
    if not isinstance(level, str) or level not in _RANK:
        raise ValueError(f"{where}: key 'min_level' must be one of {', '.join(LEVELS)}, got {level!r}")
    policy = _policy(where, {k: v for k, v in raw.items() if k in _POLICY_RULES}, base)
    out = ChannelConfig(name=name, type=kind, min_level=level, policy=policy)
    if kind in ("webhook", "slack"):
        if ("url" in raw) == ("url_env" in raw):
            raise ValueError(f"{where}: exactly one of keys 'url' and 'url_env' is required")
        if "url" in raw:
            out = replace(out, url=_check_url(where, "url", raw["url"]))
        else:
            out = replace(out, url_env=_env_name(where, "url_env", raw["url_env"]))
    if "secret" in raw and "secret_env" in raw:
        raise ValueError(f"{where}: keys 'secret' and 'secret_env' exclude each other")
    if "secret" in raw:
        if not isinstance(raw["secret"], str) or not raw["secret"]:
            raise ValueError(f"{where}: key 'secret' must be a non-empty string")
        out = replace(out, secret=raw["secret"])
    if "secret_env" in raw:
        out = replace(out, secret_env=_env_name(where, "secret_env", raw["secret_env"]))
    if kind == "command":
        argv = raw.get("argv")
        if (
            not isinstance(argv, (list, tuple))
            or not argv
            or not all(isinstance(a, str) and a and "\x00" not in a for a in argv)
        ):
            raise ValueError(f"{where}: key 'argv' must be a non-empty list of non-empty strings")
        out = replace(out, argv=tuple(argv))
    if kind == "callable":
        if not callable(raw.get("fn")):
            raise ValueError(f"{where}: key 'fn' must be a function taking the alert (a dict)")
        out = replace(out, fn=raw["fn"])
    return out


def _channel_list(chans: Sequence[Any]) -> dict[str, Any]:
    """expr-tracker 0.4's `channels` list (tables with a `type`, maybe a `name`; a bare
    function is a callable channel) as this project's table of named channels."""
    out: dict[str, Any] = {}
    for i, item in enumerate(chans):
        if callable(item) and not isinstance(item, Mapping):
            item = {"type": "callable", "fn": item}
        if not isinstance(item, Mapping):
            raise ValueError(f"alert config: channels[{i}] must be a table or a function, "
                             f"got {type(item).__name__}")
        table = {("fn" if k == "callable" else k): v for k, v in item.items() if k != "name"}
        name = item.get("name") or f"{item.get('type', 'channel')}{i if i else ''}"
        if name in out:
            raise ValueError(f"alert config: channels[{i}]: the name {name!r} is taken")
        out[name] = table
    return out


def read_config_file(path: str) -> dict[str, Any]:
    """The alert config file at `path` as a dict (its `[health]` table included); ValueError."""
    where = f"${CONFIG_ENV}={path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the alert config: {exc.strerror}") from None
    try:
        if path.lower().endswith(".json"):
            out = json.loads(data)
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - exercised on 3.10 only
                import tomli as tomllib
            out = tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSON/TOML decode errors are ValueErrors
        raise ValueError(f"{where}: not a valid alert config file: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{where}: the top level must be a table/object")
    return out


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if not (isinstance(old, Mapping) and isinstance(value, Mapping)):
            out[key] = value
        elif key == "channels":
            chans = dict(old)
            for name, table in value.items():
                prev = chans.get(name)
                same = isinstance(prev, Mapping) and isinstance(table, Mapping)
                if same and table.get("type", prev.get("type")) == prev.get("type"):  # type: ignore[union-attr]
                    chans[name] = {**prev, **table}  # type: ignore[dict-item]
                else:
                    chans[name] = table
            out[key] = chans
        else:
            out[key] = {**old, **value}
    return out


def load_config(
    alert: Mapping[str, Any] | AlertConfig | None = None, *, path: str | None = None
) -> AlertConfig:
    """Parse the `alert=` dict merged over `$EXPR_ALERT_CONFIG` (or the file at `path`).

    Errors name the channel and key. The file's `[health]` table is left to
    `expr_tracker.health.config`.
    """
    if isinstance(alert, AlertConfig):
        return alert
    if alert is not None and not isinstance(alert, Mapping):
        raise TypeError(f"alert must be a mapping or None, got {type(alert).__name__}")
    explicit = dict(alert or {})
    if isinstance(explicit.get("channels"), (list, tuple)):
        explicit["channels"] = _channel_list(explicit["channels"])
    chans = explicit.get("channels")
    if isinstance(chans, Mapping):
        for name, table in chans.items():
            if isinstance(table, Mapping) and "secret" in table:
                raise ValueError(
                    f"alert channel {name!r}: key 'secret' is accepted only in the "
                    f"${CONFIG_ENV} file (this dict is recorded); use 'secret_env'"
                )
    path = path or os.environ.get(CONFIG_ENV) or None
    from_file = read_config_file(path) if path else {}
    from_file.pop("health", None)  # detector thresholds (DESIGN 13), parsed by expr_tracker.health
    from_file.pop("defaults", None)  # init's defaults (backends), read by expr_tracker.options
    merged = _merge(from_file, explicit)
    for key in merged:
        if key not in ("channels", "policy"):
            raise ValueError(unknown_key("alert config", key, ("channels", "policy")))
    raw_policy = merged.get("policy", {})
    raw_chans = merged.get("channels", {})
    for key, value in (("policy", raw_policy), ("channels", raw_chans)):
        if not isinstance(value, Mapping):
            raise ValueError(f"alert config: key {key!r} must be a table, got {type(value).__name__}")
    for key in raw_policy:
        if key not in _POLICY_RULES:
            raise ValueError(unknown_key("alert policy", key, _POLICY_RULES))
    policy = _policy("alert policy", raw_policy, Policy())
    channels = tuple(_channel(name, table, policy) for name, table in raw_chans.items())
    if not channels:
        channels = (ChannelConfig(name="log", type="log", policy=policy),)
        return AlertConfig(channels=channels, policy=policy, source=path, default_channels=True)
    return AlertConfig(channels=channels, policy=policy, source=path)

