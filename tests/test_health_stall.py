"""Stalls, crashes as one incident per fault, and the end of a run, on hand-written runs.

Real files (shards, sidecars with the probes the SDK writes, incidents.jsonl), a real
webhook on 127.0.0.1, the real Watcher and `expr watch`; the ranks are written by hand so
that each rule of DESIGN 13 is pinned on its own (tests/test_health_ddp.py runs torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.incidents import CRASH_GRACE
from expr_tracker.health.watch import INCIDENTS, Watcher
from tests.procs import env_for

WORLD = 4
CFG = HealthConfig(hang_after=20.0, behind_steps=100_000, straggler_steps=5, slowdown_ratio=100)
COLLECTIVE = {"since": 0.0, "time": 0.0, "waiting": "collective", "spans": ["step"],
              "where": ["/venv/torch/distributed/distributed_c10d.py:2501 all_reduce",
                        "/job/train.py:80 main [user]"]}
SLEEP = {"since": 0.0, "time": 0.0, "waiting": "sleep", "spans": ["step", "data"],
         "where": ["/job/train.py:88 main [user]", "/job/train.py:120 <module> [user]"]}


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


def write_rank(run: Path, rank: int, last: int, wrote: float, *, probe: dict | None = None,
               side: float | None = None, status: str = "running", exit: dict | None = None,
               host: str = "node-1", t0: float = 1000.0, records: bool = False) -> None:
    """Rank `rank`'s shard (steps 0..last, one a second from `t0` on its own clock) written
    at `wrote`, and its sidecar (with `probe`) at `side`."""
    run.mkdir(parents=True, exist_ok=True)
    shard = run / f"{_stem(rank)}.jsonl"
    rows = []
    for s in range(last + 1):
        rows.append({"_step": s, "_time": t0 + s, "loss": 1.0})
        if records:
            rows.append({"_kind": "rank", "_step": s, "_time": t0 + s, "_rank": rank,
                         "step_time": 0.5})
    shard.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.utime(shard, (wrote, wrote))
    meta: dict[str, Any] = {"version": 1, "rank": rank, "world_size": WORLD, "host": host,
                            "pid": 4242 + rank, "status": status, "start_time": t0}
    if probe is not None:  # written while silent after its last row (its own clock)
        since = probe["since"] or t0 + last + 0.5
        meta["probe"] = {**probe, "since": since, "time": probe["time"] or since + 2}
    if exit is not None:
        meta["exit"] = exit
    path = run / f"{_stem(rank)}.meta.json"
    path.write_text(json.dumps(meta))
    t = side if side is not None else wrote
    os.utime(path, (t, t))


def _lines(run: Path) -> list[dict[str, Any]]:
    path = run / INCIDENTS
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def expr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], env=env_for(),
                          capture_output=True, text=True, timeout=60)


def test_a_rank_sleeping_while_the_others_wait_in_a_collective_is_the_suspect(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 149, now - 62, probe=SLEEP if r == 3 else COLLECTIVE, side=now - 1)
    w = Watcher(run, CFG)
    opened = w.check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (3,))]
    assert opened[0].detail == ("job stalled at step 149 for 62s: rank 3 in time.sleep "
                                "(train.py:88, span data); 3 ranks wait in all_reduce")
    assert w.check(now + 5) == []  # still stalled, still one incident
    # rank 0 advances: the stall is over; the others are not hung (they waited)
    write_rank(run, 0, 150, now + 10, probe=None)
    changes = w.check(now + 10)
    assert [(i.kind, i.state) for i in changes] == [("stall", "resolved")]
    assert w.check(now + 12) == []
    assert [i["kind"] for i in _lines(run)] == ["stall", "stall"]


def test_a_rank_whose_tracker_thread_cannot_run_has_no_probe_and_is_the_suspect(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        # rank 2 (SIGSTOP, or C code holding the GIL) wrote its last sidecar when it stopped
        write_rank(run, r, 80, now - 30, probe=None if r == 2 else COLLECTIVE,
                   side=now - 30 if r == 2 else now - 2)
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (2,))]
    assert "rank 2 wrote no probe" in opened[0].detail, opened[0].detail
    assert "3 ranks wait in all_reduce" in opened[0].detail


def test_a_probe_left_over_from_an_earlier_silence_is_not_believed(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):  # rank 1's probe says "sleep", but it logged steps after it
        old = {**SLEEP, "since": 1000.0 + 20, "time": 1000.0 + 22}
        write_rank(run, r, 60, now - 30, probe=old if r == 1 else COLLECTIVE, side=now - 1)
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (1,))]
    assert "rank 1 left only an old probe" in opened[0].detail, opened[0].detail
    # a sidecar not rewritten for long while the others' are: the same
    run2 = tmp_path / "p" / "r2"
    for r in range(WORLD):
        write_rank(run2, r, 60, now - 30, probe=SLEEP if r == 2 else COLLECTIVE,
                   side=now - 20 if r == 2 else now - 1)
    opened = Watcher(run2, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (2,))]
    assert "rank 2 left only an old probe" in opened[0].detail, opened[0].detail


def test_without_probes_the_lowest_step_then_the_oldest_write(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 40 if r == 1 else 41, now - 30)
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (1,))]
    assert "rank 1 at step 40, the lowest" in opened[0].detail
    run2 = tmp_path / "p" / "r2"
    for r in range(WORLD):
        write_rank(run2, r, 41, now - (40 if r == 2 else 30))
    opened = Watcher(run2, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (2,))]


def test_one_stall_while_its_suspects_change_and_no_hang_when_the_job_resumes(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):  # no probes yet: rank 0 wrote last longest ago
        write_rank(run, r, 10, now - (31 if r == 0 else 30))
    w = Watcher(run, CFG)
    assert [i.ranks for i in w.check(now)] == [(0,)]
    for r in range(WORLD):  # the probes arrive: rank 3 is the one not in the collective
        write_rank(run, r, 10, now - (31 if r == 0 else 30), probe=SLEEP if r == 3 else COLLECTIVE,
                   side=now + 1)
    changed = w.check(now + 2)
    assert [(i.kind, i.ranks, i.state) for i in changed] == [("stall", (3,), "open")]
    lines = _lines(run)
    assert len({i["id"] for i in lines}) == 1 and lines[-1]["ranks"] == [3]
    # spool mode: exprd applies rank 3's new rows first; the others look silent for 40 s
    write_rank(run, 3, 12, now + 10)
    assert [i.state for i in w.check(now + 10)] == ["resolved"]
    assert w.check(now + 11) == []  # not a hang of ranks 0-2: their silence was the stall's
    for r in range(3):
        write_rank(run, r, 12, now + 12)
    assert w.check(now + 12) == []


def _hook_config(path: Path, url: str) -> Path:
    path.write_text(f'[channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
                    '[policy]\nrate = 0\n')
    return path


def _rank_1_crashed(tmp_path: Path, httpserver: Any) -> tuple[Path, Path, float]:
    """A webhook config, and a run whose rank 1 raised 5 s ago while the others run on."""
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    cfg = _hook_config(tmp_path / "alert.toml", httpserver.url_for("/hook"))
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 120, now - 1, records=True)
    boom = {"type": "RuntimeError", "message": "boom", "time": now - 5}
    write_rank(run, 1, 120, now - 5, status="crashed", exit=boom, records=True)
    return cfg, run, now


def test_one_crash_cascade_is_one_incident_delivered_once(tmp_path: Path, httpserver: Any) -> None:
    cfg, run, now = _rank_1_crashed(tmp_path, httpserver)
    first = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert first.returncode == 1, first.stderr
    # gloo ends the others: "Connection closed by peer"; rank 3 without a word
    peer = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer", "time": now - 3}
    for r in (0, 2):
        write_rank(run, r, 120, now - 3, status="crashed", exit=peer, records=True)
    write_rank(run, 3, 120, now - 2, status="crashed", records=True)
    second = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert second.returncode == 1, second.stderr
    lines = _lines(run)
    assert {i["kind"] for i in lines} == {"crashed"} and len({i["id"] for i in lines}) == 1
    assert lines[0]["root"]["rank"] == 1 and lines[0]["root"]["message"] == "boom"
    assert lines[0]["root"]["type"] == "RuntimeError"
    assert lines[-1]["ranks"] == [0, 1, 2, 3] and lines[-1]["root"]["rank"] == 1
    assert "rank 1 crashed at step 120: RuntimeError: boom; then 3 more ranks crashed" in lines[-1]["detail"]
    assert len(httpserver.log) == 1
    # the whole run crashed: nothing else opens, `expr summary` names the first to fail
    summary = expr("summary", str(run), "--json")
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)["ranks"]["first_crash"]["rank"] == 1
    text = expr("summary", str(run))
    assert "rank 1 failed first" in text.stdout, text.stdout


def test_a_cascade_seen_in_one_pass_has_the_root_that_is_not_collateral(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    peer = {"type": "RuntimeError", "message": "Connection reset by peer", "time": now - 9}
    for r in range(WORLD):  # rank 2's exit time is the latest, but the others blame a peer
        ex = {"type": "ValueError", "message": "bad batch", "time": now - 8} if r == 2 else peer
        write_rank(run, r, 7, now - 8, status="crashed", exit=ex)
    opened = Watcher(run, CFG).check(now)
    assert [(i.kind, i.ranks) for i in opened] == [("crashed", (0, 1, 2, 3))]
    assert opened[0].root is not None and opened[0].root["rank"] == 2
    # a crash beyond crash_window after the first is another fault
    run2 = tmp_path / "p" / "r2"
    for r in range(2):
        write_rank(run2, r, 7, now - (200 if r == 0 else 5), status="crashed",
                   exit={"type": "OSError", "message": f"disk {r}", "time": 0.0})
    for r in range(2, WORLD):
        write_rank(run2, r, 7, now - 1)
    opened = Watcher(run2, CFG).check(now)
    assert sorted(i.ranks for i in opened if i.kind == "crashed") == [(0,), (1,)]


def test_a_rank_killed_by_a_signal_is_the_root_even_when_seen_after_its_peers(
        tmp_path: Path) -> None:
    """Issue 53 row a: rank 2 is killed -9 (no exception); ranks 0-1 on another node fail
    with "Connection reset by peer" and are seen first. They wait for the peer's crash
    (`CRASH_GRACE`); seen later than that, the rank killed still becomes the root, by a
    line of the same id, and `expr summary` names the same rank."""
    peer = {"type": "RuntimeError", "message": "Read error [10.0.0.11]:52114: Connection "
            "reset by peer", "time": 0.0}
    now = time.time()
    for name, ago in (("soon", 3.0), ("late", CRASH_GRACE + 5)):
        run = tmp_path / "p" / name
        for r in range(WORLD):
            write_rank(run, r, 50, now - 5, host=f"node{r // 2}")
        for r in (0, 1):
            write_rank(run, r, 50, now - ago, status="crashed", exit={**peer, "time": t0(r)},
                       host="node0")
        w = Watcher(run, CFG)
        first = [(i.kind, i.ranks, (i.root or {}).get("rank")) for i in w.check(now)]
        for r in (2, 3):  # node1's exprd marks them crashed a pass later: rank 2 said nothing
            write_rank(run, r, 50, now - 4, status="crashed", host="node1",
                       exit=None if r == 2 else {**peer, "time": t0(r)})
        w.check(now + 1)
        lines = _lines(run)
        assert len({x["id"] for x in lines}) == 1, lines
        assert lines[-1]["ranks"] == [0, 1, 2, 3] and lines[-1]["root"]["rank"] == 2, lines[-1]
        assert lines[-1]["detail"].startswith("rank 2 crashed at step 50"), lines[-1]["detail"]
        if name == "soon":  # held for rank 2's crash: the first line (and page) is right
            assert first == [] and lines[0]["root"]["rank"] == 2, (first, lines[0])
        else:
            assert first == [("crashed", (0, 1), 0)], first
        summary = expr("summary", str(run), "--json")
        assert json.loads(summary.stdout)["ranks"]["first_crash"]["rank"] == 2, summary.stdout


def t0(rank: int) -> float:
    """A crashed rank's exit time on its own host's clock (node1's is 100 s ahead)."""
    return 1060.0 + (100.0 if rank >= 2 else 0.0)


def _rank_2_behind(run: Path, now: float) -> Watcher:
    """A run whose rank 2 is 170 steps behind, and a watcher that has opened its incident."""
    for r in range(WORLD):
        write_rank(run, r, 30 if r == 2 else 200, now - 1)
    w = Watcher(run, HealthConfig(hang_after=3600.0, behind_steps=100))
    assert [(i.kind, i.ranks) for i in w.check(now)] == [("behind", (2,))]
    return w


def test_an_incident_whose_rank_crashed_resolves_saying_so(tmp_path: Path) -> None:
    """A rank behind that then crashes is not behind any more: its incident resolves with
    the reason (it did not catch up), and the crash opens its own."""
    run = tmp_path / "p" / "r"
    now = time.time()
    w = _rank_2_behind(run, now)
    for r in range(WORLD):
        write_rank(run, r, 30 if r == 2 else 210, now + 1,
                   **({"status": "crashed", "exit": {"type": "RuntimeError", "message": "oom",
                                                     "time": now + 1}} if r == 2 else {}))
    done = w.check(now + 2)
    assert sorted((i.kind, i.state, i.reason) for i in done) == [
        ("behind", "resolved", "rank crashed"), ("crashed", "open", None)]
    from expr_cli.render.health import incident_text

    behind = next(i for i in done if i.kind == "behind")
    text = incident_text(behind.as_line()).plain
    assert text.startswith("resolved behind rank 2 on node-1 step 30 (rank crashed, open 2s): "), text


def test_when_the_run_ends_its_incidents_resolve_and_watch_once_exits_0(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    now = time.time()
    w = _rank_2_behind(run, now)
    for r in range(WORLD):
        write_rank(run, r, 30 if r == 2 else 200, now + 1, status="finished")
    done = w.check(now + 2)
    assert [(i.kind, i.state, i.reason) for i in done] == [("behind", "resolved", "run ended")]
    assert _lines(run)[-1]["reason"] == "run ended"
    from expr_cli.render.health import incident_text  # why it resolved, how long it was open

    text = incident_text(done[0].as_line()).plain
    assert text.startswith("resolved behind rank 2 on node-1 step 30 (run ended, open 2s): "), text
    again = expr("watch", str(run), "--once", "--behind-steps", "100")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "no open incidents" in again.stdout


def test_a_torn_last_line_is_set_aside_and_its_incident_not_delivered_again(
        tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    cfg = _hook_config(tmp_path / "alert.toml", httpserver.url_for("/hook"))
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 200 if r != 3 else 20, now - 1)
    # a watcher delivered "behind [3]" and was killed while writing its line
    torn = b'{"id":"0123456789ab","kind":"behind","state":"open","delivered":true,"ranks":[3],"le'
    (run / INCIDENTS).write_bytes(torn)
    proc = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert proc.returncode == 1, proc.stderr
    assert (run / "incidents.jsonl.torn").read_bytes() == torn + b"\n"
    lines = _lines(run)  # every line whole, the incident known again, nobody paged
    assert [(i["kind"], i["ranks"], i["id"]) for i in lines] == [("behind", [3], "0123456789ab")]
    assert len(httpserver.log) == 0


def test_ranks_with_skewed_clocks_are_not_a_hang_stall_or_missing(tmp_path: Path) -> None:
    """Ranks whose `_time` (their hosts' clocks) is off by +-120 s, all writing now."""
    run = tmp_path / "p" / "r"
    now = time.time()
    w = Watcher(run, HealthConfig(hang_after=5.0, missing_after=60.0))
    for step in (30, 31, 32):
        for r in range(WORLD):
            skew = 120.0 if r % 2 else -120.0
            write_rank(run, r, step, now + step - 32, t0=now - 32 + skew, probe=None)
        assert w.check(now + step - 32) == []
    assert w.open == []


def test_watch_waits_for_a_run_that_does_not_exist_yet_and_exits_when_it_ends(tmp_path: Path) -> None:
    run = tmp_path / "p" / "later"
    watch = subprocess.Popen([sys.executable, "-m", "expr_cli.main", "watch", str(run), "--json",
                              "--exit-on-finish", "--interval", "0.2"], env=env_for(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert watch.poll() is None  # waiting, not "no run"
        now = time.time()
        for r in range(WORLD):
            write_rank(run, r, 10, now, status="finished")
        out, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, err
    assert "waiting for" in err and out == ""


def test_missing_ranks_are_timed_from_the_first_start_on_the_readers_clock(tmp_path: Path) -> None:
    """Rank 3 never wrote a shard. Ranks 0-2 started 32 s ago, but rank 0's host clock is
    120 s behind: its `start_time` says 152 s ago. `missing` waits `missing_after` (60 s)
    from the first start as the reader sees it, not from a time off another host's clock."""
    run = tmp_path / "p" / "r"
    now = time.time()
    cfg = HealthConfig(hang_after=1000.0, missing_after=60.0, behind_steps=100_000)
    for r in range(WORLD - 1):
        skew = -120.0 if r == 0 else 0.0
        write_rank(run, r, 31, now - 1, t0=now - 32 + skew, probe=None)
    assert [i.kind for i in Watcher(run, cfg).check(now)] == []
    later = now + 40  # 72 s after the start: rank 3 is missing now
    for r in range(WORLD - 1):
        skew = -120.0 if r == 0 else 0.0
        write_rank(run, r, 71, later - 1, t0=now - 32 + skew, probe=None)
    opened = Watcher(run, cfg).check(later)
    assert [(i.kind, i.ranks) for i in opened] == [("missing", (3,))]


def test_a_short_hang_after_waits_for_the_probes_before_naming_a_suspect(tmp_path: Path) -> None:
    """`hang_after` 4 s, below the SDK's first probe (10 s of silence): all four ranks
    logged step 19 and went quiet 5 s ago, nobody has probed yet. The oldest write (by a
    millisecond) is no evidence and a stall pages once, so no stall yet; nor while the
    others' probes are only just there and rank 2's is not; once rank 2's says sleep,
    the stall names it."""
    from expr_tracker import probe
    from expr_tracker.health import stall

    assert (stall.PROBE_AFTER, stall.PROBE_PERIODS, stall.PROBE_REWRITE) == (
        probe.DEFAULT_AFTER, probe.PERIODS, probe.REWRITE_EVERY)
    run = tmp_path / "p" / "r"
    now = time.time()
    cfg = HealthConfig(hang_after=4.0, behind_steps=100_000, straggler_steps=5, slowdown_ratio=100)
    for r in range(WORLD):
        write_rank(run, r, 19, now - 5 - r * 0.001)
    w = Watcher(run, cfg)
    assert w.check(now) == []
    for r in range(WORLD):  # the others just probed, rank 2 not yet: no evidence
        write_rank(run, r, 19, now - 5 - r * 0.001, probe=None if r == 2 else COLLECTIVE,
                   side=now + 1)
    assert w.check(now + 1) == []
    assert w.check(now + 2) == []
    for r in range(WORLD):
        write_rank(run, r, 19, now - 5 - r * 0.001, probe=SLEEP if r == 2 else COLLECTIVE,
                   side=now + 9)
    opened = w.check(now + 9)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (2,))]
    assert "rank 2 in main" in opened[0].detail or "rank 2 in time.sleep" in opened[0].detail, \
        opened[0].detail


def test_a_missing_probe_counts_once_the_others_have_been_seen_a_while(tmp_path: Path) -> None:
    """`hang_after` 4 s: ranks 0, 1 and 3 probed (in the collective), rank 2 did not. The
    first pass that sees their probes waits; 3 s later rank 2 still has none: the suspect.
    A single pass (`--once`) cannot tell how long the probes were there and names it."""
    run = tmp_path / "p" / "r"
    now = time.time()
    cfg = HealthConfig(hang_after=4.0, behind_steps=100_000, straggler_steps=5, slowdown_ratio=100)
    for r in range(WORLD):
        write_rank(run, r, 19, now - 6, probe=None if r == 2 else COLLECTIVE,
                   side=now - 6 if r == 2 else now - 4)
    assert [(i.kind, i.ranks) for i in Watcher(run, cfg).check(now)] == [("stall", (2,))]
    run = tmp_path / "p" / "watched"
    for r in range(WORLD):
        write_rank(run, r, 19, now - 6)
    w = Watcher(run, cfg)
    assert w.check(now - 5) == []  # a pass before the probes: the watcher has been watching
    for r in range(WORLD):
        write_rank(run, r, 19, now - 6, probe=None if r == 2 else COLLECTIVE,
                   side=now - 6 if r == 2 else now)
    assert w.check(now) == []
    assert w.check(now + 2) == []
    opened = w.check(now + 3.5)
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (2,))]
    assert "rank 2 wrote no probe" in opened[0].detail, opened[0].detail


