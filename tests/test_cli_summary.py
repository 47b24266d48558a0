"""`expr summary`: cross-rank tables, outliers, coverage and the heatmap."""

from __future__ import annotations

import json
import math
import re

import numpy as np

from tests.conftest import WORLD, rank_value


def test_summary_latest_step_matches_golden(cli, golden):
    result = cli("summary", "run-1")
    assert result.exit_code == 0, result.output
    golden("summary_run1.txt", result.stdout)


def test_summary_window_with_heatmap_matches_golden(cli, golden):
    result = cli("summary", "run-1", "--steps", "20:40", "-m", "train/loss", "--outliers",
                 "--heatmap", "train/loss")
    assert result.exit_code == 0, result.output
    golden("summary_run1_window_heatmap.txt", result.stdout)


def test_summary_json_agrees_with_numpy(cli):
    result = cli("summary", "run-1", "--step", "30", "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    assert view["step"] == 30 and view["world_size"] == WORLD
    item = next(i for i in view["keys"] if i["key"] == "train/loss")
    xs = np.array([rank_value(r, 30) for r in range(WORLD)])
    ws = np.array([1000.0 + 10 * r for r in range(WORLD)])
    st = item["stats"]
    assert st["n"] == WORLD and st["missing"] == []
    assert math.isclose(st["mean"], xs.mean()) and math.isclose(st["std"], xs.std())
    assert math.isclose(st["wmean"], float((xs * ws).sum() / ws.sum()))
    for q, name in ((5, "p05"), (50, "p50"), (95, "p95")):
        assert math.isclose(st[name], float(np.percentile(xs, q)))
    assert not any(o["flagged"] for o in item["outliers"])  # rank 6 drifts from step 35 only


def test_outlier_nonfinite_and_coverage_at_the_last_step(cli):
    view = json.loads(cli("summary", "run-1", "--json").stdout)
    assert view["step"] == 39
    loss = next(i for i in view["keys"] if i["key"] == "train/loss")
    assert [o["rank"] for o in loss["outliers"] if o["flagged"]] == [6]
    grad = next(i for i in view["keys"] if i["key"] == "grad_norm")
    assert grad["stats"]["nonfinite_ranks"] == [5] and grad["stats"]["n"] == WORLD - 1
    assert [(c["step"], c["missing"]) for c in view["coverage"]] == [(36, [3]), (38, [3])]


def test_step_with_a_missing_rank(cli):
    view = json.loads(cli("summary", "run-1", "--step", "36", "-m", "train/loss", "--json").stdout)
    assert [i["key"] for i in view["keys"]] == ["train/loss"]
    assert view["keys"][0]["stats"]["missing"] == [3] and view["keys"][0]["stats"]["n"] == WORLD - 1


def test_heatmap_cells_mark_missing_ranks(cli):
    view = json.loads(cli("summary", "run-1", "--steps", "36:37", "--heatmap", "train/loss",
                          "--json").stdout)
    cells = view["heatmap"]["cells"]
    assert view["heatmap"]["buckets"] == [[36, 36]]
    assert cells["3"] == [None] and math.isclose(cells["6"][0], rank_value(6, 36))


def test_heatmap_uses_background_colours_on_a_colour_terminal(cli):
    result = cli("summary", "run-1", "--heatmap", "train/loss", FORCE_COLOR="1", COLORTERM="truecolor")
    assert result.exit_code == 0, result.output
    assert "\x1b[48;2;" in result.stdout  # truecolor backgrounds
    plain = cli("summary", "run-1", "--heatmap", "train/loss", FORCE_COLOR="1", NO_COLOR="1")
    assert "\x1b[48;" not in plain.stdout and "█" in plain.stdout  # glyph scale instead


def test_step_out_of_range(cli):
    result = cli("summary", "run-1", "--step", "400")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: step 400 has no rank records; they cover steps 0..39 (40 steps), nearest 39\n"
    )


