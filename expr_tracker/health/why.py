"""Why a rank is slow: its latest system metrics against the other ranks' median (issue 21).

`explain(system, ranks)` takes each rank's latest system-metrics sample (`RunState.system`,
`system/*` keys as the SDK logs them, DESIGN 19) and returns what stands out for the
ranks of a straggler or slowdown incident, e.g. "rank 37: SM clock 1,410 MHz vs 1,980
median, thermal throttle", or None when nothing does. Pure, no I/O.

A value stands out when it differs from the median of the other ranks (every rank's,
for an incident of the whole job) by at least a relative and an absolute margin, per
metric (`RULES`): both, so that 3% against 1% CPU or 110 MB against 100 MB RSS is not
news. Throttle reasons are named when the rank has one the median rank does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

# NVML clock event ("throttle") reason bits, as nvml.h defines them; idle, application
# and display clock settings and sync boost are not slowdowns
THROTTLE_REASONS = (
    (0x4, "power cap"),
    (0x8, "hardware slowdown"),
    (0x20, "thermal throttle"),  # software thermal slowdown
    (0x40, "thermal throttle"),  # hardware thermal slowdown
    (0x80, "power brake"),
)
MAX_RANKS = 4  # ranks explained in one line; the rest are counted


def _mb(x: float) -> str:
    """`512 MB`, `1.5 GB`, `61 GB`."""
    if abs(x) < 1024:
        return f"{x:,.0f} MB"
    gb = x / 1024
    return f"{gb:.1f} GB" if abs(gb) < 10 else f"{gb:,.0f} GB"


def _unit(fmt: str) -> Callable[[float], str]:
    return lambda x: fmt.format(x)


@dataclass(frozen=True)
class Rule:
    """When a metric stands out: `direction` +1 higher, -1 lower, 0 either; both margins."""

    key: str
    label: str
    fmt: Callable[[float], str]
    direction: int
    rel: float  # |x - median| >= rel * |median| ...
    abs: float  # ... and >= abs


# in the order a reader wants the causes: the GPU's own slowdowns, then the host's
RULES = (
    Rule("system/gpu_sm_clock_mhz", "SM clock", _unit("{:,.0f} MHz"), -1, 0.10, 100.0),
    Rule("system/gpu_temp_c", "GPU temperature", _unit("{:.0f} °C"), +1, 0.0, 10.0),
    Rule("system/gpu_power_w", "GPU power", _unit("{:,.0f} W"), 0, 0.25, 30.0),
    Rule("system/gpu_util", "GPU utilisation", _unit("{:.0f}%"), 0, 0.0, 20.0),
    Rule("system/cpu_percent", "CPU", _unit("{:.0f}%"), 0, 1.0, 10.0),
    Rule("system/rss_mb", "RSS", _mb, +1, 0.5, 512.0),
    Rule("system/gpu_mem_mb", "GPU memory", _mb, 0, 0.25, 1024.0),
    Rule("system/read_mb_s", "disk reads", _unit("{:,.1f} MB/s"), +1, 1.0, 20.0),
    Rule("system/write_mb_s", "disk writes", _unit("{:,.1f} MB/s"), +1, 1.0, 20.0),
)


def _number(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def throttle_names(mask: Any) -> list[str]:
    """The slowdown reasons in an NVML throttle mask (`system/gpu_throttle`), in order."""
    x = _number(mask)
    if x is None or x < 0:
        return []
    bits = int(x)
    out: list[str] = []
    for bit, name in THROTTLE_REASONS:
        if bits & bit and name not in out:
            out.append(name)
    return out


def stands_out(rule: Rule, x: float, med: float) -> bool:
    """Does `x` differ from `med` by both of the rule's margins, in its direction?"""
    d = x - med
    if d == 0.0 or (rule.direction > 0 and d < 0) or (rule.direction < 0 and d > 0):
        return False
    return abs(d) >= rule.abs and abs(d) >= rule.rel * abs(med)


def rank_reasons(mine: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> list[str]:
    """What stands out in one rank's sample against the others' median, most telling first."""
    out = []
    for rule in RULES:
        x = _number(mine.get(rule.key))
        ref = [v for o in others if (v := _number(o.get(rule.key))) is not None]
        if x is None or not ref:
            continue
        med = median(ref)
        if stands_out(rule, x, med):
            out.append(f"{rule.label} {rule.fmt(x)} vs {rule.fmt(med)} median")
    if "system/gpu_throttle" in mine:
        usual = sorted(throttle_names(o.get("system/gpu_throttle")) for o in others)
        common = set(usual[len(usual) // 2]) if usual else set()
        out.extend(n for n in throttle_names(mine["system/gpu_throttle"]) if n not in common)
    return out


def explain(system: Mapping[int, Mapping[str, Any]], ranks: Sequence[int]) -> str | None:
    """The why line of an incident of `ranks` (None when no rank stands out, or no rank
    has samples to compare with)."""
    inside = set(ranks)
    outside = [s for r, s in system.items() if r not in inside]
    parts: list[str] = []
    n_more = 0
    for r in sorted(inside):
        mine = system.get(r)
        if mine is None:
            continue
        # the whole job slow: each rank against every rank's median
        others = outside or [s for q, s in system.items() if q != r]
        reasons = rank_reasons(mine, others)
        if not reasons:
            continue
        if len(parts) < MAX_RANKS:
            parts.append(f"rank {r}: " + ", ".join(reasons))
        else:
            n_more += 1
    if not parts:
        return None
    return "; ".join(parts) + (f"; and {n_more} more ranks" if n_more else "")
