"""Incidents that say why: a slow rank's system metrics against the other ranks' median."""

from __future__ import annotations

import json
import time
from pathlib import Path

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.incidents import Incident
from expr_tracker.health.watch import Watcher
from expr_tracker.health.why import explain, throttle_names
from tests.procs import spawn

GPU = {"system/gpu_sm_clock_mhz": 1980.0, "system/gpu_temp_c": 66.0, "system/gpu_throttle": 0.0,
       "system/cpu_percent": 35.0, "system/rss_mb": 12 * 1024.0}


def test_explain_names_what_stands_out() -> None:
    system = {r: dict(GPU) for r in range(8)}
    system[37] = {**GPU, "system/gpu_sm_clock_mhz": 1410.0, "system/gpu_temp_c": 88.0,
                  "system/gpu_throttle": float(0x20 | 0x1)}
    assert explain(system, [37]) == ("rank 37: SM clock 1,410 MHz vs 1,980 MHz median, "
                                     "GPU temperature 88 °C vs 66 °C median, thermal throttle")
    system[5] = {**GPU, "system/rss_mb": 61 * 1024.0, "system/cpu_percent": 100.0}
    assert explain(system, [5]) == "rank 5: CPU 100% vs 35% median, RSS 61 GB vs 12 GB median"
    # the normal ones say nothing; a rank without samples neither
    assert explain(system, [0]) is None
    assert explain(system, [99]) is None
    # small differences are not news: 110 MB against 100 MB, 3% against 1% CPU
    small = {0: {"system/rss_mb": 110.0, "system/cpu_percent": 3.0},
             **{r: {"system/rss_mb": 100.0, "system/cpu_percent": 1.0} for r in (1, 2, 3)}}
    assert explain(small, [0]) is None
    # a throttle every rank shares is not this rank's cause
    shared = {r: {"system/gpu_throttle": 4.0} for r in range(4)}
    assert explain(shared, [1]) is None
    assert throttle_names(0x4 | 0x40 | 0x20) == ["power cap", "thermal throttle"]
    assert throttle_names(float("nan")) == [] and throttle_names(None) == []


def test_a_why_survives_the_incident_file() -> None:
    inc = Incident("straggler", (3,), ("h",), 10, 1.0, 1.0, "slow", why="rank 3: CPU 100% vs 35% median")
    back = Incident.from_line(json.loads(json.dumps(inc.as_line())))
    assert back is not None and back.why == inc.why
    plain = Incident("hang", (3,), ("h",), 10, 1.0, 1.0, "silent")
    assert "why" not in plain.as_line()


# 4 ranks run ~5 s: rank 2 burns CPU in threads and sleeps 3x longer per step (a straggler),
# rank 3 holds 500 MB; system metrics every second
RANK = """
import os, threading, time
import expr_tracker as et
rank = int(os.environ["RANK"])
et.init("p", "job", dir={root!r})
if rank == 2:
    import hashlib
    def burn():
        data = b"x" * (1 << 20)
        while True:
            hashlib.sha256(data).digest()  # releases the GIL: several threads, several cores
    for _ in range(6):  # a share of a box shared with other jobs goes by runnable threads
        threading.Thread(target=burn, daemon=True).start()
hold = b"\\x01" * (500 << 20) if rank == 3 else b""  # written, so resident
t0 = time.monotonic()
while time.monotonic() - t0 < 5.0:
    et.log({{"loss": 1.0}})
    time.sleep(0.15 if rank == 2 else 0.05)
et.finish()
"""


def test_a_four_rank_job_samples_every_rank_and_the_straggler_names_its_cpu(tmp_path: Path) -> None:
    env = {"WORLD_SIZE": "4", "EXPR_SYSTEM_METRICS": "1", "EXPR_SYSTEM_INTERVAL": "1"}
    procs = [spawn(RANK.format(root=str(tmp_path)), {**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(4)]
    run_dir = tmp_path / "p" / "job"
    watcher = Watcher(run_dir, HealthConfig(straggler_steps=16))
    opened: list[Incident] = []
    try:
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if run_dir.is_dir():
                opened += [i for i in watcher.check() if i.state == "open"]
            time.sleep(0.2)
        for p in procs:
            _, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    samples: dict[int, list[dict]] = {}
    for r in range(4):
        name = "metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"
        recs = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        samples[r] = [x for x in recs if x.get("_kind") == "rank"]
        assert samples[r], f"rank {r} logged no system metrics"
        assert all(x["_rank"] == r and "system/cpu_percent" in x and "system/rss_mb" in x
                   for x in samples[r])
    rss = {r: max(x["system/rss_mb"] for x in s) for r, s in samples.items()}
    assert rss[3] > max(rss[0], rss[1], rss[2]) + 400, rss
    cpu = {r: max(x["system/cpu_percent"] for x in s[1:] or s) for r, s in samples.items()}
    # (this box is shared: what a burning rank gets of the cores varies; the others idle)
    assert cpu[2] > 10 and cpu[2] > 2 * max(cpu[0], cpu[1], cpu[3]), cpu
    stragglers = [i for i in opened if i.kind == "straggler"]
    assert [i.ranks for i in stragglers] == [(2,)], opened
    (inc,) = stragglers
    assert inc.why is not None and inc.why.startswith("rank 2: CPU "), inc
    assert inc.why in inc.detail
    lines = [json.loads(x) for x in (run_dir / "incidents.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "straggler" and x.get("why") == inc.why for x in lines)
