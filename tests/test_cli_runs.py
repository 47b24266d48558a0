"""`expr runs`: projects and runs under the run root."""

from __future__ import annotations

import json


def test_runs_table(cli):
    result = cli("runs")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["run", "ranks", "streams", "last", "step", "status", "last", "write"]
    row = next(line for line in lines if line.startswith("proj/run-1 ")).split()
    assert row == ["proj/run-1", "0-7", "(default),", "data", "39", "running", "2h", "ago"]
    assert any(line.split()[:1] == ["other/run-3"] for line in lines)


def test_a_long_run_name_folds_and_the_other_columns_stay_whole(cli, tmp_path):
    """At 80 columns a 43-character name folds in its column; before, the others were
    cut to "p…", "r…" and "…". Without a stream besides the default, no streams column."""
    import expr_tracker as et

    name = "rules-run-with-a-rather-long-name-for-width"
    # a root named relative to the test's directory (its cwd): "runs under ROOT" is as long
    # under pytest-xdist's deeper tmp_path (.../popen-gw3/...) as without it
    et.init("al", name, dir="r", system_metrics=False)
    et.log({"loss": 1.0})
    et.finish()
    result = cli("runs", "--dir", "r", COLUMNS="80")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), result.stdout
    assert lines[1].split() == ["run", "ranks", "last", "step", "status", "last", "write"]
    row = lines[3].split()
    assert row[1:4] == ["0", "0", "finished"] and "…" not in result.stdout
    assert "".join(line.split()[0] for line in lines[3:]) == f"al/{name}"


def test_runs_json(cli, cli_root):
    rows = json.loads(cli("runs", "--json").stdout)
    by = {(r["project"], r["name"]): r for r in rows}
    assert set(by) == {("other", "run-3"), ("proj", "run-1"), ("proj", "run-2"), ("proj", "zero")}
    run1 = by[("proj", "run-1")]
    assert run1["ranks"] == list(range(8)) and run1["streams"] == [None, "data"]
    assert run1["shards"] == 9 and run1["last_step"] == 39 and run1["status"] == "running"
    assert run1["path"] == str(cli_root / "proj" / "run-1")


def test_runs_with_dir_option(cli, tmp_path):
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    result = cli("runs", "--dir", str(empty))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"no runs under {empty}\n"


def test_runs_without_a_root(cli, tmp_path):
    result = cli("runs", "--dir", str(tmp_path / "nowhere"))
    assert result.exit_code == 1
    assert result.stderr == f"error: no run root at {tmp_path / 'nowhere'} (set --dir or $EXPR_DIR)\n"


def test_runs_of_many_shards_read_in_worker_processes_agree(cli, monkeypatch):
    """The shards of a big run are inspected in worker processes too: the same answer."""
    from expr_cli.data import runs

    alone = json.loads(cli("runs", "--json").stdout)
    monkeypatch.setattr(runs, "PARALLEL_SHARDS", 1)
    assert json.loads(cli("runs", "--json").stdout) == alone
