"""Evaluating rule conditions: every function against numpy/statistics, and UNKNOWN."""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from expr_tracker.alerts.rules import RuleSet, parse_rule

Row = tuple[dict[str, Any], "int | None", float]


def probe(expr: str, rows: list[Row], start: float = 0.0) -> list[Any]:
    """The value of `expr` after each row (None when UNKNOWN), read from `{value}`."""
    rules = RuleSet([parse_rule({"name": "p", "condition": f"({expr}) > -1e308",
                                 "message": "{value}", "mode": "level", "cooldown": 0})],
                    start_time=start)
    out: list[Any] = []
    for row, step, t in rows:
        fired = rules.observe(row, step, t)
        if not fired:
            out.append(None)
            continue
        text = fired[0].message
        out.append({"True": True, "False": False}.get(text, None if text == "?" else text))
        if isinstance(out[-1], str):
            out[-1] = float(out[-1])
    return out


def truth(expr: str, row: dict[str, Any]) -> str:
    """'T', 'F' or 'U' for `expr` on one row."""
    rules = RuleSet([
        parse_rule({"name": "yes", "condition": expr}),
        parse_rule({"name": "no", "condition": f"not ({expr})"}),
    ])
    names = {f.rule for f in rules.observe(row, 1, 1.0)}
    assert names != {"yes", "no"}
    return "T" if "yes" in names else "F" if "no" in names else "U"


def series(n: int, seed: int, offset: float = 0.0, scale: float = 1.0,
           t: float = 1000.0) -> list[Row]:
    rng = random.Random(seed)
    rows: list[Row] = []
    for i in range(n):
        t += rng.uniform(0.5, 5.0)
        rows.append(({"x": offset + scale * rng.gauss(0.0, 1.0)}, i * 2, t))
    return rows


def close(got: Any, want: Any, rel: float = 1e-9, abs_: float = 1e-9) -> bool:
    if want is None or got is None:
        return got is None and want is None
    return bool(got == pytest.approx(want, rel=rel, abs=abs_))


N = 20
POINT_REFS: dict[str, Callable[[Any], Any]] = {
    "mean": np.mean, "std": np.std, "var": np.var, "median": statistics.median, "sum": np.sum,
    "min": np.min, "max": np.max, "first": lambda w: w[0], "last": lambda w: w[-1],
    "count": len,
}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(POINT_REFS))
def test_point_aggregates_match_numpy(name: str, seed: int) -> None:
    rows = series(200, seed)
    xs = [r[0]["x"] for r in rows]
    got = probe(f"{name}(x[{N}])", rows)
    for i, value in enumerate(got):
        window = np.array(xs[max(0, i - N + 1) : i + 1])
        want = float(POINT_REFS[name](window))
        assert close(value, want), (name, i, value, want)


@pytest.mark.parametrize("name", sorted(POINT_REFS))
def test_time_aggregates_match_numpy(name: str) -> None:
    rows = series(200, 7)
    got = probe(f"{name}(x[30s])", rows)
    for i, value in enumerate(got):
        now = rows[i][2]
        window = np.array([r[0]["x"] for r in rows[: i + 1] if r[2] > now - 30.0])
        assert close(value, float(POINT_REFS[name](window))), (name, i)


def test_variance_stays_accurate_on_offset_data_and_regime_change() -> None:
    rows = series(300, 3, offset=1e6, scale=1e-2) + series(300, 4, offset=-5.0, scale=1e-3, t=5000.0)
    xs = [r[0]["x"] for r in rows]
    refs: list[tuple[str, Any]] = [("std", np.std), ("zscore", None), ("mean", np.mean)]
    for name, ref in refs:
        got = probe(f"{name}(x[25])", rows)
        for i, value in enumerate(got):
            window = np.array(xs[max(0, i - 24) : i + 1])
            want: float | None
            if ref is not None:
                want = float(ref(window))
            else:
                want = float((window[-1] - window.mean()) / window.std()) if i else None
            # Points near 1e6 carry ~1e-10 of rounding: compare z-scores to 1e-6.
            tol = 1e-6 if name == "zscore" else 1e-9
            assert close(value, want, rel=1e-6, abs_=tol), (name, i, value, want)


