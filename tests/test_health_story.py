"""A run's story, told by every reader at default settings (issue 53): a NaN is an
incident, a finished run keeps its incidents and pages, a late watcher records what it
finds, MCP `list_runs` names a big run's crash, and `top` rates a spool-mode job by its
rows' times. Real rank processes and real files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import env_for, spawn

NAN_JOB = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
stop = os.environ["STOP"]
with et.init("p", "nan", dir=os.environ["ROOT"]):
    s = 0
    deadline = time.time() + 90
    while not os.path.exists(stop) and time.time() < deadline:
        loss = float("nan") if rank == 1 and s == 100 else 1.0 / (s + 1)
        et.log({"loss": loss, "acc": 0.5})
        s += 1
        time.sleep(0.002 if s < 300 else 0.1)
"""


def expr(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], env=env_for(env),
                          capture_output=True, text=True, timeout=timeout)


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    (tmp_path / "stop").touch()
    for p in started:
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def _sidecar(run: Path, rank: int) -> dict[str, Any]:
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    try:
        return json.loads((run / name.replace(".jsonl", ".meta.json")).read_text())
    except (OSError, ValueError):
        return {}


def test_nan_is_one_incident_by_default(tmp_path: Path,
                                        procs: list[subprocess.Popen[str]]) -> None:
    """Row a: rank 1 logs a NaN loss at step 100, default settings. Every reader names
    the rank, the step and the key, long after the step left the readers' tail windows;
    one incident, recorded once, whoever looks again."""
    root, stop = tmp_path / "runs", tmp_path / "stop"
    for r in range(2):
        procs.append(spawn(NAN_JOB, {"RANK": str(r), "WORLD_SIZE": "2", "ROOT": str(root),
                                     "STOP": str(stop)}))
    run = root / "p" / "nan"

    def past() -> bool:  # rank 1's sidecar written after step 300 (the window is 64 steps)
        step = (_sidecar(run, 1).get("cursor") or {}).get("last_step")
        return type(step) is int and step > 300
    _wait(past, 60, "rank 1 past step 300")

    top = expr("top", str(run), "--once", "--json")
    assert top.returncode == 0, top.stderr
    incs = [i for i in json.loads(top.stdout)["incidents"] if i["kind"] == "nonfinite"]
    assert len(incs) == 1, incs
    assert incs[0]["ranks"] == [1] and incs[0]["step"] == 100 and incs[0]["metric"] == "loss"
    assert "loss is NaN on rank 1 at step 100" in incs[0]["detail"]

    first = expr("watch", str(run), "--once", "--json")
    assert first.returncode == 1, first.stderr + first.stdout  # open: a fact, not a blip
    shown = [i for i in map(json.loads, first.stdout.splitlines()) if i["kind"] == "nonfinite"]
    assert [(i["ranks"], i["step"], i["metric"]) for i in shown] == [([1], 100, "loss")]
    again = expr("watch", str(run), "--once", "--json")
    assert again.returncode == 1, again.stderr
    text = expr("watch", str(run), "--once")
    assert "loss is NaN on rank 1 at step 100" in text.stdout, text.stdout
    recorded = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "nonfinite"]
    assert [i["state"] for i in recorded] == ["open"], recorded  # once, not once a reader

    stop.touch()
    for p in procs:
        p.communicate(timeout=30)
    done = expr("watch", str(run), "--once", "--json")
    assert done.returncode == 0, done.stdout  # the run ended: nothing open
    recorded = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "nonfinite"]
    assert [i["state"] for i in recorded] == ["open", "resolved"], recorded
    assert recorded[-1]["reason"] == "run ended"
    summary = expr("summary", str(run))  # the finished run, read by anyone
    assert "non-finite: loss is NaN on rank 1 at step 100" in summary.stdout, summary.stdout


STALL_JOB = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
with et.init("p", "stall", dir=os.environ["ROOT"]):
    for s in range(80):
        et.log({"loss": 1.0 / (s + 1)})
        # rank 1 stops at step 20, rank 0 waits for it at 22: the job stalls 7 s
        time.sleep(7.0 if s == 20 + 2 * (rank == 0) else 0.05)
