"""exprd at rest (issue 24): the health passes of idle runs back off up to IDLE_MAX
intervals and return to the interval when a run changes; passes due close together share
one wake-up. A fake monotonic clock makes the schedule exact."""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import exprd.health as health_mod
from exprd.health import IDLE_MAX, SLACK, DaemonHealth

from expr_tracker.health.config import HealthConfig


def _live_run(run: Path, ranks: int = 2) -> None:
    run.mkdir(parents=True)
    t0 = time.time() - 100
    for r in range(ranks):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        rows = "".join(json.dumps({"_step": s, "_time": t0 + s}) + "\n" for s in range(20))
        (run / f"{stem}.jsonl").write_text(rows)
        side = {"version": 1, "rank": r, "world_size": ranks, "host": socket.gethostname(),
                "pid": os.getpid(), "status": "running", "start_time": t0}
        (run / f"{stem}.meta.json").write_text(json.dumps(side))


def test_idle_runs_back_off_share_wakeups_and_return_on_change(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    runs = [root / "p" / f"r{i}" for i in range(3)]
    for run in runs:
        _live_run(run)
    clock = [1000.0]
    monkeypatch.setattr(health_mod, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                            time=time.time))
    health = DaemonHealth(HealthConfig(), None, [root], interval=1.0)
    passes: dict[Path, list[float]] = {run: [] for run in runs}
    wakeups = 0
    changed_at = None
    while clock[0] < 1016.0:
        now = clock[0]
        before = {k[0]: w.state for k, w in health.watchers.items()}
        health.tick(now)
        ran = [k[0] for k, w in health.watchers.items() if w.state is not before.get(k[0])]
        for run in ran:
            passes[run].append(now)
        wakeups += bool(ran) and changed_at is None
        if now == 1000.0:  # stagger one run: its next pass is due a little earlier
            health._due[(runs[2], None)] -= 0.2
        if changed_at is None and now >= 1008.0:  # run 0 gets a new row
            with open(runs[0] / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps({"_step": 20, "_time": time.time()}) + "\n")
            changed_at = now
        clock[0] = round(now + 0.05, 2)
    idle = passes[runs[1]]
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(idle)]
    # changed (the first read), then unchanged: 1, 2, 4, 4 ... intervals, a pass up to SLACK early
    want = [1.0, 2.0, 4.0, 4.0]
    assert len(gaps) >= len(want)
    for got, w in zip(gaps[:len(want)], want, strict=True):
        assert w - SLACK - 0.051 <= got <= w + 0.051, gaps
    assert max(gaps) <= IDLE_MAX + 0.051
    # the staggered run shares the others' wake-ups: never a wake-up of its own
    assert passes[runs[2]] == passes[runs[1]]
    assert wakeups == len([t for t in idle if t <= changed_at]) >= 4
    # run 0 saw its change on its next pass, and is checked every interval again after it
    first_after = next(t for t in passes[runs[0]] if t > changed_at)
    after = [t for t in passes[runs[0]] if t >= first_after]
    assert len(after) >= 2 and after[1] - after[0] <= 1.0 + 0.051, passes[runs[0]]
