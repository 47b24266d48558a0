"""Incidents: findings turned into things that open once and resolve once (DESIGN 13). Pure.

An incident is one (kind, set of ranks) while it is open. A pass's findings of one kind
are matched to the open incidents of that kind: an incident stays open while any of its
ranks still fires (a rank that joins later opens an incident of its own), and resolves
when none does. New findings of one kind on one host form one incident naming the host.

Two kinds are one incident per fault, with a stable `id` whose later lines change it
without delivering it again: `crashed` (crashes within `crash_window` of the first join
it; `root` names the first) and `stall` (one per stall; its suspects may change).

A hang resolves on what the rank does, not on thresholds: only when each of its ranks has
written again (or is no longer live). So a watcher with other settings (an `expr watch`
beside exprd) never resolves a hang another watcher opened while the rank stays silent.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from expr_tracker.health.detect import Finding
from expr_tracker.health.roots import blames_peer, crash_order, root_of
from expr_tracker.health.roots import first_crash as first_crash  # (re-exported: readers')
from expr_tracker.health.stall import EVIDENCE_RULES
from expr_tracker.health.state import RunState
from expr_tracker.health.why import explain
from expr_tracker.ranks import compact

WHY_KINDS = ("straggler", "slowdown")

# `id`, `kind`, `state` and `delivered` first: a line torn by a watcher killed mid-write
# most likely still names them, and the next watcher recovers the incident (`salvage`)
LINE_KEYS = ("id", "kind", "state", "delivered", "ranks", "level", "hosts", "step",
             "first_seen", "last_seen", "detail")
ENDED = "run ended"
# s that crashes which only blame a peer wait for the peer's own crash before they open an
# incident: its node's exprd marks a process killed -9 crashed a pass or two later, and a
# node that died whole is named lost after 15 s (`lost.lost_nodes`, `daemons.EXPRD_SILENT`)
CRASH_GRACE = 20.0


def new_id() -> str:
    """A stable id for one incident's lines (12 hex digits)."""
    return os.urandom(6).hex()


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
    id: str = field(default_factory=new_id)
    root: dict[str, Any] | None = None  # a crash: the first rank to crash
    reason: str | None = None  # why it resolved, when not its own detector ("run ended")
    # a watcher's claim while its page is on the way: {"by": "host:pid:n", "at": epoch s};
    # others leave the incident to it until the outcome line (or `CLAIM_TTL`)
    paging: dict[str, Any] | None = None
    cause: str | None = None  # a crash that is collateral of another incident (its id)
    collateral: tuple[int, ...] = ()  # a lost node: the other ranks that crashed after it
    by: str | None = None  # the long-running watcher that opened it ("host:pid:n"), its owner
    metric: str | None = None  # a `nonfinite` incident's key: one incident per key and run
    # raised on evidence (a stall whose probes name a culprit, or every rank waiting): paged
    # at once, as a crash or a lost node is; `page_after` holds for the rest (DESIGN 13)
    evidence: bool = False
    # a resolution line: whether its recovery's page went out (`delivered` says the
    # incident's own page did, carried to every later line of it: issue 54); None on an
    # opening, and on resolutions written before this key (their `delivered` said it)
    recovery_delivered: bool | None = None

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """Its kind and its set of ranks: one opening of these per watcher pass."""
        return self.kind, self.ranks

    def as_line(self) -> dict[str, Any]:
        """The `incidents.jsonl` line (DESIGN 13), plus the level."""
        out = {
            "id": self.id, "kind": self.kind, "state": self.state, "delivered": self.delivered,
            "ranks": list(self.ranks), "level": self.level, "hosts": list(self.hosts),
            "step": self.step, "first_seen": self.first_seen, "last_seen": self.last_seen,
            "detail": self.detail,
        }
        if self.why is not None:
            out["why"] = self.why
        if self.root is not None:
            out["root"] = self.root
        if self.reason is not None:
            out["reason"] = self.reason
        if self.paging is not None:
            out["paging"] = self.paging
        if self.cause is not None:
            out["cause"] = self.cause
        if self.collateral:
            out["collateral"] = list(self.collateral)
        if self.by is not None:
            out["by"] = self.by
        if self.metric is not None:
            out["metric"] = self.metric
        if self.evidence:
            out["evidence"] = True
        if self.recovery_delivered is not None:
            out["recovery_delivered"] = self.recovery_delivered
        return out

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
        first = _time(line.get("first_seen"))
        ident = line.get("id")
        if not isinstance(ident, str) or not ident:  # a line of an older watcher
            ident = f"{kind}:{','.join(map(str, sorted(ranks)))}:{first:.3f}"
        root = line.get("root")
        reason = line.get("reason")
        paging = line.get("paging")
        if not (isinstance(paging, Mapping) and isinstance(paging.get("by"), str)
                and _time(paging.get("at")) > 0):
            paging = None
        cause = line.get("cause")
        coll = line.get("collateral")
        coll = coll if isinstance(coll, list) and all(type(r) is int for r in coll) else []
        return cls(
            kind=kind, ranks=tuple(sorted(ranks)), hosts=tuple(str(h) for h in hosts),
            step=step if type(step) is int else None,
            first_seen=first, last_seen=_time(line.get("last_seen")),
            detail=str(line.get("detail") or ""), state=state,
            delivered=bool(line.get("delivered")), level=str(line.get("level") or "warning"),
            why=line["why"] if isinstance(line.get("why"), str) else None,
            id=ident, root=dict(root) if isinstance(root, Mapping) else None,
            reason=reason if isinstance(reason, str) else None,
            paging={"by": paging["by"], "at": _time(paging["at"])} if paging else None,
            cause=cause if isinstance(cause, str) else None, collateral=tuple(sorted(coll)),
            by=line["by"] if isinstance(line.get("by"), str) else None,
            metric=line["metric"] if isinstance(line.get("metric"), str) else None,
            evidence=line.get("evidence") is True,
            recovery_delivered=rd if isinstance(rd := line.get("recovery_delivered"), bool)
            else None,
        )


