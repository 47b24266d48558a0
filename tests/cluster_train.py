"""The cluster harness's training job: a tiny DDP model over gloo, one `et.log` per step.

Run by torchrun on every node (tests/cluster_job.py starts it). Each rank keeps a ledger
outside the run root, which the harness compares with the shards: `<run>.rank<R>.steps`
gets a step's number right after its `et.log()` returned (so a rank killed -9 leaves the
steps it had logged), and `<run>.rank<R>.json` gets `et.info()` and the host at the end.

Environment: ROOT (run root), RUN_NAME, STEPS, STEP_SLEEP (seconds per step), PAD (bytes
of padding per row, to fill a spool faster), LEDGER (directory), STALL
("rank:step:seconds": that rank sleeps there, outside the collective), RANK_ENV
("rank:NAME=VALUE,...": variables set in that rank before `et.init`), EXPR_MODE and
EXPR_SPOOL as the SDK reads them.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import expr_tracker as et


def main() -> None:
    env = os.environ
    steps, pause, pad = int(env["STEPS"]), float(env.get("STEP_SLEEP", "0")), int(env.get("PAD", "0"))
    stall_rank, stall_step, stall_for = (int(float(x)) for x in env.get("STALL", "-1:-1:0").split(":"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # RANK_ENV="3:NAME=VALUE,...": variables for one rank only (a smaller spool buffer)
    want, _, assigns = env.get("RANK_ENV", "").partition(":")
    if want and int(want) == rank:
        os.environ.update(a.split("=", 1) for a in assigns.split(","))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = et.init("cluster", env["RUN_NAME"], dir=env["ROOT"])
    ledger = os.path.join(env["LEDGER"], f"{env['RUN_NAME']}.rank{rank}")
    # one write per step on an O_APPEND descriptor: cheap, and what a kill -9 leaves is exact
    fd = os.open(ledger + ".steps", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for step in range(steps):
        if rank == stall_rank and step == stall_step:
            time.sleep(stall_for)  # a slow filesystem or dataloader: the others wait in all_reduce
        x = torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # the all-reduce across both nodes
        opt.step()
        row: dict[str, object] = {"loss": loss.item(), "rank_of": rank}
        if pad:
            row["pad"] = "x" * pad
        # commit=True: the row is whole when log() returns (with only `step=`, wandb's
        # semantics keep a step's row open for more keys until the next step), so the
        # ledger's steps are exactly the rows the SDK owes the shard
        et.log(row, step=step, commit=True)
        os.write(fd, b"%d\n" % step)
        time.sleep(pause)
    before = et.info()
    et.finish()
    # after finish too: rows that could not be written show up only then
    record = {"host": socket.gethostname(), "rank": rank, "info": before, "after": run.info()}
    with open(ledger + ".json", "w") as f:
        json.dump(record, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
