"""`expr serve`'s quick first pass (issue 19 item 4): a run of `QUICK_MIN` shards or more
is answered first from a window-2 state (summary, heatmap) while top says it is reading;
once the detectors' window is read, the answers are the same as before it and as the
CLI's `--json` of the same run, and a shard changed meanwhile gives a new version."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from expr_cli.web import live as live_mod
from expr_cli.web.api import Api
from expr_cli.web.live import LiveRuns
from expr_tracker.health.config import HealthConfig

from .synthetic import write_run

WORLD, STEPS = live_mod.QUICK_MIN, 80  # (80 steps: more than the detectors' 64)
HEAT = {"metric": ["step_time"], "buckets": ["60"]}


@pytest.fixture
def root(cli_root: Path) -> Path:
    """proj/big: WORLD ranks, rank 5 a 1.6x straggler, rank 9 crashed half-way."""
    write_run(cli_root / "proj" / "big", WORLD, STEPS, straggler=5, crashed=9, status="finished")
    return cli_root.resolve()


def cli_json(cli: Any, *args: str) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def same(frame: dict[str, Any], drop: tuple[str, ...] = ("version",)) -> dict[str, Any]:
    """An answer without `drop`, its incidents without their id and when they were seen
    (each detector memory's own: a fresh server's, the CLI's)."""
    out = {k: v for k, v in frame.items() if k not in drop}
    if "incidents" in out:
        out["incidents"] = [{k: v for k, v in i.items() if k not in ("id", "first_seen", "last_seen")}
                            for i in out["incidents"]]
    return out


def full_top(api: Api, within: float = 60.0) -> dict[str, Any]:
    """Top's answer once it is no longer reading."""
    deadline = time.monotonic() + within
    while True:
        got = api.top("proj", "big", {})
        if not got.get("reading"):
            return got
        assert time.monotonic() < deadline, "top still reading"
        time.sleep(0.05)


@pytest.mark.parametrize("one_read", [False, True])
def test_the_early_answers_are_the_full_ones_and_the_clis(
        cli: Any, root: Path, one_read: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`one_read`: as on a busy machine, no workers scan the tails while the quick pass
    reads them: the pass scans them with its one read of each (issue 44)."""
    from expr_tracker.stats import parallel

    # (whether a core is idle decides it otherwise: a loaded machine reads once either way)
    monkeypatch.setattr(parallel.ScanJob, "parallel", property(lambda self: not one_read))
    switch = sys.getswitchinterval()
    api = Api(root, LiveRuns(HealthConfig()))
    summary = api.summary("proj", "big", {})
    heat = api.heatmap("proj", "big", HEAT)
    early = api.top("proj", "big", {})
    live = api.lives.get(api._run("proj", "big", {})[0], None)
    assert live.quick is not None or live.full  # (the full read may have finished already)
    assert isinstance(live._scan, live_mod._Scanned) == one_read
    assert live.progress()["shards_read"] == WORLD
    assert early.get("reading") is True, early  # no rows, no "no incidents": not known yet
    assert early["ranks"] == [] and early["incidents"] == [] and early["job"]["state"] == "reading"
    assert early["world_size"] == WORLD and early["frontier"] == summary["ranks"]["frontier"]

    top = full_top(api)
    assert not live.quick and live.full
    assert sys.getswitchinterval() == switch  # (short only while the full read ran)
    # nothing changed on disk: the same version, and the answers built before are kept
    assert api.summary("proj", "big", {}) is summary
    assert api.heatmap("proj", "big", HEAT) is heat
    assert top["version"] == summary["version"] == heat["version"]

    # ... and they are what the answers of a fresh server built from the full state are
    fresh = Api(root, LiveRuns(HealthConfig()))
    fresh_live = fresh.lives.get(fresh._run("proj", "big", {})[0], None)
    fresh_live.quick, fresh_live.full = None, True  # (no quick pass: the full state at once)
    for got, want in [(summary, fresh.summary("proj", "big", {})),
                      (heat, fresh.heatmap("proj", "big", HEAT)), (top, fresh.top("proj", "big", {}))]:
        assert same(got) == same(want)

    # ... and the CLI's
    want = cli_json(cli, "summary", "proj/big")
    chart = summary["chart"]
    assert {k: v for k, v in summary.items() if k not in ("chart", "version", "step_keys", "found")} == want
    window = cli_json(cli, "summary", "proj/big", "-m", chart["key"], "--steps",
                      f"{chart['step'][0]}:{chart['step'][-1] + 1}")["keys"][0]["variability"]
    assert chart["variability"] == window  # the noisier ranks the page shows
    want = cli_json(cli, "summary", "proj/big", "-m", "step_time", "--heatmap", "step_time")
    for k in ("buckets", "rows", "key", "agg"):
        assert heat["heatmap"][k] == want["heatmap"][k], k
    want = cli_json(cli, "top", "proj/big", "--once")
    assert same(top, ("history", "version")) == same(want)
    assert top["incidents"] and top["incidents"][0]["kind"] == "crashed"
    assert top["ranks"][0]["rank"] == 9 and top["ranks"][0]["status"] == "crashed"


def test_a_shard_changed_before_the_full_read_is_a_new_version(root: Path) -> None:
    api = Api(root, LiveRuns(HealthConfig()))
    summary = api.summary("proj", "big", {})
    assert summary["keys"][0]["stats"]["n"] == WORLD - 1  # (rank 9 crashed half-way)
    shard = root / "proj" / "big" / "metrics.rank3.jsonl"
    with open(shard, "ab") as fh:  # one more step of rank 3
        fh.write(b'{"_kind":"rank","_step":80,"_time":1.0,"_rank":3,"_world_size":1024,'
                 b'"step_time":0.5}\n')
    os.utime(shard)
    top = full_top(api)
    assert top["version"] != summary["version"]
    again = api.summary("proj", "big", {})
    assert again is not summary and again["version"] == top["version"]


def test_a_run_below_quick_min_is_read_in_full_at_once(root: Path) -> None:
    write_run(root / "proj" / "small", 8, 70, straggler=2, status="finished")
    api = Api(root, LiveRuns(HealthConfig()))
    top = api.top("proj", "small", {})
    assert "reading" not in top and len(top["ranks"]) == 8
