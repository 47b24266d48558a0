"""Reading a whole run (`expr_tracker.store.runread`) and `et.read_run`."""

from __future__ import annotations

import math

import pytest

import expr_tracker as et
from expr_tracker.store.runread import RunReader, merge_kinds, run_shards
from tests.views_runs import _write, make_run, shard_name


def test_rows_of_every_rank_with_rank_and_stream_from_the_file_name(tmp_path):
    run = make_run(tmp_path / "p" / "r", ranks=3, steps=5)
    _write(run / shard_name(2, "data"), [{"_step": 0, "_time": 1.0, "tokens": 7}])
    rows = list(RunReader(run).rows())
    assert len(rows) == 3 * 5 + 1
    assert [(r["_rank"], r["_stream"]) for r in rows[::5]] == [(0, None), (1, None), (2, None), (2, "data")]
    assert all(set(r) >= {"_rank", "_stream", "_step", "_time"} and "_kind" not in r for r in rows)
    assert [s.path.name for s in run_shards(run, "data")] == ["metrics.data.rank2.jsonl"]
    assert len(list(RunReader(run, stream=None).rows())) == 15


def test_shared_file_rows_and_rank_records_carry_their_own_rank(tmp_path):
    run = tmp_path / "p" / "r"
    _write(run / "metrics.jsonl", [
        {"_step": 0, "_time": 1.0, "_rank": 0, "loss": 1.0},
        {"_step": 0, "_time": 1.0, "_rank": 3, "loss": 2.0, "_sid": "s", "_seq": 4},
        {"_kind": "rank", "_step": 0, "_time": 1.0, "_rank": 5, "_world_size": 8, "_weight": 2,
         "gn": "NaN"},
    ])
    rows = list(RunReader(run).rows())
    assert [r["_rank"] for r in rows] == [0, 3]
    assert "_sid" not in rows[1] and "_seq" not in rows[1]
    (rec,) = RunReader(run, rank_records=True).rows()
    assert rec["_rank"] == 5 and rec["_world_size"] == 8 and rec["_weight"] == 2.0
    assert math.isnan(rec["gn"])


def test_columns_and_their_types_over_the_whole_run(tmp_path):
    run = tmp_path / "p" / "r"
    _write(run / "metrics.jsonl", [
        {"_step": 0, "_time": 1.0, "i": 1, "f": 1, "s": "x", "b": True, "m": 1, "n": None},
        {"_step": 1, "_time": 2.0, "i": 2, "f": "NaN", "s": "y", "b": False, "m": "two"},
    ], b"garbage{{\n")
    reader = RunReader(run)
    assert reader.columns() == {"_rank": "int", "_stream": "str", "_step": "int", "_time": "float",
                                "i": "int", "f": "float", "s": "str", "b": "bool", "m": "json",
                                "n": "str"}
    list(reader.rows())
    assert reader.garbage == 1  # counted once per pass, not once per pass ever made
    assert merge_kinds("int", "float") == "float" and merge_kinds(None, "bool") == "bool"


def test_batches_are_bounded_and_cover_every_row(tmp_path):
    run = make_run(tmp_path / "p" / "r", ranks=4, steps=10)
    batches = list(RunReader(run).batches(7))
    assert max(len(b) for b in batches) == 7 and sum(len(b) for b in batches) == 40
    with pytest.raises(ValueError, match="batch size"):
        list(RunReader(run).batches(0))


def test_read_run_as_pandas_arrow_and_dicts(tmp_path):
    run = make_run(tmp_path / "p" / "r", ranks=4, steps=6, nan_at=(2, 3))
    df = et.read_run(run)
    assert len(df) == 24 and list(df.columns[:4]) == ["_rank", "_stream", "_step", "_time"]
    assert df.groupby("_rank").size().to_dict() == {0: 6, 1: 6, 2: 6, 3: 6}
    assert math.isnan(df[(df._rank == 2) & (df._step == 3)]["loss"].iloc[0])
    table = et.read_run(run, rank_records=True, output_type="arrow")
    assert table.num_rows == 24 and table.schema.field("step_time").type == "double"
    rows = et.read_run(str(run / "metrics.rank3.jsonl"), metrics="loss", output_type="dict")
    assert len(rows) == 24 and set(rows[0]) == {"_rank", "_stream", "_step", "_time", "loss"}


def test_read_run_misuse(tmp_path):
    with pytest.raises(et.RunNotFoundError):
        et.read_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(et.RunNotFoundError, match="no metrics"):
        et.read_run(tmp_path / "empty")
    with pytest.raises(ValueError, match="output_type"):
        et.read_run(tmp_path, output_type="polars")
    with pytest.raises(ValueError, match="stream"):
        et.read_run(tmp_path, stream="rank3")
