"""`expr summary` while the job runs (issue 11): 4 real rank processes, rank 2 a straggler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

EXPR = Path(sys.executable).parent / "expr"
WORLD = 4
SLOW = 2

RANK_CODE = textwrap.dedent("""
    import os, sys, time
    import expr_tracker as et
    root, stop = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    run = et.init("p", "live", dir=root)
    period = 0.02 * (1.6 if rank == {slow} else 1.0)
    step = 0
    while not os.path.exists(stop):
        time.sleep(period)
        et.log({{"loss": 1.0 / (step + 1) + 0.001 * rank}}, step=step)
        # what the step cost this rank (its compute, before the all-reduce)
        run.log_rank_metrics({{"step_time": period * (1 + 0.001 * (step % 3))}}, step=step,
                             rank=rank, world_size={world})
        step += 1
    et.finish()
""").format(slow=SLOW, world=WORLD)


@pytest.fixture
def live_job(tmp_path):
    stop = tmp_path / "stop"
    procs = []
    for r in range(WORLD):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CODE, str(tmp_path), str(stop)],
                                      env=env, stderr=subprocess.PIPE))
    try:
        yield tmp_path, procs
    finally:
        stop.touch()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
            if p.stderr is not None:
                p.stderr.close()


def test_summary_of_a_live_job_reduces_at_the_frontier(live_job):
    root, procs = live_job
    run = root / "p" / "live"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until every rank has flushed some 20 steps
        shards = list(run.glob("metrics*.jsonl")) if run.exists() else []
        if len(shards) == WORLD and all(s.stat().st_size > 4000 for s in shards):
            break
        time.sleep(0.2)
    time.sleep(1.5)
    env = {**os.environ, "EXPR_DIR": str(root)}
    out = subprocess.run([str(EXPR), "summary", "p/live", "--json"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert all(p.poll() is None for p in procs), "the ranks must still be writing"
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["ranks"]["live"] == WORLD and view["world_size"] == WORLD
    assert view["why"].startswith("the frontier")
    st = next(i for i in view["keys"] if i["key"] == "step_time")
    assert st["stats"]["n"] == WORLD and st["missing"] == [] and st["behind"] == []
    assert [o["rank"] for o in st["outliers"] if o["flagged"]] == [SLOW]
    assert st["outliers"][0]["ratio"] == pytest.approx(1.6, rel=0.01)
    # the fast ranks are ahead of the frontier: the latest step of any rank would miss 3 of 4
    shards = json.loads(subprocess.run([str(EXPR), "shards", "p/live", "--json"],
                                       capture_output=True, text=True, env=env).stdout)
    assert max(s["last_step"] for s in shards) > view["step"]
