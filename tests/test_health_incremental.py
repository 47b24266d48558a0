"""A repeat pass reads only what changed, and still sees what time alone brings (a hang)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.state import RunReader
from expr_tracker.health.watch import Watcher
from expr_tracker.store.cursor import write_atomic
from tests.conftest import write_shard, write_sidecar

RANKS = 12


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


def _rows(first: int, last: int, gap: float = 1.0, t0: float = 1000.0) -> list[dict]:
    return [{"_step": s, "_time": t0 + s * gap, "loss": 1.0} for s in range(first, last + 1)]


def _append(path: Path, recs: list[dict]) -> None:
    with open(path, "ab") as fh:
        fh.write(b"".join(json.dumps(r).encode() + b"\n" for r in recs))


def _run(tmp_path: Path, steps: int = 30) -> Path:
    run = tmp_path / "p" / "r"
    for rank in range(RANKS):
        write_shard(run / f"{_stem(rank)}.jsonl", _rows(0, steps - 1))
        write_sidecar(run / f"{_stem(rank)}.meta.json", rank=rank, stream=None, rows=steps,
                      nbytes=0, last_step=steps - 1, status="running", world=RANKS)
    return run


def _settle(run: Path) -> None:
    """Date the run directory back, as if its last file was created a minute ago."""
    past = time.time() - 60
    os.utime(run, (past, past))


def test_a_repeat_pass_reads_only_the_shards_and_sidecars_that_changed(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _settle(run)
    reader = RunReader(run, window=8)
    first = reader.read()
    assert reader.shards_read == RANKS and reader.sidecars_read == RANKS
    assert first.changed == frozenset(range(RANKS)) and first.world_size == RANKS

    second = reader.read()  # nothing changed: no file opened, the same per-rank objects
    assert (reader.shards_read, reader.sidecars_read) == (0, 0)
    assert second.changed == frozenset()
    assert all(second.ranks[r] is first.ranks[r] for r in range(RANKS))

    _append(run / "metrics.rank3.jsonl", _rows(30, 34))
    _append(run / "metrics.rank7.jsonl", _rows(30, 31))
    third = reader.read()
    assert reader.shards_read == 2 and third.changed == frozenset({3, 7})
    assert third.ranks[3].last_step == 34 and third.ranks[7].last_step == 31
    assert [s for s, _ in third.ranks[3].step_times] == list(range(27, 35))
    assert third.ranks[5] is first.ranks[5]
    assert third.frontier == 29 and third.lead == 34  # run-wide values follow the change

    # a sidecar rewritten the way writers do it (temp file and rename) is read again
    side = run / "metrics.rank5.meta.json"
    meta = json.loads(side.read_text())
    meta["status"] = "finished"
    write_atomic(side, json.dumps(meta).encode())
    fourth = reader.read()
    assert reader.sidecars_read == 1 and reader.shards_read == 0
    assert fourth.changed == frozenset({5}) and fourth.ranks[5].status == "finished"
    assert [r.rank for r in fourth.live] == [r for r in range(RANKS) if r != 5]

    # a shard that goes away leaves the state; one that appears joins it
    (run / "metrics.rank11.jsonl").unlink()
    write_shard(run / "metrics.rank12.jsonl", _rows(0, 3))
    fifth = reader.read()
    assert sorted(fifth.ranks) == [*range(11), 12]
    assert fifth.changed == frozenset({11, 12}) and reader.shards_read == 1


def test_a_hang_appears_on_a_pass_with_nothing_written(tmp_path: Path) -> None:
    run = _run(tmp_path)
    now = time.time()
    for rank in range(RANKS):  # the others advanced to step 29; rank 4 stopped at step 10
        shard = run / f"{_stem(rank)}.jsonl"
        if rank == 4:
            write_shard(shard, _rows(0, 10), mtime=now - 100)
        else:
            os.utime(shard, (now, now))
    watcher = Watcher(run, HealthConfig(hang_after=90.0))
    assert watcher.check(now - 30) == []  # rank 4 silent for 70 s of 90: not yet
    assert watcher.reader.shards_read == RANKS
    opened = watcher.check(now)  # 100 s silent, and not one file changed since
    assert watcher.reader.shards_read == 0 and watcher.reader.sidecars_read == 0
    assert [(i.kind, i.ranks, i.state) for i in opened] == [("hang", (4,), "open")]
    assert watcher.check(now + 5) == []  # recorded once
    assert [i.kind for i in watcher.open] == ["hang"]


def test_a_straggler_in_new_rows_of_one_shard_is_seen(tmp_path: Path) -> None:
    run = _run(tmp_path)
    now = time.time()
    watcher = Watcher(run, HealthConfig(straggler_steps=5, slowdown_steps=5, hang_after=3600.0))
    assert watcher.check(now) == []
    # rank 2's next 25 steps take 3 s each; the others' windows stay as they were
    _append(run / "metrics.rank2.jsonl", _rows(30, 54, gap=3.0, t0=1000.0 - 60.0))
    opened = watcher.check(now)
    assert watcher.reader.shards_read == 1
    assert ("straggler", (2,)) in {(i.kind, i.ranks) for i in opened}
    assert all(i.ranks == (2,) for i in opened)
