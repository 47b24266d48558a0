"""`expr summary`'s answer: cross-rank statistics, outliers, coverage and the heatmap of one
run (DESIGN 10, 13, 14), as the JSON-ready dict `--json` prints, `render.summary` draws
and `expr serve` returns.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

from expr_cli import layout
from expr_cli.errors import CLIError
from expr_cli.resolve import (
    RunRef,
    parse_metrics,
    shards_of,
    stream_label,
    unknown_metrics,
)
from expr_cli.summary_load import (
    COVERAGE_STEPS,
    last_rows,
    load_row_table,
    load_table,
    read_window,
    step_row_keys,
)
from expr_tracker.gcpause import paused_gc

if TYPE_CHECKING:
    from expr_tracker.health.state import RunState
    from expr_tracker.stats.reduce import RankTable, Stats
    from expr_tracker.stats.scan import ColumnTable

    Table = RankTable | ColumnTable

SYSTEM = "system/"  # system metrics (DESIGN 19): samples in time, logged at whatever step
THRESHOLD = 3.5  # DESIGN 10: robust score above which a rank may be flagged
MIN_REL = 0.05  # DESIGN 10: ... if it is also this far from the median, relatively
AGGS = ("max", "min", "mean")


def _key_steps(table: Table, key: str) -> list[int]:
    return table.key_steps(key)


def is_system(table: Table, key: str) -> bool:
    """A system metric (`system/cpu_percent`, ...) sampled by the SDK every few seconds: told
    by the records' source, not the name (a user's `system/step_time` is the user's)."""
    return key in table.sample_keys


def _record_steps(primary: Table, keys: list[str]) -> list[int]:
    """The steps the view is about: those of the rank records other than system metrics,
    whose samples land on any step (their steps would read as steps most ranks miss);
    every step when only system metrics are shown."""
    user = [k for k in primary.keys if not is_system(primary, k)]
    if len(user) == len(primary.keys) or all(is_system(primary, k) for k in keys):
        return primary.steps
    return sorted(set().union(*(_key_steps(primary, k) for k in user)))


def _pick_step(
    tables: dict[str, Table], steps: list[int], step: int | None, frontier: int | None
) -> tuple[int, str]:
    """The step to reduce at, and why (for the header)."""
    if step is not None:
        if step not in set(steps):
            near = min(steps, key=lambda s: (abs(s - step), s))
            raise CLIError(
                f"step {step} has no rank records; they cover steps {steps[0]}..{steps[-1]} "
                f"({len(steps)} steps), nearest {near}"
            )
        return step, "as asked"
    last: list[int] = []
    if not all(is_system(t, k) for k, t in tables.items()):
        tables = {k: t for k, t in tables.items() if not is_system(t, k)}
    for key, table in tables.items():
        ks = _key_steps(table, key)
        if frontier is not None:
            ks = ks[:bisect_right(ks, frontier)]
        last.extend(ks[-1:])
    if last:
        return max(last), "frontier"
    return steps[-1], "latest"


def _stats(
    table: Table, key: str, step: int | None, window: tuple[int, int] | None
) -> tuple[Stats, dict[int, float]]:
    """Stats of `key` at `step` or over `window`, and the per-rank values they reduce."""
    from expr_tracker.stats import reduce
    from expr_tracker.stats.scan import ColumnTable

    if window is not None:
        lo, hi = window
        if isinstance(table, ColumnTable):
            return table.reduce_window(key, lo, hi), table.window_means(key, lo, hi)
        return reduce.reduce_window(table, key, lo, hi), reduce.window_means(table, key, lo, hi)
    assert step is not None
    if is_system(table, key):
        # each rank's latest sample at or before the step: the samples of the ranks land on
        # different steps, a few seconds apart
        rt = table.rank_table([key]) if isinstance(table, ColumnTable) else table
        values = reduce.latest_values(rt, key, step)
        return reduce.reduce_values(values, table.world_size), values
    if isinstance(table, ColumnTable):
        return table.reduce_step(key, step), table.values(key, step)
    return reduce.reduce_step(table, key, step), table.values(key, step)


