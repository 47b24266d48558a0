"""Cross-rank reducers (DESIGN 10), checked against numpy on random data."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from expr_tracker.stats.reduce import (
    HeatCell,
    Outlier,
    RankTable,
    Stats,
    collect,
    coverage,
    heatmap,
    outliers,
    reduce_step,
    reduce_values,
    reduce_window,
    window_means,
)
from expr_tracker.store import records

NAN = math.nan
INF = math.inf
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a cell: a finite value, a non-finite one, or None for "this rank reported nothing"
cell = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.sampled_from([NAN, INF, -INF]),
    st.none(),
)


def close(a: float | None, b: float, scale: float) -> bool:
    """Equal to 1e-9 relative, measured against the data's magnitude (sums cancel)."""
    assert a is not None
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=max(1e-9 * scale, 1e-300))


def np_std(xs: np.ndarray) -> float:
    """numpy's std on data scaled by a power of two (exact), so tiny values' squares don't
    underflow to zero in the reference."""
    p2 = 2.0 ** math.frexp(float(np.max(np.abs(xs))))[1]
    return float(np.std(xs / p2)) * p2


def np_wmean(xs: np.ndarray, ws: np.ndarray) -> float:
    """numpy's weighted mean with the weights scaled up by a power of two, for the same reason."""
    return float(np.average(xs, weights=ws / 2.0 ** math.frexp(float(np.max(ws)))[1]))


def rank_record(step: int, rank: int, world: int = 4, weight: float | None = None, **kv: Any):
    rec: dict[str, Any] = {"_kind": "rank", "_step": step, "_time": 1.0, "_rank": rank}
    rec["_world_size"] = world
    if weight is not None:
        rec["_weight"] = weight
    rec.update(kv)
    return rec


def check_against_numpy(
    stats: Stats, values: dict[int, float], world: int, weights: dict[int, float] | None
) -> None:
    finite = {r: x for r, x in values.items() if math.isfinite(x)}
    bad = sorted(r for r, x in values.items() if not math.isfinite(x))
    assert stats.n == len(finite)
    assert stats.world == world
    assert stats.nonfinite == len(bad)
    assert stats.nonfinite_ranks == bad
    assert stats.missing == [r for r in range(world) if r not in values]
    if not finite:
        assert stats.mean is stats.std is stats.p50 is stats.wmean is stats.min is None
        return
    xs = np.array(list(finite.values()))
    scale = float(np.max(np.abs(xs))) or 1.0
    assert close(stats.mean, float(np.mean(xs)), scale)
    assert close(stats.std, np_std(xs), scale)
    assert stats.min == float(np.min(xs))
    assert stats.max == float(np.max(xs))
    assert close(stats.range, float(np.ptp(xs)), scale)
    p05, p50, p95 = np.percentile(xs, [5, 50, 95])
    assert close(stats.p05, float(p05), scale)
    assert close(stats.p50, float(p50), scale)
    assert close(stats.p95, float(p95), scale)
    ws = np.array([(weights or {}).get(r, 1.0) for r in finite])
    if ws.sum() == 0:
        assert stats.wmean is None
    else:
        assert close(stats.wmean, np_wmean(xs, ws), scale)


@st.composite
def per_rank(draw: st.DrawFn, max_world: int = 64) -> tuple[int, dict[int, float], dict]:
    world = draw(st.integers(1, max_world))
    cells = draw(st.lists(cell, min_size=world, max_size=world))
    values = {r: x for r, x in enumerate(cells) if x is not None}
    weights = draw(
        st.one_of(
            st.none(),
            st.dictionaries(st.integers(0, world - 1), st.floats(0, 1e3), max_size=world),
        )
    )
    return world, values, weights


@SETTINGS
@given(per_rank())
def test_reduce_values_matches_numpy(case: tuple[int, dict[int, float], dict | None]) -> None:
    world, values, weights = case
    stats = reduce_values(values, world, weights)
    check_against_numpy(stats, values, world, weights)


def test_reduce_values_512_ranks_with_gaps_nonfinite_and_weights() -> None:
    rng = random.Random(7)
    for _ in range(20):
        values = {r: rng.gauss(3.0, 0.5) * 10 ** rng.randint(-3, 3) for r in range(512)}
        for r in rng.sample(range(512), 20):
            del values[r]
        for r in rng.sample(sorted(values), 5):
            values[r] = rng.choice([NAN, INF, -INF])
        weights = {r: rng.uniform(0, 2048) for r in range(512)}
        stats = reduce_values(values, 512, weights)
        check_against_numpy(stats, values, 512, weights)
        assert len(stats.missing) == 20 and stats.nonfinite == 5


