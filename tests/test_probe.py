"""Probes (DESIGN 13): a real process silent inside et.span("data") gets a probe in its
sidecar naming time.sleep, in direct mode and in spool mode through a real exprd; the
next log() clears it. Also the spans of trace_spans=True through exprd, and the unit
pieces of the sampler."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from expr_tracker import probe as probe_mod
from tests.procs import env_for
from tests.test_daemon import start_exprd, stop, wait_for, wait_ready, write_config

CHILD = """
    import os, time, expr_tracker as et
    et.init("proj", "probed", dir={root!r}{init})
    et.log({{"loss": 1.0}})
    with et.span("data"):
        while not os.path.exists({go!r}):
            time.sleep(0.05)
    while not os.path.exists({stop!r}):
        et.log({{"loss": 0.5}})
        time.sleep(0.05)
    et.finish()
"""


def sidecar(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def probe_cycle(tmp_path: Path, root: Path, init: str) -> dict[str, Any]:
    """Run CHILD; return the probe its sidecar gained; check the next log clears it."""
    go, halt = tmp_path / "go", tmp_path / "stop"
    script = tmp_path / "train.py"  # a script file, as training code is: its source is there
    script.write_text(textwrap.dedent(CHILD.format(root=str(root), init=init, go=str(go),
                                                   stop=str(halt))))
    proc = subprocess.Popen([sys.executable, str(script)], env=env_for({"EXPR_PROBE_AFTER": "1"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    meta = root / "proj" / "probed" / "metrics.meta.json"
    try:
        wait_for(lambda: sidecar(meta).get("probe") is not None, 20, "a probe in the sidecar")
        probe = sidecar(meta)["probe"]
        go.touch()
        wait_for(lambda: sidecar(meta).get("cursor", {}).get("last_step", 0) >= 3
                 and "probe" not in sidecar(meta), 20, "the probe to be cleared by log()")
        halt.touch()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # (in spool mode exprd applies the finish after the process has ended: waited for)
    wait_for(lambda: sidecar(meta).get("status") == "finished", 20, "the finished status")
    assert "probe" not in sidecar(meta)
    return probe


def check_probe(probe: dict[str, Any]) -> None:
    assert set(probe) == {"since", "time", "where", "spans", "waiting"}
    assert probe["spans"] == ["data"] and probe["waiting"] == "sleep"
    assert probe["where"][0] == "train.py:7 time.sleep"
    assert probe["where"][1] == "train.py:7 <module> [user]"
    assert 0 < len(probe["where"]) <= 8
    assert probe["since"] <= probe["time"] - 0.9


def test_a_silent_process_writes_a_probe_and_the_next_log_clears_it(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    check_probe(probe_cycle(tmp_path, root, ""))


def test_in_spool_mode_exprd_writes_the_probe_and_the_traced_spans(tmp_path: Path) -> None:
    root, spool, state = tmp_path / "runs", tmp_path / "spool", tmp_path / "state"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        init = f", upload_mode='spool', spool_dir={str(spool)!r}, trace_spans=True"
        check_probe(probe_cycle(tmp_path, root, init))
        spans_file = root / "proj" / "probed" / "spans.jsonl"
        wait_for(spans_file.exists, 10, "exprd to write the spans")
        lines = [json.loads(x) for x in spans_file.read_text().splitlines()]
        assert [s["path"] for s in lines] == ["data"] and lines[0]["dur_ms"] > 900
        assert lines[0]["step"] == 1 and lines[0]["thread"] == "MainThread"
    finally:
        assert stop(d) == 0


SILENT_WITH_SYSTEM = """
    import os, time, expr_tracker as et
    et.init("proj", "sys", dir={root!r}, probe_after=1, system_metrics=True, system_interval=1)
    et.log({{"loss": 1.0}})
    with et.span("data"):
        while not os.path.exists({stop!r}):
            time.sleep(0.05)
    et.finish()
