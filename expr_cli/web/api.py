"""The JSON API of DESIGN 18: each answer is what the CLI's `--json` prints for the same
run, built by the same function (`expr_cli.data`), from the live state `live` keeps.

Where a page needs more than a terminal, the answer is a superset, never a different
shape: `runs` adds each run's `open_incidents` (null for a run no watcher keeps
incidents for); `summary` adds `chart` (the first key's
reducers at each recent step); `summary`, `heatmap` and `top` add `version`, the version
of the live state they were built from, unique to this server process (a page opens the event stream with it, which then
stays quiet until the run moves on); `top` of a run of thousands of ranks answers
`reading: true` (no rows, no incidents) until the window its detectors need is read
(`live.QUICK_MIN`); `heatmap` keeps every rank's cells up to `PAGE_RANKS`
ranks, and past that one combined row per node (`nodes`) and the cells of the ranks of
`?node=` only (a page does not draw 16,384 rows); `top` adds `history`, the run's
incident lines, resolved ones too.

Every function takes the query parameters as a mapping of lists and raises `BadRequest`
(400) or `NotFound` (404) with a one-line message; `app` turns them into JSON errors.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from expr_cli import layout
from expr_cli.data import jsonable, now
from expr_cli.data.runs import runs_data, runs_json
from expr_cli.data.series import load_series, parse_ranks, series_data
from expr_cli.data.summary import AGGS, page_heatmap, summary_data
from expr_cli.data.top import JSON_ROWS, screenful
from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, compact_ranks, parse_metrics, parse_step_range, shards_of
from expr_cli.summary_load import COVERAGE_STEPS

from .live import TOP_TTL, LiveRuns, incident_lines
from .paths import BadRequest, NotFound, inside, no_links, run_arg, run_ref, stream_arg

Params = Mapping[str, Sequence[str]]
PAGE_RANKS = 256  # past this many ranks the heatmap's rows are nodes (a click drills in)
MAX_BUCKETS = 400
MAX_COMPARE = 8
RUNS_TTL = 5.0  # seconds the runs list is kept: it inspects every shard of every run
BOOT = secrets.token_hex(4)  # a server restarted counts its versions from 1 again


def version_tag(live: Any) -> str:
    """The live state's version as the API and the event stream name it."""
    return f"{BOOT}.{live.version}"


def _aged(frame: dict[str, Any], since: float) -> dict[str, Any]:
    """A top frame built `since` seconds ago, its ranks' last-write ages as of now: a kept
    answer means nothing was written since it was built (a write is a new version), so
    each rank's silence has grown by that much (a finished run's page said "0s ago" for
    ever, a stalled rank's its age at the last change), and the job's `no_step_for` too."""
    if since <= 0:
        return frame
    ranks = [r if r.get("last_write_age") is None
             else {**r, "last_write_age": r["last_write_age"] + since} for r in frame["ranks"]]
    out = {**frame, "ranks": ranks}
    job = frame.get("job")
    if isinstance(job, dict) and job.get("no_step_for") is not None:  # (the header's, alike)
        out["job"] = {**job, "no_step_for": job["no_step_for"] + since}
    return out


def _one(params: Params, name: str) -> str | None:
    values = params.get(name) or []
    if len(values) > 1:
        raise BadRequest(f"{name} given {len(values)} times; give it once")
    return values[0] if values else None


def _int(params: Params, name: str, lo: int = 0, hi: int = 1 << 62) -> int | None:
    text = _one(params, name)
    if text is None or text == "":
        return None
    try:
        v = int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {text!r}") from None
    if not lo <= v <= hi:
        raise BadRequest(f"{name} must be in {lo}..{hi}, got {v}")
    return v


def _cli(call: Any, root: Path) -> Any:
    """Run a data function; its CLIError becomes a 400 (a usage error, code 2, or bad
    input) or a 404 (nothing there: no such run, stream, metric or step)."""
    try:
        return call()
    except CLIError as exc:
        msg = exc.message.replace(f"{root}/", "").replace(str(root), "the run root")
        gone = exc.code != 2 and (msg.startswith(("no ", "unknown ", "run ")) or "has no" in msg
                                  or "is empty" in msg)
        raise (NotFound if gone else BadRequest)(msg) from None


