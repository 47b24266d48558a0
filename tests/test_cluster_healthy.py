"""A healthy two-node job on the simulated cluster (DESIGN 21), spool and direct mode.

Every row of every rank lands exactly once; every shard's sidecar reads `finished` and
names the node its rank ran on; the login node's `expr shards` agrees; node0's exprd and
an `expr watch` on the login node record and page no hang, stall, missing, crash or
behind. The direct-mode job runs with node1's wall clock 120 s ahead (the clock-shift
case: its ranks stamp `_time` and their sidecars with it), which must change none of that;
one two-node job costs about 10 s of CPU to start, so the case shares it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, require_cluster
from tests.cluster_job import (
    SERIOUS,
    Job,
    Watcher,
    assert_exactly_once,
    brief,
    health_toml,
    login,
    serious,
    sidecar,
)
from tests.extras import need

# one worker runs every cluster test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("cluster")

STEPS = 100
HEALTH = health_toml(hang_after="5s", page_after="2s")
AHEAD = 120


@pytest.fixture(params=["spool", "direct"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(tmp_path: Path, mode: str) -> Iterator[Cluster]:
    require_cluster()
    need("torch", "torch")
    offsets = {1: AHEAD} if mode == "direct" else {}
    with Cluster(tmp_path / "c", clock_offsets=offsets) as c:
        yield c


def _check_clock(cluster: Cluster) -> None:
    """The shim moves node1's wall clock and leaves its sleeps alone."""
    node1 = cluster.nodes[1]
    now = node1.run(["python3", "-c", "import time; print(time.time())"])
    assert float(now.stdout) - time.time() > AHEAD - 10, now
    slept = node1.run(["python3", "-c", "import time; t = time.monotonic(); time.sleep(0.2); "
                       "print(time.monotonic() - t)"])
    assert 0.15 < float(slept.stdout) < 5, slept


def test_every_row_lands_once_sidecars_name_their_hosts_nothing_false(cluster: Cluster,
                                                                      mode: str) -> None:
    if mode == "direct":
        _check_clock(cluster)
    for node in cluster.nodes:  # in direct mode node0's exprd watches through watch_roots
        node.start_exprd(HEALTH)
    job = Job(cluster, f"healthy-{mode}", mode=mode, steps=STEPS,
              env={"EXPR_PROBE_AFTER": "2"}).start()
    watcher = Watcher(cluster, job, HEALTH)
    try:
        job.check_ok()
        job.wait_finished(list(range(job.world)))
        time.sleep(1.5)  # a few passes of the watchers over the finished run
    finally:
        watcher.stop()
    counts = assert_exactly_once(job)
    for rank in range(job.world):
        side = sidecar(job.run_dir, rank)
        assert side["status"] == "finished" and side["rank"] == rank, side
        assert side["host"] == f"node{rank // 2}", side
        assert job.ledger(rank)["host"] == side["host"]
        if mode == "spool":  # exprd wrote the rows, each with its spool event id
            assert len(counts[rank].events) == STEPS, counts[rank]
    if mode == "direct":  # node1 stamped its own clock, 120 s ahead of node0's
        assert sidecar(job.run_dir, 2)["end_time"] - sidecar(job.run_dir, 0)["end_time"] > 100
    # the login node reads the same: four shards, finished, on their nodes, every row
    shards = {s["rank"]: s for s in login(cluster, "shards", str(job.run_dir), "--all")}
    assert sorted(shards) == [0, 1, 2, 3], shards
    for rank, s in shards.items():
        assert (s["status"], s["host"], s["last_step"]) == ("finished", f"node{rank // 2}",
                                                             STEPS - 1), s
    # one pass of `expr watch` on the login node: the run ended, nothing is open (exit 0)
    lines = login(cluster, "watch", str(job.run_dir), "--once") or []
    assert not [x for x in lines if x.get("state") == "open"], lines
    assert not serious(job.run_dir), brief(job.run_dir)
    pages = [p for p in cluster.read_pages() if p["rule"].split(":")[1] in SERIOUS]
    assert not pages, pages