def test_a_terminal_watcher_does_not_take_the_page_from_one_with_channels(
        tmp_path: Path, httpserver: Any) -> None:
    """`expr watch` with no alert config sees the crash first and only prints it; the
    watcher with a webhook (exprd's part) then pages it, once, under the same id."""
    cfg, run, _ = _rank_1_crashed(tmp_path, httpserver)
    terminal = expr("watch", str(run), "--once")
    assert terminal.returncode == 1 and "crashed" in terminal.stdout, terminal
    assert "expr alert" not in terminal.stderr  # printed once, not again by a log channel
    assert [(i["kind"], i["delivered"]) for i in _lines(run)] == [("crashed", False)]
    paged = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert paged.returncode == 1, paged.stderr
    assert len(httpserver.log) == 1
    assert json.loads(httpserver.log[0][0].get_data())["rule"] == "health:crashed:1"
    lines = _lines(run)
    # recorded, claimed while its page was on the way, then delivered (issue 43 row 4)
    assert [(i["kind"], i["delivered"], "paging" in i) for i in lines] == [
        ("crashed", False, False), ("crashed", False, True), ("crashed", True, False)]
    assert len({i["id"] for i in lines}) == 1
    again = expr("watch", str(run), "--once", "--json", "--config", str(cfg))
    assert again.returncode == 1 and len(httpserver.log) == 1 and len(_lines(run)) == 3


