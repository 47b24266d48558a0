"""examples/ddp_train.py: real DDP under torchrun (4 ranks, gloo), direct and through exprd.

`expr summary --json` on the run must name the slow rank as the step_time outlier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.extras import need
from tests.procs import env_for
from tests.test_daemon import sidecar, start_exprd, stop, wait_for, wait_ready, write_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"
EXPR = Path(sys.executable).parent / "expr"
STEPS, WORLD, SLOW = 16, 4, 2


def _torchrun(tmp_path: Path, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(WORLD), str(EXAMPLE), "--dir", str(tmp_path / "runs"),
           "--steps", str(STEPS), "--slow-rank", str(SLOW)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env_for({"OMP_NUM_THREADS": "1", **(env or {})}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"done: {STEPS} steps on {WORLD} ranks" in proc.stdout


def _check_run(run_dir: Path) -> None:
    for rank in range(WORLD):
        shard = run_dir / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
        rows = [json.loads(line) for line in shard.read_text().splitlines()]
        rank_rows = [r for r in rows if r.get("_kind") == "rank"]
        assert [r["_step"] for r in rows if "_kind" not in r] == list(range(STEPS))
        assert [r["_rank"] for r in rank_rows] == [rank] * STEPS
        assert sidecar(shard.with_name(shard.stem + ".meta.json"))["status"] == "finished"
    proc = subprocess.run([str(EXPR), "summary", str(run_dir), "--steps", f"2:{STEPS}", "--json"],
                          capture_output=True, text=True, timeout=60, env=env_for())
    assert proc.returncode == 0, proc.stderr
    keys = {k["key"]: k for k in json.loads(proc.stdout)["keys"]}
    assert keys["step_time"]["stats"]["n"] == WORLD
    assert [o["rank"] for o in keys["step_time"]["outliers"] if o["flagged"]] == [SLOW]


def test_ddp_example_direct_mode(tmp_path: Path) -> None:
    need("torch", "torch")
    _torchrun(tmp_path)
    _check_run(tmp_path / "runs" / "ddp" / "mlp")


def test_ddp_example_spool_mode_through_exprd(tmp_path: Path) -> None:
    need("torch", "torch")
    spool, state, runs = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [runs])
    daemon = start_exprd(cfg)
    try:
        wait_ready(state, daemon)
        _torchrun(tmp_path, {"EXPR_MODE": "spool", "EXPR_SPOOL": str(spool)})
        run_dir = runs / "ddp" / "mlp"
        sidecars = [run_dir / ("metrics.meta.json" if r == 0 else f"metrics.rank{r}.meta.json")
                    for r in range(WORLD)]
        wait_for(lambda: all(sidecar(p).get("status") == "finished" for p in sidecars), 30,
                 "exprd to apply and finish every rank's shard")
    finally:
        assert stop(daemon) == 0
    _check_run(run_dir)
