"""Issue 54, the rest of its rows: readers dated by the filesystem's clock, the frontier
and its reason, `delivered` carried along an incident, and the small things a new user
sees. Real files and processes; a login node's clock shifted by the cluster harness's
LD_PRELOAD shim (tests/cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.synthetic import write_run


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    return {**env, "EXPR_DIR": str(root), "COLUMNS": "120", "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def expr(root: Path, *args: str, env: dict[str, str] | None = None, code: int = 0) -> str:
    got = subprocess.run([sys.executable, "-c", "from expr_cli.main import entry; entry()",
                          *args], env=env or _env(root), capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == code, got.stdout + got.stderr
    return got.stdout


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[Path]:
    """A 4-rank job writing a step every 0.2 s on every rank, as of now (its sidecars name
    this process, alive)."""
    run = write_run(tmp_path / "proj" / "live", 4, 20)
    for r in range(4):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        side.update(pid=os.getpid(), host=os.uname().nodename)
        meta.write_text(json.dumps(side))
    stop = threading.Event()

    def write() -> None:
        step = 20
        while not stop.wait(0.2):
            for r in range(4):
                with open(run / f"{_stem(r)}.jsonl", "a") as f:
                    f.write(json.dumps({"_step": step, "_time": time.time(), "loss": 0.5}) + "\n")
            step += 1

    t = threading.Thread(target=write, daemon=True)
    t.start()
    time.sleep(1.0)
    try:
        yield run
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("ahead", [3600, -3600])
def test_top_and_runs_date_a_live_job_by_the_filesystems_clock(
        live_run: Path, tmp_path: Path, ahead: int) -> None:
    """A login node whose clock is an hour off reads a healthy job as healthy: written
    seconds ago, running, no stall (was "stalled 60m at step 19", "last write 1h ago")."""
    if shutil.which("gcc") is None:
        pytest.skip("the clock shim needs gcc")
    from tests.cluster import clock_shim

    shim = tmp_path / "shim"
    shim.mkdir()
    env = _env(tmp_path, LD_PRELOAD=str(clock_shim(shim)), CLUSTER_CLOCK_OFFSET=str(ahead))
    top = json.loads(expr(tmp_path, "top", "--once", "--json", "proj/live", env=env))
    assert top["job"]["state"] == "running", top["job"]
    ages = [r["last_write_age"] for r in top["ranks"]]
    assert all(a is not None and a < 60 for a in ages), ages
    runs = json.loads(expr(tmp_path, "runs", "--json", env=env))
    # on the reader's (shifted) clock: within a minute of its now
    assert abs(runs[0]["last_write"] - (time.time() + ahead)) < 60, runs[0]
    text = expr(tmp_path, "runs", env=env)
    line = next(x for x in text.splitlines() if "proj/live" in x)
    assert "s ago" in line and "h ago" not in line and "m ago" not in line, text
