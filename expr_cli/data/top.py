"""`expr top`'s answer: every rank's state and the run's incidents, worst first (DESIGN 13,
14), as the dict `expr top --once --json` prints and `expr serve` returns.

Read-only: the detectors run in memory on every frame (so the view is live even with no
watcher), merged with the open incidents a watcher recorded in `incidents.jsonl`.
"""

from __future__ import annotations

from bisect import bisect_left
from statistics import median
from typing import Any

from expr_cli.resolve import RunRef

from . import brief, now

_SEVERITY = {"lost": 0, "crashed": 0, "stall": 1, "silent": 1, "hang": 2, "missing": 3,
             "alert": 4, "nonfinite": 4, "straggler": 5, "slowdown": 6, "behind": 7,
             "exprd": 8}
# rows of ranks and of nodes `--json` prints (the worst first; `counts` tells them all): a
# screenful, never 16,384 rows (6.5 MB)
JSON_ROWS = 100
NO_STEP_AFTER = 5.0  # s without a new step (and 3 step periods) that the job line names
RATE_GRACE = 2.0  # seconds of silence that are the flush lag, not a slower rank
# ... for a rank in spool mode: its rows reach the shard when exprd applies them, woken by
# inotify or, where no event comes (an earlier SDK's memory-mapped segments, a spool on a
# filesystem without inotify), on its rescan every 5 s by default: its shard can be that
# old between two applies while the rank steps on
SPOOL_RATE_GRACE = 12.0
RATE_HORIZON = 2.0  # a live rank's steps/s counts the steps of the last this many seconds ...
RATE_PERIODS = 4  # ... or of this many of its step periods, if longer


def age_now(t: float | None) -> float | None:
    """Seconds since `t` (relative to `$EXPR_NOW` in tests)."""
    return None if t is None else max(0.0, now() - t)


def steps_per_s(rs: Any, now: float) -> float | None:
    """A rank's steps/s up to now: over its recent step rows, and for a live rank over
    the last max(RATE_HORIZON, RATE_PERIODS periods) up to `now` (the reader's clock),
    so that it falls to 0 while the rank is silent (a stall) instead of showing the rate
    of its last rows; silence within the writer's lag (exprd's, for a rank in spool mode)
    is not counted. Its rows' `_time`s are only compared with each other (its clock);
    its silence is measured on ours."""
    steps, times = rs.steps, rs.times
    if len(steps) < 2:
        return None
    s0, t0, s1, t1 = steps[0], times[0], steps[-1], times[-1]
    if t1 <= t0 or s1 <= s0:
        return None
    if not rs.live or rs.last_write is None:
        return (s1 - s0) / (t1 - t0)
    # within the writer's lag, the rate of the rows' own times up to the last one; past
    # it, the silence beyond the lag counts (`now` on the rank's clock)
    grace = SPOOL_RATE_GRACE if rs.spooled else RATE_GRACE
    end = t1 + max(0.0, now - rs.last_write - grace)
    start = max(t0, end - max(RATE_HORIZON, RATE_PERIODS * (t1 - t0) / (s1 - s0)))
    if start >= t1:
        return 0.0
    i = bisect_left(times, start)
    return (s1 - steps[i]) / (end - times[i]) if end > times[i] else None


