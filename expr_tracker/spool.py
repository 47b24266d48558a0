"""Spool mode (DESIGN 6): the SDK appends events to a node-local spool file; exprd applies them.

A spool file is `{spool}/{project}/{name}/{shard-stem}.{session}.jsonl`. Line 1 is an
`init` event (identity, run dir, config, rule texts, rank/backend/alert options, never a
secret), then one line per record (the record plus `_seq`), `alert` and `rules` events,
and a `finish` event. Every line has `_seq` 0, 1, 2, ...; the event id is
`{session}:{seq}`. The training process evaluates no rules and opens no connection.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from expr_tracker.store import records
from expr_tracker.store.layout import ShardPaths, spool_path
from expr_tracker.store.shard import (
    Cursor,
    ShardReader,
    ShardWriter,
    cursor_from,
    read_sidecar,
    select_rows,
)

if TYPE_CHECKING:
    from expr_tracker.run import Run

SPOOL_VERSION = 1
MAX_LINE = 16 * 1024 * 1024  # a longer spool line is quarantined by exprd
_BLOCK = 1024 * 1024
# backend spec keys that never carry a secret; everything else stays out of the spool
_SAFE_BACKEND_KEYS = ("type", "name", "entity", "project", "mode", "token_env", "batch",
                      "timeout", "retries", "backoff")
_SESSION_RE = r"[A-Za-z0-9_\-]+"


def event_id(session: str, seq: int) -> str:
    """The id of a spool event: the Idempotency-Key of every remote delivery of it."""
    return f"{session}:{seq}"


def proc_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None.

    Stored in the init event so exprd can tell a dead writer from a reused pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """True if process `pid` runs (not a zombie) and, when known, started at `start`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    tail = stat[stat.rfind(b")") + 2 :].split()
    if not tail or tail[0] in (b"Z", b"X"):
        return False
    return start is None or proc_start(pid) == start


def make_private_dirs(path: Path) -> None:
    """Create `path` and any missing parents with mode 0700 (the spool is private)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # the umask must not widen or narrow it


def backend_spec_for_spool(spec: str | Mapping[str, Any]) -> str | dict[str, Any]:
    """A backend spec with every key that could hold a secret (urls, tokens) removed."""
    if isinstance(spec, str):
        return spec
    return {k: v for k, v in spec.items() if k in _SAFE_BACKEND_KEYS}


def init_event(run: Run, session_path: Path) -> dict[str, Any]:
    """The first line of a spool file: everything exprd needs to apply the run, no secret."""
    ruleset = run._ruleset
    channels: list[str] = []
    if run._alert_config is not None:
        channels = [c.name for c in run._alert_config.channels]
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
        "backends": [backend_spec_for_spool(s) for s in run._backend_specs],
        "time_rule_interval": run.time_rule_interval,
    }


def spool_files_of(spool_dir: Path, stem: str) -> list[Path]:
    """Spool files of shard `stem` in one run's spool directory, oldest first."""
    pattern = re.compile(re.escape(stem) + r"\.(" + _SESSION_RE + r")\.jsonl\Z")
    try:
        names = [n for n in os.listdir(spool_dir) if pattern.match(n)]
    except OSError:
        return []
    paths = [spool_dir / n for n in names]
    return sorted(paths, key=_mtime)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def session_of(path: Path, stem: str) -> str:
    """The session part of `{stem}.{session}.jsonl`."""
    return path.name[len(stem) + 1 : -len(".jsonl")]


def scan_shard(paths: ShardPaths) -> Cursor:
    """The cursor of a shard (rows, largest step, applied spool seqs), reading only.

    Starts from the sidecar hint when it is consistent with the file, like the writer's
    repair scan, but never repairs: spool-mode processes and dry runs must not write.
    """
    try:
        fd = os.open(paths.shard, os.O_RDONLY)
    except OSError:
        return Cursor()
    try:
        return cursor_from(fd, os.fstat(fd).st_size, read_sidecar(paths.sidecar))
    finally:
        os.close(fd)


