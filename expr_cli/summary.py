"""`expr summary RUN`: cross-rank statistics, outliers, coverage and a heatmap (DESIGN 10).

Reads the rank records (`log_rank_metrics`) of every shard of one stream (the
default stream unless `--stream`), grouped by `_rank`, never by file. Without
rank records it shows each shard's last step row instead.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import CLIError
from .resolve import (
    DIR_FLAGS,
    JSON_FLAGS,
    STREAM_FLAGS,
    FastOption,
    RunRef,
    ShardRef,
    int_arg,
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

    from expr_tracker.stats.reduce import RankTable, Stats
    from expr_tracker.stats.scan import ColumnTable

    Table = RankTable | ColumnTable

COVERAGE_STEPS = 50  # how far back the coverage block looks
THRESHOLD = 3.5  # DESIGN 10: robust score above which a rank is flagged
_BLOCK = 4 << 20


def iter_rank_records(shards: list[ShardRef], garbage: dict[str, int]) -> Iterator[dict[str, Any]]:
    """Rank records of `shards` in file order; lines that do not parse are counted in `garbage`.

    The same line parser as the columnar scan (`scan.parse_rank_lines`); what it returns
    beside rank records, `collect` drops by `_kind`.
    """
    from expr_tracker.stats.scan import parse_rank_lines
    from expr_tracker.store import records

    for shard in shards:
        bad = 0
        with open(shard.path, "rb") as fh:
            for _, data in records.complete_blocks(fh, _BLOCK):
                recs, n_bad = parse_rank_lines(data)
                bad += n_bad
                yield from recs
        if bad:
            garbage[shard.path.name] = bad


def load_table(shards: list[ShardRef]) -> tuple[Table, dict[str, int]]:
    """The rank records of `shards` as a table, and the unparseable lines per file name.

    Regular shards (see `expr_tracker.stats.scan`) are read as columns: a `ColumnTable` when
    every rank sits in one shard, else a `RankTable` built from the columns. Otherwise
    every record goes through `reduce.collect`.
    """
    from expr_tracker.stats import scan
    from expr_tracker.stats.reduce import collect

    scans = scan.scan_shards([s.path for s in shards])
    garbage = {s.path.name: sc.garbage for s, sc in zip(shards, scans, strict=True) if sc.garbage}
    blocks = [b for sc in scans for b in sc.blocks or ()]
    if all(sc.blocks is not None for sc in scans):
        if len({b.rank for b in blocks}) == len(blocks):
            return scan.ColumnTable(blocks), garbage
        return scan.rank_table(blocks), garbage
    del blocks, scans
    garbage = {}
    return collect(iter_rank_records(shards, garbage)), garbage


def last_rows(shards: list[ShardRef], garbage: dict[str, int]) -> list[dict[str, Any]]:
    """Each shard's last step row (the fallback view of a run without rank records)."""
    from expr_tracker.store.shard import ShardReader

    out = []
    for shard in shards:
        reader = ShardReader(shard.path)
        row = next((r for r in reader.iter_reverse() if r.get("_kind") is None), None)
        if reader.garbage:
            garbage[shard.path.name] = reader.garbage
        if row is not None:
            values = {k: v for k, v in row.items() if not k.startswith("_")}
            out.append({"file": shard.path.name, "rank": shard.rank, "step": row.get("_step"),
                        "time": row.get("_time"), "values": values})
    return out


def _last_step(table: Table, key: str) -> int | None:
    from expr_tracker.stats.scan import ColumnTable

    if isinstance(table, ColumnTable):
        return table.last_step(key)
    return next(iter(table.key_steps(key)[-1:]), None)


def _pick_step(table: Table, keys: list[str], step: int | None) -> int:
    steps = table.steps
    if step is not None:
        if step not in set(steps):
            near = min(steps, key=lambda s: (abs(s - step), s))
            raise CLIError(
                f"step {step} has no rank records; they cover steps {steps[0]}..{steps[-1]} "
                f"({len(steps)} steps), nearest {near}"
            )
        return step
    with_keys = [s for s in (_last_step(table, k) for k in keys) if s is not None]
    return max(with_keys) if with_keys else steps[-1]


