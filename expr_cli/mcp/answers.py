"""What the tools of `expr mcp` about runs and their state answer, as plain data (DESIGN
20); `steps` answers those about a metric over steps.

The numbers come from the functions behind the CLI's `--json`: `data.runs` (`expr runs`),
`data.summary` (`expr summary`), `data.top` (`expr top`: the detectors, the job's line,
the incidents), over the live state `expr serve` keeps per
run (`web.live`: a second question about a run of 16,384 ranks costs a pass, not a read).
Each answer adds `covers` (ranks reporting of the world size, the ranks missing, the
steps) and says whether it was cut (`fit`).

A run is named `project/name` or by a bare name; it resolves only under the run root,
its directories opened without following symlinks and refused when its directory holds
one (`web.paths`). Bad arguments raise `BadArgument` naming the argument; a run that is
not there raises `NoRun` with the nearest names.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from statistics import median
from typing import Any

from expr_cli.data import RANKS_TEXT, brief, jsonable, now
from expr_cli.data.runs import runs_data, runs_json
from expr_cli.data.summary import summary_data
from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, compact_ranks, list_runs, near_runs, parse_metrics
from expr_cli.web.api import RUNS_TTL
from expr_cli.web.live import LiveRuns, incident_lines
from expr_cli.web.paths import BadRequest, NotFound, inside, no_links, run_ref
from expr_tracker.store.layout import validate_stream

from .fit import Caps

NAMED = 16  # ranks named one by one (probes, per-rank crossings); the rest are counted
PAST = 20  # resolved incidents listed
# seconds a run's top frame is kept while its files do not change: the time-based detectors
# (hang, stall) see the silence grow between calls (a page's TOP_TTL is 10 s)
FRAME_TTL = 1.0
_BAD = {"crashed": 0, "lost": 0, "stall": 1, "silent": 1, "hang": 1, "missing": 2, "straggler": 3, "slowdown": 3,
        "behind": 4, "alert": 4}
_STATUS = {"crashed": 0, "lost": 0, "stale": 1, "silent": 1, "running": 2, "finished": 3}


def _brief(told: dict[str, Any]) -> dict[str, Any] | None:
    """A run's story (`health.story`) for `list_runs`: counts, and its incidents in a line
    each (None when no watcher recorded any)."""
    if not told:
        return None
    return {"incidents": told["count"], "open": told["open"], "by_kind": told["by_kind"],
            "pages": told["pages"],
            "told": [{"kind": e["kind"], "state": e["state"], "step": e["step"],
                      "ranks": _listed(e)["ranks"], "detail": e["detail"],
                      "paged": e["paged"], "recovery_paged": e["recovery_paged"],
                      **({"reason": e["reason"]} if e.get("reason") else {})}
                     for e in told["incidents"]]}


class BadArgument(ValueError):
    """A tool argument the tool cannot take; the message starts with the argument's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")


