"""`ShardReader.iter_all` (a block of lines per orjson call) gives exactly the records of
the line-by-line `iter_records`, and RunReader's rows built on it match (issue 24)."""

from __future__ import annotations

import math

from expr_tracker.store import reader as reader_mod
from expr_tracker.store.reader import ShardReader
from expr_tracker.store.runread import RunReader
from tests.views_runs import make_run


def _same(a, b):
    """Records equal, NaN equal to NaN."""
    def norm(rec):
        return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}
    return [norm(r) for r in a] == [norm(r) for r in b]


def _odd_shard(path):
    lines = [b'{"_step":0,"_time":1.0,"loss":"NaN","tag":"NaN-ish","x":1}',
             b'{"_step":1,"_time":2.0,"loss":"Infinity","y":"-Infinity","_kind":null}',
             b'', b'   ', b'not json', b'[1,2]', b'{"_step":2,"loss":NaN}',
             b'{"_step":3,"loss":1.5}{"_step":4}', b'{"_step":5,"loss":2.5,"nested":{"a":"NaN"}}',
             b'{"_step":6,"_time":3,"loss":-0.0,"s":"\\"q\\""}']
    path.write_bytes(b"\n".join(lines) + b'\n{"_step":7,"lo')


def test_iter_all_matches_iter_records_line_by_line(tmp_path, monkeypatch):
    shard = tmp_path / "metrics.jsonl"
    _odd_shard(shard)
    old, new = ShardReader(shard), ShardReader(shard)
    want = [rec for _, rec in old.iter_records()]
    got = list(new.iter_all())
    assert _same(got, want) and len(want) == 5 and new.garbage == old.garbage == 3
    assert got[0]["loss"] != got[0]["loss"] and got[0]["tag"] == "NaN-ish"
    assert got[1]["loss"] == math.inf and got[1]["y"] == -math.inf
    # many blocks: a small block size puts the odd lines and clean lines in different blocks
    big = tmp_path / "metrics.rank1.jsonl"
    body = b"".join(b'{"_step":%d,"loss":%s,"t":"a"}\n' % (s, b'"NaN"' if s % 97 == 0 else b"0.5")
                    for s in range(5000))
    big.write_bytes(body + shard.read_bytes() + body)
    monkeypatch.setattr(reader_mod, "_READ_BLOCK", 1024)
    old, new = ShardReader(big), ShardReader(big)
    assert _same(list(new.iter_all()), [rec for _, rec in old.iter_records()])
    assert new.garbage == old.garbage == 4  # the torn tail glued to the next line


def test_run_rows_match_the_line_by_line_path(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", 6, 40, nan_at=(2, 7))
    _odd_shard(run / "metrics.rank6.jsonl")
    fast_rows = list(RunReader(run).rows())
    fast_ranks = list(RunReader(run, rank_records=True).rows())
    fast_cols = RunReader(run).columns()
    monkeypatch.setattr(ShardReader, "iter_all",
                        lambda self: (rec for _, rec in self.iter_records()))
    assert _same(fast_rows, list(RunReader(run).rows()))
    assert _same(fast_ranks, list(RunReader(run, rank_records=True).rows()))
    assert fast_cols == RunReader(run).columns()
    assert len(fast_rows) == 6 * 40 + 5  # the torn tails are not rows
    assert sum(1 for r in fast_rows if r["loss"] != r["loss"]) == 3


def _columns_from_rows(reader):
    """`RunReader.columns()` as it was: the kinds of the built rows' values."""
    from expr_tracker.store.runread import RESERVED_KINDS, merge_kinds, value_kind

    kinds = {}
    for row in reader.rows():
        for k, v in row.items():
            if k[:1] == "_":
                continue
            kind = value_kind(v)
            if k not in kinds:
                kinds[k] = kind
            elif kind is not None and kinds[k] != kind:
                kinds[k] = merge_kinds(kinds[k], kind)
    if reader.metrics is not None:
        kinds = {k: kinds[k] for k in reader.metrics if k in kinds}
    out = {k: RESERVED_KINDS[k] for k in reader.reserved}
    out.update((k, v or "str") for k, v in kinds.items())
    return out


def test_columns_from_records_match_columns_from_rows(tmp_path):
    run = make_run(tmp_path / "run", 5, 30, nan_at=(2, 7))
    _odd_shard(run / "metrics.rank5.jsonl")
    for kw in ({}, {"rank_records": True}, {"metrics": ["loss", "nested", "missing"]},
               {"metrics": ["tag"], "ranks": [0, 5]}, {"step_range": (3, 9)}):
        fast = RunReader(run, **kw)
        cols = fast.columns()
        garbage = fast.garbage
        ref = RunReader(run, **kw)
        assert list(cols.items()) == list(_columns_from_rows(ref).items()), kw
        assert garbage == ref.garbage
    assert RunReader(run).columns()["loss"] == "float" and RunReader(run).columns()["tag"] == "str"