def test_slope_zscore_ema_match_reference() -> None:
    rows = series(200, 11)
    xs = [r[0]["x"] for r in rows]
    steps = [float(r[1] or 0) for r in rows]
    slope, zscore, ema = (probe(f"{f}(x[{N}])", rows) for f in ("slope", "zscore", "ema"))
    alpha = 2.0 / (N + 1)
    avg = xs[0]
    for i in range(len(rows)):
        lo = max(0, i - N + 1)
        window = np.array(xs[lo : i + 1])
        if i == 0:
            assert slope[i] is None and zscore[i] is None
        else:
            assert close(slope[i], float(np.polyfit(steps[lo : i + 1], window, 1)[0]), rel=1e-7)
            assert close(zscore[i], float((window[-1] - window.mean()) / window.std()))
        avg = avg if i == 0 else avg + alpha * (xs[i] - avg)
        assert close(ema[i], avg)


def test_diff_rate_pct_change_match_reference() -> None:
    rows = series(200, 5)
    xs = [r[0]["x"] for r in rows]
    ts = [r[2] for r in rows]
    diff, rate, pct = (probe(f"{f}(x)", rows) for f in ("diff", "rate", "pct_change"))
    assert diff[0] is None and rate[0] is None and pct[0] is None
    for i in range(1, len(rows)):
        d = xs[i] - xs[i - 1]
        assert close(diff[i], d)
        assert close(rate[i], d / (ts[i] - ts[i - 1]))
        assert close(pct[i], d / abs(xs[i - 1]))


def test_trend_functions() -> None:
    values = [1, 2, 3, 4, 4, 4, 4, 3, 2, 1, 0]
    rows: list[Row] = [({"x": float(v)}, i, float(i)) for i, v in enumerate(values)]
    inc = probe("increasing(x[4])", rows)
    dec = probe("decreasing(x[4])", rows)
    stall = probe("stalled(x[4])", rows)
    assert inc == [None, None, None, True, False, False, False, False, False, False, False]
    assert dec == [None, None, None, False, False, False, False, False, False, True, True]
    assert stall == [None, None, None, False, False, False, True, False, False, False, False]
    # A time window needs only two points.
    assert probe("increasing(x[2s])", rows)[:3] == [None, True, True]


def test_scalar_functions_and_arithmetic() -> None:
    row: list[Row] = [({"x": 2.5, "y": -4.0}, 3, 10.0)]
    cases = {
        "abs(y)": 4.0, "log(x)": math.log(2.5), "exp(x)": math.exp(2.5), "sqrt(x)": math.sqrt(2.5),
        "floor(x)": 2.0, "ceil(x)": 3.0, "min(x, y)": -4.0, "max(x, y + 10)": 6.0,
        "x + y * 2": -5.5, "(x + y) * 2": -3.0, "x % 2": 0.5, "-x - -y": -6.5, "y / x": -1.6,
        "step()": 3.0, "elapsed()": 4.0, "x + 1e-3": 2.501, "age(x)": 0.0,
    }
    for expr, want in cases.items():
        assert close(probe(expr, row, start=6.0)[0], want), expr


def test_three_valued_logic_table() -> None:
    values = {"T": 1.0, "F": -1.0, "U": "n/a"}
    kleene_and = {("T", "T"): "T", ("T", "F"): "F", ("T", "U"): "U", ("F", "T"): "F",
                  ("F", "F"): "F", ("F", "U"): "F", ("U", "T"): "U", ("U", "F"): "F",
                  ("U", "U"): "U"}
    for (a, b), want in kleene_and.items():
        row = {"a": values[a], "b": values[b]}
        assert truth("a > 0 and b > 0", row) == want, (a, b)
        want_or = {"T": "F", "F": "T", "U": "U"}[kleene_and[({"T": "F", "F": "T", "U": "U"}[a],
                                                             {"T": "F", "F": "T", "U": "U"}[b])]]
        assert truth("a > 0 or b > 0", row) == want_or, (a, b)
    assert [truth("not a > 0", {"a": values[v]}) for v in "TFU"] == ["F", "T", "U"]


