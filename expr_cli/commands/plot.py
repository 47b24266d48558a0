"""`expr plot RUN -m METRIC`: a metric per rank as a line chart (terminal or PNG/SVG).

Up to MAX_LINES ranks, one line each. More ranks: the median across ranks, the p05-p95
band and the outlier ranks (DESIGN 10's robust score over each rank's mean in the window,
at most MAX_OUTLIERS of them) as their own lines, never thousands of lines.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expr_cli.errors import CLIError
from expr_cli.render.plot import Band, Line, Panel
from expr_cli.resolve import (
    RunRef,
    compact_ranks,
    parse_metrics,
    parse_step_range,
    resolve_run,
    root_dir,
    shards_of,
    stream_label,
    unknown_metrics,
)

if TYPE_CHECKING:
    import typer

MAX_LINES = 8
MAX_OUTLIERS = 5
IMAGE_SUFFIXES = (".png", ".svg")


def parse_ranks(text: str | None) -> list[int] | None:
    """`all` (or nothing) -> None; `3` or `0,3,5-7` -> the ranks.

    A range is clamped to the largest world a run can have (MAX_WORLD ranks, the sanity
    cap `init()` applies), so `1-100000000000` means ranks 1 and up, not a list that
    fills memory; a single rank past it is a usage error.
    """
    from expr_tracker.store.records import MAX_WORLD

    if text is None or text.strip() == "all":
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            b = int(hi) if sep else a
            if a < 0 or b < a:
                raise ValueError
            if a >= MAX_WORLD:
                raise CLIError(f"--rank {a} is past the largest world ({MAX_WORLD:,} ranks, "
                               f"0-{MAX_WORLD - 1})", 2)
            out.update(range(a, min(b, MAX_WORLD - 1) + 1))
    except ValueError:
        raise CLIError(f"--rank must be 'all', a rank or a list like 0,3,5-7; got {text!r}", 2) from None
    return sorted(out)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (the first points average what exists)."""
    if window <= 1:
        return values
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


Series = dict[str, dict[int, tuple[list[int], list[float]]]]


def load_series(run_dir: Path, stream: str | None, metrics: list[str], ranks: list[int] | None,
                steps: tuple[int | None, int | None] | None) -> Series:
    """metric -> rank -> (steps, values): the finite numbers of each rank's step rows."""
    from expr_tracker.store.runread import RunReader

    reader = RunReader(run_dir, stream=stream, metrics=metrics, ranks=ranks, step_range=steps)
    out: Series = {m: {} for m in metrics}
    for row in reader.rows():
        r = row["_rank"]
        for m in metrics:
            v = row.get(m)
            if type(v) in (int, float) and math.isfinite(v):
                xs, ys = out[m].setdefault(r, ([], []))
                xs.append(row["_step"])
                ys.append(float(v))
    return out


def _by_step(per_rank: dict[int, tuple[list[int], list[float]]]) -> dict[int, dict[int, float]]:
    table: dict[int, dict[int, float]] = {}
    for r, (xs, ys) in per_rank.items():
        for x, y in zip(xs, ys, strict=True):
            table.setdefault(x, {})[r] = y
    return table


def build_panel(metric: str, per_rank: dict[int, tuple[list[int], list[float]]], window: int) -> Panel:
    """One rank per line, or median + band + outliers beyond MAX_LINES ranks."""
    from expr_tracker.stats.reduce import outliers, reduce_values

    per_rank = {r: (xs, smooth(ys, window)) for r, (xs, ys) in sorted(per_rank.items())}
    if len(per_rank) <= MAX_LINES:
        lines = [Line(f"rank {r}", xs, ys) for r, (xs, ys) in per_rank.items()]
        return Panel(metric, lines, None, "")
    steps, med, lo, hi = [], [], [], []
    for step, values in sorted(_by_step(per_rank).items()):
        stats = reduce_values(values, len(values))
        if stats.p50 is None or stats.p05 is None or stats.p95 is None:
            continue
        steps.append(step)
        med.append(stats.p50)
        lo.append(stats.p05)
        hi.append(stats.p95)
    means = {r: sum(ys) / len(ys) for r, (_, ys) in per_rank.items() if ys}
    flagged = sorted((o for o in outliers(means) if o.flagged), key=lambda o: -abs(o.robust))
    lines = [Line(f"median of {len(per_rank)} ranks", steps, med, "median")]
    lines += [Line(f"rank {o.rank} (outlier)", *per_rank[o.rank], "outlier")
              for o in flagged[:MAX_OUTLIERS]]
    note = f"{len(per_rank)} ranks: median, p05-p95 band"
    if flagged:
        note += f", {len(flagged)} outlier{'s' if len(flagged) != 1 else ''}"
    return Panel(metric, lines, Band(steps, lo, hi), note)


def _available_metrics(run_dir: Path, stream: str | None) -> set[str]:
    """Numeric step-row keys of the first few shards (for the unknown-metric error)."""
    from expr_tracker.store.reader import ShardReader
    from expr_tracker.store.runread import run_shards

    keys: set[str] = set()
    for shard in run_shards(run_dir, stream)[:8]:
        for _, rec in ShardReader(shard.path).iter_records():
            if "_kind" not in rec:
                keys.update(k for k, v in rec.items() if k[:1] != "_" and type(v) in (int, float))
    return keys


def chart(ref: RunRef, stream: str | None, metrics: list[str], ranks: list[int] | None,
          steps: tuple[int | None, int | None] | None, window: int) -> list[Panel]:
    """The panels of the chart; CLIError when nothing can be drawn."""
    series = load_series(ref.path, stream, metrics, ranks, steps)
    empty = [m for m in metrics if not series[m]]
    if empty:
        have = _available_metrics(ref.path, stream)
        if any(m not in have for m in empty):
            raise unknown_metrics(empty, have)
        where = f" in ranks {compact_ranks(ranks)}" if ranks is not None else ""
        where += " in that step range" if steps is not None else ""
        raise CLIError(f"no finite values of {', '.join(empty)}{where}")
    return [build_panel(m, series[m], window) for m in metrics]


def terminal_size() -> tuple[int, int]:
    """Columns and rows for the chart: the terminal's (or $COLUMNS/$LINES), at most 200 wide."""
    size = shutil.get_terminal_size((80, 24))
    return max(40, min(size.columns, 200)), max(12, size.lines - 2)


def _panels_json(panels: Iterable[Panel]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        item: dict[str, Any] = {"metric": p.metric, "note": p.note,
                                "lines": [line._asdict() for line in p.lines]}
        item["band"] = p.band._asdict() if p.band is not None else None
        out.append(item)
    return out


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

        render.print_json({"run": ref.label, "stream": stream,
                           "panels": _panels_json(chart(ref, stream, wanted, ranks, rng, window))})
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
    import typer

    try:
        while True:
            panels = chart(ref, stream, wanted, ranks, rng, window)
            sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: redraw in place
            _draw(label + f"  {time.strftime('%H:%M:%S')}", panels, color)
            time.sleep(interval)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        raise typer.Exit(130) from None


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
