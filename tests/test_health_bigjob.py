"""The end of a big job (issue 53, first row; DESIGN 13 turn 5, "One incident per cause, at
any scale"): 16,384 ranks on 2,048 hosts, rank 17 crashed at step 14, then the scheduler
killed the rest (no finish; every file 20 minutes old). One incident for the crash (the
root), one job-wide silence naming its nodes by count and range, never one per node; every
reader (watch, top, MCP run_incidents) answers a screenful with counts.

And the grouping on a small job (64 ranks on 8 hosts): the whole job silent is one
incident; one or two nodes silent while the others write are lost nodes, as before.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.synthetic import PER_NODE, host_of, write_run

# 16,384 ranks: one worker runs the heavy tests, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("heavy")

WORLD = 16384
STEPS = 30  # rank 17 (`crashed`) stops half-way: its last step is 14, the others' 29
CRASHED = 17
AGE = 1200.0  # s: every file of the killed job


def _age(run: Path, seconds: float, ranks: set[int] | None = None,
         sidecars: bool = False) -> None:
    """Set the mtimes of the run's shards and sidecars (of `ranks`, default all; only the
    sidecars with `sidecars`: a probe keeps a waiting rank's sidecar fresh, not its shard)
    to `seconds` ago."""
    old = time.time() - seconds
    for entry in os.scandir(run):
        if sidecars and not entry.name.endswith(".meta.json"):
            continue
        stem = entry.name.split(".")[1] if entry.name.startswith("metrics.rank") else "rank0"
        if ranks is not None and int(stem[len("rank"):]) not in ranks:
            continue
        os.utime(entry.path, (old, old))


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The killed 16,384-rank job (written once for the module: some seconds)."""
    root = tmp_path_factory.mktemp("bigjob")
    run = write_run(root / "proj" / "killed", WORLD, STEPS, crashed=CRASHED)
    _age(run, AGE)
    return root


