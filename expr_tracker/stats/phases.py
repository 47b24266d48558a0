"""Which phase makes the straggler slow: `time_ms/*` span keys reduced across ranks.

Pure logic over per-rank values (`expr summary --spans`, DESIGN 17). The straggler is
the rank whose top-level spans (paths without '/') exceed the ranks' medians by the
most in total; each span key then shows the median, the slowest rank, and how much
the straggler spends over the median in it. Keys are sorted by that excess, so the
phase that makes the straggler slow comes first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "time_ms/"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def span_phases(means: Mapping[str, Mapping[int, float]]) -> dict[str, Any]:
    """`means`: span key -> rank -> that rank's mean ms per step. Returns
    {"straggler": rank | None, "spans": [{key, path, ranks, median_ms, max_ms, max_rank,
    min_ms, min_rank, straggler_ms, excess_ms, ratio}, ...]} sorted by excess, worst first
    (ties: the wider spread, then the slower median first)."""
    medians: dict[str, float] = {}
    for key, values in means.items():
        xs = [x for x in values.values() if x == x]
        if xs:
            medians[key] = _median(xs)
    over: dict[int, float] = {}
    for key, values in means.items():
        if key not in medians or "/" in key[len(PREFIX):]:
            continue
        for rank, x in values.items():
            if x == x:
                over[rank] = over.get(rank, 0.0) + (x - medians[key])
    straggler = max(over, key=lambda r: (over[r], -r)) if over else None
    rows: list[dict[str, Any]] = []
    for key, values in means.items():
        if key not in medians:
            continue
        finite = {r: x for r, x in values.items() if x == x}
        max_rank = max(finite, key=lambda r: (finite[r], -r))
        min_rank = min(finite, key=lambda r: (finite[r], r))
        med = medians[key]
        mine = finite.get(straggler) if straggler is not None else None
        rows.append({
            "key": key, "path": key[len(PREFIX):], "ranks": len(finite), "median_ms": med,
            "max_ms": finite[max_rank], "max_rank": max_rank,
            "min_ms": finite[min_rank], "min_rank": min_rank,
            "straggler_ms": mine, "excess_ms": None if mine is None else mine - med,
            "ratio": None if mine is None or med <= 0 else mine / med,
        })
    rows.sort(key=lambda r: (-(r["excess_ms"] if r["excess_ms"] is not None else float("-inf")),
                             -(r["max_ms"] - r["median_ms"]), -r["median_ms"], r["key"]))
    return {"straggler": straggler, "spans": rows}
