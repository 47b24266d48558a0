"""The first pass of a parquet export through DuckDB (`duckcopy`): the run's columns as
`RunReader.columns()` gives them, and what DuckDB would read differently from `RunReader`.

Parquet export needs each column's type before the first row, decided over the whole run
(int64 only when every value is an integer, float64 for numbers with "NaN"/"Infinity"
strings, a mixed key as JSON text, strings never sniffed as dates). DuckDB's own
detection differs on each of these, so this pass stays in Python: `scan_part` finds the
same columns (a test compares them), a block of records at a time (a set of the value
types of each key over the block, in C, instead of a loop over every value), and notes
anything DuckDB would read differently (see `duckcopy`'s docstring), and a line that
may name a key twice (`Scan.keys_twice`). `duckcopy.scan` splits it over two processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from itertools import chain, repeat
from operator import is_not
from pathlib import Path
from typing import Any

from expr_tracker.store import records
from expr_tracker.store.reader import ShardReader
from expr_tracker.store.runread import RunShard, merge_kinds

BLOCK = 1024 * 1024
GROUP_RECORDS = 8192  # records checked and typed together (small shards, fewer passes)
MAX_OBJECT = 16 * 1024 * 1024  # the longest line DuckDB reads (maximum_object_size)
_INT_MAX = 2**63 - 1
_INT_MIN = -(2**63)
_NONE = type(None)
_DECODE = records.DECODE_NONFINITE
_KIND_OF = {int: "int", float: "float", bool: "bool", str: "str"}  # any other type: json

class Scan:
    """The first pass: `columns` as `RunReader.columns()` gives them, the rows it would
    give, why DuckDB cannot write any row exactly (`problem`, None when it can), and the
    shards whose rows it cannot (`python`: index -> why; the Python path writes those)."""

    def __init__(self) -> None:
        self.kinds: dict[str, str | None] = {}
        self.rows = 0
        self.garbage = 0
        self.problem: str | None = None
        self.python: dict[int, str] = {}
        self.columns: dict[str, str] = {}
        self.shard = -1  # the shard being read
        # a line may name a key twice: orjson keeps the last value, `json_transform` the
        # first, `read_json` refuses the line (then the Python path writes the run)
        self.keys_twice = False

    def flag(self, why: str) -> None:
        """Something in the current shard that DuckDB would read differently."""
        self.python.setdefault(self.shard, why)

    def flag_run(self, why: str) -> None:
        """Something that keeps DuckDB from writing any of the rows."""
        if self.problem is None:
            self.problem = why


def _values(recs: list[dict[str, Any]], key: str) -> list[Any]:
    """Each record's value of `key` (None when absent), looked up in C."""
    return list(map(dict.get, recs, repeat(key)))


def _types(recs: list[dict[str, Any]], key: str) -> set[type]:
    return set(map(type, map(dict.get, recs, repeat(key))))


def _int_range(values: list[Any], types: set[type] | None = None) -> tuple[int, int]:
    """(min, max) of the integers among `values` (all ints, or ints and None; `types`,
    when given, the set of their types: {int} needs no filtering)."""
    ints = values if types == {int} else list(filter(partial(is_not, None), values))
    return min(ints), max(ints)


def _keys(recs: list[dict[str, Any]]) -> list[str]:
    """Every key of `recs`, in the order of first appearance. The set of them is a pass
    in C; when it is the first record's keys (the usual case: a writer logs the same
    keys at every step), their order is that record's, with no pass in Python order."""
    if not recs:
        return []
    first = recs[0]
    if len(set().union(*recs)) == len(first):
        return list(first)
    return list(dict.fromkeys(chain.from_iterable(recs)))


def _block_records(path: Path, fh: Any, scan: Scan) -> Any:
    """The records of each block of complete lines of the shard at `path`, as
    `ShardReader.iter_all` reads and decodes them (its garbage counted in `scan`; a
    ShardReader only for a block read line by line)."""
    done = 0
    for _, data in records.complete_blocks(fh, BLOCK):
        done += len(data)
        if len(data) > MAX_OBJECT:
            scan.flag("a line longer than DuckDB reads")
        recs = records.loads_block(data)
        if recs is None:
            scan.flag("a line orjson does not read as one JSON object (torn, blank, foreign)")
            recs = []
            reader = ShardReader(path)
            for _, line in records.iter_lines(data):
                rec = reader._parse(line) if line.strip() else None
                if rec is not None:
                    recs.append(rec)
            scan.garbage += reader.garbage
        else:
            if not scan.keys_twice and _maybe_keys_twice(data, recs):
                scan.keys_twice = True
            if b'"NaN"' in data or b'Infinity"' in data:
                _decode(recs)
        yield recs
    if fh.tell() != done:
        scan.flag("an unterminated last line (a writer mid-append, or a torn tail)")


_SPACE_COLON = re.compile(rb'"[ \t\r]+:')


def _maybe_keys_twice(data: bytes, recs: list[dict[str, Any]]) -> bool:
    """Whether a line of `data` (parsed: `recs`) may name a key twice. Each key of an
    object is followed by a colon, so as many colons as keys (one count in C) means
    none is named twice. More colons: a text holding one, a nested object, or a key
    twice; then `":` is counted (a text holds it only after a backslash), as many as
    the keys unless a key is twice (or has space before its colon: then assumed so).
    0.05 s over 95 MiB; counting `":` and the space search alone cost 0.3 s."""
    keys = sum(map(len, recs))
    if data.count(b":") == keys:
        return False
    return data.count(b'":') != keys or _SPACE_COLON.search(data) is not None


