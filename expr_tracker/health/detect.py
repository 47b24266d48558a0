"""The health detectors (DESIGN 13): pure functions of a RunState, no I/O.

`detect(state, alerts, cfg, memory, now)` returns the `Finding`s of one pass: what is
wrong now, rank by rank. `Memory` carries what one pass cannot see: each rank's best
step-time window (slowdown) and which ranks were firing (so straggler and slowdown
resolve only once their window is back under the ratio, not at the first fast step).
Turning findings into incidents is `incidents.plan`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.state import RunState

KINDS = ("straggler", "slowdown", "hang", "behind", "crashed", "missing", "alert")
LEVELS = {"straggler": "warning", "slowdown": "warning", "hang": "error", "behind": "warning",
          "crashed": "error", "missing": "error", "alert": "error"}
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


@dataclass
class Memory:
    """What the detectors remember between passes of one watcher."""

    best: dict[int, float] = field(default_factory=dict)  # rank (or JOB) -> best window mean
    firing: dict[str, set[int]] = field(default_factory=dict)  # kind -> ranks firing


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
    inf = math.inf
    for rank, rs in state.ranks.items():
        if series is not None:
            logged = [v for v in series.get(rank, ()) if 0.0 <= v < inf]  # NaN: not a number
        else:
            logged = [v for rec in state.rank_records.get(rank, ())
                      if (v := _number(rec.get(key))) is not None]
        if logged:
            out[rank] = logged
            continue
        steps, times = rs.steps, rs.times
        gaps = []
        for i in range(1, len(steps)):
            s0, s1, t0, t1 = steps[i - 1], steps[i], times[i - 1], times[i]
            if s1 > s0 and t1 >= t0:
                gaps.append((t1 - t0) / (s1 - s0))
        if gaps:
            out[rank] = gaps
    return out


def _hysteresis(memory: Memory, kind: str, rank: int, fire: bool, clear: bool) -> bool:
    """Firing now: `fire` opens, `clear` closes, anything else keeps the previous state."""
    now_firing = memory.firing.setdefault(kind, set())
    if fire:
        now_firing.add(rank)
    elif clear:
        now_firing.discard(rank)
    return rank in now_firing


def _stragglers(state: RunState, times: Mapping[int, list[float]], cfg: HealthConfig,
                memory: Memory) -> list[Finding]:
    n = cfg.straggler_steps
    recent = {r: v[-n:] for r, v in times.items() if len(v) >= n}
    if len(recent) < 2:
        return []
    ref = median(median(v) for v in recent.values())
    if ref <= 0:
        return []
    limit = cfg.straggler_ratio * ref
    out = []
    for rank, vals in sorted(recent.items()):
        rs = state.ranks.get(rank)
        if rs is None or not rs.live:
            memory.firing.get("straggler", set()).discard(rank)
            continue
        slow = all(v >= limit for v in vals)
        fast = all(v < limit for v in vals)
        if _hysteresis(memory, "straggler", rank, slow, fast):
            out.append(Finding(
                "straggler", (rank,),
                f"rank {rank} step time {median(vals):.3g}s is {median(vals) / ref:.2f}x the ranks' "
                f"median {ref:.3g}s over its last {n} steps",
                rs.last_step, rs.host, LEVELS["straggler"]))
    return out


def _window_means(vals: Sequence[float], n: int) -> list[float]:
    if len(vals) < n:
        return []
    # a running sum (each window re-summed is n times the work, at 16,384 ranks 0.2 s)
    total = sum(vals[:n])
    out = [total / n]
    for i in range(n, len(vals)):
        total += vals[i] - vals[i - n]
        out.append(total / n)
    return out


def _slowdowns(state: RunState, times: Mapping[int, list[float]], cfg: HealthConfig,
               memory: Memory) -> list[Finding]:
    n = cfg.slowdown_steps
    current: dict[int, float] = {}
    for rank, vals in times.items():
        means = _window_means(vals, n)
        if not means:
            continue
        best = min(means)
        memory.best[rank] = min(best, memory.best.get(rank, best))
        current[rank] = means[-1]
    live = [r for r in current if state.ranks[r].live]
    if not live:
        return []
    job_now = median(current[r] for r in live)
    # the same ranks' best windows: when ranks finish or crash, the median of those left
    # must not be compared with a best that ranks no longer running made
    job_best = memory.best[JOB] = median(memory.best[r] for r in live)
    ratio = job_now / job_best if job_best > 0 else 0.0
    slower = ratio >= cfg.slowdown_ratio and job_now - job_best >= SLOWDOWN_MIN_SECONDS
    if _hysteresis(memory, "slowdown", JOB, slower, not slower):
        ranks = tuple(sorted(live))
        hosts = sorted({h for r in ranks if (h := state.ranks[r].host)})
        step = max((s for r in ranks if (s := state.ranks[r].last_step) is not None), default=None)
        return [Finding(
            "slowdown", ranks,
            f"the whole job runs {ratio:.2f}x slower than its best {n}-step window "
            f"({job_now:.3g}s vs {memory.best[JOB]:.3g}s per step)",
            step, hosts[0] if len(hosts) == 1 else None, LEVELS["slowdown"], group=False)]
    out = []
    for rank in sorted(live):
        best = memory.best[rank]
        r_ratio = current[rank] / best if best > 0 else 0.0
        slower = r_ratio >= cfg.slowdown_ratio and current[rank] - best >= SLOWDOWN_MIN_SECONDS
        if _hysteresis(memory, "slowdown", rank, slower, not slower):
            rs = state.ranks[rank]
            out.append(Finding(
                "slowdown", (rank,),
                f"rank {rank} runs {r_ratio:.2f}x slower than its best {n}-step window "
                f"({current[rank]:.3g}s vs {best:.3g}s per step)",
                rs.last_step, rs.host, LEVELS["slowdown"]))
    return out


def median_period(times: Mapping[int, list[float]]) -> float | None:
    """The ranks' median step period (None before any rank has two step rows)."""
    per_rank = [median(v) for v in times.values() if v]
    return median(per_rank) if per_rank else None


