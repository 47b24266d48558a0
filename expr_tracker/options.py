"""The arguments of `init`, checked before anything touches the disk (DESIGN 7).

Misuse is an exception at the call naming the field: a bad name, value, rule text or
rank option. `parse_options` returns everything `Run` needs to start, or raises.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from expr_tracker import ranks as _ranks
from expr_tracker import sysmetrics
from expr_tracker.store.layout import default_dir, default_spool, validate_name, validate_stream
from expr_tracker.store.records import MAX_WORLD

RESUME_MODES = ("allow", "must", "never")
STEP_POLICIES = ("drop", "allow")  # a step behind the current one: dropped (counted) or kept
MAX_TAGS, MAX_TAG, MAX_NOTES = 64, 128, 10_000
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


def default_backends() -> list[str]:
    """The backends of an `init` that names none: `$EXPR_BACKENDS` (comma-separated names),
    else `[defaults] backends` of the `$EXPR_ALERT_CONFIG` file, else none (no network unless
    asked; expr-tracker 0.4 defaulted to wandb, and a site restores that with either)."""
    env = os.environ.get("EXPR_BACKENDS")
    if env is not None:
        return [b.strip() for b in env.split(",") if b.strip()]
    path = os.environ.get("EXPR_ALERT_CONFIG")
    if not path:
        return []
    from expr_tracker.alerts.config import read_config_file

    defaults = read_config_file(path).get("defaults", {})
    names = defaults.get("backends", []) if isinstance(defaults, Mapping) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"$EXPR_ALERT_CONFIG={path}: [defaults] backends must be a list of names")
    return list(names)


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
    meta: dict[str, Any]  # tags, notes, entity (those given): in the sidecar's identity
    step_policy: str
    span_count: bool = False
    trace_spans: bool = False
    probe_after: float | None = None  # None: max(10 s, 5x the median step period)
    system_metrics: bool = True
    system_interval: float = 10.0


def config_dict(config: object) -> Mapping[str, Any] | None:
    """`config` as a mapping: a dict, a pydantic model (`model_dump`, or v1's `dict`), a
    dataclass or an argparse Namespace, as expr-tracker 0.4 (and wandb) take them."""
    if config is None or isinstance(config, Mapping):
        return config
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    for method in ("model_dump", "dict"):  # pydantic v2, then v1
        dump = getattr(config, method, None)
        if callable(dump) and hasattr(type(config), "model_fields" if method == "model_dump" else "__fields__"):
            out = dump()
            if isinstance(out, Mapping):
                return out
    if type(config).__name__ == "Namespace" and hasattr(config, "__dict__"):
        return dict(vars(config))
    raise TypeError(f"config must be a dict, a dataclass or a pydantic model, got {type(config).__name__}")


def run_meta(tags: object, notes: object, entity: object) -> dict[str, Any]:
    """`init`'s tags, notes and entity (0.4 and wandb take them), checked; only those given."""
    out: dict[str, Any] = {}
    if tags is not None:
        if isinstance(tags, str) or not isinstance(tags, (list, tuple, set, frozenset)):
            raise TypeError(f"tags must be a list of strings, got {type(tags).__name__}")
        tags = list(tags)
        if len(tags) > MAX_TAGS or not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG
                                           and "\x00" not in t for t in tags):
            raise ValueError(f"tags must be at most {MAX_TAGS} non-empty strings of at most "
                             f"{MAX_TAG} characters")
        out["tags"] = list(dict.fromkeys(tags))
    if notes is not None:
        if not isinstance(notes, str) or len(notes) > MAX_NOTES:
            raise ValueError(f"notes must be a string of at most {MAX_NOTES:,} characters")
        out["notes"] = notes
    if entity is not None:
        out["entity"] = validate_name(entity, "entity")
    return out


def with_backend_kwargs(specs: list[Any], kwargs: object) -> list[Any]:
    """`backend_kwargs={"wandb": {...}}` (0.4): each backend's extra options, by type."""
    if kwargs is None:
        return specs
    if not isinstance(kwargs, Mapping) or not all(isinstance(v, Mapping) for v in kwargs.values()):
        raise TypeError("backend_kwargs must map a backend name to a dict of its options")
    out, used = [], set()
    for spec in specs:
        kind = spec if isinstance(spec, str) else spec.get("type") if isinstance(spec, Mapping) else None
        if isinstance(kind, str) and kind in kwargs:
            used.add(kind)
            base = {"type": kind} if isinstance(spec, str) else dict(spec)
            spec = {**base, **kwargs[kind]}
        out.append(spec)
    unused = set(kwargs) - used
    if unused:
        raise ValueError(f"backend_kwargs: {', '.join(sorted(unused))} is not among the backends")
    return out


def _backends(specs: list[Any], mode: str) -> list[Any]:
    """The backends this process runs (direct mode), each spec checked; in spool mode none
    (exprd runs them) and each spec checked as far as this process can."""
    if specs and mode == "spool":
        # exprd sends, with its own [backends.NAME] (URLs and tokens live there): a bare
        # name is that name, checked here only as a name; a mapping is checked in full
        from expr_tracker.backends.registry import make_backend

        for spec in specs:
            if isinstance(spec, str):
                validate_name(spec, "backends")
            elif isinstance(spec, Mapping):
                make_backend(spec)
            else:
                raise ValueError("backends: a backend object cannot travel through the "
                                 "spool; use a name from exprd's config or a mapping")
        return []
    if not specs:
        return []
    from expr_tracker.backends.registry import check_environment, make_backend

    objs = [make_backend(spec) for spec in specs]
    for backend in objs:
        check_environment(backend)  # this process connects: its variables must be set
    return objs


