"""An exprd gone silent while its node's ranks train on (DESIGN 13, turn 5): pure, no I/O.

In spool mode a node's ranks reach the run directory only through their node's exprd.
When that exprd dies (killed, OOM, a bad upgrade) and its ranks do not, their shards stop
growing: read alone, that looks like ranks behind, or hung, or a lost node. What tells them
apart is the job itself: in a synchronous job a rank cannot run more than a step ahead of
its slowest peer, so when the other nodes' ranks keep stepping after this node's went
quiet, this node's ranks are alive and only their daemon is not. Then it is one warning
about the daemon ("exprd on node1 silent 25s ..."), not `behind`, `hang` or `lost` for its
ranks; their rows wait in its spool and land once an exprd runs there again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from expr_tracker.health.clock import safe_host
from expr_tracker.health.stall import fmt_quiet
from expr_tracker.health.state import RankState, RunState
from expr_tracker.ranks import compact

# exprd touches its heartbeat in each run directory every 5 s (daemon/health.BEAT_EVERY;
# health sits below the daemon): three missed touches is silence, not a slow pass
EXPRD_SILENT = 15.0
# s by which the other nodes' ranks stepped on after this node's last write: more than a
# lock-step job runs past a dead peer (a step, exprd's apply lag) without waiting for it
STEPPED_ON = 5.0
# s without a new row before a rank's exprd's silence is what explains it: longer than
# the gap between two of exprd's applies on a busy node
UNFED_AFTER = 2.0


def peers_step_on(mine: Iterable[RankState], others: Iterable[RankState],
                  cache: float = 0.0, slack: float = STEPPED_ON) -> bool:
    """The other nodes' live ranks advanced well after `mine` last wrote (`slack`, plus the
    filesystem's cache, by which either can be seen late): `mine` are not dead."""
    last = max([w for rs in mine if (w := rs.wrote_at) is not None], default=None)
    stepped = max([a for rs in others if rs.live and (a := rs.advanced) is not None],
                  default=None)
    return last is not None and stepped is not None and stepped - last > slack + cache


def unfed_ranks(state: RunState, now: float) -> set[int]:
    """The spooled live ranks silent `UNFED_AFTER` whose node's exprd has shown no life (a
    heartbeat touch) since their last row landed: their shards tell nothing new of them
    until it does, so no `behind` or `hang` opens for them on that evidence (one open
    stays). A rank that writes is not one (a straggler behind, fed by a live exprd); a
    silent rank whose exprd lives is not one for longer than a heartbeat's period. Hosts
    without a heartbeat here (an exprd that writes none) keep the old reading."""
    beats = state.heartbeats
    if not beats:
        return set()
    out = set()
    for rs in state.live:
        wrote = rs.last_write
        if rs.spooled and rs.host and wrote is not None and now - wrote >= UNFED_AFTER:
            beat = beats.get(safe_host(rs.host))
            if beat is not None and beat <= wrote:
                out.add(rs.rank)
    return out


def silent_exprds(state: RunState, now: float, cache: float = 0.0) -> list[dict[str, Any]]:
    """The hosts whose exprd's heartbeat is older than `EXPRD_SILENT` (+ `cache`) while
    their spooled ranks run and the other hosts' ranks step on: {"host", "ranks", "quiet"
    (the heartbeat's age), "step", "detail"} each."""
    # most passes every heartbeat is fresh: a look at a handful of them, not at the ranks
    stale_beats = {h: now - beat for h, beat in state.heartbeats.items()
                   if now - beat >= EXPRD_SILENT + cache}
    if not stale_beats:
        return []
    by_host: dict[str, list[RankState]] = {}
    for rs in state.live:
        if rs.spooled and rs.host and safe_host(rs.host) in stale_beats:
            by_host.setdefault(rs.host, []).append(rs)
    stale = {h: stale_beats[safe_host(h)] for h in by_host}
    out = []
    for host, quiet in stale.items():
        mine = by_host[host]
        others = [rs for rs in state.live if rs.host != host]
        if not peers_step_on(mine, others, cache):
            continue  # the others wait too: a lost node, or a stall, says what it is
        lead = max([s for rs in others if (s := rs.last_step) is not None], default=None)
        steps = [s for rs in mine if (s := rs.last_step) is not None]
        ranks = tuple(sorted(rs.rank for rs in mine))
        many = len(ranks) != 1
        detail = (f"exprd on {host} silent {fmt_quiet(quiet)}: rank{'s' if many else ''} "
                  f"{compact(ranks)} train{'' if many else 's'} on (their peers reached step "
                  f"{lead}), {'their' if many else 'its'} rows wait in {host}'s spool until "
                  "an exprd runs there again")
        out.append({"host": host, "ranks": ranks, "quiet": quiet, "detail": detail,
                    "step": max(steps) if steps else None})
    return out
