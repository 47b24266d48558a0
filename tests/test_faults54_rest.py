"""Issue 54, the rest of its rows: readers dated by the filesystem's clock, the frontier
and its reason, `delivered` carried along an incident, and the small things a new user
sees. Real files and processes; a login node's clock shifted by the cluster harness's
LD_PRELOAD shim (tests/cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.synthetic import write_run


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    return {**env, "EXPR_DIR": str(root), "COLUMNS": "120", "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def expr(root: Path, *args: str, env: dict[str, str] | None = None, code: int = 0) -> str:
    got = subprocess.run([sys.executable, "-c", "from expr_cli.main import entry; entry()",
                          *args], env=env or _env(root), capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == code, got.stdout + got.stderr
    return got.stdout


def _stem(rank: int) -> str:
    return "metrics" if rank == 0 else f"metrics.rank{rank}"


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[Path]:
    """A 4-rank job writing a step every 0.2 s on every rank, as of now (its sidecars name
    this process, alive)."""
    run = write_run(tmp_path / "proj" / "live", 4, 20)
    for r in range(4):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        side.update(pid=os.getpid(), host=os.uname().nodename)
        meta.write_text(json.dumps(side))
    stop = threading.Event()

    def write() -> None:
        step = 20
        while not stop.wait(0.2):
            for r in range(4):
                with open(run / f"{_stem(r)}.jsonl", "a") as f:
                    f.write(json.dumps({"_step": step, "_time": time.time(), "loss": 0.5}) + "\n")
            step += 1

    t = threading.Thread(target=write, daemon=True)
    t.start()
    time.sleep(1.0)
    try:
        yield run
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("ahead", [3600, -3600])
def test_top_and_runs_date_a_live_job_by_the_filesystems_clock(
        live_run: Path, tmp_path: Path, ahead: int) -> None:
    """A login node whose clock is an hour off reads a healthy job as healthy: written
    seconds ago, running, no stall (was "stalled 60m at step 19", "last write 1h ago")."""
    if shutil.which("gcc") is None:
        pytest.skip("the clock shim needs gcc")
    from tests.cluster import clock_shim

    shim = tmp_path / "shim"
    shim.mkdir()
    env = _env(tmp_path, LD_PRELOAD=str(clock_shim(shim)), CLUSTER_CLOCK_OFFSET=str(ahead))
    top = json.loads(expr(tmp_path, "top", "--once", "--json", "proj/live", env=env))
    assert top["job"]["state"] == "running", top["job"]
    ages = [r["last_write_age"] for r in top["ranks"]]
    assert all(a is not None and a < 60 for a in ages), ages
    runs = json.loads(expr(tmp_path, "runs", "--json", env=env))
    # on the reader's (shifted) clock: within a minute of its now
    assert abs(runs[0]["last_write"] - (time.time() + ahead)) < 60, runs[0]
    text = expr(tmp_path, "runs", env=env)
    line = next(x for x in text.splitlines() if "proj/live" in x)
    assert "s ago" in line and "h ago" not in line and "m ago" not in line, text


def _alive(run: Path, world: int, done: tuple[int, ...] = ()) -> None:
    """The sidecars of `run` name this process (alive, this host); ranks `done` finished."""
    for r in range(world):
        meta = run / f"{_stem(r)}.meta.json"
        side = json.loads(meta.read_text())
        side.update(pid=os.getpid(), host=os.uname().nodename)
        if r in done:
            side["status"] = "finished"
        meta.write_text(json.dumps(side))


def test_a_live_rank_with_no_step_yet_does_not_hold_the_frontier(tmp_path: Path) -> None:
    """Rank 3 is live and has logged only the SDK's first system sample (at step 0): the
    frontier is the others' step 39, and the reason says rank 3 has no step yet (was: step
    0, "all 3 live ranks reported" beside `missing: [3]`)."""
    from expr_tracker.store.records import SAMPLE_SOURCE

    run = write_run(tmp_path / "proj" / "late", 4, 40)
    _alive(run, 4, done=(1,))
    sample = {"_kind": "rank", "_step": 0, "_time": time.time(), "_rank": 3, "_world_size": 4,
              "_source": SAMPLE_SOURCE, "system/rss_mb": 812.0}
    (run / "metrics.rank3.jsonl").write_text(json.dumps(sample) + "\n")
    side = json.loads((run / "metrics.rank3.meta.json").read_text())
    side["cursor"] = {}
    (run / "metrics.rank3.meta.json").write_text(json.dumps(side))
    summary = json.loads(expr(tmp_path, "summary", "proj/late", "--json"))
    assert summary["step"] == 39 and summary["ranks"]["frontier"] == 39, summary["why"]
    assert "rank 3 live, no step yet" in summary["why"], summary["why"]
    loss = next(k for k in summary["keys"] if k["key"] == "step_time")
    assert loss["missing"] == [] and [b["rank"] for b in loss["behind"]] == [3], loss
    assert "rank 3 (no step yet)" in expr(tmp_path, "summary", "proj/late")
    top = json.loads(expr(tmp_path, "top", "--once", "--json", "proj/late"))
    assert (top["frontier"], top["live"]) == (39, 3), top


def _incident_lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]


def test_delivered_is_carried_to_every_later_line_of_an_incident(tmp_path: Path) -> None:
    """A NaN alert held back on rank 1 (not the alerting rank) is escalated by a watcher
    with a channel (a real `command` channel) and paged: its text does not say "not
    delivered", and its resolution line, the story and MCP-style readers say it was
    delivered; the recovery's own page (notify_recovery off) is said apart."""
    from expr_tracker.alerts.dispatch import Dispatcher
    from expr_tracker.health.config import HealthConfig
    from expr_tracker.health.story import story
    from expr_tracker.health.watch import Watcher, open_incidents

    run = write_run(tmp_path / "proj" / "nan", 4, 20)
    _alive(run, 4)
    pages = tmp_path / "pages.jsonl"
    disp = Dispatcher.from_config({"channels": {"pager": {
        "type": "command", "argv": ["sh", "-c", f"cat >> {pages}; echo >> {pages}"]}}})
    w = Watcher(run, HealthConfig(page_after=0.0), disp)
    fire = {"kind": "fire", "rule": "isnan(loss)", "title": "loss is NaN", "level": "critical",
            "step": 10, "time": time.time(), "rank": 1, "delivered": False, "suppressed": "rank"}
    with open(run / "alerts.rank1.jsonl", "a") as f:
        f.write(json.dumps(fire) + "\n")
    try:
        w.check()
        assert disp.flush(10)
        w.check()  # writes what the channel said
        alert = [x for x in _incident_lines(run) if x["kind"] == "alert"]
        assert alert and alert[-1]["delivered"] is True, alert
        assert "not delivered" not in alert[-1]["detail"], alert[-1]["detail"]
        assert pages.read_text().count("loss is NaN") >= 1
        with open(run / "alerts.rank1.jsonl", "a") as f:
            f.write(json.dumps({**fire, "kind": "recover", "time": time.time()}) + "\n")
        w.check()
        assert disp.flush(10)
        w.check()
    finally:
        disp.close(5)
    alert = [x for x in _incident_lines(run) if x["kind"] == "alert"]
    assert alert[-1]["state"] == "resolved", alert
    assert alert[-1]["delivered"] is True and alert[-1]["recovery_delivered"] is False, alert[-1]
    assert not [i for i in open_incidents(run) if i.kind == "alert"]
    told = next(e for e in story(run)["incidents"] if e["kind"] == "alert")
    assert (told["paged"], told["recovery_paged"]) == (True, False), told


