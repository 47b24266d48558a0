"""The Lightning logger with the real Trainer on a tiny MLP, on CPU; every rank writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.extras import need
from tests.procs import env_for

# a tiny LightningModule; argv: tmp dir, fail-at-step (-1: never), [ddp | again]
SCRIPT = """
import sys, torch
try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl
from expr_tracker.integrations.lightning import ExprTrackerLogger

root, fail_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
ddp = mode == "ddp"

class Tiny(pl.LightningModule):
    def __init__(self, lr=0.05, hidden=8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, i):
        if self.global_step == fail_at:
            raise RuntimeError("diverged")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=8)
logger = ExprTrackerLogger("pl", "tiny", dir=root + "/runs")
trainer = pl.Trainer(max_epochs=2, logger=logger, log_every_n_steps=2, accelerator="cpu",
                     devices=2 if ddp else 1, strategy="ddp" if ddp else "auto",
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, default_root_dir=root + "/out")
try:
    trainer.fit(Tiny(), loader, loader)
except RuntimeError as exc:
    assert str(exc) == "diverged", exc
    sys.exit(3)
if mode == "again":  # a second fit with the same logger, then a rerun under the same name
    def fit(logger):
        pl.Trainer(max_epochs=1, logger=logger, log_every_n_steps=2, accelerator="cpu",
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, default_root_dir=root + "/out",
                   ).fit(Tiny(), loader, loader)
    fit(logger)
    fit(ExprTrackerLogger("pl", "tiny", dir=root + "/runs"))
