"""The `stall` detector and its suspects (DESIGN 13). Pure: a function of a RunState.

A DDP or FSDP job whose one rank is stuck does not look like one silent rank: every other
rank blocks in the next collective, so no rank advances and `hang` ("silent while another
rank advanced") never fires. `stall` fires when no rank advanced for `hang_after` while
every rank is still running, and names the suspects, in order:

1. ranks whose probe says they are not waiting in a collective while others' say they are
   (a rank in `time.sleep`, in its data loader, in a `print` to a full pipe);
2. else ranks whose probe is missing or stale while the others' are fresh: the tracker
   thread of a process holding the GIL in C code, or stopped, cannot write one;
3. else the ranks with the lowest last step;
4. else the rank that wrote last longest ago.

Rules 2 and 4 are evidence only once every healthy rank has had time to write a probe
(a stall pages once: a `hang_after` shorter than the SDK's `probe_after` would name
whichever rank probed a second later, or wrote a millisecond earlier). The ranks of a
job go silent together and probe after the same `probe_after` (by default max(10 s, 5x
the median step period)), so a missing probe counts once the others' have been seen
for a rewrite's time (`PROBE_REWRITE`), and the oldest write once the silence passes
`probe_horizon` with no probe anywhere. The default `hang_after`, max(5 min, 20x the
period), is always past both.

A probe (written by the SDK's background thread into the sidecar, `probe`) is fresh when
its sidecar changed within `PROBE_STALE` seconds of the freshest live sidecar (the SDK
rewrites a probe every 3 s while its thread runs; times on the reader's clock,
`health.clock`) and it is not left over from an earlier silence: its `since` is not
older than the rank's last step row (both on that rank's own clock). A thread that
could not run since the rank resumed (a burst of steps, then C code holding the GIL)
leaves its old probe behind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from typing import Any

from expr_tracker.health.state import RankState, RunState
from expr_tracker.ranks import compact

# the SDK rewrites a probe every 3 s (`probe.REWRITE_EVERY`) while its thread runs; two
# rewrites missed, and a little slack for exprd's apply in spool mode, is stale
PROBE_STALE = 8.0
# the SDK's default `probe_after` (`probe.DEFAULT_AFTER`, `probe.PERIODS`: health sits
# below the SDK and cannot import it; tests/test_health_stall.py checks they agree)
PROBE_AFTER, PROBE_PERIODS, PROBE_REWRITE = 10.0, 5.0, 3.0
LEFT_OVER = 1.0  # s: a probe whose `since` is this much older than the last row is old
# frames of a rank waiting for its peers even when its probe does not say "collective":
# DDP's gradient all-reduce runs inside the autograd engine, under `loss.backward()`
_COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/", "c10d")
_STALE = "left only an old probe (its tracker thread cannot run: C code holding the GIL, or stopped)"
_WAITS = {"sleep": "time.sleep", "io": "I/O", "collective": "a collective"}


def fmt_quiet(seconds: float) -> str:
    """A silence as "62s", "14m", "5h", "3d"."""
    for unit, size, above in (("d", 86400, 172800), ("h", 3600, 7200), ("m", 60, 120)):
        if seconds >= above:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _frame(text: str) -> tuple[str | None, str | None, bool]:
    """('file.py:88', 'function', user) of a probe's "path/file.py:88 function [user]"."""
    user = text.endswith(" [user]")
    if user:
        text = text[: -len(" [user]")]
    loc, _, fn = text.rpartition(" ")
    if not loc:
        loc, fn = fn, ""
    path, _, line = loc.rpartition(":")
    base = path.replace("\\", "/").rsplit("/", 1)[-1] if path else loc
    return (f"{base}:{line}" if path else base), (fn or None), user


def _frames(probe: dict[str, Any] | None) -> list[str]:
    where = probe.get("where") if probe else None
    return [w for w in where if isinstance(w, str)] if isinstance(where, list) else []


