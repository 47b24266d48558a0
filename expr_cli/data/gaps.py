"""Stalls a run's files reveal after the fact (issue 44, DESIGN 18): a pause between two
steps in every rank's step rows (their `_time`), for a run no watcher followed.

A stall stops every rank of a job together (each blocks in the next collective), so the
gap shows in any rank's `_time`: a few shards spread over the ranks are read whole, and
a step is a stall where every one of them paused at least `threshold` seconds before it
(`max(FLOOR, PERIODS x the median step period)`). Pure reading: no state, no incidents
file written.
"""

from __future__ import annotations

from itertools import pairwise
from statistics import median
from typing import Any

from expr_cli.resolve import ShardRef

SAMPLED = 8  # shards read whole, spread over the ranks
MAX_BYTES = 64 << 20  # ... at most this many bytes of them (fewer shards past it)
FLOOR = 10.0  # seconds: a shorter pause between two steps is not a stall ...
PERIODS = 20  # ... nor one under this many median step periods (as the hang default)


def _sample(shards: list[ShardRef]) -> list[ShardRef]:
    """Up to SAMPLED shards spread evenly over the ranks, under MAX_BYTES in all."""
    ordered = sorted(shards, key=lambda s: s.rank)
    n = len(ordered)
    k = min(SAMPLED, n)
    picks = sorted({ordered[i * (n - 1) // max(1, k - 1)].rank for i in range(k)})
    by = {s.rank: s for s in ordered}
    out, total = [], 0
    for r in picks:
        try:
            size = by[r].path.stat().st_size
        except OSError:
            continue
        if out and total + size > MAX_BYTES:
            break
        out.append(by[r])
        total += size
    return out


def found_stalls(shards: list[ShardRef], world: int) -> dict[str, Any]:
    """`{"stalls": [{step, after, gap_s, start, end}], "checked": [ranks], "threshold":
    seconds}`: the steps before which every checked rank's `_time` paused."""
    from expr_cli.summary_load import load_row_table

    sample = _sample(shards)
    out: dict[str, Any] = {"stalls": [], "checked": [s.rank for s in sample], "threshold": None}
    if not sample:
        return out
    table, _ = load_row_table(sample, {"_time"}, None, world)
    per_rank: dict[int, dict[int, float]] = {}
    for step in table.key_steps("_time"):
        for r, t in table.values("_time", step).items():
            per_rank.setdefault(r, {})[step] = t
    gaps: dict[int, list[tuple[int, float, float]]] = {}  # step -> (previous step, t0, t1)
    periods: list[float] = []
    for times in per_rank.values():
        steps = sorted(times)
        for a, b in pairwise(steps):
            dt = times[b] - times[a]
            periods.append(dt / (b - a))
            gaps.setdefault(b, []).append((a, times[a], times[b]))
    if not periods:
        return out
    threshold = max(FLOOR, PERIODS * median(periods))
    out["threshold"] = threshold
    for step in sorted(gaps):
        seen = gaps[step]
        if len(seen) < len(per_rank):
            continue  # a rank that did not log both steps: not every rank's gap
        if all(t1 - t0 >= threshold for _, t0, t1 in seen):
            start = max(t0 for _, t0, _ in seen)
            end = min(t1 for _, _, t1 in seen)
            out["stalls"].append({"step": step, "after": max(a for a, _, _ in seen),
                                  "gap_s": round(end - start, 3), "start": start, "end": end})
    return out
