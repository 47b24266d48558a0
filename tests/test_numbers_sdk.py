"""Issue 47: the reducers' numbers from runs written by the SDK's own calls, in its order.

Each test writes its run with real rank processes (`import expr_tracker as et`), as a user
would, and checks `expr` against numbers computed here from the raw shard lines.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from tests.procs import env_for, run_all, spawn

_WEIGHTED = """
import os, sys
import expr_tracker as et
rank = int(os.environ["RANK"])
run = et.init(project="p", name="w", dir=sys.argv[1], system_interval=1.0)
for s in range(40):
    loss = 1.0 + rank * 0.01 + s * 0.001
    step_time = 2.0 if rank == 5 else 1.0 + rank * 0.01
    run.log_rank_metrics({"train/loss": loss, "system/step_time": step_time}, step=s,
                         rank=rank, world_size=8, local_rank=rank, weight=100 + rank)
    et.log({"train/loss": loss})
et.finish()
"""


def _cli(root: Path, *args: str) -> dict:
    from expr_cli.main import build_app

    result = CliRunner().invoke(build_app(), list(args), env={"EXPR_DIR": str(root)})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _records(run: Path) -> list[dict]:
    out = []
    for shard in sorted(run.glob("metrics*.jsonl")):
        out += [orjson.loads(line) for line in shard.read_bytes().splitlines()]
    return out


@pytest.fixture(scope="module")
def weighted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 real ranks, each logging its own weighted rank records, step rows and (the
    default) system samples, one of them at finish, at the last step."""
    root = tmp_path_factory.mktemp("weighted")
    procs = [subprocess.Popen([sys.executable, "-c", _WEIGHTED, str(root)],
                              env=env_for({"RANK": str(r), "LOCAL_RANK": str(r),
                                           "WORLD_SIZE": "8"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(8)]
    run_all(procs)
    return root


def test_a_system_sample_at_the_last_step_keeps_the_users_weights(weighted_run: Path) -> None:
    recs = _records(weighted_run / "p" / "w")
    # the case of the issue: a sample (weight 1.0) at step 39 beside each user record
    assert {r["_rank"] for r in recs if r.get("_source") == "system" and r["_step"] == 39} \
        == set(range(8))
    mine = [r for r in recs if r.get("_kind") == "rank" and "_source" not in r and r["_step"] == 39]
    xs = np.array([r["train/loss"] for r in sorted(mine, key=lambda r: r["_rank"])])
    ws = np.array([r["_weight"] for r in sorted(mine, key=lambda r: r["_rank"])])
    assert list(ws) == [100.0 + r for r in range(8)]
    view = _cli(weighted_run, "summary", "p/w", "--step", "39", "-m", "train/loss", "--json")
    stats = view["keys"][0]["stats"]
    assert math.isclose(stats["wmean"], float((xs * ws).sum() / ws.sum()), rel_tol=1e-12)
    assert not math.isclose(stats["wmean"], stats["mean"], rel_tol=1e-6)
    # and over a window: each rank's mean weighted by its mean weight
    window = _cli(weighted_run, "summary", "p/w", "--steps", "30:40", "-m", "train/loss", "--json")
    got = window["keys"][0]["stats"]
    means = np.array([np.mean([q["train/loss"] for q in recs if q.get("_kind") == "rank"
                               and "_source" not in q and q["_rank"] == r
                               and 30 <= q["_step"] < 40]) for r in range(8)])
    assert math.isclose(got["wmean"], float((means * ws).sum() / ws.sum()), rel_tol=1e-12)


def test_a_users_system_key_is_the_users_metric(weighted_run: Path) -> None:
    view = _cli(weighted_run, "summary", "p/w", "--json")
    keys = {item["key"]: item for item in view["keys"]}
    assert "system/step_time" in keys, list(keys)
    assert [o["rank"] for o in keys["system/step_time"]["outliers"] if o["flagged"]] == [5]
    # the SDK's own samples are still told apart, by their source
    assert "system/step_time" not in view["system_keys"]
    assert "system/rss_mb" in view["system_keys"] and "system/rss_mb" not in keys


def test_plot_names_the_straggler_among_many_equal_ranks(tmp_path: Path) -> None:
    from tests import synthetic

    synthetic.write_run(tmp_path / "synth" / "w64", 64, 50, straggler=33)
    view = _cli(tmp_path, "plot", "synth/w64", "-m", "step_time", "--json")
    labels = [line["label"] for line in view["panels"][0]["lines"]]
    assert labels == ["median of 64 ranks", "rank 33 (outlier)"]


_COVERAGE = """
import os, random, sys
import expr_tracker as et
et.init(project="p", name="cov", dir=sys.argv[1], upload_mode="spool", system_metrics=False)
run = et.get_run()
for step in range(300):
    run.log_rank_metrics({"step_time": 1.0 + random.random() / 100, "wait_time": 0.1}, step=step)
    et.log({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
et.finish()
"""


def test_no_rank_is_missing_at_a_windows_first_step(tmp_path: Path) -> None:
    """Spool mode, applied by exprd: each rank's record of step N sits before its step row of
    N-1 (`et.log(step=N)` commits row N-1 when step N opens); every window's first step
    must still see every rank."""
    root, spool = tmp_path / "runs", tmp_path / "spool"
    env = {"WORLD_SIZE": "4", "EXPR_SPOOL": str(spool), "PYTHONWARNINGS": "ignore"}
    run_all([spawn(_COVERAGE.replace("sys.argv[1]", repr(str(root))),
                   {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(4)])
    done = subprocess.run([sys.executable, "-m", "exprd", "--spool", str(spool), "--state",
                           str(tmp_path / "state"), "--once", "--allow-root"],
                          env=env_for({"EXPR_SPOOL": str(spool)}), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.path.getsize(root / "p" / "cov" / "metrics.rank2.jsonl") > 64 << 10  # blocks
    view = _cli(root, "summary", "p/cov", "-m", "step_time", "--json")
    assert view["coverage"] == [] and view["keys"][0]["stats"]["n"] == 4
    for lo in range(95, 130):
        view = _cli(root, "summary", "p/cov", "-m", "step_time", "--steps", f"{lo}:{lo + 50}",
                    "--json")
        assert view["coverage"] == [], (lo, view["coverage"])
        assert view["keys"][0]["stats"]["missing"] == [], lo
        heat = _cli(root, "summary", "p/cov", "--steps", f"{lo}:{lo + 5}", "--heatmap",
                    "step_time", "--json")["heatmap"]
        assert all(None not in cells for cells in heat["cells"].values()), (lo, heat["cells"])
