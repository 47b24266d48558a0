"""Cross-rank reducers, coverage, outliers and heatmap cells (DESIGN 10). Pure functions, no I/O.

The reducers read a `RankTable` (built by `collect`, both in `ranktable` and re-exported
here) through its per-key lists aligned with the sorted steps.

Decisions the DESIGN leaves open:

- Only int and float values are metrics (bools, strings and None are ignored); ints become
  floats. Non-finite values are stored, counted and kept out of every statistic.
- A `_weight` that is missing, not a number, non-finite or negative counts as 1.0. A rank
  record without an integer `_step`, or with `_rank` outside [0, 1048576), is skipped and counted.
- Outliers (DESIGN 10): flagged when |robust z| > threshold and |x - median| >= min_rel *
  |median|. With a MAD of 0 (half the ranks or more share the median) the robust score is
  undefined (None) except for values equal to the median (0.0), and the relative difference
  alone decides. A median of 0 makes every other value infinitely far, relatively.
- `reduce_window`: a rank is missing when it has no value of the key in the window; `nonfinite`
  counts non-finite values (not ranks) and `nonfinite_ranks` lists the ranks that had any; a
  rank's weight is the mean of its weights at the steps where its value was finite.
- `heatmap` buckets the steps that carry the key into equal-count groups; a cell is None when the
  rank has no value there and NaN when it has only non-finite ones.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from operator import mul
from typing import Any, cast

from expr_tracker.stats.ranktable import (
    _MAX_INT as _MAX_INT,  # re-exported: scan reads the same bounds
)
from expr_tracker.stats.ranktable import _MAX_RANKS as _MAX_RANKS
from expr_tracker.stats.ranktable import RankTable as RankTable
from expr_tracker.stats.ranktable import _missing
from expr_tracker.stats.ranktable import collect as collect

_fsum = math.fsum
_isfinite = math.isfinite
_hypot = math.hypot
_NAN = math.nan

HeatCell = float | None
"""One heatmap cell: a bucket mean, NaN if the rank had only non-finite values, None if nothing."""

# per-rank weights aligned with the values, one weight shared by every rank, or unweighted
_Weights = list[float] | float | None


@dataclass(frozen=True)
class Stats:
    """Cross-rank statistics of one key (at one step or over a window)."""

    n: int
    world: int
    mean: float | None
    wmean: float | None
    min: float | None
    max: float | None
    range: float | None
    std: float | None
    p05: float | None
    p50: float | None
    p95: float | None
    missing: list[int]
    nonfinite: int
    nonfinite_ranks: list[int]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (lists copied). Field by field: `dataclasses.asdict` deep-copies
        every value, and a summary of a 50,000-key row spent 25 s of CPU in it."""
        out = {f: getattr(self, f) for f in _STATS_FIELDS}
        out["missing"] = list(self.missing)
        out["nonfinite_ranks"] = list(self.nonfinite_ranks)
        return out


@dataclass(frozen=True)
class Outlier:
    """One rank's distance from the others."""

    rank: int
    value: float
    delta: float  # value - mean
    z: float | None  # delta / std (None when std is 0)
    robust: float | None  # 0.6745 (value - median) / MAD; None when MAD is 0 and value != median
    ratio: float | None  # value / median, shown as "1.52x median" (None when the median is 0)
    flagged: bool

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (its fields are numbers: no copy needed)."""
        return {f: getattr(self, f) for f in _OUTLIER_FIELDS}


_STATS_FIELDS = tuple(f.name for f in fields(Stats))
_OUTLIER_FIELDS = tuple(f.name for f in fields(Outlier))


def _empty_stats(world: int, missing: list[int], nonfinite: int, bad: list[int]) -> Stats:
    """Stats with no finite value: every float field is None."""
    return Stats(
        0, world, None, None, None, None, None, None, None, None, None, missing, nonfinite, bad
    )


def _pct(s: Sequence[float], q: float) -> float:
    """Percentile of sorted `s` with numpy's default (linear) method; q in [0, 1]."""
    n = len(s)
    idx = q * (n - 1)
    i = int(idx)
    if i >= n - 1:
        return s[n - 1]
    t = idx - i
    a = s[i]
    b = s[i + 1]
    d = b - a
    # numpy lerps from the nearer end, which keeps the result monotone in q
    return b - d * (1.0 - t) if t >= 0.5 else a + d * t


