"""The Transformers callback with the real Trainer on a tiny GPT-2 built in code, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

import expr_tracker as et
from tests.extras import need
from tests.procs import env_for

ROOT = Path(__file__).resolve().parent.parent

# a training script: tiny model and data made in code (no download), every rank the same
SCRIPT = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from expr_tracker.integrations.transformers import ExprTrackerCallback

torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))}
        for _ in range(48)]
distributed = len(sys.argv) > 2
args = TrainingArguments(output_dir=sys.argv[1] + "/out", max_steps=6, logging_steps=2,
                         per_device_train_batch_size=4, report_to=[], save_strategy="no",
                         use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
                         eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4,
                         **({"ddp_backend": "gloo"} if distributed else {}))
callback = ExprTrackerCallback("hf", "tiny", dir=sys.argv[1] + "/runs",
                               config={"dataset": "random-48"})
Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8],
        callbacks=[callback]).train()
import expr_tracker as et
assert et.get_run() is None, "the callback finishes the run it started"
"""


# a trainer that raises at step 3 and the code goes on: the next trainers (another name,
# then one callback trained twice, then a rerun under that name) must each get their rows
FAULTS = """
import sys, torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)
from expr_tracker.integrations.transformers import ExprTrackerCallback

root = sys.argv[1]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                   n_positions=16, bos_token_id=0, eos_token_id=0))
data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))}
        for _ in range(48)]
args = TrainingArguments(output_dir=root + "/out", max_steps=6, logging_steps=2,
                         per_device_train_batch_size=4, report_to=[], save_strategy="no",
                         use_cpu=True, disable_tqdm=True)

class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise RuntimeError("boom at step 3")

def train(callback, *more):
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4],
                      callbacks=[callback, *more])
    trainer.train()
    return trainer

try:
    train(ExprTrackerCallback("hf", "exc", dir=root + "/runs"), Boom())
except RuntimeError:
    pass
train(ExprTrackerCallback("hf", "exc-after", dir=root + "/runs")).evaluate()  # reopens the run
twice = ExprTrackerCallback("hf", "twice", dir=root + "/runs")  # ... which ends well here
train(twice).evaluate()
train(twice)  # the trainer counts from 0 again: the rows continue the run's steps
train(ExprTrackerCallback("hf", "twice", dir=root + "/runs"))  # a rerun under the same name
"""


