"""The alert rule language: `<condition> => [level][: message]`, compiled once, cheap per row.

Conditions use metric names (`loss`, `train/loss`, quoted `"val loss"`; `eval.acc` also
matches `eval/acc`), numbers, durations (`30s 5m 2h 1d`, in seconds), windows (`loss[50]`
points, `loss[5m]` record time), `+ - * / %`, comparisons, `and or not` (`&& || !`), and
functions: aggregates over a window (mean std var median sum min max first last count;
std/var are population, ddof 0), slope zscore ema increasing decreasing stalled (window),
diff rate pct_change isnan isinf has age (metric), abs log exp sqrt floor ceil, min(a, b),
max(a, b), step(), elapsed(), no_data(5m). Anything missing, non-finite or undefined is
UNKNOWN, which never fires and never changes a rule's state (Kleene and/or/not).
Aggregates use the points a window holds so far; increasing/decreasing/stalled wait for a
full point window (2 points for a time window); ema is seeded with the first value.
"""

from __future__ import annotations

from expr_tracker.alerts.rules.rule import LEVELS, Rule, explain, parse_rule
from expr_tracker.alerts.rules.state import Firing, RuleSet

__all__ = ["LEVELS", "Firing", "Rule", "RuleSet", "explain", "parse_rule"]
