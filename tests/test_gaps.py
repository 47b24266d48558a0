"""expr_cli.data.gaps: the stalls a finished run's files reveal (issue 44)."""

from __future__ import annotations

from pathlib import Path

from expr_cli.data.gaps import FLOOR, SAMPLED, found_stalls
from expr_cli.resolve import RunRef, shards_of

from .synthetic import T0, write_run


def _found(run: Path, world: int) -> dict:
    return found_stalls(shards_of(RunRef(run, "p/r"), None), world)


def test_a_pause_of_every_rank_before_a_step_is_a_stall(tmp_path: Path) -> None:
    run = write_run(tmp_path / "p" / "r", 4, 60, crashed=3, stall=(20, 40.0), status="finished")
    got = _found(run, 4)
    assert got["checked"] == [0, 1, 2, 3] and got["threshold"] == max(FLOOR, 20 * 1.0)  # 20 periods
    assert got["stalls"] == [{"step": 20, "after": 19, "gap_s": 41.0, "start": T0 + 19,
                              "end": T0 + 60.0}]


def test_no_stall_and_a_pause_of_one_rank_only_are_none(tmp_path: Path) -> None:
    run = write_run(tmp_path / "p" / "r", 4, 30, status="finished")
    assert _found(run, 4)["stalls"] == []
    # one rank's pause (its rows further apart): not every rank's, not a stall
    lone = write_run(tmp_path / "p" / "lone", 4, 30, straggler=1, slow=30.0, status="finished",
                     rank_records=False)
    assert _found(lone, 4)["stalls"] == []


def test_a_big_run_reads_a_few_shards_spread_over_the_ranks(tmp_path: Path) -> None:
    run = write_run(tmp_path / "p" / "r", 64, 12, stall=(5, 30.0), status="finished")
    got = _found(run, 64)
    assert len(got["checked"]) == SAMPLED and got["checked"][0] == 0 and got["checked"][-1] == 63
    assert [s["step"] for s in got["stalls"]] == [5]
