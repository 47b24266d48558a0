"""`expr summary RUN`: cross-rank statistics, outliers, coverage and a heatmap (DESIGN 10).

Reads the rank records (`log_rank_metrics`) of every shard of one stream (the
default stream unless `--stream`), grouped by `_rank`, never by file. Without
rank records it shows each shard's last step row instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
import typer

from expr_tracker import records
from expr_tracker.shard import ShardReader

from .errors import CLIError
from .resolve import (
    DIR_OPT,
    JSON_OPT,
    RUN_ARG,
    STREAM_OPT,
    RunRef,
    ShardRef,
    parse_metrics,
    parse_step_range,
    resolve_run,
    root_dir,
    shards_of,
    stream_label,
    unknown_metrics,
)

if TYPE_CHECKING:
    from expr_tracker.reduce import RankTable

COVERAGE_STEPS = 50  # how far back the coverage block looks
THRESHOLD = 3.5  # DESIGN 10: robust score above which a rank is flagged
_BLOCK = 4 << 20
_RANK_MARK = b'"rank"'


def iter_rank_records(shards: list[ShardRef], garbage: dict[str, int]) -> Iterator[dict[str, Any]]:
    """Rank records of `shards` in file order; lines that do not parse are counted in `garbage`.

    Only lines holding the text "rank" are parsed: step rows are the bulk of most
    shards and cannot be rank records without it (`"_kind": "rank"`).
    """
    loads = records.loads
    fast = orjson.loads
    for shard in shards:
        bad = 0
        with open(shard.path, "rb") as fh:
            carry = b""
            while True:
                block = fh.read(_BLOCK)
                if not block:
                    break
                data = carry + block
                end = data.rfind(b"\n") + 1
                carry = data[end:]
                for line in data[:end].split(b"\n")[:-1]:
                    if _RANK_MARK not in line:
                        stripped = line.strip()
                        if stripped and not (stripped[:1] == b"{" and stripped[-1:] == b"}"):
                            bad += 1
                        continue
                    try:
                        # the full decoder only where a non-finite value may hide ("NaN", "inf")
                        rec = loads(line) if b"NaN" in line or b"nf" in line or b"nan" in line else fast(line)
                    except ValueError:  # orjson.JSONDecodeError is a ValueError
                        bad += 1
                        continue
                    if isinstance(rec, dict):
                        yield rec
                    else:
                        bad += 1
        if bad:
            garbage[shard.path.name] = bad


def last_rows(shards: list[ShardRef], garbage: dict[str, int]) -> list[dict[str, Any]]:
    """Each shard's last step row (the fallback view of a run without rank records)."""
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


def _window_means(table: RankTable, key: str, steps: list[int]) -> dict[int, float]:
    """Each rank's mean of its finite values of `key` over `steps` (for window outliers)."""
    acc: dict[int, list[float]] = {}
    for s in steps:
        for r, x in table.values(key, s).items():
            if math.isfinite(x):
                acc.setdefault(r, []).append(x)
    return {r: math.fsum(xs) / len(xs) for r, xs in acc.items()}


def _pick_step(table: RankTable, keys: list[str], step: int | None) -> int:
    steps = table.steps
    if step is not None:
        if step not in set(steps):
            near = min(steps, key=lambda s: (abs(s - step), s))
            raise CLIError(
                f"step {step} has no rank records; they cover steps {steps[0]}..{steps[-1]} "
                f"({len(steps)} steps), nearest {near}"
            )
        return step
    with_keys = [s for k in keys for s in table.key_steps(k)[-1:]]
    return max(with_keys) if with_keys else steps[-1]