def test_reduce_values_edge_cases() -> None:
    empty = reduce_values({}, 3)
    assert empty.n == 0 and empty.missing == [0, 1, 2] and empty.mean is None
    only_bad = reduce_values({0: NAN, 1: INF}, 2)
    assert (only_bad.n, only_bad.nonfinite, only_bad.nonfinite_ranks) == (0, 2, [0, 1])
    assert only_bad.p95 is None and only_bad.range is None
    assert reduce_values({0: 1.0, 1: 3.0}, 2, {0: 0.0, 1: 0.0}).wmean is None
    assert reduce_values({0: 1.0, 1: 3.0}, 2, {0: 3.0, 1: 1.0}).wmean == 1.5
    assert reduce_values({0: 1.0, 1: 3.0}, 2, {0: 3.0}).wmean == 1.5  # rank 1 weighs 1.0
    # equal values: exactly the value and a zero spread, whatever the rounding of the sum
    same = reduce_values(dict.fromkeys(range(7), 0.1), 7)
    assert (same.mean, same.std, same.p05, same.range) == (0.1, 0.0, 0.1, 0.0)
    huge = reduce_values({0: 1.5e308, 1: 1.7e308}, 2)
    assert huge.mean == pytest.approx(1.6e308) and huge.max == 1.7e308
    with pytest.raises(ValueError, match="weights"):
        reduce_values({0: 1.0, 1: 2.0}, 2, {0: -1.0, 1: 1.0})
    with pytest.raises(ValueError, match="weights"):
        reduce_values({0: 1.0, 1: 2.0}, 2, {0: NAN, 1: 1.0})
    with pytest.raises(ValueError, match="world_size"):
        reduce_values({0: 1.0}, -1)


def test_stats_as_dict_is_json() -> None:
    stats = reduce_values({0: 1.0, 2: NAN, 3: 2.0}, 4)
    data = orjson.loads(orjson.dumps(stats.as_dict()))
    assert data["missing"] == [1] and data["nonfinite_ranks"] == [2]
    assert data["mean"] == 1.5 and data["n"] == 2 and data["world"] == 4
    assert set(data) == {
        "n", "world", "mean", "wmean", "min", "max", "range", "std",
        "p05", "p50", "p95", "missing", "nonfinite", "nonfinite_ranks",
    }  # fmt: skip


# --- collect -----------------------------------------------------------------------------


