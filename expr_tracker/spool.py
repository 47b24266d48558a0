"""Spool mode (DESIGN 6): the SDK appends events to a node-local spool; exprd applies them.

A session's spool is a chain of segments `{spool}/{project}/{name}/{shard-stem}.{session}.jsonl`,
`...{session}~1.jsonl`, ... (`store.segment`: a row per write, sized to the disk, rolled at a
size bound, deleted by exprd once applied). Each segment's line 1 is an `init` event (identity, run dir,
config, rule texts, rank/backend/alert options, never a secret; past the first segment
also `segment` and `first_seq`), then one line per record (the record plus `_seq`),
`alert`, `rules` and `config` events, and at the end a `segment` marker (the session goes
on in the next one) or the `finish` event. Events are numbered `_seq` 1, 2, ... across
segments (the init is 0); the event id is `{session}:{seq}`. The training process
evaluates no rules and opens no connection.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.context import RunContext
from expr_tracker.errors import UsageError
from expr_tracker.procs import proc_start
from expr_tracker.store import records
from expr_tracker.store.diskroom import MAX_SEGMENT, MIN_SEGMENT, SEGMENT_BYTES
from expr_tracker.store.layout import ShardPaths, spool_path
from expr_tracker.store.lock import ShardBusyError, lock_writer
from expr_tracker.store.reader import ShardReader, last_values_of, select_rows
from expr_tracker.store.safedir import make_private_dirs
from expr_tracker.store.segment import BUFFER_BYTES, MAX_BUFFER, Segments, Warn
from expr_tracker.store.spoolfile import (
    HEARTBEAT,
    HEARTBEAT_STALE,
    SEQ_RE,
    SPOOL_VERSION,
    is_note,
    pending_of,
    scan_shard,
    unapplied_rows,
)

FINISH_WAIT = 10.0  # seconds finish() waits for a full spool to take the rows in memory
MAX_FINISH_WAIT = 600.0  # the largest EXPR_SPOOL_FINISH_WAIT accepted
SPANS_PER_EVENT = 4096  # spans of one `spans` event (a line stays well under exprd's cap)
# backend spec keys that never carry a secret; everything else stays out of the spool
_SAFE_BACKEND_KEYS = ("type", "name", "entity", "project", "mode", "token_env", "batch",
                      "timeout", "retries", "backoff")


def backend_spec_for_spool(spec: str | Mapping[str, Any]) -> str | dict[str, Any]:
    """A backend spec with every key that could hold a secret (urls, tokens) removed."""
    if isinstance(spec, str):
        return spec
    return {k: v for k, v in spec.items() if k in _SAFE_BACKEND_KEYS}


def init_event(run: RunContext, session_path: Path) -> dict[str, Any]:
    """The first line of a spool file: everything exprd needs to apply the run, no secret."""
    ruleset = run.ruleset
    channels: list[str] = []
    if run.alert_config is not None:
        channels = [c.name for c in run.alert_config.channels]
    return {
        "_event": "init",
        "_seq": 0,
        "_time": time.time(),
        "version": SPOOL_VERSION,
        "identity": run.identity(),
        "dir": str(run.root),  # absolute since init
        "stem": run.paths.stem,
        "spool_file": session_path.name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": proc_start(os.getpid()),
        "rules": [r.to_spec() for r in ruleset.rules] if ruleset is not None else [],
        "alert_on_rank": run.alert_on_rank,
        "alert_channels": channels,
        "backend_on_rank": run.backend_on_rank,
        "backend_rank_metrics": run.backend_rank_metrics,
        "backends": [backend_spec_for_spool(s) for s in run.backend_specs],
        "time_rule_interval": run.time_rule_interval,
    }


def env_knob(name: str, default: float, low: float, high: float, warn: Warn,
             integer: bool = True) -> Any:
    """A tuning knob from the environment, checked: a value that is not a number, is not
    finite, or is below `low` is one warning and the default; one above `high` is one
    warning and `high`. Never an exception at init."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip()) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or math.isnan(value) or math.isinf(value) or value < low:
        warn(f"env:{name}", f"expr_tracker: {name}={raw!r} is not "
             f"{'an integer' if integer else 'a number'} from {low:g} to {high:g}; using the "
             f"default, {default:g}")
        return default
    if value > high:
        warn(f"env:{name}", f"expr_tracker: {name}={raw!r} is above its bound; using {high:g}")
        return type(default)(high)
    return value