def job_line(state: Any, findings: list[Any], incidents: list[Any], rows: list[dict[str, Any]],
             now: float) -> dict[str, Any]:
    """The whole job in one line: stalled (and the suspects), crashed (and which rank
    failed first), finished, or running at its median steps/s."""
    from expr_tracker.health.incidents import first_crash
    from expr_tracker.health.stall import fmt_quiet
    from expr_tracker.ranks import compact

    node = next((i for i in incidents if i.kind == "lost"), None)
    if node is not None:  # (the crashes it explains name it their root, `first_crash`)
        first = first_crash(state, incidents)
        return {"state": "lost", "lost": list(node.ranks), "text": node.detail,
                **({"first_crash": first} if first is not None else {})}
    silent = next((i for i in incidents if i.kind == "silent" and i.state == "open"), None)
    if silent is not None:  # the scheduler killed the job: said once, with the crash before
        first = first_crash(state, incidents)
        why = ": ".join(str(x) for x in (first.get("type"), first.get("message")) if x) \
            if first else ""
        text = silent.detail.split("; ")[0] + (
            f"; rank {first['rank']} crashed first" + (f" ({why})" if why else "")
            if first else "")
        return {"state": "silent", "silent": len(silent.ranks), "first_crash": first,
                "text": text}
    stall = next((f.info for f in findings if f.kind == "stall" and f.info), None)
    if stall is not None and stall.get("rule") == "all wait":
        return {"state": "stalled", "suspects": [], "text":
                f"stalled {fmt_quiet(stall['quiet'])} at step {stall['step']}; "
                + stall["detail"].split(": ", 1)[-1]}
    if stall is not None:
        ranks = stall["ranks"]
        return {"state": "stalled", "suspects": list(ranks), "text":
                f"stalled {fmt_quiet(stall['quiet'])} at step {stall['step']}; suspect "
                f"rank{'s' if len(ranks) != 1 else ''} {compact(ranks)} {stall['where']}"}
    recorded = next((i for i in incidents if i.kind == "stall"), None)
    if recorded is not None:  # a watcher's (its thresholds), and no rank advanced since
        newest = max([t for rs in state.live if (t := rs.advanced) is not None], default=now)
        why = recorded.detail.split(": ", 1)[-1].split("; ")[0]
        return {"state": "stalled", "suspects": list(recorded.ranks), "text":
                f"stalled {fmt_quiet(now - newest)} at step {recorded.step}; suspect {why}"}
    first = first_crash(state, incidents) if any(r["status"] == "crashed" for r in rows) else None
    if first is not None:
        n = sum(r["status"] == "crashed" for r in rows)
        why = ": ".join(str(x) for x in (first.get("type"), first.get("message")) if x)
        return {"state": "crashed", "first_crash": first, "text":
                f"crashed: rank {first['rank']} failed first" + (f" ({why})" if why else "")
                + (f"; {n} ranks crashed" if n > 1 else "")}
    if rows and not state.live:
        return {"state": "finished", "text": "finished: every rank is done"}
    rates = [r["steps_per_s"] for r in rows if r["status"] == "running" and r["steps_per_s"] is not None]
    text = f"running at {median(rates):.3g} steps/s (median rank)" if rates else "running"
    out: dict[str, Any] = {"state": "running", "text": text}
    quiet = [r["no_step_for"] for r in rows if r["status"] == "running" and r["no_step_for"] is not None]
    fresh = [a for rs in state.live if (a := age_now(rs.wrote_at)) is not None]  # (sidecars too)
    if quiet and fresh:
        # no live rank took a step for this long while their files are written (probes,
        # system samples): said before any incident opens
        since = min(quiet)
        periods = [rs.times[-1] - rs.times[-2] for rs in state.live if len(rs.times) >= 2]
        if since >= max(NO_STEP_AFTER, 3 * (median(periods) if periods else 0.0)) \
                and since - min(fresh) >= NO_STEP_AFTER:
            out["no_step_for"] = since
            out["text"] = f"running, no step for {fmt_quiet(since)}" + (
                f" ({median(rates):.3g} steps/s, median rank)" if rates else "")
    return out


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

    def __init__(self, ref: RunRef, stream: str | None, metric: str | None, cfg: Any,
                 record: bool = False) -> None:
        """`record`: this view is a long-running watcher's (`expr serve`), which records
        the stalls it finds (`_record`)."""
        from expr_tracker.health.detect import Memory
        from expr_tracker.health.watch import IncidentLog, Watcher

        self.ref = ref
        self.metric = metric
        self.record = record
        self.recorded: set[str] = set()  # ids of the open stalls this view recorded
        self.record_errors = 0
        watcher = Watcher(ref.path, cfg, None, stream=stream, owner=False)
        self.reader = watcher.reader
        self.cfg = watcher.cfg  # (`fs_cache` resolved)
        self.memory = Memory()
        self.log = IncidentLog(ref.path)
        # files not seen change yet are dated by their mtimes on the filesystem's clock,
        # as `expr watch` does (issue 54: a login node an hour ahead read a healthy job
        # as "stalled 60m")
        from expr_tracker.health.clock import dir_fs_offset

        self.reader.fs_offset = dir_fs_offset(ref.path) or 0.0

    def __call__(self, state: Any = None) -> dict[str, Any]:
        """One frame; `state`: this pass's live state when the caller read it already
        (from `self.reader`). No cyclic collections meanwhile (`gcpause`)."""
        from expr_tracker.gcpause import paused_gc

        with paused_gc():
            return self._frame(state)

    def _frame(self, state: Any) -> dict[str, Any]:
        from expr_tracker.health.detect import detect, ended
        from expr_tracker.health.incidents import first_crash, plan
        from expr_tracker.health.story import story

        wall = self.reader.clock()
        if state is None:
            state = self.reader.read(wall)
        self.log.sync()
        findings = detect(state, [], self.cfg, self.memory, wall)
        p = plan(self.log.open.values(), findings, wall, state, crash_window=self.cfg.crash_window,
                 ended=ended(state), cache=self.cfg.fs_cache or 0.0)
        # every open incident of incidents.jsonl, whoever recorded it (a watcher with other
        # thresholds, or evidence this frame lacks: its line stands until a watcher
        # resolves it), with this frame's news of it; then what only this frame finds
        if self.record:
            self._record(p)
        shown = dict(self.log.open)
        for inc in (*p.still_open, *p.updated):
            if inc.id in shown:
                shown[inc.id] = inc
        incidents = sorted([*shown.values(), *(i for i in p.opened if i.id not in shown)],
                           key=lambda i: (_SEVERITY.get(i.kind, 9), i.ranks))
        lost = {r for i in incidents if i.kind == "lost" for r in i.ranks}
        silent = {r for i in incidents if i.kind == "silent" for r in i.ranks}
        worst: dict[int, int] = {}
        for inc in incidents:
            for r in inc.ranks:
                worst[r] = min(worst.get(r, 9), _SEVERITY.get(inc.kind, 9))
        rows = []
        for rs in state.ranks.values():
            rows.append({
                "rank": rs.rank, "host": rs.host, "step": rs.last_step,
                "status": ("lost" if rs.rank in lost else "silent" if rs.rank in silent
                           else rs.status) if rs.live else rs.status,
                "behind": state.behind(rs.rank), "steps_per_s": steps_per_s(rs, wall),
                "last_write_age": age_now(rs.last_write), "pid": rs.pid, "dropped": rs.dropped,
                # rows, not probes or system samples (they keep the files fresh)
                "no_step_for": age_now(rs.advanced) if rs.live else None,
                "incident": min((k for k, v in _SEVERITY.items() if v == worst.get(rs.rank)), default=None),
                **({"metric": _metric(state, rs, self.metric)} if self.metric else {}),
            })
        rows = _shared_rows(rows, state)
        # the rank that failed first (the crash's root) leads the crashed ones
        root = (first_crash(state, incidents) or {}).get("rank") if any(
            rs.status == "crashed" for rs in state.ranks.values()) else None
        rows.sort(key=lambda r: (worst.get(r["rank"], 9), r["rank"] != root, r["status"] == "finished",
                                 -(r["behind"] or 0), r["steps_per_s"] or 0.0, r["rank"]))
        frontier, lead = state.frontier, state.lead
        if any("file_rank" in r for r in rows):  # a shared file's ranks: by their rows
            steps = [r["step"] for r in rows if r["status"] == "running" and r["step"] is not None]
            frontier, lead = (min(steps), max(steps)) if steps else (frontier, lead)
        return {
            "run": self.ref.label, "frontier": frontier, "lead": lead,
            # a lost node's or a job-wide silence's ranks are not live (as in their rows)
            "live": sum(r["status"] == "running" for r in rows), "world_size": state.world_size,
            "metric": self.metric,
            "job": job_line(state, findings, incidents, rows, wall),
            "ranks": rows, "nodes": _nodes(rows, state),
            "incidents": [i.as_line() for i in incidents],
            "counts": _counts(rows),
            # a run that is over keeps its story: every incident it had, the pages sent
            "story": story(self.ref.path) if state.ranks and not state.live else {},
        }

    def _record(self, p: Any) -> None:
        """A long-running watcher records what it finds (DESIGN 13): a stall this view
        finds that no watcher recorded (none runs, as in direct mode without exprd, or it
        started after the stall began) goes to incidents.jsonl once, undelivered (a
        watcher with channels delivers it), and its resolution when the job goes on. Only
        stalls: the other kinds are the watchers' own (their thresholds). A write that
        fails (a read-only root) is counted, never raised."""
        opened = [i for i in p.opened if i.kind == "stall"]
        resolved = [i for i in p.resolved if i.kind == "stall" and i.id in self.recorded]
        if not opened and not resolved:
            return
        try:  # (an opening already open, another watcher's, is not written again)
            done = self.log.record([*resolved, *opened], None)
        except OSError:
            self.record_errors += 1
            return
        self.recorded.update(i.id for i in done if i.state == "open")
        self.recorded.difference_update(i.id for i in done if i.state == "resolved")


