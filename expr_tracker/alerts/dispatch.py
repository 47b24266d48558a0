"""The Dispatcher that delivers alerts to their channels (DESIGN 7).

An Alert (`expr_tracker.alerts.alert`) that must be delivered goes to a `Dispatcher`, which never blocks and never raises
into the caller: one background daemon thread per channel delivers with a token
bucket, a dedup window, a bounded queue and retries, so a channel that hangs (a
webhook that never answers) delays only itself. `close` waits at most
`exit_timeout` (policy, default 5 s); what is still pending then is counted as
undelivered. What is not delivered is counted in `stats()`; each failure cause is
logged once per channel on the `expr_tracker.alerts` logger (never `warnings.warn`:
it runs off-thread).

Configuration (`load_config`, `AlertConfig`, `ChannelConfig`, `Policy`) is parsed in
`expr_tracker.alerts.config`, whose docstring describes the file format; the channels
(`build_channel`, `DeliveryError`, `WebhookChannel`, ...) live in `expr_tracker.alerts.channels`.

Secrets (webhook URLs, HMAC keys) come only from the environment or the config
file: a literal `secret` is refused in the `alert=` dict, which travels in the
spool. They never appear in a log line or exception message (URLs are shown as
`scheme://host/…`) nor in `Alert.as_dict()`. `url_env`/`secret_env` are read when
the channels are built (`Dispatcher.from_config`), so a spool-mode SDK can check a
config whose variables only the daemon has.
"""

from __future__ import annotations

import logging
import os
import threading
import time as _clock
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from expr_tracker.alerts.alert import Alert
from expr_tracker.alerts.channels import Channel, DeliveryError, build_channel
from expr_tracker.alerts.config import _RANK, AlertConfig, Policy, load_config

MAX_BACKOFF = 30.0
# a health incident's alerts carry `event_id` "health:<incident id>:<open|resolved>": its
# pages are deduplicated per incident of one run, never across runs (DESIGN 13 Delivery)
HEALTH_EVENT = "health:"

_log = logging.getLogger("expr_tracker.alerts")

# -- dispatcher ----------------------------------------------------------------------------


class _Lane:
    """One channel's queue, counters and limiter state; guarded by the dispatcher's lock."""

    def __init__(self, channel: Channel, policy: Policy) -> None:
        self.channel = channel
        self.policy = policy
        self.queue: deque[list[Any]] = deque()  # [alert, attempts, _Outcome | None]
        self.ready_at = 0.0  # monotonic; later than now while the head waits for a retry
        self.busy = False
        self.thread: threading.Thread | None = None  # this channel's delivery worker
        self.abandoned = False  # closed while an attempt hung: it was counted undelivered
        self.sent = self.failed = self.suppressed = self.dropped = self.undelivered = 0
        self.tokens = float(policy.burst)
        self.refilled = _clock.monotonic()
        self.seen: dict[tuple[Any, ...], float] = {}

    def admit(self, alert: Alert, now: float) -> bool:
        """Apply the dedup window, then the token bucket; False means suppressed."""
        p = self.policy
        # per run: two runs' alerts of one rule never suppress each other
        incident = alert.event_id if (alert.event_id or "").startswith(HEALTH_EVENT) else None
        key = (alert.project, alert.run, alert.stream, alert.rule is None,
               alert.rule or alert.title, alert.kind, alert.level, incident)
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


class _Outcome:
    """Whether an alert queued on several channels reached one: `done(True)` once one
    channel sent it, `done(False)` once every one gave up (failed, dropped, closed)."""

    def __init__(self, channels: int, done: Callable[[bool], object]) -> None:
        self.left = channels
        self.ok = False
        self.done = done

    def end(self, ok: bool) -> None:
        """One channel's attempts ended (called under the dispatcher's lock)."""
        self.ok = self.ok or ok
        self.left -= 1
        if self.left == 0:
            try:
                self.done(self.ok)
            except Exception as exc:  # the caller's bug must not stop the worker
                _log.warning("alert outcome callback failed: %r", exc)


def _end(item: list[Any], ok: bool) -> None:
    if item[2] is not None:
        item[2].end(ok)


