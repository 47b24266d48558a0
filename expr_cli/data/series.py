"""`expr plot`'s answer: a metric per rank as lines over steps, or, past MAX_LINES ranks, the
median, the p05-p95 band and the outlier ranks (DESIGN 10's robust score over each rank's
mean in the window, at most MAX_OUTLIERS of them); never thousands of lines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, ranks_phrase, unknown_metrics

MAX_LINES = 8
MAX_OUTLIERS = 5


class Line(NamedTuple):
    """One series: a legend label, steps and values; `kind` is rank, median or outlier."""

    label: str
    steps: list[int]
    values: list[float]
    kind: str = "rank"


class Band(NamedTuple):
    """The p05-p95 envelope across ranks, per step."""

    steps: list[int]
    lo: list[float]
    hi: list[float]


class Panel(NamedTuple):
    """The chart of one metric."""

    metric: str
    lines: list[Line]
    band: Band | None
    note: str


MAX_RANK_PARTS = 4096  # ranks or ranges in one --rank (or ?ranks=)


def parse_ranks(text: str | None) -> list[int] | None:
    """`all` (or nothing) -> None; `3` or `0,3,5-7` -> the ranks.

    A range is clamped to the largest world a run can have (MAX_WORLD ranks, the sanity
    cap `init()` applies), so `1-100000000000` means ranks 1 and up, not a list that
    fills memory; a single rank past it is a usage error.
    """
    from expr_tracker.store.records import MAX_WORLD

    if text is None or text.strip() == "all":
        return None
    parts = text.split(",")
    if len(parts) > MAX_RANK_PARTS:
        raise CLIError(f"--rank takes at most {MAX_RANK_PARTS:,} ranks or ranges, "
                       f"got {len(parts):,}", 2)
    spans: list[tuple[int, int]] = []
    try:
        for part in parts:
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            b = int(hi) if sep else a
            if a < 0 or b < a:
                raise ValueError
            if a >= MAX_WORLD:
                raise CLIError(f"--rank {a} is past the largest world ({MAX_WORLD:,} ranks, "
                               f"0-{MAX_WORLD - 1})", 2)
            spans.append((a, min(b, MAX_WORLD - 1)))
    except ValueError:
        raise CLIError(f"--rank must be 'all', a rank or a list like 0,3,5-7; got {text!r}", 2) from None
    # ranges kept as ranges until merged: the same range 150 times is expanded once
    # (a set updated with each range cost 17 s of a server's CPU for 1.5 KB of query)
    out: list[int] = []
    end = -1
    for a, b in sorted(spans):
        if b > end:
            out.extend(range(max(a, end + 1), b + 1))
            end = b
    return out


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (the first points average what exists)."""
    if window <= 1:
        return values
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


Series = dict[str, dict[int, tuple[list[int], list[float]]]]


def load_series(run_dir: Path, stream: str | None, metrics: list[str], ranks: list[int] | None,
                steps: tuple[int | None, int | None] | None, nonfinite: bool = False) -> Series:
    """metric -> rank -> (steps, values): the finite numbers of each rank's step rows (`log`)
    or, for a metric no step row holds, of its rank records (`log_rank_metrics`, system
    metrics), by their own `_rank` (DESIGN 4), the latest record of a step winning.
    `nonfinite`: NaN and infinities too (an answer that must show them; a chart cannot)."""
    from expr_tracker.store.runread import RunReader

    keep = _last_of_each_step if nonfinite else (lambda xs, ys: _finite(*_last_of_each_step(xs, ys)))
    out = _series(RunReader(run_dir, stream=stream, metrics=metrics, ranks=ranks,
                            step_range=steps), metrics, finite=not nonfinite)
    rest = [m for m in metrics if not out[m]]
    if rest:
        # the latest record of a step wins before non-finite values go: a NaN logged again
        # for a step (a resumed rank) replaces the finite value before it
        more = _series(RunReader(run_dir, stream=stream, rank_records=True, metrics=rest,
                                 ranks=ranks, step_range=steps), rest, finite=False)
        out.update({m: {r: pts for r, (xs, ys) in by_rank.items()
                        if (pts := keep(xs, ys))[0]}
                    for m, by_rank in more.items()})
    return out


