"""Alerts: the Alert value, delivery channels and the delivery policy (DESIGN 7).

An Alert comes from a rule firing or recovering, or from `et.alert(...)`. Once it
must be delivered it goes to a `Dispatcher`, which never blocks and never raises
into the caller: one background daemon thread delivers to every channel with a
per-channel token bucket, a dedup window, a bounded queue and retries. What is not
delivered is counted in `stats()`; each failure cause is logged once per channel
on the `expr_tracker.alerts` logger (never `warnings.warn`: it runs off-thread).

Configuration is the `alert=` dict of `et.init` merged over the TOML or JSON file
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

With no channel configured, alerts go to one `log` channel named "log". Retries
happen on connection errors, timeouts, HTTP 408/429/5xx (honouring Retry-After,
capped at 300 s) and failed commands; any other HTTP status fails at once.

Secrets (webhook URLs, HMAC keys) come only from the environment or the config
file: a literal `secret` is refused in the `alert=` dict, which travels in the
spool. They never appear in a log line or exception message (URLs are shown as
`scheme://host/…`) nor in `Alert.as_dict()`. `url_env`/`secret_env` are read when
the channels are built (`Dispatcher.from_config`), so a spool-mode SDK can check a
config whose variables only the daemon has.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time as _clock
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import orjson

from expr_tracker.errors import TrackerError

LEVELS = ("debug", "info", "warning", "error", "critical")
KINDS = ("fire", "recover", "manual")
CHANNEL_TYPES = ("log", "webhook", "slack", "command")
CONFIG_ENV = "EXPR_ALERT_CONFIG"
MAX_BACKOFF = 30.0
MAX_RETRY_AFTER = 300.0

_log = logging.getLogger("expr_tracker.alerts")
_RANK = {level: i for i, level in enumerate(LEVELS)}
_LEVELNO = dict(zip(LEVELS, (10, 20, 30, 40, 50), strict=True))
_CHANNEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "log": (),
    "webhook": ("url", "url_env", "secret", "secret_env"),
    "slack": ("url", "url_env"),
    "command": ("argv",),
}
_SLACK_STYLE = {
    "debug": (":mag:", "#9e9e9e"),
    "info": (":information_source:", "#2196f3"),
    "warning": (":warning:", "#ff9800"),
    "error": (":x:", "#e53935"),
    "critical": (":rotating_light:", "#8e0000"),
}


@dataclass(frozen=True)
class Alert:
    """One alert to deliver: a rule firing or recovering, or a manual `et.alert`."""

    title: str
    text: str
    level: str
    rule: str | None
    kind: str
    step: int | None
    time: float
    project: str
    run: str
    stream: str | None
    rank: int
    event_id: str | None

    def as_dict(self) -> dict[str, Any]:
        """Return the alert as a JSON-safe dict; non-finite floats are left out."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if not (isinstance(v, float) and not math.isfinite(v))}


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def make_alert(
    title: object,
    text: object = "",
    level: object = "info",
    *,
    rule: str | None = None,
    kind: str = "manual",
    step: int | None = None,
    time: float | None = None,
    project: str = "",
    run: str = "",
    stream: str | None = None,
    rank: int = 0,
    event_id: str | None = None,
) -> Alert:
    """Build a validated Alert; a bad argument is a TypeError/ValueError naming it."""
    if not _text(title, "title").strip():
        raise ValueError("title must not be empty")
    lvl = _text(level, "level").lower()
    if lvl not in _RANK:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    when = _clock.time() if time is None else time
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise ValueError(f"time must be a finite number, got {time!r}")
    for name, value in (("rule", rule), ("stream", stream), ("event_id", event_id)):
        if value is not None:
            _text(value, name)
    return Alert(
        title=str(title), text=_text(text, "text"), level=lvl, rule=rule, kind=kind,
        step=step, time=float(when), project=_text(project, "project"), run=_text(run, "run"),
        stream=stream, rank=rank, event_id=event_id,
    )


