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
from tests.chserver import PASSWORD, ClickHouse

# one worker runs every ClickHouse test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("clickhouse")


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
        # the docs' example run (docs/backends.md): two ranks of llama/sft-1, diverging on rank 1
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
    assert res.exit_code == 2 and "not 'DROP'" in res.stderr  # the CLI's check
    # a SELECT that tries to lift the server's own readonly=1
    res = _invoke("--store", store.url, "SELECT 1 SETTINGS readonly = 0")
    assert res.exit_code == 1
    assert res.stderr.startswith("error: the team store refused the query")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output
    assert store.count("SELECT count() FROM team.metrics") == 12


def test_usage_and_unreachable_errors(tmp_path: Path) -> None:
    res = _invoke("--store", "ch:8123", "SELECT 1")
    assert res.exit_code == 2 and "--store must start with http" in res.stderr
    res = _invoke("--store", "http://127.0.0.1:9", "SELECT 1")
    assert res.exit_code == 1
    assert res.stderr == "error: cannot reach the team store at http://127.0.0.1:9: ConnectError\n"
    res = _invoke("--store", "http://127.0.0.1:9", "--json", "--csv", "SELECT 1")
    assert res.exit_code == 2


@pytest.mark.parametrize(("url", "message"), [
    ("http://[::1", "--store 'http://[::1' is not a valid URL"),
    ("http://ch:8123/?user=reader&password=x", "must not hold credentials (?password=, ?user=)"),
    ("http://reader:x@ch:8123", "must not hold credentials (user:password@)"),
])
def test_a_bad_store_url_is_one_usage_line(url: str, message: str) -> None:
    res = _invoke("--store", url, "SELECT 1")
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert "--user-env/--password-env" in res.stderr or "valid URL" in res.stderr


# the user this very query runs as (the server predates currentUser())
WHOAMI = "SELECT user AS u FROM system.processes WHERE query LIKE '%whoami-marker%'"


def test_a_named_user_variable_must_be_set(store: ClickHouse) -> None:
    """Before: --user-env naming an unset variable answered as the `default` user."""
    res = CliRunner().invoke(build_app(), ["query", "--store", store.url, "--user-env",
                                           "TEAM_UNSET_USER", WHOAMI])
    assert res.exit_code == 2
    assert res.stderr == ("error: --user-env names TEAM_UNSET_USER, which is not set in the "
                          "environment\n")
    res = CliRunner().invoke(build_app(), ["query", "--store", store.url, "--user-env", "U",
                                           "--password-env", "P", "--json",
                                           WHOAMI],
                             env={"U": "reader", "P": PASSWORD})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [{"u": "reader"}]


def _docs_queries() -> list[str]:
    """The example queries of "Queries across runs" in docs/backends.md (the team store)."""
    text = (Path(__file__).parent.parent / "docs" / "backends.md").read_text()
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


def test_the_docs_queries_run(store: ClickHouse) -> None:
    commands = _docs_queries()
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


# -- read-only means one read statement (issue 20, item 4) --------------------------------


@pytest.mark.parametrize("sql", [
    "SELECT ';' AS x",
    "SELECT 1 AS x -- ; KILL QUERY WHERE 1",
    "/* KILL QUERY WHERE 1; */ SELECT 'a;b' AS x ;",
    "select 'it\\'s; fine' AS x",
    "SELECT 'doubled '' ; quote' AS x",
    'SELECT 1 AS "semi;colon"',
    "SELECT 1 AS `back;tick`",
    "WITH 2 AS y SELECT y AS x",
    "(SELECT 1 AS x)",
    "SHOW TABLES FROM team",
    "DESC team.metrics",
    "DESCRIBE TABLE team.runs",
])
def test_one_read_statement_runs_whatever_its_strings_and_comments_hold(
        store: ClickHouse, sql: str) -> None:
    res = _invoke("--store", store.url, "--json", sql)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)