class NoRun(LookupError):
    """No such run under the run root (the message lists the nearest names)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"run: {message}")


def _number(v: Any) -> float | None:
    if v.__class__ in (int, float) and math.isfinite(v):
        return float(v)
    return None


def _ratio(x: float | None, med: float | None) -> float | None:
    return None if x is None or not med else round(x / med, 4)


def steps_arg(text: str | None) -> tuple[int | None, int | None] | None:
    from expr_cli.resolve import parse_step_range

    try:
        return parse_step_range(text)
    except CLIError as exc:
        raise BadArgument("steps", exc.message) from None


def _listed(line: dict[str, Any]) -> dict[str, Any]:
    """An open incident in `list_runs`: its ranks as ranges, cut as `brief` cuts them (a
    silence of 10,923 ranks with gaps was 58 KB: the whole answer cut, no run listed)."""
    ranks = line.get("ranks") or []
    text = compact_ranks(ranks)
    out = {"kind": line.get("kind"), "ranks": text, "step": line.get("step"),
           "detail": line.get("detail")}
    if len(text) > RANKS_TEXT:
        out.update(ranks=text[:RANKS_TEXT].rpartition(",")[0] + ",...", rank_count=len(ranks))
    return out


class Answers:
    """The tools' answers over one run root."""

    def __init__(self, root: Path, caps: Caps, cfg: Any) -> None:
        self.root = root
        self.caps = caps
        self.cfg = cfg
        self.lives = LiveRuns(cfg)
        self._runs: tuple[float, list[dict[str, Any]]] | None = None

    # -- runs ---------------------------------------------------------------------

    def _labels(self) -> list[str]:
        return [r.label for r in list_runs(self.root) if inside(self.root, r.path)]

    def _no_run(self, text: str) -> NoRun:
        labels = self._labels()
        if not labels:
            return NoRun(f"no run {text!r}: the run root has no runs")
        near = near_runs(text, labels, 5, 0.5)
        if near:
            return NoRun(f"no run {text!r} under the run root; near names: {', '.join(near)}")
        shown = ", ".join(labels[:8]) + (f" and {len(labels) - 8} more" if len(labels) > 8 else "")
        return NoRun(f"no run {text!r} under the run root; runs there: {shown}")

    def run(self, text: Any) -> RunRef:
        """`project/name` or a bare run name -> the run under the root."""
        if not isinstance(text, str) or not text.strip("/ "):
            raise BadArgument("run", "give a run as project/name or a run name (see list_runs)")
        text = text.strip().strip("/")
        parts = text.split("/")
        if len(parts) > 2:
            raise BadArgument("run", f"a run is project/name, got {text!r}")
        if len(parts) == 2:
            project, name = parts
        else:
            hits = [label for label in self._labels() if label.split("/", 1)[1] == text]
            if len(hits) > 1:
                raise BadArgument("run", f"the name {text!r} is ambiguous: {', '.join(hits)}; "
                                         "give project/name")
            if not hits:
                raise self._no_run(text)
            project, name = hits[0].split("/", 1)
        try:
            ref = run_ref(self.root, project, name)
            no_links(ref)
        except BadRequest as exc:
            raise BadArgument("run", str(exc)) from None
        except NotFound as exc:
            if "symlink" in str(exc):
                raise NoRun(str(exc)) from None
            raise self._no_run(text) from None
        return ref

    @staticmethod
    def stream_arg(stream: Any) -> str | None:
        if stream is None or stream == "":
            return None
        try:
            return validate_stream(stream)
        except (TypeError, ValueError) as exc:
            raise BadArgument("stream", str(exc)) from None

    def translated(self, call: Any, names: dict[str, str] | None = None) -> Any:
        """A data function's CLIError as the tool's error, naming the argument it is about."""
        try:
            return call()
        except CLIError as exc:
            msg = exc.message.replace(f"{self.root}/", "").replace(str(self.root), "the run root")
            for start, arg in (names or {}).items():
                if msg.startswith(start) or start in msg:
                    raise BadArgument(arg, msg) from None
            raise NoRun(msg) if msg.startswith(("run ", "no run")) else BadArgument("run", msg) \
                from None

    def _live(self, ref: RunRef, stream: str | None, full: bool = False) -> tuple[Any, Any]:
        """The kept live state of a run (with `full`, the detectors' window read)."""
        live = self.lives.get(ref, stream)
        state = live.full_state() if full else live.refresh()
        return live, state

    def _frame(self, ref: RunRef, stream: str | None) -> dict[str, Any]:
        """`expr top --once --json` of the run, kept for its version (FRAME_TTL at most)."""
        from expr_cli.resolve import shards_of

        live, _ = self._live(ref, stream, full=True)
        if ("shards", stream) not in live.memo:  # (listed by the first pass: not twice)
            self.translated(lambda: shards_of(ref, stream))

        def build(state: Any) -> Any:
            return now(), jsonable(live.top(state))

        return live.answer(("mcp-top",), build, ttl=FRAME_TTL)[1]  # type: ignore[no-any-return]

    def runs(self) -> dict[str, Any]:
        """Every run under the root, worst first: open incidents, crashed, stale, live; the
        job's line, and the run's story (its incidents, open and past, and the pages sent)."""
        from expr_tracker.health.story import story

        # every shard of every run inspected: kept RUNS_TTL seconds, as for a page
        if self._runs is not None and time.monotonic() - self._runs[0] < RUNS_TTL:
            rows = self._runs[1]
        else:
            rows = [r for r in runs_data(self.root) if inside(self.root, Path(r["path"]))]
            self._runs = (time.monotonic(), rows)
        rows = [dict(r) for r in rows]
        out = []
        for row in runs_json(rows, []):
            ref = RunRef(Path(row["path"]), f"{row['project']}/{row['name']}")
            opened: dict[str, dict[str, Any]] = {}
            for line in incident_lines(ref, limit=10_000)[::-1]:  # oldest first: the last wins
                key = str(line.get("id") or (line.get("kind"), tuple(line.get("ranks") or ())))
                if line.get("state") == "open":
                    opened[key] = line
                else:
                    opened.pop(key, None)
            # the job line `expr top` shows, and the incidents its detectors find (a run
            # no watcher follows has none recorded), at any size: the frame is kept
            # (`FRAME_TTL`) and its pass is the one `run_incidents` makes
            job = None
            try:
                frame = self._frame(self.run(ref.label), None)
            except (BadArgument, NoRun, CLIError):
                frame = None
            if frame is not None:
                job = frame["job"]
                for line in frame["incidents"]:
                    if line.get("state") == "open":
                        opened.setdefault(str(line.get("id")), line)
            incidents = [_listed(i) for i in opened.values()]
            ranks = row.pop("ranks")
            row.update(n_ranks=len(ranks), ranks=compact_ranks(ranks), job=job,
                       open_incidents=incidents, story=_brief(story(ref.path, limit=5)))
            out.append(row)

        def badness(row: dict[str, Any]) -> tuple[Any, ...]:
            kinds = [_BAD.get(i["kind"], 5) for i in row["open_incidents"]]
            # the detectors' line counts as the incident it would open (a run no watcher
            # follows has none recorded): a crash, then a stall
            state = (row["job"] or {}).get("state")
            now_bad = _BAD["crashed"] if state == "crashed" else _BAD["stall"] \
                if state == "stalled" else 9
            return (min([*kinds, now_bad, 9]), _STATUS.get(row["status"], 2),
                    -(row["last_write"] or 0.0))

        out.sort(key=badness)
        return {"tool": "list_runs", "covers": {"runs": len(out)}, "runs": out}

    # -- a run's reducers ---------------------------------------------------------------

    def summary(self, run: str, metrics: list[str] | None, step: int | None,
                steps: str | None, stream: str | None) -> dict[str, Any]:
        """`expr summary --json` of the run, and what it covers."""
        ref = self.run(run)
        stream = self.stream_arg(stream)
        if step is not None and steps is not None:
            raise BadArgument("step", "give either step or steps, not both")
        if step is not None and step < 0:
            raise BadArgument("step", f"must be >= 0, got {step}")
        window = steps_arg(steps)
        wanted = parse_metrics(metrics) if metrics else None
        live, _ = self._live(ref, stream)

        def build(state: Any) -> Any:
            view, warnings, full = summary_data(ref, stream, wanted, step, window, None, False,
                                                lambda w: 1, state=state, memo=live.memo)
            view.pop("stream_text", None)
            return jsonable(view), warnings, full

        view, warnings, full = self.translated(
            lambda: live.answer(("mcp-summary", tuple(wanted or ()), step, window), build),
            {"unknown metric": "metrics", "step ": "step", "no rank records in steps": "steps",
             "stream": "stream"})
        if not full:
            covers = {"world_size": None, "shards": len(view.get("last") or ()),
                      "note": "no rank records: each shard's last step row instead"}
            return {"tool": "run_summary", "covers": covers, "warnings": warnings,
                    "summary": view}
        return {"tool": "run_summary", "covers": summary_covers(view), "warnings": warnings,
                "summary": view}

    # -- incidents ------------------------------------------------------------------

    def incidents(self, run: str, stream: str | None) -> dict[str, Any]:
        """Open incidents (the detectors now, and a watcher's), past ones, where each rank
        waits (probes) and the crash root."""
        from expr_tracker.health.incidents import Incident, first_crash
        from expr_tracker.health.stall import where

        ref = self.run(run)
        stream = self.stream_arg(stream)
        frame = self._frame(ref, stream)
        _, state = self._live(ref, stream, full=True)
        opened = [brief(i) for i in frame["incidents"]]  # (a job-wide silence: 16,383 ranks)
        named: set[int] = set(frame["job"].get("suspects") or ())
        for inc in opened:
            named.update(inc["ranks"][:NAMED])
        places: dict[tuple[Any, Any], list[int]] = {}
        no_probe = []
        for rs in state.ranks.values():
            if rs.status != "running":
                continue
            if rs.probe:
                frames = rs.probe.get("where") or []
                places.setdefault((rs.probe.get("waiting"), frames[0] if frames else None),
                                  []).append(rs.rank)
            else:
                no_probe.append(rs.rank)
        by_place = [{"waiting": w, "innermost": f, "n": len(rs), "ranks": compact_ranks(rs)}
                    for (w, f), rs in sorted(places.items(), key=lambda kv: -len(kv[1]))]
        probes = {}
        for r in sorted(named)[:NAMED]:
            rs = state.ranks.get(r)
            if rs is None:
                continue
            probes[str(r)] = {"status": rs.status, "step": rs.last_step, "host": rs.host,
                              "where": where(rs.probe) if rs.status == "running" else None,
                              "probe": rs.probe, "exit": rs.exit}
        past = [brief(i) for i in incident_lines(ref) if i.get("state") == "resolved"]
        # (the frame's incidents: a lost node that the crash blames is its root)
        root = first_crash(state, [i for x in frame["incidents"]
                                   if (i := Incident.from_line(x)) is not None])
        if root is None:
            root = next((i.get("root") for i in opened if i.get("kind") == "crashed"), None)
        covers = {"world_size": frame["world_size"], "shards": len(state.ranks),
                  "live": frame["live"], "frontier": frame["frontier"], "lead": frame["lead"],
                  "crashed": compact_ranks([r for r, rs in state.ranks.items()
                                            if rs.status == "crashed"]),
                  "missing": _missing(state)}
        return {"tool": "run_incidents", "covers": covers, "job": frame["job"],
                "crash_root": root, "open": opened,
                "probes": {"named": probes, "by_place": by_place[:NAMED],
                           "live_without_probe": compact_ranks(no_probe)},
                "past": past[:PAST], "past_total": len(past)}

    # -- one rank against the median ---------------------------------------------------

    def rank(self, run: str, rank: int, stream: str | None) -> dict[str, Any]:
        """One rank's step time, system metrics and latest rank metrics against the
        ranks' median; its state, probe and incidents."""
        from expr_tracker.health.stall import where
        from expr_tracker.health.why import rank_reasons

        ref = self.run(run)
        stream = self.stream_arg(stream)
        if rank < 0:
            raise BadArgument("rank", f"must be >= 0, got {rank}")
        frame = self._frame(ref, stream)
        live, state = self._live(ref, stream, full=True)
        rs = state.ranks.get(rank)
        if rs is None:
            world = state.world_size
            raise BadArgument("rank", f"run {ref.label} has no shard of rank {rank}"
                                      + (f" (world size {world})" if world else "")
                                      + f"; ranks: {compact_ranks(state.ranks)}")
        key = self.cfg.step_time_key

        def every_rank(state: Any) -> Any:  # (16,384 ranks: a second, kept per version)
            return ({r: t for r in state.ranks if (t := _step_time(state, r, key)) is not None},
                    _latest(state))

        times, latest = live.answer(("mcp-every-rank",), every_rank)
        mine = times.get(rank)
        med = median(times.values()) if times else None
        system = state.system
        others = [s for r, s in system.items() if r != rank]
        sys_rows = {}
        for k, v in sorted((system.get(rank) or {}).items()):
            x = _number(v)
            if not k.startswith("system/") or x is None:
                continue
            ref_vals = [y for o in others if (y := _number(o.get(k))) is not None]
            m = median(ref_vals) if ref_vals else None
            sys_rows[k] = {"value": x, "median": m, "ratio": _ratio(x, m)}
        metrics = {}
        for k, v in sorted((latest.get(rank) or {}).items()):
            x = _number(v)
            if x is None or k.startswith("system/"):
                continue
            vals = [y for r, rec in latest.items() if (y := _number(rec.get(k))) is not None]
            m = median(vals)
            metrics[k] = {"value": x, "median": m, "ratio": _ratio(x, m), "ranks": len(vals)}
            if len(metrics) >= 32:
                break
        row = next((r for r in frame["ranks"] if r["rank"] == rank), {})
        return {
            "tool": "rank_vs_median",
            "covers": {"world_size": state.world_size, "ranks_compared": len(times),
                       "step_time_from": key if any(_has(state, r, key) for r in times)
                       else "gaps between step rows' _time", "steps": _window(state)},
            "rank": rank, "host": rs.host, "status": rs.status, "step": rs.last_step,
            "behind": state.behind(rank), "steps_per_s": row.get("steps_per_s"),
            "last_write_age": row.get("last_write_age"),
            "step_time": {"value": mine, "median": med, "ratio": _ratio(mine, med)},
            "system": sys_rows,
            "system_why": rank_reasons(system.get(rank) or {}, others) if others else [],
            "metrics": metrics,
            "where": where(rs.probe) if rs.status == "running" else None, "probe": rs.probe,
            "exit": rs.exit,
            "incidents": [i for i in frame["incidents"] if rank in i["ranks"]],
        }



