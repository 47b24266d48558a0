"""`expr runs`: every project and run under the run root, with ranks, streams and status."""

from __future__ import annotations

from typing import Any

import typer

from expr_cli.resolve import (
    DIR_OPT,
    JSON_OPT,
    compact_ranks,
    list_runs,
    list_shards,
    root_dir,
    stream_label,
)
from expr_cli.spooled import SPOOL_OPT

from .shards import inspect_shard

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


def runs_command(dir: str | None, as_json: bool, spool: str | None = None) -> None:
    """List the runs under the run root, and spooled runs for it not applied yet."""
    from expr_cli import render, spooled
    from expr_cli.errors import CLIError

    root = root_dir(dir)
    spool_root = spooled.spool_root(spool)
    waiting = spooled.pending(spool_root, root)
    if not root.is_dir() and not waiting:
        raise CLIError(f"no run root at {root} (set --dir or $EXPR_DIR)")
    found = list_runs(root) if root.is_dir() else []
    rows = [run_row(r.label, str(r.path), [inspect_shard(s) for s in list_shards(r)]) for r in found]
    have = {(r["project"], r["name"]) for r in rows}
    if as_json:
        # runs that exist only in the spool so far come last, with status "spooled"
        extra = [w for w in waiting if (w["project"], w["name"]) not in have]
        render.print_json([{k: v for k, v in r.items() if not k.endswith("_text")}
                           for r in rows] + extra)
        return
    if rows:
        render.runs(rows, str(root))
    elif root.is_dir():
        render.note(f"no runs under {root}")
    else:
        render.note(f"no run root at {root} yet")
    if waiting:
        render.note(spooled.mention(waiting, spool_root))


def register(app: typer.Typer) -> None:
    """Add `expr runs`."""

    @app.command("runs", epilog="Example: expr runs --dir /shared/tracker/jsonl")
    def runs(dir: str | None = DIR_OPT, json: bool = JSON_OPT,
             spool: str | None = SPOOL_OPT) -> None:
        """Projects and runs under the run root: ranks, streams, last step, status, last write;
        and spooled runs exprd has not applied yet."""
        runs_command(dir, json, spool)
