"""A job-wide silence (DESIGN 13, turn 5, "One incident per cause, at any scale"): pure.

The scheduler killed the job, a preemption, the end of a time limit: every rank stops at
once, without a finish. No rank wrote (rows, sidecar, probe) for `threshold` seconds, on
two nodes or more (counting the nodes of ranks that finished: the half of a job killed
after the other half finished is said too, though no peer waits for it and a stall needs
every rank running), and in spool mode no node's exprd lives either (a live exprd with
silent ranks is the ranks' own silence: a stall names them). That is one incident,
"every rank silent since T: the job ended without finishing", naming its nodes by count
and range; not a lost node per node (no peer waits for them: a node is lost only while
others show life) nor a stall naming suspects. A rank that crashed before keeps its own
`crashed` incident: the silence is told after it, not as its cause.

One pass over the live ranks (16,384 of them: no loop over hosts x ranks).
"""

from __future__ import annotations

import time
from typing import Any

from expr_tracker.health.clock import safe_host
from expr_tracker.health.stall import fmt_quiet
from expr_tracker.health.state import RankState, RunState
from expr_tracker.ranks import compact

RANKS_TEXT = 60  # characters of the silent ranks' ranges in the detail before they are cut


def _host(rs: RankState) -> str | None:
    """A rank's node: its sidecar's host, else rank // local_world_size, else (a sidecar
    naming only its local rank) the first rank of its node, as `_START` + that rank:
    torchrun places a node's ranks in order, so a local rank 0 starts a node."""
    if rs.host:
        return rs.host
    if rs.local_world_size:
        return f"node{rs.rank // rs.local_world_size}"
    return f"{_START}{rs.rank - rs.local_rank:012d}" if rs.local_rank is not None else None


_START = "\0start:"  # (no host name starts so: it cannot be in a file name)


def _named(hosts: set[str]) -> list[str]:
    """The nodes sorted, those known by their first rank named node0, node1, ... in order."""
    starts = sorted(h for h in hosts if h.startswith(_START))
    return sorted([*(h for h in hosts if not h.startswith(_START)),
                   *(f"node{i}" for i in range(len(starts)))])


def job_silence(state: RunState, threshold: float, now: float) -> dict[str, Any] | None:
    """The job-wide silence of this pass, or None: {"ranks", "hosts" (sorted), "since"
    (the last write of any live rank, the reader's clock), "quiet", "step" (the lead),
    "crashed" (ranks that crashed), "detail"}."""
    live = state.live
    if not live:
        return None  # the run ended: its incidents resolve ("run ended")
    newest = -1.0
    hosts: set[str] = set()
    spooled: set[str] = set()
    for rs in live:
        w = rs.wrote_at
        if w is None or now - w < threshold:
            return None  # a rank never seen written, or one that still writes
        newest = max(newest, w)
        host = _host(rs)
        if host is None:
            return None  # its node is not known: no count of nodes to give
        hosts.add(host)
        if rs.spooled:
            spooled.add(host)
    finished = [r for r, rs in state.ranks.items() if rs.status == "finished"]
    done_on = {h for r in finished if (h := _host(state.ranks[r])) is not None}
    if len(hosts | done_on) < 2:
        return None  # one node: a stall or a hang says it, as before
    beats = state.heartbeats
    if any((b := beats.get(safe_host(h))) is not None and now - b < threshold for h in spooled):
        return None  # an exprd applies that node's spool and lives: its ranks' own silence
    ranks = [rs.rank for rs in live]
    crashed = [r for r, rs in state.ranks.items() if rs.status == "crashed"]
    quiet = now - newest
    order = _named(hosts)
    nodes = (f"{len(order):,} nodes ({order[0]} ... {order[-1]})" if len(order) > 2
             else f"{len(order)} node{'s' if len(order) > 1 else ''} ({', '.join(order)})")
    text = compact(ranks)
    if len(text) > RANKS_TEXT:
        text = text[:RANKS_TEXT].rpartition(",")[0] + ",..."
    stamp = time.strftime("%H:%M:%S UTC", time.gmtime(newest + state.fs_offset))
    every = "every unfinished rank" if finished else "every rank"
    detail = (f"{every} silent since {stamp} ({fmt_quiet(quiet)}): the job ended without "
              f"finishing; {len(ranks):,} ranks ({text}) on {nodes}: no rows, no probes"
              + (", no exprd" if spooled else ""))
    if finished:
        done = compact(finished)
        if len(done) > RANKS_TEXT:
            done = done[:RANKS_TEXT].rpartition(",")[0] + ",..."
        detail += f"; {len(finished):,} ranks ({done}) finished"
    if crashed:  # told, not blamed: the crash is its own incident (the root)
        detail += f"; rank{'s' if len(crashed) != 1 else ''} {compact(crashed)} crashed"
    return {"ranks": tuple(ranks), "hosts": tuple(order), "since": newest, "quiet": quiet,
            "step": state.lead, "crashed": tuple(crashed), "detail": detail}
