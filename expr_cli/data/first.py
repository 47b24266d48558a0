"""The summary at the frontier step from the records the live state holds already (issue 44):
what a page's tiles need (ranks reporting, the reducers, the weighted gap, who is behind)
of a run of thousands of ranks, before the window's read of every tail that the rest of
`expr summary`'s answer needs (its chart, coverage, variability: seconds at 16,384 ranks).

The live state's first pass keeps each rank's last two rank records (`RunReader`, window
2). The reducers at step `at` need every record of that step, and a rank's last records
hold all of them when one of them (not a system sample, dated behind) is of an earlier
step (a rank's records are appended in step order), or when the rank stopped before `at`;
the ranks ahead of the others by two steps or more are read again, backwards from the end
of the shard until such a record (`_tail_from`: a few kilobytes each, where a window's
start is searched in 64). Then the keys' blocks are `build_view`'s
own, over a table of those records: the same numbers as `summary_data`'s, field for field
(`tests/test_serve_first.py`). What depends on the window (coverage, the world sizes the
window's records name, a key's "last at step" note) is left out, and the answer says
`first: true`. None where the state cannot answer exactly (compact tails, shards holding
other ranks' records, a run without rank records, system metrics asked): the caller
reads the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from expr_tracker.store.records import is_sample

from .summary import build_view, is_system

if TYPE_CHECKING:
    from expr_cli.resolve import RunRef, ShardRef
    from expr_tracker.health.state import RunState

TAIL_GUESS = 4 << 10  # bytes of a shard read first when its last records fall short
WINDOW_FIELDS = ("coverage", "coverage_checked", "world_sizes", "world_size_mismatch")


def first_summary(ref: RunRef, stream: str | None, metrics: list[str] | None, state: RunState,
                  shards: list[ShardRef], own_only: bool) -> dict[str, Any] | None:
    """The summary at the frontier step from `state`'s last records (and the shards of the
    ranks they do not cover, read again); None when they cannot answer it exactly.
    `own_only`: every shard holds its own rank's records alone (`RunReader.own_records`)."""
    from expr_tracker.stats.ranktable import collect

    if state.series_key is not None or state.frontier is None or not own_only \
            or not state.rank_records:
        return None
    by_shard = {s.rank: s for s in shards}
    recs = dict(state.rank_records)
    at: int | None = None
    reread: set[int] = set()
    for _ in range(3):  # a step read again can only move `at` later, once (module doc)
        at = _pick(recs, metrics, state.frontier)
        if at is None:
            return None
        short = [r for r, rs in state.ranks.items() if r not in reread
                 and not _covers(recs.get(r), rs.last_step, at)]
        if not short:
            break
        if any(r not in by_shard for r in short):
            return None
        for r in short:
            got = _tail_from(by_shard[r], at)
            if got is None:
                return None
            recs[r] = got
        reread.update(short)
    else:
        return None
    # the records of that step alone: the reducers' (and the pick's) of a table of them are
    # those of the window's table (a key logged at an earlier step only is left out)
    table = collect(r for rs in recs.values() for r in rs if r.get("_step") == at)
    user = [k for k in table.keys if not is_system(table, k)]
    keys = metrics or user
    if not user or any(k not in table.keys or is_system(table, k) for k in keys):
        return None
    view = build_view(ref, stream, dict.fromkeys(keys, table), table, None, None, None, 1,
                      False, keys=keys, state=state)
    for name in WINDOW_FIELDS:
        view.pop(name, None)
    for item in view["keys"]:
        item.pop("note", None)
    view["first"] = True
    return view


_NONFINITE = frozenset({"NaN", "Infinity", "-Infinity"})


def _pick(recs: dict[int, list[dict[str, Any]]], metrics: list[str] | None,
          frontier: int) -> int | None:
    """`summary._pick_step` at the frontier, over the records themselves: the last step at
    or before it of a user's record with a number (of `metrics`, when given); None: none."""
    at = None
    for rs in recs.values():
        for r in rs:
            step = r.get("_step")
            if type(step) is not int or step > frontier or (at is not None and step <= at) \
                    or r.get("_kind") != "rank" or is_sample(r):
                continue
            if any(k[:1] != "_" and (type(v) in (int, float) or (type(v) is str and v in _NONFINITE))
                   for k, v in r.items() if metrics is None or k in metrics):
                at = step
    return at


def _covers(recs: list[dict[str, Any]] | None, last_step: int | None, at: int) -> bool:
    """Whether a rank's last records (the last of its shard, in file order) hold every
    record of it from step `at` on: the rank never got to `at`, or one of them is a user's
    record of an earlier step (every record after it is of that step or later; a system
    sample is dated by the last committed row, behind the records of the open step)."""
    if last_step is None or last_step < at:
        return not recs or all(_step(r) < at for r in recs)
    return any(_step(r) < at and not is_sample(r) for r in recs or ())


def _step(rec: dict[str, Any]) -> int:
    step = rec.get("_step")
    return step if type(step) is int else -1


def _tail_from(shard: ShardRef, at: int) -> list[dict[str, Any]] | None:
    """The rank records of the end of the shard from a user's record of a step before `at`
    (or from its start): its tail read backwards, growing, each read parsed as
    `expr summary` parses it (`scan.parse_rank_lines`). None when a line does not parse,
    or the shard holds other ranks' records: the window's read answers then."""
    from expr_tracker.stats.scan import parse_rank_lines
    from expr_tracker.store.records import complete_end
    from expr_tracker.store.safedir import open_read

    want = TAIL_GUESS
    try:
        with open_read(shard.path) as fh:
            end = complete_end(fh, TAIL_GUESS)
            while True:
                start = max(0, end - want)
                fh.seek(start)
                data = fh.read(end - start)
                if start:
                    data = data[data.find(b"\n") + 1:]
                recs, bad = parse_rank_lines(data)
                if bad:
                    return None
                recs = [r for r in recs if r.get("_kind") == "rank"]
                if any(r.get("_rank") != shard.rank for r in recs):
                    return None  # (other ranks' records: read with the window)
                if start == 0 or any(_step(r) < at and not is_sample(r) for r in recs):
                    return recs
                want *= 4
    except OSError:
        return None