def redact_url(url: str) -> str:
    """Show a URL as `scheme://host[:port]/…`: paths and queries of webhooks carry tokens."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme or '?'}://{host}{port}/…"


def _one_line(s: str) -> str:
    return " ".join(part.strip() for part in s.splitlines() if part.strip())


def format_line(alert: Alert) -> str:
    """The one-line text form of an alert (the `log` channel writes it)."""
    where = f"{alert.project}/{alert.run}" + (f"/{alert.stream}" if alert.stream else "")
    where += f" rank {alert.rank}" + (f" step {alert.step}" if alert.step is not None else "")
    if alert.rule is not None:
        where += f" rule {alert.rule} {alert.kind}"
    body = _one_line(alert.title) + (f": {_one_line(alert.text)}" if alert.text.strip() else "")
    return f"expr alert [{alert.level}] {body} ({where})"


# -- configuration -------------------------------------------------------------------------


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


# key -> (integer only, lower bound, bound excluded)
_POLICY_RULES: dict[str, tuple[bool, float, bool]] = {
    "rate": (False, 0.0, False),
    "burst": (True, 1.0, False),
    "dedup_seconds": (False, 0.0, False),
    "max_queue": (True, 1.0, False),
    "retries": (True, 0.0, False),
    "backoff": (False, 0.0, False),
    "timeout": (False, 0.0, True),
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


@dataclass(frozen=True)
class AlertConfig:
    """The parsed alert configuration: channels, the global policy, and the file it came from."""

    channels: tuple[ChannelConfig, ...]
    policy: Policy
    source: str | None = None


def _policy(where: str, raw: Mapping[str, Any], base: Policy) -> Policy:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        integer, low, strict = _POLICY_RULES[key]
        ok_type = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type) or not math.isfinite(value):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{where}: key {key!r} must be {kind}, got {value!r}")
        if value < low or (strict and value == low):
            raise ValueError(f"{where}: key {key!r} must be {'>' if strict else '>='} {low:g}")
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
    if kind not in _TYPE_KEYS:
        raise ValueError(f"{where}: key 'type' must be one of {', '.join(CHANNEL_TYPES)}, got {kind!r}")
    allowed = ("type", "min_level", *_TYPE_KEYS[kind], *_POLICY_RULES)
    for key in raw:
        if key not in allowed:
            raise ValueError(
                f"{where}: unknown key {key!r} for type {kind!r} (allowed: {', '.join(allowed)})"
            )
    level = raw.get("min_level", "debug")
    if level not in _RANK:
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
    return out


def _read_file(path: str) -> dict[str, Any]:
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


def load_config(alert: Mapping[str, Any] | AlertConfig | None = None) -> AlertConfig:
    """Parse the `alert=` dict merged over `$EXPR_ALERT_CONFIG`; errors name the channel and key."""
    if isinstance(alert, AlertConfig):
        return alert
    if alert is not None and not isinstance(alert, Mapping):
        raise TypeError(f"alert must be a mapping or None, got {type(alert).__name__}")
    explicit = dict(alert or {})
    chans = explicit.get("channels")
    if isinstance(chans, Mapping):
        for name, table in chans.items():
            if isinstance(table, Mapping) and "secret" in table:
                raise ValueError(
                    f"alert channel {name!r}: key 'secret' is accepted only in the "
                    f"${CONFIG_ENV} file (this dict is recorded); use 'secret_env'"
                )
    path = os.environ.get(CONFIG_ENV) or None
    merged = _merge(_read_file(path) if path else {}, explicit)
    for key in merged:
        if key not in ("channels", "policy"):
            raise ValueError(f"alert config: unknown key {key!r} (allowed: channels, policy)")
    raw_policy = merged.get("policy", {})
    raw_chans = merged.get("channels", {})
    for key, value in (("policy", raw_policy), ("channels", raw_chans)):
        if not isinstance(value, Mapping):
            raise ValueError(f"alert config: key {key!r} must be a table, got {type(value).__name__}")
    for key in raw_policy:
        if key not in _POLICY_RULES:
            raise ValueError(
                f"alert policy: unknown key {key!r} (allowed: {', '.join(_POLICY_RULES)})"
            )
    policy = _policy("alert policy", raw_policy, Policy())
    channels = tuple(_channel(name, table, policy) for name, table in raw_chans.items())
    if not channels:
        channels = (ChannelConfig(name="log", type="log", policy=policy),)
    return AlertConfig(channels=channels, policy=policy, source=path)


# -- channels ------------------------------------------------------------------------------


class DeliveryError(TrackerError):
    """A channel could not deliver an alert; `cause` is short and holds no secret."""

    def __init__(
        self, cause: str, *, retryable: bool, retry_after: float | None = None, detail: str = ""
    ) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retryable = retryable
        self.retry_after = retry_after
        self.detail = detail


class Channel:
    """A delivery target: `send` returns on success and raises DeliveryError otherwise."""

    type: ClassVar[str] = ""

    def __init__(self, name: str, *, min_level: str = "debug", policy: Policy | None = None):
        self.name = name
        self.min_level = min_level
        self.policy = policy

    def describe(self) -> str:
        """A label for log lines; never contains a secret."""
        return self.type

    def send(self, alert: Alert, timeout: float) -> None:
        """Deliver one alert within about `timeout` seconds."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections; called from the delivery thread when it stops."""

    def forget(self) -> None:
        """Drop (without closing) resources inherited over fork: they belong to the parent."""