def _finite(xs: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    keep = [i for i, y in enumerate(ys) if math.isfinite(y)]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _series(reader: Any, metrics: list[str], finite: bool = True) -> Series:
    out: Series = {m: {} for m in metrics}
    for row in reader.rows():
        r = row["_rank"]
        for m in metrics:
            v = row.get(m)
            if type(v) in (int, float) and (not finite or math.isfinite(v)):
                xs, ys = out[m].setdefault(r, ([], []))
                xs.append(row["_step"])
                ys.append(float(v))
    return out


def _last_of_each_step(xs: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    """A rank's points in step order, one per step: rank records of one step repeat (a
    system sample every few seconds at the last step; rank 0's all-gathered copy of a
    rank's own record), and the latest one read wins, as in the reducers."""
    if all(a < b for a, b in pairwise(xs)):
        return xs, ys
    last = dict(zip(xs, ys, strict=True))
    order = sorted(last)
    return order, [last[x] for x in order]


def _by_step(per_rank: dict[int, tuple[list[int], list[float]]]) -> dict[int, dict[int, float]]:
    table: dict[int, dict[int, float]] = {}
    for r, (xs, ys) in per_rank.items():
        for x, y in zip(xs, ys, strict=True):
            table.setdefault(x, {})[r] = y
    return table


def band_of(rows: Iterable[tuple[int, Any]]) -> tuple[list[int], list[float], list[float],
                                                      list[float]]:
    """(steps, p50s, p05s, p95s) of the (step, reducers) rows whose reducers have all three:
    the median line and the p05-p95 band past MAX_LINES ranks."""
    steps: list[int] = []
    med: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    for step, st in rows:
        if st.p50 is None or st.p05 is None or st.p95 is None:
            continue
        steps.append(step)
        med.append(st.p50)
        lo.append(st.p05)
        hi.append(st.p95)
    return steps, med, lo, hi


def build_panel(metric: str, per_rank: dict[int, tuple[list[int], list[float]]], window: int) -> Panel:
    """One rank per line, or median + band + outliers beyond MAX_LINES ranks."""
    from expr_cli.layout import outlier_order
    from expr_tracker.stats.reduce import outliers, reduce_values

    per_rank = {r: (xs, smooth(ys, window)) for r, (xs, ys) in sorted(per_rank.items())}
    if len(per_rank) <= MAX_LINES:
        lines = [Line(f"rank {r}", xs, ys) for r, (xs, ys) in per_rank.items()]
        return Panel(metric, lines, None, "")
    steps, med, lo, hi = band_of((step, reduce_values(values, len(values)))
                                 for step, values in sorted(_by_step(per_rank).items()))
    means = {r: sum(ys) / len(ys) for r, (_, ys) in per_rank.items() if ys}
    # the furthest first; with a MAD of 0 (most ranks equal, DESIGN 10) the robust score is
    # None and the distance from the median tells
    flagged = sorted(outliers(means, flagged_only=True), key=outlier_order)
    lines = [Line(f"median of {len(per_rank)} ranks", steps, med, "median")]
    lines += [Line(f"rank {o.rank} (outlier)", *per_rank[o.rank], "outlier")
              for o in flagged[:MAX_OUTLIERS]]
    note = f"{len(per_rank)} ranks: median, p05-p95 band"
    if flagged:
        note += f", {len(flagged)} outlier{'s' if len(flagged) != 1 else ''}"
    return Panel(metric, lines, Band(steps, lo, hi), note)


def _available_metrics(run_dir: Path, stream: str | None) -> set[str]:
    """Numeric keys of the step rows and rank records of the first few shards (for the
    unknown-metric error)."""
    from expr_tracker.store.reader import ShardReader
    from expr_tracker.store.runread import run_shards

    keys: set[str] = set()
    for shard in run_shards(run_dir, stream)[:8]:
        for _, rec in ShardReader(shard.path).iter_records():
            if rec.get("_kind") in (None, "rank"):
                keys.update(k for k, v in rec.items() if k[:1] != "_" and type(v) in (int, float))
    return keys


def chart(ref: RunRef, stream: str | None, metrics: list[str], ranks: list[int] | None,
          steps: tuple[int | None, int | None] | None, window: int) -> list[Panel]:
    """The panels of the chart; CLIError when nothing can be drawn."""
    series = load_series(ref.path, stream, metrics, ranks, steps)
    empty = [m for m in metrics if not series[m]]
    if empty:
        have = _available_metrics(ref.path, stream)
        if any(m not in have for m in empty):
            raise unknown_metrics(empty, have)
        where = f" in {ranks_phrase(ranks)}" if ranks is not None else ""
        where += " in that step range" if steps is not None else ""
        raise CLIError(f"no finite values of {', '.join(empty)}{where}")
    return [build_panel(m, series[m], window) for m in metrics]


def panels_json(panels: Iterable[Panel]) -> list[dict[str, Any]]:
    """The panels as JSON-ready dicts (the `panels` of `expr plot --json`)."""
    out = []
    for p in panels:
        item: dict[str, Any] = {"metric": p.metric, "note": p.note,
                                "lines": [line._asdict() for line in p.lines]}
        item["band"] = p.band._asdict() if p.band is not None else None
        out.append(item)
    return out




def series_data(ref: RunRef, stream: str | None, metrics: list[str], ranks: list[int] | None,
                steps: tuple[int | None, int | None] | None, window: int) -> dict[str, Any]:
    """What `expr plot --json` prints."""
    return {"run": ref.label, "stream": stream,
            "panels": panels_json(chart(ref, stream, metrics, ranks, steps, window))}
