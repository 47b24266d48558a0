"""Attacks on the job-wide `silent` incident (issue 53; DESIGN 13 turn 5): what users meet
after a job ended without finishing. A rank that crashes after the others went silent, a
job resumed under the same run, every reader of a killed job's ranks (runs, shards,
summary, top, MCP list_runs), an incident line of 16,384 ranks read back in bounded size,
and the time the silence is dated by.

Synthetic runs (tests/synthetic.py: 8 ranks a host), their files aged with `os.utime`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.synthetic import write_run

AGE = 1200.0  # s: every file of the killed job


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


def _age(run: Path, seconds: float) -> None:
    old = time.time() - seconds
    for entry in os.scandir(run):
        if entry.name.startswith("metrics"):
            os.utime(entry.path, (old, old))


def _killed(tmp_path: Path, world: int = 16) -> Path:
    """A job of `world` ranks on world/8 hosts, killed (no finish) AGE seconds ago."""
    run = write_run(tmp_path / "proj" / "killed", world, 30)
    _age(run, AGE)
    return run


def _lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    return {**env, "EXPR_DIR": str(root), "COLUMNS": "80", "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join(sys.path)}


def expr(root: Path, *args: str, env: dict[str, str] | None = None, code: int = 0) -> str:
    got = subprocess.run([sys.executable, "-c", "from expr_cli.main import entry; entry()",
                          *args], env=env or _env(root), capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == code, got.stdout + got.stderr
    return got.stdout


def _mcp(root: Path, tool: str, **args: Any) -> Any:
    """An MCP tool's answer from a real `expr mcp` over `root`."""
    from tests.extras import need

    need("mcp", "mcp")
    from tests.mcpclient import McpClient
    from tests.procs import env_for

    # the server imports this tree, as `expr` above does
    c = McpClient(["--dir", str(root)], env_for({"PYTHONPATH": os.pathsep.join(sys.path)}))
    try:
        got = c.call(tool, timeout=120, **args)
    finally:
        c.close()
    assert not got.error, got.text
    return got


def test_a_rank_crashing_after_the_silence_updates_it_under_the_same_id(tmp_path: Path) -> None:
    """The crash is its own incident; the silence drops its rank and says it, as a line of
    the same id (no second `silent` page)."""
    from expr_tracker.health.watch import Watcher

    run = _killed(tmp_path)
    w = Watcher(run, owner=False)
    first = [i for i in w.check() if i.kind == "silent"]
    assert len(first) == 1 and first[0].ranks == tuple(range(16)), first
    meta = run / "metrics.rank5.meta.json"
    side = json.loads(meta.read_text())
    side.update(status="crashed", exit={"type": "RuntimeError", "message": "boom",
                                        "time": time.time()})
    meta.write_text(json.dumps(side))
    w.check()
    silent = [i for i in w.open if i.kind == "silent"]
    assert [i.id for i in silent] == [first[0].id], [i.detail for i in w.open]
    assert silent[0].ranks == tuple(r for r in range(16) if r != 5)
    assert silent[0].detail.endswith("; rank 5 crashed"), silent[0].detail
    assert "15 ranks (0-4,6-15)" in silent[0].detail
    assert {i.kind for i in w.open} == {"silent", "crashed"}
    opened = {x["id"] for x in _lines(run) if x["kind"] == "silent"}
    assert opened == {first[0].id}


def test_a_job_resumed_under_the_same_run_resolves_the_silence_once(tmp_path: Path) -> None:
    from expr_tracker.health.watch import Watcher

    run = _killed(tmp_path)
    w = Watcher(run, owner=False)
    assert [i.kind for i in w.check()] == ["silent"]
    for r in range(16):  # the job resumed from its checkpoint: rows again on every rank
        with open(run / f"{_stem(r)}.jsonl", "a") as f:
            f.write(json.dumps({"_step": 30, "_time": time.time(), "loss": 0.5}) + "\n")
    w.check()
    assert [i.kind for i in w.open] == [], [i.detail for i in w.open]
    for _ in range(2):
        w.check()
    silent = [x for x in _lines(run) if x["kind"] == "silent"]
    assert [x["state"] for x in silent] == ["open", "resolved"], silent
    assert len({x["id"] for x in silent}) == 1


def test_every_reader_says_a_silent_jobs_ranks_are_silent(tmp_path: Path) -> None:
    """Not `running` in runs and shards while only top says `silent`."""
    run = _killed(tmp_path)
    root = tmp_path
    expr(root, "watch", "--once", "proj/killed", code=1)  # records the incident
    runs = json.loads(expr(root, "runs", "--json"))
    assert [r["status"] for r in runs] == ["silent"], runs
    shards = json.loads(expr(root, "shards", "proj/killed", "--json"))
    assert {s["status"] for s in shards} == {"silent"}, shards
    summary = json.loads(expr(root, "summary", "proj/killed", "--json"))
    ranks = summary["ranks"]
    assert (ranks["live"], ranks["silent"]) == (0, 16), ranks
    assert "16 silent" in expr(root, "summary", "proj/killed")
    top = json.loads(expr(root, "top", "--once", "--json", "proj/killed"))
    assert {r["status"] for r in top["ranks"]} == {"silent"}
    listed = _mcp(root, "list_runs").json["runs"]
    assert [r["status"] for r in listed] == ["silent"], json.dumps(listed)
    assert run.is_dir()


