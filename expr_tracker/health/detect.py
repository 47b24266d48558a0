"""The health detectors (DESIGN 13): pure functions of a RunState, no I/O.

`detect(state, alerts, cfg, memory, now)` returns the `Finding`s of one pass: what is
wrong now, rank by rank. `Memory` carries what one pass cannot see: each rank's best
step-time window (slowdown) and which ranks were firing (so straggler and slowdown
resolve only once their window is back under the ratio, not at the first fast step).
Turning findings into incidents is `incidents.plan`.

A watcher of 16,384 ranks runs them every second or so, and most ranks' windows did not
change since the last pass: `Memory` also keeps, per rank, what the detectors derive from
its window (medians, extremes, window means), rebuilt only when the window is a new
object (a `RunReader` replaces a window that changed, never changes it in place). What
depends on wall time (hang) or on every rank (the ranks' median) is computed each pass
from those, with list comprehensions and one sort at most.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from operator import sub
from statistics import median
from typing import Any

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.daemons import silent_exprds, unfed_ranks
from expr_tracker.health.lost import killed_ranks, lost_nodes
from expr_tracker.health.nonfinite import Seen, nonfinite
from expr_tracker.health.silence import job_silence
from expr_tracker.health.stall import stall
from expr_tracker.health.state import RankState, RunState

KINDS = ("straggler", "slowdown", "hang", "stall", "behind", "crashed", "missing", "alert", "lost",
         "silent", "nonfinite", "exprd")
LEVELS = {"straggler": "warning", "slowdown": "warning", "hang": "error", "stall": "error",
          "behind": "warning", "crashed": "error", "missing": "error", "alert": "error",
          "lost": "error", "silent": "error", "nonfinite": "error", "exprd": "warning"}
JOB = -1  # the rank key of the whole job's slowdown window in `Memory.best`
# A slowdown must also cost at least this much per step: a best window is the minimum of
# many noisy windows, so sub-millisecond step times (timer noise, a CPU toy job) would
# otherwise read as 1.3x slower than their own best without anything having changed.
SLOWDOWN_MIN_SECONDS = 0.001


@dataclass(frozen=True)
class Finding:
    """One thing wrong now. `group`: ranks of one host firing together share an incident."""

    kind: str
    ranks: tuple[int, ...]
    detail: str
    step: int | None = None
    host: str | None = None
    level: str = "warning"
    group: bool = True
    # a crash: {rank, host, type, message, time, at}; a stall: `stall.stall`'s answer
    info: Mapping[str, Any] | None = field(default=None, compare=False)
    # not looked at this pass: an open incident of these ranks stays as it is, and none
    # opens from it (`incidents.plan`)
    hold: bool = False


@dataclass
class Memory:
    """What the detectors remember between passes of one watcher."""

    best: dict[int, float] = field(default_factory=dict)  # rank (or JOB) -> best window mean
    firing: dict[str, set[int]] = field(default_factory=dict)  # kind -> ranks firing
    derived: dict[int, _Derived] = field(default_factory=dict, repr=False)  # rank -> its window's
    derived_for: tuple[Any, ...] = ()  # the settings `derived` was computed with
    # when the last stall ended: silence before it is not a hang (a spool-mode job resuming
    # reaches exprd rank by rank, and the ranks applied last would look silent)
    stall_end: float = -math.inf
    stall_step: int | None = None  # the lead step when it ended: windows with its gap are not slow
    stalled: bool = False
    # rank -> (its probe's `since`, when this watcher first saw that probe, the probe's
    # `time`, when this watcher saw that `time` first): a missing probe is evidence once
    # the others' have been there a while, an old one is not (`stall.stall`)
    probes: dict[int, tuple[float, float, Any, float]] = field(default_factory=dict)
    passes: int = 0
    behind_since: dict[int, float] = field(default_factory=dict)  # rank -> first found behind
    newest: float | None = None  # the last advance of any live rank, at the last pass
    nonfinite: Seen = field(default_factory=Seen)  # the sidecars' non-finite notes so far
    # ranks behind since their exprd went silent: the rows that waited in its spool land
    # at once when it is back, and they are not behind while those catch up
    catching_up: set[int] = field(default_factory=set)


class _Derived:
    """What the detectors need of one rank's step times, and the window they came from."""

    __slots__ = ("count", "median", "series", "slow", "steps", "strag", "times")

    def __init__(self, series: Any, steps: Any, times: Any, vals: list[float], n_strag: int,
                 n_slow: int) -> None:
        self.series, self.steps, self.times = series, steps, times  # identity: the cache key
        self.count = len(vals)
        self.median = median(vals) if vals else 0.0
        last = vals[-n_strag:]
        # (median, min, max) of the straggler window: all >= limit is min >= limit
        self.strag = (median(last), min(last), max(last)) if len(vals) >= n_strag else None
        self.slow = _slow_windows(vals, n_slow)  # (best, current) window mean


