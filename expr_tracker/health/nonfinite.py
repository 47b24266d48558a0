"""The non-finite detector (DESIGN 13, turn 5), on by default. Pure, no I/O.

A NaN or an infinity of any key on any rank is one incident per key for the run,
naming the rank and step where it came first: read from the notes each shard's writer
keeps in its sidecar (`store.nonfinite`), so a pass reads no row for it, and a value that
went non-finite long before a reader came is still known. It is a fact, not a state: the
incident does not resolve when the key is finite again (nor open again when it is not),
only when the run ends.

A watcher keeps a `Seen` between passes: notes only grow, so a pass takes those of the
ranks whose sidecar changed (`RunState.changed`), not 16,384 ranks' (a loss that goes
NaN goes NaN on every rank of a synchronous job: 0.1 s a pass, taken again each pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from expr_tracker.health.state import RankState, RunState
from expr_tracker.ranks import compact

NAMED = 8  # ranks a detail lists; past it, how many


@dataclass
class Seen:
    """What the notes said so far, per key: the first (step, rank, value, host) and the
    ranks; `taken`, rank -> the notes object last taken (a RunReader replaces, never
    changes, a rank's state)."""

    first: dict[str, tuple[int, int, str, str | None]] = field(default_factory=dict)
    ranks: dict[str, set[int]] = field(default_factory=dict)
    taken: dict[int, Any] = field(default_factory=dict)
    answer: list[dict[str, Any]] | None = None  # the last answer, while nothing changed


def _take(seen: Seen, ranks: Iterable[RankState]) -> None:
    for rs in ranks:
        notes = rs.nonfinite
        if not notes or seen.taken.get(rs.rank) is notes:
            continue
        seen.taken[rs.rank] = notes
        seen.answer = None
        for key, n in notes.items():
            if not isinstance(key, str) or not isinstance(n, Mapping):
                continue
            step, rank = n.get("step"), n.get("rank")
            if type(step) is not int:
                continue
            rank = rank if type(rank) is int else rs.rank
            host = rs.host if rank == rs.rank else None
            value = n.get("value")
            value = value if value in ("NaN", "Infinity", "-Infinity") else "NaN"
            got = seen.first.get(key)
            if got is None or (step, rank) < got[:2]:
                seen.first[key] = (step, rank, str(value), host)
            mine = seen.ranks.setdefault(key, set())
            mine.add(rank)
            more = n.get("ranks")
            if isinstance(more, list):
                mine.update(r for r in more if type(r) is int and r >= 0)


def nonfinite(state: RunState, seen: Seen | None = None) -> list[dict[str, Any]]:
    """Per key with a non-finite value on some rank, oldest step first: {key, rank, step,
    value, host, ranks, detail}. `rank` and `step`: where it came first (the lowest step,
    then the lowest rank); `ranks`: every rank the notes name. With `seen` (a watcher's,
    kept between passes of one reader) only the ranks that changed are looked at."""
    if seen is None or not seen.taken:
        seen = seen if seen is not None else Seen()
        _take(seen, [rs for rs in state.ranks.values() if rs.nonfinite])
    else:
        ranks = state.ranks
        _take(seen, [rs for r in state.changed if (rs := ranks.get(r)) is not None])
    if seen.answer is not None:
        return seen.answer
    out = []
    for key, (step, rank, value, host) in sorted(seen.first.items(), key=lambda kv: kv[1][:2]):
        named = sorted(seen.ranks[key])
        detail = f"{key} is {value} on rank {rank} at step {step}"
        if len(named) > 1:
            which = compact(named) if len(named) <= NAMED else f"{len(named):,} ranks"
            detail += f" (first; {len(named)} ranks so far: {which})" if len(named) <= NAMED \
                else f" (first; {which} so far)"
        out.append({"key": key, "rank": rank, "step": step, "value": value, "host": host,
                    "ranks": tuple(named), "detail": detail})
    seen.answer = out
    return out
