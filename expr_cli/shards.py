"""`expr shards RUN`: a row per shard file, and the read-only shard inspection `runs` shares.

Nothing here writes: a torn tail or a sidecar that disagrees with its shard is
reported, and left for the next writer to repair (DESIGN 5).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import typer

from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.shard import ShardReader, read_sidecar

from .resolve import (
    DIR_OPT,
    JSON_OPT,
    RUN_ARG,
    ShardRef,
    list_shards,
    resolve_run,
    root_dir,
    stream_label,
)

_BLOCK = 1 << 20


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


def inspect_shard(ref: ShardRef) -> dict[str, Any]:
    """Rows, last step, size, status and sidecar state of one shard, without modifying it."""
    stem = ref.path.name[: -len(".jsonl")]
    meta = read_sidecar(ref.path.with_name(f"{stem}.meta.json"))
    with open(ref.path, "rb") as fh:
        fd = fh.fileno()
        st = os.fstat(fd)
        complete = records.complete_end(fh, _BLOCK)
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
    if meta is None:
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
        "last_step": _last_step(ref) if rows else None,
        "size": st.st_size,
        "status": status,
        "last_write": st.st_mtime,
        "sidecar": sidecar,
        "torn_bytes": torn,
        "torn_saved": ref.path.with_name(ref.path.name + ".torn").exists(),
        "world_size": (meta or {}).get("world_size"),
        "host": (meta or {}).get("host"),
    }


_JSON_DROP = ("stream_text",)


def shards_command(
    run: str,
    dir: str | None,
    as_json: bool,
) -> None:
    """List the shards of RUN."""
    from . import render
    from .errors import CLIError

    ref = resolve_run(run, root_dir(dir))
    found = list_shards(ref)
    if not found:
        raise CLIError(f"run {ref.label} is empty: no metrics*.jsonl shards in {ref.path}")
    rows = [inspect_shard(s) for s in found]
    if as_json:
        render.print_json([{k: v for k, v in r.items() if k not in _JSON_DROP} for r in rows])
        return
    render.shards(rows, ref.label)


def register(app: typer.Typer) -> None:
    """Add `expr shards`."""

    @app.command(
        "shards",
        epilog="Example: expr shards sft-1 (or expr shards my-project/sft-1 --json)",
    )
    def shards(run: str = RUN_ARG, dir: str | None = DIR_OPT, json: bool = JSON_OPT) -> None:
        """One row per shard of RUN: rank, stream, rows, last step, size, status, last write, sidecar.

        The sidecar column compares the sidecar's cursor with the file (ok, behind while
        running, needs repair, torn tail, missing). Nothing is modified.
        """
        shards_command(run, dir, json)
