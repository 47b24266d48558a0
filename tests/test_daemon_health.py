"""exprd's health watching paces its passes by their cost (daemon/health.py)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from exprd.health import PACE, DaemonHealth

from expr_tracker.health.config import HealthConfig

RANKS = 300


def _live_run(run: Path) -> None:
    """A running run whose rank-0 sidecar names this host and this (live) process."""
    run.mkdir(parents=True)
    t0 = time.time() - 100
    for r in range(RANKS):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        rows = "".join(json.dumps({"_step": s, "_time": t0 + s}) + "\n" for s in range(100))
        (run / f"{stem}.jsonl").write_text(rows)
        side = {"version": 1, "rank": r, "world_size": RANKS, "host": socket.gethostname(),
                "pid": os.getpid(), "status": "running", "start_time": t0}
        (run / f"{stem}.meta.json").write_text(json.dumps(side))


def test_passes_are_spaced_by_ten_times_their_cost(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run = root / "p" / "live"
    _live_run(run)
    # a 1 ms interval: only the pacing keeps the watcher from running flat out
    health = DaemonHealth(HealthConfig(), None, [root], interval=0.001)
    start = time.monotonic()
    busy, passes = 0.0, 0
    earliest = 0.0  # when the next pass may start, by the previous one
    # 2 s, or (a loaded machine: a first pass of 0.3 s is followed by 3 s of pause) until
    # three passes ran
    while time.monotonic() - start < 2.0 or (passes < 3 and time.monotonic() - start < 15.0):
        state = next(iter(health.watchers.values())).state if health.watchers else None
        before = time.monotonic()
        health.tick(before)
        after = time.monotonic()
        watcher = health.watchers[(run, None)]
        if watcher.state is not state:  # a pass ran in this tick
            passes += 1
            took = health.last_pass[(run, None)]
            busy += took
            assert after - took >= earliest - 0.001  # it started late enough
            earliest = before + took + PACE * took
        time.sleep(0.001)
    elapsed = time.monotonic() - start
    assert passes >= 3  # the first pass (every tail read), then cheap ones
    assert busy / elapsed < 0.2, (busy, elapsed, passes)


def test_each_incident_is_logged_once(tmp_path: Path, caplog, capfd) -> None:
    """An incident delivered to exprd's `log` channel is that line alone: no health line
    beside it, no stderr copy (exprd's log is stderr already)."""
    import logging

    from exprd import config as config_mod
    from exprd.main import build_dispatcher

    root = tmp_path / "runs"
    run = root / "p" / "live"
    _live_run(run)
    side = run / "metrics.rank7.meta.json"
    meta = json.loads(side.read_text())
    meta.update(status="crashed", exit={"type": "RuntimeError", "message": "boom", "time": 1.0})
    side.write_text(json.dumps(meta))
    disp = build_dispatcher(config_mod.Config())
    health = DaemonHealth(HealthConfig(), disp, [root])
    caplog.set_level(logging.INFO)
    assert health.tick(time.monotonic()) == 1
    assert disp.flush(5)
    alerts = [r for r in caplog.records if r.name == "expr_tracker.alerts"]
    ours = [r for r in caplog.records if r.name == "exprd" and "crashed" in r.getMessage()]
    assert len(alerts) == 1 and "rank 7 crashed" in alerts[0].getMessage() and ours == []
    assert "expr alert" not in capfd.readouterr().err
    disp.close(2)