def _variability(table: Table, key: str, window: tuple[int, int], min_rel: float,
                 nodes: layout.Nodes, per_rank: bool) -> dict[str, Any]:
    """The noisier ranks of `key` across the window's steps (and with `per_rank`, every
    rank's std and CV: like the outliers, all of them only with --outliers)."""
    from expr_tracker.stats import reduce, variability
    from expr_tracker.stats.scan import ColumnTable

    if isinstance(table, ColumnTable):
        values = table.window_values(key, *window)
    else:
        values = reduce.window_values(table, key, *window)
    var = variability.variability(values, THRESHOLD, min_rel)
    out = var.as_dict(per_rank)
    for o in out["noisier"]:
        o["node"] = nodes.label(o["rank"])
    return out


def _coverage(table: Table, steps: list[int]) -> list[tuple[int, int, int, list[int]]]:
    from expr_tracker.stats import reduce
    from expr_tracker.stats.scan import ColumnTable

    if isinstance(table, ColumnTable):
        return table.coverage(steps)
    return reduce.coverage(table, steps)


def _why(reason: str, at: int, state: RunState | None) -> str:
    """The header's reason for the step."""
    if reason == "as asked":
        return "as asked"
    live = len(state.live) if state is not None else 0
    front = state.frontier if state is not None else None
    if reason == "frontier" and live and front is not None:
        assert state is not None
        # a live rank with no step yet does not hold the frontier back (DESIGN 13): said,
        # so that "all N live ranks" never stands beside one of them missing (issue 54)
        none = [rs.rank for rs in state.live if rs.last_step is None]
        from expr_tracker.ranks import compact

        if none:
            why = (f"the frontier: the latest step all {live - len(none):,} live ranks with "
                   f"steps reported (rank{'s' if len(none) != 1 else ''} {compact(none)} "
                   f"live, no step yet)")
        else:
            why = f"the frontier: the latest step all {live:,} live ranks reported"
        return why if at == front else f"{why} is {front}; the last with these metrics"
    if reason == "frontier":
        return "no rank is live: the latest step with these metrics"
    return "the latest step with these metrics"


def _ranks_block(state: RunState | None, at: int | None, world: int) -> dict[str, Any]:
    """Where the ranks stand: live, finished, crashed, behind the step (with their step)."""
    if state is None:
        return {}
    by = {"running": 0, "finished": 0, "crashed": 0}
    crashed = []
    behind = []
    for r, rs in state.ranks.items():
        by[rs.status] = by.get(rs.status, 0) + 1
        if rs.status == "crashed":
            crashed.append(r)
        if at is not None and rs.last_step is not None and rs.last_step < at:
            behind.append({"rank": r, "step": rs.last_step, "status": rs.status})
    no_shard = [r for r in range(world) if r not in state.ranks] if len(state.ranks) > 1 else []
    from expr_cli.data import brief
    from expr_tracker.health.watch import open_incidents

    # every open incident of incidents.jsonl, whoever recorded it; a job-wide silence of
    # 16,383 ranks as its count and ranges, not 16,383 numbers
    opened = open_incidents(state.run_dir)
    first = None
    if crashed:
        from expr_tracker.health.incidents import first_crash

        first = first_crash(state, opened)  # (a lost node that the crash blames: its root)
    incidents = [brief(i.as_line()) for i in opened]
    # the ranks of a job-wide silence are not live (the job was killed), as `expr top` says
    silent = {r for i in opened if i.kind == "silent" for r in i.ranks
              if (rs := state.ranks.get(r)) is not None and rs.live}
    dropped = {r: rs.dropped for r, rs in sorted(state.ranks.items()) if rs.dropped}
    from expr_tracker.health.nonfinite import nonfinite

    # where each key first went NaN or infinite (the sidecars' notes), whoever watched
    bad = [{k: n[k] for k in ("key", "rank", "step", "value", "detail")} | {"ranks": list(n["ranks"])}
           for n in nonfinite(state)[:16]]
    return {"shards": len(state.ranks), "live": by["running"] - len(silent),
            "silent": len(silent), "finished": by["finished"],
            "crashed": crashed, "first_crash": first, "behind": behind, "no_shard": no_shard,
            "frontier": state.frontier, "incidents": incidents, "dropped": dropped,
            "nonfinite": bad}


