"""The crash root across nodes on hand-written runs (issue 53 rows 2-3; DESIGN 13 turn 5).

Real files and the real Watcher, CLI and MCP server: node1 lost while node0's ranks
crashed blaming it (every reader names node1's rank, not the rank that blamed it); a root
corrected after its page went out (one correction page); and the attacks: a rank killed
-9 on one node, two nodes' ranks killed at once, a peer named by hostname, a partition
(no rank killed), a login node's clock an hour ahead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from expr_tracker.health.incidents import CRASH_GRACE
from expr_tracker.health.watch import Watcher
from tests.procs import env_for
from tests.test_health_stall import CFG, WORLD, _lines, expr, write_rank

PEER = {"type": "RuntimeError", "message": "Read error [10.0.0.11]:52114: Connection reset "
        "by peer", "time": 1060.0}


def _node1_lost(run: Path, now: float) -> None:
    """node1 (ranks 2-3) died whole 40 s ago: no row, no probe since; node0's ranks
    crashed blaming its address 30 s ago (direct mode: no exprd)."""
    for r in (2, 3):
        write_rank(run, r, 50, now - 40, host="node1")
    for r in (0, 1):
        write_rank(run, r, 50, now - 30, status="crashed", exit=PEER, host="node0")


def test_a_lost_node_is_the_root_every_reader_names(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    _node1_lost(run, now)
    Watcher(run, CFG).check(now)
    lines = _lines(run)
    (node,) = [x for x in lines if x["kind"] == "lost"]
    assert node["hosts"] == ["node1"] and node["ranks"] == [2, 3], node
    assert any(x["kind"] == "crashed" and x.get("cause") == node["id"] for x in lines), lines
    summary = expr("summary", str(run), "--json")
    assert summary.returncode == 0, summary.stderr
    first = json.loads(summary.stdout)["ranks"]["first_crash"]
    assert (first["rank"], first["host"]) == (2, "node1"), first
    assert first["message"].startswith("node1 lost"), first
    text = expr("summary", str(run))
    assert "rank 2 failed first (node1 lost" in text.stdout, text.stdout
    top = expr("top", str(run), "--once", "--json")
    job = json.loads(top.stdout)["job"]
    assert job["state"] == "lost" and job["first_crash"]["rank"] == 2, job
    assert json.loads(top.stdout)["ranks"][0]["rank"] in (2, 3), top.stdout[:400]
    _mcp_root_is(tmp_path / "p", "p/r", 2)


def _mcp_root_is(root: Path, run: str, rank: int) -> None:
    from tests.extras import need

    need("mcp", "mcp")
    from tests.mcpclient import McpClient
    from tests.procs import env_for

    c = McpClient(["--dir", str(root.parent)], env_for())
    try:
        a = c.call("run_incidents", timeout=120, run=run)
    finally:
        c.close()
    assert not a.error, a.text
    assert a.json["crash_root"]["rank"] == rank, a.json["crash_root"]


def _hook(tmp_path: Path, httpserver: Any) -> Path:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    cfg = tmp_path / "alert.toml"
    cfg.write_text(f'[channels.hook]\ntype = "webhook"\nurl = "{httpserver.url_for("/hook")}"\n'
                   'retries = 0\n[policy]\nrate = 0\n')
    return cfg


def _pages(httpserver: Any) -> list[str]:
    return [json.dumps(req.get_json()) for req, _ in httpserver.log]


def test_a_root_corrected_after_its_page_sends_one_correction_page(
        tmp_path: Path, httpserver: Any) -> None:
    """Ranks 0-1 on node0 crashed blaming a peer longer ago than the grace: their crash
    opens and pages with rank 0 its root. Then node1's exprd says rank 2 died without an
    exception: the root is corrected (a line of the same id) and one page says so; the
    passes after it page nothing more."""
    cfg = _hook(tmp_path, httpserver)
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in (2, 3):
        write_rank(run, r, 50, now - 2, host="node1")
    for r in (0, 1):
        write_rank(run, r, 50, now - CRASH_GRACE - 5, status="crashed", exit=PEER,
                   host="node0")
    first = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert first.returncode == 1, first.stderr
    assert len(httpserver.log) == 1 and "rank 0" in _pages(httpserver)[0], _pages(httpserver)
    write_rank(run, 2, 50, now - 1, status="crashed", host="node1")
    write_rank(run, 3, 50, now - 1, status="crashed", exit=PEER, host="node1")
    for _ in range(2):
        again = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
        assert again.returncode == 1, again.stderr
    lines = _lines(run)
    assert len({x["id"] for x in lines}) == 1 and lines[-1]["root"]["rank"] == 2, lines
    pages = _pages(httpserver)
    assert len(pages) == 2, pages
    assert "root corrected: rank 2 on node1" in pages[1], pages[1]


# -- attacks (issue 53 rows 2-3) ----------------------------------------------------------

def _dead_pid() -> int:
    """The pid of a process of this host that is gone (a rank killed -9)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _set_pid(run: Path, rank: int, pid: int) -> None:
    meta = run / ("metrics.meta.json" if rank == 0 else f"metrics.rank{rank}.meta.json")
    st = meta.stat()
    side = json.loads(meta.read_text())
    meta.write_text(json.dumps({**side, "pid": pid}))
    os.utime(meta, (st.st_atime, st.st_mtime))