def iter_spool_events(path: Path) -> Iterator[dict[str, Any]]:
    """Every parseable event of a spool file, in order (unparseable lines are skipped)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the `with` below
    except OSError:
        return
    with fh:
        for _, data in records.complete_blocks(fh, 4 * _BLOCK):
            for _, line in records.iter_lines(data):
                try:
                    ev = records.loads(line)
                except ValueError:
                    continue
                if type(ev.get("_seq")) is int:
                    yield ev


def unapplied_rows(paths: ShardPaths, spool_dir: Path, cursor: Cursor) -> list[dict[str, Any]]:
    """Record events in the spool files of this shard that the shard does not hold yet."""
    out: list[dict[str, Any]] = []
    for path in spool_files_of(spool_dir, paths.stem):
        done = cursor.applied.get(session_of(path, paths.stem), -1)
        for ev in iter_spool_events(path):
            if "_event" not in ev and ev["_seq"] > done:
                out.append(ev)
    return out


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

    def __init__(self, run: Run) -> None:
        self.run = run
        self.path = spool_path(run.spool_root, run.project, run.name, run.paths.stem, run.session)
        self.alerting = False  # exprd evaluates rules and delivers alerts
        self.reporting = False
        cursor = scan_shard(run.paths)
        pending = unapplied_rows(run.paths, self.path.parent, cursor)
        self.rows = cursor.rows + len(pending)
        last = cursor.last_step
        for ev in pending:
            step = ev.get("_step")
            if "_kind" not in ev and type(step) is int and (last is None or step > last):
                last = step
        self.last_step = last
        self.next_step = 0 if last is None else last + 1
        run._spool_seq = 0  # Run's hot path numbers records; events here share the counter
        try:
            make_private_dirs(self.path.parent)
        except OSError as exc:
            run.warn_once("spool_dir", f"expr_tracker: cannot create spool directory "
                                       f"{self.path.parent}: {exc.strerror or exc}")
        self.writer = ShardWriter(
            ShardPaths(self.path.parent, self.path.name[: -len(".jsonl")]),
            {},
            write_sidecar=False,
            warn=run.warn_once,
            dropped=run.dropped,
        )
        self.writer.open()
        # rank_aware=False records carry `_rank`, which Run's fast path does not add
        # Run.log's hot path queues whole record lines, `_seq` included (it numbers them)
        self.fast_append = self.writer.queue if run.rank_aware else None
        self.after_write = None  # exprd runs the rules and backends
        self._emit(init_event(run, self.path))
        self.writer.flush()  # exprd learns about the run at once

    # -- writing --------------------------------------------------------------------

    def _emit(self, event: dict[str, Any]) -> None:
        seq = self.run._spool_seq
        assert seq is not None  # set in __init__
        event["_seq"] = seq
        self.run._spool_seq = seq + 1
        self.writer.append(orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE))

    def apply(self, record: dict[str, Any], nonfinite: bool | None) -> None:
        """Append one record event (the record plus `_seq`)."""
        seq = self.run._spool_seq
        assert seq is not None  # set in __init__
        self.run._spool_seq = seq + 1
        record["_seq"] = seq
        self.writer.append(records.dumps(record, nonfinite))

    def alert(self, title: str, text: str, level: str) -> None:
        """A manual alert: exprd records it and delivers it from the alerting rank."""
        self._emit({"_event": "alert", "_time": time.time(), "title": title, "text": text,
                    "level": level})

    def rules_changed(self) -> None:
        """Rules were added or removed: the spool carries the new rule texts."""
        ruleset = self.run._ruleset
        specs = [r.to_spec() for r in ruleset.rules] if ruleset is not None else []
        self._emit({"_event": "rules", "_time": time.time(), "rules": specs})

    def flush(self) -> None:
        self.writer.flush()

    def tick(self) -> None:
        """Time rules are evaluated by exprd, not here."""

    def checkpoint(self) -> None:
        """Nothing to do: the spool has no sidecar."""

    def close(self, status: str) -> None:
        event: dict[str, Any] = {"_event": "finish", "_time": time.time(), "status": status}
        if status == "crashed" and self.run._exit is not None:
            event["exit"] = self.run._exit  # for exprd to put in the shard's sidecar
        self._emit(event)
        self.writer.close("finished")

    def detach(self) -> None:
        # a forked child shares the parent's descriptor: forget the buffer, never flush it
        self.writer._buf.clear()
        self.writer._pending = b""

    def info(self) -> dict[str, Any]:
        return {
            "spool_file": str(self.path),
            "spool_seq": self.run._spool_seq,
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


class SpoolReader:
    """Reads the complete lines of a spool file from a byte offset, bounded in memory.

    `lines()` yields `(start, end, line)` with `end` the offset after the newline; `line`
    is None for a line longer than `max_line` (skipped without holding it in memory).
    An unterminated last line is not yielded: its writer may still be writing it.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_line: int = MAX_LINE,
                 block: int = _BLOCK) -> None:
        self.path = Path(path)
        self.max_line = max_line
        self.block = block
        self.size = 0  # the file size when `lines()` started
        self.more = False  # `lines()` stopped at its limit with more data after it

    def lines(self, offset: int, limit: int | None = None) -> Iterator[tuple[int, int, bytes | None]]:
        """Complete lines from `offset`; stops after about `limit` bytes at a line end."""
        for start, parts, big_end in self.chunks(offset, limit):
            if big_end is not None:
                yield start, big_end, None
                continue
            for line in parts:
                end = start + len(line) + 1
                yield start, end, (line if len(line) <= self.max_line else None)
                start = end

    def chunks(self, offset: int, limit: int | None = None
               ) -> Iterator[tuple[int, list[bytes], int | None]]:
        """`lines()` a block at a time: (offset of the first line, lines, None), or
        (start, [], end) for one line over `max_line` (a complete line in `parts` may
        also be longer than `max_line`: callers check)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = self.size = os.fstat(fd).st_size
            self.more = False
            stop = size if limit is None else min(size, offset + limit)
            pos = rd = offset  # pos: start of the line being assembled; rd: next read
            carry = b""
            oversize = False
            while rd < size:
                block = os.pread(fd, min(self.block, size - rd), rd)
                if not block:
                    break
                rd += len(block)
                if oversize:
                    nl = block.find(b"\n")
                    if nl < 0:
                        continue
                    end = rd - len(block) + nl + 1
                    yield pos, [], end
                    pos, oversize = end, False
                    block = block[nl + 1 :]
                data = carry + block if carry else block
                parts = data.split(b"\n")
                carry = parts.pop()
                if parts:
                    yield pos, parts, None
                    pos += len(data) - len(carry)
                if len(carry) > self.max_line:
                    oversize, carry = True, b""
                elif rd >= stop and pos > offset:
                    # progress made: a partial line is read again next time
                    self.more = rd < size
                    break
        finally:
            os.close(fd)
