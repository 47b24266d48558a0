"""Real DDP training on CPU (gloo, a small MLP) with per-rank step times; one rank can be slow.

    torchrun --standalone --nproc_per_node 4 examples/ddp_train.py --slow-rank 2
    expr summary ddp/mlp --steps 5:40          # step_time: rank 2 is flagged as the outlier

Every rank calls `et.init` (torchrun sets RANK and WORLD_SIZE) and writes its own shard:
`loss` as its step rows, and `step_time` / `wait_time` as rank records that `expr summary`
reduces across ranks. `EXPR_MODE=spool` (with `EXPR_SPOOL`) hands the rows to exprd instead.

`step_time` is the time a rank spends on its own part of a step (loading its batch and the
forward pass) before the gradient all-reduce in `backward()` makes every rank wait for the
slowest one: the wall time of a whole step is the same on every rank of a DDP job, so it
cannot tell which rank holds the others up. `wait_time` is the rest of the step.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import expr_tracker as et


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", default="ddp")
    parser.add_argument("--name", default="mlp")
    parser.add_argument("--dir", default=None, help="run root (default $EXPR_DIR or ./tracker/jsonl)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank loads its batches slowly")
    parser.add_argument("--slow-ms", type=float, default=30.0, help="how much slower, per step")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))

    run = et.init(args.project, args.name, dir=args.dir,
                  config={"world_size": world, "batch": args.batch, "lr": 0.05,
                          "slow_rank": args.slow_rank})
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = torch.randn(args.batch, 16, generator=data)
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)  # a slow disk or dataloader on this rank
        loss = nn.functional.mse_loss(model(x), x @ target)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()  # the all-reduce: every rank waits here for the slowest
        optimizer.step()
        t2 = time.perf_counter()
        run.log_rank_metrics({"step_time": t1 - t0, "wait_time": t2 - t1}, step=step)
        et.log({"loss": loss.item()}, step=step)
    et.finish()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks; rank shards in {run.shard_path.parent}")


if __name__ == "__main__":
    main()