def _crashes(run: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for x in _lines(run):
        if x["kind"] == "crashed":
            out.setdefault(x["id"], []).append(x)
    return out


def test_a_rank_killed_on_a_single_node_job_is_the_root(tmp_path: Path) -> None:
    """One host: rank 2 killed -9 (its process gone, no exception), the others ended by
    gloo with "Connection closed by peer", no address in it: one crash, rank 2 its root,
    opened in the first pass (nothing to wait for)."""
    run = tmp_path / "p" / "r"
    now = time.time()
    here = socket.gethostname()
    gone = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer",
            "time": now - 4}
    for r in range(WORLD):
        write_rank(run, r, 50, now - 5, host=here, status="running" if r == 2 else "crashed",
                   exit=None if r == 2 else gone)
    _set_pid(run, 2, _dead_pid())
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("crashed", (0, 1, 2, 3))], opened
    assert (opened[0].root or {})["rank"] == 2, opened[0].root
    summary = json.loads(expr("summary", str(run), "--json").stdout)
    assert summary["ranks"]["first_crash"]["rank"] == 2, summary["ranks"]


def test_two_ranks_killed_at_once_on_two_nodes_are_one_crash(tmp_path: Path) -> None:
    """Rank 1 (node0) and rank 2 (node1) killed -9 at once, seen a pass apart; ranks 0 and
    3 blame their peers: one crash incident, its root one of the ranks killed, paged
    once; every reader names the same rank."""
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 50, now - 30, host=f"node{r // 2}")
    for r in (0, 1):
        write_rank(run, r, 50, now - 4, status="crashed", host="node0",
                   exit=PEER if r == 0 else None)
    w = Watcher(run, CFG)
    w.check(now)
    for r in (2, 3):
        write_rank(run, r, 50, now - 3, status="crashed", host="node1",
                   exit=PEER if r == 3 else None)
    w.check(now + 1)
    (lines,) = _crashes(run).values()
    assert lines[-1]["ranks"] == [0, 1, 2, 3] and lines[-1]["root"]["rank"] == 1, lines
    summary = json.loads(expr("summary", str(run), "--json").stdout)
    assert summary["ranks"]["first_crash"]["rank"] == 1, summary["ranks"]
    top = json.loads(expr("top", str(run), "--once", "--json").stdout)
    assert top["job"]["first_crash"]["rank"] == 1, top["job"]


def test_a_peer_named_by_hostname_is_blamed_as_one_named_by_address(tmp_path: Path) -> None:
    """"Connection reset by peer" naming node1 by its hostname, not its IP: the crash
    waits for the peer's own as it does for an address, and the rank killed is the root."""
    run = tmp_path / "p" / "r"
    now = time.time()
    by_name = {"type": "RuntimeError", "message": "[../gloo/transport/tcp/pair.cc:598] Read "
               "error [node1.cluster.local]:52114: Connection reset by peer", "time": 1060.0}
    for r in range(WORLD):
        write_rank(run, r, 50, now - 5, host=f"node{r // 2}")
    for r in (0, 1):
        write_rank(run, r, 50, now - 3, status="crashed", exit=by_name, host="node0")
    w = Watcher(run, CFG)
    assert w.check(now) == []  # held for the peer's crash
    write_rank(run, 2, 50, now - 2, status="crashed", host="node1")
    w.check(now + 1)
    (lines,) = _crashes(run).values()
    assert [x["root"]["rank"] for x in lines] == [2] * len(lines), lines


def test_a_partition_with_no_rank_killed_opens_the_crash_after_the_grace(tmp_path: Path) -> None:
    """A network partition: node0's ranks crash blaming node1, whose ranks live on (their
    probes fresh, waiting in a collective); no rank was killed. The crash is held for the
    grace, then opens with node0's rank its root; node1 is not named lost."""
    from tests.test_health_stall import COLLECTIVE

    run = tmp_path / "p" / "r"
    now = time.time()
    for r in (2, 3):
        write_rank(run, r, 50, now - 30, host="node1", probe=COLLECTIVE, side=now - 1)
    for r in (0, 1):
        write_rank(run, r, 50, now - 2, status="crashed", exit=PEER, host="node0")
    w = Watcher(run, CFG)
    assert [i.kind for i in w.check(now)] == []
    for r in (2, 3):  # their tracker threads rewrite the probes
        write_rank(run, r, 50, now - 30, host="node1", probe=COLLECTIVE, side=now + 9)
    w.check(now + 10)
    for r in (2, 3):
        write_rank(run, r, 50, now - 30, host="node1", probe=COLLECTIVE,
                   side=now + CRASH_GRACE + 1)
    opened = w.check(now + CRASH_GRACE + 2)
    assert [(i.kind, i.ranks) for i in opened] == [("crashed", (0, 1))], opened
    assert (opened[0].root or {})["rank"] == 0
    assert not [x for x in _lines(run) if x["kind"] == "lost"], _lines(run)


