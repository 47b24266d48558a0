"""Parquet export's DuckDB pass reads each line as JSON text typed by `json_transform`
(issue 24, `duckcopy.transform_scan`), where it read it with `read_json(columns=...)`:
both give the same file, and the Python path's, on the same synthetic runs (every rank
and step, NaN and infinities, int64's edges, -0.0, text with colons, quotes and
accents, bools, a key only on one rank, a key present only as null, rank records,
torn lines, a value that does not cast in a record that is not exported), and a line
that may name a key twice keeps the strict `read_json` scan (which refuses it)."""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest

from expr_tracker.views import duckcopy
from expr_tracker.views.export import open_run, write_parquet
from tests.conftest import T0
from tests.views_runs import _write, shard_name

RANKS = 5
STEPS = 20
EDGES = [3, 1e300, 5e-324, -0.0, 0.1, -7, 2**53]  # ints among floats: a float column


def _rows(rank: int, stream: str | None) -> list[dict]:
    recs: list[dict] = []
    for s in range(STEPS):
        loss: object = 1.0 / (s + 1) + 0.01 * rank
        loss = {(1, 3): "NaN", (2, 5): "Infinity", (3, 9): "-Infinity"}.get((rank, s), loss)
        row = {"_step": s, "_time": T0 + s, "loss": loss, "big": EDGES[s % len(EDGES)],
               "ints": [-(2**63), 2**63 - 1, 2**53 + 1][s % 3], "at": f"12:{s:02d}:00 \"q\" é",
               "ok": s % 3 == 0, 'a "quoted" key': s}
        if rank == 0:
            row["only0"] = s / 7
        if s == 4:
            row["nul"] = None
        if stream == "eval":
            row["acc"] = 0.5
        if s == 2:  # text where the rank records hold numbers: read_json refuses to cast it
            row["step_time"] = "n/a"
        recs.append(row)
        recs.append({"_kind": "rank", "_step": s, "_time": T0 + s + 0.5, "_rank": rank,
                     "_world_size": RANKS, "_local_rank": rank, "_weight": 0.5,
                     "step_time": 1.0 + rank / 3, "loss": 0.5})
        if s == 5:  # `_kind` not first: not left out by its text (NOT_RANK_LINE)
            recs[-1] = {"_step": s, **recs[-1]}
    return recs


def _run(run, *, tail: bytes = b"", dup: bytes = b""):
    for stream in (None, "eval"):
        for r in range(RANKS):
            extra = tail if (r, stream) == (1, None) else b""
            if (r, stream) == (3, None):
                extra += dup
            _write(run / shard_name(r, stream), _rows(r, stream), extra)
    return run


@pytest.fixture
def used(monkeypatch):
    """The `transform` of each DuckDB read of the latest export, and its rows."""
    seen: list[tuple[bool, int]] = []
    real_batches, real_copy = duckcopy.duck_batches, duckcopy.copy_parquet

    def batches(con, reader, shards, columns, batch_rows, transform=False):
        seen.append((transform, 0))  # a read DuckDB refuses stays at 0 rows
        for batch in real_batches(con, reader, shards, columns, batch_rows, transform):
            seen[-1] = (transform, seen[-1][1] + batch.num_rows)
            yield batch

    def copy(con, reader, columns, out, row_group, transform=False):
        seen.append((transform, 0))
        seen[-1] = (transform, real_copy(con, reader, columns, out, row_group, transform))
        return seen[-1][1]

    monkeypatch.setattr(duckcopy, "duck_batches", batches)
    monkeypatch.setattr(duckcopy, "copy_parquet", copy)
    return seen


def _cells(path) -> tuple[list, list, list]:
    """Names, types and every row of a parquet file; floats by repr (NaN, -0.0, inf)."""
    table = pq.read_table(path)
    rows = [tuple(repr(v) if isinstance(v, float) else v for v in row.values())
            for row in table.to_pylist()]
    return table.schema.names, [str(t) for t in table.schema.types], rows


def _three(run, tmp_path, monkeypatch, used, **kw):
    """The export by json_transform, by read_json and by Python: the same file; the
    DuckDB reads of each (transform, rows)."""
    out = {}
    reads = {}
    for name, transform, engine in (("transform", True, "auto"), ("read_json", False, "auto"),
                                    ("python", False, "python")):
        monkeypatch.setattr(duckcopy, "TRANSFORM_SCAN", transform)
        used.clear()
        reader = open_run(run, **kw)
        path = tmp_path / f"{name}.parquet"
        n = write_parquet(reader, path, engine=engine)
        out[name] = (_cells(path), n, reader.garbage)
        reads[name] = list(used)
    assert out["transform"] == out["read_json"] == out["python"]
    return reads, out["transform"][0]


