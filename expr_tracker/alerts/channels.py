"""Alert channels: where an alert goes (log, webhook, Slack, command) and `build_channel`.

A channel's `send` returns on success or raises `DeliveryError`; the `Dispatcher` in
`expr_tracker.alerts` decides about retries from its `retryable` and `retry_after`.
Retryable are connection errors, timeouts, HTTP 408/429/5xx (honouring Retry-After,
capped at 300 s) and failed commands; any other HTTP status fails at once.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import threading
import time as _clock
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import orjson

from expr_tracker.alerts.alert import Alert, format_line, one_line, redact_url
from expr_tracker.alerts.config import LEVELS, ChannelConfig, Policy, _check_url
from expr_tracker.errors import TrackerError

MAX_RETRY_AFTER = 300.0

_log = logging.getLogger("expr_tracker.alerts")
_LEVELNO = dict(zip(LEVELS, (10, 20, 30, 40, 50), strict=True))
_SLACK_STYLE = {
    "debug": (":mag:", "#9e9e9e"),
    "info": (":information_source:", "#2196f3"),
    "warning": (":warning:", "#ff9800"),
    "error": (":x:", "#e53935"),
    "critical": (":rotating_light:", "#8e0000"),
}


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

    def abort(self) -> None:
        """Stop an attempt in flight now (thread-safe): the dispatcher closes at its
        deadline and leaves the attempt behind; what it started must not outlive it."""

    def forget(self) -> None:
        """Drop (without closing) resources inherited over fork: they belong to the parent."""


class LogChannel(Channel):
    """One line per alert on sys.stderr, and a record on the `expr_tracker.alerts` logger."""

    type = "log"
    # False: no stderr copy when a handler takes the record (exprd, whose log is stderr)
    echo = True

    def send(self, alert: Alert, timeout: float) -> None:

        line = format_line(alert)
        # Without any handler configured, logging's last-resort handler would print the
        # record to stderr a second time; the line below is the stderr copy.
        handled = _log.hasHandlers()
        if handled:
            _log.log(_LEVELNO.get(alert.level, logging.INFO), "%s", line)
        stream = sys.stderr
        if stream is not None and (self.echo or not handled):
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


def _proxy_for(url: str) -> str | None:
    """The proxy `$https_proxy`/`$http_proxy` name for `url`, unless `$no_proxy` exempts it."""
    import urllib.request

    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.netloc):
        return None
    return proxy


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
            # and webhook URLs are secrets. So the proxy environment is read here.
            self._transport = httpx.HTTPTransport(proxy=_proxy_for(self._url))
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
    title = _slack_escape(one_line(alert.title))
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


class CallableChannel(Channel):
    """A Python function in this process, called with the alert as a dict (a notebook's
    or a test's channel, as in expr-tracker 0.4). What it raises is a failed delivery,
    counted by the dispatcher like any channel's (not retried), never raised into training."""

    type = "callable"

    def __init__(self, name: str, fn: Any, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.fn = fn

    def describe(self) -> str:
        return f"callable {getattr(self.fn, '__qualname__', type(self.fn).__name__)}"

    def send(self, alert: Alert, timeout: float) -> None:
        try:
            self.fn(alert.as_dict())
        except Exception as exc:
            # not retried: a function that raised once is likely to raise again
            raise DeliveryError(f"the function raised {type(exc).__name__}", retryable=False,
                                detail=str(exc)) from None


class CommandChannel(Channel):
    """Run argv (never via a shell) with the alert JSON on stdin; exit status 0 is success."""

    type = "command"

    def __init__(
        self, name: str, argv: Sequence[str], *, min_level: str = "debug",
        policy: Policy | None = None,
    ) -> None:
        super().__init__(name, min_level=min_level, policy=policy)
        self.argv = tuple(argv)
        # the process groups of attempts in flight, ended by abort() (the exit deadline)
        self._groups: set[int] = set()
        self._lock = threading.Lock()

    def describe(self) -> str:
        # arguments may carry tokens; the program name is enough to find the channel
        return f"{self.type} {os.path.basename(self.argv[0])}"

    def abort(self) -> None:
        """SIGKILL the process group of every attempt in flight (its children included).

        Under the lock, so a group that send() has just finished with is either still
        in the set (its leader just waited for; the id stays taken while any member of
        the group lives) or gone from it: never an id long free for reuse."""
        with self._lock:
            for pgid in self._groups:
                _kill_group(pgid)

    def send(self, alert: Alert, timeout: float) -> None:
        import subprocess

        body = orjson.dumps(alert.as_dict(), option=orjson.OPT_APPEND_NEWLINE)
        try:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True,  # its own group, killed whole
            )
        except OSError as exc:
            raise DeliveryError(f"cannot run: {exc.strerror}", retryable=False) from None
        with self._lock:
            self._groups.add(proc.pid)
        try:
            _, err = proc.communicate(body, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            for pipe in (proc.stdin, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
            raise DeliveryError(f"timed out after {timeout:g} s", retryable=True) from None
        finally:
            with self._lock:
                self._groups.discard(proc.pid)
        if proc.returncode != 0:
            lines = err.decode("utf-8", "replace").strip().splitlines()
            code = proc.returncode
            cause = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
            raise DeliveryError(cause, retryable=True, detail=lines[-1][:200] if lines else "")


def _kill_group(pgid: int) -> None:
    """SIGKILL process group `pgid` (a command's session); gone already is fine."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


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
    if cfg.type == "callable":
        return CallableChannel(cfg.name, cfg.fn, **common)
    if cfg.type == "command":
        if shutil.which(cfg.argv[0]) is None:
            raise ValueError(
                f"alert channel {cfg.name!r}: key 'argv': {cfg.argv[0]!r} is not an executable"
            )
        return CommandChannel(cfg.name, cfg.argv, **common)
    return LogChannel(cfg.name, **common)