def test_a_failed_train_is_crashed_and_the_next_trainer_gets_its_own_run(tmp_path: Path) -> None:
    need("transformers", "transformers")
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env_for(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = tmp_path / "runs" / "hf"
    side = json.loads((runs / "exc" / "metrics.meta.json").read_text())
    assert side["status"] == "crashed", side
    assert (side["exit"]["type"], side["exit"]["message"]) == ("RuntimeError", "boom at step 3")
    assert [r["_step"] for r in _rows(runs / "exc" / "metrics.jsonl")] == [2]
    after = runs / "exc-after"
    # evaluate() after train() reopens the run: its row comes after the run's last step
    assert [(r["_step"], r.get("train/global_step")) for r in _rows(after / "metrics.jsonl")] \
        == [(2, None), (4, None), (6, None), (7, 6)]
    side = json.loads((after / "metrics.meta.json").read_text())
    assert side["status"] == "finished" and "exit" not in side  # not a failed training
    # three trainings (and an evaluation) into one run, every row kept: each shifted past
    # the run's last step, each shifted row with the trainer's own step
    rows = _rows(runs / "twice" / "metrics.jsonl")
    assert [r["_step"] for r in rows] == [2, 4, 6, 7, 8, 10, 12, 13, 15, 17]
    assert [r.get("train/global_step") for r in rows] == [None] * 3 + [6] + [2, 4, 6] * 2
    assert all("train/loss" in r for r in rows if r["_step"] != 7) and "eval/loss" in rows[3]
    assert "the trainer starts at step 6, behind the run's step 7" in proc.stderr  # evaluate()
    assert "the trainer starts at step 2, behind the run's step 8" in proc.stderr
    assert "the trainer starts at step 2, behind the run's step 13" in proc.stderr
    assert "stopped early" not in proc.stderr  # the guard saw the exception; evaluate() is no failure


def _rows(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _check_shard(run_dir: Path, shard: str, rank: int, world: int | None) -> None:
    rows = _rows(run_dir / f"{shard}.jsonl")
    # logging_steps=2 over 6 steps: rows at 2, 4, 6, an evaluation at 3 and 6; the
    # summary joins step 6's row. wandb's names: train/..., eval/..., the summary's own
    assert [r["_step"] for r in rows] == [2, 3, 4, 6]
    train = [r for r in rows if r["_step"] != 3]
    assert all(isinstance(r["train/loss"], float) and "train/learning_rate" in r
               and "train/epoch" in r for r in train)
    assert isinstance(rows[1]["eval/loss"], float) and "train/loss" not in rows[1]
    assert "eval/loss" in rows[-1]
    assert "train_loss" in rows[-1] and "train_runtime" in rows[-1]
    assert not any(k in r for r in rows for k in ("loss", "learning_rate", "eval_loss"))
    side = json.loads((run_dir / f"{shard}.meta.json").read_text())
    assert side["status"] == "finished"
    assert (side["rank"], side["world_size"]) == (rank, world)
    config = side["config"]
    assert config["n_embd"] == 16 and config["model_type"] == "gpt2"  # the model config
    assert config["max_steps"] == 6 and config["logging_steps"] == 2  # TrainingArguments
    assert config["dataset"] == "random-48"  # the caller's own config


def test_trainer_single_process_writes_one_shard(tmp_path: Path) -> None:
    need("transformers", "transformers")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env_for(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "hf" / "tiny"
    _check_shard(run_dir, "metrics", 0, None)  # no launcher: the world size is unknown (DESIGN 12)
    assert sorted(p.name for p in run_dir.glob("*.jsonl")) == ["metrics.jsonl"]


def test_trainer_under_torchrun_writes_a_shard_per_rank(tmp_path: Path) -> None:
    need("transformers", "transformers")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path), "ddp"]
    proc = subprocess.run(cmd, env=env_for({"OMP_NUM_THREADS": "1"}), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "hf" / "tiny"
    _check_shard(run_dir, "metrics", 0, 2)
    _check_shard(run_dir, "metrics.rank1", 1, 2)


def test_callback_in_process_reuses_a_run_the_code_started(tmp_path: Path) -> None:
    need("transformers", "transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from expr_tracker.integrations.transformers import ExprTrackerCallback

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    mine = et.init("hf", "mine", dir=tmp_path)
    callback = ExprTrackerCallback("hf", "ignored", dir=tmp_path)
    callback.on_train_begin(args, state, control)
    assert callback.run is mine
    state.global_step = 3
    callback.on_log(args, state, control, logs={"loss": 0.5, "per_class": [1, 2], "_x": 1,
                                                "eval_acc": 0.9, "test_f1": 0.7})
    callback.on_train_end(args, state, control)
    assert et.get_run() is mine  # the code that started it finishes it
    mine.finish()
    (row,) = _rows(mine.shard_path)
    assert {k: v for k, v in row.items() if k[0] != "_"} == {
        "train/loss": 0.5, "eval/acc": 0.9, "test/f1": 0.7}
    assert row["_step"] == 3
    assert not (tmp_path / "hf" / "ignored").exists()


def test_bad_arguments_raise_at_the_call(tmp_path: Path) -> None:
    need("transformers", "transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from expr_tracker.integrations.transformers import ExprTrackerCallback

    with pytest.raises(TypeError, match="config must be a dict"):
        ExprTrackerCallback("hf", "x", config=[1, 2])
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    callback = ExprTrackerCallback("hf", "x", dir=tmp_path, stream="a/b")
    with pytest.raises(ValueError, match="stream"):
        callback.on_train_begin(args, TrainerState(), TrainerControl())
    assert not (tmp_path / "hf").exists()


def test_import_expr_tracker_does_not_import_integrations() -> None:
    code = textwrap.dedent("""
        import sys, expr_tracker
        print([m for m in sys.modules if m.startswith(("expr_tracker.integrations", "transformers",
               "lightning", "pytorch_lightning", "accelerate", "torch"))])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]"
