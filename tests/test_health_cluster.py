"""The truth about a cluster while it runs (issue 48), on one machine.

A node is a UTS namespace (`unshare -u`, its own hostname) with its own exprd and spool:
a real gloo job of 4 ranks, ranks 0-1 on node0 and 2-3 on node1, spooled to their node's
exprd, which writes the shards into one run root and touches its heartbeat there. node1
is killed whole (its ranks and its exprd, SIGKILL): gloo takes ranks 0-1 down ("Connection
reset/closed by peer"), ranks 2-3 and node1's exprd go silent. node0's exprd names node1
lost with its ranks; the crash of ranks 0-1 joins it as collateral; `top`, `runs` and
`shards` read ranks 2-3 `lost`, not `running`.

The rest run on hand-written runs (real files, a real webhook on 127.0.0.1, real `expr`
processes): every rank waiting, delivery per run, `page_after`, a page recorded delivered
only when a channel delivered it, one view of incidents.jsonl, and the defaults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.watch import INCIDENTS, Watcher
from tests.extras import need
from tests.procs import env_for
from tests.test_health_stall import COLLECTIVE, SLEEP, WORLD, _lines, expr, write_rank

# one worker runs every cluster test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("cluster")

EVIDENCE = 4.0  # s: the lost node's threshold in this test (default max(60 s, 10 periods))

TRAIN = """
import os, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import expr_tracker as et

dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run = et.init("c", "job", dir=os.environ["ROOT"])
step = 0
while True:  # until its node is killed, or a peer's
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    et.log({"loss": loss.item()}, step=step)
    step += 1
    time.sleep(0.05)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _on(host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`argv` in a UTS namespace of its own whose hostname is `host` (a node), in a process
    group of its own (a node killed whole is its groups)."""
    with open(log, "ab") as err:
        return subprocess.Popen(
            ["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *argv],
            stdout=subprocess.DEVNULL, stderr=err, env=env_for(env), start_new_session=True)


class Cluster:
    """Two nodes: an exprd each (own spool and state), two ranks each."""

    def __init__(self, tmp: Path) -> None:
        from tests.test_daemon import EXPRD, write_config

        self.root = tmp / "runs"
        self.run = self.root / "c" / "job"
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {"node0": [], "node1": []}
        script = tmp / "train.py"
        script.write_text(TRAIN)
        port = _free_port()
        for n, node in enumerate(self.procs):
            spool, state = tmp / f"spool{n}", tmp / f"state{n}"
            spool.mkdir(mode=0o700)
            cfg = write_config(tmp / f"exprd{n}.toml", spool, state, [self.root],
                               extra=f'[health]\nevidence_after = "{EVIDENCE:g}s"\n')
            self.procs[node].append(_on(node, [*EXPRD, "--config", str(cfg), "--allow-root"], {},
                                        tmp / f"exprd{n}.log"))
            for local in range(2):
                rank = 2 * n + local
                env = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "EXPR_MODE": "spool",
                       "EXPR_SPOOL": str(spool), "EXPR_PROBE_AFTER": "1", "ROOT": str(self.root)}
                self.procs[node].append(_on(node, [sys.executable, str(script)], env,
                                            tmp / f"rank{rank}.log"))

    def kill(self, node: str) -> None:
        for p in self.procs[node]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def stop(self) -> None:
        for node in self.procs:
            self.kill(node)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    need("torch", "torch")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-u", "true"], capture_output=True).returncode != 0:
        pytest.skip("no UTS namespace here (unshare -u)")
    c = Cluster(tmp_path)
    yield c
    c.stop()


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def _steps(run: Path) -> int:
    try:
        return min(len((run / f"metrics{'' if r == 0 else f'.rank{r}'}.jsonl").read_bytes()
                       .splitlines()) for r in range(4))
    except OSError:
        return 0


def _json(*args: str) -> Any:
    proc = expr(*args, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


# on the cluster harness (netns nodes, torchrun) at the defaults: test_cluster_defaults.py
@pytest.mark.torture
def test_a_node_killed_whole_is_one_incident_naming_it_and_its_ranks_read_lost(
        cluster: Cluster, tmp_path: Path) -> None:
    run = cluster.run
    _wait(lambda: _steps(run) >= 10, 90, "every rank's steps (logs in tmp_path)")
    # each node's exprd touches its heartbeat in the run directory
    _wait(lambda: (run / ".exprd.node1.json").exists() and (run / ".exprd.node0.json").exists(),
          10, "the heartbeats")
    cluster.kill("node1")
    killed = time.monotonic()

    def lost() -> list[dict[str, Any]]:
        return [i for i in _lines(run) if i["kind"] == "lost"]

    # the default threshold here is EVIDENCE; exprd's pass, the SDK's probe and the
    # crash of ranks 0-1 come on top
    _wait(lambda: lost(), EVIDENCE + 25, "node0's exprd to name node1 lost")
    took = time.monotonic() - killed
    assert took < EVIDENCE + 20, took
    node = lost()[0]
    assert node["ranks"] == [2, 3] and node["hosts"] == ["node1"], node
    assert node["detail"].startswith("node1 lost: ranks 2-3 and exprd silent"), node["detail"]
    # gloo took ranks 0-1 down: their crash is collateral of node1's loss
    _wait(lambda: any(i["kind"] == "crashed" and i.get("cause") == node["id"]
                      for i in _lines(run)), 15, "the crash to join node1's loss")
    crashed = [i for i in _lines(run) if i["kind"] == "crashed"]
    assert len({i["id"] for i in crashed}) == 1, crashed
    assert set(crashed[-1]["ranks"]) <= {0, 1} and "collateral: node1 lost" in crashed[-1]["detail"]
    assert not [i for i in _lines(run) if i["kind"] in ("stall", "hang")], _lines(run)
    # the readers: ranks 2-3 lost, not running
    top = _json("top", str(run), "--once")
    assert {r["rank"]: r["status"] for r in top["ranks"]}[2] == "lost", top["ranks"]
    assert {r["rank"]: r["status"] for r in top["ranks"]}[3] == "lost"
    assert top["job"]["state"] == "lost" and "node1 lost" in top["job"]["text"], top["job"]
    (row,) = _json("runs", "--dir", str(cluster.root))
    assert row["status"] == "crashed" and row["lost"] == [2, 3], row  # (a rank crashed: worst)
    shards = {r["rank"]: r["status"] for r in _json("shards", str(run))}
    assert shards[2] == shards[3] == "lost", shards


# -- on hand-written runs ----------------------------------------------------------------

def _hook_config(path: Path, url: str, extra: str = "") -> Path:
    path.write_text(f'[channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
                    f'[policy]\nrate = 0\n{extra}')
    return path


def test_every_rank_waiting_names_no_rank_and_gives_the_last_peer_error(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):  # every rank in the all-reduce, rank 2 a step behind (no evidence)
        write_rank(run, r, 40 if r != 2 else 39, now - 70, probe=COLLECTIVE, side=now - 1)
    # a frame of rank 1's probe names the peer error gloo saw
    meta = json.loads((run / "metrics.rank1.meta.json").read_text())
    meta["probe"]["where"].insert(0, "/venv/torch/distributed/c10d.py:99 wait "
                                     "(Connection reset by peer [10.0.0.7]:29500)")
    (run / "metrics.rank1.meta.json").write_text(json.dumps(meta))
    os.utime(run / "metrics.rank1.meta.json", (now - 1, now - 1))
    opened = Watcher(run, HealthConfig(hang_after=600.0)).check(now)  # default evidence: 60 s
    (stall,) = [i for i in opened if i.kind == "stall"]
    assert "every rank waits in all_reduce; none stands out" in stall.detail, stall.detail
    assert "last peer error: rank 1" in stall.detail and "Connection reset by peer" in stall.detail
    assert "rank 2 at step 39" not in stall.detail and "the lowest" not in stall.detail
    top = _json("top", str(run), "--once")
    assert top["job"]["state"] == "stalled" and top["job"]["suspects"] == [], top["job"]
    assert "none stands out" in top["job"]["text"]


def test_defaults_raise_a_stall_with_evidence_after_a_minute_not_five(tmp_path: Path) -> None:
    cfg = HealthConfig()
    assert cfg.evidence_threshold(0.1) == 60.0 and cfg.evidence_threshold(12.0) == 120.0
    assert cfg.hang_threshold(0.1) == 300.0
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):  # rank 3 sleeps in its data loader, the others wait for it
        write_rank(run, r, 40, now - 65, probe=SLEEP if r == 3 else COLLECTIVE, side=now - 1)
    opened = Watcher(run).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (3,))], opened
    # no evidence (no probes): the lowest step waits for hang_after
    quiet = tmp_path / "p" / "q"
    for r in range(WORLD):
        write_rank(quiet, r, 40 if r != 3 else 39, now - 65)
    assert [i for i in Watcher(quiet).check(now) if i.kind == "stall"] == []


def test_two_runs_stalling_on_rank_3_both_page_and_a_blip_pages_nothing(
        tmp_path: Path, httpserver: Any) -> None:
    """One dispatcher (as exprd has) for two runs: before, the dedup key was the rule
    `health:stall:3` and the second run's page was suppressed."""
    from expr_tracker.alerts import Dispatcher, load_config

    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    cfg_path = _hook_config(tmp_path / "a.toml", httpserver.url_for("/hook"),
                            "dedup_seconds = 600\n")
    disp = Dispatcher.from_config(load_config(None, path=str(cfg_path)))
    cfg = HealthConfig(hang_after=600.0)
    now = time.time()
    try:
        watchers = []
        for name in ("a", "b"):
            run = tmp_path / "p" / name
            for r in range(WORLD):
                write_rank(run, r, 40, now - 70, probe=SLEEP if r == 3 else COLLECTIVE,
                           side=now - 1)
            watchers.append(Watcher(run, cfg, disp))
        for w in watchers:  # a culprit named by probes: paged as it opens (row e)
            assert [(i.kind, i.ranks) for i in w.check(now)] == [("stall", (3,))]
        assert disp.flush(10)
        pages = [json.loads(req.get_data()) for req, _ in httpserver.log]
        assert sorted(p["run"] for p in pages) == ["a", "b"], pages
        assert all(p["rule"] == "health:stall:3" for p in pages)
        for w in watchers:
            w.check(now + 1)  # writes what the channel said
            assert [(i["delivered"], "paging" in i) for i in _lines(w.run_dir)] == [
                (False, True), (True, False)]
        # a blip: a rank falls 170 steps behind and catches up within page_after
        blip = tmp_path / "p" / "blip"
        for r in range(WORLD):
            write_rank(blip, r, 200 if r != 2 else 30, now - 1)
        w = Watcher(blip, HealthConfig(behind_steps=100), disp)
        assert [i.kind for i in w.check(now)] == ["behind"]
        write_rank(blip, 2, 200, now)
        assert [(i.kind, i.state) for i in w.check(now + 3)] == [("behind", "resolved")]
        assert disp.flush(5) and len(httpserver.log) == 2  # nothing more paged
    finally:
        disp.close(2.0)


def test_a_stall_raised_on_evidence_pages_at_once_and_one_on_a_threshold_after_page_after(
        tmp_path: Path, httpserver: Any) -> None:
    """Issue 53 row e: `page_after` (here 5 minutes) holds for what a threshold raised, not
    for what evidence did. Before, the stall whose probes name rank 3 waited it out too (at
    the defaults 60 s + 10 s)."""
    from expr_tracker.alerts import Dispatcher, load_config

    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    cfg_path = _hook_config(tmp_path / "a.toml", httpserver.url_for("/hook"))
    disp = Dispatcher.from_config(load_config(None, path=str(cfg_path)))
    cfg = HealthConfig(hang_after=60.0, page_after=300.0)
    now = time.time()
    try:
        culprit, low = tmp_path / "p" / "culprit", tmp_path / "p" / "low"
        for r in range(WORLD):  # rank 3 in its data loader, the others in the all-reduce
            write_rank(culprit, r, 40, now - 70, probe=SLEEP if r == 3 else COLLECTIVE,
                       side=now - 1)
            write_rank(low, r, 40 if r != 2 else 39, now - 70)  # no probes: no evidence
        seen, silent = Watcher(culprit, cfg, disp), Watcher(low, cfg, disp)
        assert [(i.kind, i.ranks) for i in seen.check(now)] == [("stall", (3,))]
        assert [(i.kind, i.ranks) for i in silent.check(now)] == [("stall", (2,))]
        assert disp.flush(10)
        assert [json.loads(q.get_data())["run"] for q, _ in httpserver.log] == ["culprit"]
        assert _lines(culprit)[0]["evidence"] is True and "evidence" not in _lines(low)[0]
        silent.check(now + 200)
        assert disp.flush(10) and len(httpserver.log) == 1  # not held 5 minutes yet
        silent.check(now + 301)
        assert disp.flush(10)
        assert [json.loads(q.get_data())["run"] for q, _ in httpserver.log] == ["culprit", "low"]
    finally:
        disp.close(2.0)


def test_the_attribute_cache_is_learned_from_the_gaps_between_heartbeats(
        tmp_path: Path) -> None:
    """Issue 53 row d, its mechanism: node1's exprd touches its heartbeat every 5 s; a
    watcher that sees a new mtime only every 30 s (a FUSE attribute cache) learns 30 s and
    says so; one that sees them every 5 s learns nothing, nor does one exprd stopped for a
    minute once."""
    now = time.time()
    for name, gaps in (("cached", [30, 30, 30]), ("fresh", [5, 5, 5]),
                       ("stopped", [5, 60, 5, 5])):
        run = tmp_path / "p" / name
        for r in range(WORLD):
            write_rank(run, r, 40, now - 1, host=f"node{r // 2}")
        beat = run / ".exprd.node1.json"
        beat.write_text("{}")
        t = now - 1000.0
        os.utime(beat, (t, t))
        w = Watcher(run, HealthConfig(hang_after=3600.0))
        assert w.cfg.fs_cache == 0 and w.cache_note is None
        learned = []
        for i, gap in enumerate(gaps):
            w.check(now + i)
            t += gap
            os.utime(beat, (t, t))
            w.check(now + i + 0.5)
            learned.append(w.cfg.fs_cache)
        if name == "cached":
            assert learned == [0, 30, 30], learned
            assert "show up about 30s late" in (w.cache_note or ""), w.cache_note
        else:
            assert set(learned) == {0}, (name, learned)
    # a configured cache is not learned over
    w = Watcher(tmp_path / "p" / "cached", HealthConfig(fs_cache=2.0))
    assert w.learner is None and w.cfg.fs_cache == 2.0


def _rank_1_crashed(tmp_path: Path) -> Path:
    """A run of WORLD ranks at step 120, rank 1 crashed 5 s ago ("RuntimeError: boom")."""
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 120, now - 1)
    write_rank(run, 1, 120, now - 5, status="crashed",
               exit={"type": "RuntimeError", "message": "boom", "time": now - 5})
    return run


