"""Fast reading of rank records as columns, for cross-rank summaries of big runs (DESIGN 10).

A typical shard holds the rank records of one rank (or, after an all-gather, of every rank),
each rank's steps increasing and every record carrying the same keys. Such a shard is read
as one `Block` per rank: the steps, the weights and one array of values per key, extracted
with C-level `map` calls, so no Python code runs per value. Big runs are parsed in several
processes, a share of the shards each (`parallel`).

Anything else is *irregular* (a repeated step, keys that come and go, a value that is
sometimes a number and sometimes not, a bad `_step` or `_rank`): `ShardScan.blocks` is then
None and the caller reads the records with `reduce.collect`, which handles every case.
`ColumnTable` answers the queries of `reduce.RankTable` that a summary needs, over blocks
with one block per rank; `rank_table` turns any blocks into a `RankTable`.
"""

from __future__ import annotations

import math
import os
from array import array
from bisect import bisect_left
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import compress, islice, repeat
from operator import eq, itemgetter, lt
from typing import Any, BinaryIO, cast

import orjson

from expr_tracker.gcpause import paused_gc
from expr_tracker.stats.ranktable import TableShape

# `reduce`'s bounds and mean, so that both readers agree to the last bit
from expr_tracker.stats.reduce import _MAX_INT, _MAX_RANKS, RankTable, Stats, _mean, reduce_values
from expr_tracker.store import records
from expr_tracker.store.safedir import open_read
from expr_tracker.store.window import Short, TailBytes, last_step, window_start

_CHUNK = 4 << 20  # bytes parsed at a time: bounds the parsed records held in memory
_RANK_MARK = b'"rank"'  # a rank record holds `"_kind": "rank"`; step rows mostly do not
_NUMBER = frozenset((float, int))
_NONFINITE = records.DECODE_NONFINITE
_get = dict.get


class _Absent:
    """The value `map(dict.get, ...)` gives for a key a record lacks (its type is checked)."""


_ABSENT = _Absent()


class _Irregular(Exception):
    """The shard needs the general reader."""


@dataclass(frozen=True)
class Block:
    """One rank's records of one shard: strictly increasing steps, the same keys at each."""

    rank: int
    world: int  # the largest `_world_size` of the records (0 if none)
    steps: array[int]
    weights: float | array[float]  # one weight for every step, or one per step
    columns: dict[str, array[float]]  # metric key -> value per step (non-finite kept)
    sample: bool = False  # the SDK's system-metrics samples (`records.is_sample`), not the user's


@dataclass(frozen=True)
class ShardScan:
    """What one shard holds: its blocks (None if irregular) and its unparseable lines."""

    path: str
    blocks: list[Block] | None
    garbage: int


def _clean_weight(w: Any) -> float:
    """`reduce.collect`'s rule: a missing, non-numeric, non-finite or negative weight is 1.0."""
    if w.__class__ is float and 0.0 <= w < math.inf:
        return float(w)
    ok = w.__class__ is not bool and isinstance(w, (int, float)) and 0 <= w < _MAX_INT
    return float(w) if ok else 1.0


def parse_rank_lines(body: bytes) -> tuple[list[dict[str, Any]], int]:
    """The rank records among the lines of `body` (each ending in a newline), and how many
    lines were garbage."""
    if _RANK_MARK in body:
        # Rank records here (alone, or between step rows): parse all lines as one JSON
        # array, in C. If every line is one object there is no garbage, and step rows
        # among them are dropped later by `_kind`; otherwise the careful path below counts
        # garbage as `expr summary` does.
        recs = records.loads_block(body)
        if recs is not None:
            return recs, 0
    else:
        # no rank record (step rows alone): no garbage either if every line is "{...}",
        # told by three counts in C (the careful path is a Python loop over the lines)
        n = body.count(b"\n")
        if body.count(b"}\n") == n and body.count(b"\n{") + body.startswith(b"{") == n:
            return [], 0
    lines = body.split(b"\n")
    lines.pop()
    return _parse_lines(lines)


