"""Stalls and crash cascades of real DDP jobs (torchrun, 4 ranks, gloo, CPU): DESIGN 13.

One job per mode runs three faults on rank 3 one after another: a `time.sleep` in the
loop, C code holding the GIL (`ctypes.PyDLL(None).sleep`: no Python thread of that
process runs, so it writes no probe) and a SIGSTOP (a helper sends SIGCONT). Each must be
one `stall` incident naming rank 3 alone, never the ranks waiting in the all-reduce;
`expr top` then shows every rank under 1 step/s; after the job nothing is open. The spool
job (a real exprd writes the shards and the probes into the sidecars, and watches too)
ends with rank 1 raising: gloo takes the other ranks down with it, and that cascade is
one `crashed` incident whose root is rank 1, paged once to a webhook on 127.0.0.1 while
`expr watch` runs through it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.extras import need
from tests.procs import env_for

EXPR = [sys.executable, "-m", "expr_cli.main"]
WORLD, FAULTY, RAISER = 4, 3, 1
FAULTS = {20: "sleep", 55: "gil", 90: "stop"}  # step -> what rank 3 does there
STEPS, RAISE_AT, HOLD = 130, 120, 8  # HOLD: seconds each fault lasts
FLAGS = ["--hang-after", "5s", "--interval", "0.5"]

JOB = f"""
import ctypes, os, signal, subprocess, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import expr_tracker as et

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
raise_at = int(os.environ.get("RAISE_AT", "-1"))
run = et.init("ddp", "faults", dir=os.environ["ROOT"])
for step in range({STEPS}):
    t0 = time.perf_counter()
    x = torch.randn(16, 8)
    fault = {FAULTS!r}.get(step) if rank == {FAULTY} else None
    with et.span("data"):
        if fault == "sleep":
            time.sleep({HOLD})
        elif fault == "gil":
            ctypes.PyDLL(None).sleep({HOLD})  # libc sleep(3) with the GIL held
        elif fault == "stop":
            subprocess.Popen(["sh", "-c", "sleep {HOLD}; kill -CONT " + str(os.getpid())])
            os.kill(os.getpid(), signal.SIGSTOP)
    if rank == {RAISER} and step == raise_at:
        raise RuntimeError("boom: bad batch on rank 1")
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.log_rank_metrics({{"step_time": time.perf_counter() - t0}}, step=step)
    et.log({{"loss": loss.item()}}, step=step)