def build_view(
    ref: RunRef,
    stream: str | None,
    table: RankTable,
    metrics: list[str] | None,
    step: int | None,
    window: tuple[int | None, int | None] | None,
    heatmap_key: str | None,
    heatmap_width: int,
    show_all: bool,
) -> dict[str, Any]:
    """The summary as JSON-ready data (what `--json` prints and `render.summary` draws)."""
    from expr_tracker import reduce

    available = set(table.keys)
    wanted = [*(metrics or ()), *([heatmap_key] if heatmap_key else [])]
    if any(m not in available for m in wanted):
        raise unknown_metrics(wanted, available)
    keys = metrics or table.keys
    view: dict[str, Any] = {"run": ref.label, "path": str(ref.path), "stream": stream,
                            "stream_text": stream_label(stream), "world_size": table.world_size,
                            "step": None, "steps": None, "n_steps": None,
                            "threshold": THRESHOLD, "outliers_all": show_all}
    if window is not None:
        lo = window[0] if window[0] is not None else table.steps[0]
        hi = window[1] if window[1] is not None else table.steps[-1] + 1
        chosen = [s for s in table.steps if lo <= s < hi]
        if not chosen:
            raise CLIError(
                f"no rank records in steps {lo}:{hi}; they cover steps "
                f"{table.steps[0]}..{table.steps[-1]}"
            )
        view.update(steps=[lo, hi], n_steps=len(chosen))
        recent = chosen[-COVERAGE_STEPS:]
    else:
        at = _pick_step(table, keys, step)
        view["step"] = at
        chosen = [at]
        recent = [s for s in table.steps if s <= at][-COVERAGE_STEPS:]
    items = []
    for key in keys:
        if window is not None:
            stats = reduce.reduce_window(table, key, view["steps"][0], view["steps"][1])
            values = _window_means(table, key, chosen)
        else:
            stats = reduce.reduce_step(table, key, chosen[0])
            values = table.values(key, chosen[0])
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
        for s, n, w, missing in reduce.coverage(table, recent)
        if missing
    ]
    view["coverage_checked"] = {"steps": len(recent), "first": recent[0] if recent else None,
                                "last": recent[-1] if recent else None}
    if heatmap_key:
        buckets, cells = reduce.heatmap(table, heatmap_key, heatmap_width,
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
    from expr_tracker.reduce import collect

    from . import render

    if step is not None and steps is not None:
        raise CLIError("use either --step or --steps, not both", 2)
    window = parse_step_range(steps)
    ref = resolve_run(run, root_dir(dir))
    shards = shards_of(ref, stream)
    garbage: dict[str, int] = {}
    table = collect(iter_rank_records(shards, garbage))
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
    width = render.console().width
    view = build_view(ref, stream, table, parse_metrics(metrics), step, window, heatmap_key,
                      render.heatmap_buckets(width, table.world_size), show_all)
    if as_json:
        view.pop("stream_text")
        render.print_json(view)
    else:
        render.summary(view)


_METRIC_OPT = typer.Option(None, "--metric", "-m", show_default=False, metavar="KEY",
                           help="Metric key to summarise (repeatable, or comma-separated).")
_STEP_OPT = typer.Option(None, "--step", show_default=False, metavar="STEP",
                         help="One step (default: the latest with rank records).")
_STEPS_OPT = typer.Option(None, "--steps", show_default=False, metavar="START:STOP",
                          help="Half-open window START:STOP; statistics of per-rank means.")
_HEATMAP_OPT = typer.Option(None, "--heatmap", show_default=False, metavar="KEY",
                            help="Draw the rank x step heatmap of this key.")
_OUTLIERS_OPT = typer.Option(False, "--outliers", help="Show every rank's scores, not only flagged ones.")


def register(app: typer.Typer) -> None:
    """Add `expr summary`."""

    @app.command(
        "summary",
        epilog="Example: expr summary sft-1 --metric train/loss --steps 900:1000 --heatmap train/loss",
    )
    def summary(
        run: str = RUN_ARG,
        metric: list[str] | None = _METRIC_OPT,
        step: int | None = _STEP_OPT,
        steps: str | None = _STEPS_OPT,
        heatmap: str | None = _HEATMAP_OPT,
        outliers: bool = _OUTLIERS_OPT,
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
