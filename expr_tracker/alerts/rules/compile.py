"""Compile a checked condition AST into a tree of zero-argument closures.

Each closure returns a number, True/False, or None for UNKNOWN (missing metric, too few
points, a non-finite input, division by zero, log of <= 0, ...). Metric leaves read the
`MetricState` that `RuleSet.observe` updates once per row, and window functions read a
`Window` shared by every rule of the same `Env`, so evaluating a rule is a handful of
Python calls and never rescans a window for the O(1) statistics.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from expr_tracker.alerts.rules.metric import Ctx, MetricState, as_number
from expr_tracker.alerts.rules.parser import (
    Binary,
    Call,
    Metric,
    Node,
    Num,
    Unary,
    is_bool,
    render,
    walk,
)
from expr_tracker.alerts.rules.windows import MINMAX, PAIRS, STEPS, SUMS, Ema, Window

Value = Any  # float | int | bool | None
Fn = Callable[[], Value]

_WINDOW_NEEDS = {
    "mean": SUMS, "std": SUMS, "var": SUMS, "sum": SUMS, "zscore": SUMS,
    "min": MINMAX, "max": MINMAX, "increasing": PAIRS, "decreasing": PAIRS, "stalled": PAIRS,
    "slope": STEPS,
}
_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_CMP = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
        "==": operator.eq, "!=": operator.ne}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


class Env:
    """Shared state of one RuleSet: the clock, metric states and windows by (metric, size)."""

    def __init__(self, start: float | None) -> None:
        self.ctx = Ctx(start)
        self.metrics: dict[str, MetricState] = {}
        self.windows: dict[tuple[str, str, float], Window | Ema] = {}

    def metric(self, name: str) -> MetricState:
        ms = self.metrics.get(name)
        if ms is None:
            ms = self.metrics[name] = MetricState(name)
        return ms

    def feeder(self, node: Metric, kind: str) -> Window | Ema:
        """The shared window (or EMA) of `node`, with the bookkeeping `kind` needs."""
        if kind == "ema":
            assert node.points is not None
            key: tuple[str, str, float] = (node.name, "ema", float(node.points))
        elif node.points is not None:
            key = (node.name, "points", float(node.points))
        else:
            assert node.seconds is not None
            key = (node.name, "seconds", node.seconds)
        feeder = self.windows.get(key)
        if feeder is None:
            feeder = Ema(int(key[2])) if kind == "ema" else Window(node.points, node.seconds)
            self.windows[key] = feeder
            self.metric(node.name).feeders.append(feeder)
        need = _WINDOW_NEEDS.get(kind)
        if need and isinstance(feeder, Window):
            feeder.require(need)
        self.metric(node.name).refresh()
        return feeder

    def prune(self, keep: set[int]) -> None:
        """Forget the windows whose id is not in `keep` (their rules were removed)."""
        for key, feeder in list(self.windows.items()):
            if id(feeder) not in keep:
                del self.windows[key]
                ms = self.metric(key[0])
                ms.feeders.remove(feeder)
                ms.refresh()


class Compiled:
    """A compiled condition: the root closure, per-node closures and what it reads."""

    def __init__(self, root: Node, env: Env) -> None:
        self.root = root
        self.env = env
        self.fns: dict[int, Fn] = {}
        self.feeders: list[Window | Ema] = []
        self.prev_metrics: set[str] = set()  # metrics whose previous value diff/rate/... read
        self.fn = self._compile(root)
        self.metrics = tuple(env.metric(n.name) for n in _unique_metrics(root))
        # The result depends on the current values alone (no window, history, step or
        # clock): the same values give the same result.
        self.pure = all(
            not (isinstance(n, Metric) and n.windowed)
            and not (isinstance(n, Call) and n.name not in _PURE)
            for n in walk(root)
        )

    def _compile(self, node: Node) -> Fn:
        fn = self._build(node)
        self.fns[id(node)] = fn
        return fn

    def _build(self, node: Node) -> Fn:
        if isinstance(node, Num):
            c = node.value
            return lambda: c
        if isinstance(node, Metric):
            ms = self.env.metric(node.name)
            return lambda: ms.cur
        if isinstance(node, Unary):
            f = self._compile(node.operand)
            if node.op == "not":
                f = _truth(f, node.operand)
                return lambda: None if (v := f()) is None else not v
            return lambda: None if (v := f()) is None else -v
        if isinstance(node, Binary):
            return self._binary(node)
        assert isinstance(node, Call)
        return self._call(node)

    def _binary(self, node: Binary) -> Fn:
        op = node.op
        lf = self._compile(node.left)
        rf = self._compile(node.right)
        if op in ("and", "or"):
            guarded = _nonfinite_guard(node)
            if guarded is not None:
                return _nonfinite(self.env.metric(guarded))
            return _logic(op == "and", _truth(lf, node.left), _truth(rf, node.right))
        if op in _CMP:
            left, right = node.left, node.right
            if isinstance(left, Num) and not isinstance(right, Num):
                op, left, right, lf, rf = _FLIP[op], right, left, rf, lf
            if isinstance(right, Num):
                c = right.value
                if isinstance(left, Metric):
                    ms = self.env.metric(left.name)
                    return _cmp_metric_const(op, ms, c)
                if _is_point_call(left, "zscore"):  # the spike rule: compare inside the window
                    assert isinstance(left, Call) and isinstance(left.args[0], Metric)
                    feeder = self.env.feeder(left.args[0], "zscore")
                    assert isinstance(feeder, Window)
                    return feeder.zscore_fn(op, c)
                return _cmp_const(op, lf, c)
            cmp = _CMP[op]
            return lambda: (None if (a := lf()) is None or (b := rf()) is None else cmp(a, b))
        return _arith(op, lf, rf)

    def _call(self, node: Call) -> Fn:
        name, args = node.name, node.args
        ctx = self.env.ctx
        if name in ("min", "max") and len(args) == 2:
            af, bf = self._compile(args[0]), self._compile(args[1])
            pick = min if name == "min" else max
            return lambda: None if (a := af()) is None or (b := bf()) is None else pick(a, b)
        if name == "step":
            return lambda: ctx.step
        if name == "elapsed":
            return lambda: None if ctx.start is None else ctx.t - ctx.start
        if name == "no_data":
            arg = args[0]
            assert isinstance(arg, Num)
            return _no_data(ctx, arg.value)
        arg = args[0]
        if isinstance(arg, Metric) and arg.windowed:
            self.fns[id(arg)] = lambda: None  # a window has no single value of its own
            return self._window_call(name, arg)
        if isinstance(arg, Metric) and name not in _MATH:
            self.fns[id(arg)] = self._build(arg)
            if name in _CHANGE:
                self.prev_metrics.add(arg.name)
            return _metric_func(name, self.env.metric(arg.name), ctx)
        return _math(name, self._compile(arg))

    def _window_call(self, name: str, arg: Metric) -> Fn:
        feeder = self.env.feeder(arg, name)
        self.feeders.append(feeder)
        if isinstance(feeder, Ema):
            return feeder.get
        method: Fn = getattr(feeder, name)
        if not feeder.is_time:
            return feeder.trend_fn(name) if name in _TRENDS else method
        # A time window also shrinks when no new point arrives: evict by the current time.
        evict, ctx = feeder.evict, self.env.ctx

        def timed() -> Value:
            evict(ctx.t)
            return method()

        return timed

    def trace(self) -> str:
        """The condition with the values observed in the current row written in."""
        values: dict[int, str] = {}
        for node in walk(self.root):
            if isinstance(node, Metric) and not node.windowed:
                values[id(node)] = "=" + fmt(self.env.metric(node.name).value)
            elif isinstance(node, Call) and not is_bool(node) and node.name not in _NO_TRACE:
                values[id(node)] = "=" + fmt(self.fns[id(node)]())
        return render(self.root, values=values)

    def primary_value(self, node: Node | None = None) -> Value:
        """The value a message's `{value}` shows: what the condition mainly looked at."""
        node = self.root if node is None else node
        if isinstance(node, Binary) and node.op in ("and", "or"):
            for child in (node.left, node.right):
                if self.fns[id(child)]():
                    return self.primary_value(child)
            return self.primary_value(node.left)
        if isinstance(node, Binary) and node.op in _CMP:
            side = node.right if isinstance(node.left, Num) else node.left
            return self.fns[id(side)]()
        if isinstance(node, Unary) and node.op == "not":
            return self.primary_value(node.operand)
        if isinstance(node, Call) and node.name == "no_data":
            ctx = self.env.ctx
            ref = ctx.last_record if ctx.last_record is not None else ctx.start
            return None if ref is None else ctx.t - ref
        if isinstance(node, Call) and node.args and isinstance(node.args[0], Metric):
            ms = self.env.metric(node.args[0].name)
            return ms.value if node.name in ("isnan", "isinf", "has") or ms.present else None
        return self.fns[id(node)]()