# a shared file's tail read for the last step of each rank it holds: at most this many
# records (newest first), fewer once every rank of its world size was seen
SHARED_RECORDS = 200_000


def shared_steps(rs: Any) -> dict[int, tuple[int, float | None]]:
    """A shared `rank_aware=False` file (every rank appends to the rank-0 name, its step
    rows carry `_rank`): by `_rank`, the last step of its rows and that row's `_time`,
    from the file's tail; {} for a file of one rank."""
    from expr_tracker.store.reader import ShardReader

    last = rs.last_row
    if not isinstance(last, dict) or type(last.get("_rank")) is not int:
        return {}
    out: dict[int, tuple[int, float | None]] = {}
    want = rs.world_size or 0
    try:
        for n, rec in enumerate(ShardReader(rs.path).iter_reverse()):
            r, step = rec.get("_rank"), rec.get("_step")
            if rec.get("_kind") is None and type(r) is int and type(step) is int and r not in out:
                t = rec.get("_time")
                out[r] = (step, float(t) if isinstance(t, (int, float)) else None)
                if want and len(out) >= want:
                    break
            if n >= SHARED_RECORDS:
                break
    except OSError:
        return {}
    return out if len(out) > 1 else {}


def _shared_rows(rows: list[dict[str, Any]], state: Any) -> list[dict[str, Any]]:
    """Each row of a shared file (issue 54: shown as one rank) as a row per rank it holds:
    its last step, the file's status and write age; `file_rank` names the file's rank."""
    out = []
    for row in rows:
        rs = state.ranks.get(row["rank"])
        held = shared_steps(rs) if rs is not None and rs.live else {}
        if not held:
            out.append(row)
            continue
        lead = max(step for step, _ in held.values())
        for r, (step, _) in sorted(held.items()):
            mine = r == row["rank"]
            # (no steps/s: the file's rows interleave its ranks' steps; the hosts of the
            # other ranks are not in the file)
            out.append({**row, "rank": r, "step": step, "behind": lead - step,
                        "host": row["host"] if mine else None, "pid": row["pid"] if mine else None,
                        "steps_per_s": None, "file_rank": row["rank"]})
    return out


