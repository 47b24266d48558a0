"""`ColumnTable` queries over many steps at once, for `expr serve`'s run page (issue 24).

A chart reduces a key at each of the 50 recent steps and a heatmap shows every rank's
value at each: over 16,384 blocks that is ~820,000 lookups, a bisection each when asked
one step at a time. Here the blocks that share their steps (every rank but a crashed or
late one) are read with one `itemgetter` over their columns, in C; the answers are those
of `ColumnTable.reduce_step` and of `reduce.heatmap` over the table's `rank_table`.
(`table` is a `scan.ColumnTable`, not imported here: `scan` imports this module.)
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, cast

from expr_tracker.stats import reduce
from expr_tracker.stats.reduce import Stats, reduce_values


def reduce_steps(table: Any, key: str, steps: Sequence[int]) -> list[Stats]:
    """`reduce_step` of `key` at each of `steps` (a chart of the recent steps). Blocks
    with the usual steps (those of the middle rank's block: every rank but a crashed
    or late one) give each step's values in C, one `itemgetter` over their columns;
    the others are looked up per step as `_at` does. The same values and weights in
    the same (rank) order as `reduce_step`'s, so the same stats."""
    mine = [b for b in table.blocks if key in b.columns]
    if not mine:
        return [table.reduce_step(key, s) for s in steps]
    usual = mine[len(mine) // 2].steps
    where = {s: i for i, s in enumerate(usual)}
    runs: list[Any] = []  # in rank order: lists of blocks with the usual steps, or a block
    for blk in mine:
        if blk.steps == usual:
            if runs and isinstance(runs[-1], list):
                runs[-1].append(blk)
            else:
                runs.append([blk])
        else:
            runs.append(blk)
    parts: list[Any] = []
    for run in runs:
        if isinstance(run, list):
            fixed = ({b.rank: cast(float, b.weights) for b in run}
                     if all(isinstance(b.weights, float) for b in run) else None)
            parts.append(([b.rank for b in run], [b.columns[key] for b in run], fixed, run))
        else:
            parts.append(run)
    out = []
    for s in steps:
        i = where.get(s)
        values: dict[int, float] = {}
        weights: dict[int, float] = {}
        for part in parts:
            if not isinstance(part, tuple):  # a block of other steps
                j = bisect_left(part.steps, s)
                if j < len(part.steps) and part.steps[j] == s:
                    values[part.rank] = part.columns[key][j]
                    w = part.weights
                    weights[part.rank] = w if isinstance(w, float) else w[j]
                continue
            if i is None:
                continue
            ranks, cols, fixed, run = part
            values.update(zip(ranks, map(itemgetter(i), cols), strict=True))
            if fixed is not None:
                weights.update(fixed)
            else:
                weights.update({b.rank: b.weights if isinstance(b.weights, float)
                                else b.weights[i] for b in run})
        out.append(reduce_values(values, table.world_size, weights))
    return out


def heatmap(table: Any, key: str, n_buckets: int, steps: Sequence[int] | None = None
            ) -> tuple[list[tuple[int, int]], dict[int, list[float | None]]]:
    """`reduce.heatmap` over `rank_table([key])`, without building that table: with a
    bucket per step (a page's 60 columns over the 50 recent steps) a cell is the rank's
    value there (NaN when not finite), read in C for the blocks of the usual steps;
    buckets of several steps: `_bucketed`."""

    chosen = table.key_steps(key) if steps is None else sorted(set(steps))
    if n_buckets < 1 or not chosen:
        return reduce.heatmap(table.rank_table([key]), key, n_buckets, steps)
    if n_buckets < len(chosen):
        return _bucketed(table, key, chosen, n_buckets)
    nb = len(chosen)
    grid: dict[int, list[float | None]] = {r: [None] * nb for r in range(table.world_size)}
    mine, usual, where = _usual_steps(table, key)
    pos = [where.get(s) for s in chosen]
    get = itemgetter(*pos) if nb > 1 and None not in pos else None
    for b in mine:
        col = b.columns[key]
        if get is not None and b.steps == usual:
            vals = get(col)
            try:
                total = math.fsum(vals)
            except (OverflowError, ValueError):
                total = math.nan
            if total - total == 0.0 and 0.0 not in vals:  # finite, no -0.0: as they are
                grid[b.rank] = list(vals)
                continue
        row = grid[b.rank]
        for k, s in enumerate(chosen):
            i = bisect_left(b.steps, s)
            if i < len(b.steps) and b.steps[i] == s:
                v = col[i]
                row[k] = v + 0.0 if v - v == 0.0 else math.nan  # (`_mean` of one value)
    return [(s, s) for s in chosen], grid


def _bucketed(table: Any, key: str, chosen: list[int], n_buckets: int
              ) -> tuple[list[tuple[int, int]], dict[int, list[float | None]]]:
    """`reduce.heatmap`'s buckets of several steps (a terminal's 40 columns over 50
    steps): per rank and bucket the mean of its finite values there (`reduce._mean`, the
    same bits), NaN when it has only non-finite ones, None when none. A block with the
    usual steps sums each bucket's slice of its column in C; at 16,384 ranks the cell by
    cell loop of `reduce.heatmap` took 4 s."""
    nb = n_buckets
    groups = [chosen[b * len(chosen) // nb: (b + 1) * len(chosen) // nb] for b in range(nb)]
    grid: dict[int, list[float | None]] = {r: [None] * nb for r in range(table.world_size)}
    mine, usual, where = _usual_steps(table, key)
    spans = []  # each bucket's (start, end) in the usual steps, when it is a run of them
    for group in groups:
        first, last = where.get(group[0]), where.get(group[-1])
        ok = first is not None and last is not None and last - first + 1 == len(group)
        spans.append((first, last + 1) if ok else None)  # type: ignore[operator]
    whole = None not in spans
    for b in mine:
        col = b.columns[key]
        if whole and b.steps == usual:
            grid[b.rank] = [_cell(col[i:j]) for i, j in spans]  # type: ignore[misc]
            continue
        row = grid[b.rank]
        for k, group in enumerate(groups):
            xs = []
            for s in group:
                i = bisect_left(b.steps, s)
                if i < len(b.steps) and b.steps[i] == s:
                    xs.append(col[i])
            if xs:
                row[k] = _cell(xs)
    return [(g[0], g[-1]) for g in groups], grid


def _usual_steps(table: Any, key: str) -> tuple[list[Any], array[int], dict[int, int]]:
    """The blocks holding `key`, the steps most of them have (the median block's: every
    rank at every step, usually) and each of those steps' index."""
    mine = [b for b in table.blocks if key in b.columns]
    usual = mine[len(mine) // 2].steps if mine else array("q")
    return mine, usual, {s: i for i, s in enumerate(usual)}


def _cell(xs: Sequence[float]) -> float:
    """`reduce.heatmap`'s cell of the values `xs` (at least one)."""
    try:
        total = math.fsum(xs)
    except (OverflowError, ValueError):
        total = math.nan
    if total - total != 0.0:  # an infinity or NaN among them (or an overflowing sum)
        good = [x for x in xs if math.isfinite(x)]
        return reduce._mean(good) if good else math.nan
    return total / len(xs)  # (`_mean`: the same sum, divided)

