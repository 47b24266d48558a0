"""`expr plot RUN -m METRIC`: a metric per rank as a line chart (terminal or PNG/SVG).

Up to MAX_LINES ranks, one line each. More ranks: the median across ranks, the p05-p95
band and the outlier ranks (DESIGN 10's robust score over each rank's mean in the window,
at most MAX_OUTLIERS of them) as their own lines, never thousands of lines.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expr_cli.data.series import Panel, chart, parse_ranks, series_data
from expr_cli.errors import CLIError
from expr_cli.resolve import (
    parse_metrics,
    parse_step_range,
    resolve_run,
    root_dir,
    shards_of,
    stream_label,
)

if TYPE_CHECKING:
    import typer

IMAGE_SUFFIXES = (".png", ".svg")


def terminal_size() -> tuple[int, int]:
    """Columns and rows for the chart: the terminal's (or $COLUMNS/$LINES), at most 200 wide."""
    size = shutil.get_terminal_size((80, 24))
    return max(40, min(size.columns, 200)), max(12, size.lines - 2)


def plot_command(run: str, dir: str | None, metrics: list[str] | None, rank: str | None,
                 steps: str | None, window: int, stream: str | None, out: str | None,
                 follow: bool, interval: float, as_json: bool) -> None:
    """Draw the metrics of RUN in the terminal, to a file, or as JSON."""
    wanted = parse_metrics(metrics)
    if not wanted:
        raise CLIError("name at least one metric: -m METRIC", 2)
    if window < 1:
        raise CLIError("--smooth must be >= 1", 2)
    if interval <= 0:
        raise CLIError("--interval must be > 0", 2)
    out_path = Path(out) if out else None
    if out_path is not None and out_path.suffix.lower() not in IMAGE_SUFFIXES:
        raise CLIError(f"--out must end in .png or .svg, got {out_path.name!r}", 2)
    if out_path is not None and follow:
        raise CLIError("--follow draws in the terminal; leave out --out", 2)
    ranks = parse_ranks(rank)
    rng = parse_step_range(steps)
    from expr_cli.extras import require

    if not as_json:
        require("matplotlib" if out_path is not None else "plotext", "plot")
    ref = resolve_run(run, root_dir(dir))
    shards_of(ref, stream)  # the errors for an empty run or an unknown stream
    label = ref.label + ("" if stream is None else f" [{stream_label(stream)}]")
    if as_json:
        from expr_cli import render

        render.print_json(series_data(ref, stream, wanted, ranks, rng, window))
        return
    if out_path is not None:
        from expr_cli.render import plot as plotdraw

        plotdraw.image(label, chart(ref, stream, wanted, ranks, rng, window), out_path)
        from expr_cli import render

        render.note(f"wrote {out_path}")
        return
    color = not os.environ.get("NO_COLOR") and (sys.stdout.isatty() or bool(os.environ.get("FORCE_COLOR")))
    if not follow:
        _draw(label, chart(ref, stream, wanted, ranks, rng, window), color)
        return
    import signal

    import typer

    # Ctrl-C is noted as well as raised: one that lands in a destructor (plotext's pixels
    # free C memory in `__del__`) is swallowed there ("Exception ignored in"), and the
    # loop would go on redrawing
    caught: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        caught.append(signum)
        raise KeyboardInterrupt

    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, on_sigint) if ours else None
    try:
        while not caught:
            panels = chart(ref, stream, wanted, ranks, rng, window)
            sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: redraw in place
            _draw(label + f"  {time.strftime('%H:%M:%S')}", panels, color)
            if not caught:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    raise typer.Exit(130)


def _draw(title: str, panels: list[Panel], color: bool) -> None:
    from expr_cli.render import plot as plotdraw

    width, height = terminal_size()
    height = min(height, 20 * len(panels)) if len(panels) > 1 else height
    sys.stdout.write(plotdraw.terminal(title, panels, width, height, color) + "\n")
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add `expr plot`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG, STREAM_OPT

    metric_opt = typer.Option(None, "--metric", "-m", show_default=False, metavar="METRIC",
                              help="Metric to plot (repeatable, or comma-separated).")
    rank_opt = typer.Option(None, "--rank", "-r", show_default=False, metavar="all|N|0,3",
                            help="Ranks to draw (default all).")
    steps_opt = typer.Option(None, "--steps", show_default=False, metavar="A:B",
                             help="Half-open step range A:B (either side optional).")
    smooth_opt = typer.Option(1, "--smooth", metavar="N", help="Moving average over N points.")
    out_opt = typer.Option(None, "--out", "-o", show_default=False, metavar="FILE",
                           help="Write a .png or .svg file (matplotlib) instead.")
    follow_opt = typer.Option(False, "--follow", "-f", help="Redraw until Ctrl-C (exit 130).")
    interval_opt = typer.Option(2.0, "--interval", metavar="SECONDS", help="Seconds between redraws.")

    @app.command(
        "plot",
        epilog="Example: expr plot sft-1 -m loss --rank 0,3 --steps 10:40 --smooth 5",
    )
    def plot(
        run: str = RUN_ARG,
        metric: list[str] | None = metric_opt,
        rank: str | None = rank_opt,
        steps: str | None = steps_opt,
        smooth: int = smooth_opt,
        stream: str | None = STREAM_OPT,
        out: str | None = out_opt,
        follow: bool = follow_opt,
        interval: float = interval_opt,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Line chart of metrics of RUN, one line per rank, in the terminal or as PNG/SVG.

        More than 8 ranks: the median, the p05-p95 band and the outlier ranks.
        """
        plot_command(run, dir, metric, rank, steps, smooth, stream, out, follow, interval, json)