et.finish()
dist.barrier()
dist.destroy_process_group()
"""


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.endswith("}")]


def _by_id(lines: list[dict[str, Any]], kind: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if line["kind"] == kind:
            out.setdefault(line["id"], []).append(line)
    return out


def _top(run: Path) -> dict[str, Any]:
    proc = subprocess.run([*EXPR, "top", str(run), "--once", "--json"], capture_output=True,
                          text=True, timeout=60, env=env_for())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


class Job:
    """A torchrun job of JOB, and an `expr watch` started before its run exists."""

    def __init__(self, tmp: Path, env: dict[str, str], watch_args: list[str]) -> None:
        self.root = tmp / "runs"
        self.run = self.root / "ddp" / "faults"
        script = tmp / "train.py"
        script.write_text(JOB)
        self.watch = subprocess.Popen(
            [*EXPR, "watch", str(self.run), "--json", "--exit-on-finish", *FLAGS, *watch_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for())
        self.torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(WORLD), str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # system metrics on, as a user's job has them: a quiet rank's samples must not
            # count as its loop's activity (tests/test_health_quiet.py)
            cwd=tmp, env=env_for({"OMP_NUM_THREADS": "1", "EXPR_PROBE_AFTER": "2",
                                  "EXPR_SYSTEM_METRICS": "1", "EXPR_SYSTEM_INTERVAL": "1",
                                  "ROOT": str(self.root), **env}))
        self.tops: list[dict[str, Any]] = []
        self.probes: list[Any] = []  # rank 3's probes seen (for the failure messages)

    def follow(self, tops: bool) -> None:
        """Until torchrun exits; with `tops`, an `expr top` during each open stall."""
        seen: set[str] = set()
        deadline = time.monotonic() + 150
        while self.torchrun.poll() is None:
            assert time.monotonic() < deadline, "the job did not end"
            try:
                probe = json.loads((self.run / "metrics.rank3.meta.json").read_text()).get("probe")
            except (OSError, ValueError):
                probe = None
            if probe and probe not in self.probes:
                self.probes.append(probe)
            if tops:
                lines = _lines(self.run / "incidents.jsonl")
                opened = {i["id"] for i in lines if i["kind"] == "stall" and i["state"] == "open"}
                done = {i["id"] for i in lines if i["kind"] == "stall" and i["state"] == "resolved"}
                for sid in sorted(opened - done - seen):
                    seen.add(sid)
                    self.tops.append(_top(self.run))
            time.sleep(0.3)

    def stop(self) -> None:
        for proc in (self.torchrun, self.watch):
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def start(env: dict[str, str], watch_args: list[str]) -> Job:
        jobs.append(Job(tmp_path, env, watch_args))
        return jobs[-1]

    yield start
    for j in jobs:
        j.stop()


def _check_stalls(run: Path, probes: list[Any]) -> None:
    lines = _lines(run / "incidents.jsonl")
    stalls = _by_id(lines, "stall")
    assert len(stalls) == len(FAULTS), lines  # one incident per stall
    for sid, mine in stalls.items():
        assert all(i["ranks"] == [FAULTY] for i in mine), (sid, mine)  # rank 3, and only it
        assert [i["state"] for i in mine][-1] == "resolved"
    details = [mine[0]["detail"] for mine in stalls.values()]
    assert any("in time.sleep" in d and "span data" in d for d in details), (details, probes)
    # the GIL, the SIGSTOP: no probe, or the one of the sleep left behind
    assert sum("tracker thread cannot run" in d for d in details) == 2, (details, probes)
    assert all("wait in" in d for d in details), details  # the others, in the collective
    assert not [i for i in lines if i["kind"] == "hang"], lines


def test_stalls_in_direct_mode_name_the_stuck_rank_and_end_with_the_job(job: Any) -> None:
    need("torch", "torch")
    j = job({}, [])
    j.follow(tops=True)
    _, err = j.torchrun.communicate(timeout=30)
    assert j.torchrun.returncode == 0, err[-3000:]
    assert j.watch.wait(30) == 0, j.watch.stderr.read() if j.watch.stderr else ""  # --exit-on-finish
    _check_stalls(j.run, j.probes)
    assert len(j.tops) == len(FAULTS)
    for top in j.tops:  # during each stall: the job's line names rank 3, nobody makes steps
        assert top["job"]["state"] == "stalled" and top["job"]["suspects"] == [FAULTY], top["job"]
        assert top["ranks"][0]["rank"] == FAULTY
        assert all(r["steps_per_s"] is not None and r["steps_per_s"] < 1 for r in top["ranks"]), top
    assert not [i for i in _lines(j.run / "incidents.jsonl") if i["state"] == "open" and i["id"]
                not in {x["id"] for x in _lines(j.run / "incidents.jsonl") if x["state"] == "resolved"}]
    once = subprocess.run([*EXPR, "watch", str(j.run), "--once"], capture_output=True, text=True,
                          timeout=60, env=env_for())
    assert once.returncode == 0, once.stdout + once.stderr


def test_spool_mode_stalls_then_one_crash_cascade_paged_once(tmp_path: Path, job: Any,
                                                             httpserver: Any) -> None:
    from tests.test_daemon import start_exprd, stop, wait_ready, write_config

    need("torch", "torch")
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    hook = (f'type = "webhook"\nurl = {json.dumps(httpserver.url_for("/hook"))}\nretries = 0\n')
    alert = tmp_path / "alert.toml"
    alert.write_text(f"[channels.hook]\n{hook}[policy]\nrate = 0\n")
    spool, state = tmp_path / "spool", tmp_path / "state"
    spool.mkdir(mode=0o700)
    extra = (f"[alert.channels.hook]\n{hook}[alert.policy]\nrate = 0\n"
             '[health]\nhang_after = "5s"\n')
    daemon = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [tmp_path / "runs"],
                                      extra=extra))
    try:
        wait_ready(state, daemon)
        j = job({"EXPR_MODE": "spool", "EXPR_SPOOL": str(spool), "RAISE_AT": str(RAISE_AT)},
                ["--config", str(alert)])
        j.follow(tops=False)
        assert j.torchrun.wait(30) != 0
        assert j.watch.wait(60) == 1  # the run ended with the crash open
    finally:
        assert stop(daemon) == 0
    _check_stalls(j.run, j.probes)
    lines = _lines(j.run / "incidents.jsonl")
    crashes = _by_id(lines, "crashed")
    assert len(crashes) == 1, lines
    (mine,) = crashes.values()
    assert mine[0]["root"]["rank"] == RAISER and "boom: bad batch" in mine[0]["root"]["message"]
    assert mine[0]["root"]["type"] == "RuntimeError"
    assert set(mine[-1]["ranks"]) >= {RAISER} and mine[-1]["state"] == "open"
    pages = [json.loads(req.get_data()) for req, _ in httpserver.log]
    assert len([p for p in pages if p["rule"].startswith("health:crashed:")]) == 1, pages
    summary = subprocess.run([*EXPR, "summary", str(j.run)], capture_output=True, text=True,
                             timeout=60, env=env_for())
    assert f"rank {RAISER} failed first" in summary.stdout, summary.stdout + summary.stderr
