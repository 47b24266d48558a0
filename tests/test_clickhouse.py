"""The team store (issue 15): the clickhouse backend against a real ClickHouse server.

Every test that talks to ClickHouse starts Debian's `clickhouse-server` itself (tests/
chserver.py) on a free 127.0.0.1 port and skips, naming the reason, when it is not
installed. One server serves the module (each test uses its own database); the test that
stops and restarts the server mid-run has its own.
"""

from __future__ import annotations

import json
import logging
import math
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import expr_tracker as et
from expr_tracker.backends.base import Identity, reports_on_rank
from expr_tracker.backends.clickhouse import ClickHouseBackend, schema
from expr_tracker.backends.registry import make_backend
from tests.chserver import PASSWORD, ClickHouse
from tests.procs import env_for, run_all, spawn
from tests.test_daemon import (
    EXPRD,
    exprd_once,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)

# one worker runs every ClickHouse test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("clickhouse")

_SEQ = iter(range(1_000_000))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    """One ClickHouse server for the module, stopped by pid at the end."""
    ch = ClickHouse(tmp_path_factory.mktemp("clickhouse"))
    ch.start()
    try:
        yield ch
    finally:
        ch.stop()


@pytest.fixture
def db() -> str:
    """A database name of this test's own."""
    return f"t{next(_SEQ)}_{random.randrange(1 << 30)}"


def _spec(server: ClickHouse, db: str, **extra: Any) -> dict[str, Any]:
    return {"type": "clickhouse", "url": server.url, "database": db, **extra}


def _daemon_backend(server: ClickHouse, db: str, extra: str = "") -> str:
    return (f'[backends.clickhouse]\ntype = "clickhouse"\nurl = {json.dumps(server.url)}\n'
            f'database = "{db}"\nbatch = 200\nbackoff = 0.05\n{extra}')


def _writer(spool: Path, root: Path, name: str, n: int, *, stream: str | None = None,
            chunk: int = 100, pause: float = 0.0) -> str:
    """A spool-mode rank: n steps of 2 values and one rank metric per step."""
    return f"""
        import time, expr_tracker as et
        run = et.init("proj", {name!r}, dir={str(root)!r}, upload_mode="spool",
                      spool_dir={str(spool)!r}, stream={stream!r},
                      backends=[{{"type": "clickhouse", "url": "http://127.0.0.1:9"}}])
        for c in range({n} // {chunk}):
            for i in range({chunk}):
                k = c * {chunk} + i
                et.log({{"loss": 1.0 / (k + 1), "k": k}})
                run.log_rank_metrics({{"step_time": 0.1 + k * 1e-4}}, step=k)
            et.flush()
            time.sleep({pause})
        et.finish()
    """


