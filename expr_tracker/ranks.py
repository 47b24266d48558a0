"""Rank and world detection from the launcher's environment (DESIGN 12)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int | None  # None: not set by the launcher, so unknown (DESIGN 12)
    local_rank: int
    local_world_size: int


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    return None


def detect(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read RANK, then LOCAL_RANK (then SLURM/OpenMPI only if neither is set), default 0.

    The world size is None when no launcher variable sets it: a plain `RANK=3 python
    train.py` says nothing about how many ranks there are, and guessing `rank + 1` would
    turn a valid `alert_on_rank=5` into a crash.
    """
    env = os.environ if env is None else env
    local = _int(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    rank = _int(env, "RANK")
    if rank is None:
        rank = _int(env, "LOCAL_RANK")
    if rank is None:
        rank = _int(env, "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    rank = rank or 0
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE") or None
    local_world = _int(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE") or 1
    local = local or 0
    if rank < 0:
        raise ValueError(f"detected rank {rank} is negative")
    if world is not None and world < rank + 1:
        # the variables contradict each other (RANK from one launcher, a size from
        # another): the rank names the shard; the world size is not known after all
        world = None
    return RankInfo(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


def compact(ranks: Iterable[int]) -> str:
    """Ranks as ranges for people: `[0, 1, 2, 3, 7]` -> `0-3,7` (`-` for none)."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out) if out else "-"
