"""System metrics per rank (DESIGN 19): sampled in real processes, logged as rank records."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

import expr_tracker as et
from expr_tracker import sysmetrics
from tests.procs import run_all, spawn

PROCESS_KEYS = {"system/cpu_percent", "system/rss_mb", "system/read_mb_s", "system/write_mb_s"}
GPU_KEYS = {"system/gpu_util", "system/gpu_mem_mb", "system/gpu_temp_c", "system/gpu_power_w",
            "system/gpu_sm_clock_mhz", "system/gpu_throttle"}

# a rank that logs 25 steps over ~2.5 s with samples every second; INFO lines on stderr
TRAIN = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
{prelude}
import expr_tracker as et
run = et.init("p", "r", dir={root!r}, {kwargs})
for i in range(25):
    et.log({{"loss": float(i)}})
    time.sleep(0.1)
et.finish()
"""


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(tmp_path: Path, env: dict[str, str] | None = None, kwargs: str = "",
           prelude: str = "") -> tuple[list[dict], str]:
    code = TRAIN.format(root=str(tmp_path), kwargs=kwargs, prelude=prelude)
    p = spawn(code, {"EXPR_SYSTEM_METRICS": "1", "EXPR_SYSTEM_INTERVAL": "1", **(env or {})})
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    shard = tmp_path / "p" / "r" / "metrics.jsonl"
    return (_records(shard) if shard.exists() else []), err


def test_samples_are_rank_records_that_never_advance_the_step(tmp_path: Path) -> None:
    recs, _err = _train(tmp_path)
    rows = [r for r in recs if "_kind" not in r]
    sys_recs = [r for r in recs if r.get("_kind") == "rank"]
    assert [r["_step"] for r in rows] == list(range(25))  # no step taken by a sample
    # one soon after init, about one a second, and one at finish
    assert len(sys_recs) >= 3, sys_recs
    for r in sys_recs:
        assert r["_rank"] == 0
        assert set(r) >= PROCESS_KEYS, r
        assert not set(r) & GPU_KEYS  # no GPU here, or none that NVML opens
        assert 0 <= r["_step"] <= 24
        assert r["system/rss_mb"] > 5
        assert r["system/cpu_percent"] >= 0
    assert sys_recs[-1]["_step"] == 24  # the sample at finish, at the last committed step


def test_off_switch_by_argument_and_environment(tmp_path: Path) -> None:
    recs, _ = _train(tmp_path / "a", kwargs="system_metrics=False")
    assert not [r for r in recs if r.get("_kind") == "rank"]
    recs, _ = _train(tmp_path / "b", env={"EXPR_SYSTEM_METRICS": "0"})
    assert not [r for r in recs if r.get("_kind") == "rank"]


def test_missing_nvml_costs_one_info_line(tmp_path: Path) -> None:
    # pynvml unimportable: no GPU keys, the process keys still come, one line says why
    recs, err = _train(tmp_path, prelude="sys.modules['pynvml'] = None")
    lines = [ln for ln in err.splitlines() if "gpu" in ln.lower() or "nvml" in ln.lower()]
    assert len(lines) == 1, err
    assert lines[0].startswith("INFO ") and "expr-tracker[gpu]" in lines[0]
    sys_recs = [r for r in recs if r.get("_kind") == "rank"]
    assert sys_recs and all(set(r) >= PROCESS_KEYS and not set(r) & GPU_KEYS for r in sys_recs)
    assert "WARNING" not in err and "Traceback" not in err


def test_failing_nvml_costs_one_info_line(tmp_path: Path) -> None:
    # a device NVML cannot open (no driver here; elsewhere a UUID that is no GPU)
    recs, err = _train(tmp_path, env={"CUDA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000"})
    lines = [ln for ln in err.splitlines() if "nvml" in ln.lower()]
    assert len(lines) == 1, err
    assert lines[0].startswith("INFO ") and "no system/gpu_* metrics" in lines[0]
    assert all(not set(r) & GPU_KEYS for r in recs)
    assert "Traceback" not in err


def _nvml_device_or_skip() -> None:
    try:
        import pynvml
    except ImportError:
        pytest.skip("nvidia-ml-py is not installed (the gpu extra)")
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            pytest.skip("NVML sees no GPU on this machine")
    except pynvml.NVMLError as exc:
        pytest.skip(f"no GPU through NVML on this machine: {exc}")


def test_gpu_keys_through_nvml(tmp_path: Path) -> None:
    _nvml_device_or_skip()
    recs, err = _train(tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})
    sys_recs = [r for r in recs if r.get("_kind") == "rank"]
    assert sys_recs
    for r in sys_recs:
        assert {"system/gpu_util", "system/gpu_mem_mb", "system/gpu_temp_c"} <= set(r), (r, err)
        assert 0 <= r["system/gpu_util"] <= 100


def test_spool_mode_carries_the_samples(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    _, _err = _train(tmp_path, kwargs=f"upload_mode='spool', spool_dir={str(spool)!r}")
    (path,) = glob.glob(str(spool / "p" / "r" / "*.jsonl"))
    events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    samples = [e for e in events if set(e) >= PROCESS_KEYS]
    assert len(samples) >= 2, events[:3]
    assert all(e.get("_kind") == "rank" and "_seq" in e for e in samples)


def test_bad_arguments_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="system_interval"):
        et.init("p", "r", dir=tmp_path, system_interval=0)
    with pytest.raises(TypeError, match="system_interval"):
        et.init("p", "r", dir=tmp_path, system_interval="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="system_metrics"):
        et.init("p", "r", dir=tmp_path, system_metrics=1)  # type: ignore[arg-type]
    monkeypatch.setenv("EXPR_SYSTEM_INTERVAL", "soon")
    with pytest.raises(ValueError, match="EXPR_SYSTEM_INTERVAL"):
        et.init("p", "r", dir=tmp_path)
    monkeypatch.delenv("EXPR_SYSTEM_INTERVAL")
    monkeypatch.setenv("EXPR_SYSTEM_METRICS", "maybe")
    with pytest.raises(ValueError, match="EXPR_SYSTEM_METRICS"):
        et.init("p", "r", dir=tmp_path)
    assert not (tmp_path / "p").exists()  # nothing half-written


def test_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPR_SYSTEM_METRICS")
    assert sysmetrics.parse_enabled(None) is True
    assert sysmetrics.parse_enabled(False) is False


@pytest.mark.parametrize(("visible", "local_rank", "want"), [
    (None, 3, 3),
    ("4,5,6,7", 2, 6),
    ("5", 3, 5),  # one device per rank: that one
    ("", 0, None),
    ("-1", 0, None),
    ("2,-1,3", 1, 2),  # CUDA stops at the first invalid entry: one device left
    ("0,1", 5, None),
    ("GPU-abc,GPU-def", 1, "GPU-def"),
    ("MIG-xyz", 0, None),
])
def test_gpu_index(visible: str | None, local_rank: int, want: object) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert sysmetrics.gpu_index(local_rank, env) == want


def test_import_does_not_load_psutil_or_nvml() -> None:
    out = run_all([spawn("import sys, expr_tracker; print('psutil' in sys.modules, 'pynvml' in sys.modules)")])
    assert out[0].split() == ["False", "False"]