def _hangs(state: RunState, threshold: float, now: float) -> list[Finding]:
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
        if silent < threshold:
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
    out = []
    for rs in state.live:
        gap = state.behind(rs.rank)
        if lead is not None and gap is not None and gap >= cfg.behind_steps:
            out.append(Finding(
                "behind", (rs.rank,), f"rank {rs.rank} is at step {rs.last_step}, {gap} steps behind {lead}",
                rs.last_step, rs.host, LEVELS["behind"]))
    return out


def _crashed(state: RunState) -> list[Finding]:
    out = []
    for rs in state.ranks.values():
        if rs.status != "crashed":
            continue
        why = rs.status_reason or "crashed"
        if rs.exit:
            why = f"{rs.exit.get('type', 'exception')}: {rs.exit.get('message', '')}".rstrip(": ")
        elif why == "process gone":
            why = f"its process{f' {rs.pid}' if rs.pid else ''} is gone without a finish"
        at = f" at step {rs.last_step}" if rs.last_step is not None else ""
        out.append(Finding("crashed", (rs.rank,), f"rank {rs.rank} crashed{at}: {why}",
                           rs.last_step, rs.host, LEVELS["crashed"]))
    return out


def _missing(state: RunState, cfg: HealthConfig, now: float) -> list[Finding]:
    world = state.world_size
    starts = [t for rs in state.ranks.values() if (t := rs.start_time or rs.last_write) is not None]
    if not world or not starts or now - min(starts) < cfg.missing_after:
        return []
    gone = tuple(r for r in range(world) if r not in state.ranks)
    if not gone:
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
        out.append(Finding(
            "alert", (rank,),
            f"rank {rank}: {title}" + (f" at step {step}" if step is not None else "")
            + f" (rule {a.get('rule')}; not delivered: rank {rank} is not the alerting rank)",
            step, rs.host if rs else None, str(a.get("level") or "error")))
    return out


def detect(
    state: RunState,
    suppressed: Iterable[Mapping[str, Any]],
    cfg: HealthConfig,
    memory: Memory,
    now: float,
) -> list[Finding]:
    """Every finding of one pass. `suppressed`: the latest suppressed alert line per (rank, rule)."""
    times = step_times(state, cfg.step_time_key)
    return [
        *_crashed(state),
        *_hangs(state, cfg.hang_threshold(median_period(times)), now),
        *_stragglers(state, times, cfg, memory),
        *_slowdowns(state, times, cfg, memory),
        *_behind(state, cfg),
        *_missing(state, cfg, now),
        *_alerts(state, suppressed),
    ]
