"""The team store's value rows, as TabSeparated lines built a column at a time (DESIGN 16).

One row per value of a record: `metrics` for step rows, `rank_metrics` for
`log_rank_metrics` records. This is the hot loop of exprd's forwarding (every value of
every event), so the usual batch (runs of records with the same keys, numbers as values)
is encoded without Python work per value: for each run of records with one key tuple the
columns are taken with `itemgetter`, their types checked with one `set(map(type, ...))`,
numbers checked finite by one `orjson.dumps` of the whole column and written with 17
significant digits by `map` (`float_text`, value for value), and the lines put together
with `map`. Anything else (text,
booleans, non-finite values, an odd `_step` or `_rank`) takes `_slow`, record by record,
which is the definition: both give the same bytes (tests/test_chrows.py).

TabSeparated rather than JSONEachRow: the server parses it for less (measured, 2 cores:
0.8-1.0 s against 1.2-1.5 s per 480,000 rows) and the lines are a third the size. Floats
go as the same text either way (ClickHouse reads both with one parser); strings are
escaped the TSV way (backslash, tab, newline, carriage return, NUL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, groupby, repeat
from operator import itemgetter
from typing import Any

import orjson

# the column order of the lines (the INSERT names the columns: the table's own order is
# not assumed); the shared columns first, then per value key, value, text
METRICS_COLUMNS = "project, name, stream, rank, step, time, event_id, key, value, text"
RANK_COLUMNS = ("project, name, stream, rank, step, time, event_id, world_size, local_rank, "
                "weight, key, value, text")

_KIND, _STEP, _TIME, _ID, _RANK = (itemgetter(k) for k in ("_kind", "_step", "_time", "_id",
                                                           "_rank"))
_WORLD, _LOCAL, _WEIGHT = itemgetter("_world_size"), itemgetter("_local_rank"), itemgetter("_weight")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_NUMBERS = frozenset((int, float))
_SPECIAL = (b"\\", b"\t", b"\n", b"\r", b"\0")


def escape(text: str) -> bytes:
    """`text` as a TabSeparated field (UTF-8; raises UnicodeEncodeError on a lone surrogate,
    which orjson never parses)."""
    data = text.encode()
    if any(c in data for c in _SPECIAL):
        data = (data.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n")
                .replace(b"\r", b"\\r").replace(b"\0", b"\\0"))
    return data


# 17 significant digits: the shortest text of a double (orjson's, repr's) is read back one
# unit in the last place off by ClickHouse's own parser (18.x: 1.501117743431572 ->
# 1.5011177434315721, 136 of 10,000 normal values); with 17 digits it reads every one exactly
_F17 = b"%.17g".__mod__


def float_text(value: float) -> bytes:
    """A float as the server reads it back exactly (non-finite: `nan`, `inf`, `-inf`)."""
    if value - value == 0.0:
        return _F17(value)
    return b"nan" if value != value else b"inf" if value > 0 else b"-inf"


def value_text(value: Any) -> tuple[bytes, bytes] | None:
    """(value column, text column) of one record value as TSV fields, or None to skip it.

    Numbers go to `value` (ints as floats, non-finite ones as `nan`/`inf`/`-inf`); booleans
    to `value` as 1/0 with "true"/"false" in `text`; strings to `text` with `value` nan.
    """
    cls = value.__class__
    if cls is float:
        return float_text(value), b""
    if cls is int:
        return float_text(float(value)), b""
    if cls is bool:
        return (b"1.0", b"true") if value else (b"0.0", b"false")
    if cls is str:
        return b"nan", escape(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float_text(float(value)), b""
    return None


class Encoder:
    """The rows of one run's records: `project`, `name`, `stream` fixed, the run's own rank
    and world size for records that do not carry theirs."""

    def __init__(self, project: str, name: str, stream: str, rank: int, world_size: int) -> None:
        self.head = b"%b\t%b\t%b\t" % (escape(project), escape(name), escape(stream))
        self.rank, self.world_size = rank, world_size
        self._keys: dict[str, bytes] = {}  # key -> its escaped field and a tab

    def rows(self, events: Sequence[Mapping[str, Any]]) -> tuple[list[bytes], list[bytes], float]:
        """(metrics rows, rank_metrics rows, the latest `_time` seen or 0.0): the rows as
        pieces of a body, each piece whole lines, each line ending in a newline (the body is
        their join). Events of another `_kind` (alerts) are skipped."""
        metrics: list[bytes] = []
        ranks: list[bytes] = []
        latest = 0.0
        shapes = list(map(tuple, events))
        if shapes and shapes.count(shapes[0]) == len(shapes):  # the usual batch: one shape
            runs: Any = [(shapes[0], events)]
        else:
            runs = ((shape, map(_SECOND, group))
                    for shape, group in groupby(zip(shapes, events, strict=True), _FIRST))
        for shape, group in runs:
            evs = list(group)
            got = self._run(shape, evs, metrics, ranks)
            if got is None:
                got = self._slow(evs, metrics, ranks)
            latest = max(latest, got)
        return metrics, ranks, latest

    def _key(self, key: str) -> bytes:
        field = self._keys.get(key)
        if field is None:
            if len(self._keys) > 10_000:
                self._keys.clear()  # a run that makes up keys: bounded
            field = self._keys[key] = escape(key) + b"\t"
        return field

    def _run(self, shape: tuple[str, ...], evs: list[Any], metrics: list[bytes],
             ranks: list[bytes]) -> float | None:
        """Encode records that share the key tuple `shape` a column at a time; None (nothing
        written) unless every shared column is of the usual kind."""
        if "_kind" in shape:
            if set(map(_KIND, evs)) != {"rank"}:
                return None
            out = ranks
        else:
            out = metrics
        if "_step" not in shape or "_time" not in shape or "_id" not in shape:
            return None
        steps, times, ids = list(map(_STEP, evs)), list(map(_TIME, evs)), list(map(_ID, evs))
        if (set(map(type, steps)) != {int} or not set(map(type, times)) <= _NUMBERS
                or set(map(type, ids)) != {str}):
            return None
        latest = max(times)
        time_floats = list(map(float, times))
        if b"n" in orjson.dumps(time_floats):  # null: a non-finite time
            return None
        if "_rank" in shape:
            rank_col = list(map(_RANK, evs))
            if set(map(type, rank_col)) != {int} or min(rank_col) < 0:
                return None
        else:
            rank_col = [self.rank] * len(evs)
        eid_text = "\t".join(ids)
        if eid_text.count("\t") != len(ids) - 1 or any(c in eid_text for c in "\\\n\r\0"):
            return None
        columns = [rank_col, steps, list(map(_F17, time_floats)), eid_text.encode().split(b"\t")]
        fmt = self.head + b"%d\t%d\t%b\t%b\t"
        if out is ranks:
            extra = self._rank_columns(shape, evs)
            if extra is None:
                return None
            columns += extra
            fmt += b"%d\t%b\t%b\t"
        heads = list(map(fmt.__mod__, zip(*columns, strict=True)))
        for key in shape:
            if key[:1] == "_":
                continue
            col = list(map(itemgetter(key), evs))
            field = self._key(key)
            kinds = set(map(type, col))
            if kinds <= _NUMBERS:
                floats = col if kinds == {float} else list(map(float, col))
                if b"n" not in orjson.dumps(floats):  # no null: every value finite
                    values = list(map(_F17, floats))
                    # the column's lines as one piece: head, key, value, tab and newline
                    out.append(b"".join(chain.from_iterable(zip(
                        heads, repeat(field), values, repeat(b"\t\n"), strict=False))))
                    continue
            for head, value in zip(heads, col, strict=True):
                got = value_text(value)
                if got is not None:
                    out.append(b"%b%b%b\t%b\n" % (head, field, *got))
        return float(latest)

    def _rank_columns(self, shape: tuple[str, ...], evs: list[Any]) -> list[Any] | None:
        """world_size, local_rank, weight columns of rank records, or None if unusual."""
        n = len(evs)
        world = list(map(_WORLD, evs)) if "_world_size" in shape else [self.world_size] * n
        if set(map(type, world)) != {int}:
            return None
        if "_local_rank" in shape:
            local = list(map(_LOCAL, evs))
            kinds = set(map(type, local))
            if not kinds <= {int, type(None)}:  # not bool: the record-by-record path decides
                return None
            local = [b"\\N" if v is None else b"%d" % v for v in local] if type(None) in kinds \
                else list(map(b"%d".__mod__, local))
        else:
            local = [b"\\N"] * n
        if "_weight" in shape:
            weights = list(map(_WEIGHT, evs))
            if not set(map(type, weights)) <= _NUMBERS:
                return None
            wfloats = list(map(float, weights))
            if b"n" in orjson.dumps(wfloats):
                return None
            weight = list(map(_F17, wfloats))
        else:
            weight = [b"1.0"] * n
        return [world, local, weight]

    def _slow(self, evs: list[Any], metrics: list[bytes], ranks: list[bytes]) -> float:
        """Record by record: the definition `_run` agrees with."""
        latest = 0.0
        for ev in evs:
            kind = ev.get("_kind")
            if kind is not None and kind != "rank":
                continue
            when = ev.get("_time")
            when = float(when) if isinstance(when, (int, float)) else 0.0
            if when > latest:
                latest = when
            step, rank, eid = ev.get("_step"), ev.get("_rank"), ev.get("_id")
            head = b"%b%d\t%d\t%b\t%b\t" % (
                self.head, rank if type(rank) is int and rank >= 0 else self.rank,
                step if type(step) is int else 0, float_text(when),
                escape(eid) if eid.__class__ is str else b"")
            out = metrics
            if kind == "rank":
                out = ranks
                world, local, weight = ev.get("_world_size"), ev.get("_local_rank"), ev.get("_weight")
                weight = float(weight) if isinstance(weight, (int, float)) else 1.0
                head += b"%d\t%b\t%b\t" % (
                    world if type(world) is int else self.world_size,
                    b"%d" % local if type(local) is int else b"\\N",
                    float_text(weight))
            for key, raw in ev.items():
                if key[:1] == "_":
                    continue
                got = value_text(raw)
                if got is not None:
                    out.append(b"%b%b%b\t%b\n" % (head, self._key(key), *got))
        return latest
