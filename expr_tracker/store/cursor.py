"""Where a shard stands: its cursor (bytes, rows, last step, applied spool seqs), the
sidecar hint it starts from, the repair of a torn tail on resume (DESIGN 5).

The shard file is the truth; the sidecar `<stem>.meta.json` is a hint that a writer repairs
from the file when they disagree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store import records
from expr_tracker.store.layout import ShardPaths
from expr_tracker.store.safedir import open_read, write_all, write_atomic_at

MAX_SIDECAR = 64 << 20  # bytes of a sidecar read: past it, not JSON of ours (read as none)

_READ_BLOCK = 256 * 1024

Opener = Callable[[str, int], int]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temp file, fsync, rename; never a half-written file."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(dfd, path.name, data)
    finally:
        os.close(dfd)


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """The sidecar as a dict, or None if missing or unreadable."""
    try:
        with open_read(path) as fh:
            data = orjson.loads(fh.read(MAX_SIDECAR + 1))
    except (OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Cursor:
    """Where a shard stands: bytes of complete lines, rows, largest step, applied spool seqs."""

    bytes: int = 0
    rows: int = 0
    last_step: int | None = None
    applied: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        nxt = 0 if self.last_step is None else self.last_step + 1
        return {
            "bytes": self.bytes,
            "rows": self.rows,
            "last_step": self.last_step,
            "next_step": nxt,
            "applied": dict(self.applied),
        }


def _scan(data: bytes, cursor: Cursor, base: int) -> None:
    """Advance `cursor` over the complete lines of `data` (which starts at file offset `base`)."""
    for _, line in records.iter_lines(data):
        cursor.rows += 1
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        step = rec.get("_step")
        if "_kind" not in rec and type(step) is int and (cursor.last_step is None or step > cursor.last_step):
            cursor.last_step = step
        sess, seq = rec.get("_sid"), rec.get("_seq")
        if type(sess) is str and type(seq) is int and seq >= cursor.applied.get(sess, -1):
            cursor.applied[sess] = seq
    cursor.bytes = base + data.rfind(b"\n") + 1


def repair_and_scan(paths: ShardPaths, hint: Mapping[str, Any] | None,
                    opener: Opener | None = None) -> tuple[Cursor, bool]:
    """Move a torn tail to `<shard>.torn`, truncate, and compute the cursor.

    Uses the sidecar hint to avoid rescanning the whole file when it is consistent.
    Returns (cursor, repaired) where repaired says the sidecar disagreed with the file.
    The caller holds whatever lock protects the shard. `opener(name, flags)` opens a
    file of the run directory (the writer's, which follows no symlink).
    """
    if opener is None:
        def opener(name: str, flags: int) -> int:
            return os.open(paths.run_dir / name, flags | os.O_CLOEXEC, 0o644)
    try:
        fd = opener(paths.shard.name, os.O_RDWR)
    except FileNotFoundError:
        return Cursor(), hint is not None and bool(hint.get("cursor", {}).get("bytes"))
    try:
        size = os.fstat(fd).st_size
        with open(fd, "rb", closefd=False) as fh:
            tail_start = records.complete_end(fh, _READ_BLOCK)
        original = size
        if tail_start < size:
            torn = os.pread(fd, size - tail_start, tail_start)
            tfd = opener(paths.torn.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                write_all(tfd, torn if torn.endswith(b"\n") else torn + b"\n")
                os.fsync(tfd)
            finally:
                os.close(tfd)
            os.ftruncate(fd, tail_start)
            size = tail_start
        hint_bytes = ((hint or {}).get("cursor") or {}).get("bytes")
        repaired = original != size or (original > 0 and hint_bytes != size)
        return cursor_from(fd, size, hint), repaired
    finally:
        os.close(fd)


def cursor_from(fd: int, size: int, hint: Mapping[str, Any] | None) -> Cursor:
    """The cursor of the first `size` bytes of a shard, reading only.

    Starts from the sidecar `hint` when its byte count ends on a line boundary, then
    scans the complete lines after it: the whole file only when the hint is no use.
    """
    cur = (hint or {}).get("cursor") or {}
    cursor = Cursor()
    hint_bytes = cur.get("bytes")
    if isinstance(hint_bytes, int) and 0 < hint_bytes <= size and _line_boundary(fd, hint_bytes):
        cursor.bytes = hint_bytes
        cursor.rows = int(cur.get("rows") or 0)
        step = cur.get("last_step")
        cursor.last_step = step if isinstance(step, int) else None
        cursor.applied = {str(k): int(v) for k, v in (cur.get("applied") or {}).items()}
    pos = cursor.bytes
    while pos < size:
        block = os.pread(fd, min(16 * _READ_BLOCK, size - pos), pos)
        last_nl = block.rfind(b"\n")
        if last_nl < 0:
            break
        _scan(block[: last_nl + 1], cursor, pos)
        pos = cursor.bytes
    return cursor


def last_row_step(data: bytes) -> int | None:
    """`_step` of the last step row (not a `_kind` record) in `data`, parsing just that line."""
    kind = b'{"_kind"'
    if kind in data and data.count(b"\n" + kind) + data.startswith(kind) == data.count(b"\n"):
        return None  # rank records only (exprd appends a block of them at once)
    end = len(data) - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        if not data.startswith(b'{"_kind"', start):
            try:
                step = orjson.loads(data[start:end]).get("_step")
            except (orjson.JSONDecodeError, AttributeError):
                return None
            return step if type(step) is int else None
        end = start - 1
    return None


def rank_last_step(fd: int, size: int, rank: int) -> int | None:
    """The largest `_step` of rank `rank`'s own step rows in a shared (rank_aware=False)
    shard, reading backwards from `size`: a rank's rows are appended in step order, so its
    last row holds its largest step. None if the rank has no row (a fresh rank starts at 0)."""
    needle = b'"_rank":%d' % rank
    end, carry = size, b""
    while end > 0:
        start = max(0, end - _READ_BLOCK)
        data = os.pread(fd, end - start, start) + carry
        lines = data.split(b"\n")
        carry = lines[0] if start > 0 else b""
        for line in reversed(lines[1:] if start > 0 else lines):
            if needle not in line or line.startswith(b'{"_kind"'):
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            step = rec.get("_step") if isinstance(rec, dict) else None
            if rec.get("_rank") == rank and "_kind" not in rec and type(step) is int:
                return step
        end = start
    return None


def _line_boundary(fd: int, offset: int) -> bool:
    """True if `offset` is the start of a line (the byte before it is a newline)."""
    return os.pread(fd, 1, offset - 1) == b"\n"


_CAUSES = {"spool_full": "spool disk full"}


def dropped_text(notes: Any) -> str | None:
    """A sidecar's `dropped` notes (DESIGN 6: rows that never reached the shard) in one
    phrase: "311 rows dropped, spool disk full on node1 since 2026-12-06 12:04:05" (the
    SDK could not spool them), "steps 138-150 not written: the process was killed" (direct
    mode, between two flushes); None if there are none."""
    if not isinstance(notes, list):
        return None
    rows, causes, hosts, since, killed = 0, [], [], [], []
    for note in notes:
        if not isinstance(note, dict) or type(note.get("rows")) is not int or note["rows"] <= 0:
            continue
        if note.get("cause") == "killed":
            first, last = note.get("from"), note.get("to")
            if type(first) is int and type(last) is int:
                killed.append(f"{first}" if first == last else f"{first}-{last}")
            continue
        rows += note["rows"]
        cause = _CAUSES.get(str(note.get("cause")), str(note.get("cause")))
        if cause not in causes:
            causes.append(cause)
        host = note.get("host")
        if isinstance(host, str) and host and host not in hosts:
            hosts.append(host)
        if isinstance(note.get("since"), (int, float)):
            since.append(float(note["since"]))
    out = []
    if rows:
        where = f" on {', '.join(hosts)}" if hosts else ""
        when = ""
        if since:
            import time

            when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(min(since)))
        out.append(f"{rows:,} row{'s' if rows != 1 else ''} dropped, {', '.join(causes)}"
                   f"{where}{when}")
    if killed:
        out.append(f"step{'s' if len(killed) > 1 or '-' in killed[0] else ''} "
                   f"{', '.join(killed)} not written: the process was killed")
    return "; ".join(out) or None
