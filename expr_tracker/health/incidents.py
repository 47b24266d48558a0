"""Incidents: findings turned into things that open once and resolve once (DESIGN 13). Pure.

An incident is one (kind, set of ranks) while it is open. A pass's findings of one kind
are matched to the open incidents of that kind: an incident stays open while any of its
ranks still fires (a rank that joins later opens an incident of its own), and resolves
when none does. New findings of one kind on one host form one incident naming the host.

A hang resolves on what the rank does, not on thresholds: only when each of its ranks has
written again (or is no longer live). So a watcher with other settings (an `expr watch`
beside exprd) never resolves a hang another watcher opened while the rank stays silent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from expr_tracker.health.detect import Finding
from expr_tracker.health.state import RunState
from expr_tracker.health.why import explain

WHY_KINDS = ("straggler", "slowdown")
LINE_KEYS = ("kind", "ranks", "hosts", "step", "first_seen", "last_seen", "detail", "state",
             "delivered")


@dataclass
class Incident:
    """One incident; `as_line()` is its `incidents.jsonl` line."""

    kind: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    step: int | None
    first_seen: float
    last_seen: float
    detail: str
    state: str = "open"  # open | resolved
    delivered: bool = False
    level: str = "warning"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    why: str | None = None  # a straggler's or slowdown's system metrics that stand out

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What makes it one incident: its kind and its set of ranks."""
        return self.kind, self.ranks

    def as_line(self) -> dict[str, Any]:
        """The `incidents.jsonl` line (DESIGN 13), plus the level."""
        line = {
            "kind": self.kind, "ranks": list(self.ranks), "hosts": list(self.hosts),
            "step": self.step, "first_seen": self.first_seen, "last_seen": self.last_seen,
            "detail": self.detail, "state": self.state, "delivered": self.delivered,
            "level": self.level,
        }
        if self.why is not None:
            line["why"] = self.why
        return line

    @classmethod
    def from_line(cls, line: Mapping[str, Any]) -> Incident | None:
        """Parse an `incidents.jsonl` line; None if it is not one."""
        kind, ranks, state = line.get("kind"), line.get("ranks"), line.get("state")
        if not isinstance(kind, str) or not isinstance(ranks, list) or state not in ("open", "resolved"):
            return None
        if not all(type(r) is int for r in ranks):
            return None
        step = line.get("step")
        raw_hosts = line.get("hosts")
        hosts: list[Any] = raw_hosts if isinstance(raw_hosts, list) else []
        return cls(
            kind=kind, ranks=tuple(sorted(ranks)), hosts=tuple(str(h) for h in hosts),
            step=step if type(step) is int else None,
            first_seen=_time(line.get("first_seen")), last_seen=_time(line.get("last_seen")),
            detail=str(line.get("detail") or ""), state=state,
            delivered=bool(line.get("delivered")), level=str(line.get("level") or "warning"),
            why=line["why"] if isinstance(line.get("why"), str) else None,
        )


def _time(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


@dataclass
class Plan:
    """What a pass changes: incidents to open, to resolve, and those still open (updated)."""

    opened: list[Incident]
    resolved: list[Incident]
    still_open: list[Incident]


def _merge(kind: str, group: list[Finding], now: float) -> Incident:
    ranks = tuple(sorted({r for f in group for r in f.ranks}))
    hosts = tuple(sorted({f.host for f in group if f.host}))
    steps = [f.step for f in group if f.step is not None]
    if len(group) == 1:
        detail = group[0].detail
    else:
        where = f" on {hosts[0]}" if len(hosts) == 1 else ""
        detail = f"{len(ranks)} ranks{where}: " + "; ".join(f.detail for f in group[:4])
        if len(group) > 4:
            detail += f"; and {len(group) - 4} more"
    levels = ("debug", "info", "warning", "error", "critical")
    level = max((f.level for f in group), key=lambda lv: levels.index(lv) if lv in levels else 2)
    return Incident(kind=kind, ranks=ranks, hosts=hosts, step=max(steps) if steps else None,
                    first_seen=now, last_seen=now, detail=detail, level=level)


def _with_why(inc: Incident, state: RunState | None) -> Incident:
    """A straggler or slowdown says what stands out in its ranks' system metrics."""
    if inc.kind not in WHY_KINDS or state is None or not state.system:
        return inc
    why = explain(state.system, inc.ranks)
    return inc if why is None else replace(inc, why=why, detail=f"{inc.detail}; {why}")


def _still_silent(inc: Incident, state: RunState | None) -> bool:
    """A hang incident whose ranks have not written since it opened (and still run)."""
    if inc.kind != "hang" or state is None:
        return False
    for r in inc.ranks:
        rs = state.ranks.get(r)
        if rs is not None and rs.live and (rs.last_write or 0.0) <= inc.first_seen:
            return True
    return False


def plan(open_incidents: Iterable[Incident], findings: Iterable[Finding], now: float,
         state: RunState | None = None) -> Plan:
    """Match this pass's findings to the open incidents (see the module docstring).
    `state`, the pass's reading of the run, lets a hang resolve only on a new write."""
    by_kind: dict[str, list[Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.kind, []).append(f)
    opened: list[Incident] = []
    resolved: list[Incident] = []
    still: list[Incident] = []
    taken: set[tuple[str, int]] = set()
    for inc in open_incidents:
        firing = {r for f in by_kind.get(inc.kind, ()) for r in f.ranks}
        if firing & set(inc.ranks):
            hits = [f for f in by_kind[inc.kind] if set(f.ranks) & set(inc.ranks)]
            steps = [f.step for f in hits if f.step is not None]
            still.append(replace(inc, last_seen=now, step=max(steps) if steps else inc.step))
            taken.update((inc.kind, r) for r in inc.ranks)
        elif _still_silent(inc, state):
            still.append(replace(inc, last_seen=now))
            taken.update((inc.kind, r) for r in inc.ranks)
        else:
            resolved.append(replace(inc, state="resolved", last_seen=now, delivered=False))
    for kind, group in by_kind.items():
        fresh: dict[Any, list[Finding]] = {}
        for f in group:
            left = tuple(r for r in f.ranks if (kind, r) not in taken)
            if not left:
                continue
            f = replace(f, ranks=left) if left != f.ranks else f
            gkey: Any = ("host", f.host) if f.group and f.host else ("one", id(f))
            fresh.setdefault(gkey, []).append(f)
        for members in fresh.values():
            opened.append(_with_why(_merge(kind, members, now), state))
    return Plan(opened, resolved, still)
