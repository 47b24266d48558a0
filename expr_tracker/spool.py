"""Spool mode (DESIGN 6): the SDK appends events to a node-local spool file; exprd applies them.

A spool file is `{spool}/{project}/{name}/{shard-stem}.{session}.jsonl`. Line 1 is an
`init` event (identity, run dir, config, rule texts, rank/backend/alert options, never a
secret), then one line per record (the record plus `_seq`), `alert`, `rules` and
`config` events, and a `finish` event. Every line has `_seq` 0, 1, 2, ...; the event id is
`{session}:{seq}`. The training process evaluates no rules and opens no connection.
"""

from __future__ import annotations

import dataclasses
import os
import re
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
from expr_tracker.store.layout import ShardPaths, spool_path
from expr_tracker.store.lock import ShardBusyError, lock_writer
from expr_tracker.store.reader import ShardReader, select_rows
from expr_tracker.store.shard import ShardWriter
from expr_tracker.store.spoolfile import (
    HEARTBEAT,
    HEARTBEAT_STALE,
    SEQ_RE,
    SPOOL_VERSION,
    line_seq,
    make_private_dirs,
    pending_of,
    scan_shard,
    unapplied_rows,
)

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
    """The spool-mode sink of a Run: one O_APPEND spool file, buffered like a shard."""

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
        self.seq = 0  # the next event number; Run's hot path numbers records with it too
        self._shift = 0  # after a rotation: original seq - seq in the current file
        self._rotations = 0
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
        self.writer = ShardWriter(
            ShardPaths(self.path.parent, self.path.name[: -len(".jsonl")]),
            {},
            write_sidecar=False,
            warn=run.warn_once,
            dropped=run.dropped,
        )
        self.writer.on_deleted = self._rotate
        self.writer.is_current = self._is_current
        self.writer.open()
        check_consumer(run)
        # rank_aware=False records carry `_rank`, which Run's fast path does not add
        # Run.log's hot path queues whole record lines, `_seq` included (it numbers them)
        self.fast_append = self.writer.queue if run.rank_aware else None
        self.after_write = None  # exprd runs the rules and backends
        self._emit(init_event(run, self.path))
        self.writer.flush()  # exprd learns about the run at once

    # -- a spool file deleted or moved under us (issue 10 case 5, issue 20) -----------

    def _is_current(self, fd: int) -> bool:
        """Is `fd` still the file at our spool path? Checked before every flush (one stat).

        A file moved away (`mv f f.1`, then maybe `cp f.1 f`: logrotate without
        copytruncate) is still open here but no longer read by exprd, which follows the
        name: rows written to it would be lost and its missing `finish` would mark the
        run crashed. So a path that is gone or names another inode means: a new session.
        """
        try:
            at = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell (EACCES, EMFILE): keep writing where we are
        mine = os.fstat(fd)
        return (at.st_ino, at.st_dev) == (mine.st_ino, mine.st_dev)

    def _rotate(self) -> None:
        """The spool file was deleted or moved: go on in a new file of a new session.

        Called by the writer under its lock before it opens the new file. A spool file
        without an init event is never applied, so the new file starts with one (same
        run, same options, a new session id); the lines that had not been written yet
        keep their order and are renumbered from 1 as they are written (`_renumber`),
        so the hot path keeps numbering as it did and takes no extra lock.
        """
        old = self.path
        run = dataclasses.replace(self.run, session=os.urandom(6).hex())
        self.path = spool_path(run.spool_root, run.project, run.name, run.paths.stem, run.session)
        self.writer.paths = ShardPaths(self.path.parent, self.path.name[: -len(".jsonl")])
        self._session_ctx = run
        self._rotations += 1
        self.run.warn_once(
            "spool_deleted",
            f"expr_tracker: spool file {old} was deleted or moved while in use; going on in "
            f"a new session {self.path.name} (if it was deleted, rows exprd had not read "
            "from it yet are lost)",
        )
        try:
            make_private_dirs(self.path.parent)
        except OSError:
            pass  # the open that follows fails, is reported and retried
        self.writer.transform = self._renumber

    def _renumber(self, data: bytes, offset: int) -> bytes:
        """Lines for a file started by `_rotate`: its init event first, `_seq` from 1."""
        head = b""
        if offset == 0:
            first = line_seq(data[: data.find(b"\n")])
            self._shift = (first if first is not None else self.seq) - 1
            head = orjson.dumps(init_event(self._session_ctx, self.path),
                                option=orjson.OPT_APPEND_NEWLINE)
        shift = self._shift

        def renum(m: re.Match[bytes]) -> bytes:
            return m.group(1) + b'"_seq":' + str(int(m.group(2)) - shift).encode()

        return head + SEQ_RE.sub(renum, data)

    # -- writing --------------------------------------------------------------------

    def _emit(self, event: dict[str, Any]) -> None:
        seq = self.seq
        event["_seq"] = seq
        self.seq = seq + 1
        self.writer.append(orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE))

    def apply(self, record: dict[str, Any], nonfinite: bool | None) -> None:
        """Append one record event (the record plus `_seq`)."""
        seq = self.seq
        self.seq = seq + 1
        record["_seq"] = seq
        self.writer.append(records.dumps(record, nonfinite))

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
        of it is harmless); a later init (after a rotation) carries it too."""
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
        self.writer.flush()

    def tick(self) -> None:
        """Time rules are evaluated by exprd, not here."""

    def checkpoint(self) -> None:
        """Nothing to do: the spool has no sidecar."""

    def set_summary(self, summary: dict[str, Any]) -> None:
        """`Run.finish`: the finish event carries the summary, which exprd puts in the sidecar."""
        self._summary = summary

    def close(self, status: str, exit: dict[str, Any] | None = None) -> None:
        """The finish event; `exit` (a crash's {type, message, time}) and the summary go
        into the sidecar."""
        event: dict[str, Any] = {"_event": "finish", "_time": time.time(), "status": status}
        if exit is not None:
            event["exit"] = exit
        if self._summary:
            event["summary"] = self._summary
        self._emit(event)
        self.writer.close("finished")
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = None

    def detach(self) -> None:
        # a forked child shares the parent's descriptor: forget the buffer, never flush it
        self.writer._buf.clear()
        self.writer._pending = b""
        if self._lock_fd is not None:  # the parent keeps the lock (see forget_lock)
            os.close(self._lock_fd)
            self._lock_fd = None

    def info(self) -> dict[str, Any]:
        return {
            "spool_file": str(self.path),
            "spool_seq": self.seq - self._shift,
            "session": self.path.name[len(self.run.paths.stem) + 1 : -len(".jsonl")],
            "buffered_bytes": self.writer.buffered(),
            "errors": dict(self.writer.errors),
            "alerting": self.alerting,
            "reporting": self.reporting,
            "alerts_fired": {},
            "alerts": {},
            "backends": {},
        }

    # -- reading --------------------------------------------------------------------
    def history(
        self, n: int | None, metrics: list[str] | None, step_range: tuple[int | None, int | None] | None
    ) -> list[dict[str, Any]]:
        """Read-your-writes: the shard's rows, then this shard's spool events not applied yet."""
        self.writer.flush()
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

