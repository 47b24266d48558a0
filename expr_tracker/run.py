"""Run: the lifecycle of one process's tracking, the step cursor, and handing records on.

The hot path is `Run.log`: a row of known keys and finite numbers, committed at once,
is encoded and queued on the writer under the lock in a few dozen bytecodes; anything
else goes through `Run._log`: validate, merge into the open row, and on commit hand one
record to the sink (the pipeline in direct mode, the spool writer in spool mode).
Everything that can fail later (disk, network) happens behind the sink and is
reported once per cause, counted, and never raised into the training loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker import spans as _spans
from expr_tracker import sysmetrics
from expr_tracker.context import RunContext
from expr_tracker.errors import UsageError
from expr_tracker.options import merge_config, parse_options
from expr_tracker.store import records
from expr_tracker.store.layout import (
    ShardPaths,
    shard_paths,
)

_time = time.time
_orjson_dumps = orjson.dumps
_HOT = orjson.OPT_APPEND_NEWLINE | orjson.OPT_STRICT_INTEGER
_drain = _spans.drain

SIDECAR_EVERY = 5.0
KEYS_OK = 4096  # keys remembered as accepted; past that the cache restarts from the new row's
TICK = 1.0


class Run:
    """One process's tracking of a run. Create it with `expr_tracker.init`."""

    def __init__(self, project: str, name: str | None = None, **options: Any) -> None:
        # -- validate everything before touching the disk -------------------
        # (the options are `init`'s, checked and defaulted by `parse_options`)
        o = parse_options(project, name, **options)
        self.meta, self.step_policy = o.meta, o.step_policy
        # final values (0.4's run.summary): yours, over the last logged value of each key,
        # saved in the sidecar at finish
        self.summary: dict[str, Any] = {}
        self.project, self.name, self.stream, self.config = o.project, o.name, o.stream, o.config
        self.root, self.spool_root, self.mode, self.rank_aware = o.root, o.spool_root, o.mode, o.rank_aware
        self.rank, self.world_size, self.local_rank = o.rank, o.world_size, o.local_rank
        self.alert_on_rank, self.backend_on_rank = o.alert_on_rank, o.backend_on_rank
        self.backend_rank_metrics = o.backend_rank_metrics
        self.idle_timeout, self.time_rule_interval = o.idle_timeout, o.time_rule_interval
        self._alert_config = o.alert_config
        self._backend_specs, self._backend_objs = o.backend_specs, o.backend_objs
        self._ruleset: Any = None
        if o.rules:
            from expr_tracker.alerts.rules import RuleSet

            self._ruleset = RuleSet(o.rules, context=self._context(), start_time=time.time())

        self.paths: ShardPaths = shard_paths(
            self.root, self.project, self.name, self.stream, self.rank if o.rank_aware else 0
        )
        if o.resume != "allow":
            exists = self.paths.shard.exists() and self.paths.shard.stat().st_size > 0
            if o.resume == "never" and exists:
                raise ValueError(f"resume='never' but run {self.project}/{self.name} already has {self.paths.shard}")
            if o.resume == "must" and not exists:
                raise ValueError(f"resume='must' but {self.paths.shard} does not exist")
        self.session = os.urandom(6).hex()

        # -- state ----------------------------------------------------------
        self._target = self  # what `log` logs to (see there)
        self.dropped: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._open: dict[str, Any] | None = None
        self._open_nonfinite = False
        self._last_log = time.monotonic()
        self._finished = False
        self._detached = False  # a forked child: never write the parent's data
        # rows and last committed step as of `_mark`; the hot path only advances `_step`,
        # so both are derived (`_rows_committed`, `_last_step`) and `_settle` folds them in
        self._rows = 0
        self._last: int | None = None
        self._append: Any = None  # the sink's `fast_append` while log() may take the hot path
        self._keys_ok: frozenset[str] = frozenset()  # keys log() accepted: the hot path's screen
        self._pid = os.getpid()
        self._exit: dict[str, Any] | None = None  # the uncaught exception that ends the process
        self._sidecar_due = False  # update_config: write the sidecar at the next tick
        self._system = sysmetrics.make_sampler(o.system_metrics, o.system_interval, o.local_rank)
        self._sink = self._make_sink()
        self._sink.on_switch = self._reopen  # the spool's segment changed (under the lock)
        self._reopen()
        self._step = self._mark = self._sink.next_step
        self._rows_base = self._sink.rows
        self._last = self._sink.last_step
        if self._last is not None:
            # once, on stderr: a job restarted from a checkpoint continues its shards (a
            # fresh rank joining a rank_aware=False file that others wrote resumes nothing)
            print(f"resuming {self.name} rank {self.rank} at step {self._step}", file=sys.stderr,
                  flush=True)
        # spans closed since the last row (DESIGN 17); the background thread writes probes
        self._spans = _spans.Sink(self, o.span_count, o.trace_spans)
        from expr_tracker.probe import Prober

        self._prober = Prober(self, o.probe_after)
        _spans.activate(self._spans)
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

    def _make_sink(self) -> Any:
        ctx = RunContext(
            project=self.project, name=self.name, stream=self.stream, rank=self.rank,
            world_size=self.world_size, local_rank=self.local_rank, session=self.session,
            rank_aware=self.rank_aware, config=self.config, root=self.root,
            spool_root=self.spool_root, paths=self.paths, alert_on_rank=self.alert_on_rank,
            backend_on_rank=self.backend_on_rank, backend_rank_metrics=self.backend_rank_metrics,
            time_rule_interval=self.time_rule_interval, warn_once=self.warn_once,
            dropped=self.dropped, ruleset=self._ruleset, alert_config=self._alert_config,
            backend_specs=self._backend_specs, backend_objs=self._backend_objs, meta=self.meta,
            lock=self._lock,
        )
        if self.mode == "spool":
            from expr_tracker.spool import SpoolSink

            return SpoolSink(ctx)
        from expr_tracker.direct import DirectSink

        return DirectSink(ctx)

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
        # `expr_tracker.log` is this method bound to `_state.CURRENT`, whose `_target` is the
        # current run (a run's own `_target` is itself): one call, no wrapper in between
        run = self._target
        if type(data) is dict and step is None and commit is None:
            # The hot path: a plain dict of finite floats and ints whose keys were all
            # accepted before (`_keys_ok`: whether a key is valid depends on the key
            # alone), committed at once; orjson checks the int64 bound (STRICT_INTEGER
            # refuses past 2**53, and the full path decides). Anything else (a new key,
            # NaN, an explicit step, commit=False, other values, an open row) takes `_log`,
            # which writes the same bytes (tests/test_log_fastpath.py).
            keys_ok = run._keys_ok
            for key in data:
                if key not in keys_ok:
                    break
                value = data[key]
                if type(value) is float:
                    if value - value:  # NaN or an infinity: NaN is true
                        break
                elif type(value) is not int:
                    break
            else:
                # `with`, not acquire() and try: a KeyboardInterrupt raised between those two
                # (a signal is handled at the end of a call) would keep the lock taken, and
                # every later log(), finish() and the exit path would wait on it for good
                with run._lock:
                    append = run._append  # None while the hot path is closed (see `_reopen`)
                    if append is not None and data:
                        at = run._step
                        sink = run._sink
                        record = {"_step": at, "_time": _time(), **data}
                        if run._spans.pending:
                            _drain(run._spans, record)
                        seq = sink.seq
                        if seq is not None:  # spool mode: every event is numbered, last
                            record["_seq"] = seq  # (where SpoolSink.apply puts it)
                        try:
                            line = _orjson_dumps(record, option=_HOT)
                        except TypeError:
                            # an int past 2**53, or a key orjson cannot encode that passed
                            # the screen (an object equal to an accepted key): nothing has
                            # changed yet; `_log` decides, naming the key if it refuses
                            append = None
                        else:
                            # one counter: the rows and the last step of the hot path are
                            # derived from `_step` and `_mark` (see `_settle`)
                            run._step = at + 1
                            if seq is not None:
                                # spool mode: `append` is os.write to the open segment,
                                # within its room (store.segment); inline, because a call
                                # of a Python function would cost more than these checks
                                sink.seq = seq + 1
                                seg = sink.writer
                                end = seg.end + len(line)
                                if end > seg.limit:
                                    sink.overflow(line)  # the segment is full
                                    return
                                try:
                                    got = append(line)
                                except OSError as exc:
                                    sink.overflow(line, exc)
                                    return
                                if got == len(line):
                                    seg.end = end
                                else:
                                    sink.overflow(line, got)
                                return  # (no mark, no after_write, nothing to flush)
                            append(line)
                            mark = sink.mark  # direct mode: the step, where kill -9 keeps it
                            if mark is not None:
                                mark[0] = at
                            after = sink.after_write
                            if after is not None:
                                after(record)
                            # every 256 rows: has the buffer reached the flush size?
                            if at & 255 != 255:
                                return
                            writer = sink.writer
                            if writer.buffered() < writer.flush_bytes:
                                return
                    else:
                        append = None
                if append is not None:
                    # a flush's worth is buffered: write now unless a flush is running
                    writer.flush_nowait()
                    return
        run._log(data, step, commit)

    def _log(self, data: Mapping[str, Any], step: int | None, commit: bool | None) -> None:
        """`log` in full: every check, an explicit step, commit=False, the open row."""
        row, nonfinite = records.encode_row(data)
        if not row.keys() <= self._keys_ok:
            # every key of `row` passed `check_key`: rows of known keys may take the hot path
            # (a new set each time, swapped whole: readers need no lock; bounded by KEYS_OK)
            known = self._keys_ok
            self._keys_ok = (known if len(known) < KEYS_OK else frozenset()).union(row)
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
                if step < self._step and self.step_policy == "allow":
                    # kept as a row of its own at that step; the cursor stays where it is
                    record = {"_step": step, "_time": time.time(), **row}
                    if not self.rank_aware:
                        record["_rank"] = self.rank
                    self._rows += 1
                    self._sink.apply(record, nonfinite)
                    return
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
                    self._settle()
                    self._step = self._mark = step
                if commit is None:
                    commit = False  # an explicit step stays open until the step advances
            if self._open is None:
                self._open = row
                self._append = None
                self._open_nonfinite = nonfinite
            else:
                records.check_merged(self._open, row)  # the merged row must fit a line too
                self._open.update(row)
                self._open_nonfinite |= nonfinite
            if commit is not False:
                self._commit()

    def _reopen(self) -> None:
        """Open log()'s hot path unless a row is open, the run is over or the sink has
        none (rank_aware=False rows carry `_rank`). Caller holds the lock."""
        closed = self._open is not None or self._finished or self._detached
        self._append = None if closed else self._sink.fast_append

    def _settle(self) -> None:
        """Fold the hot path's rows (each one step past `_mark`) into `_rows` and `_last`.
        Caller holds the lock and calls it before changing `_step` any other way."""
        n = self._step - self._mark
        if n:
            self._mark = self._step  # first: an unlocked reader may see too few, never too many
            self._last = self._step - 1
            self._rows += n

    @property
    def _rows_committed(self) -> int:
        """Rows committed by this process (the probe watches it change, without the lock)."""
        return self._rows + self._step - self._mark

    @property
    def _last_step(self) -> int | None:
        """The step of the last committed row, None before the first."""
        return self._step - 1 if self._step != self._mark else self._last

    def _commit(self, at: float | None = None) -> None:
        """Hand the open row to the sink and advance the step; its `_time` is `at`, else
        now. Caller holds the lock."""
        self._settle()
        step = self._step
        self._step = self._mark = step + 1
        row = self._open
        self._open = None
        self._reopen()
        if not row and not self._spans.pending:
            return
        record = {"_step": step, "_time": time.time() if at is None else at}
        if not self.rank_aware:
            record["_rank"] = self.rank
        if row:
            record.update(row)
        if self._spans.pending:
            _drain(self._spans, record)
        self._rows += 1
        self._last = step
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
            self._rows += 1
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
            self._sink.rules_changed(self._ruleset)
            self._reopen()
        return parsed.name

    def remove_alert_rule(self, name: str) -> bool:
        """Remove a rule by name; False if there was none."""
        with self._lock:
            removed = self._ruleset.remove(name) if self._ruleset is not None else False
            self._sink.rules_changed(self._ruleset)
            self._reopen()
        return bool(removed)

    # -- config ------------------------------------------------------------
    def update_config(self, values: Mapping[str, Any]) -> None:
        """Merge `values` into the run's config (top-level keys replaced), in the sidecar.

        Direct mode rewrites the sidecar within a second; spool mode sends a `config`
        event that exprd applies. Raises TypeError naming a key JSON cannot hold.
        """
        merged = merge_config(self.config, values)
        with self._lock:
            if self._finished:
                raise UsageError("this run is finished; call expr_tracker.init() to start another")
            if self._detached or merged == self.config:
                return
            # a new dict, never changed in place: the background thread may be writing the
            # sidecar from the old one
            self.config = merged
            self._sink.config_changed(merged)
            self._sidecar_due = True

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
                        # the loop went quiet with a row open: commit it, dated when it was
                        # logged, and not as the loop's activity (a stalled rank stays silent
                        # to its probe and to the watchers)
                        self._commit(time.time() - (now - self._last_log))
                        self._prober.own_row()
                    if now - last_rules >= self.time_rule_interval:
                        last_rules = now
                        self._sink.tick()
                if self._system is not None:
                    self._log_system()  # what its thread sampled, before the flush
                self._prober.tick(now)
                self._sink.flush()
                if now - last_sidecar >= SIDECAR_EVERY or self._sidecar_due:
                    last_sidecar = now
                    self._sidecar_due = False
                    self._sink.checkpoint()
            except BaseException as exc:  # the tracker must never take the process down
                # (BaseException: a library that raises SystemExit or KeyboardInterrupt on
                # this thread would end it, and with it every flush until finish)
                self.warn_once(f"background:{type(exc).__name__}", f"expr_tracker: background error: {exc!r}")

    def _log_system(self, final: bool = False) -> None:
        """Log the system-metrics samples its thread took (DESIGN 19; `final`: the one at
        finish, waited for a bounded time) as rank records of this rank at its last
        committed step: they never advance the step. Never raises."""
        assert self._system is not None
        try:
            for metrics in self._system.last() if final else self._system.take():
                self._log_sample(metrics)
            stuck = self._system.stuck_for
            if final and stuck is not None:
                self.warn_once("system:stuck", f"expr_tracker: a system-metrics sample has not "
                               f"returned for {stuck:.1f}s (a hung GPU library call?); its "
                               "samples were skipped, the rows are all written")
        except Exception as exc:  # the tracker must never take the process down
            self.warn_once(f"system:{type(exc).__name__}", f"expr_tracker: system metrics: {exc!r}")

    def _log_sample(self, metrics: dict[str, float]) -> None:
        with self._lock:
            if self._detached:
                return
            last = self._last_step
            step = last if last is not None else self._step
            record, nonfinite = records.rank_record(
                metrics, step, self.rank, self.world_size, self.local_rank, 1.0,
                records.SAMPLE_SOURCE)
            self._rows += 1
            self._prober.own_row()  # same thread as its tick: not the loop's activity
            self._sink.apply(record, nonfinite)

    def final_summary(self) -> dict[str, Any]:
        """The last committed value of each key (read back from the tail of this process's
        own shard or spool file: nothing on the hot path), with `summary`'s values over them."""
        try:
            found = self._sink.last_values()  # (direct mode: {} while the run root hangs)
        except OSError:
            found = {}
        return {**found, **self.summary}

    def finish(self, status: str = "finished", exit_code: int | None = None) -> None:
        """Commit the open row, flush, write the sidecar, drain alerts and backends. Idempotent.

        `exit_code` (0.4's `finish(exit_code=1)`): a non-zero code finishes the run as crashed,
        with the code in the sidecar's `exit`."""
        if exit_code is not None:
            if isinstance(exit_code, bool) or not isinstance(exit_code, int):
                raise TypeError(f"exit_code must be an int, got {type(exit_code).__name__}")
            if exit_code != 0:
                status = "crashed"
                if self._exit is None:
                    self._exit = {"type": "exit_code", "message": f"exit code {exit_code}",
                                  "code": exit_code, "time": time.time()}
        try:
            self._finish(status)
        except KeyboardInterrupt:
            # Ctrl-C while finish() waits (on the root, a backend): the shard is still
            # closed with its status, within about a second more, as at SIGTERM (not left
            # `running`, its queued rows lost); then the interrupt goes on to the caller
            self._interrupted(status)
            raise

    def _finish(self, status: str) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._append = None
            if self._detached:
                return
            _spans.deactivate(self._spans)
            if self._open or self._spans.pending:  # spans closed after the last log() too
                self._commit()
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        self._prober.close()
        if self._system is not None:
            self._log_system(final=True)  # the last sample, covering the run's end
        try:
            self._sink.flush()
            self._sink.set_summary(self.final_summary())
        except Exception as exc:  # a summary never stops the finish
            self.warn_once("summary", f"expr_tracker: cannot save the summary: {exc!r}")
        self._sink.close(status, self._exit if status == "crashed" else None)
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

    def _interrupted(self, status: str) -> None:
        """A KeyboardInterrupt cut finish() short: close the shard as `_terminate` does,
        with Ctrl-C ignored for that second (the main thread's handler, put back after)."""
        if self._detached:
            return
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if main else None
        try:
            if main:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            if self.mode == "direct":
                self._sink.writer.exit = self._exit if status == "crashed" else None
            self._terminate(status)
        except Exception:  # (as at exit: tracking never raises over the interrupt)
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _terminate(self, status: str = "crashed") -> None:
        """SIGTERM, or a KeyboardInterrupt that cut the exit path's finish() short: save
        what can be saved (the shard closed with `status`), then let the process die.

        The handler runs on the main thread between two bytecodes, possibly inside
        log() or flush() with their locks held: so every lock is taken with a timeout,
        and backends and alert delivery are not waited for.
        """
        if self._lock.acquire(timeout=0.5):
            try:
                if self._open and not self._finished and not self._detached:
                    self._commit()
                self._finished = True
                self._append = None
            finally:
                self._lock.release()
        self._stop.set()
        self._sink.writer.close(status, flush_timeout=1.0)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc_type, type) and isinstance(exc, BaseException):
            self._crashed_by(exc_type, exc, None)
        self.finish("crashed" if exc_type is not None and exc_type is not KeyboardInterrupt else "finished")

    def _crashed_by(self, exc_type: type, exc: BaseException | None, thread: str | None) -> None:
        """Remember the exception that ends the run, for the sidecar's `exit` (the first wins)."""
        if self._exit is None and exc_type is not KeyboardInterrupt:
            message = str(exc) if exc is not None else ""
            self._exit = {"type": exc_type.__name__, "message": message[:1000],
                          "time": time.time()}
            if thread is not None:
                self._exit["thread"] = thread

    def _after_fork_in_child(self) -> None:
        """A forked child (a dataloader worker) must never write the parent's buffered rows."""
        self._detached = True
        self._append = None
        _spans.deactivate(self._spans)  # a worker's spans would pile up unread
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

    def history(
        self,
        n: int | None = 50,
        *,
        metrics: list[str] | str | None = None,
        step_range: Any = None,
        run: str | os.PathLike[str] | None = None,
        stream: Any = ...,
        rank: int | None = None,
        output_type: str = "dict",
        include_meta: bool = True,
    ) -> Any:
        """The last `n` committed rows of this run; see `expr_tracker.history`."""
        from expr_tracker import query

        if run is not None or (stream is not ... and stream != self.stream) or (
            rank is not None and rank != self.rank
        ):
            where = self.paths.run_dir if run is None else run
            return query.history(n, metrics=metrics, step_range=step_range, run=where,
                                 stream=stream, rank=rank, output_type=output_type,
                                 include_meta=include_meta)
        metric_list, rng = query.history_args(n, metrics, step_range, output_type)
        self.flush()  # read-your-writes
        if self.mode == "spool":
            rows = self._sink.history(n, metric_list, rng)
        else:
            from expr_tracker.store.reader import ShardReader, select_rows

            rows = select_rows(ShardReader(self.paths.shard), n, metrics=metric_list, step_range=rng)
        return query.to_output(query.strip_meta(rows, include_meta), output_type)

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
                "system_metrics": None if self._system is None else {
                    "interval": self._system.interval, "samples": self._system.samples,
                    "gpu": self._system.gpu},
            }
        out.update(self._sink.info())
        out["dropped"] = {**self.dropped, **out.get("dropped", {})}
        return out