def in_collective(probe: dict[str, Any] | None) -> bool:
    """The probe's main thread waits for its peers (its own word, or a frame of torch's)."""
    if not probe:
        return False
    if probe.get("waiting") == "collective":
        return True
    files = [w.rpartition(" ")[0] if not w.endswith(" [user]") else "" for w in _frames(probe)]
    return any(pat in f for f in files for pat in _COLLECTIVE_FILES)


def where(probe: dict[str, Any] | None) -> str:
    """What a probe says a rank does: "in time.sleep (train.py:88, span data)"."""
    if not probe:
        return "wrote no probe (its tracker thread cannot run: C code holding the GIL, or stopped)"
    frames = _frames(probe)
    waiting = probe.get("waiting")
    first = _frame(frames[0]) if frames else None
    user = next((f for f in map(_frame, frames) if f[2]), None)
    if first is not None and not first[2] and first[1]:
        what = first[1]
    elif isinstance(waiting, str) and waiting in _WAITS:
        what = _WAITS[waiting]
    elif first is not None and first[1]:
        what = first[1]
    else:
        what = "an unknown place"
    spans = probe.get("spans")
    span = spans[-1] if isinstance(spans, list) and spans and isinstance(spans[-1], str) else None
    paren = [p for p in (user[0] if user else None, f"span {span}" if span else None) if p]
    return f"in {what}" + (f" ({', '.join(paren)})" if paren else "")


def suspects(live: Sequence[RankState], left_over: Set[int] = frozenset(),
             cache: float = 0.0) -> tuple[list[RankState], str]:
    """The suspects of a stall among the live ranks, and the rule that named them.
    `left_over`: ranks whose probe the watcher knows to be from an earlier silence;
    `cache`: seconds the filesystem may show a sidecar old (`HealthConfig.fs_cache`), by
    which another host's rewrite may reach this reader later than its own host's."""
    sides = [rs.sidecar_write for rs in live if rs.sidecar_write is not None]
    freshest = max(sides) if sides else None

    def fresh(rs: RankState) -> bool:
        if rs.probe is None or rs.sidecar_write is None or freshest is None or rs.rank in left_over:
            return False
        since = rs.probe.get("since")
        if isinstance(since, (int, float)) and rs.times and since < rs.times[-1] - LEFT_OVER:
            return False
        return freshest - rs.sidecar_write <= PROBE_STALE + cache

    probed = [rs for rs in live if fresh(rs)]
    waiting = [rs for rs in probed if in_collective(rs.probe)]
    if waiting and len(waiting) < len(probed):
        return [rs for rs in probed if not in_collective(rs.probe)], "busy"
    if probed and len(probed) < len(live):
        return [rs for rs in live if not fresh(rs)], "no probe"
    if waiting and len(waiting) == len(live):
        # every rank waits for its peers and none stands out: a network fault or a peer
        # outside the job; naming the lowest step or the oldest write would blame an
        # innocent rank (DESIGN 13)
        return [], "all wait"
    steps = [rs.last_step for rs in live if rs.last_step is not None]
    if steps and min(steps) < max(steps):
        low = min(steps)
        return [rs for rs in live if rs.last_step == low], "lowest step"
    if probed and len(probed) == len(live):
        # every rank alive (its probe fresh) and busy outside a collective, at one step: a
        # checkpoint save or an eval that logs no rows; the oldest write is no evidence
        return [], "all busy"
    writes = [rs for rs in live if rs.last_write is not None]
    if not writes:
        return [], "unknown"
    oldest = min(writes, key=lambda rs: (rs.last_write, rs.rank))
    return [oldest], "oldest write"


def probe_horizon(period: float | None) -> float:
    """Seconds of silence by which every healthy rank has written a probe (the SDK's
    default `probe_after` for a job of this median step period, plus a rewrite's time for
    the background thread's tick and, in spool mode, exprd's apply)."""
    return max(PROBE_AFTER, PROBE_PERIODS * (period or 0.0)) + PROBE_REWRITE


