"""Rank records grouped by rank, key and step: `RankTable` and `collect` (DESIGN 10). No I/O.

`collect` groups rank records (any shard, file order) by `_rank` into a `RankTable` holding per
key and rank one dict step -> value: file order fills that fastest, and nothing is created per
record. Queries (the reducers in `reduce`) read per-key lists aligned with the sorted steps,
built on first use.

A `_weight` that is missing, not a number, non-finite or negative counts as 1.0. A rank record
without an integer `_step`, or with `_rank` outside [0, 1048576), is skipped and counted.

The weight of a key at a step is the weight of the record that carried it (DESIGN 19): a
system-metrics sample (`records.is_sample`) at a step where the user logged a weighted record
does not replace that record's weight, and the keys only samples carry (`sample_keys`) are
weighted as the samples are, 1.0. Two records of one rank and step with different weights
(`log_rank_metrics({"loss": l}, step, weight=tokens)` then `({"grad_norm": g}, step)`) keep
each key's own: the step's weight is the last record's, and the keys of the earlier ones
keep theirs in `key_weights`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Iterable, Mapping
from typing import Any, cast

from expr_tracker.store.records import DECODE_NONFINITE, is_sample

_NAN = math.nan
_INF = math.inf
_NONFINITE: dict[Any, float] = dict(DECODE_NONFINITE)
_MAX_INT = 1 << 63
# a corrupt _rank or _world_size must not make every reducer list a billion missing ranks:
# the writers' sanity cap (records.MAX_WORLD, 1,048,576; DESIGN 14)
_MAX_RANKS = 1 << 20


class TableShape:
    """World size, steps and keys: what every table of rank records answers alike."""

    _world: int
    _steps: list[int]
    _keys: list[str]
    _sample_keys: frozenset[str] = frozenset()

    @property
    def sample_keys(self) -> frozenset[str]:
        """Keys carried only by the SDK's system-metrics samples (DESIGN 19), whatever their
        names: a user's own `system/step_time` is not one."""
        return self._sample_keys

    @property
    def world_size(self) -> int:
        """The largest `_world_size` seen, at least the largest rank + 1."""
        return self._world

    @property
    def steps(self) -> list[int]:
        """Sorted steps that have any rank record."""
        return list(self._steps)

    @property
    def keys(self) -> list[str]:
        """Sorted metric keys."""
        return list(self._keys)


class RankTable(TableShape):
    """Rank records grouped by key, rank and step; the latest record wins."""

    def __init__(
        self,
        cols: dict[str, dict[int, dict[int, float]]] | None = None,
        weights: dict[int, dict[int, float]] | None = None,
        world_size: int = 0,
        skipped: int = 0,
        sample_keys: frozenset[str] = frozenset(),
        key_weights: dict[str, dict[int, dict[int, float]]] | None = None,
        sampled: set[tuple[int, int]] | None = None,
    ) -> None:
        """Build from key -> rank -> step -> value and rank -> step -> weight (see `collect`),
        the keys only samples carry (weighted 1.0), and key -> rank -> step -> weight where
        a key's record had another weight than the step's last record."""
        self._cols = cols if cols is not None else {}
        self._sample_keys = sample_keys
        self._wrank = weights if weights is not None else {}
        self._kw = key_weights or {}
        # (rank, step) of which the table holds samples alone: not a step the rank reported
        self._sampled = sampled or set()
        self._steps: list[int] = sorted(set().union(*self._wrank.values()))
        self._index = {s: i for i, s in enumerate(self._steps)}
        self._keys = sorted(self._cols)
        self._world = max(world_size, max(self._wrank, default=-1) + 1)
        present = [w.values() for w in self._wrank.values() if w]
        lo = min(map(min, present), default=1.0)
        hi = max(map(max, present), default=1.0)
        # one weight on every record (the common case) spares all per-rank weighting work
        self._wconst: float | None = lo if lo == hi and not self._kw else None
        self._columns: dict[str, _Column] = {}
        self._wlists: dict[int, list[float | None]] = {}
        self.skipped = skipped  # rank records without an integer _step or a sane _rank

    def values(self, key: str, step: int) -> dict[int, float]:
        """rank -> value of `key` at `step`, by rank (non-finite values included)."""
        by_rank = self._cols.get(key, {})
        return {r: by_rank[r][step] for r in sorted(by_rank) if step in by_rank[r]}

    def weights(self, step: int) -> dict[int, float]:
        """rank -> weight of every rank with a record at `step`, by rank."""
        wr = self._wrank
        return {r: wr[r][step] for r in sorted(wr) if step in wr[r]}

    def ranks_at(self, step: int) -> set[int]:
        """Ranks with a record of their own (not a system sample alone) at `step`."""
        got = {r for r, w in self._wrank.items() if step in w}
        return {r for r in got if (r, step) not in self._sampled} if self._sampled else got

    def key_steps(self, key: str) -> list[int]:
        """Sorted steps at which some rank reported `key`."""
        return sorted(set().union(*self._cols.get(key, {}).values()))

    def __len__(self) -> int:
        return sum(map(len, self._wrank.values()))

    def _column(self, key: str) -> _Column:
        col = self._columns.get(key)
        if col is None:
            col = self._columns[key] = _Column(self, key)
        return col

    def key_wconst(self, key: str) -> float | None:
        """The one weight of every value of `key`, if there is one (else per rank and step)."""
        return 1.0 if key in self._sample_keys else self._wconst

    def _wlist(self, rank: int, key: str | None = None) -> list[float | None]:
        """The weights of `rank` at the table's steps (of `key`'s records, if given)."""
        wl = self._wlists.get(rank)
        if wl is None:
            wl = self._wlists[rank] = list(map(self._wrank[rank].get, self._steps))
        own = self._kw.get(key, {}).get(rank) if key is not None and self._kw else None
        if own:
            wl = wl[:]
            for step, w in own.items():
                wl[self._index[step]] = w
        return wl