"""


def _webhook_config(path: Path, url: str) -> Path:
    path.write_text(f'[channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
                    '[policy]\nrate = 0\n')
    return path


@pytest.fixture
def stalled_run(tmp_path_factory: pytest.TempPathFactory, httpserver: Any) -> Path:
    """Row b's run: two ranks stall 7 s at step 22 and finish; `expr watch` beside them
    raised the stall, paged it and its recovery (2 pages)."""
    tmp = tmp_path_factory.mktemp("stall")
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    root = tmp / "runs"
    cfg = _webhook_config(tmp / "alert.toml", httpserver.url_for("/hook"))
    ranks = [spawn(STALL_JOB, {"RANK": str(r), "WORLD_SIZE": "2", "ROOT": str(root)})
             for r in range(2)]
    run = root / "p" / "stall"
    watch = subprocess.Popen(
        [sys.executable, "-m", "expr_cli.main", "watch", str(run), "--config", str(cfg),
         "--hang-after", "2s", "--page-after", "0", "--notify-recovery", "--exit-on-finish",
         "--interval", "0.3", "--json"], env=env_for(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    for p in ranks:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    out, err = watch.communicate(timeout=60)
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(i["kind"], i["state"]) for i in lines if i["kind"] == "stall"][:2] == [
        ("stall", "open"), ("stall", "resolved")], (out, err)
    assert len(httpserver.log) == 2, httpserver.log  # the page and the recovery
    return run


def test_finished_run_keeps_its_story(stalled_run: Path) -> None:
    """Row b: every reader of the finished run tells its stall and the pages sent."""
    run = stalled_run
    summary = expr("summary", str(run), "--json")
    assert summary.returncode == 0, summary.stderr
    story = json.loads(summary.stdout)["story"]
    assert story["pages"] == {"sent": 1, "recoveries": 1}, story
    [stall] = story["incidents"]
    assert stall["kind"] == "stall" and stall["state"] == "resolved" and stall["paged"]
    assert stall["step"] == 22 and stall["recovery_paged"], stall
    text = expr("summary", str(run))
    assert "stall (resolved; paged; recovery paged)" in text.stdout, text.stdout
    assert "1 page sent" in text.stdout, text.stdout

    alerts = expr("alerts", str(run))
    assert alerts.returncode == 0, alerts.stderr
    assert "no alerts" not in alerts.stdout and "stall" in alerts.stdout, alerts.stdout
    pages = json.loads(expr("alerts", str(run), "--json").stdout)["health"]
    assert [(p["kind"], p["state"]) for p in pages] == [("stall", "open"), ("stall", "resolved")]

    top = expr("top", str(run), "--once", "--json")
    assert top.returncode == 0, top.stderr
    told = json.loads(top.stdout)["story"]
    assert [(i["kind"], i["state"]) for i in told["incidents"]] == [("stall", "resolved")]
    text = expr("top", str(run), "--once")
    assert "stall (resolved; paged; recovery paged)" in text.stdout, text.stdout

    once = expr("watch", str(run), "--once")
    assert once.returncode == 0, once.stdout  # nothing open
    assert "stall (resolved; paged; recovery paged)" in once.stdout, once.stdout

    pytest.importorskip("mcp")
    from tests.mcpclient import McpClient

    with McpClient(["--dir", str(run.parent.parent)], env_for()) as c:
        [row] = c.call("list_runs").json["runs"]
    assert row["job"]["state"] == "finished", row
    assert row["story"]["pages"] == {"sent": 1, "recoveries": 1}, row
    assert [(i["kind"], i["state"], i["step"]) for i in row["story"]["told"]] == [
        ("stall", "resolved", 22)], row


def test_list_runs_tells_a_big_runs_job_line(tmp_path: Path) -> None:
    """Row d: MCP `list_runs` of a 1,024-rank run with a crash: the job line `expr top`
    shows (the crash and its root), not `job: null` and no incident."""
    pytest.importorskip("mcp")
    from tests.mcpclient import McpClient
    from tests.synthetic import write_run

    root = (tmp_path / "runs").resolve()
    write_run(root / "bench" / "big", 1024, 8, crashed=17)
    top = json.loads(expr("top", "bench/big", "--dir", str(root), "--once", "--json").stdout)
    assert top["job"]["state"] == "crashed" and top["job"]["first_crash"]["rank"] == 17, top["job"]
    with McpClient(["--dir", str(root)], env_for()) as c:
        [row] = c.call("list_runs", timeout=300).json["runs"]
        incidents = c.call("run_incidents", run="bench/big", timeout=300).json
    assert incidents["crash_root"]["rank"] == 17
    assert row["n_ranks"] == 1024 and row["job"] == top["job"], row
    assert [i["kind"] for i in row["open_incidents"]] == ["crashed"], row


RATE_JOB = """
import os, time
import expr_tracker as et
with et.init("p", "rate", dir=os.environ["ROOT"], upload_mode="spool",
             spool_dir=os.environ["SPOOL"]):
    t = time.time()
    while time.time() - t < float(os.environ["FOR"]):
        et.log({"loss": 1.0})
        time.sleep(0.125)  # 8 steps/s
