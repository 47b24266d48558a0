"""Incremental statistics over the last N points or the last N seconds of one metric.

One `Window` is shared by every rule and function that names the same (metric, window).
It is fed only finite values. Per point it keeps running shifted sums (count, sum, mean,
var, std, zscore in O(1)), the direction and length of the newest run of rising, falling
or equal neighbour pairs (increasing, decreasing, stalled in O(1)) and, when asked,
monotonic deques (min, max in amortised O(1)). Median and slope sort or scan the window,
but only when a rule asks for them. Variance is the population variance (ddof 0), as
`numpy.var`.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import deque
from collections.abc import Callable
from typing import Any

SUMS, PAIRS, MINMAX, STEPS = "sums", "pairs", "minmax", "steps"
# A variance below this fraction of the mean squared deviation from the shift is rounding
# noise of the running sums, not spread: call it 0 so zscore does not explode on flat data.
_VAR_NOISE = 1e-12
_REFIT = 1e-7  # below max-window 1/n, so a re-sum around a point of the window settles it
_TREND_OF = {"increasing": 1, "decreasing": -1, "stalled": 0}
_CMP = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
        "==": operator.eq, "!=": operator.ne}


class Window:
    """The values of one metric in the last `points` points or the last `seconds` seconds."""

    __slots__ = (
        "_cap", "_max", "_min", "_minmax", "_n_in", "_n_out", "_pairs", "_refit_at",
        "_removed", "_run", "_s1", "_s2", "_shift", "_span", "_steps", "_sums", "_times",
        "_trend", "points", "seconds", "values",
    )

    def __init__(self, points: int | None = None, seconds: float | None = None) -> None:
        self.points = points
        self.seconds = seconds
        self._cap = points or 0  # typed copies for the hot paths
        self._span = seconds or 0.0
        self.values: deque[float] = deque()
        self._times: deque[float] | None = deque() if seconds is not None else None
        self._steps: deque[int | None] | None = None
        self._sums = self._pairs = self._minmax = False
        self._shift = self._s1 = self._s2 = 0.0
        self._removed = 0  # points removed since the running sums were last re-summed
        # The points-only push re-sums past this many removals: 2 * length + 32 at its
        # length after an append, computed once instead of per point
        self._refit_at = 2 * (self._cap + 1) + 32
        # The newest run of neighbour pairs: its direction (1 rising, -1 falling, 0 equal)
        # and length. The window is a suffix of the stream, so all of its n - 1 pairs share
        # one direction exactly when that run is at least n - 1 long: nothing to undo on
        # eviction, unlike per-direction pair counts.
        self._trend = 0
        self._run = 0
        self._n_in = self._n_out = 0
        self._max: deque[tuple[int, float]] = deque()
        self._min: deque[tuple[int, float]] = deque()

    @property
    def is_time(self) -> bool:
        return self.seconds is not None

    def require(self, feature: str) -> None:
        """Turn on the bookkeeping one function needs, rebuilding it from the current points."""
        if feature == SUMS and not self._sums:
            self._sums = True
            self._recompute()
        elif feature == PAIRS and not self._pairs:
            self._pairs = True
            self._trend = self._run = 0
            for a, b in itertools.pairwise(self.values):
                self._count_pair(a, b)
        elif feature == MINMAX and not self._minmax:
            self._minmax = True
            # Indices are relative to the points held now (fast paths do not count).
            self._n_in = self._n_out = 0
            self._max.clear()
            self._min.clear()
            for v in self.values:
                self._push_minmax(v)
        elif feature == STEPS and self._steps is None:
            self._steps = deque([None] * len(self.values))

    def pusher(self) -> Callable[[float, float, int | None], None]:
        """The fastest `push` for the bookkeeping turned on (chosen again after `require`)."""
        if self._times is None and self._steps is None and not self._minmax:
            if self._sums and not self._pairs:
                return self._push_points_sums
            if self._pairs and not self._sums:
                return self._push_points_pairs
        return self.push

    def _push_points_sums(self, v: float, t: float, step: int | None) -> None:
        vals = self.values
        vals.append(v)
        n = len(vals)
        if n > self._cap:
            k = self._shift
            d = v - k
            e = vals.popleft() - k
            self._s1 += d - e
            self._s2 += d * d - e * e
            removed = self._removed + 1
            if removed > self._refit_at:
                self._recompute()
            else:
                self._removed = removed
        elif n == 1:
            self._shift = v
            self._s1 = self._s2 = 0.0
        else:
            d = v - self._shift
            self._s1 += d
            self._s2 += d * d

    def _push_points_pairs(self, v: float, t: float, step: int | None) -> None:
        vals = self.values  # _count_pair inlined: this runs per point
        if vals:
            a = vals[-1]
            trend = 0 if v == a else 1 if v > a else -1
            if trend == self._trend:
                self._run += 1
            else:
                self._trend = trend
                self._run = 1
        vals.append(v)
        if len(vals) > self._cap:
            vals.popleft()

    def push(self, v: float, t: float, step: int | None) -> None:
        """Add one finite value recorded at time `t` (and `step`), evicting what falls out."""
        vals = self.values
        if self._pairs and vals:
            self._count_pair(vals[-1], v)
        vals.append(v)
        if self._sums:
            if len(vals) == 1:
                self._shift = v
                self._s1 = self._s2 = 0.0
            else:
                d = v - self._shift
                self._s1 += d
                self._s2 += d * d
        if self._minmax:
            self._push_minmax(v)
        else:
            self._n_in += 1
        if self._steps is not None:
            self._steps.append(step)
        times = self._times
        if times is None:
            if len(vals) > self._cap:
                self._pop()
        else:
            times.append(t)
            self.evict(t)

    def evict(self, now: float) -> None:
        """Drop points of a time window recorded at or before `now - seconds`."""
        times = self._times
        if times is not None:
            cut = now - self._span
            while times and times[0] <= cut:
                self._pop()

    def _push_minmax(self, v: float) -> None:
        idx = self._n_in
        self._n_in = idx + 1
        mx, mn = self._max, self._min
        while mx and mx[-1][1] <= v:
            mx.pop()
        mx.append((idx, v))
        while mn and mn[-1][1] >= v:
            mn.pop()
        mn.append((idx, v))

    def _count_pair(self, a: float, b: float) -> None:
        trend = 0 if b == a else 1 if b > a else -1
        if trend == self._trend:
            self._run += 1
        else:
            self._trend = trend
            self._run = 1

    def _pop(self) -> None:
        vals = self.values
        v = vals.popleft()
        if self._times is not None:
            self._times.popleft()
        if self._steps is not None:
            self._steps.popleft()
        self._n_out += 1
        if self._minmax:
            out = self._n_out
            if self._max[0][0] < out:
                self._max.popleft()
            if self._min[0][0] < out:
                self._min.popleft()
        if self._sums:
            d = v - self._shift
            self._s1 -= d
            self._s2 -= d * d
            self._removed += 1
            # Re-sum exactly now and then so rounding drift of the running sums stays
            # bounded; every ~2N removals keeps the cost amortised O(1) per point.
            if self._removed > 2 * len(vals) + 32 or not vals:
                self._recompute()

    def _recompute(self) -> None:
        vals = self.values
        self._removed = 0
        if not vals:
            self._shift = self._s1 = self._s2 = 0.0
            return
        # Shift by a point of the window: a flat window then sums to exactly 0.
        k = vals[-1]
        self._shift = k
        # Lists, not generators: fsum over a list is several times faster, and this runs
        # every ~2N points.
        ds = [v - k for v in vals]
        self._s1 = math.fsum(ds)
        self._s2 = math.fsum([d * d for d in ds])

    def _moments(self, n: int) -> tuple[float, float]:
        """(mean - shift, population variance) of the n > 0 points held."""
        m = self._s1 / n
        m2 = self._s2 / n
        var = m2 - m * m
        if var < _REFIT * m2:
            # The shift is far from the points (their level moved): the running sums have
            # lost the digits that hold the spread. Re-sum around a current point; after
            # that var >= m2 / n, so this runs once per level change, not per call.
            self._recompute()
            m = self._s1 / n
            m2 = self._s2 / n
            var = m2 - m * m
        return m, (var if var > _VAR_NOISE * m2 else 0.0)

    # -- statistics; None means UNKNOWN -------------------------------------------------

    def count(self) -> float:
        return float(len(self.values))

    def sum(self) -> float | None:
        n = len(self.values)
        return self._shift * n + self._s1 if n else None

    def mean(self) -> float | None:
        n = len(self.values)
        return self._shift + self._s1 / n if n else None

    def var(self) -> float | None:
        n = len(self.values)
        return self._moments(n)[1] if n else None

    def std(self) -> float | None:
        n = len(self.values)
        return math.sqrt(self._moments(n)[1]) if n else None

    def zscore(self) -> float | None:
        return self.zscore_fn()()

    def zscore_fn(self, op: str | None = None, c: float = 0.0) -> Callable[[], Any]:
        """zscore as a closure; with a comparison `op` it returns `zscore op c` (or None).

        A rule like `zscore(loss[50]) > 4` then costs one Python call per row, not two, and
        a point on the wrong side of the mean answers without a square root.
        """
        w, vals, moments, sqrt = self, self.values, self._moments, math.sqrt
        cmp = _CMP[op] if op is not None else None
        # z has the sign of (point - mean): when that sign alone makes the comparison false
        above = (op == ">" and c >= 0) or (op == ">=" and c > 0)
        below = (op == "<" and c <= 0) or (op == "<=" and c < 0)

        def zscore() -> Any:
            n = len(vals)
            if n < 2:
                return None
            m = w._s1 / n
            m2 = w._s2 / n
            var = m2 - m * m
            # `var <= _VAR_NOISE * m2` (no spread: UNKNOWN) implies `var < _REFIT * m2`
            # unless m2 is 0; both then go the slow way, which tells them apart.
            if var < _REFIT * m2 or var <= 0.0:
                m, var = moments(n)
                if not var:
                    return None
            d = vals[-1] - w._shift - m
            if cmp is None:
                return d / sqrt(var)
            if (above and d <= 0.0) or (below and d >= 0.0):
                return False
            return cmp(d / sqrt(var), c)

        return zscore

    def median(self) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        half = len(ordered) // 2
        return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2

    def min(self) -> float | None:
        return self._min[0][1] if self._min else None

    def max(self) -> float | None:
        return self._max[0][1] if self._max else None

    def first(self) -> float | None:
        return self.values[0] if self.values else None

    def last(self) -> float | None:
        return self.values[-1] if self.values else None

    def slope(self) -> float | None:
        """Least-squares slope of value against step (points without a step are skipped)."""
        steps = self._steps
        if steps is None:
            return None
        pts = [(float(s), v) for s, v in zip(steps, self.values, strict=True) if s is not None]
        n = len(pts)
        if n < 2:
            return None
        mx = math.fsum(p[0] for p in pts) / n
        my = math.fsum(p[1] for p in pts) / n
        sxx = math.fsum((x - mx) * (x - mx) for x, _ in pts)
        if sxx == 0.0:
            return None
        return math.fsum((x - mx) * (y - my) for x, y in pts) / sxx

    def _trend_is(self, want: int) -> bool | None:
        """Whether all pairs go the `want` way; a trend needs a full point window, or 2+
        points of a time window."""
        n = len(self.values)
        if n < 2 or (self._times is None and n != self._cap):
            return None
        return self._trend == want and self._run >= n - 1

    def trend_fn(self, name: str) -> Callable[[], bool | None]:
        """increasing, decreasing or stalled of a point window as one lean closure."""
        want = _TREND_OF[name]
        w, vals, cap, pairs = self, self.values, self._cap, self._cap - 1
        if cap < 2:
            return lambda: None  # a single point has no pair: never ready

        def trend() -> bool | None:
            if len(vals) != cap:
                return None
            return w._trend == want and w._run >= pairs

        return trend

    def increasing(self) -> bool | None:
        return self._trend_is(1)

    def decreasing(self) -> bool | None:
        return self._trend_is(-1)

    def stalled(self) -> bool | None:
        return self._trend_is(0)


class Ema:
    """Exponential moving average with alpha = 2/(N+1), seeded with the first value."""

    __slots__ = ("alpha", "value")

    def __init__(self, points: int) -> None:
        self.alpha = 2.0 / (points + 1)
        self.value: float | None = None

    def push(self, v: float, t: float, step: int | None) -> None:
        """Fold one finite value into the average."""
        cur = self.value
        self.value = v if cur is None else cur + self.alpha * (v - cur)

    def get(self) -> float | None:
        return self.value

    def pusher(self) -> Callable[[float, float, int | None], None]:
        return self.push
