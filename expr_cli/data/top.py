"""`expr top`'s answer: every rank's state and the run's incidents, worst first (DESIGN 13,
14), as the dict `expr top --once --json` prints and `expr serve` returns.

Read-only: the detectors run in memory on every frame (so the view is live even with no
watcher), merged with the open incidents a watcher recorded in `incidents.jsonl`.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any

from expr_cli.resolve import RunRef

from . import now

_SEVERITY = {"crashed": 0, "hang": 1, "missing": 2, "alert": 3, "straggler": 4, "slowdown": 5,
             "behind": 6}


def age_now(t: float | None) -> float | None:
    """Seconds since `t` (relative to `$EXPR_NOW` in tests)."""
    return None if t is None else max(0.0, now() - t)


def _steps_per_s(times: list[tuple[int, float]]) -> float | None:
    if len(times) < 2:
        return None
    (s0, t0), (s1, t1) = times[0], times[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


def _metric(state: Any, rs: Any, key: str | None) -> Any:
    if key is None:
        return None
    recs = state.rank_records.get(rs.rank) or []
    for rec in reversed(recs):
        if key in rec:
            return rec[key]
    return (rs.last_row or {}).get(key)


class TopView:
    """Builds one frame's data: a reader and detector memory kept between frames."""

    def __init__(self, ref: RunRef, stream: str | None, metric: str | None, cfg: Any) -> None:
        from expr_tracker.health.detect import Memory
        from expr_tracker.health.watch import IncidentLog, Watcher

        self.ref = ref
        self.metric = metric
        self.cfg = cfg
        self.reader = Watcher(ref.path, cfg, None, stream=stream).reader
        self.memory = Memory()
        self.log = IncidentLog(ref.path)

    def __call__(self, state: Any = None) -> dict[str, Any]:
        """One frame; `state`: this pass's live state when the caller read it already
        (from `self.reader`)."""
        from expr_tracker.health.detect import detect
        from expr_tracker.health.incidents import plan

        wall = time.time()
        if state is None:
            state = self.reader.read()
        self.log.sync()
        findings = detect(state, [], self.cfg, self.memory, wall)
        p = plan(self.log.open.values(), findings, wall, state)
        recorded = [i for i in self.log.open.values() if i.kind == "alert"]  # needs alert files
        incidents = sorted([*p.still_open, *p.opened, *recorded],
                           key=lambda i: (_SEVERITY.get(i.kind, 9), i.ranks))
        worst: dict[int, int] = {}
        for inc in incidents:
            for r in inc.ranks:
                worst[r] = min(worst.get(r, 9), _SEVERITY.get(inc.kind, 9))
        rows = []
        for rs in state.ranks.values():
            rows.append({
                "rank": rs.rank, "host": rs.host, "step": rs.last_step, "status": rs.status,
                "behind": state.behind(rs.rank), "steps_per_s": _steps_per_s(rs.step_times),
                "last_write_age": age_now(rs.last_write), "pid": rs.pid,
                "incident": min((k for k, v in _SEVERITY.items() if v == worst.get(rs.rank)), default=None),
                **({"metric": _metric(state, rs, self.metric)} if self.metric else {}),
            })
        rows.sort(key=lambda r: (worst.get(r["rank"], 9), r["status"] == "finished",
                                 -(r["behind"] or 0), r["steps_per_s"] or 0.0, r["rank"]))
        return {
            "run": self.ref.label, "frontier": state.frontier, "lead": state.lead,
            "live": len(state.live), "world_size": state.world_size, "metric": self.metric,
            "ranks": rows, "nodes": _nodes(rows, state),
            "incidents": [i.as_line() for i in incidents],
        }


def _nodes(rows: list[dict[str, Any]], state: Any) -> list[dict[str, Any]]:
    """Per node (host, else rank // local_world_size), worst first."""
    order = {"crashed": 0, "running": 1, "finished": 2}
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        rs = state.ranks[r["rank"]]
        node = rs.host or (f"node{r['rank'] // rs.local_world_size}" if rs.local_world_size else "?")
        by.setdefault(node, []).append(r)
    out = []
    for node, members in by.items():
        steps = [m["step"] for m in members if m["step"] is not None]
        rates = [m["steps_per_s"] for m in members if m["steps_per_s"]]
        out.append({
            "node": node, "ranks": len(members), "live": sum(m["status"] == "running" for m in members),
            "first_rank": min(m["rank"] for m in members), "last_rank": max(m["rank"] for m in members),
            "min_step": min(steps) if steps else None,
            "max_behind": max((m["behind"] or 0 for m in members), default=0),
            "slowest": min(rates) if rates else None,
            "median_rate": median(rates) if rates else None,
            "worst": min((m["status"] for m in members), key=lambda s: order.get(s, 3)),
            "incident": min((m["incident"] for m in members if m["incident"]),
                            key=lambda k: _SEVERITY.get(k, 9), default=None),
        })
    out.sort(key=lambda n: (_SEVERITY.get(n["incident"], 9), order.get(n["worst"], 3),
                            -n["max_behind"], n["slowest"] or 0.0))
    return out