def _time(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


@dataclass
class Plan:
    """What a pass changes: incidents to open, to resolve, to update (a line of the same
    `id`, not delivered again: a crash's ranks grow, a stall's suspects change), and those
    still open (updated in memory only)."""

    opened: list[Incident]
    resolved: list[Incident]
    still_open: list[Incident]
    updated: list[Incident] = field(default_factory=list)


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


def _crash_detail(root: Mapping[str, Any], ranks: tuple[int, ...], first: str) -> str:
    others = [r for r in ranks if r != root.get("rank")]
    if not others:
        return first
    return (f"{first}; then {len(others)} more rank{'s' if len(others) != 1 else ''} "
            f"crashed: {compact(others)}")


def _waits_for_root(new: list[Finding], grown: Mapping[str, Incident], now: float,
                    grace: float) -> bool:
    """Every new crash blames a peer (its transport failed) and none is older than `grace`,
    with no open crash to join: the peer's own crash is likely on its way (through its
    node's exprd, which sees its process gone a pass later; through a cache later still),
    and an incident opened now would name a collateral rank its root, and page it."""
    if grown or not new:
        return False
    infos = [f.info or {} for f in new]
    seen = [float(at) for i in infos if isinstance(at := i.get("at"), (int, float))]
    return all(blames_peer(i) for i in infos) and all(now - at < grace for at in seen)


def _root_at(inc: Incident, offset: float) -> float:
    """When `inc`'s root crashed, on this watcher's clock: its own note (`extra`), else the
    line's `seen` (the filesystem's clock, `offset` ahead of ours) moved onto ours. Not the
    line's `first_seen`: that is the clock of whichever watcher opened it (exprd's, or a
    login node's an hour ahead), never compared with ours (DESIGN 13 Clocks)."""
    if "at" in inc.extra:
        return float(inc.extra["at"])
    seen = (inc.root or {}).get("seen")
    if isinstance(seen, (int, float)) and not isinstance(seen, bool):
        return float(seen) - offset
    return inc.first_seen  # (a line of an older watcher)


def _seen(info: Mapping[str, Any], at: float, offset: float) -> dict[str, Any]:
    """A root for a line: `seen`, when its crash was seen, on the filesystem's clock."""
    return {**root_of(info), "seen": round(at + offset, 3)}


def _rooted(inc: Incident, info: Mapping[str, Any], offset: float) -> Incident:
    """`inc` with `info` its root when `info` comes first by the crash order (a rank killed
    by a signal seen after the peers whose transport it broke): a line of the same id
    corrects the root, so every reader names the same one."""
    old = {**(inc.root or {}), "at": _root_at(inc, offset)}
    if inc.root is None or crash_order([old, info])[0] is old:
        return inc
    at = info.get("at")
    upd = replace(inc, root=_seen(info, float(at) if at is not None else inc.first_seen, offset))
    upd.extra = {**inc.extra, "at": float(at) if at is not None else inc.first_seen,
                 "first": info.get("detail") or inc.extra.get("first")}
    return upd


def _crashes(open_crashes: list[Incident], found: list[Finding], now: float, window: float,
             out: Plan, grace: float = 0.0, offset: float = 0.0) -> None:
    """One `crashed` incident per fault: crashes within `window` seconds of the first join
    its incident (a line of the same id, not delivered again). Crashes that only blame a
    peer wait up to `grace` seconds for the peer's (`_waits_for_root`). `offset`: the
    filesystem's clock minus ours (`_root_at`)."""
    mine = {r for inc in open_crashes for r in inc.ranks}
    still = {r for f in found for r in f.ranks}
    grown: dict[str, Incident] = {}
    for inc in open_crashes:
        if not still & set(inc.ranks):  # its ranks run again (a new session)
            out.resolved.append(replace(inc, state="resolved", last_seen=now, delivered=False))
        else:
            grown[inc.id] = replace(inc, last_seen=now)
    new = [f for f in found if f.ranks[0] not in mine]
    if _waits_for_root(new, grown, now, grace):
        new = []
    infos = {f.ranks[0]: f for f in new}
    for info in crash_order([{**(f.info or {"rank": f.ranks[0]}), "detail": f.detail}
                              for f in new]):
        f = infos[int(info["rank"])]
        seen = info.get("at")
        at = float(seen) if seen is not None else now
        host = (f.host,) if f.host else ()
        # the incident whose root crashed at most `window` before (on our clock)
        home = next((inc for inc in grown.values() if inc.root is not None
                     and at - _root_at(inc, offset) <= window), None)
        if home is None:
            inc = Incident(kind="crashed", ranks=f.ranks, hosts=host, step=f.step, first_seen=now,
                           last_seen=now, detail=f.detail, level=f.level,
                           root=_seen(info, at, offset))
            inc.extra["at"] = at
            inc.extra["first"] = f.detail
            grown[inc.id] = inc
            out.opened.append(inc)
            continue
        ranks = tuple(sorted({*home.ranks, *f.ranks}))
        first = home.extra.get("first") or home.detail.split("; then ")[0]
        home.extra = {**home.extra, "first": first}
        home = _rooted(home, info, offset)
        first = home.extra["first"]
        upd = replace(home, ranks=ranks, hosts=tuple(sorted({*home.hosts, *host})),
                      detail=_crash_detail(home.root or {}, ranks, first), last_seen=now)
        upd.extra = dict(home.extra)
        grown[home.id] = upd
        if any(o.id == home.id for o in out.opened):
            out.opened = [upd if o.id == home.id else o for o in out.opened]
        else:
            out.updated = [u for u in out.updated if u.id != home.id] + [upd]
    out.still_open.extend(inc for inc in grown.values()
                          if not any(inc.id == x.id for x in (*out.opened, *out.updated)))


def _still_stalled(inc: Incident, state: RunState | None) -> bool:
    """No live rank advanced since the stall incident opened (a watcher with other
    thresholds, `expr top`, keeps another's stall open until the job moves)."""
    if state is None or not state.live:
        return False
    return all((rs.advanced or 0.0) <= inc.first_seen for rs in state.live)


def _still_quiet(inc: Incident, state: RunState | None) -> bool:
    """No live rank wrote since the job-wide silence opened (a reader with other
    thresholds keeps another's silence open until the job writes again)."""
    if state is None or not state.live:
        return False
    return all((rs.wrote_at or 0.0) <= inc.first_seen for rs in state.live)


def _stall(open_stalls: list[Incident], found: list[Finding], now: float, out: Plan,
           state: RunState | None, kind: str = "stall") -> None:
    """One `stall` (or job-wide `silent`) incident per job: while it lasts the same
    incident names the ranks of each pass (a line of the same id when they change: a rank
    that crashed meanwhile leaves a silence, which says so, and is paged once)."""
    f = found[0] if found else None
    still = _still_stalled if kind == "stall" else _still_quiet
    for i, inc in enumerate(open_stalls):
        if f is None and i == 0 and still(inc, state):
            out.still_open.append(replace(inc, last_seen=now))
        elif f is None or i > 0:
            out.resolved.append(replace(inc, state="resolved", last_seen=now, delivered=False))
        elif inc.ranks != f.ranks:
            out.updated.append(replace(inc, ranks=f.ranks, hosts=(f.host,) if f.host else (),
                                       detail=f.detail, step=f.step, last_seen=now))
        else:
            out.still_open.append(replace(inc, detail=f.detail, step=f.step, last_seen=now))
    if f is not None and not open_stalls:
        inc = _merge(kind, [f], now)
        inc.evidence = (f.info or {}).get("rule") in EVIDENCE_RULES
        out.opened.append(inc)


def _nonfinite(open_nf: list[Incident], found: list[Finding], now: float, out: Plan) -> None:
    """One `nonfinite` incident per key: it stays open (a fact, not a state) and names the
    ranks the notes add (a line of the same id, not delivered again)."""
    by_key = {str(f.info["key"]): f for f in found if f.info is not None}
    for inc in open_nf:
        f = by_key.pop(inc.metric or "", None)
        if f is not None and f.ranks != inc.ranks:
            out.updated.append(replace(inc, ranks=f.ranks, detail=f.detail, last_seen=now))
        else:
            out.still_open.append(replace(inc, last_seen=now))
    for key, f in by_key.items():
        inc = _merge("nonfinite", [f], now)
        inc.metric = key
        out.opened.append(inc)


def _stopped(inc: Incident, state: RunState | None) -> str | None:
    """Why an incident resolves when its ranks stopped rather than recovered: a straggler
    whose rank crashed is no longer slow, but saying only "resolved" would read as if it
    caught up ("rank crashed", "ranks finished"; None while any of them runs)."""
    if state is None or not inc.ranks:
        return None
    statuses = {rs.status if (rs := state.ranks.get(r)) is not None else "running"
                for r in inc.ranks}
    if "running" in statuses:
        return None
    what = statuses.pop() if len(statuses) == 1 else "ended"
    if what == "corrupt":  # (its sidecar does not parse: stopped, how is not known)
        what = "stopped"
    return f"rank{'s' if len(inc.ranks) > 1 else ''} {what}"


def plan(open_incidents: Iterable[Incident], findings: Iterable[Finding], now: float,
         state: RunState | None = None, *, crash_window: float = 60.0,
         ended: bool = False, cache: float = 0.0) -> Plan:
    """Match this pass's findings to the open incidents (see the module docstring).
    `state`, the pass's reading of the run, lets a hang resolve only on a new write.
    `ended`: the run is over, every open incident but a crash resolves ("run ended").
    `cache`: the filesystem's attribute cache (`HealthConfig.fs_cache`): a peer's crash
    may show that much later, and collateral crashes wait for it that much longer."""
    by_kind: dict[str, list[Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.kind, []).append(f)
    out = Plan([], [], [])
    incs = list(open_incidents)
    _crashes([i for i in incs if i.kind == "crashed"], by_kind.pop("crashed", []), now,
             crash_window, out, CRASH_GRACE + cache, state.fs_offset if state is not None else 0.0)
    if ended:
        out.resolved.extend(replace(inc, state="resolved", last_seen=now, delivered=False,
                                    reason=ENDED) for inc in incs if inc.kind != "crashed")
        return out
    _stall([i for i in incs if i.kind == "stall"], by_kind.pop("stall", []), now, out, state)
    _stall([i for i in incs if i.kind == "silent"], by_kind.pop("silent", []), now, out, state,
           "silent")
    _nonfinite([i for i in incs if i.kind == "nonfinite"], by_kind.pop("nonfinite", []), now, out)
    lost_found = {f.ranks: f for f in by_kind.get("lost", ())}
    taken: set[tuple[str, int]] = set()
    for inc in incs:
        if inc.kind in ("crashed", "stall", "silent", "nonfinite"):
            continue
        firing = {r for f in by_kind.get(inc.kind, ()) for r in f.ranks}
        if firing & set(inc.ranks):
            hits = [f for f in by_kind[inc.kind] if set(f.ranks) & set(inc.ranks)]
            steps = [f.step for f in hits if f.step is not None]
            out.still_open.append(replace(inc, last_seen=now, step=max(steps) if steps else inc.step))
            taken.update((inc.kind, r) for r in inc.ranks)
        elif _still_silent(inc, state):
            out.still_open.append(replace(inc, last_seen=now))
            taken.update((inc.kind, r) for r in inc.ranks)
        else:
            out.resolved.append(replace(inc, state="resolved", last_seen=now, delivered=False,
                                        reason=_stopped(inc, state)))
    for kind, group in by_kind.items():
        fresh: dict[Any, list[Finding]] = {}
        for f in group:
            left = tuple(r for r in f.ranks if (kind, r) not in taken)
            if not left or f.hold:
                continue
            f = replace(f, ranks=left) if left != f.ranks else f
            gkey: Any = ("host", f.host) if f.group and f.host else ("one", id(f))
            fresh.setdefault(gkey, []).append(f)
        for members in fresh.values():
            out.opened.append(_with_why(_merge(kind, members, now), state))
    _join_collateral(out, lost_found)
    return out


def _join_collateral(out: Plan, lost: Mapping[tuple[int, ...], Finding]) -> None:
    """A crash whose ranks blame a peer, while a node is lost, is collateral of the lost
    node: the crash incident names it (`cause`, a line of the same id) and the lost
    node's incident names those ranks (`collateral`, a line of its id when they grow)."""
    if not any(i.kind == "lost" for i in (*out.opened, *out.updated, *out.still_open)):
        return
    moved: list[Incident] = []

    def node_of(inc: Incident) -> Incident:
        f = lost.get(inc.ranks)
        coll = tuple(f.info.get("collateral", ())) if f is not None and f.info else ()
        grown = tuple(sorted({*inc.collateral, *coll}))
        return inc if grown == inc.collateral else replace(inc, collateral=grown)

    out.opened = [node_of(i) if i.kind == "lost" else i for i in out.opened]
    out.updated = [node_of(i) if i.kind == "lost" else i for i in out.updated]
    still: list[Incident] = []
    for inc in out.still_open:
        upd = node_of(inc) if inc.kind == "lost" else inc
        (moved if upd is not inc else still).append(upd)
    nodes = [i for i in (*out.opened, *out.updated, *moved, *still) if i.kind == "lost"]

    def joined(inc: Incident) -> Incident:
        if inc.kind != "crashed" or inc.cause is not None:
            return inc
        root = inc.root.get("rank") if inc.root is not None else None
        home = next((n for n in nodes if set(inc.ranks) <= set(n.collateral)
                     or root in n.collateral), None)
        if home is None:
            return inc
        host = home.hosts[0] if home.hosts else "a node"
        return replace(inc, cause=home.id, detail=f"{inc.detail} (collateral: {host} lost)")

    out.opened = [joined(i) for i in out.opened]
    out.updated = [joined(i) for i in out.updated]
    rest: list[Incident] = []
    for inc in still:
        upd = joined(inc)
        if upd is inc:
            rest.append(inc)
        else:
            moved.append(upd)
    out.still_open = rest
    out.updated.extend(moved)  # lines of their ids: not delivered again
