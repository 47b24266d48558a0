"""A stand-in training script: what every rank of a real job runs.

    RANK=0 WORLD_SIZE=4 python examples/train.py --steps 200
"""

from __future__ import annotations

import argparse
import math
import random
import time

import expr_tracker as et


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", default="demo")
    parser.add_argument("--name", default="sft-1")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nan-at", type=int, default=-1, help="step at which rank 0's loss diverges")
    parser.add_argument("--slow-rank", type=int, default=-1, help="a straggler rank")
    parser.add_argument("--sleep", type=float, default=0.001, help="seconds of 'work' per step")
    args = parser.parse_args()

    run = et.init(
        args.project,
        args.name,
        dir=args.dir,
        config={"lr": 3e-4, "batch_size": 32},
        alert_rules=["isnan(loss) => critical: loss diverged at step {step}"],
    )
    rng = random.Random(run.rank)
    for step in range(args.steps):
        loss = 2.0 * math.exp(-step / 80) + 0.05 * rng.random()
        if step == args.nan_at and run.rank == 0:
            loss = float("nan")
        step_time = 0.10 + 0.01 * rng.random() + (0.12 if run.rank == args.slow_rank else 0.0)
        et.log({"train/loss": loss, "loss": loss, "lr": 3e-4 * min(1.0, (step + 1) / 20)})
        run.log_rank_metrics(
            {"step_time": step_time, "tokens_per_s": 4096 / step_time, "grad_norm": 1.0 + rng.random()},
            step=step,
            weight=4096.0,
        )
        time.sleep(args.sleep * (2.0 if run.rank == args.slow_rank else 1.0))
    et.finish()


if __name__ == "__main__":
    main()
