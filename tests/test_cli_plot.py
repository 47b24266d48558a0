"""`expr plot`: a chart per rank in the terminal, PNG/SVG files, many ranks as a band."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from expr_cli.commands.plot import parse_ranks  # (the command re-exports it)
from expr_cli.data.series import smooth
from tests.test_cli_export import _blocked
from tests.views_runs import make_run

EXPR = [sys.executable, "-c", "from expr_cli.main import entry; entry()"]


@pytest.fixture
def run4(tmp_path):
    return make_run(tmp_path / "p" / "four", ranks=4, steps=30)


def test_terminal_chart_of_a_4_rank_run(cli, run4):
    result = cli("plot", str(run4), "-m", "loss")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "p/four  loss" in text and "step" in text
    assert all(f"rank {r}" in text for r in range(4))
    assert "\x1b[" not in text  # not a terminal: no colour codes
    assert max(len(line) for line in text.splitlines()) <= 100  # COLUMNS=100 in the fixture


def test_colour_follows_force_color_and_no_color(cli, run4):
    assert "\x1b[" in cli("plot", str(run4), "-m", "loss", FORCE_COLOR="1").stdout
    assert "\x1b[" not in cli("plot", str(run4), "-m", "loss", FORCE_COLOR="1", NO_COLOR="1").stdout


def test_png_and_svg_files(cli, run4, tmp_path):
    import matplotlib.image

    png = tmp_path / "loss.png"
    result = cli("plot", str(run4), "-m", "loss", "-m", "lr", "--out", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 600 and height > 400
    svg = tmp_path / "loss.svg"
    assert cli("plot", str(run4), "-m", "loss", "-o", str(svg), "--rank", "1").exit_code == 0
    assert b"<svg" in svg.read_bytes()[:1000]


def test_ranks_steps_and_smoothing_in_json(cli, run4):
    result = cli("plot", str(run4), "-m", "loss", "--rank", "0,2-3", "--steps", "10:20", "--smooth", "3",
                 "--json")
    assert result.exit_code == 0, result.output
    (panel,) = json.loads(result.stdout)["panels"]
    assert [line["label"] for line in panel["lines"]] == ["rank 0", "rank 2", "rank 3"]
    line = panel["lines"][0]
    assert line["steps"] == list(range(10, 20)) and panel["band"] is None
    raw = [round(2.0 / (s + 1), 6) for s in range(10, 20)]
    assert line["values"] == pytest.approx(smooth(raw, 3))


def test_many_ranks_draw_median_band_and_outliers(cli, tmp_path):
    run = make_run(tmp_path / "p" / "wide", ranks=24, steps=30, outlier=17, nan_at=(3, 5))
    result = cli("plot", str(run), "-m", "loss", "--json")
    assert result.exit_code == 0, result.output
    (panel,) = json.loads(result.stdout)["panels"]
    assert [(line["kind"], line["label"]) for line in panel["lines"]] == [
        ("median", "median of 24 ranks"), ("outlier", "rank 17 (outlier)")]
    band = panel["band"]
    assert len(band["steps"]) == 30 and all(lo <= hi for lo, hi in zip(band["lo"], band["hi"], strict=True))
    assert "24 ranks" in panel["note"]
    png = tmp_path / "wide.png"
    assert cli("plot", str(run), "-m", "loss", "-o", str(png)).exit_code == 0
    text = cli("plot", str(run), "-m", "loss").stdout
    assert "median of 24 ranks" in text and "rank 17 (outlier)" in text and "rank 5 " not in text


def test_a_rank_metric_is_drawn_per_rank_from_the_rank_records(cli, tmp_path, monkeypatch):
    """`step_time` logged with `log_rank_metrics` (no step row holds it): a line per
    `_rank` of the records, wherever they sit (rank 0's shard holds an all-gathered copy
    of every rank's), one point per step with the latest record winning (a repeated
    system sample at the last step)."""
    import expr_tracker as et

    root = tmp_path / "runs"
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        with et.init("p", "ranked", dir=root, system_metrics=False) as run:
            for s in range(6):
                et.log({"loss": 1.0 / (s + 1)}, step=s)
                run.log_rank_metrics({"step_time": 0.1 * (rank + 1) + s / 100}, step=s)
                if rank == 0:  # an all-gather: rank 0 writes every rank's record again
                    for r in (1, 2):
                        run.log_rank_metrics({"step_time": 0.1 * (r + 1) + s / 100}, step=s,
                                             rank=r)
            run.log_rank_metrics({"step_time": 9.0}, step=5)  # a later record of step 5
    result = cli("plot", str(root / "p" / "ranked"), "-m", "step_time", "--json")
    assert result.exit_code == 0, result.output
    (panel,) = json.loads(result.stdout)["panels"]
    lines = {line["label"]: line for line in panel["lines"]}
    assert sorted(lines) == ["rank 0", "rank 1", "rank 2"]
    for r in range(3):
        assert lines[f"rank {r}"]["steps"] == list(range(6))
        assert lines[f"rank {r}"]["values"][:5] == pytest.approx(
            [0.1 * (r + 1) + s / 100 for s in range(5)])
    assert [lines[f"rank {r}"]["values"][5] for r in range(3)] == [9.0, 9.0, 9.0]
    loss = json.loads(cli("plot", str(root / "p" / "ranked"), "-m", "loss", "--json").stdout)
    assert [line["label"] for line in loss["panels"][0]["lines"]] == ["rank 0", "rank 1", "rank 2"]
    bad = cli("plot", str(root / "p" / "ranked"), "-m", "step_tim")
    assert bad.exit_code == 1 and "did you mean step_time?" in bad.stderr


@pytest.mark.parametrize(("args", "code", "message"), [
    (["-m", "los"], 1, "unknown metric los (did you mean loss?)"),
    ([], 2, "name at least one metric"),
    (["-m", "loss", "--rank", "x"], 2, "--rank must be"),
    (["-m", "loss", "--rank", "9"], 1, "no finite values of loss in rank 9"),
    (["-m", "loss", "--rank", "100000000000"], 2, "--rank 100000000000 is past the largest world"),
    (["-m", "loss", "-o", "x.pdf"], 2, "--out must end in .png or .svg"),
    (["-m", "loss", "--smooth", "0"], 2, "--smooth must be >= 1"),
])
def test_bad_plot_is_one_line(cli, run4, args, code, message):
    result = cli("plot", str(run4), *args)
    assert result.exit_code == code, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_a_huge_rank_range_is_clamped_to_the_largest_world(cli, run4):
    """Before: `--rank 1-100000000000` built a list of 1e11 ints ("internal error: MemoryError")."""
    res = cli("plot", str(run4), "-m", "loss", "--rank", "1-100000000000", "--json")
    assert res.exit_code == 0, res.output
    labels = [line["label"] for line in json.loads(res.stdout)["panels"][0]["lines"]]
    assert labels == ["rank 1", "rank 2", "rank 3"], labels


def test_parse_ranks_and_smooth():
    assert parse_ranks("all") is None and parse_ranks("3,0-1,3") == [0, 1, 3]
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_follow_redraws_until_ctrl_c(run4):
    env = {**os.environ, "COLUMNS": "80", "LINES": "24"}
    proc = subprocess.Popen([*EXPR, "plot", str(run4), "-m", "loss", "--follow", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            # a test run in a background job inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        seen = b""
        while seen.count(b"\x1b[2J") < 2 and time.monotonic() < deadline:
            seen += os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
        assert seen.count(b"\x1b[2J") >= 2 and b"rank 3" in seen
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert b"Traceback" not in err


def test_missing_plotext_names_the_extra(run4):
    proc = _blocked("plotext", "plot", str(run4), "-m", "loss")
    assert proc.returncode == 1
    assert proc.stderr == "error: expr plot needs plotext: pip install 'expr-tracker[plot]'\n"