class Api:
    """The answers over one run root."""

    def __init__(self, root: Path, lives: LiveRuns) -> None:
        self.root = root
        self.lives = lives
        self._runs: tuple[float, list[dict[str, Any]]] | None = None
        self._runs_lock = threading.Lock()

    def _run(self, project: str, name: str, params: Params) -> tuple[RunRef, str | None]:
        # an empty run or an unknown stream is found by the answer's build (a directory
        # listing of 16,384 shards is not for every request)
        return run_ref(self.root, project, name), stream_arg(_one(params, "stream"))

    def live(self, project: str, name: str, params: Params) -> Any:
        """The kept live state of a run (the event stream's)."""
        ref, stream = self._run(project, name, params)
        return self.lives.get(ref, stream)

    def progress(self, project: str, name: str, params: Params) -> dict[str, Any]:
        """How far the first read of the run is (`LiveRun.progress`): not behind it."""
        ref, stream = self._run(project, name, params)
        return {"run": ref.label, **self.lives.get(ref, stream).progress()}

    def runs(self, params: Params) -> list[dict[str, Any]]:
        """`expr runs --json` (without spooled runs: the page is about the run root), each
        run with `open_incidents`; kept `RUNS_TTL` seconds, whoever asks. `quick=1`: while
        that list is being built (it reads every sidecar: seconds at 16,384 ranks), the
        run directories and their sidecar counts (`shards`), `status` null, `quick` true."""
        if _one(params, "quick") and self._runs is None:
            return _quick_runs(self.root)
        with self._runs_lock:
            if self._runs is not None and time.monotonic() - self._runs[0] < RUNS_TTL:
                return self._runs[1]
            out = self._list_runs()
            self._runs = (time.monotonic(), out)
            return out

    def _list_runs(self) -> list[dict[str, Any]]:
        rows = [r for r in runs_data(self.root) if inside(self.root, Path(r["path"]))
                and _no_links(RunRef(Path(r["path"]), r["path"]))]
        out = runs_json(rows, [])
        for row in out:
            ref = RunRef(Path(row["path"]), f"{row['project']}/{row['name']}")
            # None: no watcher (expr watch, exprd) keeps incidents for this run; its page
            # runs the detectors itself, the list does not (that is a pass per run)
            watched = os.path.lexists(ref.path / "incidents.jsonl")
            row["open_incidents"] = (_open_count(incident_lines(ref, limit=10_000))
                                     if watched else None)
        return jsonable(out)

    def summary(self, project: str, name: str, params: Params) -> dict[str, Any]:
        """`expr summary --json` (`metric`, `step`, `steps`), plus `chart` (of `chart=KEY`,
        else of the first key)."""
        ref, stream = self._run(project, name, params)
        metrics = parse_metrics(list(params.get("metric") or [])) or None
        step = _int(params, "step")
        steps = _cli(lambda: parse_step_range(_one(params, "steps")), self.root)
        if step is not None and steps is not None:
            raise BadRequest("use either step or steps, not both")
        chart = _one(params, "chart") or True
        live = self.lives.get(ref, stream)
        if _one(params, "first") and step is None and steps is None:
            got = self._first(ref, stream, metrics, live)
            if got is not None:
                return got

        def build(state: Any) -> Any:
            if step is None and steps is None:
                live.scan_now()  # (after a first answer that did not start it)
            view, _, _ = _cli(lambda: summary_data(
                ref, stream, metrics, step, steps, None, False, lambda w: 1, state=state,
                chart=chart, memo=live.memo), self.root)
            view.pop("stream_text", None)
            view["version"] = version_tag(live)
            return jsonable(view)

        key = ("summary", tuple(metrics or ()), step, steps, chart)
        return live.answer(key, build)  # type: ignore[no-any-return]

    def _first(self, ref: RunRef, stream: str | None, metrics: list[str] | None,
               live: Any) -> dict[str, Any] | None:
        """`first=1`: the summary at the frontier step from the live state's own records
        (`data.first`: the tiles of a run of thousands of ranks in a second or two, before
        the window of every tail is read); None where that cannot answer exactly, and
        then the caller's answer is the whole summary."""
        from expr_cli.data.first import first_summary

        def build(state: Any) -> Any:
            shards = live.memo.get(("shards", stream))
            if shards is None:
                shards = live.memo[("shards", stream)] = _cli(lambda: shards_of(ref, stream),
                                                               self.root)
            view = first_summary(ref, stream, metrics, state, shards, live.own_records())
            if view is None:
                return None
            view.pop("stream_text", None)
            view["version"] = version_tag(live)
            return jsonable(view)

        return live.answer(("first", tuple(metrics or ())), build,  # type: ignore[no-any-return]
                           scan=False)

    def heatmap(self, project: str, name: str, params: Params) -> dict[str, Any]:
        """`expr summary --heatmap KEY --json` (`metric`, `steps`, `agg`, `buckets`; `node`)."""
        ref, stream = self._run(project, name, params)
        key = _one(params, "metric")
        if not key:
            raise BadRequest("metric is required: the key to draw")
        steps = _cli(lambda: parse_step_range(_one(params, "steps")), self.root)
        agg = _one(params, "agg") or "max"
        if agg not in AGGS:
            raise BadRequest(f"agg must be one of {', '.join(AGGS)}, got {agg!r}")
        width = _int(params, "buckets", 1, MAX_BUCKETS) or COVERAGE_STEPS
        node = _one(params, "node")
        live = self.lives.get(ref, stream)

        def build(state: Any) -> Any:
            view, _, full = _cli(lambda: summary_data(
                ref, stream, [key], None, steps, key, False, lambda w: width, agg=agg,
                state=state, memo=live.memo), self.root)
            if not full:
                raise NotFound(f"run {ref.label} has no values of {key}")
            view.pop("stream_text", None)
            hm = view["heatmap"]
            world = view["world_size"]
            view["heatmap_page"] = page_heatmap(view, state)
            if world > PAGE_RANKS:
                nodes = layout.Nodes.of(state, world)
                groups = nodes.groups(hm["cells"])
                hm["nodes"] = [{"node": n, "ranks": compact_ranks(rs), "first": rs[0],
                                "n": len(rs),
                                "cells": layout.combine([hm["cells"][r] for r in rs], agg)}
                               for n, rs in sorted(groups.items(), key=lambda kv: kv[1][0])]
                mine = groups.get(node, []) if node else []
                if node and not mine:
                    raise NotFound(f"no node {node!r} in run {ref.label}")
                hm["cells"] = {r: hm["cells"][r] for r in mine}
                hm["node"] = node
            view["version"] = version_tag(live)
            return jsonable(view)

        return live.answer(("heatmap", key, steps, agg, width, node), build)  # type: ignore[no-any-return]

    def top(self, project: str, name: str, params: Params) -> dict[str, Any]:
        """`expr top --once --json`, plus `history` (incident lines, newest first); `limit=N`
        keeps the worst N ranks and nodes (a page shows a screenful, not 16,384 rows;
        default the CLI's 100)."""
        ref, stream = self._run(project, name, params)
        limit = _int(params, "limit", 1)
        live = self.lives.get(ref, stream)
        if not live.full:  # the detectors' window is still being read (`live.QUICK_MIN`)
            # (the kept state when there is one: not behind the lock of an answer being built)
            state = live.state if live.state is not None else live.refresh()
            if not live.full:
                live.start_full()
                return _reading(live, ref, state)

        def build(state: Any) -> Any:
            _cli(lambda: _shards(live, ref, stream), self.root)
            frame = live.top(state)
            frame["history"] = incident_lines(ref)
            frame["version"] = version_tag(live)
            return now(), jsonable(frame)

        built, frame = live.answer(("top",), build, ttl=TOP_TTL)
        frame = screenful(frame, JSON_ROWS if limit is None else limit)  # (as `--json`)
        return _aged(frame, now() - built)

    def series(self, project: str, name: str, params: Params) -> dict[str, Any]:
        """`expr plot --json` (`metric`, `ranks`, `steps`, `smooth`)."""
        ref, stream = self._run(project, name, params)
        metrics = parse_metrics(list(params.get("metric") or []))
        if not metrics:
            raise BadRequest("metric is required")
        ranks = _cli(lambda: parse_ranks(_one(params, "ranks")), self.root)
        steps = _cli(lambda: parse_step_range(_one(params, "steps")), self.root)
        window = _int(params, "smooth", 1, 10_000) or 1
        live = self.lives.get(ref, stream)
        key = ("series", tuple(metrics), tuple(ranks or ()), steps, window)

        def build(state: Any) -> Any:
            _cli(lambda: _shards(live, ref, stream), self.root)
            return jsonable(_cli(lambda: series_data(ref, stream, metrics, ranks, steps, window),
                                 self.root))

        return live.answer(key, build)  # type: ignore[no-any-return]

    def compare(self, params: Params) -> dict[str, Any]:
        """One metric of several runs (`run=P/A&run=P/B&metric=`), aligned by step: per
        run the median across its ranks at each step (null where it has none)."""
        runs = list(params.get("run") or [])
        key = _one(params, "metric")
        if not runs:
            raise BadRequest("run is required: run=project/name, repeated")
        if len(runs) > MAX_COMPARE:
            raise BadRequest(f"at most {MAX_COMPARE} runs, got {len(runs)}")
        if not key:
            raise BadRequest("metric is required")
        stream = stream_arg(_one(params, "stream"))
        per: list[tuple[str, dict[int, float], int]] = []
        for text in runs:
            ref = run_arg(self.root, text)
            live = self.lives.get(ref, stream)

            def build(state: Any, ref: RunRef = ref) -> Any:
                _cli(lambda: shards_of(ref, stream), self.root)
                series = load_series(ref.path, stream, [key], None, None)[key]
                by: dict[int, list[float]] = {}
                for xs, ys in series.values():
                    for x, y in zip(xs, ys, strict=True):
                        by.setdefault(x, []).append(y)
                return {s: median(v) for s, v in by.items()}, len(series)

            values, n = live.answer(("compare", key), build)
            per.append((ref.label, values, n))
        if not any(v for _, v, _ in per):
            raise NotFound(f"no finite values of {key} in {', '.join(runs)}")
        steps = sorted({s for _, v, _ in per for s in v})
        return jsonable({"metric": key, "stream": stream, "steps": steps,
                         "runs": [{"run": label, "ranks": n, "values": [v.get(s) for s in steps]}
                                  for label, v, n in per]})


