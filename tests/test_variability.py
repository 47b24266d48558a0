"""Is a rank noisier, and do the weights matter? `expr summary --steps` over real rank processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from expr_cli.main import build_app
from expr_tracker.stats.variability import variability, weighted_gap
from tests.procs import run_all, spawn

# each rank logs 40 steps of step_time (mean 0.2 s) and a weighted loss; rank 1's step time
# swings 10x wider than the others' (+-0.05 s against +-0.005 s), its mean the same
RANK = """
import expr_tracker as et
rank = {rank}
run = et.init("p", "noisy", dir={root!r})
amp = 0.05 if rank == 1 else 0.005
for step in range(40):
    sign = 1 if step % 2 else -1
    et.log({{"loss": 1.0}})
    et.log_rank_metrics({{"step_time": 0.2 + sign * amp * (1 + (step % 3) / 10),
                          "tokens_loss": 1.0 + rank}}, step=step, weight=10.0 ** rank)
et.finish()
"""


def _job(root: Path, world: int = 4) -> None:
    procs = [spawn(RANK.format(rank=r, root=str(root)),
                   {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)})
             for r in range(world)]
    run_all(procs)


def _summary(root: Path, *args: str):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(build_app(), ["summary", "p/noisy", "--dir", str(root), *args],
                                env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result


def test_a_rank_that_swings_wider_is_noisier_not_an_outlier(tmp_path: Path) -> None:
    _job(tmp_path)
    view = json.loads(_summary(tmp_path, "--steps", "0:40", "-m", "step_time", "--json",
                               "--outliers").stdout)
    (item,) = view["keys"]
    assert item["n_flagged"] == 0  # the means agree: no outlier of the value
    var = item["variability"]
    assert var["by"] == "cv"
    assert [o["rank"] for o in var["noisier"]] == [1]
    by_rank = {r["rank"]: r for r in var["ranks"]}
    assert set(by_rank) == {0, 1, 2, 3} and all(r["n"] == 40 for r in by_rank.values())
    assert 8 < by_rank[1]["cv"] / by_rank[0]["cv"] < 12
    # without --outliers the JSON names the noisier ranks, not every rank's numbers
    brief = json.loads(_summary(tmp_path, "--steps", "0:40", "-m", "step_time", "--json").stdout)
    var = brief["keys"][0]["variability"]
    assert "ranks" not in var and var["n_ranks"] == 4 and [o["rank"] for o in var["noisier"]] == [1]
    text = _summary(tmp_path, "--steps", "0:40", "-m", "step_time").stdout
    assert re.search(r"rank 1 \(\S+\) noisier: CV 0\.28 vs 0\.028 median", text), text
    assert "no outliers" in text


def test_weights_that_go_with_the_values_are_named(tmp_path: Path) -> None:
    _job(tmp_path)
    view = json.loads(_summary(tmp_path, "--steps", "0:40", "-m", "tokens_loss,step_time",
                               "--json").stdout)
    items = {i["key"]: i for i in view["keys"]}
    # the heaviest rank (3) reports the highest loss: wmean ~3.89 against a mean of 2.5
    assert items["tokens_loss"]["weighted"]["differs"] is True
    assert items["step_time"]["weighted"]["differs"] is False
    text = _summary(tmp_path, "--steps", "0:40", "-m", "tokens_loss").stdout
    assert "weighted: wmean 3.889 differs from mean 2.5" in text, text
    assert "the weights go with the values" in text
    # and at one step too
    view = json.loads(_summary(tmp_path, "--step", "10", "-m", "tokens_loss", "--json").stdout)
    assert view["keys"][0]["weighted"]["differs"] is True
    assert "variability" not in view["keys"][0]


def test_variability_rules() -> None:
    steady = [1.0, 1.1, 0.9, 1.0]
    v = variability({0: steady, 1: steady, 2: [1.0, 3.0, -1.0, 1.0], 3: steady, 4: [5.0]})
    assert v.by == "cv" and [o["rank"] for o in v.noisier] == [2]
    assert [s.rank for s in v.ranks] == [0, 1, 2, 3]  # one value: no variability
    # a steadier rank is not news
    assert variability({0: [1.0, 1.5], 1: [1.0, 1.5], 2: [1.0, 1.5], 3: [1.0, 1.0]}).noisier == []
    # a mean of 0 makes the CV meaningless: the std is compared
    v = variability({0: [-1.0, 1.0], 1: [-1.1, 1.1], 2: [-0.9, 0.9], 3: [-9.0, 9.0], 4: [-1.0, 1.0]})
    assert v.by == "std" and [o["rank"] for o in v.noisier] == [3]
    assert weighted_gap(1, 1.0, 2.0, 0.5) is None
    gap = weighted_gap(4, 1.0, 1.2, 0.1)
    assert gap is not None and gap["differs"] and abs(gap["se"] - 0.05) < 1e-12
    gap = weighted_gap(4, 1.0, 1.05, 0.1)
    assert gap is not None and not gap["differs"]
