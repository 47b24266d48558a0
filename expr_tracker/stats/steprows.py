"""Step rows (`et.log` metrics) of many shards as one `RankTable`, each shard's rows under its
rank (issue 11: `expr summary -m loss`; the default summary of a job that logs no rank records).

A block of whole lines is parsed by one `orjson.loads` (`records.loads_block`) and each key's
values are taken from its records with C-level `map` calls: no Python runs per value where
a key holds numbers, as it does at almost every step. What is not that (text, booleans,
nulls, non-finite text, a step that is not an int) goes value by value, by the rules of
`ranktable.collect`; a block that is not one JSON object per line goes line by line, the
lines naming none of the keys left unparsed and uncounted, as `expr summary` always has.
`tests/test_steprows.py` holds both to `collect` of the records the line-by-line reader made.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Collection, Sequence
from functools import partial
from itertools import compress, islice, repeat
from operator import contains, is_, lt
from typing import Any

from expr_tracker.gcpause import paused_gc
from expr_tracker.stats.ranktable import _MAX_RANKS, RankTable
from expr_tracker.stats.scan import Block, ColumnTable
from expr_tracker.store import records
from expr_tracker.store.safedir import open_read
from expr_tracker.store.window import window_start

_BLOCK = 4 << 20  # bytes parsed at a time: bounds the records held in memory
_NONFINITE = records.DECODE_NONFINITE
_get = dict.get
_FLOATS = frozenset((float,))
_NUMBERS = frozenset((float, int))


class _Rows:
    """key -> rank -> step -> value and rank -> step -> weight, as `collect` builds them."""

    def __init__(self) -> None:
        self.cols: dict[str, dict[int, dict[int, float]]] = {}
        self.weights: dict[int, dict[int, float]] = {}
        self.skipped = 0

    def add(self, rank: int, recs: list[dict[str, Any]], keys: Collection[str],
            prefix: str | None) -> None:
        """The step rows among `recs` (records of one shard, file order) under `rank`: each
        row holding one of `keys` (or a key starting with `prefix`) gives the step a weight
        of 1.0, and each number of those keys its value (later rows win)."""
        kinds = list(map(_get, recs, repeat("_kind")))
        if kinds.count(None) != len(recs):
            recs = list(compress(recs, map(is_, kinds, repeat(None))))
        if not recs:
            return
        if prefix is not None:
            keys = sorted(k for k in set().union(*recs) if k.startswith(prefix))
        if not keys:
            return
        steps: list[Any] = list(map(_get, recs, repeat("_step")))
        if set(map(type, steps)) != {int}:
            # (`collect` skips a record without an int step, once per record)
            good = [s.__class__ is int for s in steps]
            held = [any(k in r for k in keys) for r in recs]
            self.skipped += sum(h and not g for g, h in zip(good, held, strict=True))
            recs = list(compress(recs, good))
            steps = list(compress(steps, good))
            if not recs:
                return
        holds = [list(map(contains, recs, repeat(k))) for k in keys]
        held = holds[0] if len(holds) == 1 else [any(h) for h in zip(*holds, strict=True)]
        seen = dict.fromkeys(compress(steps, held), 1.0)
        if not seen:
            return
        self.weights.setdefault(rank, {}).update(seen)
        for key, has in zip(keys, holds, strict=True):
            values = list(map(_get, compress(recs, has), repeat(key)))
            if values:
                self._add_values(key, rank, list(compress(steps, has)), values)

    def _add_values(self, key: str, rank: int, steps: Sequence[int], values: list[Any]) -> None:
        types = set(map(type, values))
        if not types <= _FLOATS:
            if str in types:
                values = [_NONFINITE.get(x, x) if x.__class__ is str else x for x in values]
                types = set(map(type, values))
            if not types <= _NUMBERS:
                # text, booleans, null, lists: only the numbers count (`collect`)
                keep = [v.__class__ is float or v.__class__ is int for v in values]
                steps = list(compress(steps, keep))
                values = list(compress(values, keep))
                if not values:
                    return
            if int in types:
                values = list(map(float, values))
        self.put(key, rank, steps, values)

    def put(self, key: str, rank: int, steps: Sequence[int], values: Sequence[float]) -> None:
        """`rank`'s numbers of `key` at `steps` (later ones win)."""
        col = self.cols.setdefault(key, {}).get(rank)
        if col is None:
            self.cols[key][rank] = dict(zip(steps, values, strict=True))
        else:
            col.update(zip(steps, values, strict=True))


