"""One parser of durations for every configuration key and option that takes one (issue
54): a number of seconds, or text like '500ms', '90s', '5m', '1h', '3d'. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from typing import Any

_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*\Z")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
LONG = 3600.0  # past an hour, a delay or cache that hides a lost node is most likely a slip


def seconds(value: Any) -> float | None:
    """The seconds `value` says (a number, or a number and a unit as text); None when it
    is not a duration (a bool, other text, NaN)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        out = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        return None
    return out if math.isfinite(out) else None


def parse_duration(value: Any, key: str, *, zero: bool = False) -> float:
    """`seconds(value)`, > 0 (>= 0 with `zero`: 0, "0" and "0s" alike); ValueError naming
    `key` otherwise."""
    out = seconds(value)
    if out is None or out < 0 or (out == 0 and not zero):
        raise ValueError(f"{key} must be a duration {'>=' if zero else '>'} 0 (seconds, or "
                         f"text like '90s', '5m', '1h'), got {value!r}")
    return out