def _number(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    return None


def step_times(state: RunState, key: str = "step_time") -> dict[int, list[float]]:
    """Per rank, its recent step durations, oldest first.

    The `key` rank metric when the rank logged it (its own `_rank`'s records), else the
    gaps between its step rows' `_time`s divided by the steps between them.
    """
    out: dict[int, list[float]] = {}
    series = state.series if state.series_key == key else None
    for rank, rs in state.ranks.items():
        vals = _rank_times(state, rank, rs.steps, rs.times, series, key)
        if vals:
            out[rank] = vals
    return out


def _rank_times(state: RunState, rank: int, steps: Sequence[int], times: Sequence[float],
                series: Mapping[int, Sequence[float]] | None, key: str) -> list[float]:
    """One rank's step durations (see `step_times`)."""
    if series is not None:
        inf = math.inf
        logged = [v for v in series.get(rank, ()) if 0.0 <= v < inf]  # NaN: not a number
    else:
        logged = [v for rec in state.rank_records.get(rank, ())
                  if (v := _number(rec.get(key))) is not None]
    if logged:
        return logged
    gaps = []
    for i in range(1, len(steps)):
        s0, s1, t0, t1 = steps[i - 1], steps[i], times[i - 1], times[i]
        if s1 > s0 and t1 >= t0:
            gaps.append((t1 - t0) / (s1 - s0))
    return gaps


def _derive(state: RunState, cfg: HealthConfig, memory: Memory) -> dict[int, _Derived]:
    """Per rank with step times, its `_Derived`: from `memory` when its window is the one
    of the last pass, else computed again (and its best slowdown window updated)."""
    key = cfg.step_time_key
    settings = (key, cfg.straggler_steps, cfg.slowdown_steps)
    if memory.derived_for != settings:
        memory.derived, memory.derived_for = {}, settings
    cache = memory.derived
    series = state.series if state.series_key == key else None
    fresh: dict[int, _Derived] = {}
    best = memory.best
    for rank, rs in state.ranks.items():
        mine = series.get(rank) if series is not None else state.rank_records.get(rank)
        d = cache.get(rank)
        if d is None or d.series is not mine or d.steps is not rs.steps or d.times is not rs.times:
            vals = _rank_times(state, rank, rs.steps, rs.times, series, key)
            d = _Derived(mine, rs.steps, rs.times, vals, cfg.straggler_steps, cfg.slowdown_steps)
            if d.slow is not None:
                b = d.slow[0]
                best[rank] = min(b, best.get(rank, b))
        fresh[rank] = d
    memory.derived = fresh
    return {r: d for r, d in fresh.items() if d.count}


def _hysteresis(memory: Memory, kind: str, rank: int, fire: bool, clear: bool) -> bool:
    """Firing now: `fire` opens, `clear` closes, anything else keeps the previous state."""
    now_firing = memory.firing.setdefault(kind, set())
    if fire:
        now_firing.add(rank)
    elif clear:
        now_firing.discard(rank)
    return rank in now_firing


def _stragglers(state: RunState, derived: Mapping[int, _Derived], cfg: HealthConfig,
                memory: Memory) -> list[Finding]:
    n = cfg.straggler_steps
    recent = {r: d.strag for r, d in derived.items() if d.strag is not None}
    if len(recent) < 2:
        return []
    ref = median(v[0] for v in recent.values())
    if ref <= 0:
        return []
    limit = cfg.straggler_ratio * ref
    clear = cfg.clear_ratio("straggler") * ref  # resolves under a lower ratio (hysteresis)
    # only ranks firing already or slow now can be (or stop being) stragglers
    firing = memory.firing.setdefault("straggler", set())
    maybe = {r for r, v in recent.items() if v[1] >= limit}
    maybe.update(r for r in firing if r in recent)
    out = []
    for rank in sorted(maybe):
        rs = state.ranks.get(rank)
        if rs is None or not rs.live:
            firing.discard(rank)
            continue
        med, lo, hi = recent[rank]
        if _hysteresis(memory, "straggler", rank, lo >= limit, hi < clear):
            out.append(Finding(
                "straggler", (rank,),
                f"rank {rank} step time {med:.3g}s is {med / ref:.2f}x the ranks' "
                f"median {ref:.3g}s over its last {n} steps",
                rs.last_step, rs.host, LEVELS["straggler"]))
    return out


def _slow_windows(vals: Sequence[float], n: int) -> tuple[float, float] | None:
    """The smallest and the last mean of `n` consecutive values (None for fewer values).
    A running sum, in C (`accumulate`: at 16,384 ranks a Python loop was 0.1 s): each
    window's sum is the last one's plus the value that came less the value that went,
    and the smallest mean is the smallest sum divided by `n` (division by n > 0 keeps
    the order of the rounded sums)."""
    if len(vals) < n:
        return None
    totals = list(accumulate(map(sub, vals[n:], vals[:-n]), initial=sum(vals[:n])))
    return min(totals) / n, totals[-1] / n


def _slowdowns(state: RunState, derived: Mapping[int, _Derived], cfg: HealthConfig,
               memory: Memory) -> list[Finding]:
    n = cfg.slowdown_steps
    current = {r: d.slow[1] for r, d in derived.items() if d.slow is not None}
    ranks = state.ranks
    live = [r for r in current if ranks[r].status == "running"]  # (`RankState.live`)
    if not live:
        return []
    job_now = median(current[r] for r in live)
    # the same ranks' best windows: when ranks finish or crash, the median of those left
    # must not be compared with a best that ranks no longer running made
    job_best = memory.best[JOB] = median(memory.best[r] for r in live)
    ratio = job_now / job_best if job_best > 0 else 0.0
    slower = ratio >= cfg.slowdown_ratio and job_now - job_best >= SLOWDOWN_MIN_SECONDS
    back = ratio < cfg.clear_ratio("slowdown") or job_now - job_best < SLOWDOWN_MIN_SECONDS
    if _hysteresis(memory, "slowdown", JOB, slower, back):
        ranks_now = tuple(sorted(live))
        hosts = sorted({h for r in ranks_now if (h := ranks[r].host)})
        step = max((s for r in ranks_now if (s := ranks[r].last_step) is not None), default=None)
        return [Finding(
            "slowdown", ranks_now,
            f"the whole job runs {ratio:.2f}x slower than its best {n}-step window "
            f"({job_now:.3g}s vs {memory.best[JOB]:.3g}s per step)",
            step, hosts[0] if len(hosts) == 1 else None, LEVELS["slowdown"], group=False)]
    # a live rank fires once it is `slowdown_ratio` slower than its best window, and
    # until it is back under `clear_ratio` (hysteresis)
    best, firing = memory.best, memory.firing.setdefault("slowdown", set())
    slow_now = []
    for r in live:
        ratio_r = current[r] / best[r] if best[r] > 0 else 0.0
        costs = current[r] - best[r] >= SLOWDOWN_MIN_SECONDS
        limit = cfg.clear_ratio("slowdown") if r in firing else cfg.slowdown_ratio
        if costs and ratio_r >= limit:
            slow_now.append(r)
    firing.difference_update(live)
    firing.update(slow_now)
    out = []
    for rank in sorted(slow_now):
        rs, b = ranks[rank], best[rank]
        r_ratio = current[rank] / b if b > 0 else 0.0
        out.append(Finding(
            "slowdown", (rank,),
            f"rank {rank} runs {r_ratio:.2f}x slower than its best {n}-step window "
            f"({current[rank]:.3g}s vs {b:.3g}s per step)",
            rs.last_step, rs.host, LEVELS["slowdown"]))
    return out


def median_period(times: Mapping[int, list[float]]) -> float | None:
    """The ranks' median step period (None before any rank has two step rows)."""
    per_rank = [median(v) for v in times.values() if v]
    return median(per_rank) if per_rank else None


def _hangs(state: RunState, threshold: float, now: float, since: float) -> list[Finding]:
    """Silence counts from `since` at the earliest (the end of the last stall)."""
    # most passes find no live rank silent that long: one comprehension, no sort
    oldest = min([w for rs in state.live if (w := rs.last_write) is not None], default=None)
    if oldest is None or now - max(oldest, since) < threshold:
        return []
    # "another rank advanced": some rank wrote later and reached a later step. The ranks
    # sorted by last write, with the largest step of those written at or after each, answer
    # that for every silent rank with one bisection (all pairs would be 268M at 16,384).
    written = sorted((o.last_write, o.last_step) for o in state.ranks.values()
                     if o.last_write is not None and o.last_step is not None)
    writes = [w for w, _ in written]
    later_step = [s for _, s in written]
    for i in range(len(later_step) - 2, -1, -1):
        later_step[i] = max(later_step[i], later_step[i + 1])
    out = []
    for rs in state.live:
        if rs.last_write is None:
            continue
        silent = now - rs.last_write
        if now - max(rs.last_write, since) < threshold:
            continue
        mine = rs.last_step if rs.last_step is not None else -1
        k = bisect_right(writes, rs.last_write)  # the first rank written after this one
        if k < len(later_step) and later_step[k] > mine:
            at = f"at step {rs.last_step}" if rs.last_step is not None else "before its first step"
            out.append(Finding(
                "hang", (rs.rank,),
                f"rank {rs.rank} has written nothing for {silent:.0f}s {at} while other ranks advanced"
                + (f" (pid {rs.pid})" if rs.pid else ""),
                rs.last_step, rs.host, LEVELS["hang"]))
    return out


def _behind(state: RunState, cfg: HealthConfig) -> list[Finding]:
    lead = state.lead
    if lead is None:
        return []
    short = lead - max(cfg.behind_steps, 0)  # a step at or below it is behind_steps short
    out = []
    for rs in [rs for rs in state.live if rs.last_step is not None and rs.last_step <= short]:
        gap = state.behind(rs.rank)
        if gap is not None and gap >= cfg.behind_steps:
            out.append(Finding(
                "behind", (rs.rank,), f"rank {rs.rank} is at step {rs.last_step}, {gap} steps behind {lead}",
                rs.last_step, rs.host, LEVELS["behind"]))
    return out


def _held_for(found: list[Finding], since: dict[int, float], now: float,
              hold: float) -> list[Finding]:
    """The findings that held `hold` seconds (`since`: rank -> when first found, kept up
    to date): a rank is never behind by a size an attribute cache still shows."""
    ranks = {f.ranks[0] for f in found}
    for r in [r for r in since if r not in ranks]:
        del since[r]
    for r in ranks:
        since.setdefault(r, now)
    return [f for f in found if now - since[f.ranks[0]] >= hold]


def crashes(state: RunState, cache: float = 0.0) -> list[Finding]:
    """One finding per crashed rank; `info` is its root candidate: {rank, host, type,
    message, time (its own clock, from the sidecar's exit), at (ours: its last write)}.
    A rank most likely killed where its pid cannot be checked (`lost.killed_ranks`) is
    one too: it is the root its peers' errors blame."""
    killed = killed_ranks(state, state.read_time, cache)
    gone = {rs.rank for rs in killed}
    out = []
    for rs in [*(rs for rs in state.ranks.values() if rs.status == "crashed"), *killed]:
        why = rs.status_reason or "crashed"
        ex = rs.exit or {}
        kind, message = ex.get("type"), ex.get("message")
        if rs.rank in gone:
            quiet = state.read_time - (rs.wrote_at or state.read_time)
            why = (f"no row or probe for {quiet:.0f}s, since before its peers crashed "
                   "blaming a peer (its process killed?)")
        elif rs.exit:
            why = f"{kind or 'exception'}: {message or ''}".rstrip(": ")
        elif why == "process gone":
            why = f"its process{f' {rs.pid}' if rs.pid else ''} is gone without a finish"
        at = f" at step {rs.last_step}" if rs.last_step is not None else ""
        t = ex.get("time")
        info = {"rank": rs.rank, "host": rs.host,
                "type": kind if isinstance(kind, str) else None,
                "message": message if isinstance(message, str) else why,
                "time": t if isinstance(t, (int, float)) and not isinstance(t, bool) else None,
                "at": rs.wrote_at}
        out.append(Finding("crashed", (rs.rank,), f"rank {rs.rank} crashed{at}: {why}",
                           rs.last_step, rs.host, LEVELS["crashed"], group=False, info=info))
    return out


def _started(rs: RankState) -> float | None:
    """When a rank started, on the reader's clock (`health.clock`): its `start_time` is on
    its host's clock, so it is dated by how long before its last row it came (both on that
    clock) back from when the reader saw that row written."""
    if rs.last_write is None:
        return None
    if rs.start_time is None or not rs.times:
        return rs.last_write
    return rs.last_write - max(0.0, rs.times[-1] - rs.start_time)


def _missing(state: RunState, cfg: HealthConfig, now: float) -> list[Finding]:
    world, ranks = state.world_size, state.ranks
    if not world or (len(ranks) >= world and max(ranks) < world):  # every rank has a shard
        return []
    gone = tuple(r for r in range(world) if r not in ranks)
    starts = [t for rs in ranks.values() if (t := _started(rs)) is not None]
    if not gone or not starts or now - min(starts) < cfg.missing_after:
        return []
    return [Finding("missing", gone,
                    f"{len(gone)} of {world} ranks never wrote a shard within "
                    f"{cfg.missing_after:.0f}s of the first rank's start",
                    None, None, LEVELS["missing"], group=False)]


def _alerts(state: RunState, suppressed: Iterable[Mapping[str, Any]]) -> list[Finding]:
    out = []
    for a in suppressed:
        rank = a.get("rank")
        if a.get("kind") != "fire" or type(rank) is not int:
            continue
        rs = state.ranks.get(rank)
        step = a.get("step") if type(a.get("step")) is int else None
        title = str(a.get("title") or a.get("rule") or "alert")
        # the rank and the step, unless the rule's message says them already
        who = "" if re.search(rf"\brank {rank}\b", title) else f"rank {rank}: "
        at = "" if step is None or re.search(rf"\bstep {step}\b", title) else f" at step {step}"
        out.append(Finding(
            "alert", (rank,),
            f"{who}{title}{at}"
            # (not "not delivered": this incident is what a watcher pages, and its line's
            # `delivered` says whether it went out; issue 54)
            + f" (rule {a.get('rule')}; held back by rank {rank}, not the alerting rank)",
            step, rs.host if rs else None, str(a.get("level") or "error")))
    return out


def _probes_seen(state: RunState, memory: Memory, now: float) -> tuple[dict[int, float], set[int]]:
    """Rank -> when this watcher first saw its probe of the current silence (a probe is
    rewritten every few seconds with the same `since`, give or take the clocks' jitter),
    and the ranks whose probe this watcher last saw rewritten before the last stall
    ended: left over from that silence (the job advanced since, and a synchronous job only
    advances with every rank; a rank whose thread then could not run, C code holding the
    GIL, never took it away, and its rows since may still sit in its buffer). A
    watcher's first pass (`--once`) cannot tell: it dates every probe long ago."""
    seen, first = memory.probes, memory.passes == 0
    memory.passes += 1
    out: dict[int, tuple[float, float, Any, float]] = {}
    for rs in state.live:
        probe = rs.probe
        if probe is None:
            continue
        since = probe.get("since")
        since = float(since) if isinstance(since, (int, float)) else math.nan
        at = probe.get("time")
        old = seen.get(rs.rank)
        if old is None or not abs(old[0] - since) < 1.0:
            at_seen = -math.inf if first else now
            out[rs.rank] = (since, at_seen, at, at_seen)
        else:
            out[rs.rank] = old if old[2] == at else (old[0], old[1], at, now)
    memory.probes = out
    end = memory.stall_end
    return ({rank: v[1] for rank, v in out.items()},
            {rank for rank, v in out.items() if v[3] < end})


def _held(state: RunState, memory: Memory) -> list[Finding]:
    """While the ranks' step-time windows still hold the step that waited out a stall:
    the stragglers and slowdowns firing before it, held as they are. (Their incidents
    resolved at the stall's end and opened again, as news and a second page, once the
    windows had moved past it.)"""
    live = tuple(sorted(rs.rank for rs in state.live))
    return [Finding(kind, live if r == JOB else (r,), "", level=LEVELS[kind], hold=True)
            for kind in ("straggler", "slowdown") for r in sorted(memory.firing.get(kind, ()))
            if r == JOB or r in live]  # (a rank that ended meanwhile is no straggler)


def _behind_fed(state: RunState, cfg: HealthConfig, memory: Memory, now: float,
                unfed: set[int]) -> list[Finding]:
    """`behind` (held `fs_cache`), but held, not opened, for a rank whose rows wait on a
    silent exprd, and after it until they caught up (`Memory.catching_up`)."""
    found = _behind(state, cfg)
    short = {f.ranks[0] for f in found}
    late = memory.catching_up = (memory.catching_up | unfed) & short
    return [_unfed(f, late) for f in _held_for(found, memory.behind_since, now,
                                                cfg.fs_cache or 0.0)]


def _unfed(f: Finding, unfed: set[int]) -> Finding:
    """A `behind` or `hang` of a rank whose rows wait on a silent exprd: held, not opened
    (`daemons.unfed_ranks`)."""
    return replace(f, hold=True) if f.ranks[0] in unfed else f


def ended(state: RunState) -> bool:
    """The run is over: it has ranks and every one finished or crashed."""
    return bool(state.ranks) and not state.live


def detect(
    state: RunState,
    suppressed: Iterable[Mapping[str, Any]],
    cfg: HealthConfig,
    memory: Memory,
    now: float,
) -> list[Finding]:
    """Every finding of one pass. `suppressed`: the latest suppressed alert line per (rank, rule).

    Once the run has ended (no live rank) only crashes are found: nothing else can be
    wrong with a run that is over (`incidents.plan` resolves what is open)."""
    if ended(state):
        return crashes(state, cfg.fs_cache or 0.0)
    derived = _derive(state, cfg, memory)
    period = median([d.median for d in derived.values()]) if derived else None
    # through an attribute cache a file's size and mtime can be that old: silence is
    # believed only beyond it (`HealthConfig.fs_cache`, resolved by the watcher)
    cache = cfg.fs_cache or 0.0
    threshold = cfg.hang_threshold(period) + cache
    evidence = cfg.evidence_threshold(period) + cache
    seen, left_over = _probes_seen(state, memory, now)
    newest = max([t for rs in state.live if (t := rs.advanced) is not None], default=None)
    last, memory.newest = memory.newest, newest
    if newest is not None and last is not None and newest - last >= threshold - cache \
            and not memory.stalled:
        # the whole job paused as long as a stall takes, and went on, whether or not the
        # stall was raised (through a cache it is raised `fs_cache` later): as after one,
        # silence before now is not a hang (another host's ranks are seen going on up to
        # `fs_cache` after this host's), and the step that waited is not a slowdown
        memory.stall_end, memory.stall_step = now, state.lead
    # every rank of every node silent, as after the scheduler killed the job: one incident,
    # no node lost (no peer waits for it), no stall naming suspects, no hang per rank
    silent = job_silence(state, evidence, now)
    lost = [] if silent is not None else lost_nodes(state, evidence, now, cache)
    # a node's exprd silent while its ranks train on: a warning about the daemon, and its
    # ranks' shards, short of the others', are neither behind nor hung
    daemons = [] if lost or silent is not None else silent_exprds(state, now, cache)
    unfed = {r for d in daemons for r in d["ranks"]} | unfed_ranks(state, now)
    # a lost node explains the others' wait: no stall names its ranks as suspects
    stalled = None if lost or silent is not None else stall(
        state, threshold, now, period, seen, left_over, evidence, cache)
    if stalled is None and memory.stalled:
        memory.stall_end, memory.stall_step = now, state.lead
    memory.stalled = stalled is not None
    job: list[Finding] = []
    if stalled is not None:  # the suspects are named: no rank is a hang on its own
        job.append(Finding("stall", stalled["ranks"], stalled["detail"], stalled["step"],
                           stalled["host"], stalled.get("level", LEVELS["stall"]), group=False,
                           info=stalled))
    job.extend(Finding("lost", node["ranks"], node["detail"], node["step"], node["host"],
                       LEVELS["lost"], group=False, info=node) for node in lost)
    if silent is not None:
        job.append(Finding("silent", silent["ranks"], silent["detail"], silent["step"], None,
                           LEVELS["silent"], group=False, info=silent))
    job.extend(Finding("exprd", d["ranks"], d["detail"], d["step"], d["host"],
                       LEVELS["exprd"], group=False, info=d) for d in daemons)
    gone = {r for node in lost for r in node["ranks"]}
    if stalled is None and silent is None and newest is not None and now - newest < threshold / 2:
        # a silent rank is a hang while the others still advance; once they stopped too
        # (a synchronous job waits for it at its next collective) it is a stall coming
        job.extend(_unfed(f, unfed) for f in _hangs(state, threshold, now, memory.stall_end)
                   if f.ranks[0] not in gone)
    # the step that waited out a stall is one huge step time: not a straggler or slowdown
    # until every rank's windows have moved past it
    front, after = state.frontier, memory.stall_step
    settled = after is None or (front is not None and
                                front - after > max(cfg.straggler_steps, cfg.slowdown_steps))
    timing = [*_stragglers(state, derived, cfg, memory),
              *_slowdowns(state, derived, cfg, memory)] if settled else _held(state, memory)
    return [
        *crashes(state, cfg.fs_cache or 0.0),
        *job,
        *timing,
        *_behind_fed(state, cfg, memory, now, unfed),
        *_missing(state, cfg, now),
        *_alerts(state, suppressed),
        *(Finding("nonfinite", n["ranks"], n["detail"], n["step"], n["host"],
                  LEVELS["nonfinite"], group=False, info=n)
          for n in nonfinite(state, memory.nonfinite)),
    ]