class LogChannel(Channel):
    """One line per alert on sys.stderr, and a record on the `expr_tracker.alerts` logger."""

    type = "log"

    def send(self, alert: Alert, timeout: float) -> None:
        line = format_line(alert)
        # Without any handler configured, logging's last-resort handler would print the
        # record to stderr a second time; the line below is the stderr copy.
        if _log.hasHandlers():
            _log.log(_LEVELNO.get(alert.level, logging.INFO), "%s", line)
        stream = sys.stderr
        if stream is not None:
            stream.write(line + "\n")
            stream.flush()


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        from datetime import timezone
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - _clock.time()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class WebhookChannel(Channel):
    """POST `alert.as_dict()` as JSON, optionally signed with HMAC-SHA256 (X-Expr-Signature)."""

    type = "webhook"

    def __init__(
        self, name: str, url: str, *, secret: str | None = None, min_level: str = "debug",
        policy: Policy | None = None,
    ) -> None:
        super().__init__(name, min_level=min_level, policy=policy)
        self._url = url
        self._secret = secret.encode("utf-8") if secret else None
        self._transport: Any = None

    def describe(self) -> str:
        return f"{self.type} {redact_url(self._url)}"

    def payload(self, alert: Alert) -> dict[str, Any]:
        """The JSON body sent for `alert`."""
        return alert.as_dict()

    def send(self, alert: Alert, timeout: float) -> None:
        import httpx

        body = orjson.dumps(self.payload(alert))
        headers = {"content-type": "application/json", "user-agent": "expr-tracker"}
        if alert.event_id:
            # stable across replays of the same spool event, distinct per rule
            key = alert.event_id + (f":{alert.rule}" if alert.rule else "")
            headers["idempotency-key"] = key
        if self._secret is not None:
            import hashlib
            import hmac

            digest = hmac.new(self._secret, body, hashlib.sha256).hexdigest()
            headers["x-expr-signature"] = f"sha256={digest}"
        if self._transport is None:
            # The transport, not httpx.Client: the client logs every request URL at INFO,
            # and webhook URLs are secrets.
            self._transport = httpx.HTTPTransport()
        request = httpx.Request(
            "POST", self._url, content=body, headers=headers,
            extensions={"timeout": httpx.Timeout(timeout).as_dict()},
        )
        try:
            response = self._transport.handle_request(request)
            response.close()
        except httpx.TimeoutException:
            raise DeliveryError("timeout", retryable=True) from None
        except httpx.TransportError as exc:
            raise DeliveryError(type(exc).__name__, retryable=True) from None
        status = response.status_code
        if 200 <= status < 300:
            return
        wait = _retry_after(response.headers.get("retry-after")) if status in (429, 503) else None
        retryable = status in (408, 429) or status >= 500
        raise DeliveryError(f"HTTP {status}", retryable=retryable, retry_after=wait)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def forget(self) -> None:
        self._transport = None


