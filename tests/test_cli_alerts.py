"""`expr alerts`: what fired, by rank, delivered or suppressed."""

from __future__ import annotations

import json


def test_alerts_table_in_time_order_with_counts(cli):
    result = cli("alerts", "run-1")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("grad_norm > 1.15") < out.index("checkpoint saved") < out.index("train/loss > 0.8")
    assert "suppressed" in out and "delivered" in out and "by rank" in out
    assert result.stderr == "warning: skipped 1 alert line that did not parse\n"


def test_alerts_json_by_rank(cli):
    data = json.loads(cli("alerts", "proj/run-1", "--json").stdout)
    assert [a["rank"] for a in data["alerts"]] == [3, 0, 0]
    assert data["by_rank"] == [
        {"rank": 0, "fired": 2, "delivered": 2, "suppressed": 0},
        {"rank": 3, "fired": 1, "delivered": 0, "suppressed": 1},
    ]


def test_alerts_of_one_rank(cli):
    data = json.loads(cli("alerts", "run-1", "--rank", "3", "--json").stdout)
    assert [a["rule"] for a in data["alerts"]] == ["grad_norm > 1.15"]


def test_run_without_alerts(cli):
    result = cli("alerts", "run-2")
    assert result.exit_code == 0, result.output
    assert result.stdout == "no alerts in proj/run-2\n"


def test_negative_rank_is_a_usage_error(cli):
    result = cli("alerts", "run-1", "--rank", "-1")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_alerts_show_the_message_and_fit_80_columns(cli):
    result = cli("alerts", "run-1", COLUMNS="80")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    # nothing cut: every message and rule is there whole
    for text in ("grad_norm 1.2 > 1.15", "rule: grad_norm > 1.15", "checkpoint saved",
                 "train/loss 0.81 > 0.8", "rule: train/loss > 0.8", "loss spike"):
        assert text in result.stdout, text
    first = lines.index(next(line for line in lines if "rank 3" in line))
    assert "error" in lines[first] and "suppressed" in lines[first] and "step 3" in lines[first]
    assert lines[first + 1].startswith("    grad_norm 1.2 > 1.15")


def test_a_rule_without_a_message_is_said_once(cli, tmp_path):
    """A rule with no message alerts with its condition as the text: its second line is
    the condition, not "isnan(grad_norm)  rule: isnan(grad_norm)"; no trailing blanks."""
    import expr_tracker as et

    et.init("p", "nan", dir=tmp_path, system_metrics=False,
            alert_rules=["isnan(grad_norm) => critical: NaN gradient"])
    et.log({"grad_norm": float("nan")})
    et.finish()
    result = cli("alerts", "p/nan", "--dir", str(tmp_path), COLUMNS="80")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    (head,) = [i for i, line in enumerate(lines) if "NaN gradient" in line]
    assert lines[head + 1] == "    isnan(grad_norm)"
    assert result.stdout.count("isnan(grad_norm)") == 1