"""


def test_system_samples_do_not_take_a_silent_ranks_probe_away(tmp_path: Path) -> None:
    """A system-metrics sample is a row the tracker's own thread commits. It once counted as
    the training loop's activity: every sample cleared the probe and reset its `since`, and
    since every rank samples at about the same time, a stall's watcher saw no probe on any
    rank for a pass and named a wrong suspect (rank 0, "wrote last longest ago")."""
    root, halt = tmp_path / "runs", tmp_path / "stop"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SILENT_WITH_SYSTEM.format(root=str(root), stop=str(halt))))
    proc = subprocess.Popen([sys.executable, str(script)], env=env_for({}), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    meta = root / "proj" / "sys" / "metrics.meta.json"
    shard = root / "proj" / "sys" / "metrics.jsonl"
    try:
        wait_for(lambda: sidecar(meta).get("probe") is not None, 20, "a probe in the sidecar")
        first = sidecar(meta)["probe"]
        deadline = time.monotonic() + 4.5  # several samples at system_interval=1
        while time.monotonic() < deadline:
            meta_now = sidecar(meta)
            if meta_now:  # a whole sidecar: the probe must be in it, from the same silence
                probe = meta_now.get("probe")
                assert probe is not None, "a system sample took the probe away"
                # `since` is rewritten from the monotonic clock: equal within its jitter
                assert abs(probe["since"] - first["since"]) < 0.1 and probe["spans"] == ["data"]
            time.sleep(0.05)
        samples = sum(1 for line in shard.read_text().splitlines() if '"_kind":"rank"' in line
                      or '"_kind": "rank"' in line)
        assert samples >= 3, samples  # the samples did happen meanwhile
        halt.touch()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the sampler in this process ----------------------------------------------------


def test_sample_names_the_c_call_and_the_wait_kind() -> None:
    import socket

    started = threading.Event()
    a, b = socket.socketpair()
    results: dict[str, Any] = {}

    def sleeper() -> None:
        started.set()
        time.sleep(1.0)

    def reader() -> None:
        started.set()
        a.recv(10)

    for name, target in (("sleep", sleeper), ("io", reader)):
        started.clear()
        t = threading.Thread(target=target)
        t.start()
        started.wait()
        time.sleep(0.2)
        results[name] = probe_mod.sample(t.ident)
        if name == "io":
            b.send(b"x")
        t.join()
    a.close()
    b.close()
    assert results["sleep"]["where"][0].endswith("time.sleep") and results["sleep"]["waiting"] == "sleep"
    assert results["io"]["where"][0].endswith("a.recv") and results["io"]["waiting"] == "io"
    assert results["io"]["where"][1].endswith("reader [user]")


def test_waiting_is_collective_only_inside_the_innermost_user_frame() -> None:
    inner = ["torch/distributed/distributed_c10d.py"]
    assert probe_mod._waiting(inner, "work.wait") == "collective"
    assert probe_mod._waiting([], "dist.all_reduce") == "collective"
    assert probe_mod._waiting([], "work.wait") == "collective"
    assert probe_mod._waiting([], "event.wait") is None
    assert probe_mod._waiting(["threading.py"], "waiter.acquire") is None  # files[:2] has no "/"
    assert probe_mod._waiting(["lib/threading.py"], "waiter.acquire") == "sleep"
    assert probe_mod._waiting([], "compute") is None


def test_clean_probe_bounds_what_a_spool_line_may_put_in_a_sidecar() -> None:
    assert probe_mod.clean_probe("x") is None
    got = probe_mod.clean_probe({"since": "x", "time": 5, "where": ["a" * 1000, 3] * 10,
                                 "spans": "no", "waiting": "bogus", "extra": 1})
    assert got == {"since": None, "time": 5.0, "where": ["a" * 300] * 4, "spans": [],
                   "waiting": None}


@pytest.mark.parametrize(("value", "error"), [
    (0, ValueError), (-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    ("5", TypeError), (True, TypeError),
])
def test_probe_after_is_checked_at_init(tmp_path: Path, value: object, error: type[Exception]) -> None:
    import expr_tracker as et

    with pytest.raises(error, match="probe_after"):
        et.init("p", "r", dir=tmp_path, probe_after=value)  # type: ignore[arg-type]


def test_bad_env_probe_after_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import expr_tracker as et

    monkeypatch.setenv("EXPR_PROBE_AFTER", "soon")
    with pytest.raises(ValueError, match="EXPR_PROBE_AFTER"):
        et.init("p", "r", dir=tmp_path)


DDP = """
import os, sys, time
import torch, torch.distributed as dist
import expr_tracker as et
go, root = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
et.init("proj", "ddp", dir=root)
for step in range(6):
    with et.span("data"):
        if rank == 1 and step == 3:
            while not os.path.exists(go):
                time.sleep(0.05)
        x = torch.randn(4, 8)
    with et.span("step"):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    et.log({"loss": loss.item()})
et.finish()
dist.destroy_process_group()
"""


def test_ddp_the_sleeping_rank_sleeps_in_data_the_other_waits_in_the_collective(tmp_path: Path) -> None:
    """torchrun, 2 ranks, gloo: rank 1 stops in et.span("data"); rank 0 blocks in DDP's
    gradient all-reduce inside backward()."""
    script, go, root = tmp_path / "ddp_probe.py", tmp_path / "go", tmp_path / "runs"
    script.write_text(DDP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(go), str(root)]
    proc = subprocess.Popen(cmd, env=env_for({"EXPR_PROBE_AFTER": "1", "OMP_NUM_THREADS": "1"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    metas = [root / "proj" / "ddp" / name for name in ("metrics.meta.json", "metrics.rank1.meta.json")]
    try:
        wait_for(lambda: all(sidecar(m).get("probe") for m in metas), 60, "both ranks' probes")
        waiting, sleeping = (sidecar(m)["probe"] for m in metas)
        go.touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sleeping["spans"] == ["data"] and sleeping["waiting"] == "sleep"
    assert sleeping["where"][:2] == ["ddp_probe.py:15 time.sleep", "ddp_probe.py:15 <module> [user]"]
    assert waiting["spans"] == ["step"] and waiting["waiting"] == "collective"
    assert any(w.startswith("torch/autograd/") for w in waiting["where"])
    assert waiting["where"][-1] == "ddp_probe.py:20 <module> [user]"
    for m in metas:
        assert sidecar(m)["status"] == "finished" and "probe" not in sidecar(m)
