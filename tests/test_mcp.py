"""`expr mcp` through the `mcp` SDK's own client over stdio (ClientSession, stdio_client),
against real runs: a 4-rank torchrun job (gloo, CPU) where rank 3 stalls the job in a
`time.sleep` and rank 1 then raises; synthetic runs for bad input, hostile SQL, the size
cap and its file, and 16,384 ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.extras import need
from tests.procs import env_for
from tests.synthetic import write_run

pytest.importorskip("mcp")
pytest.importorskip("duckdb")

from tests.mcpclient import McpClient

EXPR = [sys.executable, "-m", "expr_cli.main"]
TOOLS = {"list_runs", "run_summary", "run_incidents", "rank_vs_median", "compare_runs",
         "first_crossing", "metric_series", "query"}
STALL_AT, RAISE_AT, HOLD, STEPS = 10, 20, 9, 40

JOB = f"""
import os, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import expr_tracker as et

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run = et.init("ddp", "faults", dir=os.environ["ROOT"])
for step in range({STEPS}):
    t0 = time.perf_counter()
    x = torch.randn(16, 8)
    with et.span("data"):
        if rank == 3 and step == {STALL_AT}:
            time.sleep({HOLD})
    if rank == 1 and step == {RAISE_AT}:
        raise RuntimeError("boom: bad batch on rank 1")
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.log_rank_metrics({{"step_time": time.perf_counter() - t0}}, step=step)
    et.log({{"loss": loss.item()}}, step=step)
    time.sleep(0.05)
