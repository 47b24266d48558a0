"""`expr query`: DuckDB views over a run, read-only; bad SQL is one line."""

from __future__ import annotations

import csv
import io
import json

import pytest

from expr_tracker.views.sql import QueryError, connect, literal, run_query
from tests.conftest import write_shard
from tests.test_cli_export import _blocked
from tests.views_runs import make_run


def _json(cli, *args):  # type: ignore[no-untyped-def]
    result = cli("query", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_rows_per_rank(cli):
    rows = _json(cli, "run-1", "SELECT _rank, count(*) AS n FROM metrics GROUP BY _rank ORDER BY _rank")
    assert rows == [{"_rank": 0, "n": 43}, *({"_rank": r, "n": 40} for r in range(1, 8))]
    data = _json(cli, "run-1", "SELECT _stream, count(*) AS n FROM metrics GROUP BY _stream ORDER BY n")
    assert data == [{"_stream": "data", "n": 3}, {"_stream": None, "n": 320}]


def test_rank_records_with_nan_as_a_double(cli):
    rows = _json(cli, "run-1", "SELECT _rank, _weight, grad_norm, isnan(grad_norm) AS nan FROM ranks "
                 "WHERE _step = 39 AND _rank IN (4, 5) ORDER BY _rank")
    assert rows == [{"_rank": 4, "_weight": 1040.0, "grad_norm": 1.15, "nan": False},
                    {"_rank": 5, "_weight": 1050.0, "grad_norm": "NaN", "nan": True}]
    assert _json(cli, "run-1", "SELECT count(*) AS n FROM ranks")[0]["n"] == 318


def test_nan_strings_among_numbers_make_a_double_column(cli, tmp_path):
    run = make_run(tmp_path / "p" / "nan", ranks=2, steps=4, nan_at=(1, 2))
    rows = _json(cli, str(run), "SELECT typeof(loss) AS t, count(*) FILTER (WHERE isnan(loss)) AS n "
                 "FROM metrics GROUP BY t")
    assert rows == [{"t": "DOUBLE", "n": 1}]
    cols = _json(cli, str(run), "SELECT column_name FROM (DESCRIBE metrics)")
    assert [c["column_name"] for c in cols] == ["_rank", "_stream", "_step", "_time", "loss", "lr", "tag"]


def test_shared_file_rank_comes_from_the_rows(cli, tmp_path):
    run = tmp_path / "p" / "shared"
    write_shard(run / "metrics.jsonl", [{"_step": s, "_time": 1.0, "_rank": r, "x": r}
                                        for s in range(3) for r in range(4)])
    rows = _json(cli, str(run), "SELECT _rank, sum(x) AS x FROM metrics GROUP BY 1 ORDER BY 1")
    assert rows == [{"_rank": r, "x": 3 * r} for r in range(4)]


def test_alerts_and_incidents_views(cli, cli_root):
    rows = _json(cli, "run-1", "SELECT rank, level, delivered FROM alerts ORDER BY time")
    assert rows == [{"rank": 3, "level": "error", "delivered": False},
                    {"rank": 0, "level": "info", "delivered": True},
                    {"rank": 0, "level": "warning", "delivered": True}]
    assert _json(cli, "run-1", "SELECT * FROM incidents") == []
    write_shard(cli_root / "proj" / "run-1" / "incidents.jsonl", [
        {"kind": "straggler", "ranks": [6], "hosts": ["node-1"], "step": 36, "first_seen": 1.0,
         "last_seen": 2.0, "detail": {"ratio": 1.6}, "state": "open", "delivered": True}])
    rows = _json(cli, "run-1", "SELECT kind, ranks, detail.ratio AS ratio FROM incidents")
    # a JSON value comes out as the value (it was its text: "1.6")
    assert rows == [{"kind": "straggler", "ranks": [6], "ratio": 1.6}]


def test_a_json_column_prints_its_value_not_its_text(cli, cli_root):
    """`incidents.detail` is JSON (a watcher writes text there, others may write objects):
    `--json` gave the text of a JSON string, "\\"rank 6 ...\\"", and the table and CSV
    showed it in quotes."""
    write_shard(cli_root / "proj" / "run-1" / "incidents.jsonl", [
        {"kind": "straggler", "ranks": [6], "hosts": ["node-1"], "step": 36, "first_seen": 1.0,
         "last_seen": 2.0, "detail": "rank 6 is 1.6x the median", "state": "open",
         "delivered": True},
        {"kind": "hang", "ranks": [2], "hosts": ["node-0"], "step": 30, "first_seen": 1.0,
         "last_seen": 2.0, "detail": {"ratio": 1.6}, "state": "open", "delivered": True}])
    sql = "SELECT kind, detail FROM incidents ORDER BY kind DESC"
    assert _json(cli, "run-1", sql) == [
        {"kind": "straggler", "detail": "rank 6 is 1.6x the median"},
        {"kind": "hang", "detail": {"ratio": 1.6}}]
    rows = list(csv.reader(io.StringIO(cli("query", "run-1", sql, "--csv").stdout)))
    assert rows == [["kind", "detail"], ["straggler", "rank 6 is 1.6x the median"],
                    ["hang", '{"ratio": 1.6}']]
    table = cli("query", "run-1", sql).stdout
    assert "straggler  rank 6 is 1.6x the median" in table and '"rank 6' not in table
    assert 'hang       {"ratio": 1.6}' in table


def test_table_and_csv_output(cli):
    result = cli("query", "run-1", "SELECT _rank, max(loss) AS worst FROM metrics GROUP BY 1 ORDER BY 1")
    assert result.exit_code == 0, result.output
    assert "worst" in result.stdout and "8 rows" in result.stdout
    result = cli("query", "run-1", "SELECT _step, loss FROM metrics WHERE _rank = 2 ORDER BY 1 LIMIT 2",
                 "--csv")
    assert list(csv.reader(io.StringIO(result.stdout))) == [["_step", "loss"], ["0", "2.02"], ["1", "1.02"]]


@pytest.mark.parametrize(("sql", "message"), [
    ("SELEC 1", "Parser Error"),
    ("SELECT nope FROM metrics", "Binder Error"),
    ("COPY (SELECT 1) TO 'out.csv'", "only SELECT queries run here (read-only), not COPY"),
    ("ATTACH 'out.db' AS o", "not ATTACH"),
    ("SELECT 1; CREATE TABLE t AS SELECT 1", "expected one SQL statement, got 2"),
    ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
    ("SELECT * FROM read_text('{run}/metrics.meta.json')", "Permission Error"),
])
def test_bad_or_writing_sql_is_one_line_and_writes_nothing(cli, cli_root, tmp_path, sql, message):
    run = cli_root / "proj" / "run-1"
    before = sorted(p.name for p in run.iterdir())
    result = cli("query", "run-1", sql.format(run=run))
    assert result.exit_code == 1
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert not list(tmp_path.glob("out.*")) and sorted(p.name for p in run.iterdir()) == before


def test_duckdb_itself_refuses_other_files_and_run_query_refuses_the_rest(cli_root, tmp_path):
    import duckdb

    run = cli_root / "proj" / "run-1"
    shard = (run / "metrics.jsonl").read_bytes()
    with connect(run) as con:
        for sql in (f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'", f"ATTACH '{tmp_path / 'x.db'}'",
                    "SELECT * FROM read_csv('/etc/passwd')", "INSTALL httpfs"):
            with pytest.raises(duckdb.PermissionException):
                con.execute(sql)
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET enable_external_access = true")
        # DuckDB may write the files it may read: only the statement check stops these
        into_shard = f"COPY (SELECT 1) TO '{run / 'metrics.jsonl'}' (FORMAT csv, USE_TMP_FILE false)"
        for sql in (into_shard, "EXPLAIN ANALYZE " + into_shard,
                    f"SELECT * FROM query({literal(into_shard)})"):
            with pytest.raises(QueryError):
                run_query(con, sql)
    assert not list(tmp_path.glob("x.*"))
    assert (run / "metrics.jsonl").read_bytes() == shard


def test_missing_duckdb_names_the_extra(cli_root):
    proc = _blocked("duckdb", "query", str(cli_root / "proj" / "run-1"), "SELECT 1")
    assert proc.returncode == 1
    assert proc.stderr == "error: expr query needs DuckDB: pip install 'expr-tracker[query]'\n"


def test_a_metric_that_is_only_infinity_is_a_double(cli, tmp_path):
    """Before: DuckDB read a key whose every value is "Infinity" as DATE (9999-12-31)."""
    import expr_tracker as et

    et.init("p", "inf", dir=tmp_path)
    for s in range(3):
        et.log({"up": float("inf"), "down": float("-inf") if s else float("inf"),
                "gone": float("nan")})
    et.finish()
    run = tmp_path / "p" / "inf"
    assert b'"up":"Infinity"' in (run / "metrics.jsonl").read_bytes()
    rows = _json(cli, str(run), "SELECT typeof(up) AS t, typeof(down) AS d, up, down, gone, "
                 "up > 1e308 AS big FROM metrics ORDER BY _step")
    assert rows[0] == {"t": "DOUBLE", "d": "DOUBLE", "up": "Infinity", "down": "Infinity",
                       "gone": "NaN", "big": True}
    assert [r["down"] for r in rows] == ["Infinity", "-Infinity", "-Infinity"]


def test_a_query_is_stopped_at_timeout_and_at_its_memory_limit(cli):
    """Before: no bound; a runaway query ran (and grew) until killed."""
    long = "SELECT count(*) AS n FROM range(100000000000) AS a"
    res = cli("query", "run-1", long, "--timeout", "0.5")
    assert res.exit_code == 1
    assert res.stderr == "error: the query ran longer than --timeout 0.5 s and was stopped\n"
    big = "SELECT list(range) AS l FROM range(200000000)"
    res = cli("query", "run-1", big, "--memory", "64MB")
    assert res.exit_code == 1
    assert res.stderr.startswith("error: the query needs more memory than --memory 64MB "
                                 "(Out of Memory Error"), res.stderr
    assert res.stderr.count("\n") == 1
    for bad in ("lots", "0GB", "150%"):
        res = cli("query", "run-1", "SELECT 1", "--memory", bad)
        assert res.exit_code == 2 and "--memory: memory limit" in res.stderr, res.stderr
    res = cli("query", "run-1", "SELECT 1", "--timeout", "0")
    assert res.exit_code == 2 and "--timeout must be a positive" in res.stderr
    # a query within both limits answers as before
    assert _json(cli, "run-1", "SELECT current_setting('memory_limit') IS NOT NULL AS ok",
                 "--memory", "1GB", "--timeout", "30") == [{"ok": True}]
