"""Reading committed rows back: `expr_tracker.history` and shard resolution for readers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expr_tracker.errors import RunNotFoundError
from expr_tracker.store.layout import parse_shard_name, shard_stem, validate_stream
from expr_tracker.store.shard import ShardReader, select_rows

if TYPE_CHECKING:
    from expr_tracker.run import Run


def resolve_shard(run: str | os.PathLike[str], stream: str | None = None, rank: int | None = None) -> Path:
    """A run directory -> the shard of (`stream`, `rank`, default 0); a shard file -> itself."""
    path = Path(run)
    if path.is_dir():
        stem = shard_stem(validate_stream(stream), rank or 0)
        shard = path / f"{stem}.jsonl"
        if not shard.exists():
            have = sorted(p.name for p in path.glob("metrics*.jsonl"))
            raise RunNotFoundError(
                f"no shard {shard.name} in {path}" + (f"; it has {', '.join(have)}" if have else "")
            )
        return shard
    if path.is_file():
        if rank is not None or stream is not None:
            parsed = parse_shard_name(path.name)
            if parsed is not None and (
                (rank is not None and parsed.rank != rank) or (stream is not None and parsed.stream != stream)
            ):
                return resolve_shard(path.parent, stream, rank)
        return path
    raise RunNotFoundError(f"no run directory or shard file at {path}")


def _parse_range(step_range: Any) -> tuple[int | None, int | None] | None:
    if step_range is None:
        return None
    if isinstance(step_range, range):
        return step_range.start, step_range.stop
    if isinstance(step_range, (tuple, list)) and len(step_range) == 2:
        lo, hi = step_range
        for v in (lo, hi):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError("step_range must be (start, stop) of ints or None")
        return lo, hi
    raise TypeError("step_range must be a (start, stop) pair, half-open like range()")


def history(
    n: int | None = 50,
    *,
    metrics: list[str] | str | None = None,
    step_range: Any = None,
    run: str | os.PathLike[str] | None = None,
    stream: Any = ...,
    rank: int | None = None,
    output_type: str = "dict",
    run_obj: Run | None = None,
) -> Any:
    """The last `n` committed rows (all for n=-1 or None), oldest first, as dicts."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(f"n must be an int or None, got {type(n).__name__}")
    if output_type not in ("dict", "pandas"):
        raise ValueError(f"output_type must be 'dict' or 'pandas', got {output_type!r}")
    if isinstance(metrics, str):
        metrics = [metrics]
    rng = _parse_range(step_range)
    if run is None:
        if run_obj is None:
            from expr_tracker import _state

            run_obj = _state.get()
        if (stream is not ... and stream != run_obj.stream) or (rank is not None and rank != run_obj.rank):
            path = resolve_shard(run_obj.paths.run_dir, None if stream is ... else stream, rank)
        else:
            path = run_obj.paths.shard
            run_obj.flush()  # read-your-writes
            if run_obj.mode == "spool":
                return _to_output(run_obj._sink.history(n, metrics, rng), output_type)
    else:
        path = resolve_shard(run, None if stream is ... else stream, rank)
    rows = select_rows(ShardReader(path), n, metrics=metrics, step_range=rng)
    return _to_output(rows, output_type)


def _to_output(rows: list[dict[str, Any]], output_type: str) -> Any:
    if output_type == "pandas":
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("output_type='pandas' needs pandas: pip install pandas") from None
        return pd.DataFrame(rows)
    return rows
