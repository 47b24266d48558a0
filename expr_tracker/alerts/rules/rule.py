"""A rule: `<condition> => [level][: message]`, or a dict with the same parts and options."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from expr_tracker.alerts.rules.lexer import DURATION_UNITS, fail
from expr_tracker.alerts.rules.parser import (
    EVERY_ROW_FUNCS,
    TIME_FUNCS,
    Call,
    Metric,
    Node,
    parse_condition,
    render,
    walk,
)
from expr_tracker.errors import RuleError

LEVELS = ("debug", "info", "warning", "error", "critical")
MODES = ("edge", "level")
DEFAULT_LEVEL = "warning"
DEFAULT_COOLDOWN = 60.0
_KEYS = ("name", "condition", "level", "message", "mode", "for_steps", "cooldown", "max_fires",
         "notify_recovery", "channels")
_MAX_NAME = 120
# a message's fields: `{name}` or `{name:spec}` (filled by `state.RuleSet` when it fires)
PLACEHOLDER = re.compile(r"\{([A-Za-z_@][\w.@/\-]*)(?::([^{}]*))?\}")
# The format mini-language without nested fields: fill/align, sign, width, grouping,
# precision, type. Widths and precisions are capped so a message cannot be made huge.
SAFE_SPEC = re.compile(r"(?:[^{}]?[<>=^])?[+\- ]?z?#?0?\d{0,3}[,_]?(?:\.\d{1,3})?[bcdeEfFgGnosxX%]?")
CONTEXT_KEYS = frozenset(("run", "project", "rank", "stream"))
_FIELDS = ("step", "value", "expr", *sorted(CONTEXT_KEYS))


def _check_message(message: str, label: str) -> None:
    """RuleError naming a field of `message` that can never be filled: a reserved name
    (`{_rank}` was printed as written). (A metric key may be any other name, and a spec
    outside the safe subset prints the value plainly.)"""
    for m in PLACEHOLDER.finditer(message):
        key = m.group(1)
        if key.startswith("_"):
            raise RuleError(f"rule {label!r}: unknown field {m.group(0)} in the message; fields "
                            f"are {', '.join(_FIELDS)} and metric keys{_suggest(key[1:], _FIELDS)}")
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*")


@dataclass(frozen=True)
class Rule:
    """A parsed, checked alert rule. Build it with `parse_rule`."""

    name: str
    text: str
    condition: str
    level: str = DEFAULT_LEVEL
    message: str = ""
    mode: str = "edge"
    for_steps: int = 1
    cooldown: float = DEFAULT_COOLDOWN
    max_fires: int | None = None
    notify_recovery: bool = False
    channels: tuple[str, ...] | None = None
    metrics: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    is_time_rule: bool = False
    tree: Node | None = field(default=None, compare=False, repr=False)

    @property
    def every_row(self) -> bool:
        """Evaluated on every row (uses has/step/time functions, or no metric at all)."""
        return not self.metrics or any(f in EVERY_ROW_FUNCS for f in self.functions)

    def to_spec(self) -> dict[str, Any]:
        """A dict that `parse_rule` turns back into an equal rule."""
        return {"name": self.name, "condition": self.condition, "level": self.level,
                "message": self.message, "mode": self.mode, "for_steps": self.for_steps,
                "cooldown": self.cooldown, "max_fires": self.max_fires,
                "notify_recovery": self.notify_recovery,
                "channels": list(self.channels) if self.channels is not None else None}


def _split_arrow(text: str) -> int:
    """Offset of the first `=>` outside quotes, or -1."""
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch == "=" and text.startswith("=>", i):
            return i
    return -1


def _parse_text(text: str) -> tuple[Node, str, str | None, str | None]:
    """(tree, condition text, level or None, message or None) of a rule string."""
    arrow = _split_arrow(text)
    end = len(text) if arrow < 0 else arrow
    tree = parse_condition(text, 0, end)
    condition = text[:end].strip()
    if arrow < 0:
        return tree, condition, None, None
    tail = text[arrow + 2 :]
    level_part, colon, message = tail.partition(":")
    level = level_part.strip().lower()
    if level and level not in LEVELS:
        at = arrow + 2 + (len(level_part) - len(level_part.lstrip()))
        fail(text, at, f"unknown level {level_part.strip()!r}{_suggest(level, LEVELS)}; "
                       f"levels are {', '.join(LEVELS)}")
    return tree, condition, level or None, (message.strip() or None) if colon else None


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _option(label: str, key: str, value: Any) -> Any:
    """Validate one option of the dict form; RuleError says which option and why."""

    def bad(why: str) -> RuleError:
        return RuleError(f"rule {label!r}: {key} {why}, got {value!r}")

    if key == "level":
        if not isinstance(value, str) or value.strip().lower() not in LEVELS:
            raise bad(f"must be one of {', '.join(LEVELS)}{_suggest(str(value).lower(), LEVELS)}")
        return value.strip().lower()
    if key == "mode":
        if not isinstance(value, str) or value.strip().lower() not in MODES:
            raise bad("must be 'edge' or 'level'")
        return value.strip().lower()
    if key in ("for_steps", "max_fires"):
        if value is None and key == "max_fires":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("must be a whole number >= 1" + (" or None" if key == "max_fires" else ""))
        return value
    if key == "cooldown":
        seconds = _seconds(value)
        if seconds is None or seconds < 0:
            raise bad("must be a number of seconds >= 0 or a duration like '5m'")
        return seconds
    if key == "notify_recovery":
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    if key == "channels":
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(c, str) and c for c in items):
            raise bad("must be a channel name or a list of channel names")
        return tuple(items)
    if key == "message":
        if value is not None and not isinstance(value, str):
            raise bad("must be text")
        return value or None
    raise AssertionError(key)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        m = _DURATION.fullmatch(value)
        if m:
            return float(m.group(1)) * DURATION_UNITS.get(m.group(2), 1.0)
    return None


def _check_name(name: Any, label: str) -> str:
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        raise RuleError(f"rule {label!r}: name must be non-empty text on one line, got {name!r}")
    return name.strip()


def parse_rule(spec: str | Mapping[str, Any], *, index: int = 0) -> Rule:
    """Parse and check one rule (text or dict form); raise RuleError pointing at the problem."""
    opts: dict[str, Any] = {}
    if isinstance(spec, str):
        tree, condition, level, message = _parse_text(spec)
        text = spec
    elif isinstance(spec, Mapping):
        unknown = [k for k in spec if k not in _KEYS]
        label = str(spec.get("name") or spec.get("condition") or f"rule{index}")
        if unknown:
            hint = _suggest(str(unknown[0]), _KEYS)
            raise RuleError(f"rule {label!r}: unknown key {unknown[0]!r}{hint}; "
                            f"keys are {', '.join(_KEYS)}")
        cond_text = spec.get("condition")
        if not isinstance(cond_text, str):
            raise RuleError(f"rule {label!r}: 'condition' must be the condition text, "
                            f"got {cond_text!r}")
        tree, condition, level, message = _parse_text(cond_text)
        for key in _KEYS[2:]:
            if key in spec:
                opts[key] = _option(label, key, spec[key])
        level = opts.pop("level", level)
        message = opts.pop("message", None) or message
        if spec.get("name") is not None:
            opts["name"] = _check_name(spec["name"], label)
        text = condition
        if level or message:
            text += f" => {level or DEFAULT_LEVEL}" + (f": {message}" if message else "")
    else:
        raise RuleError(f"a rule must be text or a dict, got {type(spec).__name__}")
    normal = " ".join(condition.split())
    name = opts.pop("name", None) or (normal if len(normal) <= _MAX_NAME else f"rule{index}")
    if message:
        _check_message(message, name)
    nodes = walk(tree)
    functions = tuple(sorted({n.name for n in nodes if isinstance(n, Call)}))
    return Rule(
        name=name,
        text=text,
        condition=condition,
        level=level or DEFAULT_LEVEL,
        message=message or condition,
        metrics=tuple(sorted({n.name for n in nodes if isinstance(n, Metric)})),
        functions=functions,
        is_time_rule=any(f in TIME_FUNCS for f in functions),
        tree=tree,
        **opts,
    )


def explain(spec: str | Mapping[str, Any] | Rule) -> dict[str, Any]:
    """What a rule means: its parts, its fully parenthesised condition, metrics and windows."""
    rule = spec if isinstance(spec, Rule) else parse_rule(spec)
    assert rule.tree is not None
    windows: list[str] = []
    for node in walk(rule.tree):
        if isinstance(node, Metric) and node.windowed:
            shown = render(node)
            if shown not in windows:
                windows.append(shown)
    return {
        "name": rule.name,
        "condition": rule.condition,
        "parenthesized": render(rule.tree, parens=True),
        "level": rule.level,
        "message": rule.message,
        "mode": rule.mode,
        "metrics": list(rule.metrics),
        "functions": list(rule.functions),
        "windows": windows,
    }