def _stats(
    table: Table, key: str, step: int | None, window: tuple[int, int] | None
) -> tuple[Stats, dict[int, float]]:
    """Stats of `key` at `step` or over `window`, and the per-rank values they reduce."""
    from expr_tracker.stats import reduce
    from expr_tracker.stats.scan import ColumnTable

    if window is not None:
        lo, hi = window
        if isinstance(table, ColumnTable):
            return table.reduce_window(key, lo, hi), table.window_means(key, lo, hi)
        return reduce.reduce_window(table, key, lo, hi), reduce.window_means(table, key, lo, hi)
    assert step is not None
    if isinstance(table, ColumnTable):
        return table.reduce_step(key, step), table.values(key, step)
    return reduce.reduce_step(table, key, step), table.values(key, step)


def _coverage(table: Table, steps: list[int]) -> list[tuple[int, int, int, list[int]]]:
    from expr_tracker.stats import reduce
    from expr_tracker.stats.scan import ColumnTable

    if isinstance(table, ColumnTable):
        return table.coverage(steps)
    return reduce.coverage(table, steps)


def build_view(
    ref: RunRef,
    stream: str | None,
    table: Table,
    metrics: list[str] | None,
    step: int | None,
    window: tuple[int | None, int | None] | None,
    heatmap_key: str | None,
    heatmap_width: int,
    show_all: bool,
) -> dict[str, Any]:
    """The summary as JSON-ready data (what `--json` prints and `render.summary` draws)."""
    from expr_tracker.stats import reduce

    available = set(table.keys)
    wanted = [*(metrics or ()), *([heatmap_key] if heatmap_key else [])]
    if any(m not in available for m in wanted):
        raise unknown_metrics(wanted, available)
    keys = metrics or table.keys
    all_steps = table.steps
    view: dict[str, Any] = {"run": ref.label, "path": str(ref.path), "stream": stream,
                            "stream_text": stream_label(stream), "world_size": table.world_size,
                            "step": None, "steps": None, "n_steps": None,
                            "threshold": THRESHOLD, "outliers_all": show_all}
    span: tuple[int, int] | None = None
    at: int | None = None
    if window is not None:
        lo = window[0] if window[0] is not None else all_steps[0]
        hi = window[1] if window[1] is not None else all_steps[-1] + 1
        chosen = all_steps[bisect_left(all_steps, lo):bisect_left(all_steps, hi)]
        if not chosen:
            raise CLIError(
                f"no rank records in steps {lo}:{hi}; they cover steps "
                f"{all_steps[0]}..{all_steps[-1]}"
            )
        span = (lo, hi)
        view.update(steps=[lo, hi], n_steps=len(chosen))
        recent = chosen[-COVERAGE_STEPS:]
    else:
        at = _pick_step(table, keys, step)
        view["step"] = at
        chosen = [at]
        recent = all_steps[:bisect_right(all_steps, at)][-COVERAGE_STEPS:]
    items = []
    for key in keys:
        stats, values = _stats(table, key, at, span)
        item: dict[str, Any] = {
            "key": key,
            "stats": stats.as_dict(),
            "outliers": [o.as_dict() for o in reduce.outliers(values, THRESHOLD)],
        }
        if not values:
            seen = table.key_steps(key)
            last = [s for s in seen if s <= chosen[-1]][-1:] or seen[:1]
            item["note"] = f"not reported here (last at step {last[0]})" if last else "never reported"
        items.append(item)
    view["keys"] = items
    view["coverage"] = [
        {"step": s, "reported": n, "world": w, "missing": missing}
        for s, n, w, missing in _coverage(table, recent)
        if missing
    ]
    view["coverage_checked"] = {"steps": len(recent), "first": recent[0] if recent else None,
                                "last": recent[-1] if recent else None}
    if heatmap_key:
        from expr_tracker.stats.scan import ColumnTable

        # the heatmap reads one key at every step: a RankTable of that key alone
        ht = table.rank_table([heatmap_key]) if isinstance(table, ColumnTable) else table
        buckets, cells = reduce.heatmap(ht, heatmap_key, heatmap_width,
                                        steps=chosen if window is not None else None)
        view["heatmap"] = {"key": heatmap_key, "buckets": [list(b) for b in buckets],
                           "cells": {r: cells[r] for r in sorted(cells)}}
    return view


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
) -> None:
    """Load the rank records of RUN and print the summary."""
    from . import render

    if step is not None and steps is not None:
        raise CLIError("use either --step or --steps, not both", 2)
    window = parse_step_range(steps)
    ref = resolve_run(run, root_dir(dir))
    shards = shards_of(ref, stream)
    table, garbage = load_table(shards)
    if garbage:
        where = ", ".join(f"{f}: {n}" for f, n in sorted(garbage.items()))
        n = sum(garbage.values())
        render.warning(f"skipped {n} line{'s' if n != 1 else ''} that did not parse ({where})")
    if not table.steps:
        rows = last_rows(shards, {})
        if not rows:
            raise CLIError(f"run {ref.label} has no rows in stream {stream_label(stream)}: its shards are empty")
        if as_json:
            render.print_json({"run": ref.label, "stream": stream, "rank_records": 0, "last": rows})
        else:
            render.last_values(rows, ref.label)
        return
    # only the heatmap depends on the terminal's width (and asking rich for it costs an import)
    buckets = render.heatmap_buckets(render.console().width, table.world_size) if heatmap_key else 1
    view = build_view(ref, stream, table, parse_metrics(metrics), step, window, heatmap_key,
                      buckets, show_all)
    if as_json:
        view.pop("stream_text")
        render.print_json(view)
    else:
        render.summary(view)


