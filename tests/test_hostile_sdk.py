"""The SDK under a hostile GPU library and misused spans (issue 43): an NVML call that hangs,
one that raises KeyboardInterrupt or SystemExit, a sampling interval too small, a span
closed out of order. Real processes, with a fake `pynvml` module first on their sys.path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import expr_tracker as et
from tests.procs import spawn

FAKE_NVML = """
import time
class NVMLError(Exception):
    pass
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
class _U:
    gpu = 50
def nvmlInit():
    pass
def nvmlDeviceGetHandleByIndex(i):
    return i
def nvmlDeviceGetUtilizationRates(h):
    {body}
    return _U()
def nvmlDeviceGetMemoryInfo(h):
    raise NVMLError("not supported")
nvmlDeviceGetTemperature = nvmlDeviceGetPowerUsage = nvmlDeviceGetClockInfo = nvmlDeviceGetMemoryInfo
nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetMemoryInfo
"""

RANK = """
import json, os, sys, time
import expr_tracker as et
et.init("p", "r", dir={root!r}, system_metrics=True, system_interval=1, probe_after=1)
for i in range({rows}):
    et.log({{"loss": float(i)}})
    time.sleep(0.02)
    if i == {rows} // 2:
        time.sleep(2.5)  # silent: the tracker thread flushes and writes a probe meanwhile
        shard = os.path.join({root!r}, "p", "r", "metrics.jsonl")
        side = os.path.join({root!r}, "p", "r", "metrics.meta.json")
        on_disk = sum(1 for line in open(shard) if '"_kind"' not in line)
        print(json.dumps({{"on_disk": on_disk, "probe": "probe" in json.load(open(side))}}), flush=True)
t = time.monotonic()
et.finish()
print(json.dumps({{"finish_s": time.monotonic() - t}}), flush=True)
"""


def _rank_with_nvml(tmp_path: Path, body: str, rows: int = 50) -> tuple[list[dict], str, int]:
    lib = tmp_path / "fake"
    lib.mkdir()
    (lib / "pynvml.py").write_text(FAKE_NVML.format(body=body))
    p = spawn(RANK.format(root=str(tmp_path / "runs"), rows=rows),
              {"PYTHONPATH": f"{lib}:{Path.cwd()}", "CUDA_VISIBLE_DEVICES": "0"})
    out, err = p.communicate(timeout=60)
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")], err, p.returncode


def _shard(tmp_path: Path) -> list[dict]:
    shard = tmp_path / "runs" / "p" / "r" / "metrics.jsonl"
    return [json.loads(x) for x in shard.read_text().splitlines()]


def test_a_hung_nvml_call_costs_its_samples_never_rows_probes_or_finish(tmp_path: Path) -> None:
    started = time.monotonic()
    said, err, code = _rank_with_nvml(tmp_path, "time.sleep(3600)")
    assert code == 0, err
    mid, end = said
    assert mid["on_disk"] == 26 and mid["probe"], (mid, err)  # flushed and probed meanwhile
    assert end["finish_s"] < 5, end
    assert time.monotonic() - started < 30
    recs = _shard(tmp_path)
    assert [r["_step"] for r in recs if "_kind" not in r] == list(range(50))
    side = json.loads((tmp_path / "runs" / "p" / "r" / "metrics.meta.json").read_text())
    assert side["status"] == "finished"
    assert "has not returned" in err and "hung GPU library call" in err, err


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit(3)"])
def test_a_gpu_library_raising_base_exceptions_is_caught_the_rows_written(
        tmp_path: Path, exc: str) -> None:
    said, err, code = _rank_with_nvml(tmp_path, f"raise {exc}", rows=30)
    assert code == 0, err
    assert said[-1]["finish_s"] < 5
    recs = _shard(tmp_path)
    assert [r["_step"] for r in recs if "_kind" not in r] == list(range(30))
    assert any("system/rss_mb" in r for r in recs)  # process samples go on
    side = json.loads((tmp_path / "runs" / "p" / "r" / "metrics.meta.json").read_text())
    assert side["status"] == "finished"
    assert "Traceback" not in err


def test_a_system_interval_below_the_floor_is_refused_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"system_interval must be at least 1 s.*got 0.01"):
        et.init("p", "r", dir=tmp_path, system_interval=0.01)
    monkeypatch.setenv("EXPR_SYSTEM_INTERVAL", "0.01")
    with pytest.raises(ValueError, match="EXPR_SYSTEM_INTERVAL must be at least 1 s"):
        et.init("p", "r", dir=tmp_path)
    assert not (tmp_path / "p").exists()  # nothing half-written
    monkeypatch.delenv("EXPR_SYSTEM_INTERVAL")
    run = et.init("p", "ok", dir=tmp_path, system_metrics=False, system_interval=1)
    et.finish()
    assert run.info()["system_metrics"] is None


def _keys(tmp_path: Path, name: str) -> list[set[str]]:
    shard = tmp_path / "p" / name / "metrics.jsonl"
    return [{k for k in json.loads(x) if k.startswith("time_ms/")}
            for x in shard.read_text().splitlines()]


def test_a_span_closed_out_of_order_leaves_the_stack_wherever_it_is(tmp_path: Path) -> None:
    """`with et.span("data")` around a generator's `yield`, first advanced inside a
    `warmup` span that closes while `data` is open: later spans nest under what is open
    (`data` while the generator is suspended in it), never under the closed `warmup`."""
    et.init("p", "gen", dir=tmp_path)

    def batches():
        for i in range(4):
            with et.span("data"):
                yield i

    it = batches()
    with et.span("warmup"):
        next(it)  # "data" opens under "warmup", which closes first
    et.log({"x": 0.0})
    for _ in range(3):
        next(it)
        with et.span("opt"):
            pass
        et.log({"x": 1.0})
    it.close()  # the last "data" exits here
    with et.span("after"):
        pass
    et.log({"x": 2.0})
    et.finish()
    rows = _keys(tmp_path, "gen")
    assert rows[0] == {"time_ms/warmup"}, rows
    assert rows[1] == {"time_ms/warmup/data", "time_ms/data/opt"}, rows
    assert rows[2] == rows[3] == {"time_ms/data", "time_ms/data/opt"}, rows
    assert rows[4] == {"time_ms/data", "time_ms/after"}, rows
    from expr_tracker.spans import open_path
    assert open_path() == ""


def test_a_span_entered_and_never_exited_is_left_when_it_exits_late(tmp_path: Path) -> None:
    et.init("p", "late", dir=tmp_path)
    outer = et.span("outer").__enter__()
    inner = et.span("inner").__enter__()
    outer.__exit__(None, None, None)  # out of order: "inner" is still open
    with et.span("a"):
        pass
    inner.__exit__(None, None, None)
    with et.span("b"):
        pass
    et.log({"x": 1.0})
    et.finish()
    (row,) = _keys(tmp_path, "late")
    assert row == {"time_ms/outer", "time_ms/outer/inner", "time_ms/outer/inner/a", "time_ms/b"}, row