def _line_records(data: bytes, marks: Sequence[bytes]) -> tuple[list[dict[str, Any]], int]:
    """The records of the lines of `data` naming one of `marks`, parsed one by one (bare
    NaN tokens accepted), and how many of those did not parse."""
    out: list[dict[str, Any]] = []
    bad = 0
    for _, line in records.iter_lines(data):
        if not any(m in line for m in marks):
            continue
        try:
            rec = records.loads(line)
        except ValueError:
            bad += 1
            continue
        if rec.__class__ is dict:
            out.append(rec)
    return out, bad


def _block_columns(recs: list[dict[str, Any]], keys: Sequence[str]) -> tuple[
        list[int], list[list[Any]]] | None:
    """The steps and each key's numbers of the step rows among `recs` (file order), taken in
    C, when they make a `scan.Block`: the rows holding any of `keys` hold every one, at
    strictly increasing int steps, as numbers (non-finite ones as text too). None when
    not (a key that comes and goes, a repeated step, text): `_Rows` then."""
    kinds = list(map(_get, recs, repeat("_kind")))
    if kinds.count(None) != len(recs):
        recs = list(compress(recs, map(is_, kinds, repeat(None))))
    holds = [list(map(contains, recs, repeat(k))) for k in keys]
    counts = [h.count(True) for h in holds]
    if counts and min(counts) != len(recs):
        if min(counts) != max(counts):
            return None  # (held rows hold every key only if each key has as many)
        every = [all(h) for h in zip(*holds, strict=True)]
        if every.count(True) != counts[0]:
            return None
        recs = list(compress(recs, every))
    steps: list[Any] = list(map(_get, recs, repeat("_step")))
    if steps and (set(map(type, steps)) != {int}
                  or not all(map(lt, steps, islice(steps, 1, None)))):
        return None
    columns = []
    for key in keys:
        values: list[Any] = list(map(_get, recs, repeat(key)))
        types = set(map(type, values))
        if str in types:
            values = [_NONFINITE.get(x, x) if x.__class__ is str else x for x in values]
            types = set(map(type, values))
        if not types <= _NUMBERS:
            return None
        columns.append(values)
    return steps, columns


def _extend(steps: Any, columns: list[Any], recs: list[dict[str, Any]], keys: Sequence[str]) -> bool:
    """Append the step rows of `recs` (the next block of lines of one shard) to its arrays,
    its steps and each key's values, if they go on making a block (`_block_columns`);
    False, the arrays as they were, if not."""
    got = _block_columns(recs, keys)
    if got is None or (got[0] and steps and got[0][0] <= steps[-1]):
        return False
    n = len(steps)
    try:
        steps.extend(got[0])
        for col, values in zip(columns, got[1], strict=True):
            col.extend(values)
    except OverflowError:  # a step past int64, a number past a double
        del steps[n:]
        for col in columns:
            del col[n:]
        return False
    return True


# what one shard gives: its file name, unparseable lines, skipped rows, the steps of its
# rows (a weight of 1.0 each) and per key the steps and values; arrays where they fit
# (sent back from a worker process at a fraction of a dict's pickling); and whether it is
# a block (`_block_columns`: strictly increasing steps, every key at each)
_Part = tuple[str, int, int, Any, dict[str, tuple[Any, Any]], bool]


def _read_shard(path: str, rank: int, keys: Collection[str], lo: int | None,
                prefix: str | None) -> _Part:
    """One read of a shard's step rows: into arrays while they make a block (`_extend`),
    into `_Rows` from the first block of lines that does not, with what the arrays hold."""
    names = list(keys)
    steps: Any = array("q")
    columns = [array("d") for _ in names]
    rows = None if prefix is None and names else _Rows()
    marks = [b'"' + k.encode() + b'"' for k in keys] if prefix is None else [b'"' + prefix.encode()]
    bad = 0
    with open_read(path) as fh:
        start = window_start(fh, lo) if lo is not None else 0
        for _, data in records.complete_blocks(fh, _BLOCK, start):
            recs = records.loads_block(data)  # (non-finite text: decoded per key)
            if rows is None:
                if recs is not None and _extend(steps, columns, recs, names):
                    continue
                rows = _Rows()
                if steps:
                    rows.weights[rank] = dict.fromkeys(steps, 1.0)
                    for key, col in zip(names, columns, strict=True):
                        rows.put(key, rank, steps, col)
            if recs is None:  # a torn or foreign line, bare NaN: line by line
                recs, n_bad = _line_records(data, marks)
                bad += n_bad
            rows.add(rank, recs, keys, prefix)
    if rows is None:
        by_key = {k: (steps, col) for k, col in zip(names, columns, strict=True)} if steps else {}
        return os.path.basename(path), 0, 0, steps, by_key, True
    seen = rows.weights.get(rank, {})
    mine = {key: by_rank[rank] for key, by_rank in rows.cols.items()}
    cols: dict[str, tuple[Any, Any]]
    try:
        steps = array("q", seen)
        cols = {key: (array("q", col), array("d", col.values())) for key, col in mine.items()}
    except OverflowError:  # a step past int64: as they are
        steps = list(seen)
        cols = {key: (list(col), list(col.values())) for key, col in mine.items()}
    return os.path.basename(path), bad, rows.skipped, steps, cols, False