@pytest.fixture
def cli(killed: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    app = build_app()
    monkeypatch.setenv("EXPR_DIR", str(killed))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    # each test its own first pass: no incidents recorded by another test's watcher
    (killed / "proj" / "killed" / "incidents.jsonl").unlink(missing_ok=True)

    def invoke(*args: str, code: int = 0) -> Any:
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == code, result.output
        return result

    yield invoke


def _silent_line(detail: str) -> None:
    assert detail.startswith("every rank silent since "), detail
    assert "the job ended without finishing" in detail, detail
    assert "16,383 ranks (0-16,18-16383) on 2,048 nodes (gpu-0000 ... gpu-2047)" in detail, detail


def test_watch_once_is_the_crash_root_and_one_job_wide_silence(cli: Any) -> None:
    lines = [json.loads(x) for x in cli("watch", "proj/killed", "--once", "--json",
                                        code=1).stdout.splitlines()]
    assert [i["kind"] for i in lines] == ["crashed", "silent"], [i["detail"] for i in lines[:5]]
    crash, silent = lines
    # the crash is the root, not the collateral of a node (no node is lost: no peer waits)
    assert crash["ranks"] == [CRASHED] and crash["root"]["rank"] == CRASHED
    assert "cause" not in crash and "collateral" not in crash["detail"], crash
    assert crash["step"] == STEPS // 2 - 1
    assert silent["ranks"] == [r for r in range(WORLD) if r != CRASHED]
    assert silent["step"] == STEPS - 1 and silent["level"] == "error"
    _silent_line(silent["detail"])
    assert silent["detail"].endswith(f"rank {CRASHED} crashed"), silent["detail"]


def test_top_once_json_is_a_screenful_with_counts(cli: Any) -> None:
    out = cli("top", "proj/killed", "--once", "--json").stdout
    assert len(out.encode()) < 300_000, len(out.encode())
    top = json.loads(out)
    assert top["ranks_total"] == WORLD and top["nodes_total"] == WORLD // PER_NODE
    assert len(top["ranks"]) == len(top["nodes"]) == 100
    assert top["counts"] == {"status": {"crashed": 1, "silent": WORLD - 1},
                             "incident": {"crashed": 1, "silent": WORLD - 1}}
    assert top["ranks"][0]["rank"] == CRASHED and top["nodes"][0]["node"] == host_of(CRASHED)
    assert {r["status"] for r in top["ranks"][1:]} == {"silent"}
    job = top["job"]
    assert job["state"] == "silent" and job["first_crash"]["rank"] == CRASHED, job
    assert job["text"].startswith("every rank silent since "), job
    assert job["text"].endswith(f"rank {CRASHED} crashed first (RuntimeError: NCCL timeout)"), job
    crash, silent = top["incidents"]
    assert crash["kind"] == "crashed" and crash["ranks"] == [CRASHED]
    assert silent["kind"] == "silent" and silent["rank_count"] == WORLD - 1
    assert silent["ranks_cut"] is True and len(silent["ranks"]) == 100
    assert silent["ranks_text"] == "0-16,18-16383"
    _silent_line(silent["detail"])
    # the terminal frame: the job's line, the two incidents, the ranks counted
    frame = cli("top", "proj/killed", "--once").stdout
    assert "every rank silent since" in frame.splitlines()[1], frame
    assert sum(" lost " in line for line in frame.splitlines()) == 0, frame


def test_mcp_run_incidents_names_the_root_and_one_silence(killed: Path) -> None:
    from tests.extras import need

    need("mcp", "mcp")
    from tests.mcpclient import McpClient
    from tests.procs import env_for

    (killed / "proj" / "killed" / "incidents.jsonl").unlink(missing_ok=True)
    c = McpClient(["--dir", str(killed)], env_for())
    try:
        a = c.call("run_incidents", timeout=300, run="proj/killed")
    finally:
        c.close()
    assert not a.error, a.text
    assert a.bytes < 48_000, a.bytes
    got = a.json
    assert got["crash_root"]["rank"] == CRASHED
    assert [i["kind"] for i in got["open"]] == ["crashed", "silent"], got["open"]
    silent = got["open"][1]
    assert silent["rank_count"] == WORLD - 1 and silent["ranks_text"] == "0-16,18-16383"
    _silent_line(silent["detail"])
    assert got["job"]["state"] == "silent"


# -- the grouping on a small job: 64 ranks on 8 hosts --------------------------------------


def _small(tmp_path: Path, crashed: int | None = CRASHED) -> Path:
    run = write_run(tmp_path / "proj" / "small", 64, STEPS, crashed=crashed)
    _age(run, AGE)
    return run


def _pass(run: Path) -> list[Any]:
    from expr_tracker.health.watch import Watcher

    w = Watcher(run, owner=False)
    w.check()
    return w.open


def test_a_small_killed_job_is_one_silence_and_its_crash(tmp_path: Path) -> None:
    got = _pass(_small(tmp_path))
    assert sorted(i.kind for i in got) == ["crashed", "silent"], [i.detail for i in got]
    silent = next(i for i in got if i.kind == "silent")
    assert silent.ranks == tuple(r for r in range(64) if r != CRASHED)
    assert "63 ranks (0-16,18-63) on 8 nodes (gpu-0000 ... gpu-0007)" in silent.detail
    crash = next(i for i in got if i.kind == "crashed")
    assert crash.cause is None and crash.root is not None and crash.root["rank"] == CRASHED


def test_every_rank_silent_without_a_crash_is_one_silence_not_a_stall(tmp_path: Path) -> None:
    got = _pass(_small(tmp_path, crashed=None))
    assert [i.kind for i in got] == ["silent"], [i.detail for i in got]
    assert got[0].ranks == tuple(range(64)) and not got[0].detail.endswith("crashed")


def test_one_host_silent_while_the_others_write_is_a_lost_node(tmp_path: Path) -> None:
    run = _small(tmp_path)
    # all but gpu-0005 wait with fresh probes (a lock-step job does not step on without it)
    _age(run, 1.0, ranks=set(range(64)) - set(range(40, 48)), sidecars=True)
    got = _pass(run)
    lost = [i for i in got if i.kind == "lost"]
    assert [i.hosts for i in lost] == [("gpu-0005",)], [i.detail for i in got]
    assert lost[0].ranks == tuple(range(40, 48)) and "silent" not in {i.kind for i in got}
    assert lost[0].detail.startswith("gpu-0005 lost: ranks 40-47 silent 20m (no rows, no probes)")


def test_two_hosts_silent_while_the_others_write_are_two_lost_nodes(tmp_path: Path) -> None:
    run = _small(tmp_path)
    _age(run, 1.0, ranks=set(range(64)) - set(range(8, 16)) - set(range(48, 56)), sidecars=True)
    got = _pass(run)
    lost = sorted((i for i in got if i.kind == "lost"), key=lambda i: i.ranks)
    assert [i.hosts for i in lost] == [("gpu-0001",), ("gpu-0006",)], [i.detail for i in got]
    assert [i.ranks for i in lost] == [tuple(range(8, 16)), tuple(range(48, 56))]
    # the other nodes' crash is named in each, as before
    assert all(i.detail.endswith(f"rank {CRASHED} crashed (NCCL timeout)") for i in lost), lost


def test_a_single_host_job_all_silent_is_no_job_wide_silence(tmp_path: Path) -> None:
    """One node: a stall or hang says it (their thresholds), as before; no `silent`."""
    run = write_run(tmp_path / "proj" / "one", PER_NODE, STEPS)
    _age(run, AGE)
    assert "silent" not in {i.kind for i in _pass(run)}


def test_an_incident_of_many_ranks_is_brief_for_readers() -> None:
    from expr_cli.data.top import brief

    few = {"kind": "hang", "ranks": [3, 4], "hosts": ["gpu-0000"]}
    assert brief(few) is few
    many = {"kind": "silent", "ranks": [r for r in range(300) if r != 17], "hosts": []}
    got = brief(many)
    assert got["ranks"] == many["ranks"][:100] and got["ranks_cut"] is True
    assert got["rank_count"] == 299 and got["ranks_text"] == "0-16,18-299"
    assert "hosts_cut" not in got and many["ranks"][100] == 101  # (the line is not changed)
    gaps = brief({"kind": "silent", "ranks": list(range(0, 2000, 2)), "hosts": []})
    assert len(gaps["ranks_text"]) <= 124 and gaps["ranks_text"].endswith(",...")