def _slack_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_payload(alert: Alert) -> dict[str, Any]:
    """The Slack incoming-webhook body: fallback `text` plus a coloured attachment of blocks."""
    emoji, colour = _SLACK_STYLE.get(alert.level, _SLACK_STYLE["info"])
    title = _slack_escape(_one_line(alert.title))
    head = f"{emoji} *{title}*" + (f"\n{_slack_escape(alert.text)}" if alert.text else "")
    where = format_line(alert).rsplit(" (", 1)[-1].rstrip(")")
    return {
        "text": f"{emoji} [{alert.level.upper()}] {title}",
        "attachments": [
            {
                "color": colour,
                "blocks": [
                    # Slack caps a section's text at 3000 characters
                    {"type": "section", "text": {"type": "mrkdwn", "text": head[:2900]}},
                    {
                        "type": "context",
                        "elements": [{"type": "mrkdwn", "text": _slack_escape(where)[:2900]}],
                    },
                ],
            }
        ],
    }


class SlackChannel(WebhookChannel):
    """A Slack incoming webhook (no signature: the URL is the credential)."""

    type = "slack"

    def __init__(
        self, name: str, url: str, *, min_level: str = "debug", policy: Policy | None = None
    ) -> None:
        super().__init__(name, url, min_level=min_level, policy=policy)

    def payload(self, alert: Alert) -> dict[str, Any]:
        return slack_payload(alert)