def _a_directory(root: Path, field: str) -> None:
    """The run root, or the nearest of its parents that exists, is a directory: a file in
    the way is misuse, said at `init`, not a shard kept in memory and retried for ever."""
    for path in (root, *root.parents):
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # (below a file: the file is found further up)
        except OSError:
            return  # (unreadable, a network filesystem's error: the writer reports it)
        if not stat.S_ISDIR(st.st_mode):
            where = "it" if path == root else str(path)
            raise ValueError(f"{field} {root} is not a directory: {where} is a file")
        return


def _path(value: object, field: str) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{field} must be a path, got {type(value).__name__}")


def parse_options(
    project: str,
    name: str | None = None,
    *,
    dir: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
    stream: str | None = None,
    rank_aware: bool = True,
    resume: str = "allow",
    alert_rules: Iterable[str | Mapping[str, Any]] = (),
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
) -> Options:
    """Check every argument of `init`; raise TypeError/ValueError naming the field.

    Its parameters and defaults are `expr_tracker.init`'s (a test holds them equal): `init`
    spells them out for its callers' editors and help, `Run` passes them through.
    """
    project = validate_name(project, "project")
    name = validate_name(default_name() if name is None else name, "name")
    stream = validate_stream(stream)
    _path(dir, "dir")
    _path(run_dir, "run_dir")
    if run_dir is not None:
        if dir is not None:
            raise ValueError("dir and run_dir are the same setting (0.4 called it run_dir): give one")
        dir = run_dir
    # absolute: a later chdir in the training script must not move the shard
    root = (Path(dir) if dir is not None else default_dir()).absolute()
    config = config_dict(config)
    try:
        config_copy: dict[str, Any] = orjson.loads(orjson.dumps(dict(config or {})))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise TypeError(f"config must be JSON-serializable: {exc}") from None
    if not isinstance(rank_aware, bool):
        raise TypeError("rank_aware must be True or False")
    if step_policy not in STEP_POLICIES:
        raise ValueError(f"step_policy must be one of {', '.join(STEP_POLICIES)}; got {step_policy!r}")
    meta = run_meta(tags, notes, entity)
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {', '.join(RESUME_MODES)}; got {resume!r}")
    mode = upload_mode if upload_mode is not None else (os.environ.get("EXPR_MODE") or "direct")
    if mode not in UPLOAD_MODES:
        where = "upload_mode" if upload_mode is not None else "EXPR_MODE"  # (the one it came from)
        raise ValueError(f"{where} must be 'direct' or 'spool', got {mode!r}")
    if mode == "direct":  # (spool mode touches no shared filesystem at init)
        _a_directory(root, "dir" if dir is not None or not os.environ.get("EXPR_DIR") else "EXPR_DIR")
    _path(spool_dir, "spool_dir")
    spool_root = (Path(spool_dir) if spool_dir is not None else default_spool()).absolute()
    if mode == "spool":  # (node-local: a stat is cheap)
        _a_directory(spool_root, "spool_dir" if spool_dir is not None or not os.environ.get(
            "EXPR_SPOOL") else "EXPR_SPOOL")
    for field, value in (("idle_timeout", idle_timeout), ("time_rule_interval", time_rule_interval)):
        seconds(value, field)
    for field, flag in (("span_count", span_count), ("trace_spans", trace_spans)):
        if not isinstance(flag, bool):
            raise TypeError(f"{field} must be True or False, got {type(flag).__name__}")
    # probes: None is the default (DESIGN 13), which the probe thread works out itself
    probe = seconds(probe_after, "probe_after", env="EXPR_PROBE_AFTER")
    sys_on = sysmetrics.parse_enabled(system_metrics)
    sys_every = seconds(system_interval, "system_interval", env="EXPR_SYSTEM_INTERVAL")
    if sys_every is None:
        sys_every = sysmetrics.DEFAULT_INTERVAL
    else:
        sysmetrics.check_interval(sys_every, "system_interval" if system_interval is not None
                                  else "EXPR_SYSTEM_INTERVAL")

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
        if mode == "spool":
            for chan in alert_config.channels:
                if chan.type == "callable":
                    raise ValueError(
                        f"alert channel {chan.name!r}: a callable channel runs in this process "
                        "and cannot travel through the spool (exprd delivers spool-mode "
                        "alerts): use direct mode, or a channel in exprd's config")
    if isinstance(backends, (str, Mapping)):
        backends = [backends]
    backend_specs = with_backend_kwargs(list(backends) or default_backends(), backend_kwargs)
    try:
        backend_objs = _backends(backend_specs, mode)
    except (TypeError, ValueError) as exc:
        if backends or os.environ.get("EXPR_BACKENDS") is None:
            raise
        raise type(exc)(f"EXPR_BACKENDS: {exc}") from None  # (where the names came from)
    return Options(
        project=project, name=name, stream=stream, root=root, spool_root=spool_root,
        config=config_copy, rank_aware=rank_aware, resume=resume, mode=mode,
        idle_timeout=float(idle_timeout), time_rule_interval=float(time_rule_interval),
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        alert_on_rank=alert_rank, backend_on_rank=backend_rank,
        backend_rank_metrics=bool(backend_rank_metrics), rules=rules, alert_config=alert_config,
        backend_specs=backend_specs, backend_objs=backend_objs, meta=meta, step_policy=step_policy,
        span_count=span_count, trace_spans=trace_spans, probe_after=probe,
        system_metrics=sys_on, system_interval=sys_every,
    )


def seconds(value: object, field: str, env: str | None = None) -> float | None:
    """A positive, finite number of seconds given as `field=`, else read from `$env` when
    that is set; None when neither is. Errors name whichever was given."""
    if value is None:
        raw = os.environ.get(env, "").strip() if env is not None else ""
        if env is None or not raw:
            return None
        field = env
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{field} must be a number of seconds, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
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
