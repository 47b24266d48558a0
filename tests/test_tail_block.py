"""A small window's first reverse read is a few lines (SMALL_BLOCK), not TAIL_BLOCK; the
state read is the same either way (issue 24)."""

from __future__ import annotations

import json
import math

import pytest

from expr_tracker.health import tail
from expr_tracker.health.state import read_run
from tests.synthetic import write_run


def _state(run, window):
    st = read_run(run, window=window)
    out = {}
    for r in st.ranks:  # every rank: what the state says of it, its window and last row
        t = st.ranks[r]
        out[r] = json.dumps({k: repr(v) for k, v in vars(t).items()}, sort_keys=True)
    return out, st.frontier


@pytest.mark.parametrize("window", [2, 8])
def test_small_first_block_reads_the_same_state(tmp_path, monkeypatch, window):
    run = write_run(tmp_path / "p" / "r", 12, 60, straggler=3, crashed=5)
    # long lines (a 6 KiB string value: more than one small block), NaN and text values
    with open(run / "metrics.rank7.jsonl", "a") as fh:
        for s in range(60, 64):
            fh.write(json.dumps({"_step": s, "_time": 1.0e9 + s, "loss": "NaN",
                                 "note": "x" * 6000}) + "\n")
    with open(run / "metrics.rank8.jsonl", "a") as fh:
        fh.write(json.dumps({"_step": 60, "_time": 1.0e9, "loss": "Infinity", "tag": "a"}) + "\n")
        fh.write('{"_step":61,"lo')  # a torn tail
    small = _state(run, window)
    monkeypatch.setattr(tail, "SMALL_BLOCK", tail.TAIL_BLOCK)  # the read before issue 24
    assert _state(run, window) == small
    assert len(small[0]) == 12 and small[1] is not None
    assert math.isnan(read_run(run, window=window).ranks[7].last_row["loss"])


@pytest.mark.parametrize("window", [16, 64])
def test_a_block_sized_by_the_steps_read_reads_the_same_state(tmp_path, monkeypatch, window):
    """Past the first block, the reverse read sizes the next one by the bytes a step took
    so far; with lines of every length (a few bytes to 3 KiB, all-gathered rank records,
    steps without rank records) the state is the one whole-file blocks read."""
    import random

    rng = random.Random(5)
    run = write_run(tmp_path / "p" / "r", 6, 20)
    for rank in range(6):
        name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
        with open(run / name, "a") as fh:
            for s in range(20, 220):
                width = rng.choice([0, 10, 300, 3000]) if rank != 4 else 3000 * (s % 3)
                fh.write(json.dumps({"_step": s, "_time": 1.0e9 + s, "loss": 1.0 / s,
                                     "pad": "y" * width}) + "\n")
                for r in ((rank,) if rank else range(6)) if s % 5 else ():
                    fh.write(json.dumps({"_kind": "rank", "_step": s, "_rank": r,
                                         "_world_size": 6, "step_time": 0.5,
                                         "pad": "z" * rng.choice([0, 900])}) + "\n")
    sized = _state(run, window)
    monkeypatch.setattr(tail, "SMALL_BLOCK", tail.MAX_CATCHUP)  # one block: the whole tail
    monkeypatch.setattr(tail, "TAIL_BLOCK", tail.MAX_CATCHUP)
    assert _state(run, window) == sized
    assert all(len(read_run(run, window=window).ranks[r].steps) == window for r in range(6))
