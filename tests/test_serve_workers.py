"""`expr serve`'s answers when its first build is read by worker processes forked from a
fork server (a process with request threads may not fork), with the summary's scan
started before the live state is read: the same answers, rank for rank, as one process
reading everything itself (NaN and text values included)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="expr serve needs the serve extra (starlette, uvicorn)")

from expr_cli.web.api import Api
from expr_cli.web.live import LiveRuns
from expr_tracker.health import state as state_mod
from expr_tracker.health.config import HealthConfig
from expr_tracker.stats import parallel

from .synthetic import write_run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server")
WORLD, STEPS = 520, 80  # past the thresholds of the forked first pass and the parallel scan


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve-workers")
    run = write_run(root / "p" / "big", WORLD, STEPS, straggler=3, crashed=7)
    for r in (0, 11, 519):  # a NaN written as text and a text value in the last records
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        with open(run / f"{stem}.jsonl", "ab") as fh:
            fh.write(json.dumps({"_kind": "rank", "_step": STEPS, "_time": 1.0, "_rank": r,
                                 "_world_size": WORLD, "step_time": "NaN", "grad_norm": 1.0,
                                 "note": "warm-up"}).encode() + b"\n")
    return root


def _answers(root: Path) -> dict[str, Any]:
    api = Api(root, LiveRuns(HealthConfig()))
    run = ("p", "big")
    out = {"summary": api.summary(*run, {"chart": ["step_time"]}),
           "heatmap": api.heatmap(*run, {"metric": ["step_time"], "buckets": ["60"]}),
           "top": api.top(*run, {"limit": [str(WORLD)]})}  # (every rank: the default is a screenful)
    for v in out.values():
        v.pop("version", None)
    top = out.pop("top")
    clock = ("last_write_age", "steps_per_s", "no_step_for")  # (they move with the wall clock)
    out["ranks"] = [{k: v for k, v in r.items() if k not in clock} for r in top["ranks"]]
    out["incidents"] = sorted((i["kind"], tuple(i["ranks"]), i["step"]) for i in top["incidents"])
    return out


def test_answers_from_fork_server_workers_match_one_process(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # one process reads everything
        m.setattr(parallel, "PARALLEL_BYTES", 1 << 62)
        m.setattr(state_mod, "_FORK_MIN", 1 << 30)
        alone = _answers(root)

    got: dict[str, Any] = {}

    def request() -> None:  # as uvicorn's thread pool runs a request
        got["context"] = parallel._context().get_start_method()
        got["answers"] = _answers(root)

    monkeypatch.setattr(parallel, "_idle_core", lambda: True)  # (however busy this box is)
    parallel.use_fork_server()
    try:
        t = threading.Thread(target=request)
        t.start()
        t.join()
    finally:
        from multiprocessing import forkserver, resource_tracker

        forkserver._forkserver._stop()  # the fork server this test started, and the
        resource_tracker._resource_tracker._stop()  # tracker it started: no child left
        parallel._fork_server = False
    assert got["context"] == "forkserver"
    assert got["answers"] == alone
    assert alone["summary"]["world_size"] == WORLD and len(alone["ranks"]) == WORLD
    assert ("crashed", (7,), STEPS // 2 - 1) in alone["incidents"]


def test_no_idle_core_while_every_core_spins() -> None:
    """The fork server's workers run only while a core is idle now (`/proc/stat` over a
    tenth of a second): with a busy process per CPU there is none."""
    import os
    import subprocess
    import time

    assert parallel._cpu_times() is not None
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)
        assert not parallel._idle_core()
    finally:
        for p in spin:
            p.kill()
            p.wait()