class _Column:
    """One key's values per rank aligned with the table's sorted steps (None: no value)."""

    __slots__ = ("full", "gaps", "key", "lists", "missing", "ranks", "rows", "wrows")

    def __init__(self, table: RankTable, key: str) -> None:
        self.key = key
        steps = table._steps
        by_rank = table._cols.get(key, {})
        self.ranks = sorted(by_rank)
        self.lists = [list(map(by_rank[r].get, steps)) for r in self.ranks]
        self.full = [len(by_rank[r]) == len(steps) for r in self.ranks]
        self.missing = _missing(set(self.ranks), table._world)
        # Step-major raw doubles: one step's values then sit together in memory instead of in
        # records parsed far apart, which was most of reduce_step's time. Steps where one of
        # the key's ranks has no value (`gaps`) are read from the lists instead.
        self.gaps: set[int] = set()
        for values, full in zip(self.lists, self.full, strict=True):
            if not full:
                self.gaps.update(i for i, x in enumerate(values) if x is None)
        self.rows = _step_major(self.lists, self.full)
        self.wrows: array[float] | None = None

    def weight_rows(self, table: RankTable) -> array[float]:
        """Step-major weights of the key's ranks, like `rows`."""
        if self.wrows is None:
            self.wrows = _step_major([table._wlist(r, self.key) for r in self.ranks], self.full)
        return self.wrows


def _step_major(lists: list[list[float | None]], full: list[bool]) -> array[float]:
    """Interleave per-rank lists into one array of rows (None becomes NaN)."""
    width = len(lists)
    out = array("d", bytes(8 * width * (len(lists[0]) if lists else 0)))
    # strided slice stores run in C and create no per-step objects (the garbage collector
    # would otherwise walk the caller's records again and again)
    for k, (values, dense) in enumerate(zip(lists, full, strict=True)):
        if dense:
            out[k::width] = array("d", cast("list[float]", values))
        else:
            out[k::width] = array("d", [_NAN if x is None else x for x in values])
    return out


