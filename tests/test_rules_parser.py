"""Parsing, checking and explaining alert rules (expr_tracker.alerts.rules)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expr_tracker.alerts.rules import LEVELS, Rule, RuleSet, explain, parse_rule
from expr_tracker.errors import RuleError


def parens(text: str) -> str:
    return str(explain(text)["parenthesized"])


# -- rule text: condition, level, message ------------------------------------------------


def test_levels_are_the_five_in_order() -> None:
    assert LEVELS == ("debug", "info", "warning", "error", "critical")


def test_text_form_with_level_and_message() -> None:
    rule = parse_rule("isnan(loss) => critical: diverged")
    assert isinstance(rule, Rule)
    assert (rule.name, rule.condition, rule.level, rule.message) == (
        "isnan(loss)", "isnan(loss)", "critical", "diverged")
    assert rule.metrics == ("loss",)
    assert rule.functions == ("isnan",)
    assert rule.text == "isnan(loss) => critical: diverged"
    assert (rule.mode, rule.for_steps, rule.cooldown, rule.max_fires) == ("edge", 1, 60.0, None)
    assert rule.notify_recovery is False
    assert rule.channels is None
    assert rule.is_time_rule is False


def test_defaults_level_warning_and_message_is_condition() -> None:
    rule = parse_rule("loss   >   100")
    assert rule.level == "warning"
    assert rule.message == "loss   >   100"
    assert rule.name == "loss > 100"  # whitespace normalised


def test_empty_level_with_message() -> None:
    rule = parse_rule("loss > 100 => : big {loss:.2f}")
    assert (rule.level, rule.message) == ("warning", "big {loss:.2f}")


def test_level_only_and_case_insensitive() -> None:
    assert parse_rule("loss > 1 => ERROR").level == "error"
    assert parse_rule("loss > 1 =>").level == "warning"


def test_message_may_contain_colons_and_arrows() -> None:
    rule = parse_rule("loss > 1 => info: at {step}: loss => {loss}")
    assert rule.message == "at {step}: loss => {loss}"


def test_arrow_inside_quoted_name_does_not_split() -> None:
    rule = parse_rule('"a=>b" > 1 => error')
    assert rule.metrics == ("a=>b",)
    assert rule.level == "error"


def test_long_condition_gets_indexed_name() -> None:
    text = " or ".join(f"metric_number_{i} > {i}" for i in range(12))
    assert parse_rule(text, index=7).name == "rule7"


def test_dict_form_all_keys() -> None:
    rule = parse_rule({
        "name": "loss-spike", "condition": "zscore(loss[50]) > 4", "level": "Error",
        "message": "spike {value:.1f}", "mode": "level", "for_steps": 3, "cooldown": "5m",
        "max_fires": 2, "notify_recovery": True, "channels": ["slack", "log"],
    })
    assert rule.name == "loss-spike"
    assert (rule.level, rule.mode, rule.for_steps, rule.cooldown) == ("error", "level", 3, 300.0)
    assert (rule.max_fires, rule.notify_recovery, rule.channels) == (2, True, ("slack", "log"))
    assert rule.message == "spike {value:.1f}"
    assert parse_rule(rule.to_spec()) == rule


def test_dict_form_single_channel_and_condition_with_arrow() -> None:
    rule = parse_rule({"condition": "loss > 1 => critical: boom", "channels": "log"})
    assert (rule.level, rule.message, rule.channels) == ("critical", "boom", ("log",))
    assert rule.text == "loss > 1 => critical: boom"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"condition": "loss > 1", "levle": "info"}, ["unknown key 'levle'", "did you mean 'level'"]),
        ({"condition": "loss > 1", "level": "fatal"}, ["level must be one of"]),
        ({"condition": "loss > 1", "mode": "pulse"}, ["mode must be 'edge' or 'level'"]),
        ({"condition": "loss > 1", "for_steps": -1}, ["for_steps must be a whole number >= 1"]),
        ({"condition": "loss > 1", "for_steps": True}, ["for_steps"]),
        ({"condition": "loss > 1", "cooldown": -5}, ["cooldown must be a number of seconds >= 0"]),
        ({"condition": "loss > 1", "cooldown": "soon"}, ["cooldown"]),
        ({"condition": "loss > 1", "max_fires": 0}, ["max_fires must be a whole number >= 1"]),
        ({"condition": "loss > 1", "notify_recovery": "yes"}, ["notify_recovery"]),
        ({"condition": "loss > 1", "channels": [1]}, ["channels"]),
        ({"condition": 5}, ["'condition' must be the condition text"]),
        ({"name": "", "condition": "loss > 1"}, ["name must be non-empty"]),
    ],
)
def test_dict_form_errors_name_the_option(spec: dict[str, object], words: list[str]) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(spec)
    for word in words:
        assert word in str(info.value)


def test_not_text_nor_dict() -> None:
    with pytest.raises(RuleError, match="text or a dict"):
        parse_rule(42)  # type: ignore[arg-type]


def test_rule_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        parse_rule("loss >")


def test_duplicate_names_in_ruleset() -> None:
    rules = RuleSet([parse_rule("loss > 1 => info")])
    with pytest.raises(RuleError, match="duplicate rule name 'loss > 1'"):
        rules.add(parse_rule("loss > 1 => error"))
    rules.add(parse_rule({"name": "other", "condition": "loss > 1"}))
    assert [r.name for r in rules.rules] == ["loss > 1", "other"]


# -- names, numbers, windows -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "metrics"),
    [
        ("train/loss > 1", ["train/loss"]),
        ("a / b > 1", ["a", "b"]),
        ("a/ b > 1", ["a", "b"]),
        ("opt@lr.group0 > 1", ["opt@lr.group0"]),
        ('"train loss" > 1', ["train loss"]),
        ("'val-acc' < 0.5", ["val-acc"]),
        ("`and` > 1", ["and"]),
        ("eval.acc < 1", ["eval.acc"]),
    ],
)
def test_metric_names(text: str, metrics: list[str]) -> None:
    assert explain(text)["metrics"] == metrics


def test_numbers_and_durations() -> None:
    assert parens("x > 1e-3") == "(x > 1e-3)"
    assert parens("x > .5 + 2.") == "(x > (.5 + 2.))"
    assert parens("age(x) > 5m") == "(age(x) > 5m)"


def test_windows_listed() -> None:
    info = explain("mean(loss[50]) > 1 and max(loss[30s]) > 2 or std(gn[2h]) > mean(loss[50])")
    assert info["windows"] == ["loss[50]", "loss[30s]", "gn[2h]"]
    assert info["functions"] == ["max", "mean", "std"]
    assert info["metrics"] == ["gn", "loss"]


def test_time_rule_flag() -> None:
    assert parse_rule("no_data(5m)").is_time_rule
    assert parse_rule("age(loss) > 60").is_time_rule
    assert parse_rule("elapsed() > 3600").is_time_rule
    assert not parse_rule("step() > 10").is_time_rule


# -- precedence ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a or b and not c > 1 + 2 * 3", "(a or (b and (not (c > (1 + (2 * 3))))))"),
        ("loss > 100 or isnan(loss)", "((loss > 100) or isnan(loss))"),
        ("a || b && !c", "(a or (b and (not c)))"),
        ("a | b & c", "(a or (b and c))"),
        ("a - b - c > 0", "(((a - b) - c) > 0)"),
        ("a / b * c % d > 0", "((((a / b) * c) % d) > 0)"),
        ("-a * b > 0", "(((-a) * b) > 0)"),
        ("- - a > 0", "((-(-a)) > 0)"),
        ("not not a", "(not (not a))"),
        ("(a or b) and c", "((a or b) and c)"),
        ("a != b == c != d", None),
        ("min(a, b + 1) <= max(c[5]) * 2", "(min(a, (b + 1)) <= (max(c[5]) * 2))"),
    ],
)
def test_precedence(text: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(RuleError, match="comparisons do not chain"):
            parse_rule(text)
    else:
        assert parens(text) == expected


# -- errors: message, column, caret --------------------------------------------------------


def test_error_exact_format() -> None:
    with pytest.raises(RuleError) as info:
        parse_rule("loss >> 1")
    assert str(info.value) == (
        "rule 'loss >> 1': unexpected '>' at column 7\n"
        "  loss >> 1\n"
        "        ^"
    )


def caret_column(message: str) -> int:
    caret_line = message.splitlines()[-1]
    return caret_line.index("^") - 2 + 1


@pytest.mark.parametrize(
    ("text", "column", "words"),
    [
        ("loss >", 7, "unexpected end of condition"),
        ("(loss > 1", 1, "unclosed '('"),
        ("loss > 1)", 9, "unexpected ')'"),
        ("loss $ 1", 6, "unexpected '$'"),
        ("maen(loss[5]) > 1", 1, "unknown function maen() (did you mean mean()?)"),
        ("frobnicate(x) > 1", 1, "unknown function frobnicate()"),
        ("abs(a, b) > 1", 1, "abs() takes 1 argument, got 2"),
        ("step(1) > 1", 1, "step() takes no arguments, got 1"),
        ("min(a) > 1", 5, "min() needs a window, e.g. min(loss[50]) or min(loss[5m]), or two"),
        ("max(a, b, c) > 1", 1, "max() takes 1 argument or two numbers, got 3"),
        ("mean(loss) > 1", 6, "mean() needs a window, e.g. mean(loss[50])"),
        ("x > 1 and isnan(loss[5])", 17, "isnan() does not take a window"),
        ("loss[5] > 1", 1, "only allowed inside an aggregate"),
        ("isnan(loss + 1)", 7, "isnan() takes a metric name"),
        ("no_data(loss)", 9, "no_data() takes a duration"),
        ("ema(loss[5m]) > 1", 5, "ema() needs a window of points"),
        ("stalled(loss[1])", 9, "at least 2 points"),
        ("loss[0] > 1", 6, "a window holds 1 to"),
        ("loss[2.5] > 1", 6, "whole number of points"),
        ("loss[x] > 1", 6, "expected a window size"),
        ("loss[5 > 1", 8, "expected ']'"),
        ("loss + 1", 1, "is a number, not true/false"),
        ("3x > 1", 1, "invalid number '3x'"),
        ("1e999 > x", 1, "too large"),
        ("'loss > 1", 1, "unterminated quoted name"),
        ("`` > 1", 1, "empty quoted name"),
        ("_step > 1", 1, "reserved"),
        ("a < b < c", 7, "comparisons do not chain"),
        ("loss > 1 => critcal", 13, "unknown level 'critcal' (did you mean 'critical'?)"),
        ("", 1, "empty condition"),
        ("   => info", 4, "empty condition"),
    ],
)
def test_error_messages(text: str, column: int, words: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(text)
    message = str(info.value)
    assert words in message
    assert f"at column {column}" in message
    assert caret_column(message) == column
    assert message.splitlines()[1] == "  " + text


def test_deep_nesting_is_a_rule_error() -> None:
    for text in ["(" * 200 + "a" + ")" * 200 + " > 1", "+".join(["a"] * 500) + " > 1",
                 "-" * 500 + "a > 1", "not " * 500 + "a", "abs(" * 100 + "a" + ")" * 100 + " > 1"]:
        with pytest.raises(RuleError, match="nested more than"):
            parse_rule(text)


# -- fuzzing: nothing but RuleError escapes; what parses prints back the same ------------

_SOUP = [
    "loss", "lr", "train/loss", "eval.acc", '"q n"', "`x`", "'y'", "1", "0", "2.5", "1e-3", "5m",
    "30s", "[", "]", "(", ")", ",", "+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=",
    "and", "or", "not", "&&", "||", "!", "&", "|", "=>", ":", "critical", "info", "mean", "std",
    "min", "max", "zscore", "ema", "stalled", "isnan", "has", "no_data", "step", "elapsed",
    "age", "diff", "abs", "log", "50", "{loss}", "[50]", "[30s]", " ",
]


def _check_any(text: str) -> None:
    try:
        rule = parse_rule(text)
    except RuleError:
        return
    again = explain(explain(rule)["parenthesized"])
    assert again["parenthesized"] == explain(rule)["parenthesized"]
    rules = RuleSet([rule], start_time=0.0)
    rows: list[dict[str, Any]] = [{"loss": 1.0, "lr": float("nan")}, {"loss": "x"}, {}, {"q n": 0}]
    for i, row in enumerate(rows):
        rules.observe(row, i, float(i))
    rules.tick(100.0)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40))
def test_fuzz_random_text(text: str) -> None:
    _check_any(text)


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_SOUP), max_size=14), st.booleans())
def test_fuzz_token_soup(tokens: list[str], spaced: bool) -> None:
    _check_any((" " if spaced else "").join(tokens))
