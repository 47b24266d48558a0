"""Parquet export through DuckDB (`expr_tracker.views.duckcopy`, issue 24) writes what the
Python path writes: the same columns, types and rows in the same order, on the same
synthetic runs (every rank, every step, NaN and infinities, text, bools, two streams,
rank records, torn lines), and falls back to the Python path, shard by shard or for the
whole run, wherever DuckDB would read a line differently."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from expr_tracker.views import duckcopy
from expr_tracker.views.export import open_run, write_parquet
from tests.conftest import T0
from tests.views_runs import _write, shard_name

RANKS = 6
STEPS = 25


def _rows(rank: int, stream: str | None) -> list[dict]:
    recs: list[dict] = []
    for s in range(STEPS):
        loss: object = round(1.0 / (s + 1) + 0.01 * rank, 6)
        if (rank, s) in ((1, 3), (4, 7)):
            loss = "NaN"
        if (rank, s) == (2, 5):
            loss = "Infinity"
        if (rank, s) == (3, 9):
            loss = "-Infinity"
        row = {"_step": s, "_time": T0 + s, "loss": loss, "tokens": 4096 * s,
               "tag": f"r{rank} é \"q\"", "ok": s % 2 == 0}
        if rank == 0 and s % 5 == 0:
            row["eval acc"] = 0.5 + s / 100  # a key with a space, on rank 0 only
        if s == 7:
            row["lr"] = None  # a key present with null only
        if stream == "eval":
            row["acc"] = 1 if s % 3 else 2  # ints, another stream's own key
        recs.append(row)
        recs.append({"_kind": "rank", "_step": s, "_time": T0 + s + 0.5, "_rank": rank,
                     "_world_size": RANKS, "_local_rank": rank % 4, "_weight": 1.0,
                     "step_time": 1.0 + 0.01 * rank, "loss": 0.5})
    return recs


def make_run(run, *, tail: dict[int, bytes] | None = None, edit=None):
    """RANKS shards of two streams; `tail`: bytes after rank r's default-stream lines;
    `edit(rank, stream, recs)` changes a shard's records before they are written."""
    for stream in (None, "eval"):
        for r in range(RANKS):
            recs = _rows(r, stream)
            if edit is not None:
                edit(r, stream, recs)
            _write(run / shard_name(r, stream), recs, (tail or {}).get(r, b"") if stream is None
                   else b"")
    return run


def _norm(table) -> list[tuple]:
    return [tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row.values())
            for row in table.to_pylist()]


@pytest.fixture(autouse=True)
def duck_rows(monkeypatch):
    """The rows DuckDB gave in the latest export (the rest came from the Python path)."""
    seen = [0]
    real_batches, real_copy = duckcopy.duck_batches, duckcopy.copy_parquet

    def counting(*args, **kw):
        for batch in real_batches(*args, **kw):
            seen[0] += batch.num_rows
            yield batch

    def copying(*args, **kw):  # every shard through DuckDB: its own COPY
        n = real_copy(*args, **kw)
        seen[0] += n
        return n

    monkeypatch.setattr(duckcopy, "duck_batches", counting)
    monkeypatch.setattr(duckcopy, "copy_parquet", copying)
    return seen


def _both(run, tmp_path, **kw):
    """(DuckDB path's table, Python path's table, scan) of one run."""
    fast, slow = tmp_path / "fast.parquet", tmp_path / "slow.parquet"
    reader = open_run(run, **kw)
    first = duckcopy.scan(open_run(run, **kw))
    assert first.columns == open_run(run, **kw).columns()
    n = write_parquet(reader, fast)
    python = open_run(run, **kw)
    assert write_parquet(python, slow, engine="python") == n
    assert reader.garbage == python.garbage
    a, b = pq.read_table(fast), pq.read_table(slow)
    assert a.schema.names == b.schema.names
    assert a.schema.types == b.schema.types
    assert _norm(a) == _norm(b)
    assert a.num_rows == n
    return a, b, first


@pytest.mark.parametrize("rank_records", [False, True])
def test_a_clean_run_is_written_by_duckdb_with_the_python_paths_answer(tmp_path, rank_records,
                                                                      duck_rows):
    run = make_run(tmp_path / "run")
    a, _, first = _both(run, tmp_path, rank_records=rank_records)
    assert first.problem is None and first.python == {}
    rows = a.to_pylist()
    assert duck_rows[0] == len(rows)  # every row through DuckDB
    if rank_records:
        assert len(rows) == 2 * RANKS * STEPS
        assert {r["_rank"] for r in rows} == set(range(RANKS))
        assert {r["_world_size"] for r in rows} == {RANKS}
        return
    assert len(rows) == 2 * RANKS * STEPS  # every rank, every step, both streams
    assert [(r["_stream"], r["_rank"], r["_step"]) for r in rows] == [
        (st, r, s) for st in (None, "eval") for r in range(RANKS) for s in range(STEPS)]
    types = dict(zip(a.schema.names, map(str, a.schema.types), strict=True))
    assert types["loss"] == "double" and types["tokens"] == "int64" and types["tag"] == "string"
    assert types["ok"] == "bool" and types["lr"] == "string" and types["acc"] == "int64"
    assert "step_time" not in types  # only in rank records
    losses = [r["loss"] for r in rows]
    assert sum(1 for v in losses if v != v) == 4
    assert math.inf in losses and -math.inf in losses