def _quick_runs(root: Path) -> list[dict[str, Any]]:
    """The run directories under `root` (none through a symlink, none hidden) and how many
    sidecars each holds: a listing, no file read."""
    out: list[dict[str, Any]] = []
    try:
        projects = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                    and not e.name.startswith(".")]
    except OSError:
        return out
    for project in sorted(projects, key=lambda e: e.name):
        try:
            names = [e for e in os.scandir(project.path) if e.is_dir(follow_symlinks=False)
                     and not e.name.startswith(".")]
        except OSError:
            continue
        for run in sorted(names, key=lambda e: e.name):
            try:
                shards = sum(1 for e in os.scandir(run.path) if e.name.endswith(".meta.json"))
            except OSError:
                continue
            if shards:
                out.append({"project": project.name, "name": run.name, "path": run.path,
                            "status": None, "shards": shards, "quick": True})
    return out


def _reading(live: Any, ref: RunRef, state: Any) -> dict[str, Any]:
    """Top's answer while the window its detectors need is read: the frame's shape with
    `reading: true`, no rank rows and no incidents (not "none": unknown yet), and the
    incident lines a watcher wrote (`history`)."""
    from expr_tracker.health.state import DEFAULT_WINDOW

    text = f"reading the last {DEFAULT_WINDOW} steps of every rank for the detectors"
    return jsonable({"run": ref.label, "reading": True, "frontier": state.frontier, "lead": state.lead,
                     "live": len(state.live), "world_size": state.world_size, "metric": None,
                     "job": {"state": "reading", "text": text}, "ranks": [], "nodes": [],
                     "incidents": [], "history": incident_lines(ref), "version": version_tag(live),
                     "ranks_total": 0, "nodes_total": 0})


def _shards(live: Any, ref: RunRef, stream: str | None) -> Any:
    """`shards_of` (its CLIError for an empty run or an unknown stream), listed once per
    version of the live state: `summary_data` keeps it in the same memo."""
    key = ("shards", stream)
    if key not in live.memo:
        live.memo[key] = shards_of(ref, stream)
    return live.memo[key]


def _no_links(ref: RunRef) -> bool:
    """No entry of the run is a symlink (a shard or sidecar linked to a file outside the
    root): such a run is not listed, as its page refuses it (`paths.no_links`)."""
    try:
        no_links(ref)
    except (NotFound, OSError):
        return False
    return True


def _open_count(lines: list[dict[str, Any]]) -> int:
    """Incidents whose latest line says open (lines newest first)."""
    seen: dict[Any, str] = {}
    for line in lines:
        k = line.get("id") or (line.get("kind"), tuple(line.get("ranks") or ()))
        seen.setdefault(k, str(line.get("state")))
    return sum(1 for s in seen.values() if s == "open")