"""


def _run(tmp_path: Path, *args: str, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    launch = [sys.executable, *(["-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", "2"] if torchrun else [])]
    return subprocess.run([*launch, str(script), str(tmp_path), *args], capture_output=True,
                          text=True, timeout=180, env=env_for({"OMP_NUM_THREADS": "1"}))


def _rows(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _sidecar(path: Path) -> dict:
    return json.loads(path.read_text())


def test_fit_logs_metrics_and_hyperparams(tmp_path: Path) -> None:
    need("lightning.pytorch", "lightning")
    proc = _run(tmp_path, "-1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "pl" / "tiny"
    rows = _rows(run_dir / "metrics.jsonl")
    # 8 batches an epoch, 2 epochs, a row every 2 steps; validation joins the epoch's last row
    assert len(rows) == 8
    assert [r["_step"] for r in rows] == sorted(r["_step"] for r in rows)
    assert all("train/loss" in r and r["epoch"] in (0, 1) for r in rows)
    assert sum("val/loss" in r for r in rows) == 2
    side = _sidecar(run_dir / "metrics.meta.json")
    assert side["status"] == "finished"
    assert side["config"] == {"lr": 0.05, "hidden": 8}


def test_failed_fit_marks_the_shard_crashed(tmp_path: Path) -> None:
    need("lightning.pytorch", "lightning")
    proc = _run(tmp_path, "5")
    assert proc.returncode == 3, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "pl" / "tiny"
    assert [r["_step"] for r in _rows(run_dir / "metrics.jsonl")] == [1, 3]
    side = _sidecar(run_dir / "metrics.meta.json")
    assert side["status"] == "crashed"
    # the exception Lightning was handling when it called finalize("failed")
    assert (side["exit"]["type"], side["exit"]["message"]) == ("RuntimeError", "diverged")


def test_a_second_fit_and_a_rerun_continue_the_steps(tmp_path: Path) -> None:
    need("lightning.pytorch", "lightning")
    proc = _run(tmp_path, "-1", "again")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(tmp_path / "runs" / "pl" / "tiny" / "metrics.jsonl")
    # 8 rows of the 2-epoch fit (last step 15), then 4 rows each of two 1-epoch fits
    # whose steps restart at 1: shifted past the run's step, none dropped
    assert [r["_step"] for r in rows] == [1, 3, 5, 7, 9, 11, 13, 15, 16, 18, 20, 22, 23, 25, 27, 29]
    assert [r.get("trainer/global_step") for r in rows] == [None] * 8 + [1, 3, 5, 7] * 2
    assert sum("val/loss" in r for r in rows) == 4  # every fit's validation kept
    assert proc.stderr.count("the trainer starts at step 1, behind the run's step") == 2


def test_ddp_under_torchrun_every_rank_writes(tmp_path: Path) -> None:
    need("lightning.pytorch", "lightning")
    proc = _run(tmp_path, "-1", "ddp", torchrun=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "pl" / "tiny"
    for shard, rank in (("metrics", 0), ("metrics.rank1", 1)):
        rows = _rows(run_dir / f"{shard}.jsonl")
        assert len(rows) == 4 and all("train/loss" in r for r in rows), shard  # 4 batches a rank
        side = _sidecar(run_dir / f"{shard}.meta.json")
        assert (side["rank"], side["world_size"], side["status"]) == (rank, 2, "finished")
        assert side["config"] == {"lr": 0.05, "hidden": 8}


def test_hyperparams_after_the_start_reach_the_sidecar(tmp_path: Path) -> None:
    need("lightning.pytorch", "lightning")
    from argparse import Namespace

    from expr_tracker.integrations.lightning import ExprTrackerLogger

    logger = ExprTrackerLogger("pl", "late", dir=tmp_path, config={"seed": 1})
    _ = logger.experiment  # Lightning touches it early: that must not start the run
    assert logger.session.run is None
    assert (logger.name, logger.version, logger.save_dir) == ("pl", "late", None)
    logger.log_hyperparams(Namespace(lr=0.1))
    logger.log_metrics({"loss": 1.0, "labels": [1, 2]}, step=0)
    run = logger.session.run
    assert run is not None
    logger.log_hyperparams({"batch": 8})  # after rows: merged into the open run's config
    shard = tmp_path / "pl" / "late" / "metrics.jsonl"
    assert logger.session.run is run and run.config == {"seed": 1, "lr": 0.1, "batch": 8}
    logger.log_metrics({"loss": 0.5}, step=1)
    assert logger.experiment.step == 1  # the Run (its open step), through the lazy handle
    with pytest.raises(ValueError, match="step must be >= 0"):  # refused, never shifted
        logger.log_metrics({"loss": 0.25}, step=-1)
    logger.save()
    logger.finalize("success")
    assert [(r["_step"], r["loss"]) for r in _rows(shard)] == [(0, 1.0), (1, 0.5)]
    side = _sidecar(shard.with_suffix(".meta.json"))
    assert side["config"] == {"seed": 1, "lr": 0.1, "batch": 8}
    assert side["status"] == "finished"
    assert side["session"] == run.session  # one session: the run was never finished and resumed


def test_late_hyperparams_in_spool_mode_keep_one_session(tmp_path: Path) -> None:
    """Spool mode with a real exprd: every row of the shard carries the one session."""
    need("lightning.pytorch", "lightning")
    from expr_tracker.integrations.lightning import ExprTrackerLogger
    from tests.test_daemon import exprd_once, write_config

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    logger = ExprTrackerLogger("pl", "late", dir=root, upload_mode="spool", spool_dir=spool)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_hyperparams({"batch": 8})
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.finalize("success")
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    shard = root / "pl" / "late" / "metrics.jsonl"
    rows = _rows(shard)
    assert [(r["_step"], r["loss"]) for r in rows] == [(0, 1.0), (1, 0.5)]
    assert len({r["_sid"] for r in rows}) == 1
    assert len(list((spool / "pl" / "late").glob("*.jsonl"))) == 1  # one spool session file
    side = _sidecar(shard.with_suffix(".meta.json"))
    assert side["config"] == {"lr": 0.1, "batch": 8} and side["status"] == "finished"
    with pytest.raises(TypeError, match="hyperparameters"):
        logger.log_hyperparams([1, 2])