_CRASHING_RANK = """
import os, sys, time
import expr_tracker as et
et.init("proj", "boom", dir=sys.argv[1], upload_mode="spool", spool_dir=sys.argv[2])
for k in range(5):
    et.log({"loss": 1.0 / (k + 1)})
if sys.argv[3] == "kill":
    print("ready", flush=True)
    time.sleep(60)
raise RuntimeError("boom")
"""


def test_status_counts_what_expr_shards_says_of_a_crashed_job(tmp_path: Path) -> None:
    """All 4 ranks of a spooled job crash (3 by an exception, whose finish event says
    crashed; one killed -9): `expr status` says 4 crashed, 0 finished, as `expr shards`
    does (was "3 finished, 1 crashed": a file read to its finish event counted finished)."""
    from tests.procs import env_for
    from tests.test_daemon import EXPRD, write_config

    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    procs = []
    for r in range(4):
        env = env_for({"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r),
                       "PYTHONPATH": os.pathsep.join(sys.path)})
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _CRASHING_RANK, str(root), str(spool),
             "kill" if r == 3 else "raise"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    assert procs[3].stdout is not None and procs[3].stdout.readline() == "ready\n"
    procs[3].kill()
    for p in procs:
        p.wait(60)
    assert [p.returncode for p in procs] == [1, 1, 1, -9]
    config = write_config(tmp_path / "exprd.toml", spool, state, [root])
    done = subprocess.run([*EXPRD, "--config", str(config), "--once"], capture_output=True,
                          text=True, timeout=120, env=env_for({"PYTHONPATH": os.pathsep.join(sys.path)}))
    assert done.returncode == 0, done.stderr
    shards = json.loads(expr(root, "shards", "proj/boom", "--json"))
    assert sorted(s["status"] for s in shards) == ["crashed"] * 4, shards
    doc = json.loads(expr(root, "status", "--state", str(state), "--json"))
    totals = doc["totals"]
    assert (totals["crashed"], totals["finished"]) == (4, 0), totals
    text = expr(root, "status", "--state", str(state))
    assert "0 finished, 4 crashed" in text and "ended here: proj/boom 4 crashed" in text, text