def test_the_watcher_that_pages_late_returns_what_it_paged(tmp_path: Path, httpserver: Any) -> None:
    """A watcher with channels pages an incident another recorded first, and says so
    (`check()` returns it, claimed): exprd's log names every page it sent (it named
    none of those before)."""
    from expr_tracker.alerts import Dispatcher, load_config

    cfg, run, now = _rank_1_crashed(tmp_path, httpserver)
    assert [i.kind for i in Watcher(run, CFG).check(now)] == ["crashed"]  # no channels
    disp = Dispatcher.from_config(load_config(None, path=str(cfg)))
    try:
        paging = Watcher(run, CFG, disp)
        got = paging.check(now + 1)  # queued: claimed, not yet delivered
        assert [(i.kind, i.ranks, i.delivered) for i in got] == [("crashed", (1,), False)]
        assert got[0].paging is not None
        disp.flush(10)
        assert len(httpserver.log) == 1
        # the next pass writes what the channel said (delivered, the same id), and says
        # nothing new: it was said when it was paged
        assert paging.check(now + 2) == []
        assert [(i["delivered"], i["id"]) for i in _lines(run)][-1] == (True, got[0].id)
        assert paging.check(now + 3) == [] and len(_lines(run)) == 3  # paged once, said once
    finally:
        disp.close(2.0)