@pytest.mark.xdist_group("heavy")  # with the other 16,384-rank tests, in turn
def test_a_silence_of_16384_ranks_is_read_back_in_bounded_size(tmp_path: Path) -> None:
    """incidents.jsonl keeps every rank; summary, runs, top and MCP give a count."""
    run = _killed(tmp_path)
    line = {"id": "0123456789ab", "kind": "silent", "state": "open", "delivered": True,
            "ranks": [r for r in range(16384) if r % 3], "level": "error",
            "hosts": [f"gpu-{h:04d}" for h in range(2048)], "step": 29,
            "first_seen": time.time(), "last_seen": time.time(),
            "detail": "every rank silent since 22:00:00 UTC (20m): the job ended without finishing"}
    (run / "incidents.jsonl").write_text(json.dumps(line) + "\n")
    root = tmp_path
    summary = expr(root, "summary", "proj/killed", "--json")
    assert len(summary) < 30_000, len(summary)
    got = json.loads(summary)["ranks"]["incidents"]
    assert got[0]["rank_count"] == len(line["ranks"]) and got[0]["ranks_cut"] is True
    assert len(expr(root, "runs", "--json")) < 30_000
    assert len(expr(root, "top", "--once", "--json", "proj/killed")) < 30_000
    listed = _mcp(root, "list_runs")  # (one run: not over the answer's cap, so not cut)
    assert listed.bytes < 30_000 and not listed.json["cut"], listed.json
    opened = listed.json["runs"][0]["open_incidents"]
    assert opened[0]["rank_count"] == len(line["ranks"]), opened
    assert len(opened[0]["ranks"]) <= 130 and opened[0]["ranks"].endswith(",..."), opened


@pytest.mark.parametrize("ahead", [3600, -3600])
def test_the_silence_is_dated_by_the_filesystems_clock(tmp_path: Path, ahead: int) -> None:
    """A login node whose clock is an hour off: the time printed is the files' (the
    filesystem's), which `ls -l` shows, not the login node's; the quiet is the same."""
    from tests.cluster import clock_shim

    run = _killed(tmp_path)
    newest = max(os.stat(e.path).st_mtime for e in os.scandir(run))
    env = {**_env(tmp_path), "LD_PRELOAD": str(clock_shim(tmp_path)),
           "CLUSTER_CLOCK_OFFSET": str(ahead)}
    out = expr(tmp_path, "watch", "--once", "--json", "proj/killed", env=env, code=1)
    line = json.loads(out.splitlines()[0])
    stamp = time.strftime("%H:%M:%S UTC", time.gmtime(newest))
    assert line["detail"].startswith(f"every rank silent since {stamp} (20m)"), line["detail"]


def _probing(run: Path, world: int, waits: dict[int, tuple[str, str]]) -> None:
    """Every rank's sidecar rewritten just now with a probe: rank -> (waiting, frame);
    its rows as old as they were (a checkpoint save or an eval that logs no rows)."""
    for r in range(world):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        waiting, frame = waits.get(r, waits.get(-1, ("io", "")))
        side["probe"] = {"since": time.time() - 590, "time": time.time() - 1,
                         "where": [frame], "spans": [], "waiting": waiting}
        meta.write_text(json.dumps(side))


SAVE = "torch/serialization.py:652 save"
ALL_REDUCE = "torch/distributed/distributed_c10d.py:2050 all_reduce"


def test_every_rank_alive_in_io_for_10_minutes_is_no_silence_and_blames_no_rank(
        tmp_path: Path) -> None:
    """A checkpoint save: every rank's probe fresh, in I/O, no rows for 10 minutes. Not a
    job-wide silence (they show life), and not a stall naming rank 0 for writing last
    longest ago (an innocent): a warning that every rank waits in I/O, naming none."""
    from expr_tracker.health.watch import Watcher

    run = write_run(tmp_path / "proj" / "ckpt", 16, 30)
    _age(run, 600.0)
    _probing(run, 16, {-1: ("io", SAVE)})
    got = Watcher(run, owner=False).check()
    assert [i.kind for i in got] == ["stall"], [i.detail for i in got]
    assert got[0].level == "warning" and got[0].ranks == tuple(range(16)), got[0]
    assert "every rank in I/O (save), alive" in got[0].detail, got[0].detail
    assert "longest ago" not in got[0].detail