def test_empty_window(cli):
    result = cli("summary", "run-1", "--steps", "50:60")
    assert result.exit_code == 1
    assert result.stderr == "error: no rank records in steps 50:60; they cover steps 0..39\n"


def test_unknown_metric_and_heatmap_key(cli):
    result = cli("summary", "run-1", "--metric", "train/los")
    assert result.exit_code == 1
    assert result.stderr == (
        "error: unknown metric train/los (did you mean train/loss?); available: grad_norm, train/loss\n"
    )
    assert cli("summary", "run-1", "--heatmap", "nope").exit_code == 1


def test_step_and_steps_together_is_a_usage_error(cli):
    result = cli("summary", "run-1", "--step", "3", "--steps", "1:5")
    assert result.exit_code == 2 and "either --step or --steps" in result.stderr


def test_run_without_rank_records_shows_last_values(cli):
    result = cli("summary", "run-2")
    assert result.exit_code == 0, result.output
    assert "has no rank records" in result.stdout
    assert "loss" in result.stdout and "0.1" in result.stdout and "acc" in result.stdout
    assert result.stderr == "warning: skipped 1 line that did not parse (metrics.jsonl: 1)\n"
    data = json.loads(cli("summary", "run-2", "--json").stdout)
    assert data["rank_records"] == 0 and data["last"][0]["values"] == {"loss": 0.1, "acc": 0.9}


def test_ranks_that_log_step_rows_only_are_reduced_across_ranks(cli, cli_root, monkeypatch):
    """A job whose ranks only call et.log: the default summary reduces their step rows (it
    showed one table of last values per shard, 16,384 of them at 16,384 ranks)."""
    import expr_tracker as et

    world = 4
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        et.init("p", name="rows", dir=str(cli_root), system_metrics=False)
        for _step in range(60):
            with et.span("forward"):
                pass
            et.log({"loss": 1.0 + rank * (10.0 if rank == 3 else 0.01), "lr": 0.1,
                    "phase": "train"})
        et.finish()
    result = cli("summary", "p/rows")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "has no rank records" not in out and "metrics.rank1.jsonl" not in out
    assert "loss (step rows)" in out and "lr (step rows)" in out and "phase" not in out
    assert "outliers: 1 rank" in out and re.search(r"^ +3 +\S+ +31 +30.5x", out, re.M), out
    assert "span times: 1 key (time_ms/forward); --spans to compare the ranks" in out
    view = json.loads(cli("summary", "p/rows", "--json").stdout)
    assert view["step"] == 59 and view["span_keys"] == ["time_ms/forward"]
    assert [i["key"] for i in view["keys"]] == ["loss", "lr"]
    loss = view["keys"][0]
    xs = np.array([1.0, 1.01, 1.02, 31.0])
    assert loss["stats"]["n"] == world and math.isclose(loss["stats"]["mean"], xs.mean())
    assert math.isclose(loss["stats"]["p50"], float(np.percentile(xs, 50)))
    assert [o["rank"] for o in loss["outliers"]] == [3]
    # the heatmap of one of them, with the tables of all; a window, a step
    heat = json.loads(cli("summary", "p/rows", "--heatmap", "loss", "--json").stdout)
    assert [i["key"] for i in heat["keys"]] == ["loss", "lr"] and heat["heatmap"]["key"] == "loss"
    assert len(heat["heatmap"]["cells"]) == world
    window = json.loads(cli("summary", "p/rows", "--steps", "10:40", "-m", "loss", "--json").stdout)
    assert window["steps"] == [10, 40] and window["keys"][0]["stats"]["n"] == world
    at = json.loads(cli("summary", "p/rows", "--step", "30", "--json").stdout)
    assert at["step"] == 30 and [i["key"] for i in at["keys"]] == ["loss", "lr"]
    # one rank's step rows: its last values, as before
    assert "has no rank records" in cli("summary", "run-2").stdout