@pytest.mark.parametrize(
    ("expr", "row", "want"),
    [
        ("x > 1", {"x": math.nan}, "U"),
        ("x > 1", {"x": math.inf}, "U"),
        ("x < 1", {"x": -math.inf}, "U"),
        ("isnan(x)", {"x": math.nan}, "T"),
        ("isnan(x)", {"x": 1.0}, "F"),
        ("isinf(x)", {"x": -math.inf}, "T"),
        ("isinf(x)", {"x": math.nan}, "F"),
        ("isnan(x)", {"x": "text"}, "U"),
        ("x > 1", {"x": "text"}, "U"),
        ("x > 1", {"x": None, "y": 1}, "U"),
        ("x > 1 or y > 0", {"y": 1}, "T"),
        ("x > 1 and y > 0", {"y": 1}, "U"),
        ("x > 1 and y > 5", {"y": 1}, "F"),
        ("has(x)", {"x": "text"}, "T"),
        ("has(x)", {"x": None, "y": 1}, "F"),
        ("x / y > 0", {"x": 1.0, "y": 0.0}, "U"),
        ("x % y > 0", {"x": 1.0, "y": 0}, "U"),
        ("log(x) > 0", {"x": 0.0}, "U"),
        ("sqrt(x) > 0", {"x": -1.0}, "U"),
        ("exp(x) > 0", {"x": 1000.0}, "U"),
        ("x * x > 0", {"x": 1e200}, "U"),
        ("x > 0", {"x": True}, "T"),
        ("x + 1 == 1", {"x": False}, "T"),
        ("x > 10", {"x": 11}, "T"),
        ("zscore(x[5]) > 0", {"x": 1.0}, "U"),
        ("mean(x[5]) > 0", {"x": math.nan}, "U"),
        ("count(x[5]) == 0", {"x": math.nan}, "T"),
        ("diff(x) > 0", {"x": 1.0}, "U"),
        ("x", {"x": 1.0}, "error"),
        ("x and y", {"x": 2.0, "y": 0.0}, "F"),
        ("x or y", {"x": 2.0, "y": "n/a"}, "T"),
        ("isnan(x) + 1 > 1", {"x": math.nan}, "T"),
        ("isnan(x) or isinf(x)", {"x": math.inf}, "T"),
        ("isinf(x) or isnan(x)", {"x": math.nan}, "T"),
        ("isnan(x) or isinf(x)", {"x": 1.5}, "F"),
        ("isnan(x) or isinf(x)", {"x": 3}, "F"),
        ("isnan(x) or isinf(x)", {"x": "text"}, "U"),
        ("isnan(x) or isinf(x)", {"x": 10**400}, "U"),
        ("isnan(x) or isinf(x)", {"y": 1.0}, "U"),
        ("eval.acc < 0.5", {"eval/acc": 0.3}, "T"),
        ("eval.acc < 0.5", {"eval.acc": 0.9, "eval/acc": 0.3}, "F"),
        ("`val loss` > 1", {"val loss": 2.0}, "T"),
        ("train/loss / 2 > 1", {"train/loss": 4.0}, "T"),
    ],
)
def test_unknown_and_values(expr: str, row: dict[str, Any], want: str) -> None:
    if want == "error":
        with pytest.raises(ValueError):
            truth(expr, row)
        return
    assert truth(expr, row) == want


def test_non_finite_and_text_values_stay_out_of_windows() -> None:
    values: list[Any] = [1.0, math.nan, 3.0, math.inf, "x", None, True, -math.inf]
    rows: list[Row] = [({"x": v, "y": 0}, i, float(i)) for i, v in enumerate(values)]
    assert probe("count(x[10])", rows)[-1] == 3.0
    assert probe("mean(x[10])", rows)[-1] == pytest.approx(5 / 3)
    assert probe("diff(x)", rows)[:4] == [None, None, None, None]


def test_time_window_shrinks_without_new_points() -> None:
    rows: list[Row] = [({"x": 1.0}, 0, 0.0), ({"x": 2.0}, 1, 1.0), ({"x": 3.0}, 2, 2.0),
                       ({"y": 0}, 3, 5.0), ({"y": 0}, 4, 11.5), ({"y": 0}, 5, 12.0)]
    # has(y) makes the rule run on every row, including those without x.
    assert probe("count(x[10s]) + 0 * has(y)", rows) == [1.0, 2.0, 3.0, 3.0, 1.0, 0.0]
    assert probe("sum(x[10s]) + 0 * has(y)", rows) == [1.0, 3.0, 6.0, 6.0, 3.0, None]


