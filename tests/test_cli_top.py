"""`expr top --once`: ranks worst first, incidents on top, the documented JSON shape."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import write_shard, write_sidecar


def _run(root: Path, world: int = 6) -> Path:
    run = root / "p" / "top"
    now = time.time()
    for rank in range(world):
        last = 30 if rank != 4 else 12
        rows = [{"_step": s, "_time": now - 40 + s, "loss": 1.0 + rank} for s in range(last + 1)]
        stem = "metrics" if rank == 0 else f"metrics.rank{rank}"
        write_shard(run / f"{stem}.jsonl", rows, mtime=now - 1)
        write_sidecar(run / f"{stem}.meta.json", rank=rank, stream=None, rows=len(rows), nbytes=0,
                      last_step=last, status="crashed" if rank == 4 else "running", world=world)
    return run


def test_top_once_json_shape_and_order(cli, tmp_path: Path) -> None:
    run = _run(tmp_path / "r")
    result = cli("top", str(run), "--once", "--json", "-m", "loss", EXPR_NOW=str(time.time()))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) >= {"ranks", "incidents", "frontier", "nodes"}
    assert doc["ranks"][0]["rank"] == 4 and doc["ranks"][0]["status"] == "crashed"
    assert {"rank", "host", "step", "status", "steps_per_s", "last_write_age", "behind", "metric"} \
        <= set(doc["ranks"][0])
    assert doc["ranks"][0]["metric"] == 5.0 and doc["ranks"][1]["steps_per_s"] > 0
    assert [i["kind"] for i in doc["incidents"]] == ["crashed"]
    assert doc["incidents"][0]["ranks"] == [4]
    assert doc["frontier"] == 30 and len(doc["ranks"]) == 6
    assert not (run / "incidents.jsonl").exists()  # top never writes


def test_top_once_text_fits_80_columns(cli, tmp_path: Path) -> None:
    run = _run(tmp_path / "r", world=40)
    result = cli("top", str(run), "--once", COLUMNS="80", LINES="24", EXPR_NOW=str(time.time()))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), result.stdout
    assert "crashed" in lines[1] and "rank 4" in lines[1]
    assert any("more ranks" in line for line in lines)


def test_top_once_fits_five_lines_and_forty_columns_without_cutting_ranks(cli, tmp_path: Path) -> None:
    run = _run(tmp_path / "r", world=20)
    result = cli("top", str(run), "--once", COLUMNS="40", LINES="5", EXPR_NOW=str(time.time()))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) <= 5 and all(len(line) <= 40 for line in lines), result.stdout
    assert "crashed: rank 4 failed first" in lines[1]
    rows = [line.split() for line in lines if line[:6].strip().isdigit()]
    assert rows and rows[0][0] == "4" and "…" not in rows[0][0], result.stdout
    wide = cli("top", str(run), "--once", COLUMNS="40", LINES="30", EXPR_NOW=str(time.time()))
    ranks = [line.split()[0] for line in wide.stdout.splitlines() if line[:6].strip().isdigit()]
    assert {"16", "17", "18", "19"} <= set(ranks), wide.stdout  # whole rank numbers
