"""Synthetic runs of thousands of ranks, written straight to disk (fast): the tests of issue 12
and `bench/scale.py` share them.

Every rank has its shard (a step row `loss`, `tokens` and a rank record `step_time`,
`grad_norm` per step) and a sidecar naming its host (`gpu-0000`, 8 ranks per host) and a
pid that is not of this host, so that readers take the status as written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

T0 = 1_764_410_000.0
PER_NODE = 8


def host_of(rank: int) -> str:
    return f"gpu-{rank // PER_NODE:04d}"


def write_run(
    run_dir: Path,
    world: int,
    steps: int,
    *,
    straggler: int | None = None,
    crashed: int | None = None,
    slow: float = 1.6,
    status: str = "running",
    noisy: int | None = None,
    weights: dict[int, float] | None = None,
    rank_records: bool = True,
    stall: tuple[int, float] | None = None,
) -> Path:
    """Write `world` shards of `steps` steps each into `run_dir`; rank `straggler` has a
    `slow`x step time, rank `crashed` stopped half-way with an exception, rank `noisy` a
    step time of the same mean that swings +-40% from step to step; `weights` gives some
    ranks a `_weight` other than 1. Without `rank_records`, step rows alone (a job that
    logs with `et.log` only), the straggler's rows `slow`x further apart. `stall=(S,
    SECONDS)`: every rank paused SECONDS before step S (its `_time`s after it later)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name, project = run_dir.name, run_dir.parent.name
    for r in range(world):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        last = steps // 2 if r == crashed else steps
        end = T0 + last + (stall[1] if stall is not None and stall[0] < last else 0.0)
        factor = slow if r == straggler else 1.0
        weight = (weights or {}).get(r, 1.0)
        parts = []
        pause = 0.0
        for s in range(last):
            if stall is not None and s == stall[0]:
                pause = stall[1]
            t = T0 + s + pause
            # step times agree to the millisecond among healthy ranks, as they do in practice
            st = round((0.5 + 0.001 * ((r * 7 + s) % 5)) * factor, 6)
            if r == noisy:
                st = round(st * (1.4 if s % 2 else 0.6), 6)
            loss = round(2.0 / (s + 1) + 0.3 + 0.0001 * (r % 13), 6)
            if not rank_records:
                parts.append(f'{{"_step":{s},"_time":{T0 + s * factor + pause},"loss":{loss},'
                             f'"tokens":{4096 * (s + 1)}}}\n')
                continue
            parts.append(f'{{"_step":{s},"_time":{t},"loss":{loss},"tokens":{4096 * (s + 1)}}}\n'
                         f'{{"_kind":"rank","_step":{s},"_time":{t + 0.5},"_rank":{r},'
                         f'"_world_size":{world},"_local_rank":{r % PER_NODE},"_weight":{weight},'
                         f'"step_time":{st},"grad_norm":{round(1.0 + 0.01 * (r % 7), 6)}}}\n')
        body = "".join(parts).encode()
        shard = run_dir / f"{stem}.jsonl"
        shard.write_bytes(body)
        st_status = "crashed" if r == crashed else status
        meta = {
            "version": 1, "project": project, "name": name, "stream": None, "rank": r,
            "world_size": world, "local_rank": r % PER_NODE, "session": f"s{r}",
            "rank_aware": True, "config": {}, "host": host_of(r), "pid": 1_000_000 + r,
            "cursor": {"bytes": len(body), "rows": (2 if rank_records else 1) * last,
                       "last_step": last - 1,
                       "next_step": last, "applied": {}},
            "status": st_status, "start_time": T0, "end_time": None if st_status == "running" else end,
            "last_write": end,
        }
        if r == crashed:
            meta["exit"] = {"type": "RuntimeError", "message": "NCCL timeout", "time": end}
        (run_dir / f"{stem}.meta.json").write_text(json.dumps(meta))
        os.utime(shard, (end, end))
    # every sidecar rewritten at one moment, as a live job's are: writing thousands of
    # ranks takes tens of seconds on a loaded machine, and a first node's sidecars as old
    # as that are a node lost (health/lost.py reads their mtimes), which no test means
    now = time.time()
    for r in range(world):
        side = run_dir / ("metrics.meta.json" if r == 0 else f"metrics.rank{r}.meta.json")
        os.utime(side, (now, now))
    return run_dir