def _read_shards(items: list[tuple[str, int]], keys: Collection[str], lo: int | None,
                 prefix: str | None) -> list[_Part]:
    return [_read_shard(path, rank, keys, lo, prefix) for path, rank in items]


def row_table(
    shards: Sequence[tuple[str | os.PathLike[str], int]],
    keys: Collection[str],
    lo: int | None,
    world: int,
    prefix: str | None = None,
    expected_bytes: int | None = None,
) -> tuple[RankTable, dict[str, int]]:
    """The numeric `keys` of the step rows of each (path, rank) in `shards` from about step
    `lo` on, as a table of that rank, and the lines that did not parse per file name; with
    `prefix`, every key starting with it instead (`expr summary --spans`: `time_ms/`).

    Shards of many ranks are read in worker processes too (`parallel.map_forked`), when
    what they would read (`expected_bytes`, else the shards' sizes) is worth the start
    (`parallel.PARALLEL_BYTES`), as `parallel.scan_shards` decides."""
    items, parts = _read_all(shards, keys, lo, prefix, expected_bytes)
    return _merged(items, parts, world)


def row_columns(
    shards: Sequence[tuple[str | os.PathLike[str], int]],
    keys: Collection[str],
    lo: int | None,
    world: int,
    expected_bytes: int | None = None,
) -> tuple[RankTable | ColumnTable, dict[str, int]]:
    """`row_table`'s table, as a `scan.ColumnTable` (its reducers work on the arrays read,
    with no dict of every value to build) when each shard is a rank of its own whose rows
    make a block (`_block_columns`: what `et.log` of the same keys at each step writes);
    else that `RankTable`. Both give the same answers (`ColumnTable`)."""
    items, parts = _read_all(shards, keys, lo, None, expected_bytes)
    ranks = [r for _, r in items]
    if not all(p[5] for p in parts) or len(set(ranks)) != len(ranks):
        return _merged(items, parts, world)
    world = world if world <= _MAX_RANKS else 0
    blocks = [Block(rank, world, steps, 1.0, {key: vs for key, (_, vs) in by_key.items()})
              for rank, (_, _, _, steps, by_key, _) in zip(ranks, parts, strict=True) if steps]
    return ColumnTable(blocks), {}


def _read_all(
    shards: Sequence[tuple[str | os.PathLike[str], int]], keys: Collection[str],
    lo: int | None, prefix: str | None, expected_bytes: int | None,
) -> tuple[list[tuple[str, int]], list[_Part]]:
    from expr_tracker.stats import parallel

    items = [(os.fspath(p), r) for p, r in shards]
    read = partial(_read_shards, keys=tuple(keys), lo=lo, prefix=prefix)
    expected = expected_bytes if expected_bytes is not None else sum(map(_size, items))
    if len(items) > 1 and expected >= parallel.PARALLEL_BYTES:
        with paused_gc():
            return items, parallel.map_forked(read, items)
    return items, read(items)


def _merged(items: list[tuple[str, int]], parts: list[_Part], world: int) -> tuple[
        RankTable, dict[str, int]]:
    """The shards' parts as one `RankTable` (later shards win a rank's step)."""
    rows = _Rows()
    garbage: dict[str, int] = {}
    for (_, rank), (name, bad, skipped, steps, by_key, _) in zip(items, parts, strict=True):
        # in order: later shards win
        if bad:
            garbage[name] = bad
        rows.skipped += skipped
        if steps:
            rows.weights.setdefault(rank, {}).update(dict.fromkeys(steps, 1.0))
        for key, (ks, vs) in by_key.items():
            rows.put(key, rank, ks, vs)
    # (`collect` took the world size from the records: none, or one past the cap, is 0)
    world = world if rows.weights and world <= _MAX_RANKS else 0
    return RankTable(rows.cols, rows.weights, world, rows.skipped), garbage


def _size(item: tuple[str, int]) -> int:
    try:
        return os.path.getsize(item[0])
    except OSError:
        return 0