def _split_missing(missing: list[int], state: RunState | None, at: int | None) -> tuple[
        list[dict[str, Any]], list[int]]:
    """A missing rank whose shard stops short of the step is behind (DESIGN 13)."""
    if state is None or at is None:
        return [], missing
    behind, gone = [], []
    for r in missing:
        rs = state.ranks.get(r)
        if rs is not None and (rs.last_step is None or rs.last_step < at):
            behind.append({"rank": r, "step": rs.last_step, "status": rs.status})
        else:
            gone.append(r)
    return behind, gone


def _chart(table: Table, key: str, steps: list[int]) -> dict[str, Any]:
    """The reducers of `key` at each of `steps` (where any rank reported it), as columns."""
    cols: dict[str, list[Any]] = {"step": [], "n": [], "mean": [], "wmean": [], "p05": [],
                                  "p50": [], "p95": [], "min": [], "max": []}
    from expr_tracker.stats.scan import ColumnTable

    have = set(table.key_steps(key))
    steps = [s for s in steps if s in have]
    if isinstance(table, ColumnTable) and not is_system(table, key):
        every = table.reduce_steps(key, steps)  # (`_stats` per step, in one pass)
    else:
        every = [_stats(table, key, s, None)[0] for s in steps]
    for s, stats in zip(steps, every, strict=True):
        st = stats.as_dict()
        cols["step"].append(s)
        for name in ("n", "mean", "wmean", "p05", "p50", "p95", "min", "max"):
            cols[name].append(st.get(name))
    return {"key": key, **cols}


