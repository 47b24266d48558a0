"""RuleSet: evaluates compiled rules on each row and turns results into firings.

A rule is evaluated on a row that carries at least one of its metrics, or on every row
when it uses has(), step(), elapsed(), age() or no_data() or names no metric. UNKNOWN
(None) leaves the rule's state alone. Modes: `edge` fires when the condition becomes
true (after `for_steps` consecutive true evaluations; the first true counts), `level`
fires while it stays true, at most once per `cooldown` seconds of record time.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from expr_tracker.alerts.rules.compile import Compiled, Env, Fn
from expr_tracker.alerts.rules.metric import MetricState, Update
from expr_tracker.alerts.rules.rule import CONTEXT_KEYS, PLACEHOLDER, SAFE_SPEC, Rule, parse_rule
from expr_tracker.errors import RuleError


@dataclass
class Firing:
    """One alert raised (`kind="fire"`) or cleared (`kind="recover"`) by a rule."""

    rule: str
    level: str
    kind: str
    message: str
    step: int | None
    time: float
    values: dict[str, Any]
    condition: str




class _Live:
    """A rule compiled into one RuleSet, with its firing state."""

    __slots__ = ("active", "compiled", "enabled", "every_row", "fires", "firing", "fn", "gate",
                 "last_fire", "metrics", "pure", "rule", "streak")

    def __init__(self, rule: Rule, env: Env) -> None:
        assert rule.tree is not None
        self.rule = rule
        self.compiled = Compiled(rule.tree, env)
        self.metrics: tuple[MetricState, ...] = self.compiled.metrics
        self.every_row = rule.every_row
        # The one metric whose presence decides whether a single-metric rule runs; a rule
        # of several metrics gets a closure that is UNKNOWN (no change) when all are absent.
        self.gate = self.metrics[0] if len(self.metrics) == 1 and not self.every_row else None
        self.fn = self.compiled.fn
        if self.gate is None and not self.every_row:
            self.fn = _any_present(self.metrics, self.fn)
        # Skipped on a row whose gate metric is `stale` while the rule is idle: the same
        # value gives the same false or unknown result, which changes nothing.
        self.pure = self.gate is not None and self.compiled.pure
        self.streak = 0  # consecutive true evaluations
        self.firing = False  # fired and not yet recovered
        # streak or firing: a false result changes the state only while this is set
        self.active = False
        self.fires = 0
        self.last_fire: float | None = None
        self.enabled = True  # False once max_fires is reached


def _any_present(metrics: tuple[MetricState, ...], fn: Fn) -> Fn:
    def gated() -> Any:
        for ms in metrics:
            if ms.value is not None:
                return fn()
        return None

    return gated


class RuleSet:
    """The rules of one shard, their shared windows and their firing state."""

    def __init__(self, rules: Iterable[Rule] = (), *, context: Mapping[str, Any] | None = None,
                 start_time: float | None = None) -> None:
        self._env = Env(start_time)
        self._ctx = self._env.ctx
        self._context = dict(context or {})
        self._live: list[_Live] = []
        self._time_live: list[_Live] = []
        self._mlist: tuple[MetricState, ...] = ()
        # The per-row plan, rebuilt whenever rules change: one update closure per metric
        # read, then (gate metric or None, pure, condition, rule) in the order rules were
        # added (see _Live).
        self._updates: tuple[Update, ...] = ()
        self._plan: tuple[tuple[MetricState | None, bool, Fn, _Live], ...] = ()
        self._seen: set[str] = set()
        self._sampled = 0
        self._sample_in = 1  # rows until the next one goes into _seen
        for rule in rules:
            self.add(rule)

    @property
    def rules(self) -> list[Rule]:
        return [live.rule for live in self._live]

    def __len__(self) -> int:
        return len(self._live)

    @property
    def has_time_rules(self) -> bool:
        return bool(self._time_live)

    @property
    def seen_metrics(self) -> set[str]:
        """Every user key seen in a row so far."""
        return {k for k in self._seen if not k.startswith("_")}

    def add(self, rule: Rule | str | Mapping[str, Any]) -> None:
        """Compile and add a rule; RuleError if its name is already taken."""
        if not isinstance(rule, Rule):
            rule = parse_rule(rule, index=len(self._live))
        if any(live.rule.name == rule.name for live in self._live):
            raise RuleError(f"duplicate rule name {rule.name!r}: give one of them a 'name'")
        self._live.append(_Live(rule, self._env))
        self._refresh()

    def remove(self, name: str) -> bool:
        """Drop the rule called `name` (and windows no other rule uses); False if absent."""
        for i, live in enumerate(self._live):
            if live.rule.name == name:
                del self._live[i]
                self._env.prune({id(f) for lv in self._live for f in lv.compiled.feeders})
                self._refresh()
                return True
        return False

    def _refresh(self) -> None:
        used: dict[str, MetricState] = {}
        prev: set[str] = set()
        for live in self._live:
            for ms in live.metrics:
                used.setdefault(ms.name, ms)
            prev |= live.compiled.prev_metrics
        last_record = self._ctx.last_record
        for ms in used.values():
            ms.set_track_prev(ms.name in prev, last_record)
        # Forget the last row: a metric no longer updated must not look present later, and
        # a new rule must not be skipped as `stale` on a value it has not seen yet.
        for ms in {*self._mlist, *used.values()}:
            ms.clear(last_record)
        self._mlist = tuple(used.values())
        self._time_live = [lv for lv in self._live if lv.rule.is_time_rule]
        self._updates = tuple(ms.updater(self._ctx) for ms in self._mlist)
        self._plan = tuple((lv.gate, lv.pure, lv.fn, lv) for lv in self._live)

    def observe(self, row: Mapping[str, Any], step: int | None, t: float) -> list[Firing]:
        """Evaluate the rules on one record's user keys; return the firings it caused."""
        ctx = self._ctx
        ctx.t = t
        ctx.step = step
        left = self._sample_in - 1
        if left:
            self._sample_in = left
        else:
            self._sample(row, t)
        get = row.get
        for update in self._updates:
            update(get, t, step)
        # after the updates: a metric missing from this row reads the previous row's time
        ctx.last_record = t
        out: list[Firing] = []
        for gate, pure, fn, live in self._plan:
            if gate is not None and (
                    gate.value is None or (pure and gate.stale and not live.active)):
                continue
            res = fn()
            if res:
                self._step_state(live, True, row, out)
            elif res is not None and live.active:  # None (UNKNOWN) leaves the state alone
                self._step_state(live, False, row, out)
        return out

    def _sample(self, row: Mapping[str, Any], t: float) -> None:
        # Every key logged, for "did you mean" at finish: all of the first rows, then every
        # 128th (a referenced metric's presence is tracked exactly by its MetricState).
        self._seen.update(row)
        self._sampled += 1
        self._sample_in = 1 if self._sampled < 1024 else 128
        if self._ctx.start is None:  # the first row (sampled, like all early rows)
            self._ctx.start = t

    def tick(self, t: float) -> list[Firing]:
        """Evaluate the time rules (no_data, age, elapsed) at time `t` without a new row."""
        ctx = self._ctx
        ctx.t = t
        if ctx.start is None:
            ctx.start = t
        for ms in self._mlist:
            ms.clear(ctx.last_record)
        out: list[Firing] = []
        for live in self._time_live:
            res = live.fn()
            if res is not None:
                self._step_state(live, bool(res), None, out)
        return out

    def _step_state(self, live: _Live, res: bool, row: Mapping[str, Any] | None,
                    out: list[Firing]) -> None:
        rule = live.rule
        t = self._ctx.t
        if not res:
            live.streak = 0
            live.active = False
            if live.firing:
                live.firing = False
                if rule.notify_recovery:
                    out.append(self._firing(live, "recover", row))
            return
        live.streak += 1
        live.active = True
        if live.streak < rule.for_steps or not live.enabled:
            return
        if rule.mode == "level":
            last = live.last_fire
            # A clock that went backwards (a replay, a reset) does not hold the rule back.
            if last is not None and 0.0 <= t - last < rule.cooldown:
                return
        elif live.streak != rule.for_steps:
            return
        live.fires += 1
        live.firing = True
        live.last_fire = t
        if rule.max_fires is not None and live.fires >= rule.max_fires:
            live.enabled = False
        out.append(self._firing(live, "fire", row))

    def _firing(self, live: _Live, kind: str, row: Mapping[str, Any] | None) -> Firing:
        rule = live.rule
        message = self._render(live, rule.message, row)
        if kind == "recover":
            message = f"recovered: {message}"
        values = {ms.name: ms.value for ms in live.metrics if ms.present}
        return Firing(rule.name, rule.level, kind, message, self._ctx.step, self._ctx.t, values,
                      rule.condition)

    def _render(self, live: _Live, template: str, row: Mapping[str, Any] | None) -> str:
        """Fill `{name}` / `{name:spec}` placeholders; unknown ones stay as written."""
        if "{" not in template:
            return template

        def sub(m: re.Match[str]) -> str:
            key, spec = m.group(1), m.group(2)
            if key == "expr":
                return live.compiled.trace()
            if key == "step":
                value: Any = self._ctx.step
            elif key == "value":
                value = live.compiled.primary_value()
            elif key in CONTEXT_KEYS:
                if key not in self._context:
                    return m.group(0)
                value = self._context[key]
            else:
                value = _row_value(row, key)
                if value is None:
                    return m.group(0)
            if value is None:
                return "?"
            if not spec:
                return str(value)
            if SAFE_SPEC.fullmatch(spec):
                try:
                    return format(value, spec)
                except (ValueError, TypeError, OverflowError):
                    pass
            return str(value)

        return PLACEHOLDER.sub(sub, template)

    def info(self) -> list[dict[str, Any]]:
        """Per rule: name, level, fires, firing, enabled and metrics never seen in a row."""
        return [
            {"name": lv.rule.name, "level": lv.rule.level, "fires": lv.fires,
             "firing": lv.firing, "enabled": lv.enabled,
             "unresolved_metrics": [m for m in lv.rule.metrics if not self._was_seen(m)]}
            for lv in self._live
        ]

    def never_seen(self) -> list[tuple[str, str, str | None]]:
        """(rule, metric, closest seen metric name or None) for each metric never seen."""
        seen = sorted(self.seen_metrics)
        out: list[tuple[str, str, str | None]] = []
        for lv in self._live:
            for metric in lv.rule.metrics:
                if not self._was_seen(metric):
                    close = difflib.get_close_matches(metric, seen, n=1)
                    out.append((lv.rule.name, metric, close[0] if close else None))
        return out

    def _was_seen(self, metric: str) -> bool:
        if any(ms.name == metric and (ms.present or ms.seen_t is not None)
               for ms in self._mlist):
            return True
        return metric in self._seen or ("." in metric and metric.replace(".", "/") in self._seen)


def _row_value(row: Mapping[str, Any] | None, key: str) -> Any:
    if row is None:
        return None
    value = row.get(key)
    if value is None and "." in key:
        value = row.get(key.replace(".", "/"))
    return value
