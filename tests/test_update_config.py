"""`Run.update_config`: a config merged after `init` reaches the sidecar, in the same session;
direct mode and spool mode with a real exprd (issue 13 / helper brief J)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

import expr_tracker as et
from tests.test_daemon import exprd_once, lines_of, start_exprd, stop, wait_ready, write_config


def _sidecar(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_config(path: Path, want: dict[str, Any], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        side = _sidecar(path)
        if side.get("config") == want:
            return side
        assert time.monotonic() < deadline, f"sidecar config is {side.get('config')}, not {want}"
        time.sleep(0.05)


# -- direct mode -------------------------------------------------------------------------


def test_direct_mode_sidecar_shows_the_merged_config_soon(tmp_path: Path) -> None:
    run = et.init("p", "sft-1", dir=tmp_path, config={"lr": 0.1, "opt": {"beta": 0.9}})
    session = run.session
    et.log({"loss": 1.0})
    et.update_config({"lr": 0.2, "warmup": 500, "betas": (0.9, 0.99)})
    assert run.config == {"lr": 0.2, "opt": {"beta": 0.9}, "warmup": 500, "betas": [0.9, 0.99]}
    side = _wait_config(run.paths.sidecar, run.config, timeout=3.0)  # the next background tick
    assert side["session"] == session and side["status"] == "running"
    run.update_config({"warmup": 600})
    et.log({"loss": 0.5})
    et.finish()
    side = _sidecar(run.paths.sidecar)
    assert side["config"] == {"lr": 0.2, "opt": {"beta": 0.9}, "warmup": 600, "betas": [0.9, 0.99]}
    assert (side["session"], side["status"], side["cursor"]["rows"]) == (session, "finished", 2)


def test_bad_values_raise_at_the_call_naming_the_key_and_change_nothing(tmp_path: Path) -> None:
    run = et.init("p", "sft-1", dir=tmp_path, config={"lr": 0.1})
    with pytest.raises(TypeError, match="'model'"):
        et.update_config({"ok": 1, "model": object()})
    with pytest.raises(TypeError, match="'nested'"):
        run.update_config({"nested": {"x": {1, 2}}})
    with pytest.raises(TypeError, match="key 3 must be a string"):
        run.update_config({3: "x"})
    with pytest.raises(TypeError, match="must be a dict"):
        run.update_config([("a", 1)])  # type: ignore[arg-type]
    assert run.config == {"lr": 0.1}
    et.finish()
    assert _sidecar(run.paths.sidecar)["config"] == {"lr": 0.1}
    with pytest.raises(et.UsageError, match="finished"):
        run.update_config({"lr": 0.2})
    with pytest.raises(et.UsageError, match="init"):
        et.update_config({"lr": 0.2})


# -- spool mode with exprd ---------------------------------------------------------------


def _spool_run(tmp_path: Path, name: str = "sft-1") -> tuple[Path, Path, Path, et.Run]:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    run = et.init("proj", name, dir=root, upload_mode="spool", spool_dir=spool,
                  config={"lr": 0.1})
    return spool, state, root, run


def test_spool_mode_config_event_applied_by_a_live_exprd(tmp_path: Path) -> None:
    spool, state, root, run = _spool_run(tmp_path)
    daemon = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    try:
        wait_ready(state, daemon)
        for k in range(10):
            et.log({"loss": 1.0 / (k + 1)})
        et.update_config({"warmup": 500, "lr": 0.2})
        et.flush()
        side = _wait_config(run.paths.sidecar, {"lr": 0.2, "warmup": 500}, timeout=10.0)
        assert side["status"] == "running" and side["session"] == run.session
        for _ in range(10):
            et.log({"loss": 0.1})
        et.finish()
        deadline = time.monotonic() + 10
        while _sidecar(run.paths.sidecar).get("status") != "finished":
            assert time.monotonic() < deadline, "exprd did not apply the finish"
            time.sleep(0.05)
    finally:
        assert stop(daemon) == 0
    side = _sidecar(run.paths.sidecar)
    assert side["config"] == {"lr": 0.2, "warmup": 500}
    rows = lines_of(run.paths.shard)
    assert len(rows) == 20 and {r["_sid"] for r in rows} == {run.session}  # one session
    # the config event holds a seq of its own: the records around it are numbered on
    assert [r["_seq"] for r in rows] == [*range(1, 11), *range(12, 22)]


def test_config_survives_an_exprd_restart_from_its_checkpoint(tmp_path: Path) -> None:
    """The second exprd starts from the checkpoint, after the config event: the config it
    writes at finish is the merged one the sidecar held, not the init's."""
    spool, state, root, run = _spool_run(tmp_path)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    et.log({"loss": 1.0})
    et.update_config({"warmup": 500})
    et.flush()
    exprd_once(cfg)
    assert _sidecar(run.paths.sidecar)["config"] == {"lr": 0.1, "warmup": 500}
    et.log({"loss": 0.5})
    et.finish()
    exprd_once(cfg)
    side = _sidecar(run.paths.sidecar)
    assert (side["status"], side["cursor"]["rows"]) == ("finished", 2)
    assert side["config"] == {"lr": 0.1, "warmup": 500}


def test_an_unknown_event_is_skipped_and_the_rest_applied(tmp_path: Path) -> None:
    """An event exprd does not know (from a newer SDK) is set aside; the file goes on."""
    spool, state, root, run = _spool_run(tmp_path)
    et.log({"loss": 1.0})
    sink: Any = run._sink
    with run._lock:
        sink._emit({"_event": "from_the_future", "_time": time.time(), "x": 1})
    et.log({"loss": 0.5})
    et.finish()
    proc = exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    assert "unknown event 'from_the_future'" in proc.stderr
    rows = lines_of(run.paths.shard)
    assert [(r["_seq"], r["loss"]) for r in rows] == [(1, 1.0), (3, 0.5)]
    assert _sidecar(run.paths.sidecar)["status"] == "finished"


def test_a_bad_config_event_is_ignored(tmp_path: Path) -> None:
    """A hand-written spool whose config event holds no object: logged, the init's config kept."""
    spool, state, root, run = _spool_run(tmp_path)
    et.log({"loss": 1.0})
    sink: Any = run._sink
    with run._lock:
        sink._emit({"_event": "config", "_time": time.time(), "config": [1, 2]})
    et.finish()
    proc = exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    assert "config event 2 ignored" in proc.stderr
    side = _sidecar(run.paths.sidecar)
    assert side["config"] == {"lr": 0.1} and side["status"] == "finished"
    assert orjson.loads(run.paths.shard.read_bytes())["loss"] == 1.0
