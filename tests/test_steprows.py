"""`stats.steprows.row_table` (the step rows of many shards as a RankTable) gives the table
`expr summary -m KEY` built before it, record by record: each line naming a key parsed on
its own and the synthetic rank record of its picked keys grouped by `collect`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expr_tracker.stats import parallel, steprows
from expr_tracker.stats.ranktable import RankTable, collect
from expr_tracker.stats.scan import ColumnTable
from expr_tracker.stats.steprows import row_columns, row_table
from expr_tracker.store import records
from expr_tracker.store.window import window_start


def _old_table(shards: list[tuple[Path, int]], keys: set[str], lo: int | None, world: int,
               prefix: str | None = None) -> tuple[RankTable, dict[str, int]]:
    """The reader `row_table` replaced, as it was (expr_cli/summary_load.py at b71eb40)."""
    garbage: dict[str, int] = {}
    marks = [b'"' + k.encode() + b'"' for k in keys] if prefix is None else [b'"' + prefix.encode()]

    def rows() -> Iterator[dict[str, Any]]:
        for path, rank in shards:
            bad = 0
            with open(path, "rb") as fh:
                start = window_start(fh, lo) if lo is not None else 0
                for _, data in records.complete_blocks(fh, 4 << 20, start):
                    for _, line in records.iter_lines(data):
                        if not any(m in line for m in marks):
                            continue
                        try:
                            rec = records.loads(line)
                        except ValueError:
                            bad += 1
                            continue
                        if type(rec) is not dict or rec.get("_kind") is not None:
                            continue
                        picked = ({k: rec[k] for k in keys if k in rec} if prefix is None
                                  else {k: v for k, v in rec.items() if k.startswith(prefix)})
                        yield {"_kind": "rank", "_step": rec.get("_step"), "_rank": rank,
                               "_world_size": world, **picked}
            if bad:
                garbage[path.name] = bad

    return collect(rows()), garbage


def _same(new: tuple[RankTable, dict[str, int]], old: tuple[RankTable, dict[str, int]]) -> None:
    (a, ga), (b, gb) = new, old
    assert ga == gb
    assert a.world_size == b.world_size and a.steps == b.steps and a.keys == b.keys
    assert a.skipped == b.skipped and a._wrank == b._wrank
    assert a._cols.keys() == b._cols.keys()
    for key in a._cols:
        assert a._cols[key].keys() == b._cols[key].keys(), key
        for rank, col in a._cols[key].items():
            other = b._cols[key][rank]
            assert col.keys() == other.keys(), (key, rank)
            for step, v in col.items():
                w = other[step]
                assert type(v) is type(w) and (v == w or (math.isnan(v) and math.isnan(w))), \
                    (key, rank, step, v, w)
    for key in a.keys:  # and the reducers over them
        for step in a.steps:
            assert a.values(key, step).keys() == b.values(key, step).keys()


def _same_columns(new: tuple[Any, dict[str, int]], old: tuple[RankTable, dict[str, int]]) -> bool:
    """`row_columns`' table (a ColumnTable, or the RankTable) is the old reader's, and
    reduces to its answers; whether it was a ColumnTable."""
    from expr_tracker.stats import reduce

    table, garbage = new
    if not isinstance(table, ColumnTable):
        _same(new, old)
        return False
    ranks = table.rank_table(table.keys)
    _same((RankTable(ranks._cols, ranks._wrank, table.world_size), garbage), old)
    ref = old[0]
    for key in ref.keys:
        steps = ref.key_steps(key)
        for step in steps:
            assert table.reduce_step(key, step) == reduce.reduce_step(ref, key, step), (key, step)
        if steps:
            lo, hi = steps[0], steps[-1] + 1
            assert table.reduce_window(key, lo, hi) == reduce.reduce_window(ref, key, lo, hi)
            assert table.heatmap(key, 3) == reduce.heatmap(ref, key, 3)
    assert table.coverage(ref.steps) == reduce.coverage(ref, ref.steps)
    return True


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_odd_rows_give_the_old_readers_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ints, NaN and infinities as text, bare NaN tokens, booleans, text, nulls, keys that
    come and go, a repeated step, rank records among the rows, a line that does not parse,
    a step that is not an int, a torn last line; several ranks."""
    a, b, c = tmp_path / "metrics.jsonl", tmp_path / "metrics.rank1.jsonl", tmp_path / "metrics.rank2.jsonl"
    _write(a, [
        '{"_step":0,"_time":1.0,"loss":2,"lr":0.1,"phase":"warm"}',
        '{"_step":1,"_time":2.0,"loss":"NaN","lr":0.1,"eval":1.5}',
        '{"_kind":"rank","_step":1,"_time":2.1,"_rank":0,"loss":9.0,"step_time":0.5}',
        '{"_step":2,"_time":3.0,"loss":true,"lr":null}',
        '{"_step":3,"_time":4.0,"loss":"Infinity","lr":"high"}',
        '{"_step":3,"_time":4.5,"loss":1.25}',  # the step again: the later row wins
        '{"_step":"4","_time":5.0,"loss":1.0}',
        '{"_step":5,"_time":6.0,"other":1.0}',
        '{"_step":6,"_time":7.0,"loss":-0.0,"lr":1e308,"time_ms/fwd":3.5}',
    ])
    _write(b, [
        '{"_step":0,"_time":1.0,"loss":1.5,"lr":0.1}',
        '{"_step":1,"_time":2.0,"loss":NaN,"lr":0.1}',  # a bare NaN: line by line
        'not json at all "loss"',
        '{"_step":2,"_time":3.0,"loss":-Infinity,"time_ms/fwd":4}',
    ])
    c.write_text('{"_step":0,"_time":1.0,"loss":3.0,"lr":0.2}\n{"_step":1,"_time":2.0,"loss":3.5')
    shards = [(a, 0), (b, 1), (c, 2)]
    for keys in ({"loss"}, {"loss", "lr"}, {"lr", "eval", "phase"}, {"absent"}, set()):
        for lo in (None, 2):
            _same(row_table(shards, keys, lo, 4), _old_table(shards, keys, lo, 4))
    _same(row_table(shards, set(), None, 3, prefix="time_ms/"),
          _old_table(shards, set(), None, 3, prefix="time_ms/"))
    # read in worker processes (as for thousands of ranks): the same table, shards in order
    monkeypatch.setattr(parallel, "PARALLEL_BYTES", 0)
    many = shards * 3
    _same(row_table(many, {"loss", "lr"}, None, 4), _old_table(many, {"loss", "lr"}, None, 4))
    monkeypatch.undo()
    table, garbage = row_table(shards, {"loss"}, None, 4)
    assert garbage == {"metrics.rank1.jsonl": 1}
    assert table.values("loss", 3) == {0: 1.25}  # the later row of step 3 wins
    assert math.isnan(table.values("loss", 1)[0]) and table.values("loss", 2) == {1: -math.inf}
    assert row_table(shards, {"loss"}, None, 2 << 20)[0].world_size == 3  # past the cap


