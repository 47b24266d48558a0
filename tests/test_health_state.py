"""The live state of a run: statuses, last steps, tail windows and the frontier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from expr_tracker.health.state import MAX_CATCHUP, RunReader, read_run
from tests.conftest import write_shard, write_sidecar
from tests.procs import spawn

RANK_CODE = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
with et.init(project="p", name="live", dir=os.environ["ROOT"]):
    for s in range({steps}):
        et.log({{"loss": 1.0 / (s + 1)}}, step=s)
        et.log_rank_metrics({{"step_time": 0.1 + rank}}, step=s, rank=rank, world_size=3)
    et.flush()
    if {raise_}:
        raise RuntimeError("boom")  # the context manager marks the shard crashed
    if {hang}:
        print("ready", flush=True)
        time.sleep(60)
"""


def _rank(root: Path, rank: int, steps: int, *, hang: bool = False,
          raise_: bool = False) -> subprocess.Popen:
    code = RANK_CODE.format(steps=steps, hang=hang, raise_=raise_)
    return spawn(code, {"RANK": str(rank), "WORLD_SIZE": "3", "ROOT": str(root)})


def test_statuses_frontier_and_windows(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    done = _rank(root, 0, 30)
    crashed = _rank(root, 2, 10, raise_=True)
    alive = _rank(root, 1, 20, hang=True)
    try:
        assert done.wait(60) == 0, done.stderr.read() if done.stderr else ""
        assert crashed.wait(60) == 1
        assert alive.stdout is not None and alive.stdout.readline().strip() == "ready"
        # a running process flushes its shard and sidecar every few seconds; wait for rows
        run_dir = root / "p" / "live"
        deadline = time.monotonic() + 20
        state = read_run(run_dir, window=8)
        while (state.ranks.get(1) is None or state.ranks[1].last_step != 19) and time.monotonic() < deadline:
            time.sleep(0.2)
            state = read_run(run_dir, window=8)
        assert sorted(state.ranks) == [0, 1, 2]
        r0, r1, r2 = state.ranks[0], state.ranks[1], state.ranks[2]
        assert r0.status == "finished" and r0.last_step == 29
        assert r1.status == "running" and r1.last_step == 19 and r1.pid == alive.pid
        assert r2.status == "crashed" and r2.last_step == 9
        assert [s for s, _ in r0.step_times] == list(range(22, 30))  # the window, oldest first
        assert all(isinstance(t, float) for _, t in r0.step_times)
        assert r0.world_size == 3 and r0.host == os.uname().nodename
        # only rank 1 is live: the frontier is its step, and nobody is "behind" it
        assert state.frontier == 19 and state.lead == 19
        assert state.behind(0) == 0 and state.behind(1) == 0
        assert [r.rank for r in state.live] == [1]
        # rank records grouped by their own _rank, bounded by the window
        assert sorted(state.rank_records) == [0, 1, 2]
        assert [rec["_step"] for rec in state.rank_records[0]] == list(range(22, 30))
        assert state.rank_records[2][-1]["step_time"] == pytest.approx(2.1)
        assert state.world_size == 3
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait(10)
        for p in (done, crashed, alive):
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()
    # its process is gone without a finish: crashed, although its sidecar says running
    state = read_run(root / "p" / "live")
    assert state.ranks[1].status == "crashed" and state.ranks[1].status_reason == "process gone"
    assert state.frontier == 29  # nobody is live any more: the latest step of any rank


def _row(s: int) -> dict:
    return {"_step": s, "_time": 1000.0 + s, "loss": 1.0}


def test_reader_reads_only_appended_lines(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    shard = run / "metrics.rank1.jsonl"
    write_shard(shard, [_row(s) for s in range(100)], tail=b'{"_step": 100, "_ti')
    write_sidecar(run / "metrics.rank1.meta.json", rank=1, stream=None, rows=100, nbytes=0,
                  last_step=99, status="running", world=4)
    reader = RunReader(run, window=5)
    first = reader.read()
    assert first.ranks[1].last_step == 99  # the torn tail is not a step
    assert [s for s, _ in first.ranks[1].step_times] == [95, 96, 97, 98, 99]
    assert first.ranks[1].host == "node-1" and first.ranks[1].status == "running"  # another host
    with open(shard, "ab") as fh:  # the writer completes its line and writes two more
        fh.write(b'me": 1100.0}\n' + b"".join(json.dumps(_row(s)).encode() + b"\n" for s in (101, 102)))
    second = reader.read()
    assert [s for s, _ in second.ranks[1].step_times] == [98, 99, 100, 101, 102]
    assert second.ranks[1].last_row is not None and second.ranks[1].last_row["_step"] == 102
    # a burst larger than the catch-up bound is read from the tail again, not from the offset
    big = b"".join(json.dumps({**_row(s), "pad": "x" * 200}).encode() + b"\n"
                   for s in range(103, 103 + MAX_CATCHUP // 200))
    with open(shard, "ab") as fh:
        fh.write(big)
    third = reader.read()
    last = 102 + MAX_CATCHUP // 200
    assert [s for s, _ in third.ranks[1].step_times] == list(range(last - 4, last + 1))
    # truncated and rewritten (a new run in the same place): read afresh
    write_shard(shard, [_row(s) for s in range(3)])
    assert reader.read().ranks[1].last_step == 2


def test_frontier_ignores_finished_and_stepless_ranks(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    for rank, last, status in ((0, 50, "running"), (1, 40, "running"), (2, 10, "finished")):
        stem = "metrics" if rank == 0 else f"metrics.rank{rank}"
        write_shard(run / f"{stem}.jsonl", [_row(s) for s in range(last + 1)])
        write_sidecar(run / f"{stem}.meta.json", rank=rank, stream=None, rows=0, nbytes=0,
                      last_step=last, status=status, world=4)
    write_shard(run / "metrics.rank3.jsonl", [])  # started, no step yet
    state = read_run(run)
    assert state.frontier == 40 and state.lead == 50
    assert state.behind(0) == 0 and state.behind(1) == 10 and state.behind(3) is None
    assert state.behind(2) == 40  # finished early: short of the live ranks' lead
    assert state.world_size == 4


def test_streams_are_separate_and_missing_dir_is_empty(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    write_shard(run / "metrics.jsonl", [_row(0)])
    write_shard(run / "metrics.data.rank2.jsonl", [_row(0), _row(1)])
    assert sorted(read_run(run).ranks) == [0]
    assert sorted(read_run(run, "data").ranks) == [2]
    empty = read_run(tmp_path / "nope")
    assert empty.ranks == {} and empty.frontier is None


def test_many_shards_use_the_thread_pool(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    for rank in range(200):
        write_shard(run / (f"metrics.rank{rank}.jsonl" if rank else "metrics.jsonl"),
                    [_row(s) for s in range(rank % 7 + 3)])
    state = read_run(run)
    assert len(state.ranks) == 200
    assert state.frontier == 2
    assert state.ranks[6].last_step == 8


def _gone_writer(run: Path, rank: int, *, spooled: bool, ago: float = 0.0) -> None:
    """A running shard of `rank` whose writer (a real process, reaped) is gone; written
    `ago` seconds ago; `spooled`: by exprd from a spool, naming the training process."""
    done = subprocess.Popen(["true"])
    done.wait()
    stem = "metrics" if rank == 0 else f"metrics.rank{rank}"
    write_shard(run / f"{stem}.jsonl", [_row(s) for s in range(10)])
    side = run / f"{stem}.meta.json"
    write_sidecar(side, rank=rank, stream=None, rows=10, nbytes=0, last_step=9,
                  status="running", world=3)
    meta = json.loads(side.read_text())
    here = os.uname().nodename
    if spooled:
        meta.update(source="spool", origin_host=here, origin_pid=done.pid, host=here, pid=1)
    else:
        meta.update(host=here, pid=done.pid)
    side.write_text(json.dumps(meta))
    t = time.time() - ago
    for f in (run / f"{stem}.jsonl", side):
        os.utime(f, (t, t))


def test_a_spooled_rank_whose_process_just_ended_is_not_taken_for_crashed_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In spool mode the training process ends right after writing its finish into the
    spool, and exprd applies it a moment later: a pass between the two saw a running
    sidecar and a gone process, and paged a crash. A spooled rank counts as crashed once
    its process has been gone for SPOOL_GRACE, or when exprd has not written it for that
    long; a direct-mode rank (the SDK writes its own finish) at once."""
    from expr_tracker.health import state as state_mod

    monkeypatch.setattr(state_mod, "SPOOL_GRACE", 1.0)
    run = tmp_path / "p" / "r"
    _gone_writer(run, 0, spooled=True)  # just written by exprd
    _gone_writer(run, 1, spooled=True, ago=60.0)  # exprd has not written it for a minute
    _gone_writer(run, 2, spooled=False)
    reader = RunReader(run)
    first = reader.read()
    assert first.ranks[0].status == "running"
    assert first.ranks[1].status == "crashed" and first.ranks[1].status_reason == "process gone"
    assert first.ranks[2].status == "crashed" and first.ranks[2].status_reason == "process gone"
    time.sleep(1.1)
    later = reader.read()
    assert later.ranks[0].status == "crashed" and later.ranks[0].status_reason == "process gone"
    # a one-shot read of the same files, now quiet for over a second: crashed at once
    assert read_run(run).ranks[0].status == "crashed"


def test_a_write_seen_by_a_late_pass_is_dated_when_it_happened(tmp_path: Path) -> None:
    """Passes can be far apart (`expr serve` passes only when a page asks): a shard that
    grew between two passes is dated by its mtime within that span, not by the pass that
    saw it (a crash seen by the first request after it read "0s ago")."""
    run = tmp_path / "p" / "r"
    shard = run / "metrics.jsonl"
    write_shard(shard, [_row(s) for s in range(10)])
    write_sidecar(run / "metrics.meta.json", rank=0, stream=None, rows=10, nbytes=0,
                  last_step=9, status="running", world=1)
    reader = RunReader(run)
    reader.read()
    time.sleep(0.5)
    with shard.open("ab") as fh:
        fh.write(b'{"_step": 10, "_time": 1010.0, "loss": 1.0}\n')
    wrote = time.time()
    time.sleep(1.5)
    rs = reader.read().ranks[0]
    assert rs.last_step == 10
    assert rs.last_write is not None and abs(rs.last_write - wrote) < 0.5, (rs.last_write, wrote)
    assert rs.advanced == rs.last_write
