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

# loops that raise and code that goes on: the next tracker gets its own run; `with tracker:`
# records the exception itself
FAULTS = """
import sys, torch
from accelerate import Accelerator
from expr_tracker.integrations.accelerate import ExprTrackerTracker

root = sys.argv[1] + "/runs"

def loop(tracker, fail_at=None, steps=4):
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("acc", config={"lr": 0.1})
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    for step in range(steps):
        if step == fail_at:
            raise RuntimeError(f"loss is NaN at step {step}")
        loss = model(torch.ones(2, 4)).pow(2).mean()
        accelerator.log({"loss": loss.item()}, step=step)
    accelerator.end_training()

try:
    loop(ExprTrackerTracker("acc", "exc", dir=root), fail_at=2)
except RuntimeError:
    pass
loop(ExprTrackerTracker("acc", "exc-after", dir=root))
loop(ExprTrackerTracker("acc", "exc-after", dir=root), steps=2)  # a rerun: steps from 0 again
tracker = ExprTrackerTracker("acc", "ctx", dir=root)
try:
    with tracker:
        loop(tracker, fail_at=1)
except RuntimeError:
    pass
"""


def test_a_loop_that_raises_never_leaks_its_run_into_the_next(tmp_path: Path) -> None:
    need("accelerate", "accelerate")
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env_for({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = tmp_path / "runs" / "acc"

    def side(name: str) -> dict:
        return json.loads((runs / name / "metrics.meta.json").read_text())

    def steps(name: str) -> list[int]:
        return [r["_step"] for r in _rows(runs / name / "metrics.jsonl")]

    # no hook saw the exception the code caught: closed as abandoned when the next started
    assert (side("exc")["status"], side("exc")["exit"]["type"]) == ("crashed", "TrainingAbandoned")
    assert "acc/exc-after started after it" in side("exc")["exit"]["message"]
    assert "acc/exc was left open by a trainer that stopped early" in proc.stderr
    assert steps("exc") == [0, 1]
    assert (side("exc-after")["status"], steps("exc-after")) == ("finished", [0, 1, 2, 3, 4, 5])
    rerun = _rows(runs / "exc-after" / "metrics.jsonl")[4:]  # shifted, its own step kept
    assert [r["accelerate/step"] for r in rerun] == [0, 1]
    ctx = side("ctx")  # `with tracker:` saw it: the exception's own type and message
    assert ctx["status"] == "crashed"
    assert (ctx["exit"]["type"], ctx["exit"]["message"]) == ("RuntimeError", "loss is NaN at step 1")
    assert steps("ctx") == [0]


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