# -- configuration and rank selection (no server) -----------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "clickhouse"}, "url is required"),
        ({"type": "clickhouse", "url": "ch:8123"}, "url must start with http"),
        ({"type": "clickhouse", "url": "http://u:p@ch:8123"}, "must not hold credentials"),
        ({"type": "clickhouse", "url": "http://ch:8123/?user=u&password=p"},
         r"must not hold credentials \(\?password=, \?user=\)"),
        ({"type": "clickhouse", "url": "http://ch:8123?database=x&PASSWORD=p"},
         "must not hold credentials"),
        ({"type": "clickhouse", "url": "http://[::1"}, "is not a valid URL"),
        ({"type": "clickhouse", "url": "http://ch:99999"}, "is not a valid URL"),
        ({"type": "clickhouse", "url": "http:///x"}, "has no host"),
        ({"type": "clickhouse", "url": "http://ch", "database": "a-b"}, "database 'a-b'"),
        ({"type": "clickhouse", "url": "http://ch", "database": "x;DROP"}, "database"),
        ({"type": "clickhouse", "url": "http://ch", "password": "x"}, "unknown key 'password'"),
        ({"type": "clickhouse", "url": "http://ch", "user_env": "A B"}, "user_env 'A B'"),
        ({"type": "clickhouse", "url": "http://ch", "create": "yes"}, "create must be true"),
        ({"type": "clickhouse", "url": "http://ch", "batch": 0}, "batch must be an integer"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_backend(spec)


def test_a_named_credentials_variable_must_be_set_where_the_process_connects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an unset user_env connected silently as the server's `default` user."""
    monkeypatch.delenv("TEAM_CH_USER", raising=False)
    spec = {"type": "clickhouse", "url": "http://127.0.0.1:9", "user_env": "TEAM_CH_USER"}
    with pytest.raises(ValueError, match="user_env names TEAM_CH_USER, which is not set"):
        et.init("proj", "noenv", dir=tmp_path, backends=[spec])
    assert not (tmp_path / "proj" / "noenv").exists()
    # not named: the default variables are optional, as before
    et.init("proj", "default-user", dir=tmp_path, backends=[{"type": "clickhouse",
            "url": "http://127.0.0.1:9", "retries": 0, "exit_timeout": 0.2}])
    et.finish()
    # exprd checks its own environment at start, naming the table and the variable
    spool, state = tmp_path / "spool", tmp_path / "state"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [tmp_path / "runs"],
                       extra='[backends.team]\ntype = "clickhouse"\nurl = "http://127.0.0.1:9"\n'
                             'password_env = "TEAM_CH_PASSWORD_UNSET"\n')
    proc = subprocess.run([*EXPRD, "--config", str(cfg), "--once"],
                          env=env_for(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "backends.team" in proc.stderr and "TEAM_CH_PASSWORD_UNSET" in proc.stderr, proc.stderr


def test_spec_builds_the_backend_without_touching_the_network() -> None:
    b = make_backend({"type": "clickhouse", "url": "http://127.0.0.1:9", "database": "team",
                      "create": False, "batch": 10, "retries": 1})
    assert isinstance(b, ClickHouseBackend)
    assert (b.database, b.create, b.batch, b.retries) == ("team", False, 10, 1)
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, expr_tracker.backends.registry as r\n"
                           "r.make_backend({'type': 'clickhouse', 'url': 'http://h'})\n"
                           "assert 'httpx' not in sys.modules"], env=env_for(), timeout=60)
    assert proc.returncode == 0


def test_reporting_ranks_default_per_backend_and_backend_on_rank_overrides() -> None:
    # "auto": the team store hears every rank, wandb/trackio/http only rank 0
    assert [reports_on_rank("auto", r, True) for r in range(3)] == [True, True, True]
    assert [reports_on_rank("auto", r, False) for r in range(3)] == [True, False, False]
    assert [reports_on_rank(0, r, True) for r in range(3)] == [True, False, False]
    assert [reports_on_rank(2, r, False) for r in range(3)] == [False, False, True]
    assert [reports_on_rank(None, r, False) for r in range(3)] == [True, True, True]
    with pytest.raises(ValueError, match="backend_on_rank"):
        et.init("proj", "x", backend_on_rank="some")  # type: ignore[arg-type]


def test_schema_is_the_documented_one() -> None:
    stmts = schema("expr")
    assert stmts[0] == "CREATE DATABASE IF NOT EXISTS `expr`"
    metrics = next(s for s in stmts if ".metrics (" in s)
    assert "value Float64" in metrics and "ReplacingMergeTree" in metrics
    assert "ORDER BY (project, name, stream, rank, key, step, event_id)" in metrics
    assert {s.split("`expr`.")[1].split(" ")[0] for s in stmts[1:]} == {
        "metrics", "rank_metrics", "runs", "alerts", "incidents"}


# -- direct mode -----------------------------------------------------------------------


