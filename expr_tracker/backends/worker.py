"""A background thread between a caller and a backend, so a slow or dead backend never stalls it.

`submit()` only appends to a bounded in-memory queue; a daemon thread opens the
backend, hands it batches in order and finishes it at `close()`. Every failure
is caught, logged once per cause, and counted (DESIGN 7): nothing raises into
the caller and nothing disappears uncounted.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from expr_tracker.backends.base import Backend, Counters, Identity, reportable

FINISH_GRACE = 5.0  # seconds close() waits for finish() after the drain deadline
MAX_ALERTS = 1000  # alerts queue beside records (they are rare and matter more)
_LOG, _ALERT = 0, 1


class BackendWorker:
    """Feeds one backend from a bounded queue on a daemon thread."""

    def __init__(
        self,
        backend: Backend,
        identity: Identity,
        *,
        max_queue: int = 10000,
        batch: int = 100,
        rank_metrics: bool = False,
    ) -> None:
        if max_queue < 1 or batch < 1:
            raise ValueError("max_queue and batch must be >= 1")
        self.backend = backend
        self.identity = identity
        self.max_queue = max_queue
        self.batch = batch
        self.rank_metrics = rank_metrics
        self._counters = Counters()
        self._cond = threading.Condition()
        self._items: deque[tuple[int, dict[str, Any]]] = deque()
        self._queued_logs = 0
        self._queued_alerts = 0
        self._inflight = 0
        self._closing = False
        self._deadline = math.inf
        self._status = "finished"
        self._thread: threading.Thread | None = None
        self.enabled = self._probe()
        if self.enabled:
            self._thread = threading.Thread(
                target=self._main,
                name=f"expr-{getattr(backend, 'name', 'backend')}-{identity.remote_id()}",
                daemon=True,
            )
            self._thread.start()

    def _probe(self) -> bool:
        """Ask the backend whether its package is installed, on the caller's thread.

        This is where a missing optional package warns (warnings.warn must not
        run on the worker thread).
        """
        available = getattr(self.backend, "available", None)
        if available is None:
            return True
        try:
            return bool(available())
        except Exception as exc:
            self._counters.error(
                f"{self._name}: availability check: {type(exc).__name__}", str(exc)
            )
            return False

    @property
    def _name(self) -> str:
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    def submit(self, record: Mapping[str, Any]) -> None:
        """Queue one record. Never blocks, never raises; a full queue counts it `dropped`."""
        try:
            row = reportable(record, self.rank_metrics)
        except Exception as exc:
            self._counters.error(
                f"{self._name}: unreadable record: {type(exc).__name__}", str(exc), records=1
            )
            return
        if row is None:
            self._counters.add("skipped")
            return
        cause = ""
        with self._cond:
            if not self.enabled:
                cause = f"{self._name}: backend disabled"
            elif self._closing:
                cause = f"{self._name}: record submitted after close"
            elif self._queued_logs >= self.max_queue:
                cause = f"{self._name}: queue full ({self.max_queue} records)"
            else:
                self._items.append((_LOG, row))
                self._queued_logs += 1
                if len(self._items) == 1:
                    # the thread only ever waits on an empty queue
                    self._cond.notify()
                return
        self._counters.error(cause, records=1, kind="dropped")

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Queue one alert, in order with the records. Never blocks, never raises."""
        cause = ""
        with self._cond:
            if not self.enabled or self._closing:
                cause = f"{self._name}: alert after close or while disabled"
            elif self._queued_alerts >= MAX_ALERTS:
                cause = f"{self._name}: alert queue full"
            else:
                self._items.append((_ALERT, dict(alert)))
                self._queued_alerts += 1
                if len(self._items) == 1:
                    self._cond.notify()
                return
        self._counters.error(cause, records=1, kind="alerts_dropped")

    def close(self, timeout: float = 10.0, status: str = "finished") -> dict[str, Any]:
        """Drain for at most `timeout` s, then finish the backend with `status`; return `stats()`.

        Records still queued at the deadline are counted `dropped`. A backend
        stuck in a call is interrupted if it can be (`interrupt()`), and left
        behind on its daemon thread if not.
        """
        with self._cond:
            if not self._closing:
                self._closing = True
                self._status = status
                self._deadline = time.monotonic() + max(timeout, 0.0)
                self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(max(timeout, 0.0))
            if thread.is_alive():
                interrupt = getattr(self.backend, "interrupt", None)
                if callable(interrupt):
                    try:
                        interrupt()
                    except Exception as exc:
                        self._counters.error(
                            f"{self._name}: interrupt: {type(exc).__name__}", str(exc)
                        )
                thread.join(FINISH_GRACE)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Counts in records (`sent`, `failed`, `dropped`, `pending`, `skipped`).

        Also `errors` (cause -> occurrences) and `alerts` (`sent`, `failed`, `dropped`).
        """
        values, errors = self._counters.snapshot()
        counters = getattr(self.backend, "counters", None)
        if isinstance(counters, Counters):
            # records the backend accepted but could not deliver are not "sent"
            bvalues, berrors = counters.snapshot()
            lost = bvalues.get("failed", 0) + bvalues.get("dropped", 0)
            values["sent"] = max(values["sent"] - lost, 0)
            values["failed"] += bvalues.get("failed", 0)
            values["dropped"] += bvalues.get("dropped", 0)
            for cause, n in berrors.items():
                errors[cause] = errors.get(cause, 0) + n
        with self._cond:
            pending = self._queued_logs + self._inflight
        return {
            "sent": values["sent"],
            "failed": values["failed"],
            "dropped": values["dropped"],
            "pending": pending,
            "skipped": values.get("skipped", 0),
            "errors": errors,
            "alerts": {
                "sent": values.get("alerts_sent", 0),
                "failed": values.get("alerts_failed", 0),
                "dropped": values.get("alerts_dropped", 0),
            },
        }

    def _take(self) -> tuple[int, list[dict[str, Any]]] | None:
        """Wait for work; return (kind, items), or None when closed and drained (or out of time)."""
        with self._cond:
            while not self._items and not self._closing:
                self._cond.wait()
            if not self._items:
                return None
            if time.monotonic() < self._deadline:
                kind, first = self._items.popleft()
                if kind == _ALERT:
                    self._queued_alerts -= 1
                    return _ALERT, [first]
                taken = [first]
                while self._items and len(taken) < self.batch and self._items[0][0] == _LOG:
                    taken.append(self._items.popleft()[1])
                self._queued_logs -= len(taken)
                self._inflight = len(taken)
                return _LOG, taken
            left, alerts = self._queued_logs, self._queued_alerts
            self._items.clear()
            self._queued_logs = self._queued_alerts = 0
        # past the close deadline: what is still queued is dropped, and counted
        if left:
            self._counters.error(
                f"{self._name}: close timeout",
                f"{left} records not delivered",
                records=left,
                kind="dropped",
            )
        if alerts:
            self._counters.add("alerts_dropped", alerts)
        return None

    def _main(self) -> None:
        """The worker thread: open, deliver in order until closed, finish."""
        name = self._name
        try:
            self.backend.open(self.identity)
            opened = True
        except Exception as exc:
            opened = False
            self._counters.error(f"{name}: open: {type(exc).__name__}", str(exc))
        while True:
            work = self._take()
            if work is None:
                break
            kind, items = work
            try:
                if kind == _ALERT:
                    if opened:
                        self.backend.alert(items[0])
                        self._counters.add("alerts_sent")
                    else:
                        self._counters.error(f"{name}: not open", records=1, kind="alerts_failed")
                elif opened:
                    self.backend.log(items)
                    self._counters.add("sent", len(items))
                else:
                    self._counters.error(f"{name}: not open", records=len(items))
            except Exception as exc:
                cause = f"{name}: {'alert' if kind == _ALERT else 'log'}: {type(exc).__name__}"
                if kind == _ALERT:
                    self._counters.error(cause, str(exc), records=1, kind="alerts_failed")
                else:
                    self._counters.error(cause, str(exc), records=len(items))
            finally:
                with self._cond:
                    self._inflight = 0
        if opened:
            try:
                self.backend.finish(self._status)
            except Exception as exc:
                self._counters.error(f"{name}: finish: {type(exc).__name__}", str(exc))
