"""The trackio backend: one trackio run per (name, stream, rank), grouped by run name.

trackio keeps its "current run" in a ContextVar and `trackio.init` finishes
whatever run is current. We call `init` inside a fresh, empty
`contextvars.Context`, so it neither finishes another open identity nor
replaces the caller's current run, and then use only the returned Run object:
several identities can be open in one process (the daemon forwards many runs).

trackio reads `TRACKIO_DIR` once, when it is first imported, so the local
SQLite directory is per process; `Identity.dir` does not apply here.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from expr_tracker.backends.base import Counters, Identity, reportable, require, user_row

_LEVELS = {
    "debug": "INFO",
    "info": "INFO",
    "warning": "WARN",
    "warn": "WARN",
    "error": "ERROR",
    "critical": "ERROR",
}


class TrackioBackend:
    """Forwards records to a trackio run (local SQLite under `TRACKIO_DIR`, or a Space)."""

    name = "trackio"

    def __init__(self, *, project: str | None = None) -> None:
        self.project = project
        self.counters = Counters()
        self._run: Any = None
        self._levels: Any = None

    def available(self) -> bool:
        """True if trackio is installed; else one RuntimeWarning with the install command."""
        return require("trackio", "trackio")

    def open(self, identity: Identity) -> None:
        """Start or resume the trackio run `identity.remote_id()`; a no-op without trackio."""
        if not self.available():
            return
        trackio: Any = importlib.import_module("trackio")
        self._levels = importlib.import_module("trackio.alerts").AlertLevel
        kwargs: dict[str, Any] = {
            "project": self.project or identity.project,
            "name": identity.remote_id(),
            "group": identity.group(),
            "resume": "allow",
            "config": dict(identity.config),
            # never launch a dashboard or sample this process's hardware: we forward
            # the records of a run, which may live in another process (the daemon)
            "embed": False,
            "auto_log_gpu": False,
            "auto_log_cpu": False,
        }
        accepted = inspect.signature(trackio.init).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        self._run = contextvars.Context().run(trackio.init, **kwargs)

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Log each record's metrics at its `_step`."""
        run = self._run
        if run is None:
            return
        for event in events:
            record = reportable(event, True)
            if record is None:
                continue
            row = user_row(record)
            step = record.get("_step")
            if row:
                run.log(row, step=step if isinstance(step, int) else None)

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Record a trackio alert (stored in its database, shown on the dashboard)."""
        run = self._run
        if run is None or not hasattr(run, "alert"):
            return
        level = getattr(
            self._levels, _LEVELS.get(str(alert.get("level", "warning")).lower(), "WARN")
        )
        step = alert.get("step", alert.get("_step"))
        run.alert(
            title=str(alert.get("title") or alert.get("rule") or "alert"),
            text=str(alert.get("text") or ""),
            level=level,
            step=step if isinstance(step, int) else None,
        )

    def finish(self, status: str) -> None:
        """Flush and finish the trackio run (trackio has no exit status)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()
