"""Run: the lifecycle of one process's tracking, the step cursor, and handing records on.

The hot path is `Run.log`: validate, merge into the open row, and on commit hand one
record to the sink (the pipeline in direct mode, the spool writer in spool mode).
Everything that can fail later (disk, network) happens behind the sink and is
reported once per cause, counted, and never raised into the training loop.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from expr_tracker import ranks as _ranks
from expr_tracker.errors import UsageError
from expr_tracker.store import records
from expr_tracker.store.layout import (
    ShardPaths,
    default_dir,
    default_spool,
    shard_paths,
    validate_name,
    validate_stream,
)
from expr_tracker.store.records import MAX_WORLD

_time = time.time
_dumps = records.dumps
_orjson_dumps = orjson.dumps
_NL = orjson.OPT_APPEND_NEWLINE
_INT_MIN = records.INT_MIN
_INT_MAX = records.INT_MAX

RESUME_MODES = ("allow", "must", "never")
UPLOAD_MODES = ("direct", "spool")
SIDECAR_EVERY = 5.0
TICK = 1.0


def _default_name() -> str:
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


def _check_rank_option(value: object, field: str, world: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int rank or None, got {type(value).__name__}")
    if not 0 <= value < world:
        raise ValueError(f"{field}={value} is outside the job's ranks 0..{world - 1}")
    return value


class Run:
    """One process's tracking of a run. Create it with `expr_tracker.init`."""

    def __init__(
        self,
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
        backend_on_rank: int | None = 0,
        backend_rank_metrics: bool = False,
        upload_mode: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        idle_timeout: float = 60.0,
        time_rule_interval: float = 10.0,
    ) -> None:
        # -- validate everything before touching the disk -------------------
        self.project = validate_name(project, "project")
        self.name = validate_name(_default_name() if name is None else name, "name")
        self.stream = validate_stream(stream)
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"dir must be a path, got {type(dir).__name__}")
        # absolute: a later chdir in the training script must not move the shard
        self.root = (Path(dir) if dir is not None else default_dir()).absolute()
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        try:
            self.config: dict[str, Any] = orjson.loads(orjson.dumps(dict(config or {})))
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise TypeError(f"config must be JSON-serializable: {exc}") from None
        if not isinstance(rank_aware, bool):
            raise TypeError("rank_aware must be True or False")
        self.rank_aware = rank_aware
        if resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {', '.join(RESUME_MODES)}; got {resume!r}")
        mode = upload_mode if upload_mode is not None else (os.environ.get("EXPR_MODE") or "direct")
        if mode not in UPLOAD_MODES:
            raise ValueError(f"upload_mode must be 'direct' or 'spool', got {mode!r}")
        self.mode = mode
        if spool_dir is not None and not isinstance(spool_dir, (str, os.PathLike)):
            raise TypeError(f"spool_dir must be a path, got {type(spool_dir).__name__}")
        self.spool_root = (Path(spool_dir) if spool_dir is not None else default_spool()).absolute()
        for field, value in (("idle_timeout", idle_timeout), ("time_rule_interval", time_rule_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
        self.idle_timeout = float(idle_timeout)
        self.time_rule_interval = float(time_rule_interval)

        info = _ranks.detect()
        if info.world_size > MAX_WORLD:
            raise ValueError(f"WORLD_SIZE={info.world_size} is over the supported {MAX_WORLD}")
        self.rank, self.world_size, self.local_rank = info.rank, info.world_size, info.local_rank
        self.alert_on_rank = _check_rank_option(alert_on_rank, "alert_on_rank", self.world_size)
        self.backend_on_rank = _check_rank_option(backend_on_rank, "backend_on_rank", self.world_size)
        self.backend_rank_metrics = bool(backend_rank_metrics)

        if isinstance(alert_rules, (str, Mapping)):
            alert_rules = [alert_rules]
        alert_rules = list(alert_rules)
        self._ruleset: Any = None
        if alert_rules:
            from expr_tracker.alerts.rules import RuleSet, parse_rule

            rule_list = [parse_rule(spec, index=i) for i, spec in enumerate(alert_rules)]
            self._ruleset = RuleSet(rule_list, context=self._context(), start_time=time.time())
        self._alert_config: Any = None
        if alert is not None or os.environ.get("EXPR_ALERT_CONFIG"):
            from expr_tracker.alerts import load_config

            self._alert_config = load_config(alert)
        if isinstance(backends, (str, Mapping)):
            backends = [backends]
        self._backend_specs = list(backends)
        self._backend_objs: list[Any] = []
        if self._backend_specs and mode == "spool":
            # exprd sends, with its own [backends.NAME] (URLs and tokens live there): a bare
            # name is that name, checked here only as a name; a mapping is checked in full
            from expr_tracker.backends.registry import make_backend

            for spec in self._backend_specs:
                if isinstance(spec, str):
                    validate_name(spec, "backends")
                elif isinstance(spec, Mapping):
                    make_backend(spec)
                else:
                    raise ValueError("backends: a backend object cannot travel through the "
                                     "spool; use a name from exprd's config or a mapping")
        elif self._backend_specs:
            from expr_tracker.backends.registry import make_backend

            self._backend_objs = [make_backend(spec) for spec in self._backend_specs]

        self.paths: ShardPaths = shard_paths(
            self.root, self.project, self.name, self.stream, self.rank if rank_aware else 0
        )
        if resume != "allow":
            exists = self.paths.shard.exists() and self.paths.shard.stat().st_size > 0
            if resume == "never" and exists:
                raise ValueError(f"resume='never' but run {self.project}/{self.name} already has {self.paths.shard}")
            if resume == "must" and not exists:
                raise ValueError(f"resume='must' but {self.paths.shard} does not exist")
        self.session = os.urandom(6).hex()

        # -- state ----------------------------------------------------------
        self.dropped: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._open: dict[str, Any] | None = None
        self._open_nonfinite = False
        self._last_log = time.monotonic()
        self._finished = False
        self._detached = False  # a forked child: never write the parent's data
        self._rows_committed = 0
        self._fast_ok = True  # no open row, not finished, not detached: log() may take the hot path
        self._last_step: int | None = None
        self._pid = os.getpid()
        self._spool_seq: int | None = None  # the next spool event number (spool mode)
        self._sink = self._make_sink()
        self._step = self._sink.next_step
        self._rows_base = self._sink.rows
        self._last_step = self._sink.last_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._background, name="expr-tracker", daemon=True)
        self._thread.start()

    # -- construction helpers ----------------------------------------------
    def _context(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "name": self.name,
            "run": self.name,
            "stream": self.stream,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def identity(self) -> dict[str, Any]:
        """Who writes this shard (stored in the sidecar and the spool's init event)."""
        return {
            "project": self.project,
            "name": self.name,
            "stream": self.stream,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "session": self.session,
            "rank_aware": self.rank_aware,
            "config": self.config,
        }

    def _make_sink(self) -> Any:
        if self.mode == "spool":
            from expr_tracker.spool import SpoolSink

            return SpoolSink(self)
        from expr_tracker.direct import DirectSink

        return DirectSink(self)

    # -- warnings ----------------------------------------------------------
    def warn_once(self, cause: str, message: str) -> None:
        """Report a background problem once per cause (any thread; never raises)."""
        if cause in self._warned:
            return
        self._warned.add(cause)
        if threading.current_thread() is threading.main_thread():
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            # warnings from a background thread would surface at random places; log instead
            import logging

            logging.getLogger("expr_tracker").warning(message)

    def _count(self, cause: str, n: int = 1) -> None:
        self.dropped[cause] = self.dropped.get(cause, 0) + n

    # -- logging -----------------------------------------------------------
    def log(self, data: Mapping[str, Any], step: int | None = None, commit: bool | None = None) -> None:
        """Log metrics with wandb's step semantics (see the module docs of expr_tracker)."""
        fast = self._sink.fast_append
        if fast is not None and step is None and commit is None and data.__class__ is dict:
            # The hot path: a plain dict of floats/ints, committed at once. Anything unusual
            # (explicit step, commit=False, other value types) takes the full path below.
            nonfinite = False
            for key, value in data.items():
                cls = value.__class__
                if cls is float:
                    if value - value != 0.0:
                        nonfinite = True
                elif cls is not int or not _INT_MIN <= value <= _INT_MAX:
                    break
                if key.__class__ is not str or not key or key[0] == "_":
                    break
            else:
                with self._lock:
                    if self._fast_ok and data:
                        step = self._step
                        self._step = step + 1
                        self._last_step = step
                        seq = self._spool_seq
                        if seq is None:
                            record = {"_step": step, "_time": _time(), **data}
                        else:  # spool mode: every event is numbered
                            record = {"_step": step, "_time": _time(), "_seq": seq, **data}
                            self._spool_seq = seq + 1
                        line = _dumps(record, nonfinite) if nonfinite else _orjson_dumps(record, option=_NL)
                        fast(line)
                        after = self._sink.after_write
                        if after is not None:
                            after(record)
                        n = self._rows_committed = self._rows_committed + 1
                        # every 256 rows: has the buffer reached the flush size?
                        writer = self._sink.writer
                        if n & 255 or writer.buffered() < writer.flush_bytes:
                            return
                    else:
                        fast = None
                if fast is not None:
                    # a flush's worth is buffered: write now unless a flush is running
                    self._sink.writer.flush_nowait()
                    return
        row, nonfinite = records.encode_row(data)
        if step is not None:
            step = records.check_step(step)
        if commit is not None and not isinstance(commit, bool):
            raise TypeError(f"commit must be True, False or None, got {type(commit).__name__}")
        with self._lock:
            if self._finished:
                raise UsageError("this run is finished; call expr_tracker.init() to start another")
            if self._detached:
                return
            self._last_log = time.monotonic()
            if step is not None:
                if step < self._step:
                    self._count("backward_step")
                    self.warn_once(
                        "backward_step",
                        f"expr_tracker: step {step} is behind the current step {self._step}; "
                        "the row is dropped (counted in info()['dropped']['backward_step'])",
                    )
                    return
                if step > self._step:
                    if self._open:
                        self._commit()
                    self._step = step
                if commit is None:
                    commit = False  # an explicit step stays open until the step advances
            if self._open is None:
                self._open = row
                self._fast_ok = False
                self._open_nonfinite = nonfinite
            else:
                self._open.update(row)
                self._open_nonfinite |= nonfinite
            if commit is not False:
                self._commit()

    def _commit(self) -> None:
        """Hand the open row to the sink and advance the step. Caller holds the lock."""
        step = self._step
        self._step = step + 1
        row = self._open
        self._open = None
        self._fast_ok = not (self._finished or self._detached)
        if not row:
            return
        record = {"_step": step, "_time": time.time()}
        if not self.rank_aware:
            record["_rank"] = self.rank
        record.update(row)
        self._rows_committed += 1
        self._last_step = step
        self._sink.apply(record, self._open_nonfinite)

    def log_rank_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        weight: float = 1.0,
    ) -> None:
        """Record per-rank values of `step` for `rank` (any rank: e.g. rank 0 after an all-gather)."""
        if rank is None:
            rank = self.rank
            if local_rank is None:
                local_rank = self.local_rank
        record, nonfinite = records.rank_record(
            metrics, step, rank, self.world_size if world_size is None else world_size,
            local_rank, weight,
        )
        with self._lock:
            if self._finished:
                raise UsageError("this run is finished; call expr_tracker.init() to start another")
            if self._detached:
                return
            self._rows_committed += 1
            self._sink.apply(record, nonfinite)

    # -- alerts ------------------------------------------------------------
    def alert(self, title: str, text: str = "", level: str = "info") -> None:
        """Raise an alert now; delivered from the alerting rank, recorded on every rank."""
        from expr_tracker.alerts import make_alert

        make_alert(title=title, text=text, level=level, rule=None, kind="manual", step=None,
                   time=0.0, project=self.project, run=self.name, stream=self.stream, rank=self.rank)
        with self._lock:
            if self._finished:
                raise UsageError("this run is finished")
            if not self._detached:
                self._sink.alert(title, text, level)

    def add_alert_rule(self, rule: str | Mapping[str, Any]) -> str:
        """Compile and add a rule; returns its name. Raises RuleError on bad text."""
        from expr_tracker.alerts.rules import RuleSet, parse_rule

        with self._lock:
            count = len(self._ruleset.rules) if self._ruleset is not None else 0
            parsed = parse_rule(rule, index=count)
            if self._ruleset is None:
                self._ruleset = RuleSet((), context=self._context(), start_time=time.time())
            self._ruleset.add(parsed)
            self._sink.rules_changed()
        return parsed.name

    def remove_alert_rule(self, name: str) -> bool:
        """Remove a rule by name; False if there was none."""
        with self._lock:
            removed = self._ruleset.remove(name) if self._ruleset is not None else False
            self._sink.rules_changed()
        return bool(removed)

    # -- lifecycle ---------------------------------------------------------
    def flush(self) -> None:
        """Write everything buffered now (failures are reported, never raised)."""
        with self._lock:
            if self._detached:
                return
        self._sink.flush()

    def _background(self) -> None:
        """Flush about every second, sidecar every few seconds, idle commit, time rules."""
        last_sidecar = last_rules = time.monotonic()
        while not self._stop.wait(TICK):
            try:
                now = time.monotonic()
                with self._lock:
                    if self._detached or self._finished:
                        return
                    if self._open and now - self._last_log >= self.idle_timeout:
                        self._commit()
                    if now - last_rules >= self.time_rule_interval:
                        last_rules = now
                        self._sink.tick()
                self._sink.flush()
                if now - last_sidecar >= SIDECAR_EVERY:
                    last_sidecar = now
                    self._sink.checkpoint()
            except Exception as exc:  # the tracker must never take the process down
                self.warn_once(f"background:{type(exc).__name__}", f"expr_tracker: background error: {exc!r}")

    def finish(self, status: str = "finished") -> None:
        """Commit the open row, flush, write the sidecar, drain alerts and backends. Idempotent."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._fast_ok = False
            if self._detached:
                return
            if self._open:
                self._commit()
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        self._sink.close(status)
        # in spool mode exprd evaluates the rules: this process never fed them a row
        if self.mode == "direct" and self._ruleset is not None and self._ruleset.rules:
            for rule_name, metric, guess in self._ruleset.never_seen():
                hint = f"; did you mean {guess!r}?" if guess else ""
                self.warn_once(
                    f"never_seen:{rule_name}:{metric}",
                    f"expr_tracker: rule {rule_name!r} uses metric {metric!r}, which was never logged{hint}",
                )
        from expr_tracker import _state

        _state.forget(self)

    def _terminate(self) -> None:
        """SIGTERM: save what can be saved, then let the process die.

        The handler runs on the main thread between two bytecodes, possibly inside
        log() or flush() with their locks held: so every lock is taken with a timeout,
        and backends and alert delivery are not waited for.
        """
        if self._lock.acquire(timeout=0.5):
            try:
                if self._open and not self._finished and not self._detached:
                    self._commit()
                self._finished = True
                self._fast_ok = False
            finally:
                self._lock.release()
        self._stop.set()
        self._sink.writer.close("crashed", flush_timeout=1.0)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.finish("crashed" if exc_type is not None and exc_type is not KeyboardInterrupt else "finished")

    def _after_fork_in_child(self) -> None:
        """A forked child (a dataloader worker) must never write the parent's buffered rows."""
        self._detached = True
        self._fast_ok = False
        self._lock = threading.Lock()
        self._sink.detach()

    # -- reading -----------------------------------------------------------
    @property
    def step(self) -> int:
        """The open step: the step the next committed row gets."""
        return self._step

    @property
    def shard_path(self) -> Path:
        """The shard this process writes (direct mode) or would write (spool mode)."""
        return self.paths.shard

    def history(self, n: int | None = 50, **kwargs: Any) -> Any:
        """The last `n` committed rows of this run; see `expr_tracker.history`."""
        from expr_tracker.query import history

        return history(n, run_obj=self, **kwargs)

    def info(self) -> dict[str, Any]:
        """Where this process stands: rank, shard, rows, drops, rules, alerts, backends."""
        with self._lock:
            out: dict[str, Any] = {
                "project": self.project,
                "name": self.name,
                "dir": str(self.root),
                "run_dir": str(self.paths.run_dir),
                "rank": self.rank,
                "world_size": self.world_size,
                "local_rank": self.local_rank,
                "stream": self.stream,
                "mode": self.mode,
                "rank_aware": self.rank_aware,
                "session": self.session,
                "shard": str(self.paths.shard),
                "step": self._step,
                "rows": self._rows_base + self._rows_committed,
                "last_step": self._last_step,
                "finished": self._finished,
                "rules": self._ruleset.info() if self._ruleset is not None else [],
            }
        out.update(self._sink.info())
        out["dropped"] = {**self.dropped, **out.get("dropped", {})}
        return out
