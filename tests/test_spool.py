"""Spool mode on the SDK side (DESIGN 6) and the spool reader exprd uses."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import orjson
import pytest

import expr_tracker as et
from expr_tracker.store.layout import ShardPaths
from expr_tracker.store.spoolfile import MAX_LINE, SpoolReader, scan_shard, spool_files_of
from tests.procs import run_all, spawn


def _events(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _spool_file(spool: Path) -> Path:
    files = sorted(spool.rglob("*.jsonl"))
    assert len(files) == 1, files
    return files[0]


def test_spool_file_layout_events_and_no_secrets(tmp_path: Path) -> None:
    spool, root = tmp_path / "spool", tmp_path / "runs"
    run = et.init(
        "proj", "sft-1", dir=root, upload_mode="spool", spool_dir=spool, config={"lr": 0.1},
        alert_rules=["isnan(loss) => critical: diverged"],
        alert={"channels": {"ops": {"type": "webhook", "url": "http://127.0.0.1:9/secret-token"}}},
        backends=[{"type": "http", "url": "http://127.0.0.1:9/ingest?token=hunter2",
                   "token_env": "MY_TOKEN"}],
    )
    for i in range(5):
        et.log({"loss": 1.0 / (i + 1)})
    et.log({"loss": float("nan")})
    et.alert("checkpoint", "saved", "info")
    info = et.info()
    et.finish()

    path = _spool_file(spool)
    assert path == spool / "proj" / "sft-1" / f"metrics.{run.session}.jsonl"
    assert info["spool_file"] == str(path)
    for d in (spool, spool / "proj", spool / "proj" / "sft-1"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    raw = path.read_bytes()
    assert b"secret-token" not in raw and b"hunter2" not in raw and b"http://" not in raw
    evs = _events(path)
    assert [e["_seq"] for e in evs] == list(range(len(evs)))
    init = evs[0]
    assert init["_event"] == "init"
    assert init["identity"]["project"] == "proj" and init["identity"]["session"] == run.session
    assert init["dir"] == str(root.absolute())
    assert init["rules"][0]["condition"] == "isnan(loss)"
    assert init["alert_channels"] == ["ops"]
    assert init["backends"] == [{"type": "http", "token_env": "MY_TOKEN"}]
    assert init["pid"] == os.getpid()
    records = [e for e in evs if "_event" not in e]
    assert [r["_step"] for r in records] == list(range(6))
    assert records[-1]["loss"] == "NaN"  # strict JSON on disk
    assert evs[-2]["_event"] == "alert" and evs[-2]["title"] == "checkpoint"
    assert evs[-1] == {**evs[-1], "_event": "finish", "status": "finished"}
    # the process itself neither wrote a shard nor evaluated a rule
    assert not root.exists()
    assert info["alerts_fired"] == {} and info["alerting"] is False


def test_history_reads_own_spool_events(tmp_path: Path) -> None:
    et.init("p", "r", dir=tmp_path / "runs", upload_mode="spool", spool_dir=tmp_path / "spool")
    for i in range(10):
        et.log({"loss": float(i), "acc": i / 10})
    rows = et.history(3)
    assert [r["_step"] for r in rows] == [7, 8, 9]
    assert "_seq" not in rows[0] and "_sid" not in rows[0]
    assert [r["loss"] for r in et.history(2, metrics=["loss"])] == [8.0, 9.0]
    assert [r["_step"] for r in et.history(None, step_range=(2, 4))] == [2, 3]
    et.finish()


def test_resume_continues_after_spooled_and_applied_steps(tmp_path: Path) -> None:
    spool, root = tmp_path / "spool", tmp_path / "runs"
    et.init("p", "r", dir=root, upload_mode="spool", spool_dir=spool)
    for i in range(4):
        et.log({"loss": float(i)})
    et.finish()
    # nothing applied yet: the next session must still continue after step 3
    run = et.init("p", "r", dir=root, upload_mode="spool", spool_dir=spool)
    assert run.step == 4
    et.log({"loss": 9.0})
    assert [r["_step"] for r in et.history(None)] == [0, 1, 2, 3, 4]
    et.finish()
    assert len(spool_files_of(spool / "p" / "r", "metrics")) == 2
    # a shard that exprd already wrote counts too (largest step 41 there)
    shard = root / "p" / "r" / "metrics.jsonl"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b'{"_step":41,"_time":1.0,"loss":1.0,"_seq":1,"_sid":"old"}\n')
    assert scan_shard(ShardPaths(shard.parent, "metrics")).applied == {"old": 1}
    run = et.init("p", "r", dir=root, upload_mode="spool", spool_dir=spool)
    assert run.step == 42
    et.finish()


def test_rank_unaware_spool_records_carry_rank(tmp_path: Path) -> None:
    code = f"""
        import expr_tracker as et
        et.init("p", "r", dir={str(tmp_path / 'runs')!r}, upload_mode="spool",
                spool_dir={str(tmp_path / 'spool')!r}, rank_aware=False)
        et.log({{"loss": 1.0}})
        et.finish()
    """
    run_all([spawn(code, {"RANK": "3", "WORLD_SIZE": "4"})])
    evs = _events(_spool_file(tmp_path / "spool"))
    assert evs[0]["identity"]["rank"] == 3 and evs[0]["stem"] == "metrics"
    assert evs[1]["_rank"] == 3


def test_env_selects_spool_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPR_MODE", "spool")
    monkeypatch.setenv("EXPR_SPOOL", str(tmp_path / "sp"))
    run = et.init("p", "r", dir=tmp_path / "runs")
    et.log({"x": 1})
    et.finish()
    assert run.mode == "spool"
    assert _spool_file(tmp_path / "sp").name == f"metrics.{run.session}.jsonl"


def test_reader_yields_complete_lines_and_skips_oversize(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    big = b"x" * 300
    path.write_bytes(b"a\n" + big + b"\nbb\ntail-without-newline")
    reader = SpoolReader(path, max_line=100, block=64)
    got = list(reader.lines(0))
    assert got == [(0, 2, b"a"), (2, 303, None), (303, 306, b"bb")]
    assert reader.size == path.stat().st_size and not reader.more
    # a limit stops at a line end and says there is more; the next read resumes there
    reader = SpoolReader(path, block=2)
    first = list(reader.lines(0, limit=1))
    assert first == [(0, 2, b"a")] and reader.more
    assert [line for _, _, line in reader.lines(first[-1][1])] == [big, b"bb"]
    assert MAX_LINE == 16 * 1024 * 1024