def summary_covers(view: dict[str, Any]) -> dict[str, Any]:
    """What a summary covers: per key, the ranks reporting of the world size and the
    ranks missing or behind; the step or the window."""
    keys = []
    for item in view.get("keys") or ():
        st = item["stats"]
        keys.append({"key": item["key"], "reporting": st.get("n"), "world": st.get("world"),
                     "missing": compact_ranks(item.get("missing") or []),
                     "behind": compact_ranks(b["rank"] for b in item.get("behind") or ())})
    return {"world_size": view.get("world_size"), "step": view.get("step"),
            "steps": view.get("steps"), "n_steps": view.get("n_steps"), "why": view.get("why"),
            "keys": keys,
            "coverage_checked": view.get("coverage_checked"),
            "steps_missing_ranks": len(view.get("coverage") or ())}


def _missing(state: Any) -> str:
    world = state.world_size or 0
    return compact_ranks(r for r in range(world) if r not in state.ranks) if world else "-"


def _window(state: Any) -> list[int] | None:
    firsts = [rs.steps[0] for rs in state.ranks.values() if len(rs.steps)]
    lasts = [rs.steps[-1] for rs in state.ranks.values() if len(rs.steps)]
    return [min(firsts), max(lasts)] if firsts else None


def _has(state: Any, rank: int, key: str) -> bool:
    return any(key in rec for rec in state.rank_records.get(rank) or ())


def _step_time(state: Any, rank: int, key: str) -> float | None:
    """A rank's median step time over the window: its `step_time` rank metric if it logs
    one, else the gaps between its step rows' `_time` (its own clock)."""
    vals = [x for rec in state.rank_records.get(rank) or () if (x := _number(rec.get(key)))
            is not None]
    if vals:
        return median(vals)
    rs = state.ranks[rank]
    steps, times = list(rs.steps), list(rs.times)
    gaps = [(times[i + 1] - times[i]) / (steps[i + 1] - steps[i])
            for i in range(len(steps) - 1) if steps[i + 1] > steps[i]]
    return median(gaps) if gaps else None


def _latest(state: Any) -> dict[int, dict[str, Any]]:
    """Each rank's latest value of each key of its rank records in the window."""
    out: dict[int, dict[str, Any]] = {}
    for r, recs in state.rank_records.items():
        mine: dict[str, Any] = {}
        for rec in recs:
            mine.update((k, v) for k, v in rec.items() if k[:1] != "_")
        out[r] = mine
    return out
