"""`expr history`: rows of one shard as a table, JSON or CSV; bad input is one line."""

from __future__ import annotations

import csv
import io
import json
import math

from tests.conftest import T0, write_shard


def test_history_table_matches_golden(cli, golden):
    result = cli("history", "run-1", "--rank", "3", "-n", "6")
    assert result.exit_code == 0, result.output
    golden("history_run1_rank3.txt", result.stdout)


def test_history_json_is_the_last_rows_with_full_precision(cli):
    result = cli("history", "proj/run-1", "-n", "3", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["_step"] for r in rows] == [37, 38, 39]
    assert rows[0]["loss"] == round(2.0 / 38, 6) and rows[0]["lr"] == 1e-4
    assert all("_kind" not in r for r in rows)  # step rows only, not rank records


def test_history_metrics_and_step_range_as_csv(cli):
    result = cli("history", "run-1", "--rank", "2", "-m", "loss", "--step-range", "10:13", "-f", "csv")
    assert result.exit_code == 0, result.output
    table = list(csv.reader(io.StringIO(result.stdout)))
    assert table[0] == ["_step", "_time", "loss"]
    assert [int(r[0]) for r in table[1:]] == [10, 11, 12]
    assert math.isclose(float(table[1][2]), round(2.0 / 11 + 0.02, 6))


def test_history_all_rows_of_another_stream(cli):
    result = cli("history", "run-1", "--stream", "data", "-n", "-1", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["tokens"] for r in rows] == [4096, 8192, 12288] and rows[0]["source"] == "web"


def test_history_of_a_shard_file(cli, cli_root):
    path = cli_root / "proj" / "run-1" / "metrics.rank6.jsonl"
    rows = json.loads(cli("history", str(path), "-n", "1", "--json").stdout)
    assert rows[0]["loss"] == round(2.0 / 40 + 0.06, 6)


def test_unknown_metric_lists_the_available_ones(cli):
    result = cli("history", "run-1", "--metrics", "los,lr")
    assert result.exit_code == 1
    assert result.stderr == "error: unknown metric los (did you mean loss?); available: loss, lr\n"


def test_a_rank_metric_says_where_it_can_be_seen(cli):
    """`grad_norm` is in the run, logged with log_rank_metrics: not "unknown", but where to
    look (history shows step rows only)."""
    result = cli("history", "run-1", "--metrics", "grad_norm")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: grad_norm is a rank metric (log_rank_metrics), not a key of the step rows "
        "history shows: expr summary RUN -m grad_norm (across ranks), expr plot RUN -m "
        "grad_norm (each rank over the steps), expr export RUN --rank-records (every record)\n")
    assert cli("plot", "run-1", "-m", "grad_norm", "--json").exit_code == 0


def test_step_range_outside_the_shard(cli):
    result = cli("history", "run-1", "--step-range", "100:200")
    assert result.exit_code == 1
    assert result.stderr == "error: no rows in steps 100:200; metrics.jsonl has steps 0..39\n"


def test_malformed_step_range_is_a_usage_error(cli):
    result = cli("history", "run-1", "--step-range", "5-9")
    assert result.exit_code == 2
    assert "must look like START:STOP" in result.stderr and "Traceback" not in result.output


def test_empty_shard(cli):
    result = cli("history", "zero")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: shard ") and result.stderr.endswith("is empty\n")


def test_missing_rank_names_the_ranks_there(cli, cli_root):
    result = cli("history", "run-1", "--rank", "9")
    assert result.exit_code == 1
    assert result.stderr == "error: run proj/run-1 has no rank 9: its world size is 8 (ranks: 0-7)\n"
    (cli_root / "proj" / "run-1" / "metrics.rank3.jsonl").unlink()  # a rank of the world, not there
    result = cli("history", "run-1", "--rank", "3")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: run proj/run-1 has no shard for rank 3 of stream (default); ranks: 0-2,4-7\n"
    )


def test_garbage_lines_are_skipped_with_one_warning(cli):
    result = cli("history", "run-2", "-n", "-1", "--json")
    assert result.exit_code == 0, result.output
    assert [r["_step"] for r in json.loads(result.stdout)] == list(range(10))
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("warning: skipped 1 line of ") and "did not parse" in result.stderr


def test_bad_stream_name_is_one_line(cli):
    result = cli("history", "run-1", "--stream", "rank2")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: stream 'rank2' has a 'rank<N>' segment")
    assert result.stderr.count("\n") == 1


def test_text_values_print_as_written(cli, cli_root):
    write_shard(cli_root / "proj" / "notes" / "metrics.jsonl",
                [{"_step": 0, "_time": T0, "note": "[/bold] x [red]"}])
    result = cli("history", "notes")
    assert result.exit_code == 0, result.output
    assert "[/bold] x [red]" in result.stdout and "(rank 0, last 1 row)" in result.stdout