def shard_lines(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-trip through the on-disk encoding, as the CLI reads shards."""
    out = []
    for rec in recs:
        enc = {k: records.encode_value(k, v) if k[0] != "_" else v for k, v in rec.items()}
        out.append(records.loads(records.dumps(enc)))
    return out


def test_collect_groups_by_rank_not_by_file_and_latest_wins() -> None:
    # "file" of rank 0: its own records plus records it logged for ranks 1-3 (all-gather)
    rank0_file = [rank_record(1, 0, loss=1.0)] + [
        rank_record(1, r, weight=2.0, loss=float(r)) for r in (1, 2, 3)
    ]
    # "file" of rank 2 comes later and repeats (step 1, rank 2): its loss wins, gn is new
    rank2_file = [rank_record(1, 2, loss=20.0, gn=5.0), rank_record(2, 2, loss=NAN)]
    other = [{"_step": 1, "loss": 99.0}, {"_kind": "alert", "_step": 1, "_rank": 0}]
    table = collect(shard_lines(rank0_file + other + rank2_file))
    assert table.values("loss", 1) == {0: 1.0, 1: 1.0, 2: 20.0, 3: 3.0}
    assert table.values("gn", 1) == {2: 5.0}
    assert table.weights(1) == {0: 1.0, 1: 2.0, 2: 1.0, 3: 2.0}
    assert math.isnan(table.values("loss", 2)[2])
    assert table.ranks_at(2) == {2} and table.ranks_at(7) == set()
    assert (table.world_size, table.steps, table.keys, len(table)) == (4, [1, 2], ["gn", "loss"], 5)


def test_collect_latest_wins_per_key_and_odd_values() -> None:
    table = collect(
        [
            rank_record(5, 1, world=2, a=1.0, b=2.0, weight=4.0),
            rank_record(5, 1, world=2, a=3, s="text", flag=True, none=None, weight=NAN),
            rank_record(5, 9, world=2, a=1.0),  # rank beyond _world_size widens the world
            {"_kind": "rank", "_step": "x", "_rank": 0, "a": 1.0},  # no integer step: skipped
        ]
    )
    assert table.values("a", 5) == {1: 3.0, 9: 1.0}  # the later record's a, as a float
    assert table.values("b", 5) == {1: 2.0}  # b of the earlier record survives
    assert table.weights(5) == {1: 1.0, 9: 1.0}  # a NaN weight counts as 1.0
    assert table.keys == ["a", "b"] and table.world_size == 10 and table.skipped == 1
    assert len(table) == 2 and len(RankTable()) == 0 and RankTable().steps == []
    odd = collect(
        [
            rank_record(0, 0, world=2, weight=2, a=np.float64(1.5)),  # int weight, numpy float
            rank_record(0, 1, world=10**9, weight=-1.0, a=2.0),  # corrupt world: ignored
            rank_record(0, 10**9, a=1.0),  # corrupt rank: skipped
        ]
    )
    assert odd.values("a", 0) == {0: 1.5, 1: 2.0} and odd.weights(0) == {0: 2.0, 1: 1.0}
    assert odd.world_size == 2 and odd.skipped == 1


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict]:
    """Shuffled rank records of a few steps plus the expected final (step, rank) cells."""
    world = draw(st.integers(1, 12))
    nsteps = draw(st.integers(1, 6))
    uniform = draw(st.booleans())
    recs = []
    expect: dict[tuple[int, int], tuple[float, float]] = {}
    for step in range(0, nsteps * 10, 10):
        for rank in range(world):
            for _ in range(draw(st.integers(0, 2))):  # 0: missing, 2: a repeat that wins
                x = draw(cell.filter(lambda v: v is not None))
                w = 1.0 if uniform else draw(st.floats(0, 100))
                recs.append(rank_record(step, rank, world=world, weight=w, loss=x))
                expect[(step, rank)] = (x, w)
    return recs, {"world": world if recs else 0, "cells": expect}


def expected_values(expect: dict, step: int) -> tuple[dict[int, float], dict[int, float]]:
    cells = expect["cells"]
    vals = {r: x for (s, r), (x, _) in cells.items() if s == step}
    ws = {r: w for (s, r), (_, w) in cells.items() if s == step}
    return vals, ws


@SETTINGS
@given(tables())
def test_reduce_step_matches_numpy_on_collected_records(case: tuple[list, dict]) -> None:
    recs, expect = case
    table = collect(recs)
    world = expect["world"]
    assert table.world_size == world
    for step in [*table.steps, 12345]:
        vals, ws = expected_values(expect, step)
        assert table.values("loss", step) == pytest.approx(vals, nan_ok=True)
        check_against_numpy(reduce_step(table, "loss", step), vals, world, ws)


@SETTINGS
@given(tables(), st.integers(-5, 60), st.integers(0, 70))
def test_reduce_window_is_stats_of_per_rank_means(case: tuple, lo: int, hi: int) -> None:
    recs, expect = case
    table = collect(recs)
    world = expect["world"]
    cells = expect["cells"]
    inside = {(s, r): v for (s, r), v in cells.items() if lo <= s < hi}
    seen = {r for _, r in inside}
    means: dict[int, float] = {}
    wmeans: dict[int, float] = {}
    for rank in sorted(seen):
        pairs = [(x, w) for (_, r), (x, w) in inside.items() if r == rank and math.isfinite(x)]
        if pairs:
            means[rank] = float(np.mean([x for x, _ in pairs]))
            wmeans[rank] = float(np.mean([w for _, w in pairs]))
    stats = reduce_window(table, "loss", lo, hi)
    assert window_means(table, "loss", lo, hi) == pytest.approx(means)
    bad = [x for x, _ in inside.values() if not math.isfinite(x)]
    assert stats.nonfinite == len(bad)
    assert stats.nonfinite_ranks == sorted(
        {r for (_, r), (x, _) in inside.items() if not math.isfinite(x)}
    )
    assert stats.missing == [r for r in range(world) if r not in seen]
    assert stats.n == len(means)
    if means:
        xs = np.array(list(means.values()))
        scale = float(np.max(np.abs(xs))) or 1.0
        assert close(stats.mean, float(np.mean(xs)), scale)
        assert close(stats.std, np_std(xs), scale)
        assert close(stats.p95, float(np.percentile(xs, 95)), scale)
        ws = np.array(list(wmeans.values()))
        if ws.sum() > 0:
            assert close(stats.wmean, np_wmean(xs, ws), scale)
        else:
            assert stats.wmean is None
    else:
        assert stats.mean is None


def test_reduce_window_bounds_and_a_large_dense_table() -> None:
    rng = random.Random(3)
    world, nsteps = 64, 200
    recs = [
        rank_record(s, r, world=world, weight=1024.0, a=rng.random(), b=rng.random())
        for r in range(world)
        for s in range(nsteps)
    ]
    table = collect(recs)
    per_rank = [
        np.mean([rec["a"] for rec in recs[r * nsteps + 50 : r * nsteps + 100]])
        for r in range(world)
    ]
    stats = reduce_window(table, "a", 50, 100)
    assert close(stats.mean, float(np.mean(per_rank)), 1.0)
    assert close(stats.std, float(np.std(per_rank)), 1.0)
    assert stats.wmean == stats.mean and stats.missing == [] and stats.n == world
    assert reduce_window(table, "a", 300, 400).missing == list(range(world))
    assert reduce_window(table, "a", 100, 50).n == 0
    row = {r: recs[r * nsteps + 17]["b"] for r in range(world)}
    check_against_numpy(reduce_step(table, "b", 17), row, world, None)
    assert reduce_step(table, "nope", 17).missing == list(range(world))
    # per-rank weights that differ: the weighted mean really weighs
    weighted = collect(
        [
            rank_record(s, r, world=8, weight=float(r), a=float(r * s))
            for r in range(8)
            for s in range(3)
        ]
    )
    stats = reduce_step(weighted, "a", 2)
    assert close(stats.wmean, np_wmean(np.arange(0, 16, 2.0), np.arange(8.0)), 1.0)
    assert stats.wmean != stats.mean and weighted.weights(2) == {r: float(r) for r in range(8)}


# --- outliers ----------------------------------------------------------------------------


def test_outliers_flag_the_slow_rank_by_robust_score_only() -> None:
    times = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 2.0, 1.0]
    out = outliers(dict(enumerate(times)))
    assert [o.rank for o in out] == list(range(8))
    assert [o.rank for o in out if o.flagged] == [6]
    slow = out[6]
    assert slow.robust == pytest.approx(0.6745 * (2.0 - 1.0) / 0.01)
    assert slow.delta == pytest.approx(2.0 - np.mean(times))
    assert slow.z == pytest.approx((2.0 - np.mean(times)) / np.std(times))
    # the plain z-score of the same rank stays under sqrt(n - 1) < 3: it could never flag it
    assert max(abs(o.z or 0.0) for o in out) <= math.sqrt(7) < 3
    assert isinstance(slow, Outlier) and slow.as_dict()["flagged"] is True


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=64))
def test_plain_z_never_exceeds_sqrt_n_minus_1(xs: list[float]) -> None:
    out = outliers(dict(enumerate(xs)))
    bound = math.sqrt(len(xs) - 1)
    for o in out:
        assert o.z is None or abs(o.z) <= bound * (1 + 1e-9) + 1e-12


@SETTINGS
@given(st.lists(st.one_of(st.floats(-1e3, 1e3), st.sampled_from([0.5, 0.5, 7.0, NAN])),
                min_size=0, max_size=40), st.floats(0.0, 5.0))
def test_flagged_only_is_the_flagged_subset(xs: list[float], threshold: float) -> None:
    values = dict(enumerate(xs))
    every = outliers(values, threshold)
    assert outliers(values, threshold, flagged_only=True) == [o for o in every if o.flagged]


def test_outliers_mad_zero_rule_and_nonfinite() -> None:
    assert not any(o.flagged for o in outliers(dict.fromkeys(range(8), 0.1)))
    assert all(o.robust == 0.0 and o.z is None for o in outliers(dict.fromkeys(range(8), 3.0)))
    # MAD 0 (most ranks agree exactly): the relative difference from the median decides
    xs = [1.0] * 7 + [2.0]
    out = outliers(dict(enumerate(xs)))
    assert out[7].flagged and out[7].robust is None and out[7].ratio == 2.0
    assert not any(o.flagged for o in out[:7]) and out[0].robust == 0.0 and out[0].ratio == 1.0
    # one rank in four, which the mean-absolute-deviation fallback could never flag
    four = outliers({0: 0.5, 1: 0.5, 2: 0.8, 3: 0.5})
    assert [o.rank for o in four if o.flagged] == [2]
    # a 0.3% difference among identical step times is not an outlier (issue 11)
    small = outliers(dict(enumerate([1.0] * 7 + [1.003])))
    assert not any(o.flagged for o in small)
    assert [o.flagged for o in outliers(dict(enumerate(xs)), min_rel=1.5)] == [False] * 8
    mixed = outliers({0: 1.0, 3: NAN, 5: 2.0})
    assert [o.rank for o in mixed] == [0, 5]
    assert outliers({}) == [] and outliers({0: INF}) == []
    with pytest.raises(ValueError, match="min_rel"):
        outliers({0: 1.0}, min_rel=-0.1)


def test_outliers_need_robust_z_and_the_relative_difference() -> None:
    # a tight cluster: 2% off has a huge robust z but is under the default 5%
    xs = [1.0 + 0.0001 * i for i in range(15)] + [1.02]
    out = outliers(dict(enumerate(xs)))
    assert abs(out[15].robust or 0.0) > 3.5 and not out[15].flagged
    assert outliers(dict(enumerate(xs)), min_rel=0.01)[15].flagged
    # a wide spread: 30% off is over min_rel but not over the robust threshold
    wide = [1.0, 1.5, 0.6, 1.2, 0.8, 1.3]
    assert not any(o.flagged for o in outliers(dict(enumerate(wide))))


@SETTINGS
@given(
    st.lists(st.one_of(st.integers(-5, 5).map(float), st.floats(-1e6, 1e6)), min_size=1, max_size=64),
    st.floats(0.0, 1.0),
)
@example(xs=[0.0, 5e-324], min_rel=0.0)  # subnormals: np.median and p50 round apart
def test_outlier_flags_follow_the_rule(xs: list[float], min_rel: float) -> None:
    out = outliers(dict(enumerate(xs)), min_rel=min_rel)
    # the median as DESIGN 10's p50, numpy.percentile's (np.median rounds differently at
    # subnormals: [0.0, 5e-324] has p50 5e-324 but np.median 0.0)
    med = float(np.percentile(xs, 50))
    mad = float(np.percentile(np.abs(np.array(xs) - med), 50))
    for o in out:
        rel_ok = o.value != med and abs(o.value - med) >= abs(med) * min_rel
        if mad > 0:
            assert o.robust == pytest.approx(0.6745 * (o.value - med) / mad, rel=1e-9, abs=1e-9)
            assert o.flagged == (rel_ok and abs(o.robust) > 3.5)
        else:
            assert o.flagged == rel_ok
            assert (o.robust == 0.0) if o.value == med else (o.robust is None)
        if o.value == med:
            assert not o.flagged  # a value equal to the median is never flagged
        assert o.ratio == (None if med == 0 else pytest.approx(o.value / med))


# --- coverage and heatmap ----------------------------------------------------------------


def test_coverage_lists_missing_ranks_per_step() -> None:
    recs = [rank_record(s, r, world=4, a=1.0) for s in (0, 1, 2) for r in range(4)]
    recs = [rec for rec in recs if not (rec["_step"] == 1 and rec["_rank"] in (1, 3))]
    table = collect(recs)
    assert coverage(table) == [(0, 4, 4, []), (1, 2, 4, [1, 3]), (2, 4, 4, [])]
    assert coverage(table, [2, 9]) == [(2, 4, 4, []), (9, 0, 4, [0, 1, 2, 3])]


def test_heatmap_bucket_means_missing_and_nonfinite_cells() -> None:
    recs = []
    for s in range(10):
        for r in range(3):
            if r == 2 and s >= 5:
                continue  # rank 2 stops reporting halfway
            x = NAN if (r == 1 and s in (5, 6, 7, 8, 9)) else float(10 * r + s)
            recs.append(rank_record(s, r, world=4, a=x))
    table = collect(recs)
    buckets, grid = heatmap(table, "a", 2)
    assert buckets == [(0, 4), (5, 9)]
    assert sorted(grid) == [0, 1, 2, 3]
    assert grid[0] == [2.0, 7.0]
    assert grid[1][0] == 12.0 and math.isnan(grid[1][1])  # reported, but only NaN
    assert grid[2] == [22.0, None]
    assert grid[3] == [None, None]  # rank 3 of 4 never reported
    buckets, grid = heatmap(table, "a", 100)
    assert len(buckets) == 10 and buckets[3] == (3, 3) and grid[0][3] == 3.0
    buckets, grid = heatmap(table, "a", 3, steps=[0, 1, 2, 50])
    assert buckets == [(0, 0), (1, 1), (2, 50)] and grid[0] == [0.0, 1.0, 2.0]
    assert heatmap(table, "nope", 4) == ([], {0: [], 1: [], 2: [], 3: []})
    with pytest.raises(ValueError, match="n_buckets"):
        heatmap(table, "a", 0)
    assert all(isinstance(c, HeatCell) for row in grid.values() for c in row)
