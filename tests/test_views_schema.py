"""The views of a big run (more than EXACT_SHARDS shards) read with the schema DuckDB
detected over a sample give the answers of detection over every shard (issue 24)."""

from __future__ import annotations

import json
import math

import pytest

from expr_tracker.views import sql
from tests.conftest import T0
from tests.views_runs import _write, shard_name

RANKS = 40


def _run(run):
    """RANKS shards of two streams: NaN/Infinity strings in `loss` on a few ranks only, an
    int key, a text key, a bool key, rank records, rank 0's own eval key, a torn line."""
    for stream in (None, "eval"):
        for r in range(RANKS):
            recs = []
            for s in range(30):
                loss: object = round(1.0 / (s + 1) + 0.01 * r, 6)
                if (r, s) in ((7, 3), (23, 11)):
                    loss = "NaN"
                if (r, s) == (31, 5):
                    loss = "-Infinity"
                row = {"_step": s, "_time": T0 + s, "loss": loss, "tokens": 4096 * s,
                       "tag": f"r{r}", "ok": s % 2 == 0}
                if r == 0 and s % 10 == 0:
                    row["eval_acc"] = 0.5 + s / 100
                recs.append(row)
                recs.append({"_kind": "rank", "_step": s, "_time": T0 + s + 0.5, "_rank": r,
                             "_world_size": RANKS, "_local_rank": r % 8, "_weight": 1.0,
                             "step_time": 1.0 + 0.01 * r})
            _write(run / shard_name(r, stream), recs, b'{"_step":99,"lo' if r == 3 else b"")
    return run


def _answers(run):
    out = {}
    with sql.connect(run) as con:
        for view in ("metrics", "ranks"):
            out[view, "describe"] = sql.run_query(con, f"DESCRIBE {view}").fetchall()
            rows = sql.run_query(con, f"SELECT * FROM {view} ORDER BY ALL").fetchall()
            # NaN != NaN: compare a text form of each value
            out[view] = [tuple("nan" if isinstance(v, float) and math.isnan(v) else v
                               for v in row) for row in rows]
    return out


def test_sampled_schema_gives_the_exact_answers(tmp_path, monkeypatch):
    run = _run(tmp_path / "run")
    exact = _answers(run)
    monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
    monkeypatch.setattr(sql, "SAMPLE_SHARDS", 4)
    assert len(sql.detect_sample([str(p) for p in sorted(run.iterdir())])) < 2 * RANKS
    sampled = _answers(run)
    assert sampled == exact
    metrics = exact["metrics"]
    assert len(metrics) == 2 * RANKS * 30  # every rank, every step, both streams
    cols = [c[0] for c in exact["metrics", "describe"]]
    types = {c[0]: c[1] for c in exact["metrics", "describe"]}
    assert types["loss"] == "DOUBLE" and types["tokens"] == "BIGINT" and types["tag"] == "VARCHAR"
    loss = cols.index("loss")
    assert sum(1 for row in metrics if row[loss] == "nan") == 4
    assert any(row[loss] == -math.inf for row in metrics)
    assert "eval_acc" in cols and "step_time" not in cols


@pytest.mark.parametrize("n", [1, 5, 300])
def test_detect_sample_keeps_each_streams_first_shard(n, monkeypatch):
    monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
    files = [f"/r/{shard_name(r)}" for r in range(n)] + [f"/r/{shard_name(r, 'b')}" for r in range(n)]
    files.sort(key=lambda f: ("b" in f, f))
    picked = sql.detect_sample(files)
    assert "/r/metrics.jsonl" in picked and "/r/metrics.b.jsonl" in picked
    assert len(picked) <= sql.SAMPLE_SHARDS + 2
    assert picked == [f for f in files if f in picked]  # in the run's order


def test_a_symlinked_shard_is_read_through_its_real_path(tmp_path):
    """Shard paths are taken as they are (the run directory is resolved) except a symlink,
    which is resolved as before: its target is the file DuckDB may open and reads."""
    run = tmp_path / "run"
    _write(run / "metrics.jsonl", [{"_step": 0, "_time": T0, "loss": 1.0}])
    elsewhere = tmp_path / "kept" / "metrics.rank1.jsonl"
    _write(elsewhere, [{"_step": 0, "_time": T0, "loss": 2.0}])
    (run / "metrics.rank1.jsonl").symlink_to(elsewhere)
    with sql.connect(tmp_path / "." / "run") as con:
        rows = sql.run_query(con, "SELECT _rank, loss FROM metrics ORDER BY 1").fetchall()
        allowed = con.execute("SELECT current_setting('allowed_paths')").fetchone()[0]
    assert rows == [(0, 1.0), (1, 2.0)]
    assert str(elsewhere.resolve()) in str(allowed) and str(run / "metrics.rank1.jsonl") not in str(allowed)


@pytest.mark.parametrize("how", ["join", "list"])
def test_each_rows_rank_and_stream_the_same_whichever_way_its_file_is_found(tmp_path, monkeypatch,
                                                                            how):
    """By file_index and a few CASE branches (the default), by a lookup in a list (many
    rank gaps), or by a join on the path (a DuckDB without file_index): one answer."""
    run = _run(tmp_path / "run")
    (run / shard_name(5)).unlink()  # a gap in the ranks: two segments for the default stream
    by_index = _answers(run)
    from expr_tracker.views import duckcopy

    if how == "join":
        monkeypatch.setattr(sql, "_has_file_index", lambda con, path: False)
    else:
        monkeypatch.setattr(duckcopy, "MAX_SEGMENTS", 1)
    assert _answers(run) == by_index
    assert {row[0] for row in by_index["metrics"] if row[1] is None} == set(range(RANKS)) - {5}
    assert {row[0] for row in by_index["metrics"] if row[1] == "eval"} == set(range(RANKS))


