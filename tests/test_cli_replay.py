"""`expr replay SPOOL_DIR` and `expr status`, and `expr` never importing exprd."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expr_cli.main import build_app
from tests.procs import env_for
from tests.test_daemon import (
    check_shard,
    exprd_once,
    lines_of,
    make_spool,
    sidecar,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)

ROOT = Path(__file__).resolve().parent.parent


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


def test_replay_dry_run_of_a_dead_writer_says_would_mark(tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    spool, root = tmp_path / "spool", tmp_path / "runs"
    code = f"""
        import os, expr_tracker as et
        et.init("proj", "dead", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r})
        for k in range(5):
            et.log({{"k": k}})
        et.flush()
        os._exit(0)  # no finish: the writer is gone
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env_for(), timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    res = invoke("replay", str(spool), "--dry-run", "--state", str(tmp_path / "state"))
    assert res.exit_code == 0, res.output
    assert "would mark" in res.output and "marking" not in res.output, res.output
    assert not root.exists()


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
    assert "2 spool files: 0 live, 0 rolled over, 2 finished" in res.output
    lines = res.output.splitlines()
    # each file under its run's line, named by the rest of its path
    at = lines.index("proj/a")
    assert lines[at + 1].startswith("  metrics.") and "finished" in lines[at + 1], res.output
    res = invoke("status", "--state", str(state), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["running"] is False
    assert doc["files"][str(files[0])]["applied"] == 40
    assert doc["files"][str(files[0])]["lag_bytes"] == 0
    res = invoke("status", "--state", str(tmp_path / "none"))
    assert res.exit_code == 1 and "no exprd status" in res.output


def test_status_finds_the_state_directory_from_the_spools_heartbeat(
        tmp_path: Path, invoke, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    spool, root, _ = _spools(tmp_path)
    state = tmp_path / "state"
    proc = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    try:
        wait_ready(state, proc)
        wait_for(lambda: json.loads((state / "status.json").read_bytes())["totals"]["finished"] == 2,
                 15, "both files finished in status.json")
        assert json.loads((spool / ".exprd.json").read_bytes())["state"] == str(state)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.local/state/exprd to fall back on
        monkeypatch.setenv("EXPR_SPOOL", str(spool))
        res = invoke("status")
    finally:
        stop(proc)
    assert res.exit_code == 0, res.output
    assert "2 spool files: 0 live, 0 rolled over, 2 finished" in res.output
    # a finished file: every event it holds is in its shard, and no spooled run is waiting
    lines = res.output.splitlines()
    row = lines[lines.index("proj/a") + 1].split()
    header = next(line for line in res.output.splitlines() if line.startswith("file")).split()
    assert header[:5] == ["file", "state", "seq", "in", "shard"], header
    assert row[1] == "finished" and row[2] == row[3], row
    assert "not applied yet" not in res.output


def test_replay_passes_exprd_warnings_through_and_config_errors_are_one_line(
        tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    spool, root, _ = _spools(tmp_path)
    (spool / "proj" / "b").chmod(0o777)  # exprd refuses what other users could write
    res = invoke("replay", str(spool), "--state", str(tmp_path / "state"))
    assert res.exit_code == 0, res.output
    assert f"warning: refusing {spool / 'proj' / 'b'}: writable by other users" in res.stderr
    assert res.stdout.startswith("1 spool file: applied 40 events")
    check_shard(root / "proj" / "a" / "metrics.jsonl", 40)
    assert not (root / "proj" / "b").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n")
    res = invoke("replay", str(spool), "--config", str(bad), "--json")
    assert res.exit_code == 1
    assert res.stdout == ""
    assert res.stderr.startswith("error: unknown key 'bogus'") and res.stderr.count("\n") == 1


def test_the_spool_is_the_argument_or_spool_or_expr_spool(tmp_path: Path, invoke,
                                                          monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`expr replay` takes its spool root as `exprd --spool` and `expr status --spool` do,
    or from `$EXPR_SPOOL` (before: a required argument; `--spool` was "No such option")."""
    spool, root, _ = _spools(tmp_path)
    res = invoke("replay", "--spool", str(spool), "--state", str(tmp_path / "s1"))
    check_shard(root / "proj" / "a" / "metrics.jsonl", 40)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("2 spool files: applied ")
    monkeypatch.setenv("EXPR_SPOOL", str(spool))
    again = invoke("replay", "--state", str(tmp_path / "s2"), "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["files"] == 2
    both = invoke("replay", str(spool), "--spool", str(tmp_path / "other"))
    assert both.exit_code == 2
    assert both.stderr == (f"error: two spool roots: {spool} and --spool {tmp_path / 'other'}; "
                           "give one\n")


def test_exprd_replay_progress_json_is_json_lines_on_stdout(tmp_path: Path) -> None:
    spool, _, _ = _spools(tmp_path)
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "exprd", "--replay", "--progress", "json", "--allow-root",
         "--spool", str(spool), "--state", str(state)],
        capture_output=True, text=True, env=env_for(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    objs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {o["type"] for o in objs[:-1]} == {"progress"}
    assert objs[-2]["files_done"] == objs[-2]["files_total"] == 2 and objs[-2]["events"] == 80
    assert objs[-1] == {"type": "summary", "dry_run": False, "files": 2, "applied": 80,
                        "skipped": 0, "quarantined": 0, "finished": 2, "crashed": 0,
                        "refused": 0, "live": 0, "deleted": 0}
    assert json.loads((state / "status.json").read_text())["mode"] == "replay"
    # misuse is an error object and a non-zero exit, still nothing but JSON on stdout
    proc = subprocess.run(
        [sys.executable, "-m", "exprd", "--replay", "--progress", "json", "--allow-root",
         "--spool", str(spool), "--state", str(state), "--config", str(tmp_path / "nope.toml")],
        capture_output=True, text=True, env=env_for(), timeout=60)
    assert proc.returncode == 2
    assert [json.loads(line)["type"] for line in proc.stdout.splitlines()] == ["error"]


# -- DESIGN 2: expr_cli and exprd depend on expr_tracker, never on each other -------------

_NO_EXPRD = """
import json, sys
from typer.testing import CliRunner
from expr_cli.main import build_app

runner, app = CliRunner(), build_app()
out = {}
for args in (["--help"], ["status", "--help"], ["replay", "--help"],
             ["status", "--state", STATE, "--json"],
             ["replay", SPOOL, "--state", STATE + "-replay", "--json"]):
    res = runner.invoke(app, args)
    out[" ".join(args[:2])] = [res.exit_code, res.stdout]
out["exprd"] = sorted(m for m in sys.modules if m == "exprd" or m.startswith("exprd."))
print(json.dumps(out))
"""


def test_expr_commands_never_import_exprd(tmp_path: Path) -> None:
    spool, root, _ = _spools(tmp_path)
    state = tmp_path / "state"
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    code = f"SPOOL, STATE = {str(spool)!r}, {str(state)!r}\n" + textwrap.dedent(_NO_EXPRD)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env_for(), timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.pop("exprd") == []
    assert {k: v[0] for k, v in out.items()} == dict.fromkeys(out, 0), out
    assert "Usage: expr replay" in out["replay --help"][1]
    assert json.loads(out["status --state"][1])["totals"]["finished"] == 2
    # the replay really ran (in a child): everything was already in the shards
    assert json.loads(out["replay " + str(spool)][1])["skipped"] == 80


RUFF = Path(sys.executable).parent / "ruff"


def _ruff_ban(paths: list[Path], banned: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """ruff's banned-api (TID251) for these paths only (its settings are global, DESIGN 2)."""
    config = [f'lint.flake8-tidy-imports.banned-api."{mod}".msg = "{msg}"'
              for mod, msg in banned.items()]
    argv = [str(RUFF), "check", "--isolated", "--select", "TID251", "--output-format", "concise"]
    for c in config:
        argv += ["--config", c]
    return subprocess.run([*argv, *map(str, paths)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed next to this python")
def test_ruff_bans_imports_across_the_cli_daemon_line(tmp_path: Path) -> None:
    rules = {
        ROOT / "expr_cli": {"exprd": "expr_cli never imports exprd (run it as a process)"},
        ROOT / "daemon": {"expr_cli": "exprd never imports expr_cli"},
    }
    for where, banned in rules.items():
        proc = _ruff_ban([where], banned)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # the same check finds a function-level import (what expr replay once had)
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from exprd.main import Daemon\n\n    return Daemon\n")
    proc = _ruff_ban([bad], rules[ROOT / "expr_cli"])
    assert proc.returncode == 1 and "TID251 `exprd` is banned" in proc.stdout
    assert os.path.basename(bad) in proc.stdout
