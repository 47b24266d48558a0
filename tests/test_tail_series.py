"""A compact tail's series (`RunReader(series=KEY)`, what watchers and `expr serve` keep)
holds KEY's value of each rank record as a float, NaN where it is not a number: the bulk
conversion of a clean window and the value-by-value one of a mixed window agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

from expr_tracker.health.state import RunReader
from tests.conftest import write_sidecar

MIXED = [1.5, 2, True, None, "NaN", "Infinity", "-Infinity", "fast", 10**400, -3.25]
WANT = [1.5, 2.0, math.nan, math.nan, math.nan, math.inf, -math.inf, math.nan, math.nan, -3.25]


def _shard(path: Path, rank: int, values: list) -> None:
    lines = []
    for s, v in enumerate(values):
        lines.append(json.dumps({"_step": s, "_time": 100.0 + s, "loss": 1.0}))
        rec = {"_kind": "rank", "_step": s, "_time": 100.5 + s, "_rank": rank, "_world_size": 2}
        if v is not None:
            rec["step_time"] = v
        lines.append(json.dumps(rec))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    write_sidecar(path.with_name(path.name[: -len(".jsonl")] + ".meta.json"), rank=rank,
                  stream=None, rows=len(values), nbytes=0, last_step=len(values) - 1, world=2)


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b, strict=True))


def test_series_values_clean_and_mixed(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    clean = [0.5 + i / 100 for i in range(8)] + [3]  # floats and an int: converted in bulk
    _shard(run / "metrics.jsonl", 0, clean)
    _shard(run / "metrics.rank1.jsonl", 1, MIXED)
    state = RunReader(run, window=64, series="step_time").read()
    assert _same(list(state.series[0]), [float(v) for v in clean])
    assert _same(list(state.series[1]), WANT)
    # appended later (the forward read): a mixed block after a clean one
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"_kind": "rank", "_step": 9, "_time": 1.0, "_rank": 0,
                             "step_time": "NaN"}) + "\n")
    reader = RunReader(run, window=4, series="step_time")
    reader.read()
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"_kind": "rank", "_step": 10, "_time": 1.0, "_rank": 0,
                             "step_time": 7}) + "\n")
    got = list(reader.read().series[0])
    assert _same(got, [clean[-2], 3.0, math.nan, 7.0])


def test_the_latest_system_sample_of_each_rank(tmp_path: Path) -> None:
    run = tmp_path / "p" / "r"
    _shard(run / "metrics.jsonl", 0, [1.0] * 6)
    _shard(run / "metrics.rank1.jsonl", 1, [1.0] * 6)
    with open(run / "metrics.jsonl", "a") as fh:
        for s, key in ((3, "system/cpu_percent"), (4, "system/rss_mb"), (5, "loss")):
            fh.write(json.dumps({"_kind": "rank", "_step": s, "_time": 1.0, "_rank": 0,
                                 key: 10.0 * s}) + "\n")
    for series in ("step_time", None):
        state = RunReader(run, window=8, series=series).read()
        assert state.system == {0: {"system/rss_mb": 40.0, "_step": 4}}  # not step 5's record
