"""RUN arguments: run directory, shard file, project/name, bare name; ambiguity and typos."""

from __future__ import annotations

import json

from tests.conftest import T0, write_shard


def _steps(result):
    assert result.exit_code == 0, result.output
    return [r["_step"] for r in json.loads(result.stdout)]


def test_every_spelling_of_a_run_reads_the_same_shard(cli, cli_root):
    run = cli_root / "proj" / "run-1"
    spellings = ["run-1", "proj/run-1", str(run), str(run / "metrics.jsonl"), str(run) + "/"]
    results = {s: _steps(cli("history", s, "-n", "2", "--json")) for s in spellings}
    assert set(map(tuple, results.values())) == {(38, 39)}


def test_relative_run_directory(cli, cli_root, monkeypatch):
    monkeypatch.chdir(cli_root / "proj")
    assert _steps(cli("history", "run-1", "-n", "1", "--json")) == [39]
    assert _steps(cli("history", "./run-1", "-n", "1", "--json")) == [39]


def test_default_root_is_tracker_jsonl_under_the_working_directory(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    write_shard(tmp_path / "tracker" / "jsonl" / "p" / "r" / "metrics.jsonl",
                [{"_step": 7, "_time": T0, "x": 1}])
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app(), ["history", "r", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["_step"] == 7


def test_ambiguous_bare_name_lists_the_candidates(cli, cli_root):
    write_shard(cli_root / "other" / "run-1" / "metrics.jsonl", [{"_step": 0, "_time": T0, "x": 1}])
    result = cli("history", "run-1")
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: run name 'run-1' is ambiguous under {cli_root}: other/run-1, proj/run-1; "
        "use project/name\n"
    )
    assert _steps(cli("history", "other/run-1", "--json")) == [0]


def test_unknown_run_suggests_the_closest_names(cli, cli_root):
    result = cli("summary", "run1")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: no run 'run1' under {cli_root}; did you mean proj/run-1")


def test_unknown_run_with_nothing_close_lists_runs(cli, cli_root):
    result = cli("shards", "zzzzzzzz")
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: no run 'zzzzzzzz' under {cli_root}; runs there: other/run-3, proj/run-1, "
        "proj/run-2, proj/zero\n"
    )


def test_no_runs_at_all(cli, tmp_path):
    result = cli("history", "x", "--dir", str(tmp_path / "none"))
    assert result.exit_code == 1
    assert result.stderr == f"error: no run 'x': no runs under {tmp_path / 'none'} (set --dir or $EXPR_DIR)\n"


def test_project_directory_is_not_a_run(cli, cli_root):
    result = cli("history", str(cli_root / "proj"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {cli_root / 'proj'} is a project directory; its runs: run-1")


def test_a_file_that_is_not_a_shard(cli, cli_root):
    result = cli("history", str(cli_root / "proj" / "run-1" / "metrics.meta.json"))
    assert result.exit_code == 1
    assert "is not a shard file" in result.stderr


def test_ranks_phrase_agrees_with_the_list():
    from expr_cli.resolve import ranks_phrase

    assert ranks_phrase([3]) == "rank 3"
    assert ranks_phrase([0, 1, 2, 5]) == "ranks 0-2,5"
