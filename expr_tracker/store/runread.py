"""Reading a whole run: the step rows (or rank records) of every shard as flat rows, in batches.

`expr export`, `expr plot` and `et.read_run` read runs through `RunReader`. A row is
`{"_rank", "_stream", "_step", "_time", <metric keys>}` (rank records add `_world_size`,
`_local_rank` and `_weight`):

- `_rank` is the record's own `_rank` when it has one (rank records, rows of a shared
  `rank_aware=False` file), else the rank in the shard's file name; `_stream` comes from the
  file name (None for the default stream).
- Shards are read one after the other, sorted by stream then rank, each in file order;
  only complete lines count (DESIGN 4) and lines that do not parse are skipped and counted
  in `garbage`. exprd's `_sid`/`_seq` bookkeeping is left out.
- Memory is bounded by the batch size and the number of distinct keys, never by the run.

`columns()` is one extra pass over the run that finds every metric key and the one type
that holds all of its values (`int`, `float`, `bool`, `str`, or `json` for a mix such as
numbers and text), so that a columnar writer knows its schema before the first row.
Non-finite floats arrive as floats (`records.loads` decodes "NaN"/"Infinity").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from expr_tracker.store.layout import parse_shard_name, validate_stream
from expr_tracker.store.reader import ShardReader
from expr_tracker.store.safedir import refused_special

ALL_STREAMS: Any = ...
"""`stream=ALL_STREAMS` (the default) reads every stream; None is the default stream."""

BATCH_ROWS = 65_536
ROW_COLUMNS = ("_rank", "_stream", "_step", "_time")
RANK_COLUMNS = (*ROW_COLUMNS, "_world_size", "_local_rank", "_weight")
RESERVED_KINDS = {
    "_rank": "int", "_stream": "str", "_step": "int", "_time": "float",
    "_world_size": "int", "_local_rank": "int", "_weight": "float",
}
_INT64 = (-(2**63), 2**63 - 1)


class RunShard(NamedTuple):
    """One shard file of a run and what its name says."""

    path: Path
    stream: str | None
    rank: int


def run_shards(run_dir: str | os.PathLike[str], stream: Any = ALL_STREAMS) -> list[RunShard]:
    """The shard files of a run directory (of one stream, or all), sorted by stream then rank."""
    if stream is not ALL_STREAMS:
        validate_stream(stream)
    out = []
    run = Path(run_dir)
    # scandir: the entry's type comes with its name (no stat unless it is a symlink),
    # and a Path only for a shard: at 16,384 ranks (32,768 entries) 0.3 s less
    with os.scandir(run) as entries:
        for entry in entries:
            parsed = parse_shard_name(entry.name)
            if parsed is None:
                continue
            if not entry.is_file():  # (a symlink followed)
                if not entry.is_dir():  # a FIFO, socket or device: named, never read
                    refused_special(os.path.join(run, entry.name))
                continue
            if stream is ALL_STREAMS or parsed.stream == stream:
                out.append(RunShard(run / entry.name, parsed.stream, parsed.rank))
    out.sort(key=lambda s: (s.stream or "", s.rank))
    return out


def _int(v: Any) -> TypeGuard[int]:
    return type(v) is int


def _num(v: Any) -> TypeGuard[int | float]:
    return type(v) is int or type(v) is float


def value_kind(v: Any) -> str | None:
    """The column type of one value; None for null."""
    if v is None:
        return None
    t = type(v)
    if t is bool:
        return "bool"
    if t is int:
        return "int" if _INT64[0] <= v <= _INT64[1] else "float"
    if t is float:
        return "float"
    if t is str:
        return "str"
    return "json"  # a list or an object written by another tracker


def merge_kinds(a: str | None, b: str | None) -> str | None:
    """The type that holds values of both kinds (int and float -> float; others -> json)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if {a, b} == {"int", "float"}:
        return "float"
    return "json"


class RunReader:
    """The rows of a run's shards (one stream or all), step rows or rank records."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        stream: Any = ALL_STREAMS,
        rank_records: bool = False,
        metrics: Sequence[str] | None = None,
        ranks: Sequence[int] | None = None,
        step_range: tuple[int | None, int | None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.shards = run_shards(self.run_dir, stream)
        self.rank_records = rank_records
        self.metrics = list(metrics) if metrics else None
        self.ranks = frozenset(ranks) if ranks is not None else None
        self.step_range = step_range or (None, None)
        self.garbage = 0  # lines that did not parse, in the latest pass over the run
        self.reserved = RANK_COLUMNS if rank_records else ROW_COLUMNS

    def _records_of(self, shard: RunShard) -> Iterator[tuple[dict[str, Any], int]]:
        """(record, its rank) of every record of `shard` that makes a row."""
        reader = ShardReader(shard.path)
        want_kind = "rank" if self.rank_records else None
        lo, hi = self.step_range
        metrics = self.metrics
        ranks = self.ranks
        try:
            for rec in reader.iter_all():
                if rec.get("_kind") != want_kind:
                    continue
                step = rec.get("_step")
                if not _int(step) or (lo is not None and step < lo) or (hi is not None and step >= hi):
                    continue
                rank = rec.get("_rank")
                if not _int(rank) or rank < 0:
                    rank = shard.rank
                if ranks is not None and rank not in ranks:
                    continue
                if metrics is not None and not any(k in rec for k in metrics):
                    continue
                yield rec, rank
        finally:
            self.garbage += reader.garbage

    def _rows_of(self, shard: RunShard) -> Iterator[dict[str, Any]]:
        want_kind = "rank" if self.rank_records else None
        metrics = self.metrics
        for rec, rank in self._records_of(shard):
            t = rec.get("_time")
            row: dict[str, Any] = {
                "_rank": rank,
                "_stream": shard.stream,
                "_step": rec["_step"],
                "_time": float(t) if _num(t) else None,
            }
            if want_kind is not None:
                for k in ("_world_size", "_local_rank"):
                    v = rec.get(k)
                    row[k] = v if _int(v) else None
                w = rec.get("_weight")
                row["_weight"] = float(w) if _num(w) else None
            if metrics is None:
                row.update({k: v for k, v in rec.items() if k[:1] != "_"})
            else:
                for k in metrics:
                    if k in rec:
                        row[k] = rec[k]
            yield row

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every matching row, shard after shard."""
        self.garbage = 0
        for shard in self.shards:
            yield from self._rows_of(shard)

    def batches(self, size: int = BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
        """The rows in lists of at most `size`."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        batch: list[dict[str, Any]] = []
        for row in self.rows():
            batch.append(row)
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch

    def columns(self) -> dict[str, str]:
        """Every column (reserved first, then metric keys in order of first appearance) and
        its type; one pass over the run. Metric keys without any non-null value are `str`."""
        kinds: dict[str, str | None] = {}
        metrics = self.metrics
        self.garbage = 0
        # from the records themselves, in the rows' key order: no row dicts built
        for shard in self.shards:
            for rec, _ in self._records_of(shard):
                items = rec.items() if metrics is None else [(k, rec[k]) for k in metrics if k in rec]
                for k, v in items:
                    if k[:1] == "_":
                        continue
                    kind = value_kind(v)
                    if k not in kinds:
                        kinds[k] = kind
                    elif kind is not None and kinds[k] != kind:
                        kinds[k] = merge_kinds(kinds[k], kind)
        if self.metrics is not None:
            kinds = {k: kinds[k] for k in self.metrics if k in kinds}
        out = {k: RESERVED_KINDS[k] for k in self.reserved}
        out.update((k, v or "str") for k, v in kinds.items())
        return out
