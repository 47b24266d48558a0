"""The Weights & Biases backend: one wandb run per (name, stream, rank), grouped by run name.

wandb is imported at `open()`, never before. Several identities can be open in
one process (the daemon forwards many runs): each `wandb.init` uses
`reinit="create_new"` and we only ever talk to the returned Run object.
"""

from __future__ import annotations

import importlib
import os
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
_TITLE_MAX = 63  # wandb rejects alert titles of 64 characters or more


class WandbBackend:
    """Forwards records to a wandb run (`WANDB_MODE`, `WANDB_API_KEY` etc. apply as usual)."""

    name = "wandb"

    def __init__(
        self, *, entity: str | None = None, project: str | None = None, mode: str | None = None
    ) -> None:
        self.entity = entity
        self.project = project
        self.mode = mode
        self.counters = Counters()
        self._wandb: Any = None
        self._run: Any = None
        self._last_step: int | None = None

    def available(self) -> bool:
        """True if wandb is installed; else one RuntimeWarning with the install command."""
        return require("wandb", "wandb")

    def open(self, identity: Identity) -> None:
        """Start or resume the wandb run `identity.remote_id()`; a no-op without wandb."""
        if not self.available():
            return
        wandb: Any = importlib.import_module("wandb")
        root = identity.dir or os.environ.get("WANDB_DIR") or None
        if root:
            # wandb falls back to a temp dir (with a warning) when `dir` does not exist
            os.makedirs(root, exist_ok=True)
        rid = identity.remote_id()
        self._wandb = wandb
        self._run = wandb.init(
            entity=self.entity,
            project=self.project or identity.project,
            id=rid,
            name=rid,
            group=identity.group(),
            job_type=identity.stream or "metrics",
            config=dict(identity.config),
            resume="allow",
            dir=root,
            mode=self.mode,
            reinit="create_new",
            # console capture would copy the process's stdout into every open run
            settings=wandb.Settings(console="off"),
        )

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Log each record at its `_step`. Rows behind the last step are counted `dropped`.

        wandb merges rows of the current step and silently ignores earlier steps,
        so those are counted here instead of being handed over.
        """
        run = self._run
        if run is None:
            return
        for event in events:
            record = reportable(event, True)
            if record is None:
                continue
            step = record.get("_step")
            if not isinstance(step, int) or isinstance(step, bool):
                self.counters.error(
                    "wandb: record without an integer _step", records=1, kind="dropped"
                )
                continue
            if self._last_step is not None and step < self._last_step:
                self.counters.error(
                    "wandb: step went backwards",
                    f"step {step} after {self._last_step}; wandb keeps only increasing steps",
                    records=1,
                    kind="dropped",
                )
                continue
            row = user_row(record)
            if row:
                run.log(row, step=step)
            self._last_step = step

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Send a wandb alert; unsupported alerts (e.g. offline) are counted, not raised."""
        run = self._run
        if run is None:
            return
        level_name = _LEVELS.get(str(alert.get("level", "warning")).lower(), "WARN")
        title = str(alert.get("title") or alert.get("rule") or "alert")[:_TITLE_MAX]
        try:
            run.alert(
                title=title,
                text=str(alert.get("text") or ""),
                level=getattr(self._wandb.AlertLevel, level_name),
            )
        except Exception as exc:
            self.counters.error(f"wandb alert: {type(exc).__name__}", str(exc))

    def finish(self, status: str) -> None:
        """Finish the run with exit code 0 for `finished`, else 1."""
        run, self._run = self._run, None
        if run is not None:
            run.finish(exit_code=0 if status == "finished" else 1)