# `main` runs `expr summary` without typer when it can parse the arguments with these
# (the root group checks that they match the typer options below)
FAST_ARGS = ("run",)
FAST_OPTIONS = (
    FastOption("metric", ("--metric", "-m"), multiple=True),
    FastOption("step", ("--step",), int_arg),
    FastOption("steps", ("--steps",)),
    FastOption("heatmap", ("--heatmap",)),
    FastOption("outliers", ("--outliers",), None, default=False),
    FastOption("stream", STREAM_FLAGS),
    FastOption("json", JSON_FLAGS, None, default=False),
    FastOption("dir", DIR_FLAGS),
)


def fast_run(v: dict[str, Any]) -> None:
    """`expr summary` with arguments parsed by `resolve.parse_fast`."""
    summary_command(v["run"], v["dir"], v["stream"], v["metric"], v["step"], v["steps"],
                    v["heatmap"], v["outliers"], v["json"])


def register(app: typer.Typer) -> None:
    """Add `expr summary`."""
    import typer

    from .resolve import DIR_OPT, JSON_OPT, RUN_ARG, STREAM_OPT

    metric_opt = typer.Option(None, "--metric", "-m", show_default=False, metavar="KEY",
                              help="Metric key to summarise (repeatable, or comma-separated).")
    step_opt = typer.Option(None, "--step", show_default=False, metavar="STEP",
                            help="One step (default: the latest with rank records).")
    steps_opt = typer.Option(None, "--steps", show_default=False, metavar="START:STOP",
                             help="Half-open window START:STOP; statistics of per-rank means.")
    heatmap_opt = typer.Option(None, "--heatmap", show_default=False, metavar="KEY",
                               help="Draw the rank x step heatmap of this key.")
    outliers_opt = typer.Option(False, "--outliers",
                                help="Show every rank's scores, not only flagged ones.")

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
        stream: str | None = STREAM_OPT,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Cross-rank statistics of the rank records of RUN at one step or over a window.

        Per key: n/world, mean, wmean, min, max, range, std, p05, p50, p95 and the
        missing ranks; outliers by robust z (|z| > 3.5); which recent steps miss ranks.
        Reads every shard of one stream (the default stream unless --stream).
        """
        summary_command(run, dir, stream, metric, step, steps, heatmap, outliers, json)