def _who(ranks: Sequence[RankState]) -> str:
    hosts = {rs.host for rs in ranks}
    on = f" on {next(iter(hosts))}" if len(hosts) == 1 and None not in hosts and len(ranks) > 1 else ""
    return f"rank{'s' if len(ranks) != 1 else ''} {compact([rs.rank for rs in ranks])}{on}"


# the rules whose probes are evidence: raised after `evidence` seconds, not `threshold`
EVIDENCE_RULES = ("busy", "no probe", "all wait")
# what a rank's exit or probe says when a peer went away (the last peer error of a stall)
PEER_ERRORS = ("connection closed by peer", "connection reset by peer", "broken pipe",
               "connection refused", "timed out", "timeout", "no route to host",
               "network is unreachable", "communicator was aborted", "nccl error", "gloo")


def peer_error(state: RunState) -> str | None:
    """The last error about a peer any rank showed: a crashed rank's exit message, else a
    probe frame that names one (the newest by the rank's own exit time)."""
    found: list[tuple[float, str]] = []
    for rs in state.ranks.values():
        ex = rs.exit or {}
        msg = ex.get("message")
        if isinstance(msg, str) and any(p in msg.lower() for p in PEER_ERRORS):
            t = ex.get("time")
            found.append((float(t) if isinstance(t, (int, float)) else 0.0,
                          f"rank {rs.rank}: {msg.strip()[:200]}"))
        for fr in _frames(rs.probe):
            if any(p in fr.lower() for p in PEER_ERRORS[:7]):
                found.append((-1.0, f"rank {rs.rank}: {fr[:200]}"))
    return max(found)[1] if found else None


def stall(state: RunState, threshold: float, now: float, period: float | None = None,
          probes_seen: Mapping[int, float] | None = None,
          left_over: Set[int] = frozenset(), evidence: float | None = None,
          cache: float = 0.0) -> dict[str, Any] | None:
    """The stall of this pass, or None: {"ranks", "step", "quiet", "detail", "where",
    "host", "rule"}. `now` and the ranks' times are on the reader's clock; `period` is the
    job's median step period (for `probe_horizon`); `probes_seen`, rank -> when the reader
    first saw its current probe (none: every probe counts as long seen); `left_over`, the
    ranks whose probe is from an earlier silence (`detect._probes_seen`). A stall whose
    probes are evidence (`EVIDENCE_RULES`) is raised after `evidence` seconds (default
    `threshold`), one named by no evidence (the lowest step, the oldest write) after
    `threshold`. `cache`: the filesystem's attribute cache (`suspects`): a probe on
    another host can show that much later than one on ours, so a missing probe is
    evidence only that much later too."""
    live = state.live
    # every rank still running: once one finished or crashed, silence is that (its
    # `crashed` incident explains the others' wait), not a collective waiting for a rank
    if not live or len(live) < len(state.ranks) or state.lead is None:
        return None
    newest = max([t for rs in live if (t := rs.advanced) is not None], default=None)
    soonest = min(threshold, evidence if evidence is not None else threshold)
    if newest is None or now - newest < soonest:
        return None
    quiet = now - newest
    named, rule = suspects(live, left_over, cache)
    if rule not in EVIDENCE_RULES and quiet < threshold:
        return None
    if rule == "all wait":
        return _all_wait(state, live, quiet)
    if rule == "all busy":
        return _all_busy(state, live, quiet)
    if not named or (rule == "oldest write" and quiet < probe_horizon(period)):
        return None
    if rule == "no probe" and probes_seen is not None:
        mine = {rs.rank for rs in named}
        seen_at = min((probes_seen.get(rs.rank, -math.inf) for rs in live if rs.rank not in mine),
                      default=-math.inf)
        if now - seen_at < PROBE_REWRITE + cache:  # the others just probed: the rest may yet
            return None
    step = state.lead
    if rule in ("busy", "no probe") and len(named) <= 3:
        why = "; ".join(f"rank {rs.rank} {where(rs.probe if rule == 'busy' else None)}"
                        if rule == "busy" or rs.probe is None else
                        f"rank {rs.rank} {_STALE}" for rs in named)
    else:
        first = where(named[0].probe) if rule == "busy" else None
        why = {"busy": f"{_who(named)} not in a collective, rank {named[0].rank} {first}",
               "no probe": f"{_who(named)} wrote no probe (tracker threads cannot run: C code "
                           "holding the GIL, or stopped)",
               "lowest step": f"{_who(named)} at step {named[0].last_step}, the lowest",
               "oldest write": f"{_who(named)} wrote last longest ago"}[rule]
    if rule == "lowest step" and len(named) == 1:
        why = f"rank {named[0].rank} at step {named[0].last_step}, the lowest"
    mine = {rs.rank for rs in named}
    waiters = [rs for rs in live if rs.rank not in mine and in_collective(rs.probe)]
    detail = f"job stalled at step {step} for {fmt_quiet(quiet)}: {why}"
    if waiters:
        # where they wait: the commonest innermost frame of a sample (16,384 would cost more
        # than the rest of the detector)
        fns = Counter(fn for rs in waiters[:256]
                      if (fr := _frames(rs.probe)) and (fn := _frame(fr[0])[1]))
        fn = fns.most_common(1)[0][0] if fns else "a collective"
        many = len(waiters) != 1
        detail += f"; {len(waiters)} rank{'s' if many else ''} wait{'' if many else 's'} in {fn}"
    hosts = {rs.host for rs in named}
    return {"ranks": tuple(rs.rank for rs in named), "step": step, "quiet": quiet,
            "detail": detail, "where": where(named[0].probe), "rule": rule,
            "host": next(iter(hosts)) if len(hosts) == 1 else None}


