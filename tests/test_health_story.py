"""A run's story, told by every reader at default settings (issue 53): a NaN is an
incident, a finished run keeps its incidents and pages, a late watcher records what it
finds, MCP `list_runs` names a big run's crash, and `top` rates a spool-mode job by its
rows' times. Real rank processes and real files."""

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

NAN_JOB = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
stop = os.environ["STOP"]
with et.init("p", "nan", dir=os.environ["ROOT"]):
    s = 0
    deadline = time.time() + 90
    while not os.path.exists(stop) and time.time() < deadline:
        loss = float("nan") if rank == 1 and s == 100 else 1.0 / (s + 1)
        et.log({"loss": loss, "acc": 0.5})
        s += 1
        time.sleep(0.002 if s < 300 else 0.1)
"""


def expr(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], env=env_for(env),
                          capture_output=True, text=True, timeout=timeout)


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    (tmp_path / "stop").touch()
    for p in started:
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def _sidecar(run: Path, rank: int) -> dict[str, Any]:
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    try:
        return json.loads((run / name.replace(".jsonl", ".meta.json")).read_text())
    except (OSError, ValueError):
        return {}


def test_nan_is_one_incident_by_default(tmp_path: Path,
                                        procs: list[subprocess.Popen[str]]) -> None:
    """Row a: rank 1 logs a NaN loss at step 100, default settings. Every reader names
    the rank, the step and the key, long after the step left the readers' tail windows;
    one incident, recorded once, whoever looks again."""
    root, stop = tmp_path / "runs", tmp_path / "stop"
    for r in range(2):
        procs.append(spawn(NAN_JOB, {"RANK": str(r), "WORLD_SIZE": "2", "ROOT": str(root),
                                     "STOP": str(stop)}))
    run = root / "p" / "nan"

    def past() -> bool:  # rank 1's sidecar written after step 300 (the window is 64 steps)
        step = (_sidecar(run, 1).get("cursor") or {}).get("last_step")
        return type(step) is int and step > 300
    _wait(past, 60, "rank 1 past step 300")

    top = expr("top", str(run), "--once", "--json")
    assert top.returncode == 0, top.stderr
    incs = [i for i in json.loads(top.stdout)["incidents"] if i["kind"] == "nonfinite"]
    assert len(incs) == 1, incs
    assert incs[0]["ranks"] == [1] and incs[0]["step"] == 100 and incs[0]["metric"] == "loss"
    assert "loss is NaN on rank 1 at step 100" in incs[0]["detail"]

    first = expr("watch", str(run), "--once", "--json")
    assert first.returncode == 1, first.stderr + first.stdout  # open: a fact, not a blip
    shown = [i for i in map(json.loads, first.stdout.splitlines()) if i["kind"] == "nonfinite"]
    assert [(i["ranks"], i["step"], i["metric"]) for i in shown] == [([1], 100, "loss")]
    again = expr("watch", str(run), "--once", "--json")
    assert again.returncode == 1, again.stderr
    text = expr("watch", str(run), "--once")
    assert "loss is NaN on rank 1 at step 100" in text.stdout, text.stdout
    recorded = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "nonfinite"]
    assert [i["state"] for i in recorded] == ["open"], recorded  # once, not once a reader

    stop.touch()
    for p in procs:
        p.communicate(timeout=30)
    done = expr("watch", str(run), "--once", "--json")
    assert done.returncode == 0, done.stdout  # the run ended: nothing open
    recorded = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "nonfinite"]
    assert [i["state"] for i in recorded] == ["open", "resolved"], recorded
    assert recorded[-1]["reason"] == "run ended"