def _parse_lines(lines: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    """Parse the lines holding `"rank"`; count the others that are not `{...}` and those that
    do not parse, as `expr summary` always has."""
    recs: list[dict[str, Any]] = []
    bad = 0
    loads = orjson.loads
    for line in lines:
        if _RANK_MARK not in line:
            stripped = line.strip()
            if stripped and not (stripped[:1] == b"{" and stripped[-1:] == b"}"):
                bad += 1
            continue
        try:
            # the full decoder where a non-finite value may hide ("NaN", "inf")
            rec = records.loads(line) if b"NaN" in line or b"nf" in line or b"nan" in line else loads(line)
        except ValueError:  # orjson.JSONDecodeError is a ValueError
            bad += 1
            continue
        if rec.__class__ is dict:
            recs.append(rec)
        else:
            bad += 1
    return recs, bad


class _Acc:
    """One rank's columns, grown chunk by chunk."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.world = 0
        self.steps: array[int] = array("q")
        self.weights: float | array[float] | None = None
        self.columns: dict[str, array[float]] = {}
        self.keys: tuple[str, ...] | None = None  # every key of the records, metric or not
        self.sample = False

    def add(self, recs: list[dict[str, Any]]) -> None:
        """Append the records of this rank (file order); _Irregular if they don't fit.

        The records are turned into columns in C: each record's values of the first
        record's keys (`itemgetter`; a missing key is a KeyError), then those rows
        transposed (`zip`)."""
        n = len(recs)
        keys = tuple(recs[0])
        if self.keys is None:
            self.keys = keys
            # samples (every record has the same keys: all samples or none)
            self.sample = "system/rss_mb" in keys if "_source" not in keys else True
        elif set(keys) != set(self.keys):
            raise _Irregular
        if n > 1 and set(map(len, recs)) != {len(keys)}:
            raise _Irregular
        try:
            # (a rank record holds `_kind`, `_step` and `_rank`: rows of 3 or more values)
            values = dict(zip(keys, zip(*map(itemgetter(*keys), recs), strict=True),
                              strict=True))
        except KeyError:
            raise _Irregular from None  # the same number of keys, but other keys
        steps = cast("tuple[int, ...]", values["_step"])
        if set(map(type, steps)) != {int}:
            raise _Irregular
        try:
            step_array = array("q", steps)
        except OverflowError:
            raise _Irregular from None
        if (self.steps and steps[0] <= self.steps[-1]) or not all(
            map(lt, steps, islice(steps, 1, None))
        ):
            raise _Irregular  # a repeated step: the later record wins, per key
        if "_source" in values and set(values["_source"]) != {records.SAMPLE_SOURCE}:
            raise _Irregular  # (`reduce.collect` tells each record apart)
        cols: dict[str, array[float]] = {}
        for key, col in values.items():
            if key[:1] == "_" and key not in ("_weight", "_world_size"):
                continue  # `_kind`, `_step`, `_rank` checked above and by the caller
            types = set(map(type, col))
            if key[:1] == "_":
                if key == "_weight":
                    self._add_weights(col, types)
                elif types == {int} and max(col) <= _MAX_RANKS:  # `_world_size`, as usual
                    self.world = max(self.world, max(col))
                else:
                    sizes = [w for w in col if w.__class__ is int and w <= _MAX_RANKS]
                    self.world = max([self.world, *sizes])
                continue
            if str in types:
                # non-finite values are written as "NaN", "Infinity", "-Infinity"
                col = tuple([_NONFINITE.get(x, x) if x.__class__ is str else x for x in col])
                types = set(map(type, col))
            if types <= _NUMBER:
                try:
                    cols[key] = array("d", col)
                except OverflowError:
                    raise _Irregular from None
            elif types & _NUMBER:
                raise _Irregular  # a number at some steps only
        if "_weight" not in keys:
            self._add_weights((1.0,) * n, {float})
        if self.steps and set(cols) != set(self.columns):
            raise _Irregular
        for key, col_values in cols.items():
            self.columns.setdefault(key, array("d")).extend(col_values)
        self.steps.extend(step_array)

    def _add_weights(self, col: Sequence[Any], types: set[type]) -> None:
        distinct = set(col) if types <= _NUMBER else None  # (a JSON list is not hashable)
        one = _clean_weight(col[0]) if distinct is not None and len(distinct) == 1 else None
        if self.weights is None and one is not None:
            self.weights = one
            return
        if isinstance(self.weights, float) and one == self.weights:
            return
        if self.weights is None:
            self.weights = array("d")
        elif isinstance(self.weights, float):
            self.weights = array("d", repeat(self.weights, len(self.steps)))
        self.weights.extend(map(_clean_weight, col))

    def block(self) -> Block:
        weights = 1.0 if self.weights is None else self.weights
        return Block(self.rank, self.world, self.steps, weights, self.columns, self.sample)


def _add_chunk(accs: dict[int, _Acc], recs: list[dict[str, Any]]) -> None:
    kinds = list(map(_get, recs, repeat("_kind")))
    if kinds.count("rank") != len(recs):
        recs = list(compress(recs, map(eq, kinds, repeat("rank"))))  # (in C)
    if not recs:
        return
    ranks = cast("list[int]", list(map(_get, recs, repeat("_rank"))))
    if set(map(type, ranks)) != {int} or min(ranks) < 0 or max(ranks) >= _MAX_RANKS:
        raise _Irregular  # `reduce.collect` skips (and counts) such records
    first = ranks[0]
    groups: dict[int, list[dict[str, Any]]] = {}
    if ranks.count(first) == len(ranks):
        groups[first] = recs
    else:
        for r, rec in zip(ranks, recs, strict=True):
            groups.setdefault(r, []).append(rec)
    for r, group in groups.items():
        acc = accs.get(r)
        if acc is None:
            acc = accs[r] = _Acc(r)
        acc.add(group)


def scan_shard(
    path: str | os.PathLike[str], lo: int | None = None, recent: int | None = None
) -> ShardScan:
    """Read one shard's rank records as blocks (an unterminated last line is ignored); with
    `lo`, only the shard's tail from about step `lo` on (see `window_start`); with
    `recent`, only its last `recent` steps."""
    with open_read(path) as fh:
        return _scan_open(fh, os.fspath(path), lo, recent)


def scan_tail(held: BinaryIO, fh: BinaryIO, name: str, recent: int) -> ShardScan:
    """`scan_shard(name, recent=recent)` of a shard open as `fh`, from `held`, the last
    bytes of it read already (`window.TailBytes`), where they reach back far enough (the
    same reads, from memory: the same answer)."""
    if isinstance(held, TailBytes):
        try:
            return _scan_open(held, name, None, recent)
        except Short:
            pass
    return _scan_open(fh, name, None, recent)


def _scan_open(fh: BinaryIO, name: str, lo: int | None, recent: int | None) -> ShardScan:
    accs: dict[int, _Acc] = {}
    garbage = 0
    regular = True
    if recent is not None and lo is None:
        top = last_step(fh)
        lo = None if top is None else top - recent + 1
    start = window_start(fh, lo) if lo is not None else 0
    for _, data in records.complete_blocks(fh, _CHUNK, start):
        recs, bad = parse_rank_lines(data)
        garbage += bad
        if regular:
            try:
                _add_chunk(accs, recs)
            except _Irregular:
                regular = False
                accs.clear()
    blocks = [acc.block() for acc in accs.values()] if regular else None
    return ShardScan(name, blocks, garbage)


def scan_all(paths: Sequence[str], lo: int | None = None,
              recent: int | None = None) -> list[ShardScan]:
    """`scan_shard` of each path, in order, in this process (no cyclic collections
    meanwhile: `gcpause`)."""
    with paused_gc():
        return [scan_shard(p, lo, recent) for p in paths]


# -- tables ------------------------------------------------------------------------------


def rank_table(blocks: Iterable[Block], keys: Collection[str] | None = None) -> RankTable:
    """A `RankTable` of blocks in file order (a later block wins a repeated rank, step and
    key), of every key or of `keys` only (steps, ranks and world size stay those of all)."""
    blocks = list(blocks)
    cols: dict[str, dict[int, dict[int, float]]] = {}
    weights: dict[int, dict[int, float]] = {}
    world = 0
    sampled: set[tuple[int, int]] = set()
    for b in blocks:
        world = max(world, b.world)
        mine = weights.setdefault(b.rank, {})
        if b.sample:  # a sample never replaces the weight of the user's record
            new = [s for s in b.steps if s not in mine]
            mine.update(dict.fromkeys(new, 1.0))
            sampled.update((b.rank, s) for s in new)
        else:
            w = [b.weights] * len(b.steps) if isinstance(b.weights, float) else b.weights
            mine.update(zip(b.steps, w, strict=True))
            sampled.difference_update((b.rank, s) for s in b.steps)
        for key, values in b.columns.items():
            if keys is None or key in keys:
                by_rank = cols.setdefault(key, {})
                by_rank.setdefault(b.rank, {}).update(zip(b.steps, values, strict=True))
    return RankTable(cols, weights, world, sample_keys=sample_keys(blocks), sampled=sampled)


def sample_keys(blocks: Iterable[Block]) -> frozenset[str]:
    """The keys that only blocks of samples carry (`RankTable.sample_keys`)."""
    sampled: set[str] = set()
    users: set[str] = set()
    for b in blocks:
        (sampled if b.sample else users).update(b.columns)
    return frozenset(sampled - users)


def _step_union(blocks: Sequence[Block]) -> list[int]:
    """The sorted steps of any of `blocks`. Most ranks' blocks hold the same steps (a
    rank that crashed, or joined late, makes them differ): each distinct array once,
    not a set of 16,384 arrays' steps."""
    distinct = {b.steps.tobytes(): b.steps for b in blocks}
    return sorted(set().union(*distinct.values()))