@pytest.mark.parametrize("ahead", [3600, -3600])
def test_a_login_node_an_hour_off_joins_the_crash_another_watcher_opened(
        tmp_path: Path, ahead: int) -> None:
    """exprd (a true clock) opened node0's crash; `expr watch` on a login node whose clock
    is an hour ahead (or behind) sees rank 2 killed: it joins that crash and corrects its
    root; it does not open (and page) a second one an hour "after" the first."""
    from tests.cluster import clock_shim

    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 50, now - 5, host=f"node{r // 2}")
    for r in (0, 1):
        write_rank(run, r, 50, now - CRASH_GRACE - 5, status="crashed", exit=PEER,
                   host="node0")
    Watcher(run, CFG).check()
    for r in (2, 3):
        write_rank(run, r, 50, now - 1, status="crashed", host="node1",
                   exit=None if r == 2 else PEER)
    env = env_for({"LD_PRELOAD": str(clock_shim(tmp_path)),
                   "CLUSTER_CLOCK_OFFSET": str(ahead)})
    out = subprocess.run([sys.executable, "-m", "expr_cli.main", "watch", str(run), "--once",
                          "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    crashes = _crashes(run)
    assert len(crashes) == 1, crashes
    (lines,) = crashes.values()
    assert lines[-1]["ranks"] == [0, 1, 2, 3] and lines[-1]["root"]["rank"] == 2, lines


def test_a_rank_killed_where_no_watcher_can_see_its_pid_is_the_root(tmp_path: Path) -> None:
    """One host the watcher is not on (a login node's `expr watch`, direct mode): rank 2
    killed -9 stays `running` by its sidecar, but it went silent (no row, no probe) before
    its peers crashed blaming a peer, and stays silent. It is the root, not rank 0."""
    run = tmp_path / "p" / "r"
    now = time.time()
    gone = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer",
            "time": 1060.0}
    for r in range(WORLD):
        write_rank(run, r, 50, now - 40 if r == 2 else now - 30, host="gpu-7",
                   status="running" if r == 2 else "crashed", exit=None if r == 2 else gone)
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, (i.root or {}).get("rank")) for i in opened] == [("crashed", 2)], opened
    assert opened[0].ranks == (0, 1, 2, 3), opened[0]
    summary = json.loads(expr("summary", str(run), "--json").stdout)
    assert summary["ranks"]["first_crash"]["rank"] == 2, summary["ranks"]
    # alive (its probe rewritten while it waits): not the root, nor crashed
    from tests.test_health_stall import COLLECTIVE

    run2 = tmp_path / "p" / "r2"
    for r in range(WORLD):
        write_rank(run2, r, 50, now - 40 if r == 2 else now - 30, host="gpu-7",
                   status="running" if r == 2 else "crashed", exit=None if r == 2 else gone,
                   probe=COLLECTIVE if r == 2 else None, side=now - 2 if r == 2 else None)
    opened = Watcher(run2, CFG).check(now)
    assert [(i.kind, i.ranks, (i.root or {}).get("rank")) for i in opened] == [
        ("crashed", (0, 1, 3), 0)], opened


@pytest.mark.parametrize("message", [
    "Connect error [10.0.0.11]:29500: Connection refused",
    "[gloo] connect [node1]:29500: No route to host",
    "NCCL error: remote process exited or there was a network error, NCCL version 2.19.3",
])
def test_other_words_for_a_peer_gone_wait_for_its_crash(tmp_path: Path, message: str) -> None:
    """Transports say a peer went away in more words than "reset by peer": the crash of
    the ranks that say so waits for the peer's own, which is the root (they are the words
    a lost node's collateral is found by, `stall.PEER_ERRORS`)."""
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 50, now - 5, host=f"node{r // 2}")
    for r in (0, 1):
        write_rank(run, r, 50, now - 3, status="crashed", host="node0",
                   exit={"type": "RuntimeError", "message": message, "time": 1060.0})
    w = Watcher(run, CFG)
    assert w.check(now) == []  # held for the peer's crash
    write_rank(run, 2, 50, now - 2, status="crashed", host="node1")
    w.check(now + 1)
    (lines,) = _crashes(run).values()
    assert [x["root"]["rank"] for x in lines] == [2] * len(lines), lines