def _mean(xs: Sequence[float]) -> float:
    """Correctly rounded mean of finite values (scaled first if the sum would overflow)."""
    n = len(xs)
    try:
        return _fsum(xs) / n
    except OverflowError:
        return _fsum([x / n for x in xs])


def _std(xs: Sequence[float], m: float) -> float:
    """Population standard deviation around `m`, two-pass like numpy."""
    # hypot sums squares with extended precision and without overflow: accurate and fast
    return _hypot(*[x - m for x in xs]) / math.sqrt(len(xs))


def _wmean(ws: _Weights, xs: list[float], mean: float) -> float | None:
    if ws is None:
        return mean
    if isinstance(ws, float):
        return mean if ws > 0.0 else None
    lo = min(ws)
    try:
        sw = _fsum(ws)
    except (OverflowError, ValueError):
        sw = _NAN
    if not (lo >= 0.0 and sw - sw == 0.0):  # a finite sum means no NaN or infinite weight
        raise ValueError("weights must be finite and >= 0")
    if sw == 0.0:
        return None
    top = max(ws)
    if lo == top:
        return mean  # equal weights: exactly the mean
    if not 2.0**-64 <= top <= 2.0**64:
        # scale by a power of two (exact) so that products w * x don't underflow or overflow
        e = -math.frexp(top)[1]
        ws = [math.ldexp(w, e) for w in ws]
        sw = _fsum(ws)
    try:
        return _fsum(map(mul, ws, xs)) / sw
    except (OverflowError, ValueError):
        return _fsum([(w / sw) * x for w, x in zip(ws, xs, strict=True)])


def _reduce(
    ranks: Sequence[int], xs: list[float], world: int, ws: _Weights, missing: list[int]
) -> Stats:
    """Stats over aligned ranks, values and weights; non-finite values are counted and dropped."""
    try:
        total = _fsum(xs)
    except (OverflowError, ValueError):  # overflow, or inf + -inf: sorted out below
        total = _NAN
    if total - total == 0.0:
        # a finite sum means every value is finite: the common, fast path
        bad: list[int] = []
        n = len(xs)
        mean = total / n if n else _NAN
    else:
        keep = [i for i, x in enumerate(xs) if _isfinite(x)]
        bad = sorted(ranks[i] for i, x in enumerate(xs) if not _isfinite(x))
        xs = [xs[i] for i in keep]
        if isinstance(ws, list):
            ws = [ws[i] for i in keep]
        n = len(xs)
        mean = _mean(xs) if n else _NAN
    if n == 0:
        return _empty_stats(world, missing, len(bad), bad)
    s = sorted(xs)
    lo = s[0]
    hi = s[-1]
    if lo == hi:
        mean = lo
        std = 0.0
    else:
        std = _std(xs, mean)
    wmean = _wmean(ws, xs, mean)
    p05 = _pct(s, 0.05)
    p50 = _pct(s, 0.5)
    p95 = _pct(s, 0.95)
    return Stats(n, world, mean, wmean, lo, hi, hi - lo, std, p05, p50, p95, missing, len(bad), bad)


def reduce_values(
    values: Mapping[int, float],
    world_size: int,
    weights: Mapping[int, float] | None = None,
) -> Stats:
    """Reduce one value per rank (DESIGN 10); ranks absent from `weights` weigh 1.0."""
    if world_size < 0:
        raise ValueError(f"world_size must be >= 0, got {world_size}")
    ranks = list(values)
    ws: _Weights = None
    if weights is not None:
        wv = weights.values()
        if wv and weights.keys() >= values.keys():
            c = min(wv)
            total = sum(wv)
            if c == max(wv) and total - total == 0.0:
                if c < 0.0:
                    raise ValueError("weights must be finite and >= 0")
                ws = float(c)  # one weight for every rank: no per-rank work
        if ws is None:
            get = weights.get
            ws = [get(r, 1.0) for r in ranks]
    return _reduce(
        ranks, list(values.values()), world_size, ws, _missing(values.keys(), world_size)
    )


