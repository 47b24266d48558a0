"""A lost node (DESIGN 13, "A cluster, not one machine"): pure, no I/O.

A node dies whole (its ranks, its exprd) or is cut off: its ranks write nothing more, no
row, no probe (their tracker threads are gone, or their exprd, which applies what they
spool, is), while the ranks of other nodes wait for them in a collective or crash when
their transport notices. A host is **lost** when

- every shard of it is still `running` (none finished or crashed: those say so) and none
  was written (rows, sidecar, probe) for `threshold` seconds on the reader's clock;
- in spool mode, its exprd's heartbeat in the run directory (`clock.heartbeat_name`) is
  stale too, or absent while another node's is there (a live exprd with silent ranks is
  the ranks' own silence: a stall names them); in direct mode the ranks' own sidecars,
  which a live tracker thread rewrites with a probe every few seconds, serve;
- and the job shows life elsewhere: another node's rank wrote within `threshold` (a
  probe while it waits) or crashed, but none stepped on long after this node went quiet
  (a synchronous job does not run on without a dead peer: its exprd is what is silent,
  `daemons.silent_exprds`). With every node silent nothing tells a dead node from a
  frozen filesystem, and no node is named (two nodes or more: one job-wide silence,
  `silence.job_silence`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from expr_tracker.health.clock import safe_host
from expr_tracker.health.daemons import EXPRD_SILENT, STEPPED_ON, peers_step_on
from expr_tracker.health.stall import PEER_ERRORS, _frame, _frames, fmt_quiet, in_collective
from expr_tracker.health.state import RankState, RunState
from expr_tracker.ranks import compact


def _ranks(rs: Sequence[RankState]) -> str:
    return f"rank{'s' if len(rs) != 1 else ''} {compact([r.rank for r in rs])}"


def peer_blamed(rs: RankState) -> bool:
    """The rank's exit message says a peer went away (it crashed because another did)."""
    ex = rs.exit or {}
    text = f"{ex.get('type') or ''} {ex.get('message') or ''} {rs.status_reason or ''}".lower()
    return any(p in text for p in PEER_ERRORS)


def killed_ranks(state: RunState, now: float, cache: float = 0.0) -> list[RankState]:
    """Ranks `running` by their sidecars whose processes were most likely killed (kill -9,
    the OOM killer) where no watcher can check their pids (a login node's `expr watch` in
    direct mode): silent (no row, no probe: the tracker thread died with them) for
    `EXPRD_SILENT` + `cache`, since before the first rank that blames a peer crashed, on a
    host where a rank crashed. (A host whose every rank is silent is a lost node.)"""
    if len(state.live) == len(state.ranks):  # (most passes: nothing crashed, no loop)
        return []
    blamed = [w for rs in state.ranks.values() if rs.status == "crashed"
              and (w := rs.wrote_at) is not None and peer_blamed(rs)]
    if not blamed:
        return []
    first = min(blamed)
    hosts = {rs.host for rs in state.ranks.values() if rs.status == "crashed"}
    return [rs for rs in state.live if (w := rs.wrote_at) is not None and w < first
            and now - w >= EXPRD_SILENT + cache and rs.host in hosts]