# numbers whose text must give the same double however the column is read (JSON or text)
F_VALUES = ["NaN", "Infinity", "-Infinity", 1.5, 0, 0.1, 1e300, 2**70, -0.0, 5e-324,
            123456789.123456789, 2**53 + 1, -7, 1e-7]


def _odd_run(run):
    """Shards whose values cover what a column can hold: ints, floats, int64's edges and
    beyond, the NaN/Infinity strings, bools, text, nested objects and lists, nulls, keys
    of one type on some ranks and another on others; and lines that are not rows: torn,
    blank, a bare array, a number, a duplicate key, CRLF endings, a leading space (in
    shards outside the detection sample: a bare value there makes DuckDB's detection
    read the whole file as values)."""
    odd = [b'{"_step":0', b"", b"[1, 2]", b"5", b'{"_step":7,"big":1,"big":2}',
           b' {"_step":8,"loss":0.5}', b'{"_step":9,"loss":"oops"}\r', b"{}", b"not json"]
    for r in range(RANKS):
        lines = []
        for s in range(20):
            row: dict[str, object] = {"_step": s, "_time": T0 + s, "loss": 1.0 / (s + 1) + r}
            row["big"] = [2**63 - 1, -(2**63), 2**64, 7][s % 4] if r % 5 == 0 else s
            row["f"] = F_VALUES[s % len(F_VALUES)] if r % 3 == 0 else s / 2
            row["flag"] = s % 3 == 0
            row["text"] = f"r{r}s{s}" if s % 7 else None
            row["nested"] = {"a": s, "b": [r, s]} if r % 2 else {"a": s}
            row["mixed"] = [1, "one", 1.5, True, None, {"k": 1}, [1]][(r + s) % 7]
            if r == 4:
                row["only_here"] = "x"
            lines.append(json.dumps(row).encode())
            if r % 10 == 3:
                lines.append(odd[s % len(odd)])
        (run / shard_name(r)).parent.mkdir(parents=True, exist_ok=True)
        (run / shard_name(r)).write_bytes(b"\n".join(lines) + (b"" if r == 2 else b"\n"))
    return run


@pytest.mark.parametrize("make", [_run, _odd_run], ids=["run", "odd"])
def test_the_transform_scan_gives_read_jsons_answers(tmp_path, monkeypatch, make):
    """On DuckDB 2.0 a big run's shards are read as JSON text and typed by json_transform
    (read_json binds itself for every file there); every rank and step, every value,
    the same as read_json with the columns given, and as detection over every shard."""
    run = make(tmp_path / "run")
    exact = _answers(run) if make is _run else None
    monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
    monkeypatch.setattr(sql, "SAMPLE_SHARDS", 4)
    with sql.connect(run) as con:
        view = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'metrics'").fetchone()
    import duckdb

    on_2 = int(duckdb.__version__.split(".")[0]) >= 2
    assert ("read_ndjson_objects" in view[0]) == on_2
    if on_2 and make is _odd_run:  # a JSON key cast to DOUBLE anyway is read as its text
        assert '"f": "VARCHAR"' in view[0] and "TRY_CAST(j.f AS DOUBLE)" in view[0]
    transformed = _answers(run)
    monkeypatch.setattr(sql, "TRANSFORM_SCAN", False)
    given = _answers(run)
    assert transformed == given
    assert exact is None or transformed == exact
    metrics = transformed["metrics"]
    steps = {(row[0], row[2]) for row in metrics}
    assert steps >= {(r, s) for r in range(RANKS) for s in range(20)}
    types = dict(c[:2] for c in transformed["metrics", "describe"])
    if make is _odd_run:
        assert types["big"] == "DOUBLE" and types["f"] == "DOUBLE" and types["flag"] == "BOOLEAN"
        assert types["text"] == "VARCHAR" and types["mixed"] == "JSON"
        assert types["nested"].startswith("STRUCT") and "only_here" not in types
        assert len(metrics) > RANKS * 20  # the odd lines that parse as rows are there too


@pytest.mark.parametrize("exact", [True, False])
def test_a_shard_with_bare_json_values_in_it_loses_only_those_lines(tmp_path, monkeypatch, exact):
    """A line that is JSON but not an object (`5`, `[1, 2]`, `"x"`, `null`: a foreign
    writer's) made DuckDB read its whole file as values, and the views came out empty.
    Now that file is left out of the detection; its records are read like the others'."""
    run = tmp_path / "run"
    for r in range(4):
        recs = [{"_step": s, "_time": T0 + s, "loss": 0.5 + r + s / 10} for s in range(6)]
        _write(run / shard_name(r), recs)
        if r == 1:
            lines = (run / shard_name(r)).read_bytes().splitlines(keepends=True)
            bad = [b"5\n", b"[1, 2]\n", b'"x"\n', b"null\n"]
            (run / shard_name(r)).write_bytes(b"".join(lines[:2] + bad + lines[2:]))
    if not exact:
        monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
        monkeypatch.setattr(sql, "SAMPLE_SHARDS", 4)
    assert not sql.records_only(str(run / shard_name(1)))
    assert sql.records_only(str(run / shard_name(0)))
    with sql.connect(run) as con:
        rows = sql.run_query(con, "SELECT _rank, count(*), sum(loss) FROM metrics "
                                  "GROUP BY 1 ORDER BY 1").fetchall()
    assert [(r, n) for r, n, _ in rows] == [(0, 6), (1, 6), (2, 6), (3, 6)]
    assert rows[1][2] == pytest.approx(sum(1.5 + s / 10 for s in range(6)))