@pytest.mark.parametrize("kw", [{}, {"rank_records": True}, {"metrics": ["only0", "nul"]},
                                {"metrics": ["big"]}, {"stream": "eval"}])
def test_the_transform_scan_writes_read_jsons_file(tmp_path, monkeypatch, used, kw):
    run = _run(tmp_path / "run", tail=b'{"_step":99,"lo')  # rank 1 torn: Python for it
    reads, (names, types, rows) = _three(run, tmp_path, monkeypatch, used, **kw)
    assert rows
    assert reads["python"] == []
    if kw.get("metrics") == ["only0", "nul"]:
        assert reads["transform"] == []  # `nul` present with null: Python for every shard
        return
    assert [t for t, _ in reads["transform"]] and all(t for t, _ in reads["transform"])
    assert not any(t for t, _ in reads["read_json"])
    # every row but the torn shard's (rank 1, default stream: the Python path's)
    assert sum(n for _, n in reads["transform"]) == len(rows) - (
        0 if kw.get("stream") == "eval" else STEPS)
    if not kw:
        got = dict(zip(names, types, strict=True))
        assert got["big"] == "double" and got["ints"] == "int64" and got["at"] == "string"
        assert got["ok"] == "bool" and got['a "quoted" key'] == "int64"
        assert got["step_time"] == "string"
        assert {r[names.index("loss")] for r in rows} >= {"nan", "inf", "-inf"}
        assert "-0.0" in {r[names.index("big")] for r in rows}


@pytest.mark.parametrize("line", [
    b'{"_step":40,"_time":1.0,"loss":1.0,"loss":2.0}\n',
    b'{"_step":40,"_time":1.0,"loss":1.0, "loss" :2.0}\n',  # space before a colon
    b'{"_step":40,"_time":1.0,"at":"x\\":y","at":"z"}\n',  # and a colon in a text
])
def test_a_key_named_twice_keeps_the_strict_scan(tmp_path, monkeypatch, used, line):
    """json_transform keeps a twice-named key's first value, orjson its last: the scan
    notes such a line and DuckDB reads strictly (read_json refuses it: the Python path
    writes the run)."""
    run = _run(tmp_path / "run", dup=line)
    assert duckcopy.scan(open_run(run)).keys_twice
    reads, _ = _three(run, tmp_path, monkeypatch, used)
    assert reads["transform"] == [(False, 0)]  # refused: the Python path wrote it


def test_colons_in_texts_alone_keep_the_transform_scan(tmp_path):
    run = _run(tmp_path / "run", dup=b'{"_step":40,"_time":1.0,"at":"x\\"y: z","k:":1}\n')
    first = duckcopy.scan(open_run(run))
    assert not first.keys_twice and duckcopy.transform_scan(first)


def test_the_helper_process_reports_a_key_named_twice(tmp_path, monkeypatch):
    run = _run(tmp_path / "run")
    _write(run / shard_name(4, "eval"), _rows(4, "eval"), b'{"_step":50,"x":1,"x":2}\n')
    monkeypatch.setattr(duckcopy, "PARALLEL_SHARDS", 2)
    parts = []
    real = duckcopy._finish_part
    monkeypatch.setattr(duckcopy, "_finish_part", lambda proc: parts.append(real(proc)) or parts[-1])
    assert duckcopy.scan(open_run(run)).keys_twice
    assert parts[0] is not None and parts[0].keys_twice  # the second half: the helper's


def test_without_duckdb_the_python_path_writes_the_same_file(tmp_path, monkeypatch, used):
    run = _run(tmp_path / "run")
    write_parquet(open_run(run), tmp_path / "duck.parquet")
    monkeypatch.setitem(sys.modules, "duckdb", None)  # `import duckdb` fails
    assert not duckcopy.installed() and duckcopy.available() is None
    used.clear()
    write_parquet(open_run(run), tmp_path / "python.parquet")
    assert used == []
    assert _cells(tmp_path / "python.parquet") == _cells(tmp_path / "duck.parquet")
