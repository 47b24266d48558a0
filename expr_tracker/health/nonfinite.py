"""The non-finite detector (DESIGN 13, turn 5), on by default. Pure, no I/O.

A NaN or an infinity of any key on any rank is one incident per key for the run,
naming the rank and step where it came first: read from the notes each shard's writer
keeps in its sidecar (`store.nonfinite`), so a pass reads no row for it, and a value that
went non-finite long before a reader came is still known. It is a fact, not a state: the
incident does not resolve when the key is finite again (nor open again when it is not),
only when the run ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from expr_tracker.health.state import RunState
from expr_tracker.ranks import compact


def nonfinite(state: RunState) -> list[dict[str, Any]]:
    """Per key with a non-finite value on some rank, oldest step first: {key, rank, step,
    value, host, ranks, detail}. `rank` and `step`: where it came first (the lowest step,
    then the lowest rank); `ranks`: every rank the notes name."""
    first: dict[str, tuple[int, int, str, str | None]] = {}
    ranks: dict[str, set[int]] = {}
    for rs in [rs for rs in state.ranks.values() if rs.nonfinite]:
        for key, n in rs.nonfinite.items():  # type: ignore[union-attr]  # (filtered)
            if not isinstance(key, str) or not isinstance(n, Mapping):
                continue
            step, rank = n.get("step"), n.get("rank")
            if type(step) is not int:
                continue
            rank = rank if type(rank) is int else rs.rank
            host = rs.host if rank == rs.rank else None
            value = n.get("value") if n.get("value") in ("NaN", "Infinity", "-Infinity") else "NaN"
            got = first.get(key)
            if got is None or (step, rank) < got[:2]:
                first[key] = (step, rank, str(value), host)
            mine = ranks.setdefault(key, set())
            mine.add(rank)
            more = n.get("ranks")
            if isinstance(more, list):
                mine.update(r for r in more if type(r) is int and r >= 0)
    out = []
    for key, (step, rank, value, host) in sorted(first.items(), key=lambda kv: kv[1][:2]):
        named = sorted(ranks[key])
        detail = f"{key} is {value} on rank {rank} at step {step}"
        if len(named) > 1:
            detail += f" (first; {len(named)} ranks so far: {compact(named)})"
        out.append({"key": key, "rank": rank, "step": step, "value": value, "host": host,
                    "ranks": tuple(named), "detail": detail})
    return out