@pytest.mark.parametrize(("sql", "message"), [
    ("KILL QUERY WHERE 1", "not 'KILL'"),
    ("SYSTEM DROP DNS CACHE", "not 'SYSTEM'"),
    ("OPTIMIZE TABLE team.metrics FINAL", "not 'OPTIMIZE'"),
    ("SET readonly = 0", "not 'SET'"),
    ("  /* a comment */ kill query where 1", "not 'kill'"),
    ("(KILL QUERY WHERE 1)", "not 'KILL'"),
    ("SELECT 1; KILL QUERY WHERE 1", "one statement only"),
    ("SELECT 1;SELECT 2;", "one statement only"),
    ("SELECT 'a;' ; -- the rest\n DROP TABLE team.metrics", "one statement only"),
    ("SELECT 'unterminated; KILL QUERY WHERE 1", "unterminated string literal"),
    ("/* /* */ KILL QUERY WHERE 1 */ SELECT 1", "nested /* comments"),
    ("SELECT 1 # KILL", "# comments"),
    ("  ;  -- nothing", "SQL is empty"),
])
def test_anything_else_is_refused_in_one_line_before_it_reaches_the_server(
        store: ClickHouse, sql: str, message: str) -> None:
    res = _invoke("--store", store.url, sql)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_kill_query_cannot_cancel_another_clients_query(store: ClickHouse) -> None:
    """`readonly=1` lets KILL QUERY through: a long query of another client survives."""
    import threading
    import urllib.parse
    import urllib.request

    params = urllib.parse.urlencode({"query_id": "victim", "max_execution_time": "20"})
    answer: list[str] = []

    def victim() -> None:
        req = urllib.request.Request(f"{store.url}/?{params}", method="POST",
                                     data=b"SELECT count() FROM system.numbers")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                answer.append(resp.read().decode())
        except OSError as exc:
            answer.append(f"ended: {exc}")

    thread = threading.Thread(target=victim)
    thread.start()
    try:
        running = "SELECT count() FROM system.processes WHERE query_id = 'victim'"
        deadline = time.monotonic() + 10
        while store.count(running) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.count(running) == 1
        res = _invoke("--store", store.url, "KILL QUERY WHERE query_id = 'victim' SYNC")
        assert res.exit_code == 2 and "not 'KILL'" in res.stderr
        time.sleep(0.3)
        assert store.count(running) == 1 and not answer
    finally:
        store.query("KILL QUERY WHERE query_id = 'victim' SYNC")
        thread.join(30)


# -- a readonly=1 user (issue 20, item 5) -------------------------------------------------


def test_a_readonly_user_reads_64_bit_integers_and_floats(store: ClickHouse) -> None:
    env = {"COLUMNS": "100", "CLICKHOUSE_USER": "reader", "CLICKHOUSE_PASSWORD": PASSWORD}
    app = build_app()
    sql = ("SELECT rank, step, value, toUInt64(18446744073709551615) AS big, [toInt64(-5)] AS arr"
           " FROM team.metrics FINAL WHERE key = 'gn' ORDER BY rank, step")
    res = CliRunner().invoke(app, ["query", "--store", store.url, "--json", sql], env=env)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows[0] == {"rank": 0, "step": 0, "value": 0.5, "big": 2**64 - 1, "arr": [-5]}
    # a readonly=1 user may not ask for quoted NaN: the server's JSON says null
    assert rows[2]["value"] is None and len(rows) == 6
    res = CliRunner().invoke(app, ["query", "--store", store.url, "--csv",
                                   "SELECT count() AS n, max(step) AS last FROM team.metrics"],
                             env=env)
    assert res.exit_code == 0, res.output
    assert res.stdout == "n,last\n12,2\n"
    # the server still refuses a write for this user (here the CLI does first)
    res = CliRunner().invoke(app, ["query", "--store", store.url, "DROP TABLE team.metrics"],
                             env=env)
    assert res.exit_code == 2 and store.count("SELECT count() FROM team.metrics") == 12
    res = CliRunner().invoke(app, ["query", "--store", store.url, "SELECT 1"],
                             env={**env, "CLICKHOUSE_PASSWORD": "wrong"})
    assert res.exit_code == 1 and "the team store refused the query (HTTP" in res.stderr
