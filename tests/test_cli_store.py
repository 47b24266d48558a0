"""`expr query --store URL "SQL"`: read-only SQL on the team store, against a real ClickHouse."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expr_cli.main import build_app
from expr_tracker.backends.base import Identity
from expr_tracker.backends.clickhouse import ClickHouseBackend
from tests.chserver import ClickHouse


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    """A server holding two ranks x 3 steps of one run in database `team`."""
    ch = ClickHouse(tmp_path_factory.mktemp("clickhouse"))
    ch.start()
    try:
        for rank in range(2):
            b = ClickHouseBackend(url=ch.url, database="team")
            b.open(Identity("proj", "sft-1", rank=rank, world_size=2, session=f"s{rank}"))
            b.log([{"_step": s, "_time": 1.0 + s, "_id": f"s{rank}:{s}", "loss": 1.0 / (s + 1),
                    "gn": float("nan") if s == 2 else 0.5} for s in range(3)])
            b.finish("finished")
        # the README's example run: two ranks of llama/sft-1, diverging on rank 1
        now = time.time()
        for rank in range(2):
            b = ClickHouseBackend(url=ch.url)
            b.open(Identity("llama", "sft-1", rank=rank, world_size=2, session=f"r{rank}",
                            config={"cluster": "east"}))
            b.log([{"_step": s, "_time": now - 100 + s, "_id": f"r{rank}:{s}",
                    "train/loss": float("nan") if (rank, s) == (1, 3) else 2.0 / (s + 1)}
                   for s in range(5)])
            b.log([{"_kind": "rank", "_rank": rank, "_world_size": 2, "_local_rank": rank,
                    "_weight": 1.0, "_step": s, "_time": now - 100 + s, "_id": f"r{rank}:{5 + s}",
                    "step_time": 0.1 * (rank + 1)} for s in range(5)])
            b.finish("finished")
        yield ch
    finally:
        ch.stop()


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(build_app(), ["query", *args], env={"COLUMNS": "100"})


SQL = ("SELECT rank, step, value FROM team.metrics FINAL WHERE key = '{key}' "
       "ORDER BY rank, step")


def test_json_csv_and_table_as_for_the_local_views(store: ClickHouse) -> None:
    res = _invoke("--store", store.url, "--json", SQL.format(key="loss"))
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)  # a JSON array, as `expr query RUN SQL --json` prints
    assert rows[:2] == [{"rank": 0, "step": 0, "value": 1.0}, {"rank": 0, "step": 1, "value": 0.5}]
    assert len(rows) == 6
    res = _invoke("--store", store.url, "--json", SQL.format(key="gn"))
    assert [row["value"] for row in json.loads(res.stdout)][2] == "NaN"
    res = _invoke("--store", store.url, "--csv", SQL.format(key="loss") + " LIMIT 2")
    assert res.exit_code == 0, res.output
    assert res.stdout == "rank,step,value\n0,0,1\n0,1,0.5\n"
    res = _invoke("--store", store.url,
                  "SELECT rank, status FROM team.runs FINAL ORDER BY rank")
    assert res.exit_code == 0, res.output
    assert "2 rows" in res.stdout and "finished" in res.stdout and "rank" in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80


def test_writes_are_refused_by_the_server_in_one_line(store: ClickHouse) -> None:
    res = _invoke("--store", store.url, "DROP TABLE team.metrics")
    assert res.exit_code == 1
    assert res.stderr.startswith("error: the team store refused the query")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output
    assert store.count("SELECT count() FROM team.metrics") == 12


def test_usage_and_unreachable_errors(tmp_path: Path) -> None:
    res = _invoke("--store", "ch:8123", "SELECT 1")
    assert res.exit_code == 2 and "--store must be an http" in res.stderr
    res = _invoke("--store", "http://127.0.0.1:9", "SELECT 1")
    assert res.exit_code == 1
    assert res.stderr == "error: cannot reach the team store at http://127.0.0.1:9: ConnectError\n"
    res = _invoke("--store", "http://127.0.0.1:9", "--json", "--csv", "SELECT 1")
    assert res.exit_code == 2


def _readme_queries() -> list[str]:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = text[text.index("**Queries across runs**"):]
    block = block[block.index("```sh\n") + 6 : block.index("```\n", block.index("```sh"))]
    lines = [line for line in block.splitlines() if not line.startswith("#")]
    commands: list[str] = []
    for line in lines:
        if line.startswith("expr "):
            commands.append(line)
        else:
            commands[-1] += "\n" + line
    return commands


def test_the_readme_queries_run(store: ClickHouse) -> None:
    commands = _readme_queries()
    assert len(commands) == 3
    answers = []
    for command in commands:
        args = shlex.split(command)[1:]
        args[args.index("--store") + 1] = store.url
        res = CliRunner().invoke(build_app(), args, env={"COLUMNS": "100"})
        assert res.exit_code == 0, f"{command}\n{res.output}"
        answers.append(res.stdout)
    assert "sft-1" in answers[0] and "3" in answers[0]
    assert json.loads(answers[1])[0]["cluster"] == "east"
    assert answers[2].splitlines()[:2] == ["rank,steps,mean_step_time", "1,5,0.2"]
