"""A run's story: every incident `incidents.jsonl` recorded, open or resolved, and the pages
sent (DESIGN 13, turn 5: a finished run keeps its story).

One entry per incident (its lines share an `id`): what it was, when it opened and
resolved, and whether its page (and its recovery's) went out. What `expr summary`, `top
--once`, `watch --once`, `expr alerts` and MCP `list_runs` tell of a run that is over,
from the same function. A screenful whatever the file holds: the worst and newest
`limit` incidents, and counts of all of them. Read only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from expr_tracker.health.incidentlog import INCIDENTS, _LineTail
from expr_tracker.health.incidents import Incident

# the order incidents are told in: the faults first
SEVERITY = {"lost": 0, "crashed": 0, "stall": 1, "hang": 2, "missing": 3, "alert": 4,
            "nonfinite": 4, "straggler": 5, "slowdown": 6, "behind": 7}
MAX_RANKS = 64  # ranks listed per incident (`ranks_count` says how many it has)


def _entry(first: Incident, last: Incident, paged: bool, recovered: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": last.id, "kind": last.kind, "level": last.level, "state": last.state,
        "ranks": list(last.ranks[:MAX_RANKS]), "ranks_count": len(last.ranks),
        "hosts": list(last.hosts[:8]), "step": last.step if last.step is not None else first.step,
        "detail": last.detail or first.detail,
        "first_seen": first.first_seen,
        "resolved_at": last.last_seen if last.state == "resolved" else None,
        "paged": paged, "recovery_paged": recovered,
    }
    if last.reason is not None:
        out["reason"] = last.reason
    if last.metric is not None:
        out["metric"] = last.metric
    if last.root is not None:
        out["root"] = last.root
    return out


def _lines(run_dir: str | os.PathLike[str]) -> list[Incident]:
    """Every incident line of `{run}/incidents.jsonl`, in file order."""
    tail = _LineTail(Path(run_dir) / INCIDENTS)
    out: list[Incident] = []
    while True:
        before = tail.offset
        out.extend(inc for line in tail.new_lines() if (inc := Incident.from_line(line)))
        if tail.offset == before:  # (read in pieces of a few MB)
            return out


def pages(run_dir: str | os.PathLike[str], limit: int = 200) -> list[dict[str, Any]]:
    """The health pages sent for the run, oldest first (the last `limit`): one per line of
    `incidents.jsonl` that says a page went out, `state` "open" for the incident's page
    and "resolved" for its recovery's."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for inc in _lines(run_dir):
        if _paged(inc) and (inc.id, inc.state) not in out:
            out[(inc.id, inc.state)] = {
                "id": inc.id, "kind": inc.kind, "state": inc.state, "level": inc.level,
                "ranks": list(inc.ranks[:MAX_RANKS]), "ranks_count": len(inc.ranks),
                "step": inc.step, "detail": inc.detail, "time": inc.last_seen}
    return list(out.values())[-max(0, limit):] if limit else []


def _paged(inc: Incident) -> bool:
    """The page of this line's state went out: an opening's, or a resolution's recovery
    (`recovery_delivered`; a resolution written before that key said it by `delivered`)."""
    if inc.state == "open" or inc.recovery_delivered is None:
        return inc.delivered
    return inc.recovery_delivered


def story(run_dir: str | os.PathLike[str], limit: int = 20) -> dict[str, Any]:
    """The incidents of `{run}/incidents.jsonl` ({} when it has none): `incidents`, one
    entry each (open ones first, then by severity, newest first), at most `limit`;
    `count`, `open`, `by_kind` ({kind: n}), `pages` ({"sent": incidents paged,
    "recoveries": recoveries paged}) and `cut` (more incidents than listed)."""
    first: dict[str, Incident] = {}
    last: dict[str, Incident] = {}
    paged: set[str] = set()
    recovered: set[str] = set()
    for inc in _lines(run_dir):
        first.setdefault(inc.id, inc)
        last[inc.id] = inc
        if inc.delivered and inc.recovery_delivered is not None:
            paged.add(inc.id)  # (carried to a resolution: the incident's own page)
        if _paged(inc):
            (paged if inc.state == "open" else recovered).add(inc.id)
    if not last:
        return {}
    entries = [_entry(first[i], inc, i in paged, i in recovered) for i, inc in last.items()]
    entries.sort(key=lambda e: (e["state"] != "open", SEVERITY.get(e["kind"], 9),
                                -(e["first_seen"] or 0.0)))
    by_kind: dict[str, int] = {}
    for e in entries:
        by_kind[e["kind"]] = by_kind.get(e["kind"], 0) + 1
    return {"incidents": entries[:max(0, limit)], "count": len(entries),
            "open": sum(e["state"] == "open" for e in entries), "by_kind": by_kind,
            "pages": {"sent": len(paged), "recoveries": len(recovered)},
            "cut": len(entries) > limit}


def told(e: dict[str, Any]) -> str:
    """One incident of a story in a line: "stall (resolved: run ended; paged, recovery
    paged): job stalled at step 20 ..."."""
    how = [e["state"] if e["state"] == "open" else
           "resolved" + (f": {e['reason']}" if e.get("reason") else "")]
    if e["paged"]:
        how.append("paged")
    if e["recovery_paged"]:
        how.append("recovery paged")
    return f"{e['kind']} ({'; '.join(how)}): {e['detail']}"