et.finish()
dist.destroy_process_group()
"""


def _until(what: str, ok: Any, within: float) -> Any:
    deadline = time.monotonic() + within
    while not (got := ok()):
        assert time.monotonic() < deadline, what
        time.sleep(0.3)
    return got


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    made: list[McpClient] = []

    def start(*args: str, env: dict[str, str] | None = None) -> McpClient:
        made.append(McpClient(args, env_for(env)))
        return made[-1]

    yield start
    for c in made:
        c.close()


@pytest.mark.slow  # 45-55 s on the 2-core box, most of it four ranks importing torch
def test_a_stalled_then_crashed_torchrun_job_its_culprit_where_it_waited_and_the_root(
        tmp_path: Path, client: Any) -> None:
    need("torch", "torch")
    root = (tmp_path / "runs").resolve()
    root.mkdir()
    cfg = tmp_path / "alerts.toml"
    cfg.write_text('[health]\nhang_after = "3s"\n')  # a stall is news after 3 s here
    c = client("--dir", str(root), env={"EXPR_ALERT_CONFIG": str(cfg)})
    assert {t.name for t in c.tools()} == TOOLS
    assert all(t.annotations.read_only_hint for t in c.tools())
    script = tmp_path / "train.py"
    script.write_text(JOB)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=env_for({"OMP_NUM_THREADS": "1", "EXPR_PROBE_AFTER": "2", "ROOT": str(root),
                     "EXPR_SYSTEM_METRICS": "1", "EXPR_SYSTEM_INTERVAL": "1"}),
        start_new_session=True)
    try:
        _until("the run", lambda: (root / "ddp" / "faults" / "metrics.rank3.jsonl").exists(), 120)

        def stalled() -> Any:
            # stalled, and the probes written (after EXPR_PROBE_AFTER=2 s of silence)
            a = c.call("run_incidents", run="ddp/faults")
            assert not a.error, a.text
            places = {p["waiting"] for p in a.json["probes"]["by_place"]}
            return a.json if a.json["job"]["state"] == "stalled" and places >= {
                "sleep", "collective"} else None

        stall = _until("a stall named by run_incidents", stalled, 60)
        assert stall["job"]["suspects"] == [3], stall["job"]
        assert "time.sleep" in stall["job"]["text"], stall["job"]
        culprit = stall["probes"]["named"]["3"]
        assert culprit["probe"]["waiting"] == "sleep" and "span data" in culprit["where"], culprit
        waiting = {p["waiting"]: p for p in stall["probes"]["by_place"]}
        assert waiting["sleep"]["ranks"] == "3", stall["probes"]
        assert "collective" in waiting, stall["probes"]  # the others wait in the all-reduce
        assert stall["covers"]["world_size"] == 4 and stall["cut"] is False
        rank3 = c.call("rank_vs_median", run="faults", rank=3).json
        assert rank3["status"] == "running" and "time.sleep" in rank3["where"], rank3
        assert set(rank3["system"]) >= {"system/cpu_percent", "system/rss_mb"}, rank3["system"]
        _, err = job.communicate(timeout=120)
        assert job.returncode != 0 and "boom: bad batch on rank 1" in err, err[-2000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()

    after = c.call("run_incidents", run="ddp/faults").json
    assert after["job"]["state"] == "crashed", after["job"]
    assert after["crash_root"]["rank"] == 1 and "boom" in after["crash_root"]["message"]
    crashed = [i for i in after["open"] if i["kind"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["root"]["rank"] == 1, after["open"]
    runs = c.call("list_runs").json
    assert runs["runs"][0]["name"] == "faults" and runs["runs"][0]["status"] == "crashed"
    assert runs["runs"][0]["job"]["first_crash"]["rank"] == 1

    summary = c.call("run_summary", run="ddp/faults")
    cli = subprocess.run([*EXPR, "summary", "ddp/faults", "--dir", str(root), "--json"],
                         capture_output=True, text=True, env=env_for(), timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert summary.json["summary"] == json.loads(cli.stdout)
    covers = summary.json["covers"]
    assert covers["world_size"] == 4 and covers["keys"][0]["key"] == "step_time"
    steps = c.call("run_summary", run="ddp/faults", steps="0:10", metrics=["step_time"]).json
    cli = subprocess.run([*EXPR, "summary", "ddp/faults", "--dir", str(root), "--json",
                          "--steps", "0:10", "-m", "step_time"],
                         capture_output=True, text=True, env=env_for(), timeout=60)
    assert steps["summary"] == json.loads(cli.stdout)
    assert steps["covers"]["steps"] == [0, 10] and steps["covers"]["keys"][0]["reporting"] == 4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mcp") / "runs"
    write_run(root / "proj" / "big", 64, 40, straggler=5, crashed=17)
    write_run(root / "proj" / "other", 4, 40)
    return root.resolve()


def test_bad_arguments_are_tool_errors_naming_the_argument(small: Path, client: Any) -> None:
    c = client("--dir", str(small))
    cases = [
        ("run_summary", {"run": "bigg"}, "run: no run 'bigg' under the run root; near names: proj/big"),
        ("run_summary", {"run": "proj/../../etc"}, "run: a run is project/name"),
        ("run_summary", {"run": "proj/.x"}, "run: "),
        ("run_summary", {"run": "big", "step": 999}, "step: step 999 has no rank records"),
        ("run_summary", {"run": "big", "steps": "9:3"}, "steps: step range '9:3' is empty"),
        ("run_summary", {"run": "big", "metrics": ["lsos"]}, "metrics: unknown metric lsos"),
        ("run_summary", {"run": "big", "step": 3, "steps": "1:4"}, "step: give either"),
        ("rank_vs_median", {"run": "big", "rank": 99}, "rank: run proj/big has no shard of rank 99"),
        ("first_crossing", {"run": "big", "metric": "loss", "value": 1, "direction": "up"},
         "direction: must be 'above' or 'below'"),
        ("first_crossing", {"run": "big", "metric": "los", "value": 1}, "metric: run proj/big has no metric 'los'; near: loss"),
        ("metric_series", {"run": "big", "metric": "loss", "points": 1}, "points: must be in 2..200"),
        ("metric_series", {"run": "big", "metric": "loss", "ranks": "x"}, "ranks: ranks must be"),
        ("compare_runs", {"runs": [], "metric": "loss"}, "runs: give at least one run"),
        ("query", {"sql": "SELECT 1"}, "run: name the run"),
        ("query", {"sql": "SELECT 1", "store": True}, "store: expr mcp was started without --store"),
        ("run_summary", {"run": "big", "stream": "../x"}, "stream: "),
    ]
    for tool, args, message in cases:
        a = c.call(tool, **args)
        assert a.error and message in a.text, (tool, args, a.text)
    wrong_type = c.call("rank_vs_median", run="big", rank="three")
    assert wrong_type.error and "rank" in wrong_type.text
    # a symlinked run directory, and a run holding a symlinked shard, are not read
    (small / "proj" / "linked").symlink_to(small / "proj" / "other")
    other = small / "proj" / "other"
    (small / "evil").mkdir(exist_ok=True)
    (small / "evil" / "run").mkdir(exist_ok=True)
    (small / "evil" / "run" / "metrics.jsonl").symlink_to(other / "metrics.jsonl")
    try:
        a = c.call("run_summary", run="proj/linked")
        assert a.error and a.text.count("run: ") == 1, a.text
        b = c.call("run_summary", run="evil/run")
        assert b.error and "symlinks" in b.text, b.text
    finally:
        (small / "proj" / "linked").unlink()
        (small / "evil" / "run" / "metrics.jsonl").unlink()


def test_hostile_sql_is_refused_or_stopped_at_a_cap(small: Path, tmp_path: Path,
                                                    client: Any) -> None:
    out = tmp_path / "out"
    c = client("--dir", str(small), "--out", str(out), "--sql-timeout", "2", "--max-rows", "10")
    target = tmp_path / "copied.csv"
    refused = {
        f"COPY (SELECT 1) TO '{target}'": "not COPY",
        "SELECT * FROM read_csv('/etc/passwd')": "Cannot access file",
        "SELECT * FROM read_text('/etc/passwd')": "Cannot access file",
        "ATTACH '/tmp/x.db' AS x": "not ATTACH",
        "CREATE TABLE t AS SELECT 1": "not CREATE",
        "SET enable_external_access = true": "not SET",
        "INSTALL httpfs": "not",
        "SELECT 1; SELECT 2": "one SQL statement",
        "EXPLAIN ANALYZE SELECT 1": "not EXPLAIN",
    }
    for sql, message in refused.items():
        a = c.call("query", run="proj/other", sql=sql)
        assert a.error and a.text.count("sql: ") == 1 and message in a.text, (sql, a.text)
    assert not target.exists()
    t0 = time.monotonic()
    endless = c.call("query", run="proj/other",
                     sql="WITH RECURSIVE t(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM t) "
                         "SELECT count(*) FROM t")
    assert endless.error and "time cap (2 s)" in endless.text, endless.text
    assert time.monotonic() - t0 < 15
    many = c.call("query", run="proj/other", sql="SELECT _rank, _step, loss FROM metrics "
                                                 "ORDER BY _rank, _step").json
    assert many["cut"] is True and many["n_rows"] == 10 and len(many["rows"]) == 10
    assert many["file_rows"] == 4 * 40
    lines = Path(many["file"]).read_text().splitlines()
    assert Path(many["file"]).parent == out and len(lines) == many["file_rows"]
    assert json.loads(lines[0]) == many["rows"][0]
    # the views are kept between queries; a shard that appears since is queried too
    grow = small / "proj" / "grow"
    write_run(grow, 2, 3)
    count = "SELECT count(DISTINCT _rank) AS n, count(*) AS rows FROM metrics"
    assert c.call("query", run="proj/grow", sql=count).json["rows"] == [{"n": 2, "rows": 6}]
    time.sleep(0.01)  # (a directory mtime that moves on)
    (grow / "metrics.rank2.jsonl").write_text('{"_step": 0, "_time": 1.0, "loss": 1.5}\n')
    assert c.call("query", run="proj/grow", sql=count).json["rows"] == [{"n": 3, "rows": 7}]


def test_an_answer_over_the_cap_is_cut_and_written_whole_under_out(small: Path, tmp_path: Path,
                                                                   client: Any) -> None:
    out = tmp_path / "out"
    capped = client("--dir", str(small), "--out", str(out), "--max-bytes", "4096")
    args = {"run": "big", "metric": "loss", "ranks": "0-7"}  # 8 lines of 40 points
    a = capped.call("metric_series", **args)
    assert not a.error and a.bytes <= 4096, a.text
    assert a.json["cut"] is True and a.json["cuts"], a.json
    assert a.json["covers"] == {"ranks_reporting": 8, "world_size": 64, "ranks_drawn": 8,
                                "steps": [0, 39], "points": 40, "of_points": 40}
    assert Path(a.json["file"]).parent == out
    whole = json.loads(Path(a.json["file"]).read_text())
    cli = subprocess.run([*EXPR, "plot", "proj/big", "--dir", str(small), "-m", "loss",
                          "--rank", "0-7", "--json"], capture_output=True, text=True,
                         env=env_for(), timeout=60)
    assert whole["series"] == json.loads(cli.stdout) and whole["cut"] is False
    # without an output directory: cut all the same, and the note says how to get it whole
    from expr_cli.mcp.fit import OutDir, encode, fit

    nowhere = fit("metric_series", whole, 4096, OutDir(None))
    assert nowhere["cut"] is True and nowhere["file"] is None and "--out" in nowhere["note"]
    assert len(encode(nowhere)) <= 4096 and nowhere["covers"] == a.json["covers"]


def test_series_compare_and_crossing_of_many_ranks(small: Path, client: Any) -> None:
    c = client("--dir", str(small))
    for metric in ("step_time", "loss"):  # a rank record, a step row
        a = c.call("metric_series", run="proj/big", metric=metric)
        cli = subprocess.run([*EXPR, "plot", "proj/big", "--dir", str(small), "-m", metric,
                              "--json"], capture_output=True, text=True, env=env_for(), timeout=60)
        assert a.json["series"] == json.loads(cli.stdout), metric
    lines = a.json["series"]["panels"][0]["lines"]
    assert lines[0]["label"] == "median of 64 ranks" and a.json["covers"]["ranks_reporting"] == 64
    thinned = c.call("metric_series", run="proj/big", metric="step_time", points=5).json
    assert thinned["covers"]["points"] == 5 and thinned["covers"]["of_points"] == 40
    assert thinned["series"]["panels"][0]["lines"][0]["steps"] == [0, 10, 20, 29, 39]
    outlier = thinned["series"]["panels"][0]["lines"][1]
    assert outlier["label"] == "rank 5 (outlier)", thinned  # the straggler
    cross = c.call("first_crossing", run="big", metric="loss", value=0.5, direction="below").json
    assert cross["first_step_any_rank"] == 9 and cross["median_first_step"] == 10, cross
    assert cross["ranks_never"] == "-" and cross["ranks_crossed"] == 64
    runs = c.call("list_runs").json  # worst first: the crashed run, then the silent one
    states = [(r["name"], r["job"]["state"]) for r in runs["runs"]]
    assert states[0] == ("big", "crashed") and ("other", "stalled") in states[1:], states
    assert runs["runs"][0]["n_ranks"] == 64 and runs["runs"][0]["ranks"] == "0-63"
    cmp = c.call("compare_runs", runs=["big", "proj/other"], metric="loss").json
    assert [r["ranks"] for r in cmp["runs"]] == [64, 4] and cmp["covers"]["last_common_step"] == 39


# 16-42 s on the 2-core box (32,768 files written, then read by each tool): `make torture`
@pytest.mark.torture
def test_16384_ranks_answers_within_the_caps(tmp_path: Path, client: Any) -> None:
    root = (tmp_path / "runs").resolve()
    write_run(root / "bench" / "big", 16384, 2, straggler=8193, crashed=17)
    c = client("--dir", str(root))
    cap = 48_000
    calls = {
        "run_summary": {"run": "bench/big"},
        "run_incidents": {"run": "bench/big"},
        "rank_vs_median": {"run": "bench/big", "rank": 8193},
        "metric_series": {"run": "bench/big", "metric": "step_time"},
        "first_crossing": {"run": "bench/big", "metric": "loss", "value": 1.5, "direction": "below"},
    }
    got = {}
    for tool, args in calls.items():
        a = c.call(tool, timeout=300, **args)
        assert not a.error, (tool, a.text)
        assert a.bytes <= cap, (tool, a.bytes)
        got[tool] = a.json
    assert got["run_summary"]["covers"]["world_size"] == 16384
    keys = {k["key"]: k for k in got["run_summary"]["covers"]["keys"]}
    assert keys["step_time"]["reporting"] == 16383 and keys["step_time"]["behind"] == "17"
    outliers = got["run_summary"]["summary"]["keys"]
    assert any(o["rank"] == 8193 for k in outliers for o in k["outliers"])
    inc = got["run_incidents"]
    assert inc["crash_root"]["rank"] == 17 and inc["covers"]["world_size"] == 16384
    assert got["rank_vs_median"]["step_time"]["ratio"] > 1.5
    assert got["metric_series"]["covers"]["ranks_reporting"] == 16384
    cross = got["first_crossing"]  # rank 17 stopped after step 0 (a loss of 2.3)
    assert cross["ranks_crossed"] == 16383 and cross["ranks_never"] == "17", cross


@pytest.mark.xdist_group("clickhouse")  # with the other ClickHouse tests, in turn
def test_the_team_store_is_capped_by_the_servers_own_settings(small: Path, tmp_path: Path,
                                                              client: Any) -> None:
    from tests.chserver import PASSWORD, ClickHouse

    ch = ClickHouse(tmp_path / "clickhouse")
    ch.start()
    try:
        ch.query("CREATE TABLE default.t (x UInt64) ENGINE = MergeTree ORDER BY x")
        c = client("--dir", str(small), "--store", ch.url, "--max-rows", "5",
                   "--sql-timeout", "1", env={"CLICKHOUSE_USER": "", "CLICKHOUSE_PASSWORD": ""})
        endless = c.call("query", store=True, sql="SELECT number FROM system.numbers")
        assert not endless.error and endless.json["cut"] is True, endless.text
        assert endless.json["n_rows"] == 5 and "max_result_rows=6" in endless.json["note"]
        slow = c.call("query", store=True, sql="SELECT sum(cityHash64(number)) FROM (SELECT "
                                               "number FROM system.numbers LIMIT 100000000000)")
        # max_execution_time=1: stopped on the way, or refused by the server's estimate
        assert slow.error and re.search(r"(?i)timeout exceeded|too long|TIMEOUT_EXCEEDED",
                                        slow.text), slow.text
        lifted = c.call("query", store=True, sql="SELECT number FROM system.numbers "
                                                 "SETTINGS max_result_rows = 0")
        assert lifted.error and "readonly" in lifted.text, lifted.text
        for sql in ("INSERT INTO default.t VALUES (1)", "DROP TABLE default.t",
                    "SELECT 1; DROP TABLE default.t", "KILL QUERY WHERE 1"):
            a = c.call("query", store=True, sql=sql)
            assert a.error and a.text.count("sql: ") == 1, (sql, a.text)
        assert ch.count("SELECT count() FROM default.t") == 0
        assert ch.count("EXISTS TABLE default.t") == 1
        one = c.call("query", store=True, sql="SELECT 42 AS x").json
        assert one["rows"] == [{"x": 42}] and one["cut"] is False
        # a user whose profile is read-only cannot be capped by settings: refused, not run
        reader = client("--dir", str(small), "--store", ch.url, "--user-env", "U",
                        "--password-env", "P", env={"U": "reader", "P": PASSWORD})
        a = reader.call("query", store=True, sql="SELECT 1")
        assert a.error and "read-only profile" in a.text, a.text
    finally:
        ch.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--max-bytes", "10"], "--max-bytes must be in 4096.."),
    (["--max-rows", "0"], "--max-rows must be in 1..100000"),
    (["--points", "1"], "--points must be in 2..100000"),
    (["--sql-timeout", "0"], "--sql-timeout must be a positive number"),
    (["--sql-memory", "lots"], "--sql-memory: memory limit 'lots'"),
    (["--store", "ftp://x"], "--store must start with http:// or https://"),
    (["--out", "{root}/inside"], "--out must be outside the run root"),
])
def test_bad_options_are_one_usage_line(small: Path, args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    args = [a.replace("{root}", str(small)) for a in args]
    result = CliRunner().invoke(build_app(), ["mcp", "--dir", str(small), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (small / "inside").exists()
