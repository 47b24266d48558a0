"""Is a rank noisier? Per-rank variability over a window of steps (issue 21). Pure, no I/O.

A rank's variability is the population standard deviation (ddof 0, as DESIGN 10's `std`)
of its own values across the window's steps, and its coefficient of variation, std over
|mean|. A rank is *noisier* when its variability is an outlier among the ranks by the
rule DESIGN 10 applies to values (`reduce.outliers`: robust score over 3.5 and at least
`min_rel` from the median), and above the median: a steadier rank is not news.

The CV is compared when every rank's mean is non-zero (it does not care whether a rank
runs at 0.3 s or 0.31 s per step); otherwise the std is (a CV of a mean near 0 is noise).
A rank with fewer than two values in the window has no variability and is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from expr_tracker.stats.reduce import _mean, _pct, _std, outliers


@dataclass(frozen=True)
class RankSpread:
    """One rank's variability over the window."""

    rank: int
    n: int
    mean: float
    std: float
    cv: float | None  # std / |mean|; None when the mean is 0


@dataclass(frozen=True)
class Variability:
    """Every rank's variability of one key, and the ranks that are noisier than the rest."""

    by: str  # "cv" or "std": what the ranks were compared on
    median: float | None  # the ranks' median of `by`
    ranks: list[RankSpread]
    noisier: list[dict[str, Any]]  # {rank, std, cv, robust, ratio}, noisiest first

    def as_dict(self, per_rank: bool = True) -> dict[str, Any]:
        """A JSON-ready dict; every rank's std and CV only with `per_rank`."""
        out = {"by": self.by, "median": self.median, "n_ranks": len(self.ranks),
               "noisier": self.noisier}
        if per_rank:
            out["ranks"] = [asdict(r) for r in self.ranks]
        return out


def spread(rank: int, xs: Sequence[float]) -> RankSpread | None:
    """One rank's std and CV over its finite values `xs` (None with fewer than two)."""
    try:
        total = math.fsum(xs)
    except (OverflowError, ValueError):
        total = math.nan
    if total - total != 0.0:  # a non-finite value (or a sum past a float): the slow path
        xs = [x for x in xs if math.isfinite(x)]
        total = math.nan
    n = len(xs)
    if n < 2:
        return None
    m = total / n if total == total else _mean(xs)
    sd = _std(xs, m)
    if sd <= 1e-12 * abs(m) and list(xs).count(xs[0]) == n:
        sd = 0.0  # equal values: exactly 0, not the rounding of their mean
    return RankSpread(rank, n, m, sd, sd / abs(m) if m != 0.0 else None)


def variability(values: Mapping[int, Sequence[float]], threshold: float = 3.5,
                min_rel: float = 0.05) -> Variability:
    """Per-rank variability of `values` (rank -> its values across steps) and the noisier ranks."""
    ranks = [s for r in sorted(values) if (s := spread(r, values[r])) is not None]
    use_cv = bool(ranks) and all(s.cv is not None for s in ranks)
    by = "cv" if use_cv else "std"
    basis = {s.rank: (s.cv if use_cv else s.std) for s in ranks}
    score = {r: v for r, v in basis.items() if v is not None}
    med = _pct(sorted(score.values()), 0.5) if score else None
    found: list[tuple[float, dict[str, Any]]] = []
    for o in outliers(score, threshold, min_rel):
        if o.flagged and med is not None and o.value > med:
            s = next(x for x in ranks if x.rank == o.rank)
            found.append((o.value, {"rank": o.rank, "std": s.std, "cv": s.cv,
                                    "robust": o.robust, "ratio": o.ratio}))
    found.sort(key=lambda p: -p[0])  # the noisiest first
    noisier = [d for _, d in found]
    return Variability(by, med, ranks, noisier)


def weighted_gap(n: int, mean: float | None, wmean: float | None, std: float | None,
                 z: float = 2.0) -> dict[str, Any] | None:
    """Does the weighted mean differ from the mean by more than the spread explains?

    The rule: |wmean - mean| > z * std / sqrt(n), twice the standard error of the mean
    of the n rank values. A gap that large means the weights go with the values (heavy
    ranks report higher, or lower, values), not that weighting reshuffled noise. None
    when there is nothing to compare (fewer than two ranks, no weighted mean).
    """
    if n < 2 or mean is None or wmean is None or std is None:
        return None
    gap = wmean - mean
    se = std / math.sqrt(n)
    return {"gap": gap, "se": se, "z": z, "differs": abs(gap) > z * se and gap != 0.0,
            "rel": gap / abs(mean) if mean != 0.0 else None}
