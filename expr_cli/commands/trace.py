"""`expr trace RUN -o trace.json`: every rank's traced spans as one Chrome/Perfetto trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from expr_cli.errors import CLIError
from expr_cli.resolve import resolve_run, root_dir

if TYPE_CHECKING:
    import typer


def trace_command(run: str, dir: str | None, out: str, force: bool, as_json: bool) -> None:
    """Write the spans of every rank of RUN to `out` (written whole, then renamed)."""
    from expr_cli import render
    from expr_cli.commands.export import check_out
    from expr_tracker.views.trace import span_files, write_chrome_trace

    ref = resolve_run(run, root_dir(dir))
    out_path = Path(out)
    check_out(out_path, ref.path, force)
    if not span_files(ref.path):
        raise CLIError(f"run {ref.label} has no span trace: start it with "
                       "et.init(..., trace_spans=True)")
    target = out_path.expanduser()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            stats = write_chrome_trace(ref.path, fh)
        os.replace(tmp, target)  # never half a trace under the name asked for
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CLIError(f"cannot write {out}: {exc.strerror or exc}") from None
    ranks = stats["ranks"]
    if as_json:
        render.print_json({"run": ref.label, "out": str(out_path), "ranks": ranks,
                           "spans": stats["spans"]})
    else:
        render.note(f"wrote {stats['spans']} spans of {ref.label} ({len(ranks)} "
                    f"rank{'s' if len(ranks) != 1 else ''}) to {out_path}; open it in "
                    "https://ui.perfetto.dev or chrome://tracing")


def register(app: typer.Typer) -> None:
    """Add `expr trace`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG

    out_opt = typer.Option(..., "--out", "-o", show_default=False, metavar="FILE",
                           help="The trace file to write (never inside the run directory).")
    force_opt = typer.Option(False, "--force", help="Replace an existing --out file.")

    @app.command("trace", epilog="Example: expr trace sft-1 -o trace.json")
    def trace(
        run: str = RUN_ARG,
        out: str = out_opt,
        force: bool = force_opt,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Write every rank's spans (from et.init(trace_spans=True)) as one Chrome trace.

        A process per rank, a thread per thread; open the file in Perfetto
        (ui.perfetto.dev) or chrome://tracing to see all ranks on one timeline.
        """
        trace_command(run, dir, out, force, json)
