"""Lightning: `ExprTrackerLogger`, a Lightning `Logger` that writes on every rank.

    from expr_tracker.integrations.lightning import ExprTrackerLogger
    trainer = Trainer(logger=ExprTrackerLogger("proj", "sft-1"), ...)

Works with the `lightning` package (`lightning.pytorch`) and, where only that is
installed, with `pytorch_lightning`. Lightning's own loggers write from rank 0 only; this
one calls `init` on every rank, so each writes its own shard. `log_hyperparams` lands in
the sidecar's config; a fit that fails finishes the shard as `crashed`, with the
exception's type and message as its exit.
"""

from __future__ import annotations

import importlib
import sys
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from expr_tracker.integrations._session import Session


def _logger_base() -> Any:
    try:
        return importlib.import_module("lightning.pytorch.loggers.logger").Logger
    except ImportError:  # only the standalone package is installed
        return importlib.import_module("pytorch_lightning.loggers.logger").Logger


Logger: Any = _logger_base()
# Lightning's finalize(status) -> the sidecar's status
_STATUS = {"success": "finished", "finished": "finished", "failed": "crashed"}


class _LazyRun:
    """`logger.experiment`: the `expr_tracker.Run`, started on the first attribute used.

    Lightning touches `experiment` before it hands over the hyperparameters; starting the
    run only when something is asked of it keeps them in the run's first config.
    """

    def __init__(self, session: Session) -> None:
        self._session = session

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._session.ensure(), attr)

    def __repr__(self) -> str:
        return f"<expr_tracker run {self._session.project}/{self._session.name or '?'} (lazy)>"


class ExprTrackerLogger(Logger):
    """A Lightning logger over `expr_tracker.init/log/finish`; `init_kwargs` go to `init`."""

    def __init__(self, project: str, name: str | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.session = Session(project, name, init_kwargs, step_key="trainer/global_step")
        self._experiment = _LazyRun(self.session)

    @property
    def name(self) -> str:
        """The project (Lightning puts checkpoints under `{root}/{name}/{version}`)."""
        return self.session.project

    @property
    def version(self) -> str:
        """The run name (without `name=` the SDK's default, which starts the run)."""
        if self.session.name is None:
            self.session.ensure()
        assert self.session.name is not None
        return self.session.name

    @property
    def save_dir(self) -> None:
        """None: checkpoints go under the trainer's `default_root_dir`."""
        return None

    @property
    def experiment(self) -> Any:
        """This process's `expr_tracker.Run` (started on first use)."""
        return self._experiment

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Merge into the run's config (a run already writing records it in its sidecar)."""
        if isinstance(params, Namespace):
            params = vars(params)
        if not isinstance(params, Mapping):
            raise TypeError(f"hyperparameters must be a dict or Namespace, got {type(params).__name__}")
        self.session.update_config(params)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log the numbers in `metrics` at Lightning's `step` (one row per step)."""
        self.session.log(metrics, step=step)

    def save(self) -> None:
        """Write what is buffered now."""
        if self.session.started and self.session.run is not None:
            self.session.run.flush()

    def finalize(self, status: str) -> None:
        """End of fit/validate/test: "success" finishes the shard, "failed" marks it crashed.

        Lightning calls `finalize("failed")` from inside its `except` block, so the
        exception being handled is the one that ended the fit: it becomes the exit.
        """
        exc = sys.exc_info()[1] if status == "failed" else None
        if exc is not None:
            self.session.fail(exc)
        else:
            self.session.finish(_STATUS.get(status, "finished"))
