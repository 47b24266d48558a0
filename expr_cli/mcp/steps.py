"""The tools of `expr mcp` about a metric over steps: a thinned series, the first step
a metric crossed a value, runs compared (DESIGN 20).

A big run's metric is read as the columns `expr summary` reads (`summary_load.load_table`,
`load_row_table`: worker processes, C parsing) and reduced per step by the same reducers
(`reduce_steps`), not record by record; a run whose shards are not regular enough for
columns, or a few ranks asked by name, goes through `data.series.load_series` (`expr
plot`'s reader). Both are kept per version of the run's live state.
"""

from __future__ import annotations

import difflib
import math
from statistics import median
from typing import Any

from expr_cli.data.series import (
    MAX_LINES,
    MAX_OUTLIERS,
    band_of,
    build_panel,
    load_series,
    panels_json,
    parse_ranks,
)
from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, compact_ranks

from .answers import NAMED, Answers, BadArgument, steps_arg

MAX_COMPARE = 8


def thin(n: int, points: int) -> list[int]:
    """Indices of `points` of `n` items, evenly spread, the first and the last kept."""
    if n <= points:
        return list(range(n))
    if points <= 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})


def thin_values(values: list[Any], points: int) -> list[int]:
    """`thin` of a line, keeping what thinning must not hide: its non-finite points (a
    rank's NaN at one step) and its lowest and highest values, the evenly spread points
    making up the rest of `points` (the first and the last always kept)."""
    n = len(values)
    if n <= points:
        return list(range(n))
    finite = [(v, i) for i, v in enumerate(values)
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    special = [i for i, v in enumerate(values)
               if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))]
    if finite:
        special += [min(finite)[1], max(finite)[1]]
    keep = {0, n - 1, *special[:max(0, points - 2)]}
    for i in thin(n, points):
        if len(keep) >= points:
            break
        keep.add(i)
    return sorted(keep)


class StepAnswers:
    """The over-steps tools' answers, over the runs `base` resolves and keeps."""

    def __init__(self, base: Answers) -> None:
        self.base = base

    def _series(self, ref: RunRef, stream: str | None, metric: str,
                steps: tuple[int | None, int | None] | None = None,
                ranks: list[int] | None = None, nonfinite: bool = False) -> dict[int, Any]:
        """`data.series.load_series` of one metric (rank -> steps, values), kept for the
        run's version; BadArgument naming the metric when it has no finite values."""
        from expr_cli.resolve import shards_of

        self.base.translated(lambda: shards_of(ref, stream))
        live = self.base.lives.get(ref, stream)

        def build(state: Any) -> Any:
            return load_series(ref.path, stream, [metric], ranks, steps, nonfinite)[metric]

        per = live.answer(("mcp-series", metric, steps, tuple(ranks or ()), nonfinite), build)
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

        shards = self.base.translated(lambda: shards_of(ref, stream))
        live = self.base.lives.get(ref, stream)
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
        live = self.base.lives.get(ref, stream)

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
        stream = self.base.stream_arg(stream)
        points = self._points(points)
        per = []
        for text in runs:
            ref = self.base.run(text)
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
        ref = self.base.run(run)
        stream = self.base.stream_arg(stream)

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
        ref = self.base.run(run)
        stream = self.base.stream_arg(stream)
        points = self._points(points)
        try:
            wanted = parse_ranks(ranks)
        except CLIError as exc:
            raise BadArgument("ranks", exc.message.replace("--rank", "ranks")) from None
        window = steps_arg(steps)
        table = self._columns(ref, stream, metric, window) if wanted is None else None
        if table is not None and len(table.blocks) > MAX_LINES:
            # thousands of ranks: `build_panel`'s median, band and outliers from the columns,
            # at the thinned steps only (its answer, without a dict per rank and step), kept
            # for the run's version
            live = self.base.lives.get(ref, stream)
            return live.answer(  # type: ignore[no-any-return]
                ("mcp-big-series", metric, window, points),
                lambda state: self._big_series(ref, stream, metric, window, points, table))
        # a rank's own line keeps its NaN (thinning keeps it too: `thin_values`); the
        # median and band of many ranks take finite values
        per = self._series(ref, stream, metric, window, wanted, nonfinite=True)
        if len(per) > MAX_LINES:
            per = {r: pts for r, (xs, ys) in per.items()
                   if (pts := ([x for x, y in zip(xs, ys, strict=True) if math.isfinite(y)],
                               [y for y in ys if math.isfinite(y)]))[0]}
        # `series_data`'s answer (`expr plot --json`) from the read kept for the run
        data = {"run": ref.label, "stream": stream,
                "panels": panels_json([build_panel(metric, per, 1)])}
        panel = data["panels"][0]
        kept = of = 0
        for line in panel["lines"]:
            idx = thin_values(line["values"], points)
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
        band_steps, med, p05, p95 = band_of(zip(keep, table.reduce_steps(metric, keep),
                                                strict=True))
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
            return self.base.caps.points
        if not 2 <= points <= self.base.caps.points:
            raise BadArgument("points", f"must be in 2..{self.base.caps.points}, got {points}")
        return points

    def _world(self, ref: RunRef) -> int:
        live = self.base.lives.get(ref, None)
        state = live.state if live.state is not None else live.refresh()
        return int(state.world_size or 0)