class Dispatcher:
    """Delivers alerts to channels, one background thread each; never blocks, never raises."""

    def __init__(
        self,
        channels: Iterable[Channel],
        policy: Policy | None = None,
        *,
        on_warning: Callable[[str], object] | None = None,
    ) -> None:
        base = policy or Policy()
        self.exit_timeout = base.exit_timeout
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
    def channels(self) -> tuple[Channel, ...]:
        """The channels, in the order of the config."""
        return tuple(lane.channel for lane in self._lanes.values())

    @property
    def channel_names(self) -> tuple[str, ...]:
        """Names a rule or `submit` may route to."""
        return tuple(self._lanes)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

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

    def submit(self, alert: Alert, channels: Iterable[str] | None = None, *,
               on_done: Callable[[bool], object] | None = None) -> dict[str, str]:
        """Queue `alert` for every channel (or those named) at or above its min_level.

        Returns what happened per channel name, decided now: "queued", "suppressed",
        "dropped", "below_min_level" or "unknown" (what an alerts.jsonl line can record).
        `on_done(delivered)`, when some channel queued it, is called once on a worker
        thread when the outcome is known: True once one channel sent it, False once every
        channel that queued it gave up (or `close` counted it undelivered).
        """
        try:
            return self._submit(alert, channels, on_done)
        except Exception as exc:  # the training thread must never see a delivery problem
            self._warn_once("*", f"submit {type(exc).__name__}", f"alert not queued: {exc!r}")
            return {}

    def _submit(self, alert: Alert, channels: Iterable[str] | None,
                on_done: Callable[[bool], object] | None = None) -> dict[str, str]:
        if os.getpid() != self._pid:
            # forked (a DataLoader worker): the parent's lock, queue and thread are not ours
            for old in self._lanes.values():
                old.queue.clear()
                old.busy = False
                old.thread = None
                old.channel.forget()
            self._reset()
        if not isinstance(alert, Alert):
            raise TypeError(f"submit() takes an Alert, got {type(alert).__name__}")
        if isinstance(channels, str):
            channels = (channels,)
        names = list(self._lanes) if channels is None else list(dict.fromkeys(channels))
        rank = _RANK.get(alert.level, 1)
        outcome: dict[str, str] = {}
        now = _clock.monotonic()
        queued: list[list[Any]] = []
        with self._cond:
            for name in names:
                lane = self._lanes.get(name)
                if lane is None:
                    outcome[name] = "unknown"
                    continue
                if rank < _RANK.get(lane.channel.min_level, 0):
                    outcome[name] = "below_min_level"
                    continue
                waiting = len(lane.queue) - (1 if lane.busy else 0)  # the head may be in flight
                if self._closed or waiting >= lane.policy.max_queue:
                    lane.dropped += 1
                    outcome[name] = "dropped"
                elif not lane.admit(alert, now):
                    lane.suppressed += 1
                    outcome[name] = "suppressed"
                else:
                    item = [alert, 0, None]
                    lane.queue.append(item)
                    queued.append(item)
                    outcome[name] = "queued"
                    self._start(lane)
            if on_done is not None and queued:
                tracker = _Outcome(len(queued), on_done)
                for item in queued:
                    item[2] = tracker
            self._cond.notify_all()
        for name, what in outcome.items():
            if what == "unknown":
                self._warn_once(name, what, f"alert for unknown channel {name!r} not delivered")
            elif what == "dropped":
                why = "the dispatcher is closed" if self._closed else "its queue is full"
                self._warn_once(name, what, f"alert channel {name!r}: alert dropped, {why}")
        return outcome

    def _start(self, lane: _Lane) -> None:
        if lane.thread is not None:
            return
        thread = threading.Thread(target=self._run, args=(lane,), daemon=True,
                                  name=f"expr-alerts-{lane.channel.name}")
        try:
            thread.start()
        except RuntimeError:  # cannot start new thread: count what is queued as dropped
            lane.dropped += len(lane.queue)
            for item in lane.queue:
                _end(item, False)
            lane.queue.clear()
            raise
        lane.thread = thread

    def _run(self, lane: _Lane) -> None:
        """One channel's worker: deliver its queue head when due, until closed."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        if not lane.busy:
                            lane.channel.close()
                        return
                    now = _clock.monotonic()
                    if lane.queue and lane.ready_at <= now:
                        break
                    self._cond.wait(max(lane.ready_at - now, 0.001) if lane.queue else None)
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
            if lane.abandoned:
                return  # close() counted it as undelivered and moved on
            if error is None:
                lane.sent += 1
                _end(lane.queue.popleft(), True)
            elif give_up:
                lane.failed += 1
                _end(lane.queue.popleft(), False)
            elif self._closed:
                lane.dropped += 1  # closed while it waited for a retry
                _end(lane.queue.popleft(), False)
            else:
                delay = error.retry_after
                if delay is None:
                    delay = min(p.backoff * 2 ** (item[1] - 1), MAX_BACKOFF)
                lane.ready_at = _clock.monotonic() + delay
            self._cond.notify_all()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per channel: sent, failed, suppressed, pending (queued or in flight), dropped,
        undelivered (still pending when `close` gave up)."""
        with self._cond:
            return {
                name: {"sent": ln.sent, "failed": ln.failed, "suppressed": ln.suppressed,
                       "pending": len(ln.queue), "dropped": ln.dropped,
                       "undelivered": ln.undelivered}
                for name, ln in self._lanes.items()
            }

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every queue to drain; True if it did."""
        deadline = _clock.monotonic() + max(timeout, 0.0)
        with self._cond:
            while any(ln.queue for ln in self._lanes.values()):
                remaining = deadline - _clock.monotonic()
                live = [ln for ln in self._lanes.values()
                        if ln.queue and ln.thread is not None and ln.thread.is_alive()]
                if remaining <= 0 or not live:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Deliver for up to `timeout` s (default: the policy's `exit_timeout`), then stop.

        What is still queued or in flight then is counted as undelivered (a worker stuck
        in a hanging request is left behind: it is a daemon thread and its result is
        ignored). Returns True if everything was delivered.
        """
        timeout = self.exit_timeout if timeout is None else timeout
        drained = self.flush(timeout)
        left = 0
        hung: list[_Lane] = []
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            for lane in self._lanes.values():
                n = len(lane.queue)
                if not n:
                    continue
                lane.undelivered += n
                left += n
                for item in lane.queue:
                    _end(item, False)
                lane.queue.clear()
                if lane.busy:
                    lane.abandoned = True
                    hung.append(lane)
            for lane in self._lanes.values():
                if lane.thread is None:
                    lane.channel.close()
        for lane in hung:
            # the attempt left behind must not outlive the run: a command's process group
            # is killed now (a hanging webhook request ends with the daemon thread)
            try:
                lane.channel.abort()
            except Exception as exc:  # a channel bug must not reach finish()
                self._warn_once(lane.channel.name, "abort", f"alert channel "
                                f"{lane.channel.name!r}: abort failed: {type(exc).__name__}")
        if left:
            self._warn_once("*", "close", f"{left} alert(s) not delivered within {timeout:g} s "
                                          "of closing; counted as undelivered")
        return drained