def test_a_page_no_channel_delivered_is_recorded_undelivered_and_paged_by_the_next_watcher(
        tmp_path: Path, httpserver: Any) -> None:
    """Issue 43 row 4: a command channel exiting 7."""
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    bad = tmp_path / "bad.toml"
    bad.write_text('[channels.cmd]\ntype = "command"\nargv = ["sh", "-c", "exit 7"]\n'
                   "retries = 0\n[policy]\nrate = 0\n")
    good = _hook_config(tmp_path / "good.toml", httpserver.url_for("/hook"))
    run = _rank_1_crashed(tmp_path)
    first = expr("watch", str(run), "--once", "--json", "--config", str(bad))
    assert first.returncode == 1, first.stderr
    lines = _lines(run)
    assert [(i["kind"], i["delivered"]) for i in lines] == [("crashed", False)] * 2, lines
    assert "paging" in lines[0] and "paging" not in lines[1]  # the claim dropped
    second = expr("watch", str(run), "--once", "--json", "--config", str(good))
    assert second.returncode == 1, second.stderr
    assert len(httpserver.log) == 1
    assert _lines(run)[-1]["delivered"] is True and len({i["id"] for i in _lines(run)}) == 1


def test_expr_watch_prints_every_incident_line_whoever_recorded_it(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 120, now - 1)
    watch = subprocess.Popen([sys.executable, "-m", "expr_cli.main", "watch", str(run), "--json",
                              "--interval", "0.2", "--behind-steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env_for())
    try:
        time.sleep(3)  # its first pass: nothing open
        other = Watcher(run, HealthConfig(behind_steps=100))  # exprd's part, beside it
        write_rank(run, 2, 10, time.time())
        opened = other.check()
        assert [i.kind for i in opened] == ["behind"]
        _wait(lambda: (run / INCIDENTS).exists(), 5, "the line")
        time.sleep(2)
    finally:
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [(i["kind"], i["id"]) for i in got] == [("behind", opened[0].id)], (out, err)


HEALTHY = """
import os, random, time
import expr_tracker as et

run = et.init("p", "healthy", dir=os.environ["ROOT"])
rank = int(os.environ["RANK"])
end = time.monotonic() + float(os.environ["SECONDS_"])
step = 0
while time.monotonic() < end:
    t0 = time.perf_counter()
    sum(i * i for i in range(10_000))  # a step of work: CPU, so the load slows it ...
    time.sleep(0.02 + random.random() * 0.005)  # ... and a wait (data, a collective)
    run.log_rank_metrics({"step_time": time.perf_counter() - t0}, step=step)
    et.log({"loss": 1.0 / (step + 1)}, step=step)
    step += 1
et.finish()
"""
BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def healthy_job_pages_nothing(tmp: Path, url: str, seconds: float) -> tuple[list[Any], list[Any]]:
    """A healthy 4-rank job (real processes, direct mode) beside a busy loop,
    watched with the default thresholds and a webhook; (the pages, the incident lines).
    `bench/torture.py` runs it for minutes."""
    from expr_tracker.alerts import Dispatcher, load_config

    root = tmp / "runs"
    script = tmp / "healthy.py"
    script.write_text(HEALTHY)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds + 10)], env=env_for())
            for _ in range(1)]
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True,
                              env=env_for({"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r),
                                           "ROOT": str(root), "SECONDS_": str(seconds)}))
             for r in range(4)]
    disp = Dispatcher.from_config(load_config(None, path=str(_hook_config(tmp / "a.toml", url))))
    run = root / "p" / "healthy"
    try:
        watcher = Watcher(run, HealthConfig(), disp)
        while any(p.poll() is None for p in ranks):
            if run.is_dir():
                watcher.check()
            time.sleep(1.0)
        watcher.check()
        disp.flush(10)
        for p in ranks:
            assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    finally:
        disp.close(2.0)
        for p in [*ranks, *busy]:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    return [], _lines(run)


