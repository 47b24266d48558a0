"""`expr top RUN`: a live view of a job's ranks, worst first, open incidents on top (DESIGN 13, 14).

Read-only: the detectors run in memory on every frame (so the view is live even with no
watcher), merged with the open incidents a watcher recorded in `incidents.jsonl`.
"""

from __future__ import annotations

import typer

from expr_cli.data.top import TopView, screenful
from expr_cli.errors import CLIError
from expr_cli.layout import NODE_AGGS
from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG, STREAM_OPT, resolve_run, root_dir


def top_command(run: str, dir: str | None, stream: str | None, metric: str | None, once: bool,
                as_json: bool, config: str | None, refresh: float, agg: str = "worst") -> int:
    """Show RUN's ranks; the exit code."""
    from expr_cli import render
    from expr_cli.render import health as render_health

    from .watch import health_config

    ref = resolve_run(run, root_dir(dir))
    view = TopView(ref, stream, metric, health_config(config, {}))
    try:
        if once:
            from expr_tracker.gcpause import paused_gc

            with paused_gc():  # (a row per rank printed: `gcpause`)
                frame = view()
                if as_json:  # (nodes last: a reader of the head sees the ranks first)
                    frame = screenful(frame)
                    render.print_json({k: v for k, v in frame.items() if k != "nodes"}
                                      | {"nodes": frame["nodes"]})
                else:
                    render_health.top_print(frame, agg)
            return 0
        render_health.top_live(view, refresh, agg)
    except KeyboardInterrupt:
        return 130
    return 0


def register(app: typer.Typer) -> None:
    """Add `expr top`."""

    @app.command("top", epilog="Example: expr top sft-1 -m train/loss")
    def top(
        run: str = RUN_ARG,
        metric: str | None = typer.Option(None, "--metric", "-m", metavar="KEY", show_default=False,
                                          help="Show each rank's latest value of KEY."),
        once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
        json: bool = JSON_OPT,
        config: str | None = typer.Option(None, "--config", "-c", metavar="FILE", show_default=False,
                                          help="Alert config whose \\[health] table sets thresholds."),
        refresh: float = typer.Option(1.0, "--refresh", min=0.2, metavar="SECONDS",
                                      help="Seconds between frames."),
        agg: str = typer.Option("worst", "--agg", metavar="worst|max|min|mean",
                                help="How a bin of nodes combines its nodes' values."),
        stream: str | None = STREAM_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """A live view of RUN: open incidents, then one line per rank, worst first.

        Per rank: status, step, steps behind the lead, steps/s, last write age and, with
        -m, a metric's latest value. A frame fits the terminal: big jobs show the worst
        ranks that fit, name the other ranks with incidents, then the nodes that need a
        look and the other nodes folded into bins (--agg).
        --once prints one frame (--json: {"ranks": [...], "incidents": [...]}: the worst
        100 ranks and nodes, with ranks_total, nodes_total and counts by status).
        """
        if agg not in NODE_AGGS:
            raise CLIError(f"--agg must be one of {', '.join(NODE_AGGS)}, got {agg!r}", 2)
        code = top_command(run, dir, stream, metric, once, json, config, refresh, agg)
        if code:
            raise typer.Exit(code)

