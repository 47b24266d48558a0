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

from expr_tracker.errors import RuleError
from expr_tracker.rules.compile import Compiled, Env, MetricState
from expr_tracker.rules.rule import Rule, parse_rule


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


_PLACEHOLDER = re.compile(r"\{([A-Za-z_@][\w.@/\-]*)(?::([^{}]*))?\}")
# The format mini-language without nested fields: fill/align, sign, width, grouping,
# precision, type. Widths and precisions are capped so a message cannot be made huge.
_SAFE_SPEC = re.compile(r"(?:[^{}]?[<>=^])?[+\- ]?z?#?0?\d{0,3}[,_]?(?:\.\d{1,3})?[bcdeEfFgGnosxX%]?")
_CONTEXT_KEYS = frozenset(("run", "project", "rank", "stream"))


class _Live:
    """A rule compiled into one RuleSet, with its firing state."""

    __slots__ = ("compiled", "enabled", "every_row", "fires", "firing", "fn", "gate",
                 "last_fire", "metrics", "rule", "streak")

    def __init__(self, rule: Rule, env: Env) -> None:
        assert rule.tree is not None
        self.rule = rule
        self.compiled = Compiled(rule.tree, env)
        self.fn = self.compiled.fn
        self.metrics: tuple[MetricState, ...] = self.compiled.metrics
        self.every_row = rule.every_row
        # The one metric whose presence decides whether a single-metric rule runs.
        self.gate = self.metrics[0] if len(self.metrics) == 1 and not self.every_row else None
        self.streak = 0  # consecutive true evaluations
        self.firing = False  # fired and not yet recovered
        self.fires = 0
        self.last_fire: float | None = None
        self.enabled = True  # False once max_fires is reached


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
        self._seen: set[str] = set()
        self._observed = 0
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
        for live in self._live:
            for ms in live.metrics:
                used.setdefault(ms.name, ms)
        self._mlist = tuple(used.values())
        self._time_live = [lv for lv in self._live if lv.rule.is_time_rule]

    def observe(self, row: Mapping[str, Any], step: int | None, t: float) -> list[Firing]:
        """Evaluate the rules on one record's user keys; return the firings it caused."""
        ctx = self._ctx
        ctx.t = t
        ctx.step = step
        ctx.last_record = t
        if ctx.start is None:
            ctx.start = t
        # every key logged, for "did you mean" at finish: all of the first rows, then a
        # sample (a referenced metric's presence is tracked exactly by its MetricState)
        n = self._observed = self._observed + 1
        if n < 1024 or not n & 127:
            self._seen.update(row)
        get = row.get
        for ms in self._mlist:
            v = get(ms.name)
            if v is None and ms.alias is not None:
                v = get(ms.alias)
            if v is None:
                if ms.present:
                    ms.present = False
                    ms.value = ms.num = ms.cur = None
                continue
            ms.present = True
            ms.value = v
            ms.seen_t = t
            if v.__class__ is not float:
                if v.__class__ is str or not isinstance(v, (int, float)):
                    ms.num = ms.cur = None
                    continue
                try:
                    v = float(v)
                except OverflowError:  # an int beyond float range has no usable value
                    ms.num = ms.cur = None
                    continue
            ms.prev = ms.last
            ms.prev_t = ms.last_t
            ms.last = ms.num = v
            ms.last_t = t
            if v - v == 0.0:
                ms.cur = v
                for push in ms.pushers:
                    push(v, t, step)
            else:
                ms.cur = None  # non-finite: isnan/isinf see it, windows and arithmetic do not
        out: list[Firing] = []
        for live in self._live:
            gate = live.gate
            if gate is not None:
                if not gate.present:
                    continue
            elif not live.every_row:
                for ms in live.metrics:
                    if ms.present:
                        break
                else:
                    continue
            res = live.fn()
            if res is None or (not res and not live.streak and not live.firing):
                continue
            self._step_state(live, bool(res), row, out)
        return out

    def tick(self, t: float) -> list[Firing]:
        """Evaluate the time rules (no_data, age, elapsed) at time `t` without a new row."""
        ctx = self._ctx
        ctx.t = t
        if ctx.start is None:
            ctx.start = t
        for ms in self._mlist:
            ms.clear()
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
            if live.firing:
                live.firing = False
                if rule.notify_recovery:
                    out.append(self._firing(live, "recover", row))
            return
        live.streak += 1
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
            elif key in _CONTEXT_KEYS:
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
            if _SAFE_SPEC.fullmatch(spec):
                try:
                    return format(value, spec)
                except (ValueError, TypeError):
                    pass
            return str(value)

        return _PLACEHOLDER.sub(sub, template)

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
        if any(ms.name == metric and ms.seen_t is not None for ms in self._mlist):
            return True
        return metric in self._seen or ("." in metric and metric.replace(".", "/") in self._seen)


def _row_value(row: Mapping[str, Any] | None, key: str) -> Any:
    if row is None:
        return None
    value = row.get(key)
    if value is None and "." in key:
        value = row.get(key.replace(".", "/"))
    return value
