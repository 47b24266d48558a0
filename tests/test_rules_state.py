"""Rule state machine, RuleSet bookkeeping and message templates (expr_tracker.alerts.rules)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from expr_tracker.alerts.rules import Firing, RuleSet, parse_rule


def make(spec: str | dict[str, Any], **context: Any) -> RuleSet:
    return RuleSet([parse_rule(spec)], context=context or None, start_time=0.0)


def feed(rules: RuleSet, values: list[Any], key: str = "x", t0: float = 0.0,
         dt: float = 1.0) -> list[str]:
    """One row per value (None: a row without `key`); the firings as 'step:kind'."""
    out = []
    for i, v in enumerate(values):
        row = {"other": 1} if v is None else {key: v}
        for f in rules.observe(row, i, t0 + i * dt):
            out.append(f"{i}:{f.kind}")
    return out


U = "n/a"  # a present value that makes `x > 0` UNKNOWN


def test_edge_fires_on_transitions_and_first_true_counts() -> None:
    rules = make("x > 0")
    assert feed(rules, [1, 1, -1, 1, 1, -1, -1, 1]) == ["0:fire", "3:fire", "7:fire"]


def test_unknown_leaves_state_alone() -> None:
    assert feed(make("x > 0"), [1, U, 1, math.nan, 1, -1, U, -1, 1]) == ["0:fire", "8:fire"]
    assert feed(make({"condition": "x > 0", "for_steps": 3}), [1, U, 1, U, 1]) == ["4:fire"]


def test_rows_without_the_metric_are_skipped() -> None:
    rules = make({"condition": "x > 0", "for_steps": 2})
    assert feed(rules, [1, None, 1, None, None, -1, 1, None, 1]) == ["2:fire", "8:fire"]


def test_for_steps_needs_consecutive_trues() -> None:
    rules = make({"condition": "x > 0", "for_steps": 3})
    assert feed(rules, [1, 1, -1, 1, 1, 1, 1, 1, -1, 1, 1, 1]) == ["5:fire", "11:fire"]


def test_level_mode_repeats_after_cooldown() -> None:
    rules = make({"condition": "x > 0", "mode": "level", "cooldown": 3})
    assert feed(rules, [1] * 8) == ["0:fire", "3:fire", "6:fire"]
    rules = make({"condition": "x > 0", "mode": "level", "cooldown": 0})
    assert feed(rules, [1, 1, -1, 1]) == ["0:fire", "1:fire", "3:fire"]


def test_level_mode_default_cooldown_is_a_minute() -> None:
    rules = make({"condition": "x > 0", "mode": "level"})
    assert feed(rules, [1] * 5, dt=20.0) == ["0:fire", "3:fire"]


def test_level_mode_with_for_steps() -> None:
    rules = make({"condition": "x > 0", "mode": "level", "cooldown": 0, "for_steps": 2})
    assert feed(rules, [1, 1, 1, -1, 1, 1]) == ["1:fire", "2:fire", "5:fire"]


def test_max_fires_stops_the_rule() -> None:
    rules = make({"condition": "x > 0", "max_fires": 2, "notify_recovery": True})
    got = feed(rules, [1, -1, 1, -1, 1, -1, 1])
    assert got == ["0:fire", "1:recover", "2:fire", "3:recover"]
    info = rules.info()[0]
    assert (info["fires"], info["enabled"], info["firing"]) == (2, False, False)


def test_notify_recovery() -> None:
    rules = make({"condition": "x > 10 => error: high {x}", "notify_recovery": True})
    fired: list[Firing] = []
    for i, v in enumerate([11.0, 12.0, U, 5.0, 4.0, 20.0]):
        fired += rules.observe({"x": v}, i, float(i))
    assert [(f.kind, f.step, f.message) for f in fired] == [
        ("fire", 0, "high 11.0"), ("recover", 3, "recovered: high 5.0"), ("fire", 5, "high 20.0")]
    assert all(f.level == "error" and f.condition == "x > 10" for f in fired)
    assert feed(make("x > 10"), [11, 5, 11]) == ["0:fire", "2:fire"]  # off by default


def test_firing_fields() -> None:
    rules = RuleSet([parse_rule("isnan(loss) or lr < 0 => critical: bad")])
    fired = rules.observe({"loss": math.nan, "lr": 0.1, "_step": 7, "acc": 3}, 7, 123.5)
    assert len(fired) == 1
    f = fired[0]
    assert (f.rule, f.level, f.kind, f.message, f.step, f.time) == (
        "isnan(loss) or lr < 0", "critical", "fire", "bad", 7, 123.5)
    assert f.condition == "isnan(loss) or lr < 0"
    assert math.isnan(f.values["loss"]) and f.values["lr"] == 0.1
    assert set(f.values) == {"loss", "lr"}


# -- time rules and tick -------------------------------------------------------------------


def test_no_data_fires_on_tick_and_recovers_on_data() -> None:
    rules = make({"condition": "no_data(5m) => error: silent", "notify_recovery": True})
    assert rules.has_time_rules
    assert rules.observe({"x": 1}, 0, 10.0) == []
    assert rules.tick(309.0) == []
    fired = rules.tick(310.0)
    assert [(f.kind, f.message, f.step) for f in fired] == [("fire", "silent", 0)]
    assert rules.tick(400.0) == []  # edge: once
    fired = rules.observe({}, 1, 500.0)
    assert [f.kind for f in fired] == ["recover"]
    assert [f.kind for f in rules.tick(800.0)] == ["fire"]


def test_no_data_counts_from_start_before_any_record() -> None:
    rules = RuleSet([parse_rule("no_data(60s)")], start_time=100.0)
    assert rules.tick(150.0) == []
    assert len(rules.tick(160.0)) == 1


def test_age_grows_on_rows_and_ticks_without_the_metric() -> None:
    rules = make("age(loss) > 60 => : loss silent for {value:.0f}s")
    assert rules.observe({"loss": 1.0}, 0, 0.0) == []
    assert rules.observe({"acc": 1.0}, 1, 50.0) == []
    fired = rules.observe({"acc": 1.0}, 2, 70.0)
    assert [f.message for f in fired] == ["loss silent for 70s"]
    rules = make("age(loss) > 60")
    rules.observe({"loss": 1.0}, 0, 0.0)
    assert len(rules.tick(61.0)) == 1


def test_elapsed_uses_start_time_or_first_record() -> None:
    rules = RuleSet([parse_rule("elapsed() >= 3600")], start_time=1000.0)
    assert rules.tick(4599.0) == []
    assert len(rules.tick(4600.0)) == 1
    rules = RuleSet([parse_rule("elapsed() >= 10")])
    assert rules.observe({"x": 1}, 0, 500.0) == []
    assert len(rules.observe({"x": 1}, 1, 510.0)) == 1


def test_tick_only_runs_time_rules() -> None:
    rules = RuleSet([parse_rule("step() >= 0"), parse_rule("not has(x)")], start_time=0.0)
    assert not rules.has_time_rules
    assert rules.tick(10.0) == []
    assert [f.rule for f in rules.observe({"y": 1}, 3, 11.0)] == ["step() >= 0", "not has(x)"]


# -- templates -----------------------------------------------------------------------------


def render(message: str, row: dict[str, Any], condition: str = "x > 0", **context: Any) -> str:
    rules = make({"condition": condition, "message": message}, **context)
    fired = rules.observe(row, 12, 99.0)
    assert fired, "rule did not fire"
    return fired[0].message


def test_template_placeholders() -> None:
    ctx: dict[str, Any] = {"run": "sft-1", "project": "llm", "rank": 3, "stream": "data"}
    row = {"x": 1.23456, "train/loss": 0.5, "name": "abc"}
    assert render("{project}/{run} rank {rank} {stream} step {step}", row, **ctx) == \
        "llm/sft-1 rank 3 data step 12"
    assert render("x={x:.2f} loss={train/loss:.1%} n={name}", row) == "x=1.23 loss=50.0% n=abc"
    assert render("{x:>8.3f}|{x:+.1e}", row) == "   1.235|+1.2e+00"


def test_template_failures_stay_harmless() -> None:
    row = {"x": 1.5, "name": "abc"}
    assert render("{name:.2f}", row) == "abc"  # spec fails on the value: str(value)
    assert render("{x:>99999}", row) == "1.5"  # spec outside the safe subset: str(value)
    assert render("{nope} {run} {x.__class__} {0} {x!r}", row) == \
        "{nope} {run} {x.__class__} {0} {x!r}"
    assert render("{{x}} {x", row) == "{1.5} {x"


def test_template_expr_and_value() -> None:
    assert render("{expr}", {"x": 101.5}, "x > 100") == "x=101.5 > 100"
    assert render("{expr}", {"loss": math.nan}, "isnan(loss)") == "isnan(loss=nan)"
    got = render("{expr}", {"x": 3.0, "y": 0.0}, "x / y > 1 or x > 2 and not isnan(y)")
    assert got == "x=3 / y=0 > 1 or x=3 > 2 and not isnan(y=0)"
    assert render("{expr}", {"x": 9.0}, "mean(x[5]) > 2") == "mean(x[5])=9 > 2"
    assert render("{value}", {"x": 101.5}, "x > 100") == "101.5"
    assert render("{value:.0f}", {"x": 101.5}, "100 < x") == "102"
    assert render("{value}", {"x": 1.0, "y": 7.0}, "x > 5 or y > 5") == "7.0"


def test_default_message_is_condition() -> None:
    assert render("", {"x": 1}, "x   > 0") == "x   > 0"


# -- RuleSet bookkeeping -------------------------------------------------------------------


def test_info_never_seen_and_seen_metrics() -> None:
    rules = RuleSet([parse_rule("train/los > 1"), parse_rule("eval.acc < 0.1"),
                     parse_rule("gpu_temp > 90")])
    rules.observe({"train/loss": 2.0, "eval/acc": 0.5, "_step": 1, "_time": 2.0}, 1, 2.0)
    assert rules.seen_metrics == {"train/loss", "eval/acc"}
    assert [i["unresolved_metrics"] for i in rules.info()] == [["train/los"], [], ["gpu_temp"]]
    assert rules.never_seen() == [("train/los > 1", "train/los", "train/loss"),
                                  ("gpu_temp > 90", "gpu_temp", None)]
    assert set(rules.info()[0]) == {"name", "level", "fires", "firing", "enabled",
                                    "unresolved_metrics"}


def test_remove_and_add() -> None:
    rules = RuleSet([parse_rule("x > 0"), parse_rule("mean(x[3]) > 5 => info")])
    assert rules.remove("x > 0") is True
    assert rules.remove("x > 0") is False
    assert [r.name for r in rules.rules] == ["mean(x[3]) > 5"]
    assert feed(rules, [1.0, 2.0]) == []
    assert rules.remove("mean(x[3]) > 5") is True
    assert rules.rules == []
    assert feed(rules, [100.0]) == []


def test_window_history_is_shared_with_rules_added_later() -> None:
    rules = RuleSet([parse_rule("mean(x[3]) > 100")])
    feed(rules, [10.0, 10.0, 10.0, 10.0])
    rules.add(parse_rule({"name": "late", "condition": "max(x[3]) >= 10 and count(x[3]) == 3"}))
    fired = rules.observe({"x": 1.0}, 5, 5.0)
    assert [f.rule for f in fired] == ["late"]


def test_removing_a_rule_keeps_shared_windows_of_others() -> None:
    rules = RuleSet([parse_rule("mean(x[3]) > 100"), parse_rule("count(x[3]) == 3")])
    rules.remove("mean(x[3]) > 100")
    assert feed(rules, [1.0, 2.0, 3.0]) == ["2:fire"]


def test_rules_fire_in_order_added() -> None:
    rules = RuleSet([parse_rule({"name": n, "condition": "x > 0"}) for n in "cab"])
    assert [f.rule for f in rules.observe({"x": 1}, 0, 0.0)] == ["c", "a", "b"]


@pytest.mark.parametrize("bad", [{"condition": "x >"}, "mean(x) > 1"])
def test_add_accepts_specs_and_raises_rule_errors(bad: Any) -> None:
    rules = RuleSet()
    rules.add("x > 1")
    with pytest.raises(ValueError):
        rules.add(bad)
    assert [r.name for r in rules.rules] == ["x > 1"]


# -- rows that repeat a value object (a constant lr) ----------------------------------------


def test_repeated_value_object_still_drives_for_steps_level_and_recovery() -> None:
    lr = 3e-4  # one float object, logged row after row as a constant lr would be
    rules = make({"condition": "lr > 0", "for_steps": 3})
    assert feed(rules, [lr] * 5, key="lr") == ["2:fire"]
    rules = make({"condition": "lr > 0", "mode": "level", "cooldown": 2})
    assert feed(rules, [lr] * 5, key="lr") == ["0:fire", "2:fire", "4:fire"]
    neg = -1.0
    rules = make({"condition": "lr > 0", "notify_recovery": True})
    assert feed(rules, [lr, lr, neg, neg, lr, lr], key="lr") == ["0:fire", "2:recover", "4:fire"]
    # windows and history still take every row of a repeated object
    rules = RuleSet([parse_rule("count(lr[3]) == 3"), parse_rule("diff(lr) == 0"),
                     parse_rule("lr > 1")])
    assert [f"{i}:{f.rule}" for i in range(4) for f in rules.observe({"lr": lr}, i, float(i))] \
        == ["1:diff(lr) == 0", "2:count(lr[3]) == 3"]


def test_rule_added_later_sees_a_repeated_value_object() -> None:
    x = 7.5
    rules = make("x > 100")
    assert rules.observe({"x": x}, 0, 0.0) == []
    assert rules.observe({"x": x}, 1, 1.0) == []
    rules.add("x > 5")
    assert [f.rule for f in rules.observe({"x": x}, 2, 2.0)] == ["x > 5"]


def test_age_after_gaps_ticks_and_rule_changes() -> None:
    rules = make({"condition": "age(x) >= 0", "mode": "level", "cooldown": 0,
                  "message": "{value}"})

    def age(row: dict[str, Any], t: float) -> str | None:
        fired = rules.observe(row, None, t)
        return fired[0].message if fired else None

    assert age({"y": 1}, 1.0) is None  # never seen: UNKNOWN
    assert age({"x": 1.0}, 2.0) == "0.0"
    assert age({"x": "text"}, 3.0) == "0.0"  # present, though not a number
    assert age({"y": 1}, 5.0) == "2.0"
    assert [f.message for f in rules.tick(9.0)] == ["6.0"]
    assert age({"y": 1}, 10.0) == "7.0"
    assert age({"x": 1.0}, 11.0) == "0.0"
    rules.add("y > 100")  # rebuilding the plan keeps what was seen
    assert age({"y": 1}, 12.0) == "1.0"


def test_diff_added_later_starts_from_the_last_row() -> None:
    rules = make("x > 100")
    rules.observe({"x": 1.0}, 0, 0.0)
    rules.observe({"x": 2.0}, 1, 1.0)
    rules.add({"name": "d", "condition": "diff(x) > 0", "message": "{value}"})
    assert [f.message for f in rules.observe({"x": 5.0}, 2, 2.0)] == ["3.0"]


def test_template_spec_on_a_huge_int_falls_back_to_text() -> None:
    assert render("{x:.3g}", {"x": 10**400}, "has(x)") == str(10**400)
