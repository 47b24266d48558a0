"""Thousands of ranks (issue 12): a synthetic 4,096-rank run read by summary and shards."""

from __future__ import annotations

import json
import time

import pytest

from tests.synthetic import host_of, write_run

WORLD = 4096
STEPS = 60
STRAGGLER = 2049
CRASHED = 17


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    write_run(root / "proj" / "big", WORLD, STEPS, straggler=STRAGGLER, crashed=CRASHED)
    return root


@pytest.fixture
def run_cli(big_root, monkeypatch):
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    app = build_app()
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("EXPR_DIR", str(big_root))
    monkeypatch.setenv("NO_COLOR", "1")

    def invoke(*args):
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result

    return invoke


def test_summary_json_counts_every_rank_and_flags_the_straggler(run_cli):
    t0 = time.monotonic()
    view = json.loads(run_cli("summary", "big", "--json").stdout)
    elapsed = time.monotonic() - t0
    assert view["world_size"] == WORLD and view["step"] == STEPS - 1
    st = next(i for i in view["keys"] if i["key"] == "step_time")
    # every live rank at the frontier; the crashed one is behind, not missing
    assert st["stats"]["n"] == WORLD - 1
    assert st["behind"] == [{"rank": CRASHED, "step": STEPS // 2 - 1, "status": "crashed"}]
    assert st["missing"] == []
    assert [o["rank"] for o in st["outliers"] if o["flagged"]] == [STRAGGLER]
    assert st["outliers"][0]["ratio"] == pytest.approx(1.6, rel=0.02)
    assert st["outliers"][0]["node"] == host_of(STRAGGLER)
    assert view["ranks"]["crashed"] == [CRASHED] and view["ranks"]["live"] == WORLD - 1
    assert elapsed < 30  # generous: loaded CI machines; bench/scale.py measures it


def test_summary_json_of_a_step_row_metric(run_cli):
    view = json.loads(run_cli("summary", "big", "-m", "loss", "--json").stdout)
    (item,) = view["keys"]
    assert item["key"] == "loss" and item["source"] == "step rows"
    assert item["stats"]["n"] == WORLD - 1 and set(item["stats"]) >= {"mean", "p50", "missing"}


def test_text_summary_with_heatmap_fits_100_lines_and_names_the_straggler(run_cli):
    out = run_cli("summary", "big", "--heatmap", "step_time").stdout
    lines = out.splitlines()
    assert len(lines) <= 100, out
    assert max(len(line) for line in lines) <= 100
    assert any(line.lstrip().startswith(f"{STRAGGLER} ") and "1.6" in line for line in lines), out
    heat = lines[next(i for i, line in enumerate(lines) if line.startswith("heatmap of")):]
    assert any(line.lstrip().startswith(f"r{STRAGGLER} ") for line in heat), out
    assert "crashed (rank 17)" in out and "behind: ranks 17 (step 29, crashed)" in out


def test_shards_fits_100_lines_and_names_the_straggler_and_the_crash(run_cli):
    out = run_cli("shards", "big").stdout
    lines = out.splitlines()
    assert len(lines) <= 100, out
    assert "4,096 shards on 512 nodes" in lines[0]
    row = next(line for line in lines if line.lstrip().startswith(f"{STRAGGLER} "))
    assert host_of(STRAGGLER) in row and "slow: step_time 1.6" in row
    crash = next(line for line in lines if line.lstrip().startswith(f"{CRASHED} "))
    assert "RuntimeError: NCCL timeout" in crash and "behind" not in crash
    every = run_cli("shards", "big", "--all").stdout.splitlines()
    assert len(every) >= WORLD