def check_consumer(run: RunContext) -> None:
    """Warn once when no exprd has left a heartbeat in the spool root lately: the rows
    are safe in the spool, but nothing applies them until one starts."""
    beat = run.spool_root / HEARTBEAT
    try:
        info = orjson.loads(beat.read_bytes())
        age = time.time() - float(info["time"])
    except (OSError, ValueError, KeyError, TypeError):
        age = None
    if age is not None and age <= HEARTBEAT_STALE:
        return
    seen = "no exprd heartbeat" if age is None else f"exprd's last heartbeat is {age:.0f} s old"
    run.warn_once(
        "no_consumer",
        f"expr_tracker: no exprd is running for spool {run.spool_root} ({seen} in {HEARTBEAT}); "
        "rows are kept in the spool until one starts (or `expr replay`)",
    )


def _strip(rec: dict[str, Any]) -> dict[str, Any]:
    rec.pop("_sid", None)
    rec.pop("_seq", None)
    return rec


class _ListReader(ShardReader):
    """A ShardReader over records already in memory (for `select_rows`)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        super().__init__(os.devnull)
        self.rows = rows

    def iter_records(self, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        yield from enumerate(self.rows)

    def iter_reverse(self) -> Iterator[dict[str, Any]]:
        return reversed(self.rows)


class SpoolSink:
    """The spool-mode sink of a Run: a chain of segments (`store.segment`).

    Every method is called with the run's lock held, except `flush` and `close`, which
    take it (or run after the hot path closed): the segments' state has one writer at a time.
    """

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.path = spool_path(run.spool_root, run.project, run.name, run.paths.stem, run.session)
        self.alerting = False  # exprd evaluates rules and delivers alerts
        self.reporting = False
        self._summary: dict[str, Any] | None = None  # set by finish, sent in the finish event
        # a shared rank_aware=False shard resumes after this rank's own rows (DESIGN 5)
        own = None if run.rank_aware else run.rank
        cursor = scan_shard(run.paths, own)
        pending = pending_of(run.paths, self.path.parent, cursor, own)
        self.rows = cursor.rows + pending.rows
        last = cursor.last_step
        if pending.last_step is not None and (last is None or pending.last_step > last):
            last = pending.last_step
        self.last_step = last
        self.next_step = 0 if last is None else last + 1
        self.seq = 1  # the next event number (0 is the init); Run's hot path numbers records too
        try:
            make_private_dirs(self.path.parent)
        except OSError as exc:
            run.warn_once("spool_dir", f"expr_tracker: cannot create spool directory "
                                       f"{self.path.parent}: {exc.strerror or exc}")
        # one writer per shard in spool mode too: the lock sits in the node-local spool
        # directory, where exprd would otherwise apply two sessions of one rank into it
        try:
            self._lock_fd = lock_writer(ShardPaths(self.path.parent, run.paths.stem), run.rank,
                                        not run.rank_aware)
        except ShardBusyError as exc:
            raise UsageError(str(exc).replace(f"shard {self.path.parent / run.paths.stem}.jsonl",
                                              f"shard {run.paths.shard}")) from None
        warn = run.warn_once
        self.writer = Segments(
            self._segment_path, self._head,
            size=env_knob("EXPR_SPOOL_SEGMENT_BYTES", SEGMENT_BYTES, MIN_SEGMENT, MAX_SEGMENT,
                          warn),
            max_buffer=env_knob("EXPR_SPOOL_BUFFER_BYTES", BUFFER_BYTES, 1, MAX_BUFFER, warn),
            warn=warn, dropped=run.dropped)
        self.finish_wait = env_knob("EXPR_SPOOL_FINISH_WAIT", FINISH_WAIT, 0.0, MAX_FINISH_WAIT,
                                    warn, integer=False)
        self.writer.open_first()
        self.path = self.writer.path
        check_consumer(run)
        # Run.log's hot path writes whole record lines, `_seq` included (it numbers them),
        # with the open segment's `fast_append` (os.write), checking `writer.end` and
        # `writer.limit`; rank_aware=False records carry `_rank`, which it does not add
        self.fast_append = self.writer.fast_append if run.rank_aware else None
        self.on_switch: Any = None  # Run: `fast_append` changed (called under the run's lock)
        self.writer.on_switch = self._switched
        self.writer.new_session = self._new_session
        self.writer.next_seq = lambda: self.seq
        self.after_write = None  # exprd runs the rules and backends
        self.mark = None  # rows are in the kernel once written: no step mark needed

    def _segment_path(self, index: int) -> Path:
        run = self.run
        return spool_path(run.spool_root, run.project, run.name, run.paths.stem, run.session,
                          index)

    def _head(self, index: int, first_seq: int) -> bytes:
        """A segment's first line: the init event (the current rules and config), and past
        the first segment where its events start."""
        ev = init_event(self.run, self._segment_path(index))
        if index:
            ev["segment"] = index
            ev["first_seq"] = first_seq
        return orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)

    def _switched(self) -> None:
        self.path = self.writer.path
        self.fast_append = self.writer.fast_append if self.run.rank_aware else None
        if self.on_switch is not None:
            self.on_switch()

    def _new_session(self, lines: list[bytes]) -> list[bytes]:
        """The spool file was deleted or moved (logrotate without copytruncate): the run
        goes on in a new session (same run, same options), the lines not written yet
        numbered from 1 in it, in their order (a copy of the moved file may come back and
        be applied after them)."""
        self.run = dataclasses.replace(self.run, session=os.urandom(6).hex())
        seq = 1
        out = []
        for chunk in lines:
            renumbered = []
            for line in chunk.splitlines(keepends=True):
                m = SEQ_RE.search(line)
                if m is not None and not is_note(line):
                    line = line[: m.start(2)] + b"%d" % seq + line[m.end(2) :]
                    seq += 1
                renumbered.append(line)
            out.append(b"".join(renumbered))
        self.seq = seq
        return out

    def overflow(self, line: bytes, got: int | OSError | None = None) -> None:
        """A record the hot path did not write into the open segment: it is full, or its
        write failed (`got`: the error, or how many bytes of it were written)."""
        if got is not None:
            self.writer.unwritten(got)
        if not self.writer.overflow(line):
            self.seq -= 1  # dropped: its number goes to the next event (no gap for exprd)

    # -- writing --------------------------------------------------------------------

    def _put(self, line: bytes, record: bool) -> None:
        if self.writer.fast_append is not None:  # a segment is open, nothing waits
            try:
                self.writer.append(line)
                return
            except ValueError:
                pass  # the segment is full, or the write failed
        if not self.writer.overflow(line, record):
            self.seq -= 1

    def _emit(self, event: dict[str, Any]) -> None:
        seq = self.seq
        event["_seq"] = seq
        self.seq = seq + 1
        self._put(orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE), False)

    def apply(self, record: dict[str, Any], nonfinite: bool | None) -> None:
        """Append one record event (the record plus `_seq`)."""
        seq = self.seq
        self.seq = seq + 1
        record["_seq"] = seq
        self._put(records.dumps(record, nonfinite), True)

    def alert(self, title: str, text: str, level: str) -> None:
        """A manual alert: exprd records it and delivers it from the alerting rank."""
        self._emit({"_event": "alert", "_time": time.time(), "title": title, "text": text,
                    "level": level})

    def rules_changed(self, ruleset: Any) -> None:
        """Rules were added or removed: the spool carries the new rule texts."""
        self.run.ruleset = ruleset
        specs = [r.to_spec() for r in ruleset.rules] if ruleset is not None else []
        self._emit({"_event": "rules", "_time": time.time(), "rules": specs})

    def config_changed(self, config: dict[str, Any]) -> None:
        """`Run.update_config`: a `config` event with the whole merged config (a replay
        of it is harmless); the next segment's init carries it too."""
        self.run.config = config
        self._emit({"_event": "config", "_time": time.time(), "config": config})

    def set_probe(self, probe: dict[str, Any] | None) -> None:
        """Where the silent process is (None: it logs again): a `probe` event that exprd
        writes into the sidecar."""
        self._emit({"_event": "probe", "_time": time.time(), "probe": probe})

    def spans(self, lines: list[dict[str, Any]]) -> None:
        """Traced spans: `spans` events that exprd appends to `spans[.rankN].jsonl`."""
        for i in range(0, len(lines), SPANS_PER_EVENT):
            self._emit({"_event": "spans", "_time": time.time(),
                        "spans": lines[i : i + SPANS_PER_EVENT]})

    def flush(self) -> None:
        """Rows are in the kernel once written; this sends what waits in memory (a full
        spool), checks that the segment is still ours and wakes exprd up."""
        lock = self.run.lock
        if lock is None:
            self.writer.check()
            return
        if lock.acquire(timeout=5.0):
            try:
                if not self.writer.closed:
                    self.writer.check()
            finally:
                lock.release()

    def tick(self) -> None:
        """Time rules are evaluated by exprd, not here."""

    def checkpoint(self) -> None:
        """Nothing to do: the spool has no sidecar."""

    def set_summary(self, summary: dict[str, Any]) -> None:
        """`Run.finish`: the finish event carries the summary, which exprd puts in the sidecar."""
        self._summary = summary

    def last_values(self) -> dict[str, Any]:
        """The last value of each key in the open segment (the summary finish saves)."""
        return last_values_of(self.writer.data())

    def close(self, status: str, exit: dict[str, Any] | None = None) -> None:
        """The finish event; `exit` (a crash's {type, message, time}) and the summary go
        into the sidecar. Always written: space for it is kept in every segment."""
        event: dict[str, Any] = {"_event": "finish", "_time": time.time(), "status": status}
        if exit is not None:
            event["exit"] = exit
        if self._summary:
            event["summary"] = self._summary
        event["_seq"] = self.seq
        self.seq += 1
        self.writer.finish(orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE),
                           self.finish_wait)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = None

    def detach(self) -> None:
        # a forked child shares the parent's descriptor: let go of it, never write with it
        self.writer.crash_close()
        if self._lock_fd is not None:  # the parent keeps the lock (see forget_lock)
            os.close(self._lock_fd)
            self._lock_fd = None

    def info(self) -> dict[str, Any]:
        w = self.writer
        out = {
            "spool_file": str(self.path),
            "spool_seq": self.seq,
            "session": self.run.session,
            "buffered_bytes": w.buffered(),
            "buffer_bytes": w.max_buffer,
            "finish_wait": self.finish_wait,
            "errors": dict(w.errors),
            "alerting": self.alerting,
            "reporting": self.reporting,
            "alerts_fired": {},
            "alerts": {},
            "backends": {},
            **w.info(),
        }
        if w.drops:
            out["spool_full_since"] = w.drops_since
        return out

    # -- reading --------------------------------------------------------------------
    def history(
        self, n: int | None, metrics: list[str] | None, step_range: tuple[int | None, int | None] | None
    ) -> list[dict[str, Any]]:
        """Read-your-writes: the shard's rows, then this shard's spool events not applied yet."""
        paths = self.run.paths
        cursor = scan_shard(paths)
        if n is not None and n >= 0 and not metrics and step_range is None:
            # the common `history(5)`: only the last n rows are read, from the end
            fresh = [_strip(r) for r in unapplied_rows(paths, self.path.parent, cursor, limit=n)]
        else:
            fresh = [_strip(r) for r in unapplied_rows(paths, self.path.parent, cursor)]
        newer = select_rows(_ListReader(fresh), None, metrics=metrics, step_range=step_range)
        if n is not None and 0 <= n <= len(newer):
            return newer[len(newer) - n :]
        older: list[dict[str, Any]] = []
        if paths.shard.exists():
            want = None if n is None or n < 0 else n - len(newer)
            older = [_strip(r) for r in select_rows(ShardReader(paths.shard), want,
                                                    metrics=metrics, step_range=step_range)]
        return older + newer