def test_a_probe_left_from_the_last_stall_is_old_even_before_the_rows_arrive(tmp_path: Path) -> None:
    """Rank 3 sleeps (a stall it is named in), wakes, runs 35 steps in a blink and holds
    the GIL in C code: its tracker thread never ran in between, so neither its probe was
    taken away nor its rows flushed. In spool mode exprd keeps rewriting its sidecar. The
    second stall must not believe the first's probe ("in time.sleep")."""
    run = tmp_path / "p" / "r"
    now = time.time()
    for r in range(WORLD):
        write_rank(run, r, 19, now - 62, probe=SLEEP if r == 3 else COLLECTIVE, side=now - 1)
    w = Watcher(run, CFG)
    assert [(i.kind, i.ranks) for i in w.check(now)] == [("stall", (3,))]
    for r in range(3):  # the job resumes; rank 3's new rows are still in its buffer
        write_rank(run, r, 54, now + 10, side=now + 10)
    assert [(i.kind, i.state) for i in w.check(now + 10)] == [("stall", "resolved")]
    for r in range(WORLD):  # 30 s on: ranks 0-2 probe in the collective, rank 3 cannot
        if r == 3:
            write_rank(run, 3, 19, now - 62, probe=SLEEP, side=now + 39)  # the same probe
        else:
            write_rank(run, r, 54, now + 10, probe=COLLECTIVE, side=now + 39)
    opened = [*w.check(now + 40), *w.check(now + 44)]
    assert [(i.kind, i.ranks) for i in opened] == [("stall", (3,))], opened
    assert "rank 3 left only an old probe" in opened[0].detail, opened[0].detail


