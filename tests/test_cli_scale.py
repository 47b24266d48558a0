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
    assert "crashed (rank 17)" in out and "behind: rank 17 (step 29, crashed)" in out


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


def test_watch_once_json_names_the_straggler_and_the_crash(big_root, tmp_path):
    # a copy: watch records incidents.jsonl in the run, which the other tests do not expect
    import shutil

    from typer.testing import CliRunner

    from expr_cli.main import build_app

    shutil.copytree(big_root / "proj" / "big", tmp_path / "proj" / "big")
    env = {"EXPR_DIR": str(tmp_path), "NO_COLOR": "1", "COLUMNS": "100"}
    t0 = time.monotonic()
    # the synthetic ranks last wrote at T0, long ago: without a longer hang_after the job
    # is stalled too (correctly)
    watch = ["watch", "big", "--once", "--json", "--hang-after", "1000d"]
    result = CliRunner().invoke(build_app(), watch, env=env)
    elapsed = time.monotonic() - t0
    assert result.exit_code == 1, result.output  # incidents are open
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    by_kind = {i["kind"]: i for i in lines}
    assert set(by_kind) == {"straggler", "crashed"}, lines
    assert by_kind["straggler"]["ranks"] == [STRAGGLER]
    assert by_kind["straggler"]["hosts"] == [host_of(STRAGGLER)]
    assert "1.60x" in by_kind["straggler"]["detail"]
    assert by_kind["crashed"]["ranks"] == [CRASHED]
    recorded = (tmp_path / "proj" / "big" / "incidents.jsonl").read_text().splitlines()
    assert len(recorded) == 2
    # a second pass records nothing new and still reports both as open
    again = CliRunner().invoke(build_app(), watch, env=env)
    assert again.exit_code == 1, again.output
    assert sorted(json.loads(x)["kind"] for x in again.stdout.splitlines()) == ["crashed", "straggler"]
    assert len((tmp_path / "proj" / "big" / "incidents.jsonl").read_text().splitlines()) == 2
    assert elapsed < 30  # generous: loaded CI machines; bench/scale.py measures it


@pytest.mark.parametrize(("columns", "lines"), [(80, 24), (80, 100), (100, 100)])
def test_top_once_fits_the_terminal_and_names_the_straggler_and_the_crash(run_cli, monkeypatch,
                                                                         tmp_path, columns, lines):
    cfg = tmp_path / "alert.toml"  # the synthetic ranks wrote long ago: not a stall here
    cfg.write_text('[health]\nhang_after = "1000d"\n')
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(cfg))
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("LINES", str(lines))
    out = run_cli("top", "big", "--once").stdout.splitlines()
    assert len(out) <= lines, "\n".join(out)
    assert all(len(line) <= columns for line in out), "\n".join(out)
    assert out[0].startswith("proj/big") and f"{WORLD} ranks" in out[0]
    text = "\n".join(out)
    # the job's line, the incidents on top, the ranks with them first, their nodes named,
    # the rest binned
    assert out[1].startswith(f"crashed: rank {CRASHED} failed first (RuntimeError: NCCL timeout)")
    assert out[2].startswith(f"crashed rank {CRASHED}") and out[3].startswith(f"straggler rank {STRAGGLER}")
    ranks = [line.split()[0] for line in out if line[:6].strip().isdigit()]
    assert ranks[:2] == [str(CRASHED), str(STRAGGLER)]
    assert "more ranks" in text
    head = next(i for i, line in enumerate(out) if line.startswith("node "))
    node_rows = [line.split() for line in out[head + 2:]]
    nodes = [row[0] for row in node_rows]
    assert nodes[:2] == [host_of(CRASHED), host_of(STRAGGLER)]
    assert node_rows[0][-1] == "crashed" and node_rows[1][-1] == "straggler"
    assert any(n.startswith("r") and "-" in n for n in nodes)  # the healthy nodes, binned
    assert sum(int(row[1]) for row in node_rows) == WORLD  # every rank in a node row or a bin


def test_top_agg_is_checked(run_cli):
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    result = CliRunner().invoke(build_app(), ["top", "big", "--once", "--agg", "median"])
    assert result.exit_code == 2 and "--agg" in result.output
    assert "straggler" in run_cli("top", "big", "--once", "--agg", "mean").stdout
