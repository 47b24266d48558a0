"""`expr export`: parquet, CSV and JSONL with every row of every rank; bad input is one line."""

from __future__ import annotations

import collections
import csv
import json
import math
import subprocess
import sys

import pytest


def _blocked(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `expr` in a process where `module` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv = ['expr', *{list(args)!r}]; "
            "from expr_cli.main import entry; entry()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_parquet_holds_every_row_of_every_rank(cli, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "run-1.parquet"
    result = cli("export", "run-1", "--format", "parquet", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "wrote 323 rows" in result.stdout
    table = pq.read_table(out)
    assert table.column_names == ["_rank", "_stream", "_step", "_time", "loss", "lr", "tokens", "source"]
    assert table.num_rows == 8 * 40 + 3
    per_rank = collections.Counter(zip(table["_rank"].to_pylist(), table["_stream"].to_pylist(), strict=True))
    assert per_rank == {**{(r, None): 40 for r in range(8)}, (0, "data"): 3}
    assert table.schema.field("loss").type == "double" and table.schema.field("tokens").type == "int64"
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed into place


def test_csv_rank_records_read_back_with_the_csv_module(cli, tmp_path):
    out = tmp_path / "ranks.csv"
    result = cli("export", "run-1", "--rank-records", "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == 8 * 40 - 2
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 318 and list(rows[0])[:7] == [
        "_rank", "_stream", "_step", "_time", "_world_size", "_local_rank", "_weight"]
    assert {int(r["_rank"]) for r in rows} == set(range(8))
    nan = [r for r in rows if r["_rank"] == "5" and r["_step"] == "39"]
    assert math.isnan(float(nan[0]["grad_norm"]))


def test_jsonl_of_one_stream(cli, tmp_path):
    out = tmp_path / "data.jsonl"
    result = cli("export", "run-1", "--stream", "data", "-o", str(out))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [4096, 8192, 12288] and rows[0]["_stream"] == "data"


@pytest.mark.parametrize(("args", "code", "message"), [
    (["-o", "x.txt"], 2, "cannot tell the format from 'x.txt'"),
    (["-o", "{run}/out.csv"], 1, "is inside the run directory"),
    (["-o", "exists.csv"], 1, "exists.csv exists; pass --force"),
    (["-o", "nodir/x.csv"], 1, "does not exist"),
    (["--stream", "nope", "-o", "x.csv"], 1, "has no shards of stream nope"),
])
def test_bad_export_is_one_line(cli, cli_root, tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exists.csv").write_text("keep")
    args = [a.format(run=cli_root / "proj" / "run-1") for a in args]
    result = cli("export", "run-1", *args)
    assert result.exit_code == code
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert (tmp_path / "exists.csv").read_text() == "keep"
    assert not (cli_root / "proj" / "run-1" / "out.csv").exists()


def test_missing_pyarrow_names_the_extra(cli_root, tmp_path):
    out = tmp_path / "x.parquet"
    proc = _blocked("pyarrow", "export", str(cli_root / "proj" / "run-1"), "-o", str(out))
    assert proc.returncode == 1
    assert proc.stderr == "error: expr export needs pyarrow: pip install 'expr-tracker[export]'\n"
    assert not out.exists()


def test_the_note_counts_one_shard_and_one_row_in_the_singular(cli, tmp_path):
    import expr_tracker as et

    et.init("p", "one", dir=tmp_path, system_metrics=False)
    et.log({"loss": 1.0})
    et.finish()
    result = cli("export", "p/one", "--dir", str(tmp_path), "--out", str(tmp_path / "one.csv"))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote 1 row of p/one (1 shard, 1 rank) to {tmp_path / 'one.csv'} (csv)\n"
