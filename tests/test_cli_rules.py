"""`expr rules explain` and `expr rules test`."""

from __future__ import annotations

import json


def test_explain_prints_the_parenthesised_condition(cli):
    result = cli("rules", "explain", "loss > 1 and mean(loss[5]) > 2 or isnan(lr) => error: bad {loss}")
    assert result.exit_code == 0, result.output
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert lines["parenthesized"].strip() == "(((loss > 1) and (mean(loss[5]) > 2)) or isnan(lr))"
    assert lines["level"].strip() == "error" and lines["message"].strip() == "bad {loss}"
    assert lines["metrics"].strip() == "loss, lr" and lines["functions"].strip() == "isnan, mean"


def test_explain_json(cli):
    info = json.loads(cli("rules", "explain", "loss > 3", "--json").stdout)
    assert info["parenthesized"] == "(loss > 3)" and info["level"] == "warning"


def test_a_bad_rule_is_an_error_without_traceback(cli):
    result = cli("rules", "explain", "loss >> 1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: rule 'loss >> 1': unexpected '>' at column 7")
    assert "Traceback" not in result.output


def test_rule_test_lists_the_firing_steps(cli):
    result = cli("rules", "test", "train/loss > 0.8 => error: drift {train/loss}", "run-1",
                 "--rank", "6", "--json")
    assert result.exit_code == 0, result.output
    fired = json.loads(result.stdout)
    # edge mode: fires when the condition becomes true (step 0: 2.3; step 35: the drift)
    assert [(f["kind"], f["step"]) for f in fired] == [("fire", 0), ("fire", 35)]
    assert fired[1]["message"].startswith("drift 0.85")


def test_rule_test_table_and_step_rows(cli):
    result = cli("rules", "test", "loss > 1.5 => warning", "run-1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("fired 1 time over proj/run-1 metrics.jsonl (80 records")


def test_rule_that_never_fires(cli):
    result = cli("rules", "test", "loss > 100", "run-1", "--rank", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("the rule never fired over proj/run-1 metrics.rank2.jsonl")


def test_rules_without_subcommand_prints_help(cli):
    result = cli("rules")
    assert result.exit_code == 0, result.output
    assert "explain" in result.stdout and "test" in result.stdout
