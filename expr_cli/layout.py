"""Thousands of ranks in a screenful (DESIGN 14): nodes, worst first, bins. Pure data, no rich.

Ranks are grouped by node: the host a rank's sidecar names, else `rank // local_world_size`
(from the sidecars, else 8). Views name every outlier rank, then show the worst nodes,
and fold the other nodes into a few bins combined with `--agg max|min|mean`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .resolve import compact_ranks

if TYPE_CHECKING:
    from expr_tracker.health.state import RunState

DEFAULT_PER_NODE = 8  # GPUs per node when no sidecar says
ALL_RANKS_UP_TO = 32  # at most this many ranks: one row each, no grouping
WORST_RANKS = 8  # outlier ranks with a heatmap row of their own
WORST_NODES = 8  # nodes shown one row each
BINS = 8  # the other nodes fold into at most this many rows

Cell = float | None


class Nodes:
    """Which node each rank runs on."""

    def __init__(self, hosts: Mapping[int, str], per_node: int, world: int) -> None:
        self.hosts = dict(hosts)
        self.per_node = max(1, per_node)
        self.world = world

    @classmethod
    def of(cls, state: RunState | None, world: int) -> Nodes:
        """From the sidecars read into `state` (hosts, local world sizes)."""
        if state is None:
            return cls({}, DEFAULT_PER_NODE, world)
        hosts = {r: rs.host for r, rs in state.ranks.items() if rs.host}
        sizes = [rs.local_world_size for rs in state.ranks.values() if rs.local_world_size]
        locals_ = [rs.local_rank for rs in state.ranks.values() if rs.local_rank is not None]
        if sizes:
            per = max(sizes)
        elif locals_ and max(locals_) > 0:
            per = max(locals_) + 1
        else:
            per = DEFAULT_PER_NODE
        return cls(hosts, per, world)

    def label(self, rank: int) -> str:
        """The host of `rank`; else the host of a rank in its `rank // per_node` group (a
        rank without a sidecar); else `node<rank // per_node>`."""
        host = self.hosts.get(rank)
        if host is not None:
            return host
        base = rank - rank % self.per_node
        for r in range(base, base + self.per_node):
            if r in self.hosts:
                return self.hosts[r]
        return f"node{rank // self.per_node}"

    def groups(self, ranks: Iterable[int] | None = None) -> dict[str, list[int]]:
        """node label -> its ranks (ascending), nodes in the order of their first rank."""
        out: dict[str, list[int]] = {}
        for r in sorted(range(self.world) if ranks is None else ranks):
            out.setdefault(self.label(r), []).append(r)
        return out


def outlier_order(o: Any) -> tuple[float, int]:
    """Sort key of an `Outlier`: the furthest from the median (relatively) first."""
    if o.ratio is not None:
        far = abs(o.ratio - 1.0)
    else:
        far = math.inf if o.robust is None or o.robust != 0.0 else 0.0
    return (-far, o.rank)


def _clean(row: Sequence[Cell]) -> bool:
    """Every cell a finite number (the loops over them run in C: 16,384 rows of 60)."""
    return None not in row and all(map(math.isfinite, row))  # type: ignore[arg-type]


def _badness(grid: Mapping[int, Sequence[Cell]]) -> dict[int, float]:
    """Per rank, the largest relative distance of its cells from their column's median."""
    if not grid:
        return {}
    width = len(next(iter(grid.values())))
    medians: list[float | None] = []
    for col in zip(*grid.values(), strict=True) if width else ():
        vals = sorted(col) if _clean(col) else sorted(
            v for v in col if v is not None and math.isfinite(v))
        medians.append(_median(vals) if vals else None)
    out = {}
    clean = [r for r, row in grid.items() if _clean(row)] if width else []
    if clean:
        # rows of finite cells (a clean row means every column has a median): a column at
        # a time, each a list in one comprehension, the maximum per rank in C
        dists = []
        for col, m in zip(zip(*(grid[r] for r in clean), strict=True), medians, strict=True):
            assert m is not None
            am = abs(m)
            dists.append([abs(v - m) / am for v in col] if m != 0.0 else [abs(v - m) for v in col])
        out = dict(zip(clean, map(max, *dists), strict=True)) if width > 1 else dict(
            zip(clean, dists[0], strict=True))
    done = set(clean)
    for r, row in grid.items():
        if r in done:
            continue
        worst = 0.0
        for v, m in zip(row, medians, strict=True):
            if m is None:
                continue
            if v is None:
                worst = max(worst, 1.0)  # silent where the others reported: as bad as 2x
                continue
            if not math.isfinite(v):
                worst = math.inf
                break
            d = abs(v - m) / abs(m) if m != 0.0 else abs(v - m)
            worst = max(worst, d)
        out[r] = worst
    return out if len(done) in (0, len(grid)) else {r: out[r] for r in grid}


