"""The Accelerate tracker with a real `Accelerator`, on CPU, in one process and under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson

from tests.extras import need
from tests.procs import env_for

SCRIPT = """
import sys, torch
from accelerate import Accelerator
from expr_tracker.integrations.accelerate import ExprTrackerTracker

tracker = ExprTrackerTracker("acc", "tiny", dir=sys.argv[1] + "/runs")
accelerator = Accelerator(cpu=True, log_with=[tracker])
accelerator.init_trackers("acc", config={"lr": 0.1, "batch": 8})
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for step, (x, y) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.log({"loss": loss.item()}, step=step)        # the main process only
    tracker.log({"rank_loss": loss.detach()}, step=step)     # every process: its own shard
accelerator.end_training()
"""


def _rows(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _run(tmp_path: Path, nproc: int) -> Path:
    script = tmp_path / "acc.py"
    script.write_text(SCRIPT)
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run([*launch, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=180, env=env_for({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path / "runs" / "acc" / "tiny"


def test_accelerator_log_with_the_tracker(tmp_path: Path) -> None:
    need("accelerate", "accelerate")
    run_dir = _run(tmp_path, 1)
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["_step"] for r in rows] == [0, 1, 2, 3]
    assert all(isinstance(r["loss"], float) and isinstance(r["rank_loss"], float) for r in rows)
    side = json.loads((run_dir / "metrics.meta.json").read_text())
    assert side["config"] == {"lr": 0.1, "batch": 8}
    assert side["status"] == "finished"


def test_under_torchrun_every_process_writes_its_shard(tmp_path: Path) -> None:
    need("accelerate", "accelerate")
    run_dir = _run(tmp_path, 2)
    main = _rows(run_dir / "metrics.jsonl")
    other = _rows(run_dir / "metrics.rank1.jsonl")
    assert [r["_step"] for r in main] == [0, 1] == [r["_step"] for r in other]
    assert all("loss" in r for r in main)  # accelerator.log: main process only
    assert all("loss" not in r and "rank_loss" in r for r in other)
    side = json.loads((run_dir / "metrics.rank1.meta.json").read_text())
    assert (side["rank"], side["world_size"], side["status"]) == (1, 2, "finished")
