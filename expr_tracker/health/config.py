"""The `[health]` table: detector thresholds (DESIGN 13).

It sits in exprd's config file and in the alert config file named by `expr watch --config`
or `$EXPR_ALERT_CONFIG` (whose `channels` and `policy` tables `expr_tracker.alerts` parses)::

    [health]
    straggler_ratio = 1.3     # step time >= this x the ranks' median ...
    straggler_steps = 20      # ... for this many reported steps in a row
    slowdown_ratio = 1.3      # >= this x slower than its own best window
    slowdown_steps = 20       # the window of the slowdown detector
    hang_after = "5m"         # silence without evidence; default max(5 min, 20 x the median step period)
    evidence_after = "60s"    # a stall with probe evidence (a culprit, a lost node, every rank
                              # waiting); default max(60 s, 10 x the median step period)
    straggler_clear_ratio = 1.15  # resolves under this (default halfway from 1 to the ratio)
    slowdown_clear_ratio = 1.15
    page_after = "10s"        # a ratio detector's incident is paged once it has held this
                              # long (raised on evidence: a crash, a lost node, a stall
                              # whose probes name a culprit, it pages at once)
    fs_cache = "30s"          # the run root's attribute cache (bindfs attr_timeout, NFS
                              # actimeo): silence and `behind` are believed only beyond
                              # it; default: what the mount's options say (NFS), else 0
    behind_steps = 100        # steps short of the leading live rank
    missing_after = "10m"     # after the first rank started
    crash_window = "60s"      # crashes this soon after the first are one incident
    step_time_key = "step_time"   # the rank metric holding a step's duration
    notify_recovery = false   # deliver resolved incidents too

Durations are seconds or text like "500ms", "90s", "5m", "1h".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from expr_tracker.durations import LONG, parse_duration
from expr_tracker.errors import unknown_key

HANG_FLOOR = 300.0  # the default hang_after is at least 5 minutes ...
HANG_PERIODS = 20  # ... and at least 20 median step periods
EVIDENCE_FLOOR = 60.0  # with probe evidence, a stall is raised after at least a minute ...
EVIDENCE_PERIODS = 10  # ... and at least 10 median step periods


@dataclass(frozen=True)
class HealthConfig:
    """Detector thresholds; every field is a key of the `[health]` table."""

    straggler_ratio: float = 1.3
    straggler_steps: int = 20
    slowdown_ratio: float = 1.3
    slowdown_steps: int = 20
    hang_after: float | None = None  # None: max(HANG_FLOOR, HANG_PERIODS x median period)
    behind_steps: int = 100
    missing_after: float = 600.0
    crash_window: float = 60.0
    step_time_key: str = "step_time"
    notify_recovery: bool = False
    evidence_after: float | None = None  # None: max(EVIDENCE_FLOOR, EVIDENCE_PERIODS x period)
    straggler_clear_ratio: float | None = None  # None: 1 + (straggler_ratio - 1) / 2
    slowdown_clear_ratio: float | None = None  # None: 1 + (slowdown_ratio - 1) / 2
    page_after: float = 10.0
    fs_cache: float | None = None  # None: detected from the mount (`clock.attr_cache`)

    def hang_threshold(self, median_period: float | None) -> float:
        """`hang_after`, or its default for a job whose median step period is given."""
        if self.hang_after is not None:
            return self.hang_after
        return max(HANG_FLOOR, HANG_PERIODS * (median_period or 0.0))

    def evidence_threshold(self, median_period: float | None) -> float:
        """`evidence_after`, or its default: the silence after which a stall whose probes
        name a culprit (or a lost node, or every rank waiting) is raised. Never later than
        the silence without evidence (`hang_threshold`)."""
        if self.evidence_after is not None:
            return min(self.evidence_after, self.hang_threshold(median_period))
        return min(max(EVIDENCE_FLOOR, EVIDENCE_PERIODS * (median_period or 0.0)),
                   self.hang_threshold(median_period))

    def clear_ratio(self, kind: str) -> float:
        """The ratio a straggler or slowdown resolves under (hysteresis: lower than the one
        it fires at, so a job near the line does not open and resolve again and again)."""
        fire = self.straggler_ratio if kind == "straggler" else self.slowdown_ratio
        clear = self.straggler_clear_ratio if kind == "straggler" else self.slowdown_clear_ratio
        if clear is None:
            return 1.0 + (fire - 1.0) / 2.0
        return min(clear, fire)


_RATIOS = ("straggler_ratio", "slowdown_ratio", "straggler_clear_ratio", "slowdown_clear_ratio")
_COUNTS = ("straggler_steps", "slowdown_steps", "behind_steps")
_DURATIONS = ("hang_after", "missing_after", "crash_window", "evidence_after")
KEYS = tuple(f.name for f in fields(HealthConfig))


def duration(value: Any, key: str, zero: bool = False) -> float:
    """Seconds from a number or a text like '500ms', '90s', '5m', '1h' (`durations`, the one
    parser); ValueError naming `key`."""
    try:
        return parse_duration(value, key, zero=zero)
    except ValueError as exc:
        raise ValueError(f"health: key {exc}") from None


# keys whose value hides a lost node or an incident for as long as it says
_WARN_LONG = ("page_after", "fs_cache")


def parse_health(raw: Mapping[str, Any] | None, base: HealthConfig | None = None) -> HealthConfig:
    """Validate a `[health]` table over `base` (the defaults); errors name the key."""
    cfg = base or HealthConfig()
    if raw is None:
        return cfg
    if not isinstance(raw, Mapping):
        raise ValueError(f"health: must be a table of keys, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in KEYS:
            raise ValueError(unknown_key("health", key, KEYS))
        if key in _RATIOS:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 1.0:
                raise ValueError(f"health: key {key!r} must be a number > 1, got {value!r}")
            values[key] = float(value)
        elif key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"health: key {key!r} must be an integer >= 1, got {value!r}")
            values[key] = value
        elif key in _DURATIONS:
            values[key] = duration(value, key)
        elif key in ("page_after", "fs_cache"):  # 0: at once / no cache
            values[key] = duration(value, key, zero=True)
            if values[key] > LONG:
                import logging

                logging.getLogger("expr_tracker").warning(
                    "expr_tracker: health key %r is %s, over an hour: a lost node or an open "
                    "incident stays unseen that long (was it meant?)", key, value)
        elif key == "step_time_key":
            if not isinstance(value, str) or not value or value.startswith("_"):
                raise ValueError(f"health: key {key!r} must be a metric name, got {value!r}")
            values[key] = value
        else:
            if not isinstance(value, bool):
                raise ValueError(f"health: key {key!r} must be true or false, got {value!r}")
            values[key] = value
    out = replace(cfg, **values)
    for kind in ("straggler", "slowdown"):
        clear = getattr(out, f"{kind}_clear_ratio")
        if clear is not None and clear > getattr(out, f"{kind}_ratio"):
            raise ValueError(f"health: key '{kind}_clear_ratio' must be at most {kind}_ratio "
                             f"({getattr(out, f'{kind}_ratio')}), got {clear!r}")
    return out


def load_health(path: str | None) -> HealthConfig:
    """The `[health]` table of the alert config file at `path` (None: the defaults)."""
    if path is None:
        return HealthConfig()
    from expr_tracker.alerts.config import read_config_file

    return parse_health(read_config_file(path).get("health"))