def test_a_healthy_job_on_a_loaded_machine_pages_nothing(tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    _, lines = healthy_job_pages_nothing(tmp_path, httpserver.url_for("/hook"), 18.0)
    pages = [json.loads(req.get_data()) for req, _ in httpserver.log]
    assert pages == [], (pages, lines)


def test_a_sidecar_read_that_fails_once_keeps_the_last_good_copy(tmp_path: Path) -> None:
    """Through a caching filesystem a sidecar can read as garbage (a cached size over new
    bytes) or be gone for one look: `expr top` called the rank "corrupt" after one such
    read. Twice in a row is believed."""
    from expr_tracker.health.state import RunReader

    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 40, now - 1)
    reader = RunReader(run)
    assert reader.read().ranks[2].status == "running"
    side = run / "metrics.rank2.meta.json"
    good = side.read_bytes()
    side.write_bytes(good[: len(good) // 2])  # half of it
    assert reader.read().ranks[2].status == "running"  # the last good copy
    assert reader.read().ranks[2].status == "corrupt"  # again: believed
    side.write_bytes(good)
    assert reader.read().ranks[2].status == "running"
    side.unlink()
    assert reader.read().ranks[2].host == "node-1"  # gone for one look: kept
    assert reader.read().ranks[2].host is None


FAST = """
import os, time
import expr_tracker as et

run = et.init("p", "cached", dir=os.environ["ROOT"])
end = time.monotonic() + float(os.environ["SECONDS_"])
step = 0
while time.monotonic() < end:
    time.sleep(0.02)
    et.log({"loss": 1.0}, step=step)
    step += 1
et.finish()
"""

CACHED_WATCH = """
import json, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from dataclasses import replace
from expr_tracker.health.config import HealthConfig
from expr_tracker.health.detect import Memory, detect
from expr_tracker.health.state import RunReader
from expr_tracker.health.watch import Watcher

src, mnt = {src!r}, {mnt!r}
subprocess.run(["bindfs", "-o", "attr_timeout=5,entry_timeout=5", src, mnt], check=True)
try:
    run = os.path.join(mnt, "p", "cached")
    while not os.path.isdir(run):
        time.sleep(0.2)
    cfg = HealthConfig(hang_after=3.0, behind_steps=50, straggler_ratio=100.0,
                       slowdown_ratio=100.0)
    watcher = Watcher(run, replace(cfg, fs_cache=6.0))
    naive, memory, found = RunReader(run), Memory(), set()
    end = time.monotonic() + {seconds}
    stale = 0  # passes that saw a shard smaller than it was (the cache at work)
    shard = os.path.join("p", "cached", "metrics.rank2.jsonl")
    while time.monotonic() < end:
        try:
            stale += os.stat(os.path.join(mnt, shard)).st_size < os.stat(os.path.join(src, shard)).st_size
        except OSError:
            pass
        watcher.check()
        now = naive.clock()
        state = naive.read(now)
        found |= {{f.kind for f in detect(state, [], replace(cfg, fs_cache=0.0), memory, now)
                   if f.kind in ("behind", "hang", "stall", "lost")}}
        time.sleep(0.5)
    lines = [json.loads(x) for x in open(os.path.join(run, "incidents.jsonl"))] \\
        if os.path.exists(os.path.join(run, "incidents.jsonl")) else []
    print(json.dumps({{"note": watcher.cache_note, "naive": sorted(found), "stale": stale,
                      "recorded": [(i["kind"], i["detail"]) for i in lines]}}))
finally:
    subprocess.run(["umount", mnt], check=False)
"""


def test_through_an_attribute_cache_silence_and_behind_are_believed_only_beyond_it(
        tmp_path: Path) -> None:
    """The run root read through bindfs with a 5 s attribute cache (as NFS clients cache):
    a size 5 s old made a watcher without `fs_cache` see ranks behind or silent; with it,
    a healthy job has no incident."""
    from tests.procs import in_mount_namespace

    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed")
    src, mnt = tmp_path / "runs", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    script = tmp_path / "fast.py"
    script.write_text(FAST)
    seconds = 11.0
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True,
                              env=env_for({"RANK": str(r), "WORLD_SIZE": "4", "ROOT": str(src),
                                           "SECONDS_": str(seconds + 6)}))
             for r in range(4)]
    try:
        repo = str(Path(__file__).resolve().parent.parent)
        got = in_mount_namespace(CACHED_WATCH.format(repo=repo, src=str(src), mnt=str(mnt),
                                                     seconds=seconds), timeout=120)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert "up to 6s old (configured)" in got["note"], got
    assert got["recorded"] == [], got
    # the watcher read a stale view: the same reads without fs_cache may take it for a
    # false incident (seen: behind, hang), as the machine's pace decides
    assert got["stale"] >= 3, got