def test_one_rank_evaluating_while_the_others_wait_is_named_not_silent(tmp_path: Path) -> None:
    """An eval on rank 0 with no rows while the others wait in a collective: rank 0 is
    the stall's suspect (not in a collective), at error level; no job-wide silence."""
    from expr_tracker.health.watch import Watcher

    run = write_run(tmp_path / "proj" / "eval", 16, 30)
    _age(run, 600.0)
    _probing(run, 16, {0: (None, "train.py:88 evaluate"), -1: ("collective", ALL_REDUCE)})
    got = Watcher(run, owner=False).check()
    assert [i.kind for i in got] == ["stall"], [i.detail for i in got]
    assert got[0].ranks == (0,) and got[0].level == "error", got[0]


def _finish(run: Path, ranks: range) -> None:
    """`ranks` finished AGE seconds ago (their sidecars say so)."""
    old = time.time() - AGE
    for r in ranks:
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        side.update(status="finished", end_time=old)
        meta.write_text(json.dumps(side))
        os.utime(meta, (old, old))


@pytest.mark.parametrize(("world", "done"), [(32, range(16)), (16, range(8))])
def test_half_the_nodes_finished_and_the_others_were_killed(tmp_path: Path, world: int,
                                                            done: range) -> None:
    """The killed half is one silence that says the other half finished, not "every rank
    silent"; and when the killed half is one node, still said (nothing was, before: no
    peer waits for it, so no lost node, and a stall needs every rank running)."""
    from expr_tracker.health.watch import Watcher

    run = _killed(tmp_path, world)
    _finish(run, done)
    got = Watcher(run, owner=False).check()
    assert [i.kind for i in got] == ["silent"], [i.detail for i in got]
    killed = tuple(r for r in range(world) if r not in done)
    assert got[0].ranks == killed
    detail = got[0].detail
    assert detail.startswith("every unfinished rank silent since "), detail
    assert f"{len(done)} ranks ({done[0]}-{done[-1]}) finished" in detail, detail
    nodes = (world - len(done)) // 8
    assert f"{len(killed)} ranks ({killed[0]}-{killed[-1]}) on {nodes} node" in detail, detail


def test_ranks_with_no_host_are_placed_by_their_local_rank(tmp_path: Path) -> None:
    """Sidecars without a host (nor local_world_size): torchrun places ranks on nodes in
    order, so a local rank 0 starts a node; a killed job of 2 nodes is still one silence
    (it was a stall blaming rank 0 for writing last longest ago)."""
    from expr_tracker.health.watch import Watcher

    run = _killed(tmp_path)
    for r in range(16):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        del side["host"]
        meta.write_text(json.dumps(side))
    _age(run, AGE)
    got = Watcher(run, owner=False).check()
    assert [i.kind for i in got] == ["silent"], [i.detail for i in got]
    assert "16 ranks (0-15) on 2 nodes (node0, node1)" in got[0].detail, got[0].detail


def test_a_killed_job_at_80_columns_in_top_and_watch(tmp_path: Path) -> None:
    """`expr top` at 80 columns keeps the crash root on the job's line (it was cut after
    "the job ended without finishing; ra…") and counts the silent ranks as not live
    ("64 ranks, 63 live" said the header); `expr watch` prints the whole incident."""
    run = write_run(tmp_path / "proj" / "killed", 64, 30, crashed=17)
    _age(run, AGE)
    watch = expr(tmp_path, "watch", "--once", "proj/killed", code=1)
    assert "63 ranks (0-16,18-63) on 8 nodes (gpu-0000 ... gpu-0007): no rows, no probes; " \
           "rank 17 crashed" in watch.replace("\n", " "), watch
    frame = expr(tmp_path, "top", "--once", "proj/killed").splitlines()
    assert all(len(line) <= 80 for line in frame), "\n".join(frame)
    assert "64 ranks, 0 live" in frame[0], frame[0]
    assert frame[1].startswith("every rank silent since "), frame[1]
    assert frame[1].endswith("the job ended without finishing"), frame[1]
    assert frame[2] == "rank 17 crashed first (RuntimeError: NCCL timeout)", frame[2]


@pytest.mark.parametrize(("hosts", "kind"), [(("n0", "n0", "n1", "n1"), "silent"),
                                             (("n0", "n0", "n0", "n0"), "stall")])
def test_two_nodes_of_two_ranks_is_the_smallest_silence(tmp_path: Path, hosts: tuple[str, ...],
                                                        kind: str) -> None:
    """2 nodes of 2 ranks killed: one silence; the same 4 ranks on 1 node: a stall (one
    node cannot tell a killed job from a stuck one), never `silent`."""
    from expr_tracker.health.watch import Watcher

    run = write_run(tmp_path / "proj" / "small", 4, 30)
    for r, host in enumerate(hosts):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        side.update(host=host, local_rank=r % 2, local_world_size=hosts.count(host))
        meta.write_text(json.dumps(side))
    _age(run, AGE)
    got = Watcher(run, owner=False).check()
    assert [i.kind for i in got] == [kind], [i.detail for i in got]
    if kind == "silent":
        assert "4 ranks (0-3) on 2 nodes (n0, n1)" in got[0].detail, got[0].detail