def build_view(
    ref: RunRef,
    stream: str | None,
    tables: dict[str, Table],
    primary: Table,
    step: int | None,
    window: tuple[int | None, int | None] | None,
    heatmap_key: str | None,
    heatmap_width: int,
    show_all: bool,
    *,
    keys: list[str] | None = None,
    row_keys: set[str] | frozenset[str] = frozenset(),
    state: RunState | None = None,
    min_rel: float = MIN_REL,
    agg: str = "max",
    world_sizes: dict[int, int] | None = None,
    chart: bool | str = False,
) -> dict[str, Any]:
    """The summary as JSON-ready data (what `--json` prints and `render_summary` draws).

    `tables` maps each key to the table holding it (rank records, or step rows for keys
    logged with `et.log`); `keys` (default: every key of `tables`) get a statistics block;
    `primary` decides the steps and the coverage block. `chart` adds the reducers of the
    first key (or of the key it names) at each recent step (`expr serve`'s chart; the CLI
    does not ask for it).
    """
    from expr_tracker.stats import reduce, variability

    world = max([primary.world_size, *(t.world_size for t in tables.values()),
                 (state.world_size or 0) if state is not None else 0])
    all_steps = _record_steps(primary, keys if keys is not None else list(tables))
    view: dict[str, Any] = {"run": ref.label, "path": str(ref.path), "stream": stream,
                            "stream_text": stream_label(stream), "world_size": world,
                            "step": None, "steps": None, "n_steps": None, "why": None,
                            "threshold": THRESHOLD, "min_rel": min_rel, "outliers_all": show_all}
    span: tuple[int, int] | None = None
    at: int | None = None
    frontier = state.frontier if state is not None else None
    if window is not None:
        lo = window[0] if window[0] is not None else all_steps[0]
        hi = window[1] if window[1] is not None else all_steps[-1] + 1
        chosen = all_steps[bisect_left(all_steps, lo):bisect_left(all_steps, hi)]
        if not chosen:
            raise CLIError(
                f"no rank records in steps {lo}:{hi}; they cover steps "
                f"{all_steps[0]}..{all_steps[-1]}"
            )
        span = (lo, hi)
        view.update(steps=[lo, hi], n_steps=len(chosen), why="as asked")
        recent = chosen[-COVERAGE_STEPS:]
    else:
        at, reason = _pick_step(tables, all_steps, step, frontier)
        view["step"] = at
        view["why"] = _why(reason, at, state)
        chosen = [at]
        recent = all_steps[:bisect_right(all_steps, at)][-COVERAGE_STEPS:]
    view["ranks"] = _ranks_block(state, at if at is not None else (span[1] - 1 if span else None),
                                 world)
    if state is not None:  # its incidents, open and past, and the pages sent
        from expr_tracker.health.story import story

        view["story"] = story(state.run_dir)
    nodes = layout.Nodes.of(state, world)
    view["world_sizes"] = layout.disagreeing_world_sizes(world_sizes or {}, world)
    sidecars = {r: rs.world_size for r, rs in state.ranks.items()} if state is not None else {}
    view["world_size_mismatch"] = layout.sidecar_world_warning(sidecars, world_sizes or {}, world)
    items = []
    flagged_all: set[int] = set()
    for key in keys if keys is not None else list(tables):
        table = tables[key]
        stats, values = _stats(table, key, at, span)
        outs = reduce.outliers(values, THRESHOLD, min_rel, flagged_only=not show_all)
        flagged = [o for o in outs if o.flagged]
        flagged_all.update(o.rank for o in flagged)
        shown = outs if show_all else flagged
        # worst first: the furthest from the median, relatively
        shown = sorted(shown, key=layout.outlier_order)
        behind, missing = _split_missing(stats.missing, state, at)
        item: dict[str, Any] = {
            "key": key,
            "source": "step rows" if key in row_keys else "rank records",
            "stats": stats.as_dict(),
            "behind": behind,
            "missing": missing,
            "outliers": [{**o.as_dict(), "node": nodes.label(o.rank)} for o in shown],
            "n_flagged": len(flagged),
            "weighted": variability.weighted_gap(stats.n, stats.mean, stats.wmean, stats.std),
        }
        if span is not None:
            item["variability"] = _variability(table, key, span, min_rel, nodes, show_all)
        if not values:
            seen = table.key_steps(key)
            last = [s for s in seen if s <= chosen[-1]][-1:] or seen[:1]
            item["note"] = f"not reported here (last at step {last[0]})" if last else "never reported"
        items.append(item)
    view["keys"] = items
    ckey = chart if isinstance(chart, str) and chart in tables else (items[0]["key"] if items else None)
    if chart and ckey is not None:
        view["chart"] = ch = _chart(tables[ckey], ckey,
                                    chosen if window is not None else recent)
        # the noisier ranks over the chart's steps, as `--steps FIRST:LAST+1` gives them:
        # from the table read already (it holds every record of those steps), where a page
        # asked a second summary for them, which read every tail again (seconds at 16,384)
        ch["variability"] = (_variability(tables[ckey], ckey, (ch["step"][0], ch["step"][-1] + 1),
                                          min_rel, nodes, False) if ch["step"] else None)
    view["coverage"] = [
        {"step": s, "reported": n, "world": w, "missing": missing}
        for s, n, w, missing in _coverage(primary, recent)
        if missing
    ]
    view["coverage_checked"] = {"steps": len(recent), "first": recent[0] if recent else None,
                                "last": recent[-1] if recent else None}
    if heatmap_key:
        from expr_tracker.stats.scan import ColumnTable

        table = tables[heatmap_key]
        hsteps = chosen if window is not None else recent
        if isinstance(table, ColumnTable):  # (`reduce.heatmap` of its RankTable, read in C)
            buckets, cells = table.heatmap(heatmap_key, heatmap_width, steps=hsteps)
        else:
            buckets, cells = reduce.heatmap(table, heatmap_key, heatmap_width, steps=hsteps)
        grid = {r: cells.get(r, [None] * len(buckets)) for r in range(world)}
        view["heatmap"] = {"key": heatmap_key, "agg": agg, "buckets": [list(b) for b in buckets],
                           "cells": grid,
                           "rows": layout.heatmap_rows(grid, nodes, flagged_all, agg)}
    return view


def _rows_answer(sampled: tuple[list[str], list[str]], asked: list[str]) -> bool:
    """Whether the step rows hold the keys asked (by default: any), by the last rows of
    a few shards (`sampled`: `step_row_keys`), so that a run without rank records in its
    recent steps is not read whole for them."""
    keys, spans = sampled
    return set(asked) <= {*keys, *spans} if asked else bool(keys)