STALLER = """
import os, time
import expr_tracker as et

run = et.init("p", os.environ["NAME"], dir=os.environ["ROOT"])
rank = int(os.environ["RANK"])
for step in range(30 if rank == 3 else 31):  # rank 3 stops a step short ...
    et.log({"loss": 1.0}, step=step)
    time.sleep(0.05)
time.sleep(float(os.environ["HOLD"]))  # ... and the others wait for it
et.finish()
"""


def test_two_spool_mode_jobs_each_stalling_rank_3_both_page(tmp_path: Path,
                                                           httpserver: Any) -> None:
    """One exprd, one dispatcher, two jobs whose stalls name rank 3 alike: both page (the
    dedup key was (rule `health:stall:3`, kind, level), and the second was suppressed)."""
    from tests.test_daemon import start_exprd, stop, wait_ready, write_config

    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    hook = f'type = "webhook"\nurl = {json.dumps(httpserver.url_for("/hook"))}\nretries = 0\n'
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    spool.mkdir(mode=0o700)
    extra = (f"[alert.channels.hook]\n{hook}[alert.policy]\nrate = 0\n"
             '[health]\nhang_after = "3s"\npage_after = "1s"\n')
    daemon = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra),
                         "--allow-root")
    script = tmp_path / "staller.py"
    script.write_text(STALLER)
    procs = []
    try:
        wait_ready(state, daemon)
        for name in ("a", "b"):
            procs += [subprocess.Popen(
                [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, env=env_for({"RANK": str(r), "WORLD_SIZE": "4", "ROOT": str(root),
                                        "NAME": name, "HOLD": "12", "EXPR_MODE": "spool",
                                        "EXPR_SPOOL": str(spool)})) for r in range(4)]

        def pages() -> list[dict[str, Any]]:
            return [json.loads(req.get_data()) for req, _ in httpserver.log]

        _wait(lambda: len(pages()) >= 2, 40, "both runs' pages")
        # before the ranks still holding are killed: exprd pages that as a crash, rightly
        got = sorted((p["run"], p["rule"]) for p in pages())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        assert stop(daemon) == 0
    assert got == [("a", "health:stall:3"), ("b", "health:stall:3")], got


LATER = """
import json, os, subprocess, sys, time
src, mnt, write = {src!r}, {mnt!r}, {write!r}
subprocess.run(["bindfs", "-o", "attr_timeout=30,entry_timeout=30,negative_timeout=30",
                src, mnt], check=True)
expr = [sys.executable, "-m", "expr_cli.main"]
try:
    before = subprocess.run([*expr, "top", "p/r", "--once", "--dir", mnt], capture_output=True,
                            text=True)
    listed = subprocess.run([*expr, "runs", "--json", "--dir", mnt], capture_output=True, text=True)
    subprocess.run([sys.executable, "-c", write], check=True)  # the run appears (on its node)
    after = subprocess.run([*expr, "top", "p/r", "--once", "--json", "--dir", mnt],
                           capture_output=True, text=True)
    runs = subprocess.run([*expr, "runs", "--json", "--dir", mnt], capture_output=True, text=True)
    print(json.dumps({{"before": before.returncode, "before_err": before.stderr,
                      "listed": listed.stdout, "after": after.returncode, "after_err": after.stderr,
                      "runs": runs.stdout}}))
finally:
    subprocess.run(["umount", mnt], check=False)
"""


def test_a_run_that_appears_later_is_found_through_a_cached_lookup(tmp_path: Path) -> None:
    """A login node looked for the run before it existed: through a filesystem that caches
    failed lookups (FUSE `negative_timeout`, NFS's lookup cache) it stayed "no run" for the
    cache's time. The readers find a run by its directory's listing first."""
    from tests.procs import in_mount_namespace

    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed")
    src, mnt = tmp_path / "runs", tmp_path / "mnt"
    (src / "p").mkdir(parents=True)
    mnt.mkdir()
    write = (f"import expr_tracker as et\net.init('p', 'r', dir={str(src)!r})\n"
             "et.log({'loss': 1.0}, step=0)\net.finish()\n")
    got = in_mount_namespace(LATER.format(src=str(src), mnt=str(mnt), write=write), timeout=120)
    assert got["before"] != 0 and "no run" in got["before_err"], got
    assert got["after"] == 0, got  # at once, not after 30 s
    assert [r["name"] for r in json.loads(got["runs"])] == ["r"], got



NEGATIVE = """
import json, pathlib, subprocess, sys
src, mnt = pathlib.Path({src!r}), pathlib.Path({mnt!r})
sys.path.insert(0, {repo!r})  # (exprd's package, `daemon`, lives at the repository's top)
subprocess.run(["bindfs", "-o", "attr_timeout=30,entry_timeout=30,negative_timeout=30",
                str(src), str(mnt)], check=True)
try:
    from daemon.health import _sidecars
    before = (mnt / "cluster").exists()  # looked up before the project exists: cached
    (src / "cluster" / "r").mkdir(parents=True)
    (src / "cluster" / "r" / "metrics.meta.json").write_text("{{}}")
    try:
        list(mnt.glob("*/*/metrics.meta.json"))
        glob = "ok"
    except FileNotFoundError:
        glob = "FileNotFoundError"
    print(json.dumps({{"before": before, "glob": glob, "found": [str(p) for p in _sidecars(mnt)]}}))
finally:
    subprocess.run(["umount", str(mnt)], check=False)
"""


def test_exprds_scan_of_its_roots_survives_a_cached_failed_lookup(tmp_path: Path) -> None:
    """The listing of a shared root names a project that a cached failed lookup (FUSE's
    negative entry, NFS's lookup cache) says is not there: pathlib's glob raised
    FileNotFoundError, and exprd's health scan of its `watch_roots` died with it (the
    cluster cache case saw node0's exprd stop). The scan skips it until the cache lets it
    through."""
    from tests.procs import in_mount_namespace

    if shutil.which("bindfs") is None:
        pytest.skip("needs bindfs (apt-get install bindfs)")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    repo = str(Path(__file__).resolve().parent.parent)
    got = in_mount_namespace(NEGATIVE.format(src=str(src), mnt=str(mnt), repo=repo), timeout=60)
    assert got["before"] is False and got["glob"] == "FileNotFoundError", got  # the case is real
    assert got["found"] == [], got  # skipped, not raised

def test_a_webhook_that_hangs_leaves_the_page_to_the_next_watcher(tmp_path: Path) -> None:
    """Issue 43 row 4: `expr watch --once` with a webhook that never answers: the page is
    counted undelivered at exit and its claim dropped, so the next watcher need not wait
    for the claim to expire."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # accepts, never answers
    try:
        cfg = _hook_config(tmp_path / "a.toml", f"http://127.0.0.1:{hung.getsockname()[1]}/hook")
        cfg.write_text(cfg.read_text() + "timeout = 30\nexit_timeout = 1\n")
        run = _rank_1_crashed(tmp_path)
        env = env_for()
        proc = subprocess.run([sys.executable, "-m", "expr_cli.main", "watch", str(run), "--once",
                               "--config", str(cfg)], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 1, proc.stderr
        lines = _lines(run)
        assert [(i["delivered"], "paging" in i) for i in lines] == [(False, True), (False, False)]
    finally:
        hung.close()


QUIET_RANK = """
import os, time
import expr_tracker as et

run = et.init("p", "quiet", dir=os.environ["ROOT"], system_metrics=True, system_interval=1)
for step in range(30):
    et.log({"loss": 1.0 / (step + 1)}, step=step)
    time.sleep(0.02)
open(os.environ["READY"], "w").close()
time.sleep(120)  # a rank stuck outside tracking: its probe and samples keep its files fresh
"""


def test_no_step_for_is_shown_before_any_incident(tmp_path: Path) -> None:
    """Issue 48 row 7: a rank that stopped stepping while its probes and system samples keep
    its files fresh reads "no step for N s" in `top`, `runs` and `shards`, with the default
    thresholds, before any incident opens (a minute of silence at the least)."""
    root, ready = tmp_path / "runs", tmp_path / "ready"
    script = tmp_path / "quiet.py"
    script.write_text(QUIET_RANK)
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE,
                            env=env_for({"ROOT": str(root), "READY": str(ready),
                                         "EXPR_PROBE_AFTER": "1"}))
    try:
        _wait(ready.exists, 60, "the rank's 30 steps")
        stopped = time.time()
        time.sleep(13)  # past NO_STEP_SHOWN (10 s) of files written without a step
        run = root / "p" / "quiet"
        side = json.loads((run / "metrics.meta.json").read_text())
        assert side.get("probe"), side  # what keeps the files fresh: a probe, samples
        top = _json("top", str(run), "--once")
        (row,) = top["ranks"]
        assert row["status"] == "running" and row["no_step_for"] >= 12, row
        assert top["job"]["no_step_for"] >= 12 and "no step for" in top["job"]["text"], top["job"]
        assert not top.get("incidents"), top  # nothing yet: the threshold is a minute
        for args in (("runs", "--dir", str(root)), ("shards", str(run))):
            out = expr(*args)
            assert out.returncode == 0, out.stderr
            said = " ".join(out.stdout.split())
            assert "no step for 1" in said, (args, out.stdout)  # 12-19 s: "no step for 1Ns"
        assert time.time() - stopped < 60
    finally:
        proc.kill()
        proc.wait(10)
