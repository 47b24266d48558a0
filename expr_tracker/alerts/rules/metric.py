"""What the current row says about each metric the rules read, and how a row updates it.

`RuleSet.observe` calls one update closure per referenced metric per row. The closure is
chosen when the rules change for exactly what they use (how many windows to feed, whether
diff/rate/pct_change need the previous value), so a row of finite floats costs a dict
lookup, two stores and the window pushes, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from expr_tracker.alerts.rules.windows import Ema, Window

Push = Callable[[float, float, "int | None"], None]
Get = Callable[[str], Any]
Update = Callable[[Get, float, "int | None"], None]


class Ctx:
    """The time, step and clock of the row (or tick) being evaluated."""

    __slots__ = ("last_record", "start", "step", "t")

    def __init__(self, start: float | None) -> None:
        self.t = 0.0
        self.step: int | None = None
        self.start = start
        self.last_record: float | None = None


class MetricState:
    """What the current row said about one metric, and what its functions need of the past."""

    __slots__ = ("alias", "cur", "feeders", "last", "last_t", "name", "prev", "prev_t",
                 "pushers", "seen_t", "stale", "track_prev", "value")

    def __init__(self, name: str) -> None:
        self.name = name
        # `eval.acc` also matches the metric `eval/acc` when `eval.acc` itself is absent.
        self.alias = name.replace(".", "/") if "." in name else None
        self.value: Any = None  # as given in the current row; None when the row lacks it
        self.cur: float | None = None  # the value as a finite float, else None (UNKNOWN)
        # The row carries the very object of the previous row (a constant lr, say), so a
        # rule of current values alone would repeat its last result. Only set for metrics
        # without windows or history, whose state such a row leaves unchanged.
        self.stale = False
        # Time of the last row that carried the metric, written when a row first lacks it
        # (while it is present its age is 0), so rows that carry it pay nothing for age().
        self.seen_t: float | None = None
        # Last two numeric values (non-finite included) and their times, kept only while
        # a rule uses diff, rate or pct_change (`track_prev`).
        self.track_prev = False
        self.last: float | None = None
        self.prev: float | None = None
        self.last_t = self.prev_t = 0.0
        self.feeders: list[Window | Ema] = []
        # Bound push methods of the feeders, refreshed whenever their bookkeeping changes.
        self.pushers: list[Push] = []

    @property
    def present(self) -> bool:
        """The current row has a non-None value for the metric."""
        return self.value is not None

    def refresh(self) -> None:
        self.pushers = [f.pusher() for f in self.feeders]

    def clear(self, last_record: float | None) -> None:
        """Forget the current row (a tick has none); `last_record` is the last row's time."""
        if self.value is not None:
            self.seen_t = last_record
            self.value = self.cur = None
        self.stale = False

    def set_track_prev(self, on: bool, last_record: float | None) -> None:
        """Keep the previous value for diff/rate/pct_change, from the last row on."""
        if on and not self.track_prev:
            # Not kept while no rule needed it: start from the last row's value, if any.
            self.last = as_number(self.value)
            self.last_t = last_record or 0.0
            self.prev = None
            self.prev_t = 0.0
        self.track_prev = on

    def updater(self, ctx: Ctx) -> Update:
        """The closure that reads this metric from a row (`row.get`, time, step)."""
        ms, name = self, self.name
        general = self._general(ctx)
        pushers = tuple(self.pushers)
        if self.track_prev or len(pushers) > 2:

            def update_any(get: Get, t: float, step: int | None) -> None:
                general(get(name), get, t, step)

            return update_any
        # The common row: a finite float under the metric's own name. Anything else (absent,
        # an alias, int, text, NaN) takes the general path.
        if not pushers:

            def update(get: Get, t: float, step: int | None) -> None:
                v = get(name)
                if v.__class__ is float and v - v == 0.0:
                    if v is ms.value:
                        ms.stale = True
                        return
                    ms.value = ms.cur = v
                    ms.stale = False
                else:
                    general(v, get, t, step)

            return update
        if len(pushers) == 1:
            (push,) = pushers

            def update_1(get: Get, t: float, step: int | None) -> None:
                v = get(name)
                if v.__class__ is float and v - v == 0.0:
                    ms.value = ms.cur = v
                    push(v, t, step)
                else:
                    general(v, get, t, step)

            return update_1
        push, push2 = pushers

        def update_2(get: Get, t: float, step: int | None) -> None:
            v = get(name)
            if v.__class__ is float and v - v == 0.0:
                ms.value = ms.cur = v
                push(v, t, step)
                push2(v, t, step)
            else:
                general(v, get, t, step)

        return update_2

    def _general(self, ctx: Ctx) -> Callable[[Any, Get, float, int | None], None]:
        ms, alias, pushers, track_prev = self, self.alias, tuple(self.pushers), self.track_prev

        def general(v: Any, get: Get, t: float, step: int | None) -> None:
            if v is None and alias is not None:
                v = get(alias)
            if v is None:
                if ms.value is not None:
                    # observe() stamps last_record after the updates: it is still the
                    # previous row's time, the last row that carried the metric.
                    ms.seen_t = ctx.last_record
                    ms.value = ms.cur = None
                return
            ms.value = v
            ms.stale = False
            if v.__class__ is not float:
                v = as_number(v)
                if v is None:
                    ms.cur = None
                    return
            if track_prev:
                ms.prev = ms.last
                ms.prev_t = ms.last_t
                ms.last = v
                ms.last_t = t
            if v - v == 0.0:
                ms.cur = v
                for push in pushers:
                    push(v, t, step)
            else:
                ms.cur = None  # non-finite: isnan/isinf see it, windows and arithmetic do not

        return general


def as_number(v: Any) -> float | None:
    """A row value as a float (non-finite included), or None for text and non-numbers."""
    if v.__class__ is float:
        return v
    if v is None or v.__class__ is str or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:  # an int beyond float range has no usable value
        return None
