"""`expr runs`: every project and run under the run root, with ranks, streams and status."""

from __future__ import annotations

import typer

from expr_cli.resolve import DIR_OPT, JSON_OPT, root_dir
from expr_cli.spooled import SPOOL_OPT


def runs_command(dir: str | None, as_json: bool, spool: str | None = None) -> None:
    """List the runs under the run root, and spooled runs for it not applied yet."""
    from expr_cli import render, spooled
    from expr_cli.data.runs import runs_data, runs_json
    from expr_cli.errors import CLIError

    root = root_dir(dir)
    spool_root = spooled.spool_root(spool)
    waiting = spooled.pending(spool_root, root)
    if not root.is_dir() and not waiting:
        raise CLIError(f"no run root at {root} (set --dir or $EXPR_DIR)")
    rows = runs_data(root)
    if as_json:
        render.print_json(runs_json(rows, waiting))
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