def collect(records: Iterable[Mapping[str, Any]]) -> RankTable:
    """Group rank records by `_rank` (never by file), key and step; later records win."""
    by_rank: dict[int, dict[str, dict[int, float]]] = {}
    weights: dict[int, dict[int, float]] = {}
    world = 0
    skipped = 0
    last = -1
    cols: dict[str, dict[int, float]] = {}
    wr: dict[int, float] = {}
    samples: dict[int, dict[str, dict[int, float]]] = {}  # the samples' values, apart
    sampled: set[tuple[int, int]] = set()  # (rank, step) whose weight a sample set
    key_weights: dict[str, dict[int, dict[int, float]]] = {}
    float_ = float
    int_ = int
    # The hot loop: files hold runs of one rank, so the rank's dicts stay at hand and each
    # metric value costs one dict lookup and one store.
    for rec in records:
        if rec.get("_kind") != "rank":
            continue
        step = rec.get("_step")
        rank = rec.get("_rank")
        if step.__class__ is not int_ or rank.__class__ is not int_ or not 0 <= rank < _MAX_RANKS:
            skipped += 1
            continue
        ws = rec.get("_world_size")
        if ws.__class__ is int_ and world < ws <= _MAX_RANKS:
            world = ws
        if rank != last:
            last = rank
            if rank in by_rank:
                cols = by_rank[rank]
                wr = weights[rank]
            else:
                cols = by_rank[rank] = {}
                wr = weights[rank] = {}
        # (two lookups for the usual record: `_source` absent, no `system/rss_mb`)
        if ("_source" in rec or "system/rss_mb" in rec) and is_sample(rec):
            if step not in wr:
                wr[step] = 1.0  # a sample never replaces the weight of the user's record
                sampled.add((rank, step))
            _put(samples.setdefault(rank, {}), rec, step)
            continue
        w = rec.get("_weight", 1.0)
        if w.__class__ is not float_ or not 0.0 <= w < _INF:
            ok = w.__class__ is not bool and isinstance(w, (int_, float_)) and 0 <= w < _MAX_INT
            w = float_(w) if ok else 1.0
        if step in wr:
            if sampled and (rank, step) in sampled:
                sampled.discard((rank, step))
            elif wr[step] != w or key_weights:
                _keep_weights(key_weights, cols, rank, step, wr[step], rec, w)
        wr[step] = w
        for key, value in rec.items():
            if key[0] == "_":
                continue
            if value.__class__ is not float_:  # (floats, the usual value, inline)
                value = _number(value)
                if value is None:
                    continue
            col = cols.get(key)
            if col is None:
                cols[key] = {step: value}
            else:
                col[step] = value
    sample_keys = _merge_samples(by_rank, samples)
    by_key: dict[str, dict[int, dict[int, float]]] = {}
    for rank, per_key in by_rank.items():
        for key, col in per_key.items():
            by_key.setdefault(key, {})[rank] = col
    return RankTable(by_key, weights, world, skipped, sample_keys, key_weights, sampled)


def _keep_weights(key_weights: dict[str, dict[int, dict[int, float]]],
                  cols: dict[str, dict[int, float]], rank: int, step: int, before: float,
                  rec: Mapping[str, Any], weight: float) -> None:
    """A record of `rank` at `step` with `weight`, after records of the step weighing
    `before`: if the two differ, the keys they carried keep `before` (unless one of their
    own already); the keys of `rec` take the step's weight, `weight`. Rare: not on the hot
    path."""
    if weight != before:
        for key, col in cols.items():
            if step in col and key not in rec:
                key_weights.setdefault(key, {}).setdefault(rank, {}).setdefault(step, before)
    for key in rec:
        own = key_weights.get(key, {}).get(rank)
        if own:
            own.pop(step, None)


def _put(cols: dict[str, dict[int, float]], rec: Mapping[str, Any], step: int) -> None:
    """Store the numeric metric values of `rec` at `step` (later records win)."""
    for key, value in rec.items():
        if key[0] == "_":
            continue
        value = _number(value)
        if value is not None:
            cols.setdefault(key, {})[step] = value


def _number(value: Any) -> float | None:
    """A metric value as a float: ints and floats, and the non-finite values as written
    ("NaN", "Infinity": the columnar parse hands records over undecoded); None for text,
    bools and the rest, which the reducers leave out."""
    if value.__class__ is float:
        return value
    if value.__class__ is bool or not isinstance(value, (int, float)):
        return _NONFINITE.get(value) if value.__class__ is str else None
    return float(value)


def _merge_samples(
    by_rank: dict[int, dict[str, dict[int, float]]],
    samples: dict[int, dict[str, dict[int, float]]],
) -> frozenset[str]:
    """Put the samples' values beside the user's; the keys only samples carried. A key the
    user logged too is the user's (their value wins at a step both wrote)."""
    users = set().union(*by_rank.values()) if samples else set()
    only: set[str] = set()
    for rank, per_key in samples.items():
        mine = by_rank.setdefault(rank, {})
        for key, col in per_key.items():
            if key in users:
                col.update(mine.get(key, {}))
            else:
                only.add(key)
            mine[key] = col
    return frozenset(only)


_FULL: dict[int, frozenset[int]] = {}


def _missing(present: Collection[int], world: int) -> list[int]:
    """Sorted ranks in range(world) not in `present` (a set or dict keys)."""
    full = _FULL.get(world)
    if full is None:
        full = frozenset(range(world))
        if world <= 4096:
            _FULL[world] = full
    if present == full:
        return []
    return [r for r in range(world) if r not in present]