class CommandChannel(Channel):
    """Run argv (never via a shell) with the alert JSON on stdin; exit status 0 is success."""

    type = "command"

    def __init__(
        self, name: str, argv: Sequence[str], *, min_level: str = "debug",
        policy: Policy | None = None,
    ) -> None:
        super().__init__(name, min_level=min_level, policy=policy)
        self.argv = tuple(argv)

    def describe(self) -> str:
        # arguments may carry tokens; the program name is enough to find the channel
        return f"{self.type} {os.path.basename(self.argv[0])}"

    def send(self, alert: Alert, timeout: float) -> None:
        import signal
        import subprocess

        body = orjson.dumps(alert.as_dict(), option=orjson.OPT_APPEND_NEWLINE)
        try:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True,  # its own group, killed whole
            )
        except OSError as exc:
            raise DeliveryError(f"cannot run: {exc.strerror}", retryable=False) from None
        try:
            _, err = proc.communicate(body, timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            for pipe in (proc.stdin, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
            raise DeliveryError(f"timed out after {timeout:g} s", retryable=True) from None
        if proc.returncode != 0:
            lines = err.decode("utf-8", "replace").strip().splitlines()
            code = proc.returncode
            cause = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
            raise DeliveryError(cause, retryable=True, detail=lines[-1][:200] if lines else "")


def _from_env(cfg: ChannelConfig, key: str, env: str) -> str:
    value = os.environ.get(env)
    if not value:
        raise ValueError(f"alert channel {cfg.name!r}: key {key!r} names ${env}, which is not set")
    return value


def build_channel(cfg: ChannelConfig) -> Channel:
    """Make the channel of `cfg`, reading `url_env`/`secret_env` now (ValueError if unset)."""
    common: dict[str, Any] = {"min_level": cfg.min_level, "policy": cfg.policy}
    if cfg.type in ("webhook", "slack"):
        url = cfg.url if cfg.url_env is None else _from_env(cfg, "url_env", cfg.url_env)
        url = _check_url(f"alert channel {cfg.name!r}", "url_env" if cfg.url_env else "url", url)
        if cfg.type == "slack":
            return SlackChannel(cfg.name, url, **common)
        secret = cfg.secret
        if cfg.secret_env is not None:
            secret = _from_env(cfg, "secret_env", cfg.secret_env)
        return WebhookChannel(cfg.name, url, secret=secret, **common)
    if cfg.type == "command":
        if shutil.which(cfg.argv[0]) is None:
            raise ValueError(
                f"alert channel {cfg.name!r}: key 'argv': {cfg.argv[0]!r} is not an executable"
            )
        return CommandChannel(cfg.name, cfg.argv, **common)
    return LogChannel(cfg.name, **common)


# -- dispatcher ----------------------------------------------------------------------------


class _Lane:
    """One channel's queue, counters and limiter state; guarded by the dispatcher's lock."""

    def __init__(self, channel: Channel, policy: Policy) -> None:
        self.channel = channel
        self.policy = policy
        self.queue: deque[list[Any]] = deque()  # [alert, attempts]
        self.ready_at = 0.0  # monotonic; later than now while the head waits for a retry
        self.busy = False
        self.sent = self.failed = self.suppressed = self.dropped = 0
        self.tokens = float(policy.burst)
        self.refilled = _clock.monotonic()
        self.seen: dict[tuple[Any, ...], float] = {}

    def admit(self, alert: Alert, now: float) -> bool:
        """Apply the dedup window, then the token bucket; False means suppressed."""
        p = self.policy
        key = (alert.rule is None, alert.rule or alert.title, alert.kind, alert.level)
        last = self.seen.get(key)
        if p.dedup_seconds > 0 and last is not None and now - last < p.dedup_seconds:
            return False
        if p.rate > 0:
            self.tokens = min(float(p.burst), self.tokens + (now - self.refilled) * p.rate / 60.0)
            self.refilled = now
            if self.tokens < 1.0:
                return False
            self.tokens -= 1.0
        if p.dedup_seconds > 0:
            if len(self.seen) > 4096:  # bound memory under many distinct titles
                self.seen = {k: t for k, t in self.seen.items() if now - t < p.dedup_seconds}
            self.seen[key] = now
        return True


class Dispatcher:
    """Delivers alerts to channels from one background thread; never blocks, never raises."""

    def __init__(
        self,
        channels: Iterable[Channel],
        policy: Policy | None = None,
        *,
        on_warning: Callable[[str], object] | None = None,
    ) -> None:
        base = policy or Policy()
        self._lanes: dict[str, _Lane] = {}
        for ch in channels:
            if ch.name in self._lanes:
                raise ValueError(f"alert channel {ch.name!r} is defined twice")
            self._lanes[ch.name] = _Lane(ch, ch.policy or base)
        self._on_warning = on_warning
        self._warned: set[tuple[str, str]] = set()
        self._reset()

    @classmethod
    def from_config(
        cls,
        cfg: AlertConfig | Mapping[str, Any] | None = None,
        *,
        on_warning: Callable[[str], object] | None = None,
    ) -> Dispatcher:
        """Build the channels of `cfg` (parsed with `load_config` if needed)."""
        cfg = load_config(cfg)
        return cls([build_channel(c) for c in cfg.channels], cfg.policy, on_warning=on_warning)

    @property
    def channel_names(self) -> tuple[str, ...]:
        """Names a rule or `submit` may route to."""
        return tuple(self._lanes)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        self._rr = 0

    def _warn_once(self, channel: str, cause: str, message: str) -> None:
        if (channel, cause) in self._warned:
            return
        self._warned.add((channel, cause))
        if self._on_warning is not None:
            try:
                self._on_warning(message)
                return
            except Exception:  # a broken callback must not stop delivery; fall back to logging
                pass
        _log.warning("%s", message)

    def submit(self, alert: Alert, channels: Iterable[str] | None = None) -> None:
        """Queue `alert` for every channel (or those named) at or above its min_level."""
        try:
            self._submit(alert, channels)
        except Exception as exc:  # the training thread must never see a delivery problem
            self._warn_once("*", f"submit {type(exc).__name__}", f"alert not queued: {exc!r}")

    def _submit(self, alert: Alert, channels: Iterable[str] | None) -> None:
        if os.getpid() != self._pid:
            # forked (a DataLoader worker): the parent's lock, queue and thread are not ours
            for old in self._lanes.values():
                old.queue.clear()
                old.busy = False
                old.channel.forget()
            self._reset()
        if not isinstance(alert, Alert):
            raise TypeError(f"submit() takes an Alert, got {type(alert).__name__}")
        if isinstance(channels, str):
            channels = (channels,)
        names = list(self._lanes) if channels is None else list(dict.fromkeys(channels))
        unknown = [n for n in names if n not in self._lanes]
        rank = _RANK.get(alert.level, 1)
        full: list[str] = []
        now = _clock.monotonic()
        with self._cond:
            for name in names:
                lane = self._lanes.get(name)
                if lane is None or rank < _RANK.get(lane.channel.min_level, 0):
                    continue
                waiting = len(lane.queue) - (1 if lane.busy else 0)  # the head may be in flight
                if self._closed or waiting >= lane.policy.max_queue:
                    lane.dropped += 1
                    full.append(name)
                elif not lane.admit(alert, now):
                    lane.suppressed += 1
                else:
                    lane.queue.append([alert, 0])
                    self._start()
            self._cond.notify_all()
        for name in unknown:
            self._warn_once(name, "unknown", f"alert for unknown channel {name!r} not delivered")
        for name in full:
            why = "the dispatcher is closed" if self._closed else "its queue is full"
            self._warn_once(name, "dropped", f"alert channel {name!r}: alert dropped, {why}")

    def _start(self) -> None:
        if self._thread is not None:
            return
        thread = threading.Thread(target=self._run, name="expr-alerts", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start new thread: count everything queued as dropped
            for lane in self._lanes.values():
                lane.dropped += len(lane.queue)
                lane.queue.clear()
            raise
        self._thread = thread

    def _next(self) -> _Lane | None:
        lanes = list(self._lanes.values())
        now = _clock.monotonic()
        for i in range(len(lanes)):  # round robin, so one busy channel cannot starve the rest
            lane = lanes[(self._rr + i) % len(lanes)]
            if lane.queue and lane.ready_at <= now:
                self._rr = (self._rr + i + 1) % len(lanes)
                return lane
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                lane = None if self._closed else self._next()
                while lane is None:
                    if self._closed:
                        for ch in self._lanes.values():
                            ch.channel.close()
                        return
                    waits = [ln.ready_at for ln in self._lanes.values() if ln.queue]
                    self._cond.wait(max(min(waits) - _clock.monotonic(), 0.001) if waits else None)
                    lane = None if self._closed else self._next()
                lane.busy = True
                item = lane.queue[0]
            self._attempt(lane, item)

    def _attempt(self, lane: _Lane, item: list[Any]) -> None:
        item[1] += 1
        error: DeliveryError | None = None
        try:
            lane.channel.send(item[0], lane.policy.timeout)
        except DeliveryError as exc:
            error = exc
        except Exception as exc:  # a channel bug is a failure of that alert, not of the thread
            error = DeliveryError(type(exc).__name__, retryable=False)
        p = lane.policy
        give_up = error is not None and not (error.retryable and item[1] <= p.retries)
        if error is not None and give_up:
            # warned before the counters change, so whoever sees them in stats() after a
            # flush() also sees the warning
            detail = f" ({error.detail})" if error.detail else ""
            self._warn_once(
                lane.channel.name,
                error.cause,
                f"alert channel {lane.channel.name!r} ({lane.channel.describe()}): {error.cause}"
                f"{detail}; gave up after {item[1]} attempt(s); further failures with this "
                "cause are only counted",
            )
        with self._cond:
            lane.busy = False
            if error is None:
                lane.sent += 1
                lane.queue.popleft()
            elif give_up:
                lane.failed += 1
                lane.queue.popleft()
            elif self._closed:
                lane.dropped += 1  # closed while it waited for a retry
                lane.queue.popleft()
            else:
                delay = error.retry_after
                if delay is None:
                    delay = min(p.backoff * 2 ** (item[1] - 1), MAX_BACKOFF)
                lane.ready_at = _clock.monotonic() + delay
            self._cond.notify_all()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per channel: sent, failed, suppressed, pending (queued or in flight), dropped."""
        with self._cond:
            return {
                name: {"sent": ln.sent, "failed": ln.failed, "suppressed": ln.suppressed,
                       "pending": len(ln.queue), "dropped": ln.dropped}
                for name, ln in self._lanes.items()
            }

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every queue to drain; True if it did."""
        deadline = _clock.monotonic() + max(timeout, 0.0)
        with self._cond:
            while any(ln.queue for ln in self._lanes.values()):
                remaining = deadline - _clock.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Flush for up to `timeout` s, then stop the thread; what is left is counted dropped."""
        deadline = _clock.monotonic() + max(timeout, 0.0)
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            for lane in self._lanes.values():
                lane.channel.close()
        else:
            thread.join(max(deadline - _clock.monotonic(), 0.05))
        left = 0
        with self._cond:
            for lane in self._lanes.values():
                # an alert still in flight stays pending; it is counted when its attempt ends
                keep = 1 if lane.busy and lane.queue else 0
                while len(lane.queue) > keep:
                    lane.queue.pop()
                    lane.dropped += 1
                    left += 1
        if left:
            self._warn_once("*", "close", f"{left} alert(s) not delivered before close; dropped")
        return drained
