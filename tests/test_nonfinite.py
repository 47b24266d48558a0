"""The writer's notes of non-finite values (`store.nonfinite`), and their life in a real
shard's sidecar across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from expr_tracker.store import nonfinite
from tests.procs import run_all, spawn


def _lines(*recs: dict[str, object]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in recs)


def test_notes_the_first_step_and_rank_of_each_key() -> None:
    notes: dict[str, dict[str, object]] = {}
    data = _lines({"_step": 3, "_time": 1.0, "loss": 0.5, "NaN": 1.0},  # a key named NaN: no
                  {"_step": 4, "_time": 2.0, "loss": "NaN"},
                  {"_kind": "rank", "_step": 4, "_rank": 7, "grad": "-Infinity"},
                  {"_step": 5, "_time": 3.0, "loss": "Infinity"})
    assert nonfinite.note(data + b'{"_step": 6, "x": "NaN"', notes, 2)  # (a torn tail: not yet)
    assert notes == {
        "loss": {"step": 4, "rank": 2, "value": "NaN", "rows": 2, "ranks": [2]},
        "grad": {"step": 4, "rank": 7, "value": "-Infinity", "rows": 1, "ranks": [7]},
    }
    assert not nonfinite.note(_lines({"_step": 7, "_time": 4.0, "loss": 1.0}), notes, 2)
    assert not nonfinite.note(_lines({"_step": 8, "_time": 5.0, "NLL": 1.0, "IoU": 2.0}), notes, 2)


def test_keys_are_bounded_and_kept_notes_filtered() -> None:
    notes: dict[str, dict[str, object]] = {}
    nonfinite.note(_lines({"_step": 1, **{f"k{i}": "NaN" for i in range(50)}}), notes, 0)
    assert len(notes) == nonfinite.MAX_KEYS
    assert nonfinite.kept({"a": {"step": 1}, "b": {"step": "x"}, 3: {}, "c": []}) == {"a": {"step": 1}}
    assert nonfinite.kept(["not", "a", "mapping"]) == {}


JOB = """
import os
import expr_tracker as et
with et.init("p", "r", dir=os.environ["ROOT"]):
    for i in range(int(os.environ["N"])):
        et.log({"loss": float("nan") if i == int(os.environ["AT"]) else 1.0})
"""


def test_a_resumed_shard_keeps_the_first_note(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run_all([spawn(JOB, {"RANK": "0", "ROOT": str(root), "N": "20", "AT": "10"})])
    run_all([spawn(JOB, {"RANK": "0", "ROOT": str(root), "N": "20", "AT": "5"})])  # steps 20-39
    side = json.loads((root / "p" / "r" / "metrics.meta.json").read_text())
    assert side["nonfinite"]["loss"]["step"] == 10, side["nonfinite"]  # the first stays first
    assert side["nonfinite"]["loss"]["rows"] == 2


def test_the_detector_names_the_first_and_takes_only_changed_ranks() -> None:
    from expr_tracker.health.nonfinite import Seen, nonfinite
    from expr_tracker.health.state import RankState, RunState

    ranks = {r: RankState(rank=r, stream=None, path=Path(f"/r/{r}"), host=f"h{r // 8}")
             for r in range(32)}
    ranks[5].nonfinite = {"loss": {"step": 12, "rank": 5, "value": "NaN", "rows": 1, "ranks": [5]}}
    ranks[3].nonfinite = {"loss": {"step": 12, "rank": 3, "value": "Infinity", "ranks": [3]},
                          "bad": "not a note"}

    def state(changed: set[int]) -> RunState:
        return RunState(run_dir=Path("/r"), stream=None, ranks=ranks, rank_records={},
                        read_time=0.0, changed=frozenset(changed))

    seen = Seen()
    [got] = nonfinite(state(set(ranks)), seen)
    assert (got["key"], got["rank"], got["step"], got["ranks"]) == ("loss", 3, 12, (3, 5))
    assert got["detail"] == "loss is Infinity on rank 3 at step 12 (first; 2 ranks so far: 3,5)"
    assert got["host"] == "h0"
    ranks[9].nonfinite = {"loss": {"step": 4, "rank": 9, "value": "NaN", "ranks": [9]}}
    assert nonfinite(state(set()), seen)[0]["rank"] == 3  # not changed: not looked at
    [got] = nonfinite(state({9}), seen)
    assert (got["rank"], got["step"], got["ranks"]) == (9, 4, (3, 5, 9))
    assert nonfinite(state(set()))[0]["rank"] == 9  # one-shot: every rank