def _median(s: Sequence[float]) -> float:
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


def combine(rows: Sequence[Sequence[Cell]], agg: str) -> list[Cell]:
    """Cells of several ranks as one row: `agg` of the finite values per column; a
    non-finite value anywhere shows (NaN); None where none of them reported."""
    if not rows:
        return []
    if all(map(_clean, rows)):  # (most nodes: the same answer, the columns gone over in C)
        if agg == "mean":
            return [math.fsum(col) / len(col) for col in zip(*rows, strict=True)]
        if agg in ("min", "max"):
            return list(rows[0]) if len(rows) == 1 else list(map(min if agg == "min" else max, *rows))
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


def heatmap_rows(
    grid: Mapping[int, Sequence[Cell]], nodes: Nodes, flagged: Iterable[int], agg: str,
    notable: float = 0.05,
) -> list[dict[str, Any]]:
    """The heatmap's rows: every rank when there are few; else the outlier ranks, the worst
    nodes, then bins of the other nodes, each row `{label, kind, ranks, cells}`."""
    if len(grid) <= ALL_RANKS_UP_TO:
        return [{"label": f"r{r}", "kind": "rank", "ranks": str(r), "cells": list(grid[r])}
                for r in sorted(grid)]
    bad = _badness(grid)
    rows: list[dict[str, Any]] = []
    named = sorted(set(flagged) & set(grid), key=lambda r: (-bad.get(r, 0.0), r))
    for r in named[:WORST_RANKS]:
        rows.append({"label": f"r{r} {nodes.label(r)}", "kind": "rank", "ranks": str(r),
                     "cells": list(grid[r])})
    groups = nodes.groups(grid)
    node_bad = {n: max(bad.get(r, 0.0) for r in rs) for n, rs in groups.items()}
    # a node is among the worst only if it stands out: `notable` from its column's median
    worst = sorted((n for n in groups if node_bad[n] >= notable),
                   key=lambda n: (-node_bad[n], groups[n][0]))[:WORST_NODES]
    for name in worst:
        members = groups[name]
        rows.append({"label": name, "kind": "node", "ranks": compact_ranks(members),
                     "cells": combine([grid[r] for r in members], agg)})
    shown = set(worst)
    rest = [n for n in groups if n not in shown]
    per_bin = max(1, math.ceil(len(rest) / BINS))
    for i in range(0, len(rest), per_bin):
        chunk = rest[i:i + per_bin]
        members = [r for n in chunk for r in groups[n]]
        label = chunk[0] if len(chunk) == 1 else f"r{members[0]}-{members[-1]}"
        rows.append({"label": label, "kind": "bin", "ranks": compact_ranks(members),
                     "cells": combine([grid[r] for r in members], agg)})
    return rows