def test_direct_mode_every_rank_lands_with_values_text_and_nonfinite(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spec = json.dumps(_spec(server, db))
    code = f"""
        import expr_tracker as et
        run = et.init("proj", "direct", dir={str(tmp_path / 'runs')!r}, backends=[{spec}],
                      config={{"lr": 0.1}})
        for k in range(50):
            et.log({{"loss": 1.0 / (k + 1), "note": "warm" if k < 5 else "hot",
                     "ok": k % 2 == 0, "bad": float("nan") if k == 7 else float("inf"),
                     "none": None}})
            run.log_rank_metrics({{"step_time": 0.5}}, step=k, weight=2.0)
        et.alert("checkpoint", "saved", level="info")
        et.finish()
    """
    run_all([spawn(code, {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
             for r in range(2)])
    q = server.count
    # 4 values per step row (None skipped), every rank (the default for the team store)
    assert q(f"SELECT count() FROM {db}.metrics FINAL") == 2 * 50 * 4
    assert q(f"SELECT uniqExact(rank) FROM {db}.metrics") == 2
    assert q(f"SELECT count() FROM {db}.rank_metrics FINAL WHERE weight = 2 "
             "AND world_size = 2 AND local_rank = rank") == 2 * 50
    assert server.query(f"SELECT value, text FROM {db}.metrics WHERE key = 'note' AND rank = 1 "
                        "AND step = 9 FORMAT TSV") == "nan\thot\n"
    assert server.query(f"SELECT sum(value), uniqExact(text) FROM {db}.metrics "
                        "WHERE key = 'ok' AND rank = 0 FORMAT TSV") == "25\t2\n"
    assert q(f"SELECT countIf(isNaN(value)) FROM {db}.metrics WHERE key = 'bad'") == 2
    assert q(f"SELECT countIf(isInfinite(value) AND value > 0) FROM {db}.metrics "
             "WHERE key = 'bad'") == 2 * 49
    assert math.isclose(float(server.query(
        f"SELECT value FROM {db}.metrics WHERE key = 'loss' AND step = 3 AND rank = 0")), 0.25)
    runs = [json.loads(line) for line in server.query(
        f"SELECT rank, status, config, start_time, end_time FROM {db}.runs FINAL "
        "ORDER BY rank FORMAT JSONEachRow").splitlines()]
    assert [(r["rank"], r["status"], json.loads(r["config"])) for r in runs] == [
        (0, "finished", {"lr": 0.1}), (1, "finished", {"lr": 0.1})]
    assert all(0 < r["start_time"] <= r["end_time"] for r in runs)
    # the alert comes from the alerting rank only
    assert server.query(f"SELECT rank, title, level, kind FROM {db}.alerts FORMAT TSV") == \
        "0\tcheckpoint\tinfo\tmanual\n"


def test_backend_on_rank_still_overrides_the_default(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spec = json.dumps(_spec(server, db))
    code = f"""
        import expr_tracker as et
        et.init("proj", "r0", dir={str(tmp_path / 'runs')!r}, backends=[{spec}], backend_on_rank=0)
        for k in range(10):
            et.log({{"loss": k}})
        assert et.info()["reporting"] == (et.info()["rank"] == 0)
        et.finish()
    """
    run_all([spawn(code, {"RANK": str(r), "WORLD_SIZE": "3"}) for r in range(3)])
    assert server.query(f"SELECT rank, count() FROM {db}.metrics GROUP BY rank FORMAT TSV") == \
        "0\t10\n"


def test_credentials_come_from_the_environment_and_are_written_nowhere(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    run_all([spawn(_writer(spool, root, "cred", 20, chunk=10), {"RANK": "0", "WORLD_SIZE": "1"})])
    extra = 'user_env = "TEAM_CH_USER"\npassword_env = "TEAM_CH_PASSWORD"\n'
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra="retention = 0\n" + _daemon_backend(server, db, extra))
    # a wrong password is refused by the server: nothing stored, the spool keeps the data
    d = start_exprd(cfg, env={"TEAM_CH_USER": "writer", "TEAM_CH_PASSWORD": "wrong-password"})
    try:
        wait_ready(state, d)
        time.sleep(1.5)
        assert not _exists(server, db)
    finally:
        assert stop(d) == 0
    assert "code 516" in (tmp_path / "exprd.log").read_text() or "code 193" in (
        tmp_path / "exprd.log").read_text()
    d = start_exprd(cfg, env={"TEAM_CH_USER": "writer", "TEAM_CH_PASSWORD": PASSWORD})
    try:
        wait_ready(state, d)
        wait_for(lambda: server.count(f"SELECT count() FROM {db}.metrics FINAL") == 40
                 if _exists(server, db) else False, 30, "rows written as user writer")
    finally:
        assert stop(d) == 0
    assert server.count(f"SELECT count() FROM {db}.rank_metrics FINAL") == 20
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
            assert b"wrong-password" not in path.read_bytes(), path


def _exists(server: ClickHouse, db: str) -> bool:
    """The schema is complete (the backend creates it on its first send)."""
    return server.count(f"SELECT count() FROM system.tables WHERE database = '{db}'") == 5


def test_a_server_that_is_down_costs_bounded_retries_never_the_training_loop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = ClickHouseBackend(url="http://127.0.0.1:9", retries=2, backoff=0.01, timeout=0.5)
    backend.open(Identity("proj", "down"))
    with caplog.at_level(logging.WARNING, logger="expr_tracker.backends"):
        backend.log([{"_step": s, "_time": 1.0, "loss": 0.5} for s in range(5)])
        backend.finish("finished")
    values, errors = backend.counters.snapshot()
    assert values["failed"] == 5
    assert any("gave up after 3 attempts" in r.getMessage() for r in caplog.records)
    assert sum(n for cause, n in errors.items() if "ConnectError" in cause) >= 3
    # through the SDK: log() returns at once, finish() within its bound, info() counts it
    t0 = time.monotonic()
    et.init("proj", "down", dir=tmp_path, backends=[{"type": "clickhouse", "url":
            "http://127.0.0.1:9", "retries": 1, "backoff": 0.01, "timeout": 0.5}])
    for k in range(100):
        et.log({"loss": k})
    logged = time.monotonic() - t0
    et.flush()
    stats = et.info()["backends"]["clickhouse"]
    et.finish()
    assert logged < 2.0
    assert stats["dropped"] == 0
    assert (tmp_path / "proj" / "down" / "metrics.jsonl").read_bytes().count(b"\n") == 100


def test_http_500_is_retried_and_a_data_error_is_not(httpserver: Any) -> None:
    from werkzeug import Request, Response

    calls: list[str] = []

    def handler(request: Request) -> Response:
        sql = request.args.get("query", "")
        calls.append(sql)
        if sql.startswith("INSERT") and len([c for c in calls if c.startswith("INSERT")]) <= 2:
            return Response("Code: 241, e.displayText() = DB::Exception: Memory limit", 500)
        if "bad" in request.get_data(as_text=True):
            return Response("Code: 27, e.displayText() = DB::Exception: Cannot parse", 500)
        return Response("0\n" if sql.startswith("SELECT") else "")

    httpserver.expect_request("/").respond_with_handler(handler)
    backend = ClickHouseBackend(url=httpserver.url_for("/"), retries=3, backoff=0.01)
    backend.open(Identity("proj", "five", session="s1"))
    backend.log([{"_step": 0, "_time": 1.0, "_id": "s1:1", "loss": 1.0}])
    values, errors = backend.counters.snapshot()
    assert values["failed"] == 0
    inserts = [c for c in calls if c.startswith("INSERT")]
    assert inserts[-1] == ("INSERT INTO `expr`.metrics (project, name, stream, rank, step, time, "
                           "event_id, key, value, text) FORMAT TabSeparated")
    assert sum(errors.values()) == 2  # two 500s, retried, then acknowledged
    backend.log([{"_step": 1, "_time": 1.0, "_id": "s1:2", "bad": "bad"}])
    values, errors = backend.counters.snapshot()
    assert values["failed"] == 1
    assert any("code 27" in c for c in errors)
    n = len(calls)
    backend.finish("running")  # exprd stopping: no runs row for a live run
    assert len(calls) == n


# -- spool mode through exprd ------------------------------------------------------------


def test_spool_4_ranks_2_streams_through_exprd_and_replay_changes_nothing(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    n, ranks, streams = 300, 4, (None, "data")
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra=_daemon_backend(server, db))
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        run_all([spawn(_writer(spool, root, "team", n, stream=s, chunk=50, pause=0.02),
                       {"RANK": str(r), "WORLD_SIZE": str(ranks)})
                 for r in range(ranks) for s in streams])
        wait_for(lambda: _exists(server, db) and server.count(
            f"SELECT count() FROM {db}.runs FINAL WHERE status = 'finished'") == 8,
            60, "every shard session finished in runs")
    finally:
        assert stop(d) == 0
    q = server.count
    metrics = f"SELECT count() FROM {db}.metrics FINAL"
    ranked = f"SELECT count() FROM {db}.rank_metrics FINAL"
    assert q(metrics) == ranks * len(streams) * n * 2
    assert q(ranked) == ranks * len(streams) * n
    assert server.query(f"SELECT stream, rank, count() FROM {db}.metrics FINAL "
                        "GROUP BY stream, rank ORDER BY stream, rank FORMAT CSV") == "".join(
        f'"{s}",{r},{2 * n}\n' for s in ("", "data") for r in range(ranks))
    assert q(f"SELECT uniqExact(event_id) FROM {db}.metrics") == ranks * len(streams) * n
    # background merges would collapse the replayed duplicates at any moment: hold them
    server.query(f"SYSTEM STOP MERGES {db}.metrics")
    raw = q(f"SELECT count() FROM {db}.metrics")
    # expr replay of the same spool, with a state of its own: every event is sent again
    res = subprocess.run([sys.executable, "-m", "expr_cli.main", "replay", str(spool),
                          "--state", str(tmp_path / "replay-state"), "--config", str(cfg)],
                         capture_output=True, text=True, env=env_for(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert q(f"SELECT count() FROM {db}.metrics") > raw  # it did send them again
    assert q(metrics) == ranks * len(streams) * n * 2
    assert q(ranked) == ranks * len(streams) * n
    assert q(f"SELECT count() FROM {db}.runs FINAL") == 8
    server.query(f"SYSTEM START MERGES {db}.metrics")
    server.query(f"OPTIMIZE TABLE {db}.metrics FINAL")
    assert q(f"SELECT count() FROM {db}.metrics") == ranks * len(streams) * n * 2


def test_kill9_exprd_5_times_during_forwarding_every_event_once(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    writers, n, kills = 3, 2000, 5
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra="checkpoint_interval = 0.2\n" + _daemon_backend(server, db))
    rng = random.Random(15)
    procs: list[subprocess.Popen[str]] = []
    progress = []
    for _ in range(kills):
        d = start_exprd(cfg)
        wait_ready(state, d)
        if not procs:
            procs = [spawn(_writer(spool, root, "kill", n, chunk=50, pause=0.05),
                           {"RANK": str(r), "WORLD_SIZE": str(writers)})
                     for r in range(writers)]
        time.sleep(rng.uniform(0.3, 0.9))
        d.kill()  # SIGKILL: inserts in flight, queues lost, checkpoints maybe stale
        d.wait()
        progress.append(server.count(f"SELECT count() FROM {db}.metrics FINAL")
                        if _exists(server, db) else 0)
    run_all(procs)
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        wait_for(lambda: server.count(f"SELECT count() FROM {db}.runs FINAL "
                                      "WHERE status = 'finished'") == writers,
                 60, "every rank finished in runs")
    finally:
        assert stop(d) == 0
    total = writers * n
    assert any(0 < p < 2 * total for p in progress), progress  # kills landed mid-forwarding
    assert server.count(f"SELECT count() FROM {db}.metrics FINAL") == 2 * total
    assert server.count(f"SELECT count() FROM {db}.rank_metrics FINAL") == total
    assert server.count(f"SELECT uniqExact(event_id) FROM {db}.metrics") == total
    assert server.query(f"SELECT rank, count(), min(step), max(step) FROM {db}.metrics FINAL "
                        "WHERE key = 'k' GROUP BY rank ORDER BY rank FORMAT CSV") == "".join(
        f"{r},{n},0,{n - 1}\n" for r in range(writers))
    # restarts did send some batches again: the raw table holds repeats FINAL collapses
    assert server.count(f"SELECT count() FROM {db}.metrics") >= 2 * total


def test_server_stopped_mid_run_and_started_again_receives_everything(
        tmp_path: Path, db: str) -> None:
    ch = ClickHouse(tmp_path / "clickhouse")
    ch.start()
    try:
        spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
        writers, n = 2, 2000
        cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                           extra=_daemon_backend(ch, db))
        d = start_exprd(cfg)
        try:
            wait_ready(state, d)
            procs = [spawn(_writer(spool, root, "outage", n, chunk=20, pause=0.1),
                           {"RANK": str(r), "WORLD_SIZE": str(writers)}) for r in range(writers)]
            wait_for(lambda: _exists(ch, db) and ch.count(
                f"SELECT count() FROM {db}.metrics") > 0, 30, "the first rows")
            shards = [root / "proj" / "outage" / ("metrics.jsonl" if r == 0
                                                  else f"metrics.rank{r}.jsonl")
                      for r in range(writers)]
            before = sum(s.read_bytes().count(b"\n") for s in shards)
            # SIGTERM: the server refuses new work at once and takes seconds to drain
            ch.stop()
            time.sleep(1.0)  # training goes on, the shards too; exprd retries the store
            assert sum(s.read_bytes().count(b"\n") for s in shards) > before
            ch.start()
            run_all(procs)
            wait_for(lambda: ch.count(f"SELECT count() FROM {db}.runs FINAL "
                                      "WHERE status = 'finished'") == writers,
                     60, "every rank finished in runs")
        finally:
            assert stop(d) == 0
        assert ch.count(f"SELECT count() FROM {db}.metrics FINAL") == 2 * writers * n
        assert ch.count(f"SELECT count() FROM {db}.rank_metrics FINAL") == writers * n
        status = json.loads((state / "status.json").read_text())
        assert status is not None
    finally:
        ch.stop()


def test_a_backends_table_named_after_its_type_needs_no_type_key(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    """Issue 22: `[backends.clickhouse]` without `type = ...` was "type is required"."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    run_all([spawn(_writer(spool, root, "typeless", 20, chunk=10),
                   {"RANK": "0", "WORLD_SIZE": "1"})])
    table = _daemon_backend(server, db).replace('type = "clickhouse"\n', "")
    assert table.startswith("[backends.clickhouse]\nurl") and "type" not in table
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], extra=table)
    exprd_once(cfg)
    assert server.count(f"SELECT count() FROM {db}.metrics FINAL") == 40
    # a table of another name still needs its type, and the error says how to leave it out
    bad = write_config(tmp_path / "bad.toml", spool, state, [root],
                       extra=table.replace("[backends.clickhouse]", "[backends.team]"))
    proc = subprocess.run([*EXPRD, "--config", str(bad), "--once"], env=env_for(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "backends.team" in proc.stderr and "named after its type" in proc.stderr, proc.stderr


def test_exprd_without_clickhouse_config_warns_and_forwards_nothing(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    run_all([spawn(_writer(spool, root, "nocfg", 10, chunk=10), {"RANK": "0", "WORLD_SIZE": "1"})])
    proc = exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    assert "backend 'clickhouse'" in proc.stderr
    assert not _exists(server, db)
    assert (root / "proj" / "nocfg" / "metrics.jsonl").read_bytes().count(b"\n") == 20


# -- incidents ---------------------------------------------------------------------------


def test_incidents_keep_their_last_change(server: ClickHouse, db: str) -> None:
    backend = ClickHouseBackend(url=server.url, database=db)
    backend.open(Identity("proj", "inc", world_size=8))
    line = {"kind": "straggler", "ranks": [5, 3], "hosts": ["node-2"], "step": 40,
            "first_seen": 100.0, "last_seen": 100.0, "detail": {"ratio": 1.6},
            "state": "open", "delivered": True}
    backend.incident(line)
    backend.incident({**line, "last_seen": 160.5, "state": "resolved", "step": 90})
    backend.finish("finished")
    rows = [json.loads(x) for x in server.query(
        f"SELECT kind, ranks, hosts, step, state, detail FROM {db}.incidents FINAL "
        "FORMAT JSONEachRow").splitlines()]
    assert rows == [{"kind": "straggler", "ranks": [3, 5], "hosts": ["node-2"], "step": "90",
                     "state": "resolved", "detail": '{"ratio":1.6}'}]


def test_a_long_outage_never_holds_the_shards_and_everything_lands_after(
        tmp_path: Path, db: str) -> None:
    """More events than a backend may hold (HIGH_WATER) arrive while the server is down:
    the shards still reach the end, and the server gets every event once it is back."""
    from daemon.forwarder import HIGH_WATER

    ch = ClickHouse(tmp_path / "clickhouse")
    ch.start()
    try:
        spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
        n = 6000  # 2 events per step: 12,000 events, well over HIGH_WATER
        assert 2 * n > 2 * HIGH_WATER
        cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                           extra=_daemon_backend(ch, db))
        d = start_exprd(cfg)
        try:
            wait_ready(state, d)
            proc = spawn(_writer(spool, root, "long", 200, chunk=100),
                         {"RANK": "0", "WORLD_SIZE": "1"})
            run_all([proc])
            wait_for(lambda: _exists(ch, db) and ch.count(
                f"SELECT count() FROM {db}.rank_metrics FINAL") == 200, 30, "the first rows")
            ch.stop()
            proc = spawn(_writer(spool, root, "long2", n, chunk=500),
                         {"RANK": "0", "WORLD_SIZE": "1"})
            run_all([proc])
            shard = root / "proj" / "long2" / "metrics.jsonl"
            # the whole run reaches its shard while the server is still down
            wait_for(lambda: shard.exists() and shard.read_bytes().count(b"\n") == 2 * n,
                     60, "every row in the shard during the outage")
            status = json.loads((state / "status.json").read_text())
            assert status is not None
            ch.start()
            wait_for(lambda: ch.count(f"SELECT count() FROM {db}.runs FINAL "
                                      "WHERE status = 'finished'") == 2,
                     120, "both runs finished in runs")
        finally:
            assert stop(d) == 0
        q = ch.count
        assert q(f"SELECT count() FROM {db}.metrics FINAL WHERE name = 'long2'") == 2 * n
        assert q(f"SELECT count() FROM {db}.rank_metrics FINAL WHERE name = 'long2'") == n
        assert q(f"SELECT uniqExact(event_id) FROM {db}.metrics WHERE name = 'long2'") == n
    finally:
        ch.stop()


# -- direct mode at exit, refused credentials, bursts (issue 20, item 8) ---------------------


def _run_and_finish(tmp_path: Path, name: str, spec: dict[str, Any], n: int = 50
                    ) -> tuple[float, dict[str, Any]]:
    """A direct-mode run of n rows: (seconds finish() took, backend stats before it)."""
    et.init("proj", name, dir=tmp_path, backends=[spec])
    for k in range(n):
        et.log({"loss": 1.0 / (k + 1)})
    et.flush()
    stats = et.info()["backends"]["clickhouse"]
    t0 = time.monotonic()
    et.finish()
    took = time.monotonic() - t0
    assert (tmp_path / "proj" / name / "metrics.jsonl").read_bytes().count(b"\n") == n
    return took, stats


def test_finish_gives_up_after_exit_timeout_when_the_store_is_down_hangs_or_fails(
        tmp_path: Path, httpserver: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Before: finish() waited 30-32 s in each case (the shared backend bound + grace)."""
    import socket

    httpserver.expect_request("/").respond_with_data(
        "Code: 241, e.displayText() = DB::Exception: Memory limit", status=500)
    hanging = socket.socket()  # accepts connections (the kernel does), never answers
    hanging.bind(("127.0.0.1", 0))
    hanging.listen(64)
    urls = {"down": "http://127.0.0.1:9", "500": httpserver.url_for("/"),
            "hanging": f"http://127.0.0.1:{hanging.getsockname()[1]}"}
    try:
        with caplog.at_level(logging.WARNING, logger="expr_tracker.backends"):
            for case, url in urls.items():
                took, _ = _run_and_finish(tmp_path, f"exit-{case}",
                                          {"type": "clickhouse", "url": url, "exit_timeout": 1})
                assert took < 6.0, (case, took)  # 1 s bound (+0.25 s) on a loaded machine
    finally:
        hanging.close()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "no acknowledgement for exit_timeout = 1 s" in said
    assert "left behind at exit" in said or "last: ReadTimeout" in said


def test_a_wrong_password_is_not_retried_and_says_so(
        tmp_path: Path, server: ClickHouse, db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_CH_USER", "writer")
    monkeypatch.setenv("TEAM_CH_PASSWORD", "wrong-password")
    spec = _spec(server, db, user_env="TEAM_CH_USER", password_env="TEAM_CH_PASSWORD")
    et.init("proj", "badpw", dir=tmp_path, backends=[spec])
    for k in range(20):
        et.log({"loss": 1.0 / (k + 1)})
    et.flush()
    stats = et.info()["backends"]["clickhouse"]
    deadline = time.monotonic() + 20
    while stats["failed"] < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = et.info()["backends"]["clickhouse"]
    t0 = time.monotonic()
    et.finish()
    assert time.monotonic() - t0 < 5.0
    assert stats["failed"] == 20 and stats["sent"] == 0, stats
    refused = {c: n for c, n in stats["errors"].items() if "authentication refused" in c}
    assert refused and all("code 193" in c or "code 516" in c for c in refused), stats["errors"]
    assert not any("retrying" in c or "interrupted" in c for c in stats["errors"])
    assert not _exists(server, db)


def test_a_burst_of_200k_rows_fits_the_default_queue_and_lands(
        tmp_path: Path, server: ClickHouse, db: str) -> None:
    """Before: a 10,000-record queue dropped 92% of such a burst; now 64 MB holds it."""
    n = 200_000
    et.init("proj", "burst", dir=tmp_path, backends=[_spec(server, db)])
    for k in range(n):
        et.log({"loss": 1.0 / (k + 1)})
    et.flush()
    during = et.info()["backends"]["clickhouse"]
    et.finish()
    assert during["dropped"] == 0, during
    assert server.count(f"SELECT count() FROM {db}.metrics") == n


def test_past_queue_mb_a_burst_is_dropped_and_counted(tmp_path: Path) -> None:
    """A store that is down and a 1 MB queue: what does not fit is counted under its cause."""
    n = 20_000
    et.init("proj", "small-queue", dir=tmp_path, backends=[{
        "type": "clickhouse", "url": "http://127.0.0.1:9", "queue_mb": 1, "exit_timeout": 0.5}])
    for k in range(n):
        et.log({"loss": 1.0 / (k + 1), "k": k})
    stats = et.info()["backends"]["clickhouse"]
    et.finish()
    # about 2,600 records of 4 keys fit in 1 MB, plus the one batch the thread holds
    assert 2_000 < n - stats["dropped"] <= 2 * 2_700, stats
    assert stats["errors"]["clickhouse: queue full (1 MB)"] == stats["dropped"]