def test_torn_lines_go_through_python_for_their_shard_only(tmp_path, duck_rows):
    run = make_run(tmp_path / "run", tail={1: b'{"_step":99,"lo', 4: b'{"_step":99,"loss":1}'})
    # a line torn in the middle: the writer was killed, and restarted on the same file
    with open(run / shard_name(2), "ab") as fh:
        fh.write(b'{"_step":30,"lo{"_step":31,"_time":1.0,"loss":2.0}\n')
    a, _, first = _both(run, tmp_path)
    assert set(first.python) == {1, 2, 4}
    assert first.garbage == 1
    assert duck_rows[0] == a.num_rows - 3 * STEPS  # the other shards through DuckDB


@pytest.mark.parametrize("what", ["mixed", "float step", "text rank", "bool time", "bare nan",
                                  "dup key", "bad cast", "kind", "big int", "blank"])
def test_lines_duckdb_would_read_differently_give_the_python_answer(tmp_path, what, duck_rows):
    def edit(rank, stream, recs):
        if rank != 3 or stream is not None:
            return
        row = recs[10]
        if what == "mixed":
            row["tag"] = 5  # text and numbers: JSON text, the whole run in Python
        elif what == "float step":
            recs.append({"_step": 30.0, "_time": T0, "loss": 1.0})
        elif what == "text rank":
            row["_rank"] = "3"
        elif what == "bool time":
            row["_time"] = True
        elif what == "big int":
            row["tokens"] = 2**64 - 1  # beyond int64: a float column
            for r in recs:
                if "tokens" in r:
                    r["tokens"] = float(r["tokens"]) if r is not row else r["tokens"]
        elif what == "kind":
            recs.append({"_kind": 5, "_step": 30, "loss": 1.0})
        elif what == "bad cast":
            recs.append({"_kind": "rank", "_step": 30, "loss": "text"})  # not exported

    run = make_run(tmp_path / "run", edit=edit)
    path = run / shard_name(3)
    if what in ("bare nan", "dup key", "blank"):
        extra = {"bare nan": b'{"_step":40,"_time":1.0,"loss":NaN}\n',
                 "dup key": b'{"_step":40,"_time":1.0,"loss":1.0,"loss":2.0}\n',
                 "blank": b'\n  \n{"_step":40,"_time":1.0,"loss":3.0}\n'}[what]
        with open(path, "ab") as fh:
            fh.write(extra)
    if what == "big int":
        # the Python path refuses an integer beyond int64 in a float column (pyarrow);
        # only the columns are compared
        reader = open_run(run)
        assert duckcopy.scan(reader).columns == open_run(run).columns()
        return
    a, _, first = _both(run, tmp_path)
    if what == "mixed":
        assert first.problem is not None and duck_rows[0] == 0
    elif what in ("dup key", "bad cast"):
        assert first.problem is None and first.python == {}  # DuckDB itself refuses
    else:
        assert set(first.python) == {3}  # rank 3's default-stream shard
        assert 0 < duck_rows[0] < a.num_rows


def test_metric_filters_and_many_rank_segments(tmp_path, monkeypatch, duck_rows):
    run = tmp_path / "run"
    for r in (0, 2, 3, 7, 8, 9):  # gaps in the ranks: several file -> rank segments
        _write(run / shard_name(r), _rows(r, None))
    a, _, first = _both(run, tmp_path, metrics=["tokens", "eval acc"])
    assert first.python == {} and duck_rows[0] == a.num_rows == 6 * STEPS
    assert [r["_rank"] for r in a.to_pylist()][::STEPS] == [0, 2, 3, 7, 8, 9]
    _, _, first = _both(run, tmp_path, metrics=["lr"])
    assert len(first.python) == 6  # present with null: Python for those shards
    monkeypatch.setattr(duckcopy, "MAX_SEGMENTS", 1)  # the list lookup instead of CASE
    duck_rows[0] = 0
    a, _, first = _both(run, tmp_path)
    assert first.python == {} and duck_rows[0] == a.num_rows


def test_an_empty_result_has_the_columns(tmp_path):
    run = tmp_path / "run"
    _write(run / shard_name(0), [{"_step": 0, "_time": T0, "loss": 1.0}])
    a, _, _ = _both(run, tmp_path, rank_records=True)
    assert a.num_rows == 0


@pytest.mark.parametrize("helper", [True, False])
def test_a_second_process_reading_half_the_shards_gives_the_same_scan(tmp_path, monkeypatch,
                                                                      helper):
    run = make_run(tmp_path / "run", tail={1: b'{"_step":99,"lo'})
    with open(run / shard_name(4, "eval"), "ab") as fh:
        fh.write(b'{"_step":30,"_time":1.0,"loss":NaN}\n')
    alone = duckcopy.scan(open_run(run))
    monkeypatch.setattr(duckcopy, "PARALLEL_SHARDS", 2)
    if not helper:  # a helper that cannot start: this process reads both halves
        monkeypatch.setattr(duckcopy, "_start_part", lambda *a: None)
    parts = []
    real = duckcopy._finish_part
    monkeypatch.setattr(duckcopy, "_finish_part", lambda proc: parts.append(real(proc)) or parts[-1])
    both = duckcopy.scan(open_run(run))
    assert (parts[0] is not None) == helper  # the helper process's own answer, or none
    assert (both.columns, both.rows, both.garbage, both.python, both.problem) == (
        alone.columns, alone.rows, alone.garbage, alone.python, alone.problem)
    assert set(both.python) == {1, RANKS + 4}  # the torn shard, the eval shard's bare NaN
    _both(run, tmp_path)
