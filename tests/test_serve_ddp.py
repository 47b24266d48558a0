"""`expr serve` watching a real job: `torchrun --standalone --nproc_per_node 4` (gloo, CPU,
examples/ddp_train.py, rank 2 slowed), in Debian's chromium, as a person would use it: the
page is open before the job starts, then shows the job, its `step N` advancing without a
reload, the straggler incident naming rank 2, and, once rank 3 is stopped (SIGSTOP), the
stall incident naming rank 3.

Marked `slow`: 43 s at load average 5 on the 2-core box, 70 s at load 20 (four ranks and
torchrun importing torch is most of it); `-m "not slow"` leaves it out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.browser import require
from tests.extras import need
from tests.procs import env_for

# one worker runs every Chromium test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("browser")

require()

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"
EXPR = Path(sys.executable).parent / "expr"


def _until(what: str, ok: Callable[[], Any], within: float, page: Any) -> Any:
    deadline = time.monotonic() + within
    while not (got := ok()):
        assert time.monotonic() < deadline, f"{what}: the page shows {page.inner_text('main')[:800]!r}"
        page.wait_for_timeout(250)
    return got


@pytest.mark.slow
def test_a_live_torchrun_job_its_steps_its_straggler_and_its_stall(tmp_path: Path,
                                                                   page: Any) -> None:
    need("torch", "torch")

    root = tmp_path / "runs"
    root.mkdir()
    cfg = tmp_path / "alerts.toml"
    cfg.write_text('[health]\nhang_after = "3s"\n')  # a stall is news after 3 s here
    srv = subprocess.Popen([str(EXPR), "serve", "--dir", str(root), "--port", "0"],
                           env=env_for({"EXPR_ALERT_CONFIG": str(cfg)}), stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    job: subprocess.Popen[bytes] | None = None
    stopped: int | None = None
    try:
        assert srv.stdout is not None
        base = srv.stdout.readline().strip().rstrip("/")
        page.goto(base + "/runs/ddp/mlp?metric=step_time")
        page.wait_for_selector("#missing:not([hidden])")
        page.evaluate("window.__same_page = true")
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", "4", str(EXAMPLE), "--dir", str(root), "--steps", "100000",
             "--slow-rank", "2", "--slow-ms", "40"],
            cwd=tmp_path, env=env_for({"OMP_NUM_THREADS": "1"}), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        page.wait_for_selector("body[data-loaded='1']", timeout=90_000)

        def step() -> int | None:
            m = re.fullmatch(r"step (\d+)", page.inner_text("#frontier"))
            return int(m.group(1)) if m else None

        first = _until("a step in the header", step, 20, page)
        _until("the step to advance", lambda: (step() or 0) > first, 20, page)
        assert page.inner_text("#tile-ranks").split("\n")[1] == "4/4"
        straggler = _until("a straggler incident", lambda: next(
            (li for li in page.locator("#open-incidents li").all_inner_texts()
             if li.startswith("straggler")), None), 30, page)
        assert re.search(r"\brank 2\b", straggler) and "x the ranks' median" in straggler
        sidecar = root / "ddp" / "mlp" / "metrics.rank3.meta.json"
        stopped = int(json.loads(sidecar.read_text())["pid"])
        os.kill(stopped, signal.SIGSTOP)  # rank 3 stops: every other rank waits for it
        stall = _until("a stall incident", lambda: next(
            (li for li in page.locator("#open-incidents li").all_inner_texts()
             if li.startswith("stall")), None), 30, page)
        assert re.search(r"\brank 3\b", stall) and "job stalled at step" in stall, stall
        assert page.evaluate("window.__same_page") is True  # all of it without a reload
        # the run's answers were 404 until its first shard (the "missing" page above)
        page.errors_seen[:] = [e for e in page.errors_seen if "status of 404" not in e]
    finally:
        page.goto("about:blank")  # (its event stream closed before the server stops)
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if job is not None:
            os.killpg(job.pid, signal.SIGTERM)  # torchrun and its 4 ranks (its own session)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        srv.send_signal(signal.SIGINT)
        assert srv.wait(timeout=15) == 130