def disagreeing_world_sizes(worlds: Mapping[int, int], world: int) -> list[dict[str, Any]]:
    """When rank records name more than one `_world_size`: each size and its ranks, the most
    common first (issue 10, item 22); [] when they agree."""
    by: dict[int, list[int]] = {}
    for r, w in worlds.items():
        by.setdefault(w, []).append(r)
    beyond = sorted(r for r, w in worlds.items() if r >= w)
    if len(by) <= 1 and not beyond:
        return []
    out = [{"world_size": w, "ranks": sorted(rs), "beyond": False}
           for w, rs in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    if beyond:
        out.append({"world_size": None, "ranks": beyond, "beyond": True})
    return out


def sidecar_world_warning(sidecars: Mapping[int, int], records: Mapping[int, int],
                          world: int) -> str | None:
    """One line when the sidecars' world size (rank -> size) is not what the ranks' rank
    records say (`_world_size`), naming both and their ranks; None when they agree (or
    either says nothing)."""
    side = {r: w for r, w in sidecars.items() if w}
    recs = {r: w for r, w in records.items() if w}
    if not side or not recs or set(side.values()) == set(recs.values()):
        return None

    def said(sizes: Mapping[int, int]) -> str:
        by: dict[int, list[int]] = {}
        for r, w in sizes.items():
            by.setdefault(w, []).append(r)
        return ", ".join(f"{w} (rank{'s' if len(rs) != 1 else ''} {compact_ranks(sorted(rs))})"
                         for w, rs in sorted(by.items()))

    return (f"the sidecars say world_size {said(side)}, the rank records {said(recs)}; "
            f"using {world}")


def world_size_warning(groups: Sequence[Mapping[str, Any]], world: int) -> str:
    """One line naming the ranks that disagree on the world size."""
    parts = [f"{g['world_size']} (rank{'s' if len(g['ranks']) != 1 else ''} "
             f"{compact_ranks(list(g['ranks']))})" for g in groups if not g["beyond"]]
    text = "rank records disagree on world_size: " + ", ".join(parts)
    beyond = [g for g in groups if g["beyond"]]
    if beyond:
        ranks = list(beyond[0]["ranks"])
        text += (f"; rank {ranks[0]} is beyond its world_size" if len(ranks) == 1 else
                 f"; ranks {compact_ranks(ranks)} are beyond their world_size")
    return text + f"; using {world}"


def coverage_runs(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive coverage rows missing the same ranks as one `{first, last, steps,
    reported, world, missing}` (a crashed rank misses every step after it)."""
    out: list[dict[str, Any]] = []
    for r in rows:
        prev = out[-1] if out else None
        if prev is not None and prev["missing"] == r["missing"] and prev["world"] == r["world"]:
            prev["last"] = r["step"]
            prev["steps"] += 1
        else:
            out.append({"first": r["step"], "last": r["step"], "steps": 1,
                        "reported": r["reported"], "world": r["world"], "missing": r["missing"]})
    return out


NODE_AGGS = ("worst", "max", "min", "mean")


def _agg(values: Sequence[float], how: str) -> float | None:
    if not values:
        return None
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return math.fsum(values) / len(values)


def fold_nodes(nodes: Sequence[Mapping[str, Any]], room: int, agg: str = "worst") -> list[dict[str, Any]]:
    """`expr top`'s node rows in at most `room` rows: the nodes that need a look (not all
    running, a rank behind, an incident) one row each, worst first, then the others folded into bins of
    consecutive nodes. A bin's `min_step`, `max_behind` and `slowest` combine its nodes'
    with `agg`: `worst` (min step, max behind, slowest rate), or max, min or mean of each."""
    if len(nodes) <= room:
        return [dict(n, kind="node") for n in nodes]
    bad = [n for n in nodes if n.get("incident") or n["worst"] != "running"
           or n["live"] < n["ranks"] or n["max_behind"]]
    bins = max(1, min(BINS, room // 2)) if len(nodes) > len(bad) else 0
    shown = bad[: max(0, room - bins)]
    bins = min(bins, room - len(shown))
    out = [dict(n, kind="node") for n in shown]
    named = {id(n) for n in shown}
    rest = sorted((n for n in nodes if id(n) not in named), key=lambda n: n.get("first_rank", 0))
    if not rest or bins <= 0:
        return out
    per_bin = max(1, math.ceil(len(rest) / bins))
    for i in range(0, len(rest), per_bin):
        chunk = rest[i : i + per_bin]
        if len(chunk) == 1:
            out.append(dict(chunk[0], kind="node"))
            continue
        steps = [n["min_step"] for n in chunk if n["min_step"] is not None]
        rates = [n["slowest"] for n in chunk if n["slowest"] is not None]
        behind = [n["max_behind"] for n in chunk]
        order = {"crashed": 0, "running": 1, "finished": 2}
        first, last = chunk[0].get("first_rank"), chunk[-1].get("last_rank")
        out.append({
            "node": f"r{first}-{last}", "kind": "bin", "nodes": len(chunk),
            "first_rank": first, "last_rank": last,
            "ranks": sum(n["ranks"] for n in chunk), "live": sum(n["live"] for n in chunk),
            "min_step": min(steps, default=None) if agg == "worst" else _agg(steps, agg),
            "max_behind": max(behind, default=0) if agg == "worst" else _agg(behind, agg),
            "slowest": min(rates, default=None) if agg == "worst" else _agg(rates, agg),
            "worst": min((n["worst"] for n in chunk), key=lambda s: order.get(s, 3)),
            "incident": next((n["incident"] for n in chunk if n.get("incident")), None),
        })
    return out
