"""`expr runs`' answer and the read-only shard inspection it shares with `expr shards`: each
shard's rows, last step, size, status and sidecar state, and each run's line.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from expr_cli.resolve import ShardRef, compact_ranks, list_runs, list_shards, stream_label
from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.cursor import read_sidecar
from expr_tracker.store.reader import ShardReader

_BLOCK = 1 << 20  # counting lines
_TAIL = 16 << 10  # finding the end of the last complete line


def _count_lines(fd: int, start: int, end: int) -> int:
    n = 0
    pos = start
    while pos < end:
        block = os.pread(fd, min(_BLOCK * 4, end - pos), pos)
        if not block:
            break
        n += block.count(b"\n")
        pos += len(block)
    return n


def _last_step(ref: ShardRef) -> int | None:
    """The largest `_step`, reading backwards to the last step row.

    Step rows of a shard are in increasing step order, so the last one holds the
    largest; rank records after it may name any step. The sidecar's cursor is not
    used: the file is the truth.
    """
    best: int | None = None
    for rec in ShardReader(ref.path).iter_reverse():
        step = rec.get("_step")
        if type(step) is int:
            best = step if best is None else max(best, step)
            if rec.get("_kind") is None:
                break
    return best


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
        cursor = (meta or {}).get("cursor") or {}
        hint, hint_rows = cursor.get("bytes"), cursor.get("rows")
        # trust the sidecar's row count up to its cursor when that is a line boundary
        if (
            isinstance(hint, int) and isinstance(hint_rows, int) and 0 <= hint <= complete
            and (hint == 0 or os.pread(fd, 1, hint - 1) == b"\n")
        ):
            rows = hint_rows + _count_lines(fd, hint, complete)
        else:
            rows = _count_lines(fd, 0, complete)
    status = (meta or {}).get("status")
    if status == "running" and meta and meta.get("host") == socket.gethostname() and not _pid_alive(meta.get("pid")):
        status = "stale"
    torn = st.st_size - complete
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
        "last_step": (_last_step(ref) if last_step is False else last_step) if rows else None,
        "size": st.st_size,
        "status": status,
        "last_write": st.st_mtime,
        "sidecar": sidecar,
        "torn_bytes": torn,
        "torn_saved": ref.path.with_name(ref.path.name + ".torn").exists(),
        "world_size": (meta or {}).get("world_size"),
        "host": (meta or {}).get("host"),
    }


# a run is as bad as its worst shard
_STATUS_ORDER = ("crashed", "stale", "running", "finished")


def run_row(label: str, path: str, shard_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's line from the inspection of its shards."""
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
        "last_write": max((r["last_write"] for r in shard_rows), default=None),
    }




def runs_data(root: Path) -> list[dict[str, Any]]:
    """A line per run under `root` (an empty list when there is no root)."""
    found = list_runs(root) if root.is_dir() else []
    return [run_row(r.label, str(r.path), [inspect_shard(s) for s in list_shards(r)])
            for r in found]


def runs_json(rows: list[dict[str, Any]], waiting: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `expr runs --json` prints: the runs, then runs that exist only in the spool so
    far, with status "spooled"."""
    have = {(r["project"], r["name"]) for r in rows}
    extra = [w for w in waiting if (w["project"], w["name"]) not in have]
    return [{k: v for k, v in r.items() if not k.endswith("_text")} for r in rows] + extra
