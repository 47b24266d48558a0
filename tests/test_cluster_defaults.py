"""A dead node and a cut link at the default thresholds (issue 48 items 1, 2 and 5; DESIGN
13, 21).

The other cluster cases run with `hang_after` 5 s to stay short; these run with an empty
`[health]` table and the SDK's default `probe_after`, as a user would, and hold the
watchers to the design's promise: with probe evidence (a lost node, every rank waiting) the
truth is named within the default threshold, max(60 s, 10x the median step period), plus
10 s. Each case waits out that minute, so the two run at once, each on its own cluster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from expr_tracker.health.config import EVIDENCE_FLOOR
from tests.cluster import Cluster, require_cluster, wait_for
from tests.cluster_job import Job, Watcher, brief, count_rows, health_toml, login, serious
from tests.extras import need

# one worker runs every cluster test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("cluster")

DEFAULTS = health_toml()  # every threshold its default; page_after too
# the jobs step every ~30 ms: the default threshold is its floor, a minute
BOUND = EVIDENCE_FLOOR + 10


def _started(cluster: Cluster, name: str, steps: int) -> tuple[Job, Watcher]:
    """An exprd per node and a login watcher, all at the defaults, and a spool-mode job
    past its 30th step."""
    for node in cluster.nodes:
        node.start_exprd(DEFAULTS)
    job = Job(cluster, name, mode="spool", steps=steps).start()
    watcher = Watcher(cluster, job, DEFAULTS)
    try:
        job.wait_steps(30, timeout=120)
    except BaseException:
        watcher.stop()
        raise
    return job, watcher


def _dead_node(cluster: Cluster) -> str:
    """node1 dies whole in spool mode: one incident names node1 lost with ranks 2-3 within
    BOUND; the crash of ranks 0-1 joins it; `expr top` reads ranks 2-3 lost; node1's spool,
    applied after a reboot, holds every row once."""
    job, watcher = _started(cluster, "dies", 100_000)
    try:
        time.sleep(6)  # every exprd has left its heartbeat (every 5 s) where others look
        cluster.nodes[1].kill()
        killed_at = time.monotonic()

        def lost() -> list[dict[str, Any]] | None:
            return next((x for x in serious(job.run_dir).values() if x[0]["kind"] == "lost"),
                        None)

        node = wait_for(lost, BOUND + 5, lambda: f"node1 named lost; {brief(job.run_dir)}")
        took = time.monotonic() - killed_at
        assert node[-1]["hosts"] == ["node1"] and node[-1]["ranks"] == [2, 3], node[-1]
        assert took <= BOUND, f"node1 named lost {took:.0f}s after it died (bound {BOUND:.0f}s)"
        others = [x for i, x in serious(job.run_dir).items() if i != node[0]["id"]]
        assert all(x[0]["kind"] == "crashed" for x in others), brief(job.run_dir)
        wait_for(lambda: all(x[-1].get("cause") == node[0]["id"]
                             for i, x in serious(job.run_dir).items() if i != node[0]["id"]),
                 15, lambda: f"the crash of ranks 0-1 joined to node1's loss; {brief(job.run_dir)}")
        top = login(cluster, "top", str(job.run_dir), "--once", ok=(0, 1))
        states = {r["rank"]: r.get("status") for r in top["ranks"]}
        assert states.get(2) == states.get(3) == "lost", top["ranks"]
    finally:
        watcher.stop()
    cluster.nodes[1].boot()
    cluster.nodes[1].start_exprd(DEFAULTS)
    wait_for(lambda: not any(c.lost for c in count_rows(job).values()), 30,
             lambda: "; ".join(str(c) for c in count_rows(job).values()))
    for c in count_rows(job).values():
        assert not c.doubled and not c.doubled_events and not c.garbled, str(c)
    return f"node1 named lost {took:.0f}s after it died"


def _cut_link(cluster: Cluster) -> str:
    """node1's link is down until the stall is seen: within BOUND the stall says every rank
    waits and names none; it resolves once the link is back, and every row lands once."""
    job, watcher = _started(cluster, "cut", 400)
    try:
        cluster.nodes[1].link(up=False)
        cut_at = time.monotonic()
        try:
            stall = wait_for(lambda: next((x for x in serious(job.run_dir).values()
                                           if x[0]["kind"] == "stall"), None),
                             BOUND + 5, lambda: f"a stall; {brief(job.run_dir)}")
            took = time.monotonic() - cut_at
        finally:
            cluster.nodes[1].link(up=True)
        assert took <= BOUND, f"the stall named {took:.0f}s after the cut (bound {BOUND:.0f}s)"
        assert "every rank waits" in stall[0]["detail"], stall[0]
        job.check_ok(120)
        job.wait_finished([0, 1, 2, 3])
        time.sleep(2)  # the watchers' passes over the finished run
    finally:
        watcher.stop()
    found = serious(job.run_dir)
    assert len(found) == 1, brief(job.run_dir)  # the one stall: no hang, crash or lost node
    (lines,) = found.values()
    assert all(set(x["ranks"]) in (set(), {0, 1, 2, 3}) for x in lines), brief(job.run_dir)
    assert lines[-1]["state"] == "resolved", lines
    for c in count_rows(job).values():
        assert c.logged == list(range(400)) and not c.lost and not c.doubled, str(c)
    return f"the stall named {took:.0f}s after the cut"


def test_a_dead_node_and_a_cut_link_are_named_within_the_default_threshold(
        tmp_path: Path) -> None:
    require_cluster()
    need("torch", "torch")
    cases: dict[str, tuple[Callable[[Cluster], str], dict[str, Any]]] = {
        "dead": (_dead_node, {"spool_sizes": {1: None}}),
        "cut": (_cut_link, {}),
    }
    said: dict[str, str] = {}
    failed: dict[str, BaseException] = {}

    def run(name: str) -> None:
        case, kw = cases[name]
        try:
            with Cluster(tmp_path / name, **kw) as cluster:
                said[name] = case(cluster)
        except BaseException as exc:  # (re-raised below, in the test's thread)
            failed[name] = exc

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, exc in failed.items():
        raise AssertionError(f"the {name} case failed: {exc}") from exc
    print(said)
