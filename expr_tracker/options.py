"""The arguments of `init`, checked before anything touches the disk (DESIGN 7).

Misuse is an exception at the call naming the field: a bad name, value, rule text or
rank option. `parse_options` returns everything `Run` needs to start, or raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from expr_tracker import ranks as _ranks
from expr_tracker.store.layout import default_dir, default_spool, validate_name, validate_stream
from expr_tracker.store.records import MAX_WORLD

RESUME_MODES = ("allow", "must", "never")
UPLOAD_MODES = ("direct", "spool")


def default_name() -> str:
    """Same default on every rank of one job: the launcher's job id when there is one."""
    env = os.environ
    if env.get("EXPR_RUN_NAME"):
        return env["EXPR_RUN_NAME"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    rid = env.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return f"torchrun-{rid}"
    return time.strftime("run-%Y%m%d-%H%M%S")


def check_rank_option(value: object, field: str, world: int | None) -> int | None:
    """A rank option; checked against the world size only when the launcher set it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int rank or None, got {type(value).__name__}")
    if value < 0 or value >= MAX_WORLD:
        raise ValueError(f"{field}={value} is not a rank (0..{MAX_WORLD - 1})")
    if world is not None and value >= world:
        raise ValueError(f"{field}={value} is outside the job's ranks 0..{world - 1} (WORLD_SIZE={world})")
    return value


@dataclass
class Options:
    """`init`'s arguments, checked; rank and world size from the launcher's environment."""

    project: str
    name: str
    stream: str | None
    root: Path
    spool_root: Path
    config: dict[str, Any]
    rank_aware: bool
    resume: str
    mode: str
    idle_timeout: float
    time_rule_interval: float
    rank: int
    world_size: int | None
    local_rank: int
    alert_on_rank: int | None
    backend_on_rank: int | str | None
    backend_rank_metrics: bool
    rules: list[Any]
    alert_config: Any
    backend_specs: list[Any]
    backend_objs: list[Any]
    span_count: bool = False
    trace_spans: bool = False
    probe_after: float | None = None  # None: max(10 s, 5x the median step period)


def _path(value: object, field: str) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{field} must be a path, got {type(value).__name__}")


def parse_options(
    project: str,
    name: str | None,
    *,
    dir: str | os.PathLike[str] | None,
    config: Mapping[str, Any] | None,
    stream: str | None,
    rank_aware: bool,
    resume: str,
    alert_rules: Iterable[str | Mapping[str, Any]],
    alert_on_rank: int | None,
    alert: Mapping[str, Any] | None,
    backends: Sequence[str | Mapping[str, Any]],
    backend_on_rank: int | str | None,
    backend_rank_metrics: bool,
    upload_mode: str | None,
    spool_dir: str | os.PathLike[str] | None,
    idle_timeout: float,
    time_rule_interval: float,
    span_count: bool = False,
    trace_spans: bool = False,
    probe_after: float | None = None,
) -> Options:
    """Check every argument of `init`; raise TypeError/ValueError naming the field."""
    project = validate_name(project, "project")
    name = validate_name(default_name() if name is None else name, "name")
    stream = validate_stream(stream)
    _path(dir, "dir")
    # absolute: a later chdir in the training script must not move the shard
    root = (Path(dir) if dir is not None else default_dir()).absolute()
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    try:
        config_copy: dict[str, Any] = orjson.loads(orjson.dumps(dict(config or {})))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise TypeError(f"config must be JSON-serializable: {exc}") from None
    if not isinstance(rank_aware, bool):
        raise TypeError("rank_aware must be True or False")
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {', '.join(RESUME_MODES)}; got {resume!r}")
    mode = upload_mode if upload_mode is not None else (os.environ.get("EXPR_MODE") or "direct")
    if mode not in UPLOAD_MODES:
        raise ValueError(f"upload_mode must be 'direct' or 'spool', got {mode!r}")
    _path(spool_dir, "spool_dir")
    spool_root = (Path(spool_dir) if spool_dir is not None else default_spool()).absolute()
    for field, value in (("idle_timeout", idle_timeout), ("time_rule_interval", time_rule_interval)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
    for field, flag in (("span_count", span_count), ("trace_spans", trace_spans)):
        if not isinstance(flag, bool):
            raise TypeError(f"{field} must be True or False, got {type(flag).__name__}")
    probe = check_probe_after(probe_after)

    info = _ranks.detect()
    if info.world_size is not None and info.world_size > MAX_WORLD:
        raise ValueError(f"WORLD_SIZE={info.world_size} is over the sanity cap of {MAX_WORLD:,} ranks")
    alert_rank = check_rank_option(alert_on_rank, "alert_on_rank", info.world_size)
    # "auto": each backend's default (backends.base.reports_on_rank): rank 0, or every
    # rank for the team store, whose rows carry their rank
    if isinstance(backend_on_rank, str) and backend_on_rank != "auto":
        raise ValueError(f"backend_on_rank must be 'auto', a rank or None, not {backend_on_rank!r}")
    backend_rank: int | str | None = (
        "auto" if backend_on_rank == "auto"
        else check_rank_option(backend_on_rank, "backend_on_rank", info.world_size))

    if isinstance(alert_rules, (str, Mapping)):
        alert_rules = [alert_rules]
    rules: list[Any] = []
    rule_specs = list(alert_rules)
    if rule_specs:
        from expr_tracker.alerts.rules import parse_rule

        rules = [parse_rule(spec, index=i) for i, spec in enumerate(rule_specs)]
    alert_config: Any = None
    if alert is not None or os.environ.get("EXPR_ALERT_CONFIG"):
        from expr_tracker.alerts import load_config

        alert_config = load_config(alert)
    if isinstance(backends, (str, Mapping)):
        backends = [backends]
    backend_specs = list(backends)
    backend_objs: list[Any] = []
    if backend_specs and mode == "spool":
        # exprd sends, with its own [backends.NAME] (URLs and tokens live there): a bare
        # name is that name, checked here only as a name; a mapping is checked in full
        from expr_tracker.backends.registry import make_backend

        for spec in backend_specs:
            if isinstance(spec, str):
                validate_name(spec, "backends")
            elif isinstance(spec, Mapping):
                make_backend(spec)
            else:
                raise ValueError("backends: a backend object cannot travel through the "
                                 "spool; use a name from exprd's config or a mapping")
    elif backend_specs:
        from expr_tracker.backends.registry import make_backend

        backend_objs = [make_backend(spec) for spec in backend_specs]
    return Options(
        project=project, name=name, stream=stream, root=root, spool_root=spool_root,
        config=config_copy, rank_aware=rank_aware, resume=resume, mode=mode,
        idle_timeout=float(idle_timeout), time_rule_interval=float(time_rule_interval),
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        alert_on_rank=alert_rank, backend_on_rank=backend_rank,
        backend_rank_metrics=bool(backend_rank_metrics), rules=rules, alert_config=alert_config,
        backend_specs=backend_specs, backend_objs=backend_objs,
        span_count=span_count, trace_spans=trace_spans, probe_after=probe,
    )


def check_probe_after(value: object) -> float | None:
    """`probe_after=` (else `$EXPR_PROBE_AFTER`): seconds of silence before the background
    thread writes a probe (DESIGN 13); None for the default."""
    field = "probe_after"
    if value is None:
        env = os.environ.get("EXPR_PROBE_AFTER")
        if not env:
            return None
        field = "EXPR_PROBE_AFTER"
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"EXPR_PROBE_AFTER must be a number of seconds, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
    return float(value)


def merge_config(current: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`current` with the top-level keys of `values` replaced (as JSON round-trips them).

    Checked whole before anything changes: a TypeError names the first key that is not a
    string or whose value JSON cannot hold.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"config values must be a dict, got {type(values).__name__}")
    merged = dict(current)
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"config key {key!r} must be a string, got {type(key).__name__}")
        try:
            merged[key] = orjson.loads(orjson.dumps(value))
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise TypeError(f"config value of {key!r} is not JSON-serializable: {exc}") from None
    return merged
