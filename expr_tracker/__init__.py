"""expr-tracker: experiment tracking for distributed training.

    import expr_tracker as et
    run = et.init("my-project", "sft-1", config={"lr": 3e-4})
    et.log({"loss": 0.31, "lr": 1e-4})
    et.finish()

Every rank writes its own shard; nothing here ever raises into the training loop
after `init` except for misuse at the call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import MethodType as _MethodType
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any

from expr_tracker import _state
from expr_tracker.errors import RuleError, RunNotFoundError, TrackerError, UsageError
from expr_tracker.run import Run
from expr_tracker.spans import span, start_span

__version__ = "0.1.0"

__all__ = [
    "RuleError",
    "Run",
    "RunNotFoundError",
    "TrackerError",
    "UsageError",
    "__version__",
    "add_alert_rule",
    "alert",
    "finish",
    "flush",
    "get_run",
    "history",
    "info",
    "init",
    "log",
    "log_rank_metrics",
    "read_run",
    "remove_alert_rule",
    "span",
    "start_span",
    "summary",
    "update_config",
]


def init(
    project: str,
    name: str | None = None,
    *,
    dir: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
    stream: str | None = None,
    rank_aware: bool = True,
    resume: str = "allow",
    alert_rules: Sequence[str | Mapping[str, Any]] = (),
    alert_on_rank: int | None = 0,
    alert: Mapping[str, Any] | None = None,
    backends: Sequence[str | Mapping[str, Any]] = (),
    backend_on_rank: int | str | None = "auto",
    backend_rank_metrics: bool = False,
    upload_mode: str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    idle_timeout: float = 60.0,
    time_rule_interval: float = 10.0,
    tags: Sequence[str] | None = None,
    notes: str | None = None,
    entity: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    step_policy: str = "drop",
    backend_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    span_count: bool = False,
    trace_spans: bool = False,
    probe_after: float | None = None,
    system_metrics: bool | None = None,
    system_interval: float | None = None,
) -> Run:
    """Start (or resume) this process's shard of run `project/name` and make it current."""
    active = _state.current
    if active is not None and not active._finished:
        raise UsageError(
            f"expr_tracker.init() was already called for {active.project}/{active.name}; "
            "call finish() first"
        )
    run = Run(
        project, name, dir=dir, config=config, stream=stream, rank_aware=rank_aware, resume=resume,
        alert_rules=alert_rules, alert_on_rank=alert_on_rank, alert=alert, backends=backends,
        backend_on_rank=backend_on_rank, backend_rank_metrics=backend_rank_metrics,
        upload_mode=upload_mode, spool_dir=spool_dir, idle_timeout=idle_timeout,
        time_rule_interval=time_rule_interval, tags=tags, notes=notes, entity=entity,
        run_dir=run_dir, step_policy=step_policy, backend_kwargs=backend_kwargs,
        span_count=span_count, trace_spans=trace_spans, probe_after=probe_after,
        system_metrics=system_metrics, system_interval=system_interval,
    )
    _state.set_current(run)
    return run


def get_run() -> Run | None:
    """The current run of this process, or None before `init` and after `finish`."""
    run = _state.current
    if run is None or run._finished:
        return None
    return run


if _TYPE_CHECKING:
    def log(data: Mapping[str, Any], step: int | None = None, commit: bool | None = None) -> None:
        """Log metrics to the current run with wandb's step semantics."""
else:
    # `Run.log` bound to the holder of the current run (see `_state.Current`): a call costs
    # no wrapper, and `from expr_tracker import log` taken at any time logs to the run
    # current at each call, or raises the usage error without one
    log = _MethodType(Run.log, _state.CURRENT)


def log_rank_metrics(
    metrics: Mapping[str, Any],
    step: int,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    weight: float = 1.0,
) -> None:
    """Record per-rank values for `step` (reduced across ranks by `expr summary`)."""
    _state.get().log_rank_metrics(metrics, step, rank, world_size, local_rank, weight)


def history(n: int | None = 50, **kwargs: Any) -> Any:
    """The last `n` committed rows of a shard; works without `init` when `run=` is given."""
    if kwargs.get("run") is None:
        return _state.get().history(n, **kwargs)
    from expr_tracker.query import history as _history

    return _history(n, **kwargs)


def read_run(run: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Every rank's rows of a run as one pandas DataFrame (or Arrow table, or list of dicts)."""
    from expr_tracker.views.export import read_run as _read_run

    return _read_run(run, **kwargs)


def info() -> dict[str, Any]:
    """The current run's rank, shard, counters, rules and delivery state."""
    return _state.get().info()


def alert(title: str, text: str = "", level: str = "info") -> None:
    """Raise an alert from the training code."""
    _state.get().alert(title, text, level)


def add_alert_rule(rule: str | Mapping[str, Any]) -> str:
    """Add an alert rule to the current run; returns its name."""
    return _state.get().add_alert_rule(rule)


def remove_alert_rule(name: str) -> bool:
    """Remove an alert rule from the current run by name."""
    return _state.get().remove_alert_rule(name)


def update_config(values: Mapping[str, Any]) -> None:
    """Merge `values` into the current run's config (visible in its sidecar)."""
    _state.get().update_config(values)


def flush() -> None:
    """Write everything buffered now."""
    run = _state.current
    if run is not None:
        run.flush()


def __dir__() -> list[str]:
    # the public names only: not the modules and typing names this file imports
    return sorted(__all__)


def finish(exit_code: int | None = None) -> None:
    """Finish the current run (idempotent; without a run, nothing to do). A non-zero
    `exit_code` (0.4) finishes it as crashed, with the code in the sidecar's `exit`."""
    run = _state.current
    if run is not None:
        run.finish(exit_code=exit_code)


def summary(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The current run's summary (0.4's `run.summary`): `values` merged into it, then the
    final values as `finish` will save them (the last logged value of each key, yours over)."""
    from expr_tracker.options import merge_config

    run = _state.get()
    if values is not None:
        run.summary = merge_config(run.summary, values)
    run.flush()
    return run.final_summary()