_SHARED_RANK = """
import os, sys, time
import expr_tracker as et
et.init("proj", "shared", dir=sys.argv[1], rank_aware=False)
for k in range(10 + 5 * int(os.environ["RANK"])):
    et.log({"loss": 1.0 / (k + 1)})
print("ready", flush=True)
time.sleep(60)
"""


def test_top_shows_the_ranks_a_shared_file_holds(tmp_path: Path) -> None:
    """Three live ranks of a `rank_aware=False` job append to one file (rows with `_rank`):
    `expr top` shows the three, each at its own step (was one rank, at the file's last)."""
    from tests.procs import env_for

    root = tmp_path / "runs"
    procs = [subprocess.Popen([sys.executable, "-c", _SHARED_RANK, str(root)],
                              env=env_for({"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                                           "PYTHONPATH": os.pathsep.join(sys.path)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr
        shard = root / "proj" / "shared" / "metrics.jsonl"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every rank's rows flushed (a few seconds)
            rows = [json.loads(x) for x in shard.read_text().splitlines()] if shard.exists() else []
            if sum("_kind" not in x for x in rows) == 10 + 15 + 20:
                break
            time.sleep(0.2)
        assert [p.name for p in shard.parent.glob("metrics*.jsonl")] == ["metrics.jsonl"]
        top = json.loads(expr(root, "top", "--once", "--json", "proj/shared"))
        text = expr(root, "top", "--once", "proj/shared")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    got = sorted((r["rank"], r["step"], r["status"]) for r in top["ranks"])
    assert got == [(0, 9, "running"), (1, 14, "running"), (2, 19, "running")], top["ranks"]
    assert (top["live"], top["frontier"], top["lead"]) == (3, 9, 19), top
    assert "3 ranks, 3 live" in text, text


def test_tail_all_ranks_prints_live_rows_in_step_order(tmp_path: Path) -> None:
    """Two ranks flush at their own times: rank 0's steps 1-8 are read a poll before rank
    1's. `expr tail --rank all` prints the live rows in step order (was 1-8 of rank 0,
    then 1-8 of rank 1)."""
    import signal

    run = tmp_path / "proj" / "flush"
    run.mkdir(parents=True)

    def write(rank: int, steps: range) -> None:
        with open(run / f"{_stem(rank)}.jsonl", "a") as f:
            f.write("".join(json.dumps({"_step": s, "_time": time.time(), "loss": 1.0}) + "\n"
                            for s in steps))

    for r in range(2):
        write(r, range(1))
    proc = subprocess.Popen([sys.executable, "-c", "from expr_cli.main import entry; entry()",
                             "tail", "proj/flush", "--rank", "all", "--json", "-n", "0"],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None and "following" in proc.stderr.readline()
        time.sleep(1.0)  # its file watch set up (it starts after that line)
        write(0, range(1, 9))
        time.sleep(0.5)  # a poll (woken by the write) reads rank 0's rows alone
        write(1, range(1, 9))
        time.sleep(3.0)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    got = [(x["_step"], x["_rank"]) for x in map(json.loads, out.splitlines())]
    assert sorted(got) == [(s, r) for s in range(1, 9) for r in range(2)], got
    assert got == sorted(got), got


_SLOW_START = """
import sys, time
import expr_tracker as et
et.init("proj", "slow", dir=sys.argv[1], upload_mode="spool", spool_dir=sys.argv[2])
time.sleep(3)  # a job's start: its run directory not there yet (no row applied)
for k in range(5):
    et.log({"loss": 1.0 / (k + 1)})
    time.sleep(0.2)
et.finish()
"""


def test_exprd_says_it_watches_a_runs_health_once(tmp_path: Path) -> None:
    """A spooled job whose first rows come a few seconds after its start: exprd logs
    "watching health of" once (was once per health interval until its directory was
    there, 5 times)."""
    from tests.procs import env_for
    from tests.test_daemon import start_exprd, stop, wait_ready, write_config

    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    config = write_config(tmp_path / "exprd.toml", spool, state, [root])
    log = tmp_path / "exprd.log"
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = start_exprd(config, log=log, env=env)
    try:
        wait_ready(state, proc)
        job = subprocess.run([sys.executable, "-c", _SLOW_START, str(root), str(spool)],
                             env=env_for(env), capture_output=True, text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        deadline = time.monotonic() + 20
        while "watching health of" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop(proc)
    said = [x for x in log.read_text().splitlines() if "watching health of" in x]
    assert len(said) == 1, "\n".join(said)


def test_top_prints_nothing_more_after_ctrl_c(tmp_path: Path) -> None:
    """`expr top` in a terminal (a pty): Ctrl-C leaves the last frame as it is and exits
    130; it does not draw the frame again (that repeated its header below the old one)."""
    import pty
    import select

    write_run(tmp_path / "proj" / "view", 4, 20)
    pid, fd = pty.fork()
    if pid == 0:  # the child: `expr top` on the pty
        os.execve(sys.executable, [sys.executable, "-c", "from expr_cli.main import entry; entry()",
                                   "top", "proj/view", "--refresh", "60"],
                  {**_env(tmp_path), "TERM": "xterm", "LINES": "40"})

    def read(quiet: float) -> bytes:
        out = b""
        while select.select([fd], [], [], quiet)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child is gone
                break
            if not chunk:
                break
            out += chunk
        return out

    first = b""
    deadline = time.monotonic() + 60
    while b"proj/view" not in first and time.monotonic() < deadline:
        first += read(1.0)
    first += read(1.0)  # the whole first frame, then quiet (the next is 60 s away)
    assert b"proj/view" in first, first
    os.write(fd, b"\x03")  # Ctrl-C as a terminal sends it: SIGINT to the foreground group
    after = read(5.0)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 130
    assert b"proj/view" not in after and b"rank" not in after, after


def test_exprd_stopping_resolves_the_incidents_of_a_run_that_ended(tmp_path: Path) -> None:
    """`make demo`'s run: 4 spooled ranks, rank 2 a straggler (an incident exprd opens);
    the job finishes and exprd is stopped at once. Its last pass resolves the straggler
    ("run ended"): nothing is left open on the finished run (was: open, resolved by the
    next watcher as "open 42m")."""
    from expr_tracker.health.watch import open_incidents
    from tests.procs import env_for
    from tests.test_daemon import start_exprd, stop, wait_ready, write_config

    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    config = write_config(tmp_path / "exprd.toml", spool, state, [root])
    env = {"PYTHONPATH": os.pathsep.join(sys.path), "EXPR_DIR": str(root),
           "EXPR_SPOOL": str(spool), "EXPR_MODE": "spool", "WORLD_SIZE": "4"}
    proc = start_exprd(config, log=tmp_path / "exprd.log", env=env)
    run = root / "demo" / "sft-1"
    train = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    try:
        wait_ready(state, proc)
        ranks = [subprocess.Popen([sys.executable, str(train), "--steps", "60", "--slow-rank",
                                   "2", "--sleep", "0.04"],
                                  env=env_for({**env, "RANK": str(r), "LOCAL_RANK": str(r)}),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(4)]
        assert [p.wait(120) for p in ranks] == [0] * 4
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # as the demo waits: every shard finished
            metas = [json.loads(p.read_text()) for p in run.glob("metrics*.meta.json")]
            if len(metas) == 4 and all(m.get("status") == "finished" for m in metas):
                break
            time.sleep(0.2)
    finally:
        assert stop(proc, 15) == 0
    lines = _incident_lines(run)
    assert any(x["kind"] == "straggler" for x in lines), lines  # (the test has a straggler)
    assert open_incidents(run) == [], [x for x in lines if x["state"] == "open"]
