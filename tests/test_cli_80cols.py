"""The CLI at 80 columns, as a terminal shows it: the step and the time always, no value cut."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expr_cli.main import build_app
from tests.conftest import NOW, T0, write_shard, write_sidecar
from tests.test_daemon import exprd_once, make_spool, write_config


@pytest.fixture
def cli80(cli_root: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`cli80("history", "wide")` -> the output at COLUMNS=80, frozen clock, root = cli_root."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("EXPR_NOW", str(NOW))
    monkeypatch.setenv("EXPR_DIR", str(cli_root))
    app = build_app()

    def run(*args: str) -> str:
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert all(len(line) <= 80 for line in lines), "\n".join(lines)
        assert "…" not in result.output, result.output  # nothing cut with an ellipsis
        return result.output

    return run


@pytest.fixture
def wide(cli_root: Path) -> Path:
    """proj/wide: 14 metric keys of 7-9 digits, too many for 80 columns."""
    run = cli_root / "proj" / "wide"
    recs = [{"_step": s, "_time": T0 + s,
             **{f"train/metric_{i:02d}": round(math.sin(s + i) * 1000, 3) for i in range(14)}}
            for s in range(5)]
    nbytes = write_shard(run / "metrics.jsonl", recs, mtime=T0 + 5)
    write_sidecar(run / "metrics.meta.json", rank=0, stream=None, rows=5, nbytes=nbytes,
                  last_step=4, world=1)
    return run


def test_history_of_many_keys_keeps_step_time_and_whole_values(cli80, wide, golden) -> None:  # type: ignore[no-untyped-def]
    out = cli80("history", "wide")
    header = out.splitlines()[1].split()
    assert header[:2] == ["step", "time"]
    said = " ".join(out.split())
    assert "11 more key(s) not shown (train/metric_03, train/metric_04, ...)" in said
    assert "-m KEY,KEY picks them, -f json or -f csv shows all" in said
    golden("history_wide_80.txt", out)
    # the keys asked for are shown, and all of them with -f json
    picked = cli80("history", "wide", "-m", "train/metric_13")
    assert "train/metric_13" in picked and "not shown" not in picked
    rows = json.loads(CliRunner().invoke(build_app(), ["history", "wide", "-f", "json"]).stdout)
    assert len(rows[0]) == 2 + 14


def test_shards_at_80_columns(cli80, golden) -> None:  # type: ignore[no-untyped-def]
    out = cli80("shards", "run-1")
    assert "written" in out and "step" in out
    golden("shards_run1_80.txt", out)


def test_summary_at_80_columns(cli80, golden) -> None:  # type: ignore[no-untyped-def]
    golden("summary_run1_80.txt", cli80("summary", "run-1", "-m", "train/loss"))


def test_status_at_80_columns(tmp_path: Path, cli80) -> None:  # type: ignore[no-untyped-def]
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    long_run = "llama-70b-pretrain-lr3e-4-warmup2000-bs4096"
    files = [make_spool(spool, root, name, 20) for name in (long_run, "b")]
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    out = cli80("status", "--state", str(state))
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("file "))
    assert lines[header].split()[1:] == ["state", "seq", "in", "shard", "lag", "lag", "s",
                                         "quarantined"], out
    # each run is a line of its own, its files under it: one line each, whole, with the
    # numbers in their columns (a spool file's path in one cell folded in two before)
    for f in files:
        run = f"{f.parent.parent.name}/{f.parent.name}"
        at = lines.index(run)
        row = lines[at + 1]
        assert row.startswith("  " + f.name.removesuffix(".jsonl") + " "), out
        assert row.split()[1:] == ["finished", "21", "21", "0", "B", "0.0", "0"], out
        # the columns line up with the header's
        assert row.rindex("0") == len(lines[header]) - 1, out
    assert len(lines) == header + 1 + 4 + 1, out  # two runs of one file each, the channel


def test_status_folds_a_file_name_longer_than_its_column(tmp_path: Path) -> None:
    from io import StringIO

    from rich.console import Console

    from expr_cli.render import exprd

    doc = {"pid": 1, "mode": "inotify", "spool": "/s", "updated": None, "totals": {},
           "files": {"/s/p/r/" + "x" * 50 + ".jsonl": {"state": "live", "seq": 3}}}
    buf = StringIO()
    console = Console(file=buf, width=60, color_system=None)
    exprd._files(console, exprd.file_rows(doc["files"], "/s"))
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= 60 for line in lines), lines
    assert lines[1] == "p/r"
    # the name goes on in the lines after its row, indented like it; nothing is cut
    assert lines[2].split()[0] + "".join(line.strip() for line in lines[3:]) == "x" * 50
    assert lines[2].split()[1:] == ["live", "3", "0", "B", "0.0", "0"], lines
    assert all(line.startswith("  x") for line in lines[3:]), lines


def test_top_at_80_columns(tmp_path: Path, cli80, golden, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LINES", "40")
    # the fixture run was written long ago: thresholds that leave it alone
    cfg = tmp_path / "health.toml"
    cfg.write_text('[health]\nhang_after = "1000d"\n')
    out = cli80("top", "run-1", "--once", "--config", str(cfg))
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rank"))
    assert "step" in header.split(), out
    golden("top_run1_80.txt", out)


def test_top_cuts_a_long_run_name_not_the_numbers_after_it(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The header of `expr top` at 80 columns with a 43-character run name: the name gives
    way ("…"), the frontier and the lead stay (before: "frontier 19  l…")."""
    import expr_tracker as et

    name = "rules-run-with-a-rather-long-name-for-width"
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with et.init("al", name, dir=tmp_path, system_metrics=False):
            for s in range(20):
                et.log({"loss": 1.0}, step=s)
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(build_app(), ["top", f"al/{name}", "--once", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    head = result.output.splitlines()[0]
    assert len(head) <= 80 and head.endswith("frontier 19  lead 19"), head
    assert head.startswith("al/rules-run-with") and "…" in head


@pytest.mark.parametrize("command", ["watch", "top"])
def test_help_at_80_columns_leaves_the_descriptions_room(command: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The options' descriptions had about 17 columns of watch's 80 (an option's negative
    form and a range's type took the rest), and were cut (issue 54)."""
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(build_app(), [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output, result.output
    helps = [line for line in result.output.splitlines() if line.startswith("│ --help")]
    assert len(helps) == 1, result.output
    # 30 and more columns of description (watch had 17: they began at column 61)
    assert helps[0].index("Show this") <= 80 - 2 - 30, result.output
