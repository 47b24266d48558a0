"""`expr watch` on a real job: a straggler, a hung rank, a rank that raises, a NaN on a
non-alerting rank; direct mode and spool mode with exprd. Each incident is recorded and
delivered once; a second pass records nothing new."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import env_for, spawn

JOB = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
stop = os.environ["STOP"]
role = {0: "ok", 1: "nan", 2: "slow", 3: "hang", 4: "raise"}[rank]
kw = {}
if os.environ.get("SPOOL"):
    kw = {"upload_mode": "spool", "spool_dir": os.environ["SPOOL"]}
with et.init("p", "job", dir=os.environ["ROOT"], alert_rules=["isnan(loss) => critical: diverged"], **kw):
    s = 0
    deadline = time.time() + 60
    while not os.path.exists(stop) and time.time() < deadline:
        if role == "hang" and s == 5:
            et.flush()
            while not os.path.exists(stop) and time.time() < deadline:
                time.sleep(0.05)  # alive and silent
            break
        if role == "raise" and s == 8:
            et.flush()
            raise RuntimeError("boom")
        et.log({"loss": float("nan") if role == "nan" and s == 10 else 1.0 / (s + 1)}, step=s)
        s += 1
        time.sleep(0.12 if role == "slow" else 0.03)
"""
WORLD = 5
FLAGS = ["--hang-after", "2s", "--straggler-steps", "5", "--slowdown-ratio", "100",
         "--behind-steps", "100000"]


def expr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], env=env_for(),
                          capture_output=True, text=True, timeout=timeout)


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []
    stop = tmp_path / "stop"

    def start(root: Path, spool: Path | None = None) -> list[subprocess.Popen[str]]:
        for r in range(WORLD):
            env = {"RANK": str(r), "WORLD_SIZE": str(WORLD), "ROOT": str(root), "STOP": str(stop)}
            if spool is not None:
                env["SPOOL"] = str(spool)
            procs.append(spawn(JOB, env))
        return procs

    yield start
    stop.touch()
    for p in procs:
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def _config(path: Path, url: str) -> Path:
    path.write_text(f'[channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
                    '[policy]\nrate = 0\n[health]\nmissing_after = "10m"\n')
    return path


def _check_job(run: Path, cfg: Path, httpserver: Any) -> None:
    first = expr("watch", str(run), "--once", "--json", "--config", str(cfg), *FLAGS)
    assert first.returncode == 1, first.stderr  # incidents are open
    incs = [i for i in map(json.loads, first.stdout.splitlines()) if i["state"] == "open"]
    by_kind = {i["kind"]: i for i in incs}
    assert by_kind["straggler"]["ranks"] == [2], incs
    assert by_kind["hang"]["ranks"] == [3], incs
    assert by_kind["crashed"]["ranks"] == [4], incs
    assert "boom" in by_kind["crashed"]["detail"] or "crashed" in by_kind["crashed"]["detail"]
    assert by_kind["alert"]["ranks"] == [1] and "diverged" in by_kind["alert"]["detail"], incs
    assert all(i["hosts"] for i in incs)
    recorded = _lines(run / "incidents.jsonl")
    opened = [i for i in recorded if i["state"] == "open"]
    assert {i["kind"] for i in opened} >= {"straggler", "hang", "crashed", "alert"}
    # each incident reached the webhook once
    posts = [json.loads(req.get_data()) for req, _ in httpserver.log]
    assert sorted(p["rule"] for p in posts) == sorted(
        f"health:{i['kind']}:{','.join(map(str, i['ranks']))}" for i in opened if i["delivered"])
    assert {p["rule"].split(":")[1] for p in posts} >= {"straggler", "hang", "crashed", "alert"}
    # a second pass (a restarted watcher) records and delivers nothing new
    second = expr("watch", str(run), "--once", "--json", "--config", str(cfg), *FLAGS)
    assert second.returncode == 1, second.stderr
    assert len(_lines(run / "incidents.jsonl")) == len(recorded)
    assert len(httpserver.log) == len(posts)
    again = {i["kind"]: i["ranks"] for i in map(json.loads, second.stdout.splitlines())
             if i["state"] == "open"}
    assert again["hang"] == [3] and again["straggler"] == [2]


def _ready(run: Path) -> bool:
    side = run / "metrics.rank4.meta.json"
    if not (run / "alerts.rank1.jsonl").exists() or not side.exists():
        return False
    return json.loads(side.read_text()).get("status") == "crashed"


