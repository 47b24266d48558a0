"""Tails read in a worker process come back whole: `TailList` sends them as one `marshal`
blob (pickle cost as long as the read at 16,384 shards), and what arrives must equal what
the worker read, for every kind of value a shard holds."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import pytest

from expr_tracker.health.state import RunReader, list_shards
from expr_tracker.health.tail import ShardTail, TailList, refresh_all
from tests.conftest import write_sidecar

ODD = [1.5, 2, True, None, "NaN", "Infinity", "fast", 10**30, -(2**63), [1, {"a": None}]]


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "p" / "r"
    run.mkdir(parents=True)
    for rank in range(3):
        lines = []
        for s, v in enumerate(ODD):
            lines.append(json.dumps({"_step": s, "_time": 100.0 + s, "loss": v, "é": "ü"}))
            for r in (rank, rank + 10):  # another `_rank` too: an all-gather
                lines.append(json.dumps({"_kind": "rank", "_step": s, "_time": 100.5 + s,
                                         "_rank": r, "_world_size": 3, "step_time": v}))
            lines.append(json.dumps({"_kind": "rank", "_step": s, "_rank": rank,
                                     "system/rss_mb": 10.0 + s, "system/cpu_percent": 5}))
        body = "\n".join(lines) + "\nNaN\n" + '{"_step": 3, "loss": NaN}\n' + '{"torn'
        path = run / f"metrics.rank{rank}.jsonl" if rank else run / "metrics.jsonl"
        path.write_text(body)
        if rank != 2:  # rank 2: no sidecar
            write_sidecar(path.with_name(path.name[: -len(".jsonl")] + ".meta.json"), rank=rank,
                          stream=None, rows=len(lines), nbytes=0, last_step=9, world=3)
    return run


def _plain(t: ShardTail) -> dict:
    out = dict(vars(t))
    out["rank_recs"] = {r: (repr(list(q)), q.maxlen) for r, q in t.rank_recs.items()}
    out["series"] = {r: (list(s.steps), repr(list(s.values)), repr(s.latest))
                     for r, s in t.series.items()}
    out["last_row"] = repr(t.last_row)  # (NaN != NaN: compared as text)
    out["system"] = repr(t.system)
    return out


@pytest.mark.parametrize("series", [None, "step_time"])
def test_tails_survive_the_trip_back_from_a_worker(tmp_path: Path, series: str | None) -> None:
    run = _run(tmp_path)
    tails = [ShardTail(p, r, None, 4, series) for r, p in sorted(list_shards(run).items())]
    read = refresh_all(tails)
    assert isinstance(read, TailList) and all(t.ok for t in read)
    back = pickle.loads(pickle.dumps(read))
    assert [_plain(t) for t in back] == [_plain(t) for t in read]
    assert type(back[0].path) is type(read[0].path)
    assert back[0].rank_recs or back[0].series
    if series:
        assert any(math.isnan(v) for s in back[0].series.values() for v in s.values)
    # a tail that came back refreshes as one that never left
    for t in back:
        assert t.refresh()
    (run / "metrics.jsonl").open("a").write(  # (after the torn line)
        "\n" + json.dumps({"_step": 99, "_time": 1.0}) + "\n")
    assert back[0].refresh() and back[0].last_step == 99 and back[0].read_now


def test_a_forked_first_read_equals_one_in_process(tmp_path: Path, monkeypatch) -> None:
    """The reader forks its first read from `_FORK_MIN` shards on; the state must be the
    one a single process reads."""
    from expr_tracker.health import state as st
    from expr_tracker.health import tail
    from expr_tracker.stats import parallel

    run = _run(tmp_path)
    for rank, shard in enumerate(sorted(run.glob("metrics*.jsonl"))):
        # a `_rank` every shard names (read in different pieces: merged as they come)
        with shard.open("a") as fh:
            fh.write("\n" + json.dumps({"_kind": "rank", "_step": 20 + rank, "_rank": 99,
                                        "step_time": 0.5 + rank}) + "\n")
    one = RunReader(run, series="step_time").read()
    assert 99 in one.rank_records
    monkeypatch.setattr(st, "_FORK_MIN", 2)
    # a fork server's workers: this process may have threads (no fork then)
    monkeypatch.setattr(parallel, "_context", lambda: multiprocessing.get_context("forkserver"))
    made: set[int] = set()
    init = tail.ShardTail.__init__

    def noted(self: ShardTail, *args: Any) -> None:
        init(self, *args)
        made.add(id(self))

    monkeypatch.setattr(tail.ShardTail, "__init__", noted)
    reader = RunReader(run, series="step_time")
    forked = reader.read()
    assert [r for r, t in reader._tails.items() if id(t) not in made], "none from a worker"
    assert repr(forked.ranks) == repr(one.ranks)
    assert repr(forked.rank_records) == repr(one.rank_records)
    assert repr(forked.series) == repr(one.series)
