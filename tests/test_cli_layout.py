"""expr_cli.layout: nodes, heatmap rows of thousands of ranks, --agg, world-size groups."""

from __future__ import annotations

import math

from expr_cli.layout import (
    ALL_RANKS_UP_TO,
    Nodes,
    combine,
    coverage_runs,
    disagreeing_world_sizes,
    heatmap_rows,
)


def test_combine_per_agg_keeps_nonfinite_and_gaps_visible():
    rows = [[1.0, None, 2.0], [3.0, None, math.nan], [2.0, None, 4.0]]
    assert combine(rows, "max")[:2] == [3.0, None] and math.isnan(combine(rows, "max")[2])
    assert combine(rows, "min")[0] == 1.0 and combine(rows, "mean")[0] == 2.0


def test_nodes_from_hosts_else_rank_groups():
    nodes = Nodes({0: "a", 1: "a", 8: "b"}, 8, 24)
    assert nodes.label(0) == "a" and nodes.label(3) == "a"  # no sidecar: its group's host
    assert nodes.label(9) == "b" and nodes.label(17) == "node2"
    assert list(nodes.groups()) == ["a", "b", "node2"]


def test_heatmap_rows_name_outliers_then_worst_nodes_then_bins():
    world = 1024
    grid = {r: [1.0, 1.0, 1.0] for r in range(world)}
    grid[517] = [1.0, 3.0, 3.0]  # the straggler
    grid[40] = [1.0, None, None]  # a rank that went silent
    rows = heatmap_rows(grid, Nodes({}, 8, world), {517}, "max")
    assert len(rows) <= 1 + 8 + 8 + 1
    assert rows[0] == {"label": "r517 node64", "kind": "rank", "ranks": "517",
                       "cells": [1.0, 3.0, 3.0]}
    worst = [r["label"] for r in rows if r["kind"] == "node"]
    assert worst == ["node64", "node5"]
    bins = [r for r in rows if r["kind"] == "bin"]
    assert sum(len(r["ranks"].split(",")) for r in bins) >= 1 and len(bins) <= 8
    covered = set()
    for r in rows[1:]:
        for part in r["ranks"].split(","):
            a, _, b = part.partition("-")
            covered.update(range(int(a), int(b or a) + 1))
    assert covered == set(range(world))  # every rank sits in exactly one node or bin row
    mean = heatmap_rows(grid, Nodes({}, 8, world), {517}, "mean")
    node64 = next(r for r in mean if r["label"] == "node64")
    assert node64["cells"][1] == (7 * 1.0 + 3.0) / 8
    few = {r: [float(r)] for r in range(ALL_RANKS_UP_TO)}
    assert [r["label"] for r in heatmap_rows(few, Nodes({}, 8, 32), set(), "max")] == [
        f"r{r}" for r in range(32)]


def test_world_size_groups_and_coverage_runs():
    assert disagreeing_world_sizes({0: 8, 1: 8}, 8) == []
    groups = disagreeing_world_sizes({0: 4, 1: 4, 2: 8, 9: 8}, 10)
    assert [(g["world_size"], g["ranks"]) for g in groups] == [(4, [0, 1]), (8, [2, 9]), (None, [9])]
    rows = [{"step": s, "reported": 3, "world": 4, "missing": [2]} for s in range(5, 9)]
    rows.append({"step": 9, "reported": 2, "world": 4, "missing": [1, 2]})
    assert [(r["first"], r["last"], r["steps"]) for r in coverage_runs(rows)] == [(5, 8, 4), (9, 9, 1)]