def reduce_step(table: RankTable, key: str, step: int) -> Stats:
    """Stats of `key` across ranks at one step."""
    world = table._world
    col = table._column(key)
    i = table._index.get(step)
    if i is None or not col.ranks:
        return _empty_stats(world, list(range(world)), 0, [])
    ws: _Weights = table.key_wconst(key)
    if i not in col.gaps:
        # every rank of the key has a value here: read one row
        rk = col.ranks
        lo = i * len(rk)
        hi = lo + len(rk)
        xs = col.rows[lo:hi].tolist()
        missing = col.missing[:]
        if ws is None:
            ws = col.weight_rows(table)[lo:hi].tolist()
        return _reduce(rk, xs, world, ws, missing)
    rk = []
    xs = []
    for r, values in zip(col.ranks, col.lists, strict=True):
        x = values[i]
        if x is not None:
            rk.append(r)
            xs.append(x)
    if ws is None:
        wl = table._wlist
        ws = cast("list[float]", [wl(r, key)[i] for r in rk])
    return _reduce(rk, xs, world, ws, _missing(set(rk), world))


def _window_parts(
    table: RankTable, key: str, lo: int, hi: int
) -> tuple[list[int], list[float], list[float], set[int], int, list[int]]:
    """Per rank over steps lo <= s < hi: ranks with a finite value, their means and mean
    weights, ranks with any value, the non-finite count and the ranks that had one."""
    steps = table._steps
    i = bisect_left(steps, lo)
    j = max(i, bisect_left(steps, hi))
    col = table._column(key)
    wconst = table.key_wconst(key)
    got: list[int] = []
    means: list[float] = []
    wmeans: list[float] = []
    seen: set[int] = set()
    bad: list[int] = []
    nonfinite = 0
    for r, values, complete in zip(col.ranks, col.lists, col.full, strict=True):
        seg = cast("list[float]", values[i:j])
        wseg = None if wconst is not None else cast("list[float]", table._wlist(r, key)[i:j])
        try:
            total = _fsum(seg) if complete else _NAN  # gaps (None) take the slow path
        except (OverflowError, ValueError):
            total = _NAN
        if seg and total - total == 0.0:
            seen.add(r)
            mean = total / len(seg)
        else:
            have = [k for k, x in enumerate(seg) if x is not None]
            if not have:
                continue
            seen.add(r)
            keep = [k for k in have if _isfinite(seg[k])]
            if len(keep) < len(have):
                nonfinite += len(have) - len(keep)
                bad.append(r)
            if not keep:
                continue
            seg = [seg[k] for k in keep]
            wseg = None if wseg is None else [wseg[k] for k in keep]
            mean = _mean(seg)
        got.append(r)
        means.append(mean)
        if wseg is not None:
            wmeans.append(_fsum(wseg) / len(wseg))
    return got, means, wmeans, seen, nonfinite, bad


def reduce_window(table: RankTable, key: str, lo: int, hi: int) -> Stats:
    """Stats of each rank's mean of `key` over steps lo <= s < hi (finite values only)."""
    got, means, wmeans, seen, nonfinite, bad = _window_parts(table, key, lo, hi)
    world = table._world
    wconst = table.key_wconst(key)
    ws: _Weights = wconst if wconst is not None else wmeans
    stats = _reduce(got, means, world, ws, _missing(seen, world))
    return replace(stats, nonfinite=nonfinite, nonfinite_ranks=bad)


def window_means(table: RankTable, key: str, lo: int, hi: int) -> dict[int, float]:
    """rank -> mean of its finite values of `key` over steps lo <= s < hi (as `reduce_window`)."""
    got, means, _, _, _, _ = _window_parts(table, key, lo, hi)
    return dict(zip(got, means, strict=True))


def window_values(table: RankTable, key: str, lo: int, hi: int) -> dict[int, list[float]]:
    """rank -> its finite values of `key` at steps lo <= s < hi, in no particular order
    (ranks with none left out): what `stats.variability` measures."""
    out: dict[int, list[float]] = {}
    for r, by_step in table._cols.get(key, {}).items():
        xs = [v for s, v in by_step.items() if lo <= s < hi and _isfinite(v)]
        if xs:
            out[r] = xs
    return out