_MATH = frozenset(("abs", "log", "exp", "sqrt", "floor", "ceil"))
_CHANGE = frozenset(("diff", "rate", "pct_change"))
_TRENDS = frozenset(("increasing", "decreasing", "stalled"))
_PURE = _MATH | {"isnan", "isinf", "min", "max"}  # min/max of a window need a window
_NO_TRACE = frozenset(("step",))


def fmt(value: Any) -> str:
    """A short, readable form of an observed value."""
    if value is None:
        return "?"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int):
        return str(value)
    return repr(value)


def _unique_metrics(root: Node) -> list[Metric]:
    seen: dict[str, Metric] = {}
    for node in walk(root):
        if isinstance(node, Metric):
            seen.setdefault(node.name, node)
    return list(seen.values())


def _truth(f: Fn, node: Node) -> Fn:
    """`f` as a condition: a number is true when non-zero."""
    if is_bool(node):
        return f
    return lambda: None if (v := f()) is None else v != 0


def _logic(is_and: bool, lf: Fn, rf: Fn) -> Fn:
    """Kleene and/or: a decisive side wins over an UNKNOWN one."""
    if is_and:
        def both() -> Value:
            a = lf()
            if a is False:
                return False
            b = rf()
            if b is False:
                return False
            return None if a is None or b is None else True

        return both

    def either() -> Value:
        a = lf()
        if a is True:
            return True
        b = rf()
        if b is True:
            return True
        return None if a is None or b is None else False

    return either