def _all_wait(state: RunState, live: Sequence[RankState], quiet: float) -> dict[str, Any]:
    """The stall when every rank waits in a collective: no rank named, the last peer error."""
    fns = Counter(fn for rs in live[:256] if (fr := _frames(rs.probe)) and (fn := _frame(fr[0])[1]))
    fn = fns.most_common(1)[0][0] if fns else "a collective"
    detail = (f"job stalled at step {state.lead} for {fmt_quiet(quiet)}: every rank waits in {fn}; "
              "none stands out (a network fault, or a peer outside the job)")
    err = peer_error(state)
    detail += f"; last peer error: {err}" if err else "; no rank showed a peer error"
    hosts = {rs.host for rs in live}
    return {"ranks": tuple(rs.rank for rs in live), "step": state.lead, "quiet": quiet,
            "detail": detail, "where": f"every rank waits in {fn}", "rule": "all wait",
            "host": next(iter(hosts)) if len(hosts) == 1 else None, "error": err}


def _place(probe: dict[str, Any] | None) -> str:
    """Where a probe says a rank is, briefly: "in I/O (save)", else as `where` says."""
    waiting = (probe or {}).get("waiting")
    frames = _frames(probe)
    fn = _frame(frames[0])[1] if frames else None
    if isinstance(waiting, str) and waiting in _WAITS:
        return f"in {_WAITS[waiting]}" + (f" ({fn})" if fn else "")
    return where(probe)


def _all_busy(state: RunState, live: Sequence[RankState], quiet: float) -> dict[str, Any]:
    """The pause when every rank is alive and busy outside a collective (a checkpoint save,
    an eval with no rows): no rank named, and a warning, not an error (the ranks show life;
    a save that takes `hang_after` is worth a look, not a page that a rank is stuck)."""
    places = Counter(_place(rs.probe) for rs in live[:256])  # (a sample, as `_all_wait`)
    place = places.most_common(1)[0][0] if places else "busy"
    detail = (f"job paused at step {state.lead} for {fmt_quiet(quiet)}: every rank {place}, "
              "alive (its probe fresh), none in a collective; none stands out (a checkpoint "
              "save, or an eval that logs no rows?)")
    hosts = {rs.host for rs in live}
    return {"ranks": tuple(rs.rank for rs in live), "step": state.lead, "quiet": quiet,
            "detail": detail, "where": f"every rank {place}", "rule": "all busy",
            "host": next(iter(hosts)) if len(hosts) == 1 else None, "level": "warning"}