def lost_nodes(state: RunState, threshold: float, now: float,
               cache: float = 0.0) -> list[dict[str, Any]]:
    """The lost nodes of this pass: {"host", "ranks", "quiet", "exprd" (its silence, None
    in direct mode or unknown), "collateral" (other nodes' crashed ranks that blame a
    peer), "detail", "step"} each (see the module docstring). `cache`: the filesystem's
    attribute cache (`daemons.peers_step_on`)."""
    if len(state.live) < len(state.ranks) and any(
            peer_blamed(rs) for rs in state.ranks.values() if rs.status == "crashed"):
        # ranks crashed saying a peer went away: a node silent as long as three of its
        # exprd's heartbeats (its ranks' probes in direct mode) is the peer, and naming it
        # now makes it the root their crash joins, paged once (DESIGN 13, turn 5)
        threshold = min(threshold, EXPRD_SILENT + cache)
    # most passes no live rank is that silent: one comprehension, no grouping
    oldest = min([w for rs in state.live if (w := rs.wrote_at) is not None], default=None)
    if oldest is None or now - oldest < threshold:
        return []
    by_host: dict[str, list[RankState]] = {}
    for rs in state.ranks.values():
        if rs.host:
            by_host.setdefault(rs.host, []).append(rs)
    if len(by_host) < 2:
        return []
    beats = state.heartbeats
    # a lost host's ranks are all live and silent: none of them is alive or crashed, so
    # "the other nodes' ranks" alive or crashed are every node's, found once (not a loop
    # over the other hosts' ranks per host: 2,048 hosts x 16,384 ranks was a minute)
    alive = [rs for rs in state.live if rs.wrote_at is not None and now - rs.wrote_at < threshold]
    crashed = [rs for rs in state.ranks.values() if rs.status == "crashed"]
    if not alive and not crashed:
        return []
    others = _others(alive, crashed)  # the same words for every lost node of this pass
    out = []
    for host, mine in by_host.items():
        if any(not rs.live for rs in mine):
            continue
        writes = [rs.wrote_at for rs in mine]
        if any(w is None for w in writes):
            continue
        quiet = now - max(w for w in writes if w is not None)
        if quiet < threshold:
            continue
        exprd: float | None = None
        if any(rs.spooled for rs in mine):
            beat = beats.get(safe_host(host))
            if beat is None and not beats:
                continue  # no exprd here writes heartbeats: no verdict on this one
            exprd = now - beat if beat is not None else None
            if exprd is not None and exprd < threshold:
                continue  # its exprd lives: the ranks' own silence (a stall names them)
        # (by half the threshold at most: a silence of `threshold` with peers stepping
        # all along is not one they waited out)
        if peers_step_on(mine, alive, cache, min(STEPPED_ON, threshold / 2)):
            continue  # its peers step on without it: its ranks live (`daemons`)
        out.append(_verdict(host, mine, quiet, exprd, others))
    return out


def _others(alive: list[RankState], crashed: list[RankState]) -> tuple[str, tuple[int, ...]]:
    """What the other nodes do meanwhile, as the end of a lost node's detail, and the
    crashed ranks that blame a peer (its collateral)."""
    detail = ""
    waiting = [rs for rs in alive if in_collective(rs.probe)]
    if waiting:
        fns = Counter(fn for rs in waiting[:256] if (fr := _frames(rs.probe))
                      and (fn := _frame(fr[0])[1]))
        fn = fns.most_common(1)[0][0] if fns else "a collective"
        many = len(waiting) != 1
        detail += f"; {_ranks(waiting)} wait{'' if many else 's'} in {fn}"
    collateral = [rs for rs in crashed if peer_blamed(rs)]
    if crashed:
        first = next((rs for rs in collateral if rs.exit), None)
        why = f" ({(first.exit or {}).get('message')})" if first is not None else ""
        detail += f"; {_ranks(crashed)} crashed{why}"
    return detail, tuple(rs.rank for rs in collateral)


def _verdict(host: str, mine: list[RankState], quiet: float, exprd: float | None,
             others: tuple[str, tuple[int, ...]]) -> dict[str, Any]:
    spooled = any(rs.spooled for rs in mine)
    what = f"{_ranks(mine)} and exprd" if spooled else _ranks(mine)
    silent = (f"silent {fmt_quiet(quiet)}" if not spooled or exprd is None or exprd >= quiet
              else f"silent {fmt_quiet(quiet)} (exprd {fmt_quiet(exprd)})")
    detail = f"{host} lost: {what} {silent}"
    if not spooled:
        detail += " (no rows, no probes)"
    steps = [rs.last_step for rs in mine if rs.last_step is not None]
    return {"host": host, "ranks": tuple(rs.rank for rs in mine), "quiet": quiet,
            "exprd": exprd, "collateral": others[1], "detail": detail + others[0],
            "step": max(steps) if steps else None}
