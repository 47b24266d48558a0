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