def test_summary_of_an_empty_shard(cli):
    result = cli("summary", "zero")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: run proj/zero has no rows")


def test_summary_fits_80_columns_with_every_statistic(cli):
    result = cli("summary", "run-1", COLUMNS="80")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    header = next(line for line in lines if "n/world" in line)
    for name in ("mean", "wmean", "min", "max", "range", "std", "p05", "p50", "p95"):
        assert name in header.split(), (name, header)


def test_world_sizes_that_disagree_are_named_in_a_warning(cli, cli_root):
    from tests.conftest import write_shard

    run = cli_root / "proj" / "mixed"
    for r in (*range(8), 9):
        ws = 4 if r < 4 else 8
        recs = [{"_kind": "rank", "_step": s, "_time": 1.0 + s, "_rank": r, "_world_size": ws,
                 "t": 1.0} for s in range(3)]
        write_shard(run / ("metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"), recs)
    result = cli("summary", "proj/mixed")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: rank records disagree on world_size: 8 (ranks 4-7,9), 4 (ranks 0-3); "
        "rank 9 is beyond its world_size; using 10\n"
    )
    view = json.loads(cli("summary", "proj/mixed", "--json").stdout)
    assert view["world_size"] == 10
    assert [g["ranks"] for g in view["world_sizes"]] == [[4, 5, 6, 7, 9], [0, 1, 2, 3], [9]]
    agree = cli("summary", "run-1")
    assert "disagree" not in agree.stderr


def test_metric_logged_with_et_log_has_the_rank_record_json_shape(cli):
    view = json.loads(cli("summary", "run-1", "-m", "loss", "--heatmap", "loss", "--json").stdout)
    (item,) = view["keys"]
    rank_item = json.loads(cli("summary", "run-1", "-m", "train/loss", "--json").stdout)["keys"][0]
    assert set(item) == set(rank_item) and set(item["stats"]) == set(rank_item["stats"])
    assert item["source"] == "step rows" and item["stats"]["n"] == WORLD
    # loss = 2/(s+1) + 0.01 r at step 39: every rank's step row
    assert math.isclose(item["stats"]["max"], 2 / 40 + 0.07)
    assert view["heatmap"]["key"] == "loss" and len(view["heatmap"]["cells"]) == WORLD


def test_robust_scores_read_as_numbers() -> None:
    """Issue 11: `+2.57e3` means nothing to a reader; large scores are whole numbers."""
    from expr_cli.render.summary import _fmt_robust

    assert _fmt_robust(2570.4) == "+2570"
    assert _fmt_robust(-13.42) == "-13.4"
    assert _fmt_robust(None) == "MAD 0"


def test_rank_records_long_ago_do_not_hide_the_step_rows_at_the_frontier(cli, tmp_path, monkeypatch):
    """Ranks that logged rank records at their first steps only, and step rows since: the
    default summary reduces the step rows at the frontier (it read every shard whole for
    the old rank records, and showed step 4); a rank-record key asked for is still found."""
    import expr_tracker as et

    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        run = et.init("p", "early", dir=tmp_path, system_metrics=False)
        for step in range(200):
            if step < 5:
                run.log_rank_metrics({"grad": 1.0 + rank}, step=step)
            et.log({"loss": 2.0 + rank})
        et.finish()
    view = json.loads(cli("summary", "p/early", "--dir", str(tmp_path), "--json").stdout)
    assert view["step"] == 199 and [i["key"] for i in view["keys"]] == ["loss"]
    assert view["keys"][0]["source"] == "step rows" and view["keys"][0]["stats"]["n"] == 3
    grad = json.loads(cli("summary", "p/early", "--dir", str(tmp_path), "-m", "grad", "--json").stdout)
    assert grad["step"] == 4 and grad["keys"][0]["source"] == "rank records"
    assert grad["keys"][0]["stats"]["mean"] == 2.0
