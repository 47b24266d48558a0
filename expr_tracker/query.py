"""Reading committed rows back: `expr_tracker.history` and shard resolution for readers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from expr_tracker.errors import RunNotFoundError
from expr_tracker.outputs import output_kind
from expr_tracker.store.layout import parse_shard_name, shard_stem, validate_stream
from expr_tracker.store.reader import ShardReader, select_rows


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


def history_args(n: Any, metrics: list[str] | str | None, step_range: Any, output_type: str
                 ) -> tuple[list[str] | None, tuple[int | None, int | None] | None]:
    """Check `history`'s arguments; return the metrics list and the step range."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(f"n must be an int or None, got {type(n).__name__}")
    output_kind(output_type)
    if isinstance(metrics, str):
        metrics = [metrics]
    return metrics, _parse_range(step_range)


def history(
    n: int | None = 50,
    *,
    metrics: list[str] | str | None = None,
    step_range: Any = None,
    run: str | os.PathLike[str],
    stream: Any = ...,
    rank: int | None = None,
    output_type: str = "dict",
    include_meta: bool = True,
) -> Any:
    """The last `n` committed rows (all for n=-1 or None) of a shard of `run`, oldest first.
    `include_meta=False` (0.4) leaves out the `_` keys but `_step`.

    Reads files only; the current run's own rows (read-your-writes, spool mode) are
    `Run.history`'s.
    """
    metric_list, rng = history_args(n, metrics, step_range, output_type)
    path = resolve_shard(run, None if stream is ... else stream, rank)
    rows = select_rows(ShardReader(path), n, metrics=metric_list, step_range=rng)
    return to_output(strip_meta(rows, include_meta), output_type)


def strip_meta(rows: list[dict[str, Any]], include_meta: bool) -> list[dict[str, Any]]:
    """`rows` as they are, or without the `_` keys (`_time`, `_sid`, `_seq`...) but `_step`."""
    if include_meta:
        return rows
    return [{k: v for k, v in r.items() if k == "_step" or not k.startswith("_")} for r in rows]


def to_output(rows: list[dict[str, Any]], output_type: str) -> Any:
    """`rows` as `output_type` asks: a list of dicts, a pandas DataFrame or an Arrow table."""
    kind = output_kind(output_type)
    if kind == "pandas":
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("output_type='pandas' needs pandas: pip install pandas") from None
        return pd.DataFrame(rows)
    if kind == "arrow":
        try:
            import pyarrow as pa
        except ImportError:
            raise ImportError("output_type='arrow' needs pyarrow: pip install 'expr-tracker[export]'") from None
        return pa.Table.from_pylist(rows)
    return rows