@paused_gc()
def summary_data(
    ref: RunRef,
    stream: str | None,
    metrics: list[str] | None,
    step: int | None,
    window: tuple[int | None, int | None] | None,
    heatmap_key: str | None,
    show_all: bool,
    buckets: Callable[[int], int],
    *,
    min_rel: float = MIN_REL,
    agg: str = "max",
    state: RunState | None = None,
    chart: bool | str = False,
    memo: dict[Any, Any] | None = None,
) -> tuple[dict[str, Any], list[str], bool]:
    """Load the recent rank records (and step rows) of RUN and reduce them: the view, the
    warnings to show beside it, and whether it is a full summary (False: the run has no
    rank records nor the asked keys, and the view holds each shard's last row instead).

    `buckets(world)` is the heatmap's width in step buckets (a terminal's, a page's);
    `state` is the run's live state when the caller keeps it between calls (`expr serve`),
    and `memo` a dict it keeps while that state does not change: the rank records read for
    one step or window are read once for every answer about them.

    No cyclic collections meanwhile (`gcpause`): the reducers' allocations at 16,384 ranks
    set off collections that walk every record read, a tenth of the command's time.
    """
    shards = memo.get(("shards", stream)) if memo is not None else None
    if shards is None:  # (a listing of 16,384 shards is a fifth of a second: once per memo)
        shards = shards_of(ref, stream)
        if memo is not None:
            memo[("shards", stream)] = shards
    wanted = parse_metrics(metrics)
    hit = memo.get(("table", step, window)) if memo is not None else None
    if hit is not None:
        lo, table, garbage, worlds = hit
        garbage = dict(garbage)
    else:
        job = memo.pop(("scan", stream), None) if memo is not None and step is None \
            and window is None else None  # (started before the live state was read)
        state, lo, scans = read_window(ref.path, stream, shards, step, window, state, job)
        table, garbage, worlds = load_table(shards, lo, scans)
        if memo is not None:
            memo[("table", step, window)] = (lo, table, dict(garbage), worlds)
    assert state is not None
    asked = [*(wanted or ()), *([heatmap_key] if heatmap_key else [])]
    sampled = cache(lambda: step_row_keys(shards))  # (8 shards' last rows, read once)
    # (a window's read may begin a line or two early: `window_start`)
    if lo is not None and (not table.steps or table.steps[-1] < lo) and state.frontier is not None and not (
            (asked or (step is None and window is None)) and _rows_answer(sampled(), asked)):
        # sparse rank records (every 100th step, or system metrics alone), or a step or
        # window asked without them: the rank records of the whole shards; not when the
        # step rows hold the keys asked (or, at the frontier, any: a run that logs with
        # et.log only was read whole)
        full = memo.get(("all", step, window)) if memo is not None else None
        if full is None:
            full = load_table(shards, None)
            if memo is not None:
                memo[("all", step, window)] = full
        table, garbage, worlds = full[0], dict(full[1]), full[2]
    have = set(table.keys)
    row_keys = {k for k in asked if k not in have}
    system_keys = [k for k in table.keys if is_system(table, k)]
    user_keys = [k for k in table.keys if not is_system(table, k)]
    defaults: list[str] = []
    span_keys: list[str] = []
    if not wanted and not user_keys and len({s.rank for s in shards}) > 1:
        # ranks that log with et.log only: their step rows are what to reduce (a shard's
        # last values each would be a table per rank, 16,384 of them); with the heatmap's
        # key, if it is one of theirs
        defaults, span_keys = sampled()
    rows = None
    if row_keys or defaults:
        # keys logged with et.log: each rank's step rows (issue 11), read once for both
        world = max(table.world_size, state.world_size or 0)
        rows, bad = load_row_table(shards, {*row_keys, *defaults}, lo, world)
        garbage.update(bad)
        found = set(rows.keys)
        if any(k not in found for k in row_keys):
            raise unknown_metrics(asked, have | found)
        defaults = [k for k in defaults if k in found]
        row_keys.update(defaults)
    warnings = []
    if garbage:
        where = ", ".join(f"{f}: {n}" for f, n in sorted(garbage.items()))
        n = sum(garbage.values())
        warnings.append(f"skipped {n} line{'s' if n != 1 else ''} that did not parse ({where})")
    # system metrics alone do not make rank records of a run that logs none
    records_asked = bool(user_keys) or any(is_system(table, k) for k in asked)
    primary: Table = table if (table.steps and records_asked) or rows is None else rows
    if not primary.steps or not (user_keys or asked or defaults):
        last = last_rows(shards, {})
        if not last:
            raise CLIError(f"run {ref.label} has no rows in stream {stream_label(stream)}: its shards are empty")
        return ({"run": ref.label, "stream": stream, "rank_records": 0, "last": last,
                 "system_keys": system_keys}, warnings, False)
    # system metrics are shown when asked for (-m system/cpu_percent): they would double
    # the summary of every run
    keys = wanted or user_keys or defaults
    tables: dict[str, Table] = {
        k: rows if rows is not None and k in row_keys else table for k in [*keys, *asked]
    }
    world = max(primary.world_size, state.world_size or 0)
    width = buckets(world) if heatmap_key else 1
    view = build_view(ref, stream, tables, primary, step, window, heatmap_key, width, show_all,
                      keys=keys, row_keys=row_keys, state=state, min_rel=min_rel, agg=agg,
                      world_sizes=worlds, chart=chart)
    view["system_keys"] = [] if wanted else system_keys
    view["span_keys"] = span_keys
    if chart:  # (the page's: its metric picker, and what a run no watcher followed reveals)
        view["step_keys"] = sampled()[0]
        if not state.live:
            from .gaps import found_stalls

            view["found"] = found_stalls(shards, world)
    if view["world_sizes"]:
        warnings.append(layout.world_size_warning(view["world_sizes"], view["world_size"]))
    if view["world_size_mismatch"]:
        warnings.append(view["world_size_mismatch"])
    return view, warnings, True


