"""Small runs for the view tests (plot, export, query, read_run): written as shards are."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import T0


def _write(path: Path, recs: list[dict], tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
    path.write_bytes(body.encode() + tail)


def shard_name(rank: int, stream: str | None = None) -> str:
    parts = ["metrics", *([stream] if stream else []), *([f"rank{rank}"] if rank else [])]
    return ".".join(parts) + ".jsonl"


def loss_value(rank: int, step: int, outlier: int | None = None) -> float:
    """A falling curve with a per-rank offset; the `outlier` rank jumps after step 20."""
    return round(2.0 / (step + 1) + 0.001 * rank + (1.0 if rank == outlier and step >= 20 else 0.0), 6)


def make_run(run: Path, ranks: int, steps: int, *, outlier: int | None = None,
             nan_at: tuple[int, int] | None = None) -> Path:
    """`ranks` shards of `steps` step rows (loss, lr, tag) plus one rank record per step;
    loss is the string "NaN" at (rank, step) `nan_at`; rank 1 ends in a torn line."""
    for r in range(ranks):
        recs: list[dict] = []
        for s in range(steps):
            loss: object = loss_value(r, s, outlier)
            if nan_at == (r, s):
                loss = "NaN"
            recs.append({"_step": s, "_time": T0 + s, "loss": loss, "lr": 1e-4, "tag": "a"})
            recs.append({"_kind": "rank", "_step": s, "_time": T0 + s + 0.5, "_rank": r,
                         "_world_size": ranks, "_local_rank": r, "_weight": 1.0,
                         "step_time": 1.0 + 0.01 * r})
        _write(run / shard_name(r), recs, b'{"_step":99,"lo' if r == 1 else b"")
    return run