class ColumnTable(TableShape):
    """Blocks with one block per rank, with the summary queries of `reduce.RankTable`.

    Results equal those of `reduce` over a `RankTable` of the same records.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        """Raises ValueError if two blocks have the same rank (use `rank_table` then)."""
        self._blocks = sorted(blocks, key=lambda b: b.rank)
        ranks = [b.rank for b in self._blocks]
        if len(set(ranks)) != len(ranks):
            raise ValueError("several blocks of one rank")
        first = self._blocks[0].steps if self._blocks else array("q")
        self._one_steps = all(b.steps == first for b in self._blocks)
        if self._one_steps:
            self._steps = list(first)  # every rank at every step: the usual case
        else:
            self._steps = _step_union(self._blocks)
        self._keys = sorted(set().union(*(b.columns for b in self._blocks)))
        self._world = max([b.world for b in self._blocks] + [r + 1 for r in ranks] + [0])
        distinct: set[float] = set()
        for b in self._blocks:
            distinct.update([b.weights] if isinstance(b.weights, float) else b.weights)
            if len(distinct) > 1:
                break
        # one weight on every record, as `RankTable` finds it: the statistics then ignore weights
        self._wconst = next(iter(distinct)) if len(distinct) == 1 else None
        self._sample_keys = sample_keys(self._blocks)
        self._last_window: tuple[Any, Any] = (None, None)
        self._last_at: tuple[Any, list[tuple[Block, int]]] = (None, [])
        self._last_values: tuple[Any, dict[int, float]] = (None, {})

    def key_steps(self, key: str) -> list[int]:
        """Sorted steps at which some rank reported `key`."""
        if self._one_steps and any(key in b.columns for b in self._blocks):
            return list(self._steps)  # (every block has the same steps: no set of them all)
        return _step_union([b for b in self._blocks if key in b.columns])

    def last_step(self, key: str) -> int | None:
        """The last step at which some rank reported `key`."""
        return max((b.steps[-1] for b in self._blocks if key in b.columns and b.steps), default=None)

    def _at(self, step: int) -> list[tuple[Block, int]]:
        # a summary asks for the stats and then the values of each key at one step
        if self._last_at[0] == step:
            return self._last_at[1]
        out = []
        for b in self._blocks:
            i = bisect_left(b.steps, step)
            if i < len(b.steps) and b.steps[i] == step:
                out.append((b, i))
        self._last_at = (step, out)
        return out

    def values(self, key: str, step: int) -> dict[int, float]:
        """rank -> value of `key` at `step`, by rank (non-finite values included)."""
        if self._last_values[0] == (key, step):
            return dict(self._last_values[1])  # (what `reduce_step` just gathered)
        return {b.rank: b.columns[key][i] for b, i in self._at(step) if key in b.columns}

    def reduce_step(self, key: str, step: int) -> Stats:
        """`reduce.reduce_step`: stats of `key` across ranks at one step."""
        at = [(b, i) for b, i in self._at(step) if key in b.columns]
        values = {b.rank: b.columns[key][i] for b, i in at}
        self._last_values = ((key, step), values)  # a summary asks for the values next
        if self._wconst is not None:
            weights: dict[int, float] = dict.fromkeys(values, self._wconst)
        else:
            weights = {b.rank: b.weights if isinstance(b.weights, float) else b.weights[i]
                       for b, i in at}
        return reduce_values(values, self._world, weights)

    @property
    def blocks(self) -> list[Block]:
        """The blocks, by rank."""
        return self._blocks

    def reduce_steps(self, key: str, steps: Sequence[int]) -> list[Stats]:
        """`reduce_step` of `key` at each of `steps` (a chart's recent steps), the same
        stats, gathered in C where blocks share their steps (`stats.columns`)."""
        from expr_tracker.stats.columns import reduce_steps

        return reduce_steps(self, key, steps)

    def heatmap(self, key: str, n_buckets: int, steps: Sequence[int] | None = None) -> tuple[
            list[tuple[int, int]], dict[int, list[float | None]]]:
        """`reduce.heatmap` of `rank_table([key])`, the same cells, without building that
        table (`stats.columns`)."""
        from expr_tracker.stats.columns import heatmap

        return heatmap(self, key, n_buckets, steps)

    def _window(
        self, key: str, lo: int, hi: int
    ) -> tuple[dict[int, float], dict[int, float], list[int], int, list[int]]:
        """Per rank the mean of its finite values and of their weights; who reported; bad."""
        # a summary asks for the stats and then the means of each key: sum once
        if self._last_window[0] == (key, lo, hi):
            return self._last_window[1]
        parts = self._window_parts(key, lo, hi)
        self._last_window = ((key, lo, hi), parts)
        return parts

    def _window_parts(
        self, key: str, lo: int, hi: int
    ) -> tuple[dict[int, float], dict[int, float], list[int], int, list[int]]:
        means: dict[int, float] = {}
        wmeans: dict[int, float] = {}
        seen: list[int] = []
        bad: list[int] = []
        nonfinite = 0
        wconst = self._wconst
        for b in self._blocks:
            values = b.columns.get(key)
            if values is None:
                continue
            i = bisect_left(b.steps, lo)
            j = bisect_left(b.steps, hi)
            if j <= i:
                continue
            seen.append(b.rank)
            seg = values[i:j]
            wseg: Sequence[float] | None = None
            if wconst is None:
                w = b.weights
                wseg = [w] * (j - i) if isinstance(w, float) else w[i:j]
            try:
                total = math.fsum(seg)
            except (OverflowError, ValueError):
                total = math.nan
            if total - total == 0.0:
                means[b.rank] = total / len(seg)
            else:
                keep = [k for k, x in enumerate(seg) if math.isfinite(x)]
                if len(keep) < len(seg):
                    nonfinite += len(seg) - len(keep)
                    bad.append(b.rank)
                if not keep:
                    continue
                means[b.rank] = _mean([seg[k] for k in keep])
                if wseg is not None:
                    wseg = [wseg[k] for k in keep]
            # the mean weight of the steps whose value counted, as `reduce.reduce_window`
            if wseg is not None:
                wmeans[b.rank] = math.fsum(wseg) / len(wseg)
            elif wconst is not None:
                wmeans[b.rank] = wconst
        return means, wmeans, seen, nonfinite, bad

    def window_means(self, key: str, lo: int, hi: int) -> dict[int, float]:
        """rank -> mean of its finite values of `key` over steps lo <= s < hi."""
        return dict(self._window(key, lo, hi)[0])

    def reduce_window(self, key: str, lo: int, hi: int) -> Stats:
        """`reduce.reduce_window`: stats of each rank's mean of `key` over lo <= s < hi."""
        means, wmeans, seen, nonfinite, bad = self._window(key, lo, hi)
        stats = reduce_values(means, self._world, wmeans)
        present = set(seen)
        missing = [r for r in range(self._world) if r not in present]
        return replace(stats, missing=missing, nonfinite=nonfinite, nonfinite_ranks=bad)

    def window_values(self, key: str, lo: int, hi: int) -> dict[int, Sequence[float]]:
        """`reduce.window_values`: rank -> its values of `key` over lo <= s < hi (non-finite
        ones too: `stats.variability` drops them), slices of the columns, not copies per value."""
        out: dict[int, Sequence[float]] = {}
        for b in self._blocks:
            values = b.columns.get(key)
            if values is None:
                continue
            i, j = bisect_left(b.steps, lo), bisect_left(b.steps, hi)
            if j > i:
                out[b.rank] = values[i:j]
        return out

    def rank_table(self, keys: Collection[str]) -> RankTable:
        """The `RankTable` of `keys` (for `reduce.heatmap`)."""
        return rank_table(self._blocks, keys)

    def coverage(self, steps: Iterable[int]) -> list[tuple[int, int, int, list[int]]]:
        """`reduce.coverage`: per step (step, ranks reported, world size, missing ranks)."""
        wanted = sorted(set(steps))
        order = list(steps)
        if not wanted:
            return []
        lo, hi = wanted[0], wanted[-1]
        want = set(wanted)
        # per rank, not per step: a rank with every wanted step (the usual case) costs two
        # bisects; only the others are looked at step by step
        missing: dict[int, list[int]] = {s: [] for s in wanted}
        seen = set()
        for b in self._blocks:
            seen.add(b.rank)
            if b.sample:  # a rank with samples alone reported no step (DESIGN 19)
                for s in want:
                    missing[s].append(b.rank)
                continue
            i = bisect_left(b.steps, lo)
            j = bisect_left(b.steps, hi + 1)
            have = b.steps[i:j]
            if len(have) == len(wanted) and (len(wanted) == hi - lo + 1 or set(have) == want):
                continue
            for s in want.difference(have):
                missing[s].append(b.rank)
        absent = [r for r in range(self._world) if r not in seen]
        out = []
        for s in order:
            gone = sorted(missing[s] + absent) if absent else sorted(missing[s])
            out.append((s, self._world - len(gone), self._world, gone))
        return out