def _timed(run: Path, last: int, wrote: float, slow: dict[int, float]) -> None:
    """Every rank's shard, steps 0..last, with a `step_time` rank record per step: 0.5 s,
    rank 2 twice that (a straggler), and the times in `slow` ({step: s}) for rank 3's
    step that waited out a stall."""
    for r in range(WORLD):
        write_rank(run, r, last, wrote)
        shard = run / f"{_stem(r)}.jsonl"
        rows = [json.loads(x) for x in shard.read_text().splitlines()]
        out = []
        for row in rows:
            out.append(row)
            s = row["_step"]
            st = slow.get(s, 0.5) if r == 3 else (1.0 if r == 2 else 0.5)
            out.append({"_kind": "rank", "_step": s, "_time": row["_time"], "_rank": r,
                        "step_time": st})
        shard.write_text("".join(json.dumps(x) + "\n" for x in out))
        os.utime(shard, (wrote, wrote))


def test_a_straggler_stays_one_incident_through_a_stall(tmp_path: Path) -> None:
    """The step-time windows hold the stall's one huge step for a while after it; the
    straggler open before the stall stays open through that while, as one incident (it
    was resolved at the stall's end and opened again, a second page, 20 steps later)."""
    run = tmp_path / "p" / "r"
    now = time.time()
    _timed(run, 20, now - 1, {})
    w = Watcher(run, CFG)
    assert [(i.kind, i.ranks) for i in w.check(now)] == [("straggler", (2,))]
    assert [i.kind for i in w.check(now + 25)] == ["stall"]  # nobody advanced for 20 s
    _timed(run, 22, now + 26, {21: 25.0})  # resumed: rank 3's step 21 waited out the stall
    assert [(i.kind, i.state) for i in w.check(now + 26)] == [("stall", "resolved")]
    _timed(run, 24, now + 27, {21: 25.0})
    assert w.check(now + 27) == []  # the windows still hold step 21: the straggler held
    _timed(run, 40, now + 28, {21: 25.0})
    assert w.check(now + 28) == []  # past it: still the same straggler
    strag = [i for i in _lines(run) if i["kind"] == "straggler"]
    assert len({i["id"] for i in strag}) == 1 and {i["state"] for i in strag} == {"open"}
    assert [(i.kind, i.ranks) for i in w.open] == [("straggler", (2,))]