def _kept(recs: list[dict[str, Any]], want: str | None, metrics: list[str] | None,
          flag: Callable[[str], Any]) -> list[dict[str, Any]]:
    """The records of `recs` that make rows (`RunReader._records_of`), calling `flag`
    for a reserved field that DuckDB would read differently."""
    kinds = _types(recs, "_kind")
    if kinds == {_NONE}:
        kept = recs if want is None else []
    else:
        if not kinds <= {_NONE, str}:
            flag("a _kind that is not text")
        kept = ([r for r in recs if r.get("_kind") is None] if want is None
                else [r for r in recs if r.get("_kind") == want])
    if not kept:
        return kept
    values = _values(kept, "_step")
    steps = set(map(type, values))
    if steps != {int}:
        if not steps <= {int, _NONE}:
            flag("a _step that is not an integer")
        kept = [r for r in kept if type(r.get("_step")) is int]
        if not kept:
            return kept
        values = _values(kept, "_step")
    lo, hi = _int_range(values, {int})
    if lo < _INT_MIN or hi > _INT_MAX:
        flag("a _step beyond int64")
    ints = ["_rank", "_world_size", "_local_rank"] if want is not None else ["_rank"]
    for key in ints:
        seen = _types(kept, key)
        if not seen <= {_NONE, int}:
            flag(f"a {key} that is not an integer")
        elif int in seen:
            lo, hi = _int_range(_values(kept, key))
            if lo < _INT_MIN or hi > _INT_MAX:
                flag(f"a {key} beyond int64")
    for key in ("_time", "_weight") if want is not None else ("_time",):
        if not _types(kept, key) <= {_NONE, int, float}:
            flag(f"a {key} that is not a number")
    if metrics is not None:
        kept = [r for r in kept if any(k in r for k in metrics)]
        if any(r.get(k, 0) is None for k in metrics for r in kept):
            flag("a --metric key present with null (DuckDB reads it as absent)")
    return kept


def _decode(recs: list[dict[str, Any]]) -> None:
    """`records.decode_nonfinite` of every record, a key at a time (only the keys with
    text values loop in Python)."""
    for key in _keys(recs):
        if key[:1] == "_":
            continue
        values = _values(recs, key)
        if str in set(map(type, values)):
            for rec, v in zip(recs, values):  # noqa: B905 (same length)
                if v.__class__ is str and v in _DECODE:
                    rec[key] = _DECODE[v]


def _merge_block(kept: list[dict[str, Any]], metrics: list[str] | None, scan: Scan) -> None:
    """Each key's kind over a block, merged into `scan.kinds` (first appearance first), as
    `value_kind` and `merge_kinds` give it value by value."""
    if metrics is None:
        keys = [k for k in _keys(kept) if k[:1] != "_"]
    else:
        keys = [k for k in metrics if k[:1] != "_" and any(k in r for r in kept)]
    kinds = scan.kinds
    for key in keys:
        values = _values(kept, key)
        seen = set(map(type, values))
        types = seen - {_NONE}
        kind: str | None = None
        for t in types:
            k = _KIND_OF.get(t, "json")
            if t is int:  # beyond int64, value_kind says float
                lo, hi = _int_range(values, seen) if types == {int} else (0, 0)
                if types == {int} and (lo < _INT_MIN or hi > _INT_MAX):
                    k = "float"
            kind = merge_kinds(kind, k)
        if key not in kinds:
            kinds[key] = kind
        elif kind is not None and kinds[key] != kind:
            kinds[key] = merge_kinds(kinds[key], kind)


def scan_part(shards: list[RunShard], offset: int, want: str | None,
               metrics: list[str] | None) -> Scan:
    """The first pass over `shards` (the run's from index `offset` on)."""
    out = Scan()
    group: list[tuple[int, list[dict[str, Any]]]] = []
    size = 0

    def flush() -> None:
        # the shards of a group are checked together; a flag is then found its shard
        flags: list[str] = []
        kept = _kept(list(chain.from_iterable(r for _, r in group)), want, metrics, flags.append)
        if flags:
            for i, recs in group:
                _kept(recs, want, metrics, partial(out.python.setdefault, i))
        out.rows += len(kept)
        _merge_block(kept, metrics, out)
        group.clear()

    for i, shard in enumerate(shards, offset):
        out.shard = i
        with open(shard.path, "rb") as fh:
            for recs in _block_records(shard.path, fh, out):
                group.append((i, recs))
                size += len(recs)
                if size >= GROUP_RECORDS:
                    flush()
                    size = 0
    if group:
        flush()
    return out


def merge_parts(a: Scan, b: Scan) -> Scan:
    """`a` then `b` as one pass over both would have found them."""
    for key, kind in b.kinds.items():
        if key not in a.kinds:
            a.kinds[key] = kind
        elif kind is not None and a.kinds[key] != kind:
            a.kinds[key] = merge_kinds(a.kinds[key], kind)
    a.rows += b.rows
    a.garbage += b.garbage
    a.keys_twice = a.keys_twice or b.keys_twice
    for i, why in b.python.items():
        a.python.setdefault(i, why)
    return a
