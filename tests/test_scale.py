"""World sizes far above 512 (issue 12): init, log and log_rank_metrics at 1,024 and 16,384."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

import expr_tracker as et
from expr_tracker.store.records import MAX_WORLD


def _lines(path):
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def test_1024_rank_init_and_log_in_process(tmp_path, monkeypatch):
    """Every rank of a 1,024-rank job inits and logs (one after the other, in this process)."""
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in range(1024):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 8))
        run = et.init("p", "big", dir=tmp_path)
        assert run.rank == rank and run.world_size == 1024
        et.log({"loss": 1.0 / (rank + 1)})
        et.finish()
    run_dir = tmp_path / "p" / "big"
    shards = sorted(run_dir.glob("metrics*.jsonl"))
    assert len(shards) == 1024
    side = orjson.loads((run_dir / "metrics.rank1023.meta.json").read_bytes())
    assert side["rank"] == 1023 and side["world_size"] == 1024 and side["status"] == "finished"
    (row,) = _lines(run_dir / "metrics.rank1023.jsonl")
    assert row["loss"] == pytest.approx(1 / 1024)


def test_1024_rank_init_real_processes(tmp_path):
    """Real processes with WORLD_SIZE=1024 start (the 512 cap killed such jobs at init)."""
    code = "import expr_tracker as et; et.init('p', 'r', dir=%r); et.log({'x': 1}); et.finish()"
    procs = []
    for rank in (0, 511, 512, 1023):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "1024"}
        procs.append(subprocess.Popen([sys.executable, "-c", code % str(tmp_path)], env=env,
                                      stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    for rank in (511, 512, 1023):
        side = orjson.loads((tmp_path / "p" / "r" / f"metrics.rank{rank}.meta.json").read_bytes())
        assert side["world_size"] == 1024


def test_log_rank_metrics_world_16384(tmp_path):
    run = et.init("p", "r", dir=tmp_path)
    run.log_rank_metrics({"t": 1.0}, step=0, rank=16383, world_size=16384)
    with pytest.raises(ValueError, match="rank must satisfy"):
        run.log_rank_metrics({"t": 1.0}, step=0, rank=16384, world_size=16384)
    with pytest.raises(ValueError, match=r"world_size must be between 1 and 1,048,576"):
        run.log_rank_metrics({"t": 1.0}, step=0, rank=0, world_size=MAX_WORLD + 1)
    et.finish()
    (rec,) = _lines(run.shard_path)
    assert rec["_rank"] == 16383 and rec["_world_size"] == 16384


def test_world_size_over_the_sanity_cap_fails_at_init(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(MAX_WORLD + 1))
    with pytest.raises(ValueError, match="WORLD_SIZE=1048577 is over the sanity cap"):
        et.init("p", "r", dir=tmp_path)
    assert not (tmp_path / "p").exists()