def _cmp_const(op: str, f: Fn, c: float) -> Fn:
    # One closure per operator: the hot path is `metric-ish OP constant`.
    if op == ">":
        return lambda: None if (v := f()) is None else v > c
    if op == ">=":
        return lambda: None if (v := f()) is None else v >= c
    if op == "<":
        return lambda: None if (v := f()) is None else v < c
    if op == "<=":
        return lambda: None if (v := f()) is None else v <= c
    if op == "==":
        return lambda: None if (v := f()) is None else v == c
    return lambda: None if (v := f()) is None else v != c


def _cmp_metric_const(op: str, ms: MetricState, c: float) -> Fn:
    if op == ">":
        return lambda: None if (v := ms.cur) is None else v > c
    if op == ">=":
        return lambda: None if (v := ms.cur) is None else v >= c
    if op == "<":
        return lambda: None if (v := ms.cur) is None else v < c
    if op == "<=":
        return lambda: None if (v := ms.cur) is None else v <= c
    if op == "==":
        return lambda: None if (v := ms.cur) is None else v == c
    return lambda: None if (v := ms.cur) is None else v != c


def _arith(op: str, lf: Fn, rf: Fn) -> Fn:
    if op in _ARITH:
        fn = _ARITH[op]

        def arith() -> Value:
            a = lf()
            if a is None:
                return None
            b = rf()
            if b is None:
                return None
            r = fn(a, b)
            return r if r - r == 0 else None  # overflow to inf is UNKNOWN

        return arith
    is_div = op == "/"

    def divide() -> Value:
        a = lf()
        if a is None:
            return None
        b = rf()
        if b is None or b == 0:
            return None
        r = a / b if is_div else a % b
        return r if r - r == 0 else None

    return divide


def _math(name: str, f: Fn) -> Fn:
    if name == "abs":
        return lambda: None if (v := f()) is None else abs(v)
    if name == "floor":
        return lambda: None if (v := f()) is None else float(math.floor(v))
    if name == "ceil":
        return lambda: None if (v := f()) is None else float(math.ceil(v))
    if name == "sqrt":
        return lambda: None if (v := f()) is None or v < 0 else math.sqrt(v)
    if name == "log":
        return lambda: None if (v := f()) is None or v <= 0 else math.log(v)

    def exp() -> Value:
        v = f()
        if v is None or v > 709.0:  # math.exp overflows past ~709.78
            return None
        return math.exp(v)

    return exp


def _metric_func(name: str, ms: MetricState, ctx: Ctx) -> Fn:
    if name == "isnan":

        def isnan() -> Value:
            v = ms.value
            if v.__class__ is not float and (v := as_number(v)) is None:
                return None
            return v != v

        return isnan
    if name == "isinf":

        def isinf() -> Value:
            v = ms.value
            if v.__class__ is not float and (v := as_number(v)) is None:
                return None
            return v in (math.inf, -math.inf)

        return isinf
    if name == "has":
        return lambda: ms.value is not None
    if name == "age":

        def age() -> Value:
            if ms.value is not None:
                return 0.0
            return None if (s := ms.seen_t) is None else ctx.t - s

        return age

    def change() -> Value:
        cur, prev = ms.cur, ms.prev
        if cur is None or prev is None or prev - prev != 0:
            return None
        d = cur - prev
        if name == "diff":
            return d
        if name == "pct_change":
            return None if prev == 0 else d / abs(prev)
        dt = ms.last_t - ms.prev_t
        return d / dt if dt > 0 else None

    return change


def _is_point_call(node: Node, name: str) -> bool:
    """`node` is `name(metric[N points])`."""
    return (isinstance(node, Call) and node.name == name and isinstance(node.args[0], Metric)
            and node.args[0].points is not None)


def _nonfinite_guard(node: Binary) -> str | None:
    """The metric of `isnan(m) or isinf(m)` (either order), the usual divergence guard."""
    left, right = node.left, node.right
    if (node.op == "or" and isinstance(left, Call) and isinstance(right, Call)
            and {left.name, right.name} == {"isnan", "isinf"}):
        a, b = left.args[0], right.args[0]
        if (isinstance(a, Metric) and isinstance(b, Metric) and a.name == b.name
                and not a.windowed and not b.windowed):
            return a.name
    return None


def _nonfinite(ms: MetricState) -> Fn:
    # One closure instead of three (or, isnan, isinf): inf - inf and nan - x are nan.
    def nonfinite() -> Value:
        v = ms.value
        if v.__class__ is not float and (v := as_number(v)) is None:
            return None
        return v - v != 0.0

    return nonfinite


def _no_data(ctx: Ctx, seconds: float) -> Fn:
    def no_data() -> Value:
        ref = ctx.last_record if ctx.last_record is not None else ctx.start
        return None if ref is None else ctx.t - ref >= seconds

    return no_data