def test_point_window_fed_only_when_metric_present() -> None:
    rows: list[Row] = [({"x": 1.0}, 0, 0.0), ({"y": 5.0}, 1, 1.0), ({"x": 3.0}, 2, 2.0),
                       ({"y": 5.0, "x": None}, 3, 3.0), ({"x": 5.0}, 4, 4.0)]
    assert probe("mean(x[2]) + 0 * has(y)", rows) == [1.0, 1.0, 2.0, 2.0, 4.0]


def test_duration_literals_are_seconds() -> None:
    rows: list[Row] = [({"x": 1.0}, 0, 0.0), ({"y": 1.0}, 1, 400.0)]
    assert probe("age(x) - 5m", rows) == [-300.0, 100.0]


def test_flat_window_after_a_level_change_has_zero_spread() -> None:
    rows = series(100, 9, offset=1e3, scale=5.0)
    t = rows[-1][2]
    rows += [({"x": 0.1}, 1000 + i, t + i + 1.0) for i in range(40)]
    assert probe("std(x[20])", rows)[-1] == 0.0
    assert probe("var(x[20])", rows)[-1] == 0.0
    assert probe("zscore(x[20])", rows)[-1] is None
    assert probe("stalled(x[20])", rows)[-1] is True
    assert probe("mean(x[20])", rows)[-1] == pytest.approx(0.1, rel=1e-12)


def test_window_statistics_do_not_rescan() -> None:
    # 60k points into a 1M-point window: an O(window) rescan per row would take many
    # seconds; the running sums and pair counts take well under one.
    rules = RuleSet([parse_rule("zscore(x[1000000]) > 100 or mean(x[1000000]) < -1e9"),
                     parse_rule("stalled(x[1000000]) or std(x[1000000]) > 1e9")])
    rng = random.Random(0)
    started = time.perf_counter()
    for i in range(60_000):
        assert rules.observe({"x": rng.random()}, i, float(i)) == []
    assert time.perf_counter() - started < 3.0


@pytest.mark.parametrize("seconds", [False, True])
def test_trends_match_a_rescan_with_ties_and_gaps(seconds: bool) -> None:
    rng = random.Random(13)
    rows: list[Row] = []
    t = 0.0
    for i in range(300):
        t += rng.choice([0.5, 1.0, 3.0])
        v = rng.choice([1.0, 2.0, 3.0]) if rng.random() < 0.5 else float(i % 4 == 0)
        rows.append(({"x": v} if rng.random() < 0.9 else {"y": 1.0}, i, t))
    window = "x[4s]" if seconds else "x[4]"
    for name, pair in (("increasing", lambda a, b: b > a), ("decreasing", lambda a, b: b < a),
                       ("stalled", lambda a, b: b == a)):
        got = probe(f"{name}({window}) or not has(x) and has(y)", rows)
        seen: list[tuple[float, float]] = []
        for i, (row, _, now) in enumerate(rows):
            if "x" not in row:
                continue  # the has(y) row: the rule is true whatever the window holds
            seen.append((now, row["x"]))
            held = [v for ts, v in seen if ts > now - 4.0] if seconds else [v for _, v in seen[-4:]]
            ready = len(held) >= 2 and (seconds or len(held) == 4)
            want = all(pair(a, b) for a, b in itertools.pairwise(held)) if ready else None
            assert got[i] == want, (name, i, held)


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
@pytest.mark.parametrize("c", [-1.0, 0.0, 0.5])
def test_zscore_compared_to_a_constant_matches_the_zscore(op: str, c: float) -> None:
    rows = series(120, 17)
    rows += [({"x": 2.0}, 500 + i, 2000.0 + i) for i in range(8)]  # a flat window: UNKNOWN
    zs = probe("zscore(x[6])", rows)
    got = probe(f"zscore(x[6]) {op} {c}", rows)
    cmp = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__,
           "==": float.__eq__, "!=": float.__ne__}[op]
    assert got == [None if z is None else cmp(z, c) for z in zs]
    assert zs[-1] is None and None not in zs[1:100]
