"""A silent rank's shard still grows: what its tracker thread writes is not the loop's.

With system metrics on (the default) the tracker thread appends a sample every interval,
and after `idle_timeout` it commits the row the loop left open. Neither may count as the
rank advancing or writing: real rank processes (system samples every second, an idle
commit after 2 s) go quiet, and a live watcher and a single pass (`--once`) must still
see the hang of one quiet rank, and the stall of a job whose ranks are all quiet, as one
incident that stays open until the ranks log again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from expr_tracker.health.config import parse_health
from expr_tracker.health.watch import Watcher
from tests.procs import spawn

EXPR = [sys.executable, "-m", "expr_cli.main"]
QUIET = 10.0  # seconds each quiet rank sleeps
ENV = {"EXPR_SYSTEM_METRICS": "1", "EXPR_SYSTEM_INTERVAL": "1", "EXPR_PROBE_AFTER": "1",
       "WORLD_SIZE": "2"}

RANK = """
import time
import expr_tracker as et
et.init("p", "r", dir={root!r}, idle_timeout=2)
t0 = time.time()
for step in range({steps}):
    et.log({{"loss": 1.0 / (step + 1)}}, step=step)  # explicit steps: each row stays open
    time.sleep(0.05)
    if step == {quiet_at}:
        time.sleep({quiet})
et.finish()
"""


def _job(root: Path, plan: dict[int, tuple[int, int]]) -> list[subprocess.Popen[str]]:
    """Rank r logs `steps` steps and goes quiet for QUIET seconds after step `quiet_at`."""
    return [spawn(RANK.format(root=str(root), steps=steps, quiet_at=at, quiet=QUIET),
                  {**ENV, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r, (steps, at) in plan.items()]


def _watch(run: Path, until: float, once_at: float) -> tuple[list[Any], dict[str, Any] | None]:
    """A live watcher's passes every 0.3 s until `until`, and one `expr watch --once` in
    another process at `once_at`: the changes seen live, and the single pass's answer."""
    watcher = Watcher(run, parse_health({"hang_after": "4s"}))
    seen: list[Any] = []
    once = None
    while time.monotonic() < until:
        if run.is_dir():
            seen += watcher.check()
        if once is None and time.monotonic() >= once_at:
            p = subprocess.run([*EXPR, "watch", str(run), "--once", "--json", "--hang-after", "4s"],
                               capture_output=True, text=True, timeout=60)
            once = {"rc": p.returncode, "lines": [json.loads(x) for x in p.stdout.splitlines()],
                    "stderr": p.stderr}
        time.sleep(0.3)
    return seen, once


def _wait(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err


def _opened(run: Path, kind: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]
    return [i for i in lines if i["kind"] == kind and i["state"] == "open"]


def test_a_quiet_rank_is_a_hang_whatever_its_tracker_thread_writes(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    start = time.monotonic()
    # rank 0 logs on through rank 1's quiet spell
    procs = _job(tmp_path, {0: (400, -1), 1: (20, 10)})
    seen, once = _watch(run, start + 2 + QUIET, once_at=start + 9)
    _wait(procs)
    samples = [json.loads(x) for x in (run / "metrics.rank1.jsonl").read_text().splitlines()
               if '"system/' in x]
    assert len(samples) >= 5, "rank 1's tracker thread sampled while it was quiet"
    hangs = [i for i in seen if i.kind == "hang" and i.state == "open"]
    assert [i.ranks for i in hangs] == [(1,)], seen
    assert once is not None and any(i["kind"] == "hang" and i["ranks"] == [1] for i in once["lines"]), once
    # one hang, never resolved and opened again while rank 1 stayed quiet
    assert len(_opened(run, "hang")) == 1, _opened(run, "hang")


def test_a_quiet_job_is_one_stall_not_ended_by_an_idle_commit(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    start = time.monotonic()
    # both go quiet at once; rank 1 one step short, so it is the suspect
    procs = _job(tmp_path, {0: (20, 11), 1: (20, 10)})
    seen, once = _watch(run, start + 2 + QUIET, once_at=start + 10)
    _wait(procs)
    shard = [json.loads(x) for x in (run / "metrics.rank1.jsonl").read_text().splitlines()]
    rows = [r for r in shard if "_kind" not in r]
    # the row of step 10 was committed by the idle timeout, dated when it was logged
    ten = next(r for r in rows if r["_step"] == 10)
    nine = next(r for r in rows if r["_step"] == 9)
    assert ten["_time"] - nine["_time"] < 1.0, (nine, ten)
    stalls = [i for i in seen if i.kind == "stall"]
    assert [i.state for i in stalls][:1] == ["open"] and stalls[0].ranks == (1,), seen
    assert once is not None and once["rc"] == 1, once
    assert any(i["kind"] == "stall" for i in once["lines"]), once
    assert len(_opened(run, "stall")) == 1, _opened(run, "stall")
    # the watcher saw no slowdown or straggler from the step that waited
    assert not [i for i in seen if i.kind in ("slowdown", "straggler")], seen
