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


def test_a_rule_that_fires_on_every_rank_is_one_entry(cli, tmp_path, monkeypatch):
    """A loss that goes high on all 64 ranks at once: one entry per step naming the ranks
    (rank 0 delivered, the rest suppressed), not an entry per rank; `--json` keeps each."""
    import expr_tracker as et

    world = 64
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        et.init("p", "wide", dir=tmp_path, system_metrics=False,
                alert_rules=["loss > 2 => warning: loss high"])
        for step in range(30):
            # every rank at step 10; every third rank at step 20
            et.log({"loss": 3.0 if step == 10 or (step == 20 and rank % 3 == 0) else 1.0})
        et.finish()
    result = cli("alerts", "p/wide", "--dir", str(tmp_path), COLUMNS="80")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    heads = [line for line in lines if "loss high" in line]
    assert len(heads) == 2, result.stdout
    assert heads[0].endswith("  ranks 0-63  warning  step 10  1 delivered, 63 suppressed  loss high")
    # a list of ranks too long for the line is cut after a whole range, and counted
    # a list of ranks too long for the line is counted, and cut after a whole range (rank
    # 0's own second alert is suppressed too: the policy's cooldown)
    assert heads[1].endswith("  22 ranks (0,3,6,9,...)  warning  step 20  22 suppressed  loss high")
    assert max(len(line.rstrip()) for line in lines) <= 80
    # narrower: the title goes under the line, with the message
    narrow = cli("alerts", "p/wide", "--dir", str(tmp_path), COLUMNS="70").stdout.splitlines()
    at = narrow.index(next(line for line in narrow if "ranks 0-63" in line))
    assert narrow[at].endswith("ranks 0-63  warning  step 10  1 delivered, 63 suppressed")
    assert narrow[at + 1:at + 3] == ["    loss high", "    loss > 2"]
    data = json.loads(cli("alerts", "p/wide", "--dir", str(tmp_path), "--json").stdout)
    assert len(data["alerts"]) == world + 22