_VALUES = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**53), 2**53),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "text", True, False, None]),
)
_ROW = st.dictionaries(st.sampled_from(["loss", "lr", "acc"]), _VALUES, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=st.lists(st.lists(st.tuples(st.integers(0, 30), _ROW, st.booleans()), max_size=25),
                      min_size=1, max_size=4))
def test_generated_rows_give_the_old_readers_table(tmp_path: Path, ranks: list[Any]) -> None:
    """Any step rows (steps in any order, repeated; any values), with rank records among
    them, give the same table."""
    shards = []
    for rank, rows in enumerate(ranks):
        path = tmp_path / f"metrics.rank{rank}.jsonl"
        lines = []
        for step, row, with_rank_record in rows:
            lines.append(json.dumps({"_step": step, "_time": 1.0, **row}))
            if with_rank_record:
                lines.append(json.dumps({"_kind": "rank", "_step": step, "_rank": rank, "loss": 7.0}))
        _write(path, lines)
        shards.append((path, rank))
    for keys in ({"loss"}, {"loss", "lr", "acc"}):
        for lo in (None, 10):
            _same(row_table(shards, keys, lo, len(ranks)), _old_table(shards, keys, lo, len(ranks)))


_NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**53), 2**53),
                    st.sampled_from(["NaN", "Infinity", "-Infinity"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans(),
                                st.sampled_from(["none", "other row", "repeat", "text", "torn"])),
                      min_size=1, max_size=5),
       values=st.lists(_NUMBER, min_size=1, max_size=8))
def test_row_columns_give_the_old_readers_table(tmp_path: Path, ranks: list[Any],
                                                values: list[Any]) -> None:
    """Step rows as `et.log` of the same keys writes them (each rank's rows at increasing
    steps, every key a number at each), some with one thing that breaks the block (a key
    missing at a step, a repeated step, text, a torn line): `row_columns` is the old
    reader's table (as a ColumnTable when nothing breaks it), with the same reductions."""
    shards = []
    for rank, (first, n, with_other, odd) in enumerate(ranks):
        lines = []
        for i, step in enumerate(range(first, first + n)):
            row = {"loss": values[(i + rank) % len(values)], "lr": values[i % len(values)]}
            if odd == "none" or i != n // 2:
                lines.append(json.dumps({"_step": step, "_time": 1.0, **row}))
            elif odd == "other row":
                lines.append(json.dumps({"_step": step, "_time": 1.0, "loss": 1.0}))
            elif odd == "repeat":
                lines += [json.dumps({"_step": step, **row}), json.dumps({"_step": step, **row})]
            elif odd == "text":
                lines.append(json.dumps({"_step": step, "loss": "high", "lr": 0.1}))
            else:
                lines.append('{"_step": 1, "loss"')
            if with_other:  # rows of other keys, and rank records, between them
                lines.append(json.dumps({"_step": step, "eval": 2.0}))
                lines.append(json.dumps({"_kind": "rank", "_step": step, "_rank": rank, "loss": 7.0}))
        path = tmp_path / f"metrics.rank{rank}.jsonl"
        _write(path, lines)
        shards.append((path, rank))
    regular = all(odd == "none" for *_, odd in ranks)
    for keys in ({"loss"}, {"loss", "lr"}, {"eval"}, {"loss", "eval"}):
        for lo in (None, 10):
            old = _old_table(shards, keys, lo, len(ranks) + 1)
            columns = _same_columns(row_columns(shards, keys, lo, len(ranks) + 1), old)
            if keys != {"loss", "eval"} and regular:
                assert columns, keys
            with pytest.MonkeyPatch.context() as m:
                # a few lines at a time: a shard that stops making a block part of the way
                # through goes on as rows, with what its arrays held
                m.setattr(steprows, "_BLOCK", 150)
                _same_columns(row_columns(shards, keys, lo, len(ranks) + 1), old)