def latest_values(table: RankTable, key: str, step: int) -> dict[int, float]:
    """rank -> its value of `key` at its latest step at or before `step` (finite values
    only): a snapshot of samples taken in time, not at steps (system metrics, DESIGN 19)."""
    out: dict[int, float] = {}
    for r, by_step in table._cols.get(key, {}).items():
        at = max((s for s, v in by_step.items() if s <= step and _isfinite(v)), default=None)
        if at is not None:
            out[r] = by_step[at]
    return out


def outliers(
    values: Mapping[int, float], threshold: float = 3.5, min_rel: float = 0.05,
    flagged_only: bool = False,
) -> list[Outlier]:
    """Per rank delta, z, robust score and ratio to the median (DESIGN 10), sorted by rank;
    finite values only. Flagged: |robust| > threshold and a relative difference from the
    median of at least `min_rel`; with a MAD of 0, the relative difference alone.
    `flagged_only`: the flagged ones alone (16,384 ranks: an object each is a tenth of a
    summary)."""
    if not threshold >= 0.0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if not min_rel >= 0.0:
        raise ValueError(f"min_rel must be >= 0, got {min_rel}")
    items = sorted((r, x) for r, x in values.items() if _isfinite(x))
    if not items:
        return []
    xs = [x for _, x in items]
    s = sorted(xs)
    if s[0] == s[-1]:
        mean = s[0]
        std = 0.0
    else:
        mean = _mean(xs)
        std = _std(xs, mean)
    med = _pct(s, 0.5)
    mad = _pct(sorted([abs(x - med) for x in xs]), 0.5)
    # a difference of min_rel times the median; with a median of 0 any other value is far
    near = abs(med) * min_rel
    out = []
    for r, x in items:
        delta = x - med
        far = abs(delta) >= near and delta != 0.0
        robust: float | None
        if mad > 0.0:
            robust = 0.6745 * delta / mad
            flagged = far and abs(robust) > threshold
        else:
            # no typical spread: a 0.3% difference among ranks that agree exactly is noise
            robust = 0.0 if delta == 0.0 else None
            flagged = far
        if flagged_only and not flagged:
            continue
        z = (x - mean) / std if std > 0.0 else None
        ratio = x / med if med != 0.0 else None
        out.append(Outlier(r, x, x - mean, z, robust, ratio, flagged))
    return out


def coverage(
    table: RankTable, steps: Iterable[int] | None = None
) -> list[tuple[int, int, int, list[int]]]:
    """Per step: (step, ranks reported, world size, missing ranks)."""
    world = table._world
    out = []
    for s in table._steps if steps is None else steps:
        got = table.ranks_at(s)  # (a system sample alone is not the rank reporting the step)
        missing = _missing(got, world)
        out.append((s, len(got), world, missing))
    return out


def heatmap(
    table: RankTable, key: str, n_buckets: int, steps: Sequence[int] | None = None
) -> tuple[list[tuple[int, int]], dict[int, list[HeatCell]]]:
    """Bucket the steps carrying `key` (or `steps`) into at most `n_buckets` equal-count groups.

    Returns the buckets as (first step, last step) and, per rank 0..world-1, the mean of its
    finite values in each bucket: None when it reported nothing there, NaN when only non-finite.
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    chosen = table.key_steps(key) if steps is None else sorted(set(steps))
    col = table._column(key)
    index = table._index
    nb = min(n_buckets, len(chosen))
    buckets: list[tuple[int, int]] = []
    grid: dict[int, list[HeatCell]] = {r: [None] * nb for r in range(table._world)}
    for b in range(nb):
        group = chosen[b * len(chosen) // nb : (b + 1) * len(chosen) // nb]
        buckets.append((group[0], group[-1]))
        pos = [index[s] for s in group if s in index]
        for r, values in zip(col.ranks, col.lists, strict=True):
            xs = [x for x in map(values.__getitem__, pos) if x is not None]
            if xs:
                good = [x for x in xs if _isfinite(x)]
                grid[r][b] = _mean(good) if good else _NAN
    return buckets, grid
