"""The pipeline every record goes through: shard -> rules -> alerts -> backends (DESIGN 7).

Direct mode runs it inside the training process; `exprd` and `expr replay` run it
on spool events. It holds no process-specific state beyond what it is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from expr_tracker.store import records
from expr_tracker.store.layout import alerts_name
from expr_tracker.store.shard import ShardWriter

if TYPE_CHECKING:
    from expr_tracker.alerts import Alert, Dispatcher
    from expr_tracker.alerts.rules import Firing, RuleSet
    from expr_tracker.backends.worker import BackendWorker


class Pipeline:
    """Applies records of one shard: writes them, evaluates rules, delivers, forwards."""

    def __init__(
        self,
        writer: ShardWriter,
        context: Mapping[str, Any],
        *,
        rules: RuleSet | None = None,
        dispatcher: Dispatcher | None = None,
        backends: Sequence[BackendWorker] = (),
        alerting: bool = True,
        reporting: bool = True,
        warn: Callable[[str, str], None] | None = None,
    ) -> None:
        self.writer = writer
        self.context = dict(context)
        self._warn = warn or (lambda cause, msg: None)
        self.dispatcher = dispatcher
        self.backends = list(backends) if reporting else []
        self.alerting = alerting
        self.reporting = reporting
        self.rules = rules
        self.alerts_path = writer.paths.run_dir / alerts_name(int(self.context.get("rank", 0)))
        self.alert_counts = {"fired": 0, "delivered": 0, "suppressed_rank": 0}
        # direct mode: hands an alert line to the shard's writer thread (False: its queue
        # is full); else the line is written here
        self.append_alert: Callable[[str, bytes], bool] | None = None

    def apply(
        self, record: dict[str, Any], nonfinite: bool | None = None, line: bytes | None = None
    ) -> None:
        """Write one record to the shard, then rules, alerts and backends.

        `line` is the record already encoded (exprd copies spool lines verbatim).
        """
        self.writer.append(records.dumps(record, nonfinite) if line is None else line)
        self.after_write(record)

    def after_write(self, record: dict[str, Any]) -> None:
        """Rules, alerts and backends for a record already queued for its shard."""
        observe = self._observe
        if observe is not None:
            try:
                firings = observe(record, record.get("_step"), record.get("_time") or time.time())
            except Exception as exc:  # a rule engine bug must never reach the training loop
                self._warn(f"rules:{type(exc).__name__}", f"expr_tracker: rule evaluation failed: {exc!r}")
                firings = []
            for firing in firings:
                self.fire(firing)
        for backend in self.backends:
            backend.submit(record)

    @property
    def rules(self) -> RuleSet | None:
        """The shard's rules; setting them again after adding or removing a rule updates the hot path."""
        return self._rules

    @rules.setter
    def rules(self, value: RuleSet | None) -> None:
        self._rules = value
        self._observe = value.observe if value is not None and len(value) else None

    def tick(self, now: float | None = None) -> None:
        """Evaluate time rules (no_data, age, elapsed) without a new record."""
        if self.rules is not None and self.rules.has_time_rules:
            for firing in self.rules.tick(time.time() if now is None else now):
                self.fire(firing)

    def fire(self, firing: Firing) -> None:
        """Record a rule firing in the alerts file and deliver it from the alerting rank."""
        from expr_tracker.alerts import make_alert

        rule = next((r for r in self.rules.rules if r.name == firing.rule), None) if self.rules else None
        alert = make_alert(
            title=firing.message if firing.kind == "fire" else f"recovered: {firing.message}",
            text=firing.condition,
            level=firing.level if firing.kind == "fire" else "info",
            rule=firing.rule,
            kind=firing.kind,
            step=firing.step,
            time=firing.time,
            **self._alert_identity(),
        )
        self.deliver(alert, channels=rule.channels if rule is not None else None)

    def _alert_identity(self) -> dict[str, Any]:
        c = self.context
        return {
            "project": c.get("project", ""),
            "run": c.get("name", ""),
            "stream": c.get("stream"),
            "rank": int(c.get("rank", 0)),
        }

    def manual_alert(self, title: str, text: str, level: str) -> Alert:
        """`et.alert(...)`: validated at the call, then recorded and delivered like a rule's."""
        from expr_tracker.alerts import make_alert

        alert = make_alert(title=title, text=text, level=level, rule=None, kind="manual",
                           step=None, time=time.time(), **self._alert_identity())
        self.deliver(alert)
        return alert

    def deliver(self, alert: Alert, channels: Sequence[str] | None = None) -> None:
        """Append the alert to `alerts[.rankN].jsonl`; only the alerting rank delivers it."""
        self.alert_counts["fired"] += 1
        outcome: dict[str, str] = {}
        if self.alerting and self.dispatcher is not None:
            outcome = self.dispatcher.submit(alert, channels)
        delivered = any(v == "queued" for v in outcome.values())
        if delivered:
            self.alert_counts["delivered"] += 1
        elif not self.alerting:
            self.alert_counts["suppressed_rank"] += 1
        else:
            self.alert_counts["suppressed"] = self.alert_counts.get("suppressed", 0) + 1
        if self.alerting:
            for backend in self.backends:
                backend.alert(alert.as_dict())
        entry = {**alert.as_dict(), "delivered": delivered}
        if not self.alerting:
            entry["suppressed"] = "rank"  # another rank delivers this run's alerts
        elif outcome and not delivered:
            entry["suppressed"] = ",".join(sorted(set(outcome.values())))
        line = orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
        if self.append_alert is not None:
            if not self.append_alert(self.alerts_path.name, line):
                self._warn("alerts_file", f"expr_tracker: cannot write {self.alerts_path}: "
                           "its writer is behind (a hung run root?); alert lines are dropped")
            return
        try:
            # opened like the shard: no symlink followed, below exprd's allowed root
            fd = self.writer.open_file(self.alerts_path.name,
                                       os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            self._warn("alerts_file", f"expr_tracker: cannot write {self.alerts_path}: {exc}")

    def flush(self) -> bool:
        """Flush the shard buffer."""
        return self.writer.flush()

    def close(self, status: str = "finished", timeout: float = 5.0) -> None:
        """Final flush, sidecar, then drain alert delivery and backends within `timeout`."""
        self.writer.close(status)
        self.drain(timeout, status)

    def drain(self, timeout: float, status: str = "finished") -> None:
        """Drain alert delivery and backends within `timeout`; backends are told `status`."""
        deadline = time.monotonic() + timeout
        if self.dispatcher is not None:
            # its own short bound (policy exit_timeout, 5 s): a hanging webhook must not
            # hold finish(); what is left is counted as undelivered
            self.dispatcher.close()
        for backend in self.backends:
            backend.close(max(0.1, deadline - time.monotonic()), status)