"""


def test_top_rates_a_spool_mode_job_by_its_rows(tmp_path: Path) -> None:
    """Row e: `expr top` on a spool-mode job that exprd applies (default settings) says
    about 8 steps/s whenever it looks, not 0 between two of exprd's applies."""
    from tests.test_daemon import start_exprd, stop

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = tmp_path / "exprd.toml"
    cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                   f"allowed_roots = {json.dumps([str(root)])}\n")  # exprd's defaults
    daemon = start_exprd(cfg)
    ranks = [spawn(RATE_JOB, {"RANK": str(r), "WORLD_SIZE": "2", "ROOT": str(root),
                              "SPOOL": str(spool), "FOR": "25"}) for r in range(2)]
    try:
        run = root / "p" / "rate"
        def applied() -> bool:
            step = (_sidecar(run, 1).get("cursor") or {}).get("last_step")
            return type(step) is int and step > 40
        _wait(applied, 30, "exprd to apply 40 steps")
        rates = []
        for _ in range(8):  # over 10 s: two of exprd's rescans at least
            frame = json.loads(expr("top", str(run), "--once", "--json").stdout)
            assert frame["job"]["state"] == "running", frame["job"]
            rates.append([r["steps_per_s"] for r in frame["ranks"]])
            time.sleep(1.25)
        assert all(r is not None and 5.0 < r < 9.0 for pair in rates for r in pair), rates
    finally:
        for p in ranks:
            p.communicate(timeout=60)
        stop(daemon)


LATE_JOB = """
import os, time
import expr_tracker as et
rank = int(os.environ["RANK"])
with et.init("p", "late", dir=os.environ["ROOT"]):
    for s in range(60):
        et.log({"loss": 1.0 / (s + 1)})
        # rank 1 stops at step 20, rank 0 waits for it at 22: the job stalls 25 s
        time.sleep(25.0 if s == 20 + 2 * (rank == 0) else 0.05)
"""


def test_a_late_watcher_records_the_stall_it_finds(tmp_path: Path) -> None:
    """Row c: direct mode, no exprd, no `expr watch`: `expr serve` (a long-running
    watcher) started well into a stall records it once, and its end; a watcher after it
    writes no second copy."""
    import urllib.request

    root = tmp_path / "runs"
    cfg = tmp_path / "health.toml"
    cfg.write_text('[health]\nhang_after = "5s"\n')
    ranks = [spawn(LATE_JOB, {"RANK": str(r), "WORLD_SIZE": "2", "ROOT": str(root)})
             for r in range(2)]
    run = root / "p" / "late"
    serve = None
    try:
        def stopped() -> bool:
            return [(_sidecar(run, r).get("cursor") or {}).get("last_step") for r in (0, 1)] \
                == [22, 20]
        _wait(stopped, 30, "both ranks at their stop")
        time.sleep(8)  # the stall is older than hang_after before anyone watches
        assert not (run / "incidents.jsonl").exists()
        serve = subprocess.Popen(
            [sys.executable, "-m", "expr_cli.main", "serve", "--dir", str(root), "--port", "0"],
            env=env_for({"EXPR_ALERT_CONFIG": str(cfg)}), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert serve.stdout is not None
        base = serve.stdout.readline().strip().rstrip("/")
        assert base.startswith("http://127.0.0.1:"), base

        def top() -> dict[str, Any]:
            with urllib.request.urlopen(f"{base}/api/runs/p/late/top", timeout=60) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        for _ in range(3):  # asked again and again: recorded once
            frame = top()
            assert frame["job"]["state"] == "stalled", frame["job"]
            time.sleep(0.6)
        stalls = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "stall"]
        assert [(i["state"], i["step"], i["ranks"]) for i in stalls] == [("open", 22, [1])]
        again = expr("watch", str(run), "--once", "--json", "--hang-after", "5s")
        assert again.returncode == 1, again.stdout
        assert len(_lines(run / "incidents.jsonl")) == 1  # not a second copy

        for p in ranks:
            p.communicate(timeout=60)
        frame = top()
        assert frame["job"]["state"] == "finished", frame["job"]
        stalls = [i for i in _lines(run / "incidents.jsonl") if i["kind"] == "stall"]
        assert [i["state"] for i in stalls] == ["open", "resolved"], stalls
        assert len({i["id"] for i in stalls}) == 1
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.communicate()
        if serve is not None:
            serve.terminate()
            serve.communicate(timeout=10)