PAGE_MARKED = 8  # crashed ranks given a heatmap row of their own on the page


def page_heatmap(view: dict[str, Any], state: RunState) -> dict[str, Any]:
    """What the page adds to `--heatmap`'s answer (issue 44): one colour `scale` (lo, hi of
    every rank's finite cells, for the rows and every drill-down), and a row of their own
    for the crashed ranks (the one that failed first leading) and the ranks with no shard,
    marked with their `state`: a crashed node must not hide in a bin's colours."""
    import math

    hm = view["heatmap"]
    grid: dict[int, list[Any]] = hm["cells"]
    lo, hi = math.inf, -math.inf
    for row in grid.values():
        vals = [v for v in row if v is not None and math.isfinite(v)]
        if vals:
            lo, hi = min(lo, *vals), max(hi, *vals)
    crashed = sorted(r for r, rs in state.ranks.items() if rs.status == "crashed")
    root = None
    if crashed:
        from expr_tracker.health.incidents import first_crash
        from expr_tracker.health.watch import open_incidents

        first = (view.get("ranks") or {}).get("first_crash") or first_crash(
            state, open_incidents(state.run_dir))
        root = (first or {}).get("rank")
        crashed.sort(key=lambda r: (r != root, r))
    nodes = layout.Nodes.of(state, view["world_size"])
    marked = []
    for r in crashed[:PAGE_MARKED]:
        rs = state.ranks[r]
        marked.append({"label": f"r{r} {nodes.label(r)}", "kind": "rank", "ranks": str(r),
                       "cells": list(grid.get(r, [])), "state": "crashed", "root": r == root,
                       "step": rs.last_step})
    for r in (view.get("ranks") or {}).get("no_shard", [])[:PAGE_MARKED]:
        marked.append({"label": f"r{r} {nodes.label(r)}", "kind": "rank", "ranks": str(r),
                       "cells": [None] * len(hm["buckets"]), "state": "no shard", "root": False,
                       "step": None})
    return {"scale": [lo, hi] if lo <= hi else None, "marked": marked,
            "crashed": crashed, "no_shard": (view.get("ranks") or {}).get("no_shard", [])}