def test_watch_direct_mode(tmp_path: Path, job: Any, httpserver: Any) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    root = tmp_path / "runs"
    job(root)
    run = root / "p" / "job"
    _wait(lambda: _ready(run), 30, "the NaN alert and the crash")
    time.sleep(3.5)  # rank 3 silent for more than --hang-after while the others advance
    _check_job(run, _config(tmp_path / "alert.toml", httpserver.url_for("/hook")), httpserver)


def test_watch_flags_and_errors(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run = root / "p" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"_step": 0, "_time": 1.0}\n')
    ok = expr("watch", str(run), "--once", "--json")
    assert ok.returncode == 0 and ok.stdout == "", ok.stderr
    bad = expr("watch", str(run), "--once", "--hang-after", "soon")
    assert bad.returncode == 2 and "--hang-after" in bad.stderr and "Traceback" not in bad.stderr
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[health]\nstraggler_ratio = 0.5\n")
    bad = expr("watch", str(run), "--once", "--config", str(cfg))
    assert bad.returncode == 1 and "straggler_ratio" in bad.stderr and "Traceback" not in bad.stderr


def test_a_thresholds_only_config_leaves_the_page_to_a_watcher_with_channels(
        tmp_path: Path, httpserver: Any) -> None:
    """A config of `[health]` thresholds and no `[channels]` makes `expr watch` print
    only: no second copy of each incident on stderr (its default log channel), and the
    incident is recorded undelivered, so the watcher with a webhook (exprd, here another
    `expr watch`) still pages it, once."""
    from tests.synthetic import write_run

    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    run = write_run(tmp_path / "runs" / "p" / "r", 4, 30, crashed=2, status="finished")
    thresholds = tmp_path / "health.toml"
    thresholds.write_text('[health]\nhang_after = "8s"\n')
    first = expr("watch", str(run), "--once", "--config", str(thresholds))
    assert first.returncode == 1, first.stderr
    assert "crashed rank 2" in first.stdout
    assert "expr alert" not in first.stderr, first.stderr
    (crash,) = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "crashed"]
    assert crash["delivered"] is False
    assert not httpserver.log
    paged = expr("watch", str(run), "--once", "--config",
                 str(_config(tmp_path / "alert.toml", httpserver.url_for("/hook"))))
    assert paged.returncode == 1, paged.stderr
    assert [json.loads(req.get_data())["rule"] for req, _ in httpserver.log] == ["health:crashed:2"]
    assert [i["delivered"] for i in _lines(run / "incidents.jsonl") if i["kind"] == "crashed"][-1]


def test_watch_spool_mode_with_exprd_watching(tmp_path: Path, job: Any, httpserver: Any) -> None:
    from tests.test_daemon import start_exprd, stop, write_config

    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    url = httpserver.url_for("/hook")
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    extra = (f'[alert.channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
             '[alert.policy]\nrate = 0\n'
             '[health]\nhang_after = "2s"\nstraggler_steps = 5\nslowdown_ratio = 100\n'
             'behind_steps = 100000\n')
    daemon = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra))
    try:
        job(root, spool)
        run = root / "p" / "job"
        _wait(lambda: _ready(run), 40, "the NaN alert and the crash")
        # exprd itself records and delivers: wait for its hang incident on rank 3
        _wait(lambda: any(i["kind"] == "hang" and i["ranks"] == [3]
                          for i in _lines(run / "incidents.jsonl")), 30, "exprd's hang incident")
        _wait(lambda: {i["kind"] for i in _lines(run / "incidents.jsonl")}
              >= {"straggler", "hang", "crashed", "alert"}, 20, "exprd's incidents")
        _check_job(run, _config(tmp_path / "alert.toml", url), httpserver)
    finally:
        assert stop(daemon) == 0


def test_an_incident_of_thousands_of_scattered_ranks_is_one_short_line() -> None:
    """500 nodes that never started (8 ranks each, every other node): the line counts the
    ranks and cuts their list after a whole range, where it was 4,000 characters long."""
    from expr_cli.render.health import incident_text

    ranks = [r for node in range(0, 8000, 16) for r in range(node, node + 8)]
    text = incident_text({"kind": "missing", "state": "open", "ranks": ranks, "hosts": [],
                          "step": None, "detail": "no shard after 10m"}).plain
    assert text == "missing 4,000 ranks (0-7,16-23,32-39,48-55,64-71,...): no shard after 10m"
    whole = incident_text({"kind": "crashed", "ranks": list(range(16384)), "hosts": ["gpu-0"],
                           "step": 3, "detail": "x"}).plain
    assert whole == "crashed ranks 0-16383 on gpu-0 step 3: x"
