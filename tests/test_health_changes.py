"""A reader with a kernel watch (`RunReader.watch_changes`, inotify) reads what the kernel
named and nothing else, yet sees everything a reader that `stat`s every shard sees:
appends, sidecars replaced, shards that appear, go or are renamed, an overflowed queue,
and a watch that misses writes (a network filesystem) is found out and dropped."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from expr_tracker.health import state as state_mod
from expr_tracker.health.changes import DirChanges, fs_type, watch_dir
from expr_tracker.health.state import RunReader, RunState
from expr_tracker.store.cursor import write_atomic
from tests.conftest import write_shard, write_sidecar

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")
RANKS = 8


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


def _rows(first: int, last: int) -> list[dict]:
    return [{"_step": s, "_time": 1000.0 + s, "loss": 1.0 / (s + 1)} for s in range(first, last + 1)]


def _append(path: Path, recs: list[dict]) -> None:
    with open(path, "ab") as fh:
        fh.write(b"".join(json.dumps(r).encode() + b"\n" for r in recs))


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "p" / "r"
    for rank in range(RANKS):
        write_shard(run / f"{_stem(rank)}.jsonl", _rows(0, 19))
        write_sidecar(run / f"{_stem(rank)}.meta.json", rank=rank, stream=None, rows=20,
                      nbytes=0, last_step=19, status="running", world=RANKS)
    return run


def _view(st: RunState) -> dict:
    """What a page shows of a state, comparable between two readers."""
    return {r: (rs.status, rs.last_step, list(rs.steps), list(rs.times), rs.size)
            for r, rs in st.ranks.items()} | {"frontier": st.frontier, "lead": st.lead}


@pytest.fixture
def watched(tmp_path: Path) -> tuple[Path, RunReader]:
    run = _run(tmp_path)
    reader = RunReader(run, window=8)
    if not reader.watch_changes():
        pytest.skip(f"no inotify watch on {fs_type(str(run))}")
    yield run, reader
    reader.close()


def test_an_idle_pass_stats_no_shard_and_every_change_is_seen(
        watched: tuple[Path, RunReader], monkeypatch: pytest.MonkeyPatch) -> None:
    run, reader = watched
    first = reader.read()
    assert not reader.dirty_pass and reader.shards_read == RANKS

    calls: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (calls.append(os.fspath(p)), real_stat(p, *a, **k))[1])
    second = reader.read()
    assert reader.dirty_pass and second.changed == frozenset()
    assert not [c for c in calls if c.endswith((".jsonl", ".meta.json"))]  # nothing stat'ed
    assert second.ranks is first.ranks and second.frontier == first.frontier
    monkeypatch.setattr(os, "stat", real_stat)

    _append(run / "metrics.rank3.jsonl", _rows(20, 24))
    third = reader.read()
    assert reader.dirty_pass and third.changed == frozenset({3}) and reader.shards_read == 1
    assert third.ranks[3].last_step == 24 and third.lead == 24 and third.frontier == 19
    assert third.ranks[5] is first.ranks[5]

    side = run / "metrics.rank5.meta.json"  # replaced as writers do: a temp file, a rename
    meta = json.loads(side.read_text())
    meta["status"] = "finished"
    write_atomic(side, json.dumps(meta).encode())
    fourth = reader.read()
    assert reader.dirty_pass and fourth.changed == frozenset({5})
    assert (reader.sidecars_read, reader.shards_read) == (1, 0)
    assert fourth.ranks[5].status == "finished"

    # a shard that appears, one that goes, one rotated (renamed away, a new one in its place)
    write_shard(run / "metrics.rank8.jsonl", _rows(0, 3))
    (run / "metrics.rank7.jsonl").unlink()
    os.rename(run / "metrics.rank6.jsonl", run / "metrics.rank6.jsonl.old")
    write_shard(run / "metrics.rank6.jsonl", _rows(30, 31))
    fifth = reader.read()
    assert not reader.dirty_pass  # a listing change: the directory is listed again
    assert sorted(fifth.ranks) == [0, 1, 2, 3, 4, 5, 6, 8]
    assert fifth.ranks[6].last_step == 31 and fifth.ranks[8].last_step == 3
    assert _view(fifth) == _view(RunReader(run, window=8).read())

    _append(run / "metrics.rank8.jsonl", _rows(4, 9))  # the new shard is watched too
    sixth = reader.read()
    assert reader.dirty_pass and sixth.changed == frozenset({8})
    assert _view(sixth) == _view(RunReader(run, window=8).read())


def test_an_overflowed_queue_means_a_stat_pass(watched: tuple[Path, RunReader]) -> None:
    run, reader = watched
    reader.read()
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    a, b = run / "metrics.rank1.jsonl", run / "metrics.rank2.jsonl"
    with open(a, "ab", buffering=0) as fa, open(b, "ab", buffering=0) as fb:
        for i in range(limit // 2 + 64):  # alternating names: the kernel merges none of them
            fa.write(json.dumps({"_step": 20 + i, "_time": 2000.0 + i}).encode() + b"\n")
            fb.write(json.dumps({"_step": 20 + i, "_time": 2000.0 + i}).encode() + b"\n")
    got = reader.read()
    assert not reader.dirty_pass and reader.changes.overflows == 1
    assert got.changed == frozenset({1, 2}) and got.ranks[2].last_step == 20 + limit // 2 + 63
    assert _view(got) == _view(RunReader(run, window=8).read())
    assert reader.read().changed == frozenset() and reader.dirty_pass  # back on the watch


def test_a_watch_that_misses_writes_is_dropped(
        tmp_path: Path, watched: tuple[Path, RunReader], monkeypatch: pytest.MonkeyPatch) -> None:
    run, reader = watched
    reader.read()
    # a watch that hears nothing of this run: what a network filesystem written by other
    # hosts gives (inotify reports only this kernel's writes)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reader.changes.close()
    reader.changes = watch_dir(elsewhere)
    assert isinstance(reader.changes, DirChanges)
    monkeypatch.setattr(state_mod, "VERIFY_EVERY", 0.3)
    _append(run / "metrics.rank4.jsonl", _rows(20, 22))
    missed = reader.read()
    assert reader.dirty_pass and missed.ranks[4].last_step == 19  # the watch did not say
    time.sleep(0.35)
    found = reader.read()  # the periodic stat pass finds the write, and the watch goes
    assert not reader.dirty_pass and found.ranks[4].last_step == 22
    assert reader.blind and reader.changes is None and not reader.watch_changes()
    _append(run / "metrics.rank4.jsonl", _rows(23, 23))
    assert reader.read().ranks[4].last_step == 23 and not reader.dirty_pass


def test_no_watch_on_a_network_filesystem_type(tmp_path: Path) -> None:
    assert fs_type("/proc/self") == "proc"
    assert watch_dir("/proc/self") is None  # not a filesystem whose writes this kernel sees all
    assert fs_type(str(tmp_path)) is not None
