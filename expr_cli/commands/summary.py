"""`expr summary RUN`: cross-rank statistics, outliers, coverage and a heatmap (DESIGN 10, 13, 14).

Reads one stream (the default stream unless `--stream`). Without `--step`/`--steps` it
reduces at the run's **frontier**, the latest step every live rank has reported, taken
from the sidecars and shard tails (`expr_tracker.health.state`); ranks short of it are
*behind*, not missing. Only the tail of each shard is read for that recent window, so
the cost does not grow with the run's length. Rank records (`log_rank_metrics`) are
grouped by `_rank`, never by file; `--metric`/`--heatmap` also take keys that ranks log
with `et.log` (each rank's step row at that step). Without rank records and without
`--metric`, it shows each shard's last step row instead.

Thousands of ranks fit a screen (`layout`): outlier ranks are always named, then the worst
nodes, and the other ranks are binned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from expr_cli.data.summary import AGGS, MIN_REL, summary_data
from expr_cli.errors import CLIError
from expr_cli.resolve import (
    DIR_FLAGS,
    JSON_FLAGS,
    STREAM_FLAGS,
    FastOption,
    RunRef,
    int_arg,
    parse_step_range,
    resolve_run,
    root_dir,
    shards_of,
)
from expr_cli.summary_load import COVERAGE_STEPS

if TYPE_CHECKING:
    import typer

def summary_command(
    run: str,
    dir: str | None,
    stream: str | None,
    metrics: list[str] | None,
    step: int | None,
    steps: str | None,
    heatmap_key: str | None,
    show_all: bool,
    as_json: bool,
    min_rel: float = MIN_REL,
    agg: str = "max",
    spans: bool = False,
) -> None:
    """Load the recent rank records (and step rows) of RUN and print the summary."""
    from expr_cli import render
    from expr_cli.render import summary as render_summary

    if step is not None and steps is not None:
        raise CLIError("use either --step or --steps, not both", 2)
    if spans:
        if metrics or heatmap_key:
            raise CLIError("--spans shows the time_ms/* keys; leave out --metric and --heatmap", 2)
        ref = resolve_run(run, root_dir(dir))
        view = spans_view(ref, stream, shards_of(ref, stream), step, parse_step_range(steps))
        if as_json:
            render.print_json(view)
        else:
            render_summary.spans(view)
        return
    if not min_rel >= 0.0:
        raise CLIError(f"--min-rel must be >= 0, got {min_rel}", 2)
    if agg not in AGGS:
        raise CLIError(f"--agg must be one of {', '.join(AGGS)}, got {agg!r}", 2)
    window = parse_step_range(steps)
    ref = resolve_run(run, root_dir(dir))

    def buckets(world: int) -> int:
        # only the heatmap depends on the terminal's width (and asking rich for it costs an import)
        return render_summary.heatmap_buckets(render.console().width, world)

    view, warnings, full = summary_data(ref, stream, metrics, step, window, heatmap_key, show_all,
                                        buckets, min_rel=min_rel, agg=agg)
    for w in warnings:
        render.warning(w)
    if as_json:
        view.pop("stream_text", None)
        render.print_json(view)
    elif full:
        render_summary.summary(view)
    else:
        render_summary.last_values(view["last"], ref.label, view.get("system_keys", []))


# `main` runs `expr summary` without typer when it can parse the arguments with these
# (the root group checks that they match the typer options below)
FAST_ARGS = ("run",)
FAST_OPTIONS = (
    FastOption("metric", ("--metric", "-m"), multiple=True),
    FastOption("step", ("--step",), int_arg),
    FastOption("steps", ("--steps",)),
    FastOption("heatmap", ("--heatmap",)),
    FastOption("outliers", ("--outliers",), None, default=False),
    FastOption("min_rel", ("--min-rel",), float, default=MIN_REL),
    FastOption("agg", ("--agg",), default="max"),
    FastOption("spans", ("--spans",), None, default=False),
    FastOption("stream", STREAM_FLAGS),
    FastOption("json", JSON_FLAGS, None, default=False),
    FastOption("dir", DIR_FLAGS),
)


def fast_run(v: dict[str, Any]) -> None:
    """`expr summary` with arguments parsed by `resolve.parse_fast`."""
    summary_command(v["run"], v["dir"], v["stream"], v["metric"], v["step"], v["steps"],
                    v["heatmap"], v["outliers"], v["json"], v["min_rel"], v["agg"], v["spans"])

def spans_view(ref: RunRef, stream: str | None, shards: list[Any], step: int | None,
               window: tuple[int | None, int | None] | None) -> dict[str, Any]:
    """`--spans`: every `time_ms/*` key (et.span) as per-rank means over the recent steps
    (up to the frontier), the window or one step, reduced across ranks (stats.phases)."""
    from expr_cli.summary_load import load_span_table, window_lo
    from expr_tracker.health.state import read_run
    from expr_tracker.stats import phases, reduce

    state = read_run(ref.path, stream, window=2)
    world = max([state.world_size or 0, *(s.rank + 1 for s in shards)])
    table, _ = load_span_table(shards, window_lo(step, window, state.frontier), world,
                               phases.PREFIX)
    all_steps = table.steps
    if not table.keys or not all_steps:
        raise CLIError(f"run {ref.label} has no span times (time_ms/* keys): time phases "
                       "with et.span(...)")
    if window is not None:
        lo = window[0] if window[0] is not None else all_steps[0]
        hi = window[1] if window[1] is not None else all_steps[-1] + 1
    elif step is not None:
        lo, hi = step, step + 1
    else:
        front = state.frontier
        hi = (front if front is not None and front <= all_steps[-1] else all_steps[-1]) + 1
        lo = max(all_steps[0], hi - COVERAGE_STEPS)
    means = {k: reduce.window_means(table, k, lo, hi) for k in table.keys}
    means = {k: v for k, v in means.items() if v}
    if not means:
        raise CLIError(f"no span times in steps {lo}:{hi}; they cover steps "
                       f"{all_steps[0]}..{all_steps[-1]}")
    return {"run": ref.label, "stream": stream, "world_size": world, "steps": [lo, hi],
            **phases.span_phases(means)}


def register(app: typer.Typer) -> None:
    """Add `expr summary`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG, STREAM_OPT

    metric_opt = typer.Option(None, "--metric", "-m", show_default=False, metavar="KEY",
                              help="Metric key to summarise (repeatable, or comma-separated); "
                                   "rank records or keys logged with et.log.")
    step_opt = typer.Option(None, "--step", show_default=False, metavar="STEP",
                            help="One step (default: the frontier, the latest step every "
                                 "live rank reported).")
    steps_opt = typer.Option(None, "--steps", show_default=False, metavar="START:STOP",
                             help="Half-open window START:STOP; statistics of per-rank means.")
    heatmap_opt = typer.Option(None, "--heatmap", show_default=False, metavar="KEY",
                               help="Draw the rank x step heatmap of this key (the last "
                                    f"{COVERAGE_STEPS} steps, or the --steps window).")
    outliers_opt = typer.Option(False, "--outliers",
                                help="Show every rank's scores, not only flagged ones.")
    min_rel_opt = typer.Option(MIN_REL, "--min-rel", metavar="RATIO",
                               help="An outlier also differs from the median by at least "
                                    "this fraction.")
    agg_opt = typer.Option("max", "--agg", metavar="max|min|mean",
                           help="How a heatmap row of many ranks (a node, a bin) combines them.")
    spans_opt = typer.Option(False, "--spans",
                             help="Reduce the span times (time_ms/* of et.span) across ranks: "
                                  "which phase makes the straggler slow.")

    @app.command(
        "summary",
        epilog="Example: expr summary sft-1 --metric train/loss --steps 900:1000 --heatmap train/loss",
    )
    def summary(
        run: str = RUN_ARG,
        metric: list[str] | None = metric_opt,
        step: int | None = step_opt,
        steps: str | None = steps_opt,
        heatmap: str | None = heatmap_opt,
        outliers: bool = outliers_opt,
        min_rel: float = min_rel_opt,
        agg: str = agg_opt,
        spans: bool = spans_opt,
        stream: str | None = STREAM_OPT,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Cross-rank statistics of RUN at the frontier, at one step or over a window.

        Per key: n/world, mean, wmean, min, max, range, std, p05, p50, p95, behind and
        missing ranks; outliers (|robust z| > 3.5 and at least --min-rel from the
        median, shown as x median); which recent steps miss ranks. Thousands of ranks
        are grouped by node: outliers named, the worst nodes first, the rest binned.
        """
        summary_command(run, dir, stream, metric, step, steps, heatmap, outliers, json,
                        min_rel, agg, spans)

