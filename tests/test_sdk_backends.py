"""Backends wired into the SDK in direct mode: rank routing with real wandb, failing backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import orjson
import pytest

import expr_tracker as et

from .procs import run_all, spawn

WANDB_RANK = """
import os, expr_tracker as et
run = et.init("proj", "sft-1", dir={root!r}, stream={stream!r}, backends=["wandb"],
              backend_on_rank={on_rank!r})
for step in range(5):
    et.log({{"loss": 1.0 / (step + 1) if step != 3 else float("nan"), "r": run.rank}})
et.finish()
"""


def _wandb_env(tmp_path):
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true",
        "WANDB_CACHE_DIR": str(tmp_path / "wbc"), "WANDB_CONFIG_DIR": str(tmp_path / "wbcfg"),
        "WANDB_DATA_DIR": str(tmp_path / "wbd"), "WORLD_SIZE": "4",
    }


def _inspect(run_dir):
    wandb_bin = os.path.join(os.path.dirname(sys.executable), "wandb")
    (wfile,) = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
    out = subprocess.run([wandb_bin, "leet", "inspect", "--json", os.path.join(run_dir, wfile)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _offline_runs(tmp_path):
    base = tmp_path / "wb" / "wandb"
    return sorted(p for p in base.glob("offline-run-*")) if base.exists() else []


def test_wandb_ids_and_groups_for_every_rank_and_stream(tmp_path):
    (tmp_path / "wb").mkdir()
    procs = [
        spawn(WANDB_RANK.format(root=str(tmp_path / "runs"), stream=stream, on_rank=None),
              {**_wandb_env(tmp_path), "RANK": str(r)})
        for r in range(4) for stream in (None, "data")
    ]
    run_all(procs, timeout=240)
    ids = sorted(p.name.split("-", 3)[-1] for p in _offline_runs(tmp_path))
    expected = sorted(["sft-1", "sft-1-rank1", "sft-1-rank2", "sft-1-rank3",
                       "sft-1-data", "sft-1-data-rank1", "sft-1-data-rank2", "sft-1-data-rank3"])
    assert ids == expected
    # rows and steps of one run, read back from its .wandb file, match the shard
    (rank2_data,) = [p for p in _offline_runs(tmp_path) if p.name.endswith("-sft-1-data-rank2")]
    dump = _inspect(rank2_data)
    assert '"sft-1"' in dump  # the group
    shard = tmp_path / "runs" / "proj" / "sft-1" / "metrics.data.rank2.jsonl"
    rows = [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    assert [r["_step"] for r in rows] == [0, 1, 2, 3, 4]
    records = [json.loads(line) for line in dump.splitlines() if line.strip()]
    (run_rec,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run_rec["run_id"], run_rec["run_group"], run_rec["job_type"]) == ("sft-1-data-rank2", "sft-1", "data")
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [r["_step"] for r in rows]
    for row in rows:
        got = history[row["_step"]]
        assert got["r"] == row["r"] == 2
        assert got["loss"] == (row["loss"] if row["_step"] != 3 else "NaN")


def test_wandb_default_routing_only_rank0(tmp_path):
    (tmp_path / "wb").mkdir()
    procs = [spawn(WANDB_RANK.format(root=str(tmp_path / "runs"), stream=None, on_rank=0),
                   {**_wandb_env(tmp_path), "RANK": str(r)}) for r in range(4)]
    run_all(procs, timeout=240)
    runs = _offline_runs(tmp_path)
    assert [p.name.split("-", 3)[-1] for p in runs] == ["sft-1"]
    # silenced ranks still wrote their full shards
    for r in range(1, 4):
        shard = tmp_path / "runs" / "proj" / "sft-1" / f"metrics.rank{r}.jsonl"
        assert len(shard.read_bytes().splitlines()) == 5


class Exploding:
    name = "exploding"

    def open(self, identity):
        pass

    def log(self, events):
        raise ConnectionError("backend is down")

    def alert(self, alert):
        raise ConnectionError("backend is down")

    def finish(self, status):
        raise ConnectionError("backend is down")


def test_backend_that_raises_never_reaches_training(tmp_path, caplog):
    run = et.init("p", "r", dir=tmp_path, backends=[Exploding()])
    t0 = time.perf_counter()
    for i in range(500):
        et.log({"x": i})
    assert time.perf_counter() - t0 < 5
    et.finish()
    rows = et.history(-1, run=run.paths.run_dir)
    assert [r["x"] for r in rows] == list(range(500))
    stats = run.info()["backends"]["exploding"]
    assert stats["failed"] + stats["dropped"] == 500 and stats["sent"] == 0
    assert stats["errors"]


def test_backend_spec_errors_at_init(tmp_path):
    with pytest.raises(ValueError, match="type"):
        et.init("p", "r", dir=tmp_path, backends=["nosuch"])
    with pytest.raises(ValueError, match="backend object"):
        et.init("p", "r", dir=tmp_path, backends=[Exploding()], upload_mode="spool",
                spool_dir=tmp_path / "spool")
    assert not (tmp_path / "p").exists()


TRACKIO_RANK = """
import expr_tracker as et
et.init("proj", "sft-1", dir={root!r}, backends=["trackio"], backend_on_rank=None,
        config={{"lr": 0.1}})
for step in range(3):
    et.log({{"loss": 1.0 + step}})
et.finish()
"""


def test_trackio_every_rank_under_its_remote_id_and_group(tmp_path):
    import sqlite3

    env = {"TRACKIO_DIR": str(tmp_path / "tio"), "HF_HOME": str(tmp_path / "hf"),
           "HOME": str(tmp_path), "WORLD_SIZE": "2"}
    procs = [spawn(TRACKIO_RANK.format(root=str(tmp_path / "runs")), {**env, "RANK": str(r)})
             for r in range(2)]
    run_all(procs, timeout=240)
    (db,) = (tmp_path / "tio").glob("*.db")
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT run_name, step, metrics FROM metrics ORDER BY run_name, step").fetchall()
        configs = dict(con.execute("SELECT run_name, config FROM configs").fetchall())
    finally:
        con.close()
    assert [(name, step, json.loads(m)["loss"]) for name, step, m in rows] == [
        ("sft-1", 0, 1.0), ("sft-1", 1, 2.0), ("sft-1", 2, 3.0),
        ("sft-1-rank1", 0, 1.0), ("sft-1-rank1", 1, 2.0), ("sft-1-rank1", 2, 3.0),
    ]
    assert {json.loads(c)["_Group"] for c in configs.values()} == {"sft-1"}
