"""What each tool of `expr mcp` answers, as plain data (DESIGN 20).

The numbers come from the functions behind the CLI's `--json`: `data.runs` (`expr runs`),
`data.summary` (`expr summary`), `data.top` (`expr top`: the detectors, the job's line,
the incidents), `data.series` (`expr plot`), over the live state `expr serve` keeps per
run (`web.live`: a second question about a run of 16,384 ranks costs a pass, not a read).
Each answer adds `covers` (ranks reporting of the world size, the ranks missing, the
steps) and says whether it was cut (`fit`).

A run is named `project/name` or by a bare name; it resolves only under the run root,
its directories opened without following symlinks and refused when its directory holds
one (`web.paths`). Bad arguments raise `BadArgument` naming the argument; a run that is
not there raises `NoRun` with the nearest names.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from statistics import median
from typing import Any

from expr_cli.data import jsonable, now
from expr_cli.data.runs import runs_data, runs_json
from expr_cli.data.series import (
    MAX_LINES,
    MAX_OUTLIERS,
    build_panel,
    load_series,
    panels_json,
    parse_ranks,
)
from expr_cli.data.summary import summary_data
from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, compact_ranks, list_runs, parse_metrics
from expr_cli.web.api import RUNS_TTL
from expr_cli.web.live import QUICK_MIN, LiveRuns, incident_lines
from expr_cli.web.paths import BadRequest, NotFound, inside, no_links, run_ref
from expr_tracker.store.layout import validate_stream

from .fit import Caps

MAX_COMPARE = 8
NAMED = 16  # ranks named one by one (probes, per-rank crossings); the rest are counted
PAST = 20  # resolved incidents listed
# seconds a run's top frame is kept while its files do not change: the time-based detectors
# (hang, stall) see the silence grow between calls (a page's TOP_TTL is 10 s)
FRAME_TTL = 1.0
_BAD = {"crashed": 0, "stall": 1, "hang": 1, "missing": 2, "straggler": 3, "slowdown": 3,
        "behind": 4, "alert": 4}
_STATUS = {"crashed": 0, "stale": 1, "running": 2, "finished": 3}


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


def _steps_arg(text: str | None) -> tuple[int | None, int | None] | None:
    from expr_cli.resolve import parse_step_range

    try:
        return parse_step_range(text)
    except CLIError as exc:
        raise BadArgument("steps", exc.message) from None


def thin(n: int, points: int) -> list[int]:
    """Indices of `points` of `n` items, evenly spread, the first and the last kept."""
    if n <= points:
        return list(range(n))
    if points <= 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})


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
        names = {label.split("/", 1)[1]: label for label in labels}
        near = difflib.get_close_matches(text, labels, n=5, cutoff=0.5)
        near += [names[n] for n in difflib.get_close_matches(text, list(names), n=5, cutoff=0.5)]
        near = list(dict.fromkeys(near))[:5]
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
    def _stream(stream: Any) -> str | None:
        if stream is None or stream == "":
            return None
        try:
            return validate_stream(stream)
        except (TypeError, ValueError) as exc:
            raise BadArgument("stream", str(exc)) from None

    def _cli(self, call: Any, names: dict[str, str] | None = None) -> Any:
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
        """`expr top --once --json` of the run, kept for its version (TOP_TTL at most)."""
        from expr_cli.resolve import shards_of

        live, _ = self._live(ref, stream, full=True)
        self._cli(lambda: shards_of(ref, stream))

        def build(state: Any) -> Any:
            return now(), jsonable(live.top(state))

        return live.answer(("mcp-top",), build, ttl=FRAME_TTL)[1]  # type: ignore[no-any-return]

    def runs(self) -> dict[str, Any]:
        """Every run under the root, worst first: open incidents, crashed, stale, live."""
        import time

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
            job = None
            if row["shards"] < QUICK_MIN:  # the detectors too, where a pass is cheap
                try:
                    job = self._frame(self.run(ref.label), None)["job"]
                except (BadArgument, NoRun, CLIError):
                    job = None
            incidents = [{"kind": i.get("kind"), "ranks": compact_ranks(i.get("ranks") or []),
                          "step": i.get("step"), "detail": i.get("detail")}
                         for i in opened.values()]
            ranks = row.pop("ranks")
            row.update(n_ranks=len(ranks), ranks=compact_ranks(ranks), job=job,
                       open_incidents=incidents)
            out.append(row)

        def badness(row: dict[str, Any]) -> tuple[Any, ...]:
            kinds = [_BAD.get(i["kind"], 5) for i in row["open_incidents"]]
            job = row["job"] or {}
            stalled = 1 if job.get("state") == "stalled" else 9
            return (min([*kinds, stalled, 9]), _STATUS.get(row["status"], 2),
                    -(row["last_write"] or 0.0))

        out.sort(key=badness)
        return {"tool": "list_runs", "covers": {"runs": len(out)}, "runs": out}

    # -- a run's reducers ---------------------------------------------------------------

    def summary(self, run: str, metrics: list[str] | None, step: int | None,
                steps: str | None, stream: str | None) -> dict[str, Any]:
        """`expr summary --json` of the run, and what it covers."""
        ref = self.run(run)
        stream = self._stream(stream)
        if step is not None and steps is not None:
            raise BadArgument("step", "give either step or steps, not both")
        if step is not None and step < 0:
            raise BadArgument("step", f"must be >= 0, got {step}")
        window = _steps_arg(steps)
        wanted = parse_metrics(metrics) if metrics else None
        live, _ = self._live(ref, stream)

        def build(state: Any) -> Any:
            view, warnings, full = summary_data(ref, stream, wanted, step, window, None, False,
                                                lambda w: 1, state=state, memo=live.memo)
            view.pop("stream_text", None)
            return jsonable(view), warnings, full

        view, warnings, full = self._cli(
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
        from expr_tracker.health.incidents import first_crash
        from expr_tracker.health.stall import where

        ref = self.run(run)
        stream = self._stream(stream)
        frame = self._frame(ref, stream)
        _, state = self._live(ref, stream, full=True)
        opened = frame["incidents"]
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
        past = [i for i in incident_lines(ref) if i.get("state") == "resolved"]
        root = first_crash(state)
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
        stream = self._stream(stream)
        if rank < 0:
            raise BadArgument("rank", f"must be >= 0, got {rank}")
        frame = self._frame(ref, stream)
        _, state = self._live(ref, stream, full=True)
        rs = state.ranks.get(rank)
        if rs is None:
            world = state.world_size
            raise BadArgument("rank", f"run {ref.label} has no shard of rank {rank}"
                                      + (f" (world size {world})" if world else "")
                                      + f"; ranks: {compact_ranks(state.ranks)}")
        key = self.cfg.step_time_key
        times = {r: t for r in state.ranks if (t := _step_time(state, r, key)) is not None}
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
        latest = _latest(state)
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

    # -- over steps -------------------------------------------------------------------

    def _series(self, ref: RunRef, stream: str | None, metric: str,
                steps: tuple[int | None, int | None] | None = None,
                ranks: list[int] | None = None) -> dict[int, Any]:
        """`data.series.load_series` of one metric (rank -> steps, values), kept for the
        run's version; BadArgument naming the metric when it has no finite values."""
        from expr_cli.resolve import shards_of

        self._cli(lambda: shards_of(ref, stream))
        live = self.lives.get(ref, stream)

        def build(state: Any) -> Any:
            return load_series(ref.path, stream, [metric], ranks, steps)[metric]

        per = live.answer(("mcp-series", metric, steps, tuple(ranks or ())), build)
        if not per:
            from expr_cli.data.series import _available_metrics

            have = _available_metrics(ref.path, stream)
            if metric not in have:
                near = difflib.get_close_matches(metric, sorted(have), n=3)
                raise BadArgument("metric", f"run {ref.label} has no metric {metric!r}"
                                  + (f"; near: {', '.join(near)}" if near else "")
                                  + f"; metrics: {', '.join(sorted(have)[:20])}")
            where = " in those ranks" if ranks is not None else ""
            where += " in that step range" if steps is not None else ""
            raise BadArgument("metric", f"no finite values of {metric}{where} in run {ref.label}")
        return per  # type: ignore[no-any-return]

    def _columns(self, ref: RunRef, stream: str | None, metric: str,
                 window: tuple[int | None, int | None] | None = None) -> Any:
        """The metric of every rank as columns (`summary_load.load_table`, or its step rows
        by `load_row_table`: the columnar scan of `expr summary`, in worker processes), kept
        for the run's version; None when the shards are not regular enough for columns
        (`_series` reads them record by record then)."""
        from expr_cli.resolve import shards_of
        from expr_cli.summary_load import load_row_table, load_table, step_row_keys
        from expr_tracker.stats.scan import ColumnTable

        shards = self._cli(lambda: shards_of(ref, stream))
        live = self.lives.get(ref, stream)
        lo = window[0] if window is not None else None

        def build(state: Any) -> Any:
            # a key of the step rows (by a few shards' last rows) is not looked for in the
            # rank records: that would read every shard whole once more
            rows = metric in step_row_keys(shards)[0]
            table = None if rows else load_table(shards, lo)[0]
            if table is None or metric not in table.keys:
                world = max(table.world_size if table is not None else 0,
                            state.world_size or 0, len(shards))
                table, _ = load_row_table(shards, {metric}, lo, world)
            ok = isinstance(table, ColumnTable) and metric in table.keys
            return table if ok else None

        return live.answer(("mcp-columns", metric, window), build)

    def _medians(self, ref: RunRef, stream: str | None, metric: str) -> tuple[
            dict[int, float], int]:
        """step -> the median across ranks of `metric` (finite values), and the ranks that
        report it; kept for the run's version. From the columns' reducers where the shards
        are regular (`reduce_steps`, in C), else from each rank's series."""
        live = self.lives.get(ref, stream)

        def build(state: Any) -> Any:
            table = self._columns(ref, stream, metric)
            if table is not None:
                steps = table.key_steps(metric)
                meds = {s: st.p50 for s, st in zip(steps, table.reduce_steps(metric, steps),
                                                     strict=True) if st.p50 is not None}
                n = sum(1 for b in table.blocks if metric in b.columns)
                if meds:
                    return meds, n
            series = self._series(ref, stream, metric)
            by: dict[int, list[float]] = {}
            for xs, ys in series.values():
                for x, y in zip(xs, ys, strict=True):
                    by.setdefault(x, []).append(y)
            return {s: median(v) for s, v in sorted(by.items())}, len(series)

        return live.answer(("mcp-medians", metric), build)  # type: ignore[no-any-return]

    def _firsts(self, ref: RunRef, stream: str | None, metric: str,
                crossed: Any) -> tuple[list[tuple[int, int, float]], list[int]]:
        """(step, rank, value) of each rank's first value that `crossed`, by step; and the
        ranks reporting the metric."""
        table = self._columns(ref, stream, metric)
        firsts = []
        ranks = []
        if table is not None and any(metric in b.columns for b in table.blocks):
            for b in table.blocks:
                col = b.columns.get(metric)
                if col is None:
                    continue
                ranks.append(b.rank)
                for i, y in enumerate(col):
                    if math.isfinite(y) and crossed(y):
                        firsts.append((b.steps[i], b.rank, y))
                        break
        else:
            for r, (xs, ys) in self._series(ref, stream, metric).items():
                ranks.append(r)
                hit = next((i for i, y in enumerate(ys) if crossed(y)), None)
                if hit is not None:
                    firsts.append((xs[hit], r, ys[hit]))
        firsts.sort()
        return firsts, ranks

    def compare(self, runs: list[str], metric: str, stream: str | None,
                points: int | None) -> dict[str, Any]:
        """One metric of several runs: per run the median across its ranks at each step,
        aligned by step and thinned to `points`."""
        if not runs:
            raise BadArgument("runs", "give at least one run")
        if len(runs) > MAX_COMPARE:
            raise BadArgument("runs", f"at most {MAX_COMPARE} runs, got {len(runs)}")
        if not metric:
            raise BadArgument("metric", "give the metric to compare")
        stream = self._stream(stream)
        points = self._points(points)
        per = []
        for text in runs:
            ref = self.run(text)
            meds, n = self._medians(ref, stream, metric)
            per.append((ref.label, meds, n))
        steps = sorted({s for _, m, _ in per for s in m})
        keep = [steps[i] for i in thin(len(steps), points)]
        common = sorted(set.intersection(*(set(m) for _, m, _ in per)))
        rows = []
        for label, meds, n in per:
            ss = list(meds)
            lo = min(meds, key=meds.__getitem__)
            hi = max(meds, key=meds.__getitem__)
            rows.append({"run": label, "ranks": n, "steps": [ss[0], ss[-1]], "n_steps": len(ss),
                         "last": {"step": ss[-1], "median": meds[ss[-1]]},
                         "min": {"step": lo, "median": meds[lo]},
                         "max": {"step": hi, "median": meds[hi]},
                         "at_last_common_step": meds[common[-1]] if common else None})
        return {"tool": "compare_runs",
                "covers": {"runs": len(per), "steps": [steps[0], steps[-1]],
                           "points": len(keep), "of_steps": len(steps),
                           "last_common_step": common[-1] if common else None},
                "metric": metric, "stream": stream, "runs": rows,
                "aligned": {"step": keep,
                            "median": {label: [m.get(s) for s in keep] for label, m, _ in per}}}

    def crossing(self, run: str, metric: str, value: float, direction: str,
                 stream: str | None) -> dict[str, Any]:
        """The first step at which `metric` went above (or below) `value`: on any rank, on
        the median across ranks, and which ranks crossed when."""
        if direction not in ("above", "below"):
            raise BadArgument("direction", f"must be 'above' or 'below', got {direction!r}")
        if not math.isfinite(value):
            raise BadArgument("value", f"must be a finite number, got {value!r}")
        if not metric:
            raise BadArgument("metric", "give the metric")
        ref = self.run(run)
        stream = self._stream(stream)

        def crossed(y: float) -> bool:
            return y >= value if direction == "above" else y <= value

        firsts, ranks = self._firsts(ref, stream, metric, crossed)
        meds, _ = self._medians(ref, stream, metric)
        med_first = next(((s_, m) for s_, m in sorted(meds.items()) if crossed(m)), None)
        all_steps = sorted(meds)
        first_step = firsts[0][0] if firsts else None
        world = max(ranks) + 1 if ranks else 0
        crossed_ranks = {r for _, r, _ in firsts}
        return {
            "tool": "first_crossing",
            "covers": {"ranks_reporting": len(ranks), "world_size": max(world, self._world(ref)),
                       "steps": [all_steps[0], all_steps[-1]] if all_steps else None},
            "metric": metric, "value": value, "direction": direction,
            "first_step_any_rank": first_step,
            "first_ranks": [{"rank": r, "value": y} for s, r, y in firsts if s == first_step][:NAMED],
            "median_first_step": med_first[0] if med_first else None,
            "median_at_that_step": med_first[1] if med_first else None,
            "ranks_crossed": len(crossed_ranks),
            "ranks_never": compact_ranks(r for r in ranks if r not in crossed_ranks),
            "earliest": [{"rank": r, "step": s, "value": y} for s, r, y in firsts[:NAMED]],
        }

    def series(self, run: str, metric: str, ranks: str | None, steps: str | None,
               points: int | None, stream: str | None) -> dict[str, Any]:
        """`expr plot --json` of one metric, each line and the band thinned to `points`."""
        if not metric:
            raise BadArgument("metric", "give the metric")
        ref = self.run(run)
        stream = self._stream(stream)
        points = self._points(points)
        try:
            wanted = parse_ranks(ranks)
        except CLIError as exc:
            raise BadArgument("ranks", exc.message.replace("--rank", "ranks")) from None
        window = _steps_arg(steps)
        table = self._columns(ref, stream, metric, window) if wanted is None else None
        if table is not None and len(table.blocks) > MAX_LINES:
            # thousands of ranks: `build_panel`'s median, band and outliers from the columns,
            # at the thinned steps only (its answer, without a dict per rank and step), kept
            # for the run's version
            live = self.lives.get(ref, stream)
            return live.answer(  # type: ignore[no-any-return]
                ("mcp-big-series", metric, window, points),
                lambda state: self._big_series(ref, stream, metric, window, points, table))
        per = self._series(ref, stream, metric, window, wanted)
        # `series_data`'s answer (`expr plot --json`) from the read kept for the run
        data = {"run": ref.label, "stream": stream,
                "panels": panels_json([build_panel(metric, per, 1)])}
        panel = data["panels"][0]
        kept = of = 0
        for line in panel["lines"]:
            idx = thin(len(line["steps"]), points)
            of = max(of, len(line["steps"]))
            kept = max(kept, len(idx))
            line["steps"] = [line["steps"][i] for i in idx]
            line["values"] = [line["values"][i] for i in idx]
        band = panel["band"]
        if band is not None:
            idx = thin(len(band["steps"]), points)
            for k in ("steps", "lo", "hi"):
                band[k] = [band[k][i] for i in idx]
        all_steps = [s for line in panel["lines"] for s in line["steps"][:1] + line["steps"][-1:]]
        n_ranks = len(per)
        return {"tool": "metric_series",
                "covers": {"ranks_reporting": n_ranks, "world_size": self._world(ref),
                           "ranks_drawn": len(panel["lines"]) if band is None else n_ranks,
                           "steps": [min(all_steps), max(all_steps)] if all_steps else None,
                           "points": kept, "of_points": of},
                "thinned": of > kept, "series": data}

    def _big_series(self, ref: RunRef, stream: str | None, metric: str,
                    window: tuple[int | None, int | None] | None, points: int,
                    table: Any) -> dict[str, Any]:
        """`build_panel` past MAX_LINES ranks (the median, the p05-p95 band, the outlier
        ranks by their mean over the steps) over the columns, at `points` steps."""
        from bisect import bisect_left

        from expr_cli.layout import outlier_order
        from expr_tracker.stats.reduce import outliers

        lo = window[0] if window is not None and window[0] is not None else None
        hi = window[1] if window is not None and window[1] is not None else None
        steps = [s for s in table.key_steps(metric)
                 if (lo is None or s >= lo) and (hi is None or s < hi)]
        if not steps:
            raise BadArgument("steps", f"no values of {metric} in that step range")
        keep = [steps[i] for i in thin(len(steps), points)]
        band_steps, med, p05, p95 = [], [], [], []
        for s_, st in zip(keep, table.reduce_steps(metric, keep), strict=True):
            if st.p50 is None or st.p05 is None or st.p95 is None:
                continue
            band_steps.append(s_)
            med.append(st.p50)
            p05.append(st.p05)
            p95.append(st.p95)
        means = table.window_means(metric, steps[0], steps[-1] + 1)
        flagged = sorted(outliers(means, flagged_only=True), key=outlier_order)
        by_rank = {b.rank: b for b in table.blocks}
        n = len(means)
        lines = [{"label": f"median of {n} ranks", "steps": band_steps, "values": med,
                  "kind": "median"}]
        for o in flagged[:MAX_OUTLIERS]:
            b = by_rank[o.rank]
            col = b.columns[metric]
            xs, ys = [], []
            for s_ in keep:
                i = bisect_left(b.steps, s_)
                if i < len(b.steps) and b.steps[i] == s_ and math.isfinite(col[i]):
                    xs.append(s_)
                    ys.append(col[i])
            lines.append({"label": f"rank {o.rank} (outlier)", "steps": xs, "values": ys,
                          "kind": "outlier"})
        note = f"{n} ranks: median, p05-p95 band"
        if flagged:
            note += f", {len(flagged)} outlier{'s' if len(flagged) != 1 else ''}"
        panel = {"metric": metric, "note": note, "lines": lines,
                 "band": {"steps": band_steps, "lo": p05, "hi": p95}}
        return {"tool": "metric_series",
                "covers": {"ranks_reporting": n, "world_size": self._world(ref),
                           "ranks_drawn": n, "steps": [steps[0], steps[-1]],
                           "points": len(keep), "of_points": len(steps)},
                "thinned": len(keep) < len(steps),
                "series": {"run": ref.label, "stream": stream, "panels": [panel]}}

    def _points(self, points: int | None) -> int:
        if points is None:
            return self.caps.points
        if not 2 <= points <= self.caps.points:
            raise BadArgument("points", f"must be in 2..{self.caps.points}, got {points}")
        return points

    def _world(self, ref: RunRef) -> int:
        live = self.lives.get(ref, None)
        state = live.state if live.state is not None else live.refresh()
        return int(state.world_size or 0)


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
