"""The heatmap's per-rank badness and per-node cells, computed a column at a time in C
(`layout._badness`, `layout.combine`), give what the cell-by-cell loops gave: every rank,
None (silent), NaN and infinities included."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from expr_cli import layout

Cell = float | None


def _badness_cell_by_cell(grid: Mapping[int, Sequence[Cell]]) -> dict[int, float]:
    """The loop as it was before (a73f360)."""
    if not grid:
        return {}
    width = len(next(iter(grid.values())))
    medians = []
    for b in range(width):
        col = sorted(v for row in grid.values() if (v := row[b]) is not None and math.isfinite(v))
        medians.append(layout._median(col) if col else None)
    out = {}
    for r, row in grid.items():
        worst = 0.0
        for v, m in zip(row, medians, strict=True):
            if m is None:
                continue
            if v is None:
                worst = max(worst, 1.0)
                continue
            if not math.isfinite(v):
                worst = math.inf
                break
            d = abs(v - m) / abs(m) if m != 0.0 else abs(v - m)
            worst = max(worst, d)
        out[r] = worst
    return out


def _combine_cell_by_cell(rows: Sequence[Sequence[Cell]], agg: str) -> list[Cell]:
    if not rows:
        return []
    out: list[Cell] = []
    for col in zip(*rows, strict=True):
        vals = [v for v in col if v is not None]
        if not vals:
            out.append(None)
        elif any(not math.isfinite(v) for v in vals):
            out.append(math.nan)
        elif agg == "min":
            out.append(min(vals))
        elif agg == "mean":
            out.append(math.fsum(vals) / len(vals))
        else:
            out.append(max(vals))
    return out


def _same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN (and None to None)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


cells = st.one_of(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6), st.floats(-1e6, 1e6),
                  st.none(), st.just(math.nan), st.just(math.inf), st.just(0.0))


@st.composite
def grids(draw: st.DrawFn) -> dict[int, list[Cell]]:
    width = draw(st.integers(0, 6))
    ranks = draw(st.lists(st.integers(0, 10_000), min_size=0, max_size=24, unique=True))
    clean = draw(st.booleans())  # a grid of finite cells only: the fast path everywhere
    cell = st.floats(-1e6, 1e6) if clean else cells
    return {r: draw(st.lists(cell, min_size=width, max_size=width)) for r in ranks}


@settings(max_examples=200, deadline=None)
@given(grids())
def test_badness_matches_the_cell_by_cell_loop(grid: dict[int, list[Cell]]) -> None:
    got, want = layout._badness(grid), _badness_cell_by_cell(grid)
    assert list(got) == list(want)  # every rank, in the grid's order
    assert all(_same(got[r], want[r]) for r in want)


@settings(max_examples=200, deadline=None)
@given(grids(), st.sampled_from(["max", "min", "mean"]))
def test_combine_matches_the_cell_by_cell_loop(grid: dict[int, list[Cell]], agg: str) -> None:
    rows = list(grid.values())
    got, want = layout.combine(rows, agg), _combine_cell_by_cell(rows, agg)
    assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))


def test_a_silent_rank_and_a_nan_among_clean_ranks() -> None:
    grid = {r: [1.0, 1.0 + r / 100, 2.0] for r in range(10)}
    grid[3] = [None, 1.0, 2.0]
    grid[4] = [1.0, math.nan, 2.0]
    grid[5] = [1.0, 1.0, 5.0]
    got = layout._badness(grid)
    assert got == _badness_cell_by_cell(grid)
    assert got[4] == math.inf and got[3] == 1.0 and got[5] == 1.5