def _counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """How many ranks have each status and each (worst) incident kind: what a screenful
    of the worst rows leaves out is still counted."""
    status: dict[str, int] = {}
    incident: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
        if (k := r["incident"]) is not None:
            incident[k] = incident.get(k, 0) + 1
    return {"status": status, "incident": incident}


def screenful(frame: dict[str, Any], limit: int = JSON_ROWS) -> dict[str, Any]:
    """`frame` with its worst `limit` ranks and nodes (rows are worst first), and how many
    there are (`ranks_total`, `nodes_total`; `counts` tells the statuses of them all); its
    incidents `brief`."""
    out = {**frame, "ranks_total": len(frame["ranks"]), "nodes_total": len(frame["nodes"]),
           "ranks": frame["ranks"][:limit], "nodes": frame["nodes"][:limit],
           "incidents": [brief(i, limit) for i in frame["incidents"]]}
    if "history" in frame:
        out["history"] = [brief(i, limit) for i in frame["history"]]
    return out




def _nodes(rows: list[dict[str, Any]], state: Any) -> list[dict[str, Any]]:
    """Per node (host, else rank // local_world_size), worst first."""
    order = {"crashed": 0, "running": 1, "finished": 2}
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        rs = state.ranks[r.get("file_rank", r["rank"])]
        node = (r["host"] if "file_rank" in r else rs.host) or (f"node{r['rank'] // rs.local_world_size}" if rs.local_world_size else "?")
        by.setdefault(node, []).append(r)
    out = []
    for node, members in by.items():
        steps = [m["step"] for m in members if m["step"] is not None]
        rates = [m["steps_per_s"] for m in members if m["steps_per_s"] is not None]
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


