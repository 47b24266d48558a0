"""`expr serve`'s first tiles (issue 44 item 4): `summary?first=1` answers the frontier
step from the live state's first pass (`data.first`), before the window of every tail is
read; every field it gives is the whole summary's, and the CLI's `--json`, on a run with a
crashed rank, a finished one behind, a NaN value, a system sample and, with `lagging`, a
live rank three steps behind the others (whose last records then fall short of the
frontier: their shards are read again from the end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from expr_cli.web import live as live_mod
from expr_cli.web.api import Api
from expr_cli.web.live import LiveRuns
from expr_tracker.health.config import HealthConfig

from .synthetic import write_run

WORLD, STEPS = live_mod.QUICK_MIN, 12  # (QUICK_MIN: the quick first pass, window 2)
CRASHED, FINISHED, LAGGING, NAN, SAMPLED = 9, 13, 7, 3, 11


def _rewrite(shard: Path, keep: int | None = None, nan: bool = False,
             sample: bool = False) -> None:
    """Shard `shard` cut to its first `keep` steps, the step_time of its last 4 steps NaN
    (as the SDK writes it), or a system sample after its last record (dated a step behind,
    as the SDK's are)."""
    lines = shard.read_text().splitlines(keepends=True)
    if keep is not None:
        lines = lines[: 2 * keep]
    for i in range(len(lines) - 7, len(lines), 2) if nan else ():
        rec = json.loads(lines[i])
        rec["step_time"] = "NaN"
        lines[i] = json.dumps(rec, separators=(",", ":")) + "\n"
    if sample:
        last = json.loads(lines[-1])
        lines.append(json.dumps({"_kind": "rank", "_step": last["_step"] - 1, "_time": last["_time"],
                                 "_rank": last["_rank"], "_source": "system",
                                 "system/cpu_percent": 50.0}) + "\n")
    shard.write_text("".join(lines))
    side = shard.with_name(shard.name[: -len(".jsonl")] + ".meta.json")
    meta = json.loads(side.read_text())
    if keep is not None:
        meta["cursor"].update(last_step=keep - 1, next_step=keep)
        meta["status"] = "finished" if shard.name.endswith(f"rank{FINISHED}.jsonl") else "running"
    meta["cursor"]["bytes"] = shard.stat().st_size
    side.write_text(json.dumps(meta))


def write(root: Path, lagging: bool = False) -> Path:
    run = write_run(root / "proj" / "big", WORLD, STEPS, straggler=5, crashed=CRASHED)
    _rewrite(run / f"metrics.rank{FINISHED}.jsonl", keep=STEPS // 2 + 2)
    _rewrite(run / f"metrics.rank{NAN}.jsonl", nan=True)
    _rewrite(run / f"metrics.rank{SAMPLED}.jsonl", sample=True)
    if lagging:
        _rewrite(run / f"metrics.rank{LAGGING}.jsonl", keep=STEPS - 3)
    return root.resolve()


@pytest.mark.parametrize("lagging", [False, True], ids=["together", "lagging"])
def test_the_first_answer_is_the_whole_summarys_and_the_clis(cli: Any, cli_root: Path,
                                                             lagging: bool) -> None:
    root = write(cli_root, lagging)
    api = Api(root, LiveRuns(HealthConfig()))
    first = api.summary("proj", "big", {"chart": ["step_time"], "first": ["1"]})
    assert first["first"] is True  # (not the whole summary: the state answered it)
    whole = api.summary("proj", "big", {"chart": ["step_time"]})
    assert "first" not in whole and "chart" not in first and "coverage" not in first
    result = cli("summary", "proj/big", "--json")
    assert result.exit_code == 0, result.output
    cli_view = json.loads(result.stdout)
    for want in (whole, cli_view):
        for k, v in first.items():
            if k not in ("keys", "first", "version"):
                assert v == want[k], k
        items = {i["key"]: i for i in want["keys"]}
        assert [i["key"] for i in first["keys"]] == list(items)
        for item in first["keys"]:
            assert item == {k: v for k, v in items[item["key"]].items() if k != "note"}, item["key"]
    # what the tiles show: the crash counted apart, the finished rank behind, the NaN
    stats = {i["key"]: i for i in first["keys"]}["step_time"]
    assert first["ranks"]["crashed"] == [CRASHED]
    behind = {b["rank"]: b["status"] for b in stats["behind"]}
    assert behind == {CRASHED: "crashed", FINISHED: "finished"}
    assert stats["stats"]["nonfinite_ranks"] == [NAN]
    assert first["step"] == first["ranks"]["frontier"] == (STEPS - 4 if lagging else STEPS - 1)


def test_a_run_the_state_cannot_answer_gets_the_whole_summary(cli_root: Path) -> None:
    """Rank 0 logs every rank's records (an all-gather): the last records of its shard are
    not the others', and the whole summary answers `first=1`."""
    root = write(cli_root)
    run = root / "proj" / "big"
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"_kind": "rank", "_step": STEPS - 1, "_time": 1.0, "_rank": 1,
                             "_world_size": WORLD, "step_time": 0.5}) + "\n")
    api = Api(root, LiveRuns(HealthConfig()))
    got = api.summary("proj", "big", {"chart": ["step_time"], "first": ["1"]})
    assert "first" not in got and got["chart"]["key"] == "step_time"
    assert got == api.summary("proj", "big", {"chart": ["step_time"]})
