"""`expr runs`' answer and the read-only shard inspection it shares with `expr shards`: each
shard's rows, last step, size, status and sidecar state, and each run's line.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection
from pathlib import Path
from typing import Any

from expr_cli.resolve import ShardRef, compact_ranks, list_runs, list_shards, stream_label
from expr_tracker.health.tail import ShardTail
from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.cursor import dropped_text, read_sidecar
from expr_tracker.store.reader import ShardReader

_BLOCK = 1 << 20  # counting lines
_TAIL = 16 << 10  # finding the end of the last complete line


def _count_lines(fd: int, start: int, end: int) -> int:
    n = 0
    pos = start
    while pos < end:
        try:  # a crash's hole (maybe a GiB) holds no line: jumped, not read
            pos = min(end, os.lseek(fd, pos, os.SEEK_DATA))
        except OSError:
            pass  # no data after pos (ENXIO: the loop reads nothing), or no SEEK_DATA here
        block = os.pread(fd, min(_BLOCK * 4, end - pos), pos)
        if not block:
            break
        n += block.count(b"\n")
        pos += len(block)
    return n


def _last_steps(ref: ShardRef) -> tuple[int | None, float]:
    """The largest `_step`, reading backwards to the last step row (step rows of a shard
    are in increasing step order; rank records after it may name any step; the sidecar's
    cursor is not used: the file is the truth), and how much later (the rank's own clock)
    than that row the shard's last record was logged: rank records and system samples
    keep a silent rank's shard growing, and are not steps."""
    best: int | None = None
    newest: float | None = None
    for rec in ShardReader(ref.path).iter_reverse():
        t = rec.get("_time")
        if newest is None and isinstance(t, (int, float)) and not isinstance(t, bool):
            newest = float(t)
        step = rec.get("_step")
        if type(step) is int:
            best = step if best is None else max(best, step)
            if rec.get("_kind") is None:
                after = newest - float(t) if newest is not None and isinstance(
                    t, (int, float)) and not isinstance(t, bool) else 0.0
                return best, max(0.0, after)
    return best, 0.0


def last_step_at(status: Any, mtime: float, after: float, meta: dict[str, Any] | None,
                 side_mtime: float | None) -> float | None:
    """When (epoch s, the filesystem's clock) a running shard wrote its last step row: its
    last write less what was logged after that row (its own clock), or earlier by its
    probe (how long its loop has been quiet, counted back from the sidecar's write). None
    when not running. A probe or a system sample keeps the files fresh: this is not."""
    if status != "running":
        return None
    at = mtime - after
    probe = (meta or {}).get("probe")
    if isinstance(probe, dict) and side_mtime is not None:
        since, t = probe.get("since"), probe.get("time")
        if isinstance(since, (int, float)) and isinstance(t, (int, float)):
            at = min(at, side_mtime - max(0.0, t - since))
    return at


def _pid_alive(pid: Any) -> bool:
    if type(pid) is not int or pid <= 0:
        return True  # unknown pid
    return pid_alive(pid)


def inspect_shard(ref: ShardRef, last_step: Any = False) -> dict[str, Any]:
    """Rows, last step, size, status and sidecar state of one shard, without modifying it
    (`last_step` when the caller knows it already)."""
    side = ref.sidecar
    meta = read_sidecar(side)
    corrupt = meta is None and side.exists()
    with open(ref.path, "rb") as fh:
        fd = fh.fileno()
        st = os.fstat(fd)
        complete = records.complete_end(fh, _TAIL)
        rows = _rows(fd, meta, complete)
    torn_saved = ref.path.with_name(ref.path.name + ".torn").exists()
    return _shard_row(ref, meta, corrupt, st.st_size, st.st_mtime, complete, rows, torn_saved,
                      last_step)


def inspect_tail(ref: ShardRef, tail: ShardTail, names: Collection[str],
                 last_step: Any = False) -> dict[str, Any]:
    """`inspect_shard`'s row from what a `RunReader` pass read of the shard already (its
    sidecar, size, mtime and the end of its last complete line) and the run directory's
    `names`: no second read of each shard (`expr shards` of 16,384 ranks read every one
    twice). The file is opened only to count the rows past a sidecar's cursor."""
    meta, complete = tail.sidecar, tail.offset
    ns = tail.mtime_ns  # `st_mtime` as `os.stat` computes it from the two halves
    mtime = ns // 1_000_000_000 + (ns % 1_000_000_000) * 1e-9
    hint, hint_rows = _hint(meta)
    if type(hint) is int and hint == complete and hint_rows is not None:
        rows = hint_rows  # (a line boundary: `complete` is one)
    else:
        try:
            fd = os.open(tail.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return inspect_shard(ref, last_step)
        try:
            rows = _rows(fd, meta, complete)
        finally:
            os.close(fd)
    return _shard_row(ref, meta, tail.sidecar_corrupt, tail.size, mtime, complete, rows,
                      ref.path.name + ".torn" in names, last_step)


def _hint(meta: dict[str, Any] | None) -> tuple[Any, int | None]:
    """The sidecar's cursor: its byte offset (any value) and its row count (if an int)."""
    cursor = (meta or {}).get("cursor") or {}
    rows = cursor.get("rows")
    return cursor.get("bytes"), rows if isinstance(rows, int) else None


def _rows(fd: int, meta: dict[str, Any] | None, complete: int) -> int:
    """The complete lines of the shard open as `fd`: the sidecar's row count up to its
    cursor when that is a line boundary, and those counted after it."""
    hint, hint_rows = _hint(meta)
    if (
        isinstance(hint, int) and hint_rows is not None and 0 <= hint <= complete
        and (hint == 0 or os.pread(fd, 1, hint - 1) == b"\n")
    ):
        return hint_rows + _count_lines(fd, hint, complete)
    return _count_lines(fd, 0, complete)


def _shard_row(ref: ShardRef, meta: dict[str, Any] | None, corrupt: bool, size: int,
               mtime: float, complete: int, rows: int, torn_saved: bool,
               last_step: Any) -> dict[str, Any]:
    status = (meta or {}).get("status")
    if status == "running" and meta and meta.get("host") == socket.gethostname() and not _pid_alive(meta.get("pid")):
        status = "stale"
    after = 0.0
    if last_step is False and rows:
        last_step, after = _last_steps(ref)
    try:
        side_mtime: float | None = os.stat(ref.sidecar, follow_symlinks=False).st_mtime
    except OSError:
        side_mtime = None
    hint = _hint(meta)[0]
    torn = size - complete
    if corrupt:
        sidecar, status = "corrupt sidecar", "corrupt"
    elif meta is None:
        sidecar = "missing"
    elif torn:
        sidecar = f"torn tail {torn} B"
    elif hint == complete:
        sidecar = "ok"
    elif status == "running" and type(hint) is int and hint < complete:
        sidecar = "behind"  # written every few seconds while running
    else:
        sidecar = "needs repair"
    return {
        "rank": ref.rank,
        "stream": ref.stream,
        "stream_text": stream_label(ref.stream),
        "file": ref.path.name,
        "path": str(ref.path),
        "rows": rows,
        "last_step": last_step if rows and last_step is not False else None,
        "last_step_at": last_step_at(status, mtime, after, meta, side_mtime),
        "size": size,
        "status": status,
        "last_write": mtime,
        "sidecar": sidecar,
        "torn_bytes": torn,
        "torn_saved": torn_saved,
        "world_size": (meta or {}).get("world_size"),
        "host": (meta or {}).get("host"),
        "dropped": dropped_text((meta or {}).get("dropped")),
    }


# a run is as bad as its worst shard
_STATUS_ORDER = ("crashed", "stale", "running", "finished")


def run_row(label: str, path: str, shard_rows: list[dict[str, Any]],
            offset: float = 0.0) -> dict[str, Any]:
    """One run's line from the inspection of its shards; its times on the reader's clock
    (`offset`: the filesystem's clock minus ours, `health.clock.fs_offset`)."""
    project, name = label.split("/", 1)
    statuses = {r["status"] for r in shard_rows}
    status = next((s for s in _STATUS_ORDER if s in statuses), None)
    steps = [r["last_step"] for r in shard_rows if r["last_step"] is not None]
    streams = sorted({r["stream"] for r in shard_rows}, key=lambda s: (s is not None, s or ""))
    ranks = sorted({r["rank"] for r in shard_rows})
    return {
        "project": project,
        "name": name,
        "path": path,
        "ranks": ranks,
        "ranks_text": compact_ranks(ranks),
        "streams": streams,
        "streams_text": [stream_label(s) for s in streams],
        "shards": len(shard_rows),
        "last_step": max(steps) if steps else None,
        "status": status,
        "last_write": _ours(max((r["last_write"] for r in shard_rows), default=None), offset),
        # the job's newest step row, of its running shards
        "last_step_at": _ours(max((t for r in shard_rows if (t := r.get("last_step_at"))
                                   is not None), default=None), offset),
    }


def _ours(t: float | None, offset: float) -> float | None:
    return None if t is None else t - offset




PARALLEL_SHARDS = 1024  # a run of this many shards is inspected in worker processes too


def _inspect_all(shards: list[ShardRef]) -> list[dict[str, Any]]:
    return [inspect_shard(s) for s in shards]


def runs_data(root: Path) -> list[dict[str, Any]]:
    """A line per run under `root` (an empty list when there is no root). The shards of a
    big run are inspected in worker processes too (a tail read and a sidecar each: 2-3 s
    of one core at 16,384 ranks)."""
    from expr_tracker.gcpause import paused_gc
    from expr_tracker.health.clock import dir_fs_offset
    from expr_tracker.stats import parallel

    found = list_runs(root) if root.is_dir() else []
    # mtimes are the filesystem's clock: moved onto ours, so that "last write 5s ago" holds
    # on a login node whose clock is off (issue 54: an hour ahead read "1h ago")
    offset = (dir_fs_offset(root) or 0.0) if found else 0.0
    out = []
    for r in found:
        shards = list_shards(r)
        if len(shards) < PARALLEL_SHARDS:
            rows = _inspect_all(shards)
        else:
            with paused_gc():
                rows = parallel.map_forked(_inspect_all, shards)
        row = run_row(r.label, str(r.path), rows, offset)
        _with_incidents(row, r.path)
        out.append(row)
    return out


def _with_incidents(row: dict[str, Any], run_dir: Path) -> None:
    """The run's open incidents (incidents.jsonl, whoever recorded them): their count and
    kinds, and a lost node's ranks read `lost` (its status too, unless a rank crashed); a
    job-wide silence makes a running run `silent` (as `expr top` says: the scheduler killed
    it), its ranks counted, not listed (16,383 of them)."""
    from expr_tracker.health.watch import open_incidents

    incs = open_incidents(run_dir)
    # None: no watcher keeps incidents for this run (as `expr serve`'s /api/runs says)
    row["open_incidents"] = len(incs) if os.path.lexists(run_dir / "incidents.jsonl") else None
    row["incident_kinds"] = sorted({i.kind for i in incs})
    lost = sorted({r for i in incs if i.kind == "lost" for r in i.ranks})
    row["lost"] = lost
    if lost and row["status"] == "running":
        row["status"] = "lost"
    row["silent"] = sum(len(i.ranks) for i in incs if i.kind == "silent")
    if row["silent"] and row["status"] == "running":
        row["status"] = "silent"


def runs_json(rows: list[dict[str, Any]], waiting: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `expr runs --json` prints: the runs, then runs that exist only in the spool so
    far, with status "spooled"."""
    have = {(r["project"], r["name"]) for r in rows}
    extra = [w for w in waiting if (w["project"], w["name"]) not in have]
    return [{k: v for k, v in r.items() if not k.endswith("_text")} for r in rows] + extra
