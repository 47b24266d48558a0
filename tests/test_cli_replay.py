"""`expr replay SPOOL_DIR` and `expr status`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expr_cli.main import build_app
from tests.test_daemon import check_shard, exprd_once, lines_of, make_spool, sidecar, write_config


def _tree(*dirs: Path) -> dict[str, tuple[str, float]]:
    """Every file under `dirs`: content hash and mtime."""
    out = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file():
                out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime)
    return out


@pytest.fixture
def invoke(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "120")
    app = build_app()
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def _spools(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    spool, root = tmp_path / "spool", tmp_path / "runs"
    files = [make_spool(spool, root, name, 40,
                        alert_rules=["loss < 0.05 => warning: low"]) for name in ("a", "b")]
    return spool, root, files


def test_replay_applies_once_and_a_second_replay_changes_nothing(tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    spool, root, _ = _spools(tmp_path)
    state = tmp_path / "state"
    res = invoke("replay", str(spool), "--state", str(state), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["applied"] == 80
    for name in ("a", "b"):
        check_shard(root / "proj" / name / "metrics.jsonl", 40)
        assert sidecar(root / "proj" / name / "metrics.meta.json")["status"] == "finished"
        # the rule fired once per run (loss < 0.05 from k=20 on, edge mode)
        assert [a["title"] for a in lines_of(root / "proj" / name / "alerts.jsonl")] == ["low"]
    before = _tree(root, spool)
    # a fresh state directory: only the shards' own _sid/_seq say what is applied
    res = invoke("replay", str(spool), "--state", str(tmp_path / "other-state"))
    assert res.exit_code == 0, res.output
    assert "applied 0 events, 80 already in shards" in res.output
    assert _tree(root, spool) == before


def test_replay_dry_run_writes_nothing(tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    spool, root, _ = _spools(tmp_path)
    before = _tree(spool)
    state = tmp_path / "state"
    res = invoke("replay", str(spool), "--dry-run", "--state", str(state))
    assert res.exit_code == 0, res.output
    assert "would apply 80 events" in res.output
    assert not root.exists() and not state.exists()
    assert _tree(spool) == before


def test_replay_missing_spool_is_one_error_line(tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    res = invoke("replay", str(tmp_path / "nope"))
    assert res.exit_code == 1
    assert "no spool directory" in res.output and "Traceback" not in res.output


def test_status_shows_the_daemon_status(tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    spool, root, files = _spools(tmp_path)
    state = tmp_path / "state"
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    res = invoke("status", "--state", str(state))
    assert res.exit_code == 0, res.output
    assert "2 files: 0 live, 2 finished" in res.output
    assert "proj/a/metrics." in res.output and "finished" in res.output
    res = invoke("status", "--state", str(state), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["running"] is False
    assert doc["files"][str(files[0])]["applied"] == 40
    assert doc["files"][str(files[0])]["lag_bytes"] == 0
    res = invoke("status", "--state", str(tmp_path / "none"))
    assert res.exit_code == 1 and "no exprd status" in res.output
