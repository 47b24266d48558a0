"""A healthy two-node job on the simulated cluster (DESIGN 21), spool and direct mode.

Every row of every rank lands exactly once; every shard's sidecar reads `finished` and
names the node its rank ran on; the login node's `expr shards` agrees.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, require_cluster
from tests.cluster_job import Job, assert_exactly_once, login, sidecar
from tests.extras import need

STEPS = 60


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    require_cluster()
    need("torch", "torch")
    with Cluster(tmp_path / "c") as c:
        yield c


@pytest.mark.parametrize("mode", ["spool", "direct"])
def test_every_row_lands_once_and_sidecars_name_their_hosts(cluster: Cluster, mode: str) -> None:
    if mode == "spool":
        for node in cluster.nodes:
            node.start_exprd()
    job = Job(cluster, f"healthy-{mode}", mode=mode, steps=STEPS).start()
    job.check_ok()
    job.wait_finished(list(range(job.world)))
    counts = assert_exactly_once(job)
    for rank in range(job.world):
        side = sidecar(job.run_dir, rank)
        assert side["status"] == "finished" and side["rank"] == rank, side
        assert side["host"] == f"node{rank // 2}", side
        assert job.ledger(rank)["host"] == side["host"]
        if mode == "spool":  # exprd wrote the rows, each with its spool event id
            assert len(counts[rank].events) == STEPS, counts[rank]
    # the login node reads the same: four shards, finished, on their nodes, every row
    shards = {s["rank"]: s for s in login(cluster, "shards", str(job.run_dir), "--all")}
    assert sorted(shards) == [0, 1, 2, 3], shards
    for rank, s in shards.items():
        assert (s["status"], s["host"], s["last_step"]) == ("finished", f"node{rank // 2}",
                                                             STEPS - 1), s
