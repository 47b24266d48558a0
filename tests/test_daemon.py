"""exprd with real processes: kill -9 of the daemon and of writers, quarantine, alerts.

The issue's numbers run by default (4 writers x 20,000 events, 20 kills of exprd).
"""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

import expr_tracker as et
from tests.procs import env_for, run_all, spawn

EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]


# -- helpers (also used by test_systemd and test_cli_replay) -----------------------------


def write_config(path: Path, spool: Path, state: Path, roots: list[Path], *, rescan: float = 0.2,
                 extra: str = "") -> Path:
    """An exprd TOML config for a test."""
    path.write_text(
        f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
        f"allowed_roots = {json.dumps([str(r) for r in roots])}\n"
        f"rescan_interval = {rescan}\nstatus_interval = 0.2\n" + extra
    )
    return path


def start_exprd(config: Path, *args: str, log: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """exprd as a real process; its stderr goes to `log` (appended)."""
    err = open(log or config.with_suffix(".log"), "ab")  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen([*EXPRD, "--config", str(config), *args], stdout=subprocess.DEVNULL,
                                stderr=err, env=env_for(env))
    finally:
        err.close()


def exprd_once(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`exprd --once`: apply what is there and exit."""
    proc = subprocess.run([*EXPRD, "--config", str(config), "--once", *args], env=env_for(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


def wait_ready(state: Path, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Until this exprd process has written its first status.json (it is serving)."""

    def ready() -> bool:
        assert proc.poll() is None, f"exprd exited with {proc.returncode}"
        try:
            return json.loads((state / "status.json").read_text())["pid"] == proc.pid
        except (OSError, ValueError, KeyError):
            return False

    wait_for(ready, timeout, "exprd to be ready")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM, then wait: exprd must drain and exit within `timeout`."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def lines_of(path: Path) -> list[dict[str, Any]]:
    """Every line of a file as JSON (all must parse)."""
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def sidecar(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def writer_code(spool: Path, root: Path, name: str, n: int, *, chunk: int = 500,
                pause: float = 0.0, init: str = "", tail: str = "et.finish()") -> str:
    """A training process in spool mode: n rows of loss, flushed every `chunk` rows."""
    return f"""
        import time, expr_tracker as et
        et.init("proj", {name!r}, dir={str(root)!r}, upload_mode="spool",
                spool_dir={str(spool)!r}{init})
        for c in range({n} // {chunk}):
            for i in range({chunk}):
                k = c * {chunk} + i
                et.log({{"loss": 1.0 / (k + 1), "k": k}})
            et.flush()
            time.sleep({pause})
        {tail}
    """


def make_spool(spool: Path, root: Path, name: str, n: int, **init: Any) -> Path:
    """A finished spool file written by the SDK in this process; returns its path."""
    run = et.init("proj", name, dir=root, upload_mode="spool", spool_dir=spool, **init)
    for k in range(n):
        et.log({"loss": 1.0 / (k + 1), "k": k})
    path = Path(run.info()["spool_file"])
    et.finish()
    return path


def check_shard(path: Path, n: int) -> None:
    """Every event of one session exactly once and in order."""
    recs = lines_of(path)
    assert [r["_seq"] for r in recs] == list(range(1, n + 1))
    assert [r["k"] for r in recs] == list(range(n))
    assert [r["_step"] for r in recs] == list(range(n))
    assert len({r["_sid"] for r in recs}) == 1


# -- exactly once through kill -9 --------------------------------------------------------


def test_kill9_exprd_repeatedly_every_event_once_in_order(tmp_path: Path) -> None:
    n, kills = 20_000, 20  # the numbers: about 5 s here
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    shards = [root / "proj" / "kill" / ("metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl")
              for r in range(4)]
    # the first exprd serves before the writers start, and is killed once it has applied
    # rows: on a loaded machine a kill at a random moment may land before exprd applied
    # anything, and the writers (at least 4 s of pauses) are far from done by then
    d = start_exprd(cfg)
    wait_ready(state, d, 60)
    writers = [
        spawn(writer_code(spool, root, "kill", n, chunk=250, pause=0.05),
              {"RANK": str(r), "WORLD_SIZE": "4"})
        for r in range(4)
    ]
    wait_for(lambda: sum(count_lines(s) for s in shards) > 0, 60, "the first rows applied")
    rng = random.Random(20251129)
    progress = []
    for i in range(kills):
        if i:
            d = start_exprd(cfg)
            time.sleep(rng.uniform(0.05, 0.35))
        d.kill()  # SIGKILL: no drain, no checkpoint, maybe half a write
        d.wait()
        progress.append(sum(count_lines(s) for s in shards))
    run_all(writers)
    # some kills must have landed while the shards were being written
    assert any(0 < p < 4 * n for p in progress), progress
    d = start_exprd(cfg)
    try:
        wait_ready(state, d, 60)  # ready once it has caught up with up to 80,000 rows
        wait_for(lambda: all(sidecar(s.with_name(s.name.replace(".jsonl", ".meta.json")))
                             .get("status") == "finished" for s in shards), 60, "finished shards")
        # a shard's finish can land before exprd deleted the segments its session rolled
        # from (they go once applied): the spool holds each session's last segment only
        wait_for(lambda: len(list(spool.rglob("*.jsonl"))) == 4, 60, "rolled segments deleted")
    finally:
        assert stop(d) == 0
    for s in shards:
        check_shard(s, n)
    cps = json.loads((state / "checkpoints.json").read_text())["files"]
    assert len(cps) == 4 and all(c["state"] == "finished" for c in cps.values())


def test_checkpoints_of_files_gone_are_pruned_at_load(tmp_path: Path) -> None:
    """An exprd killed after deleting a rolled segment and before saving its checkpoints
    left the entry on disk: the next exprd drops it at load (and saves without it)."""
    from daemon.state import Checkpoints, StateDir

    spool, state = tmp_path / "spool", tmp_path / "state"
    spool.mkdir()
    state.mkdir()
    here, gone = spool / "a.jsonl", spool / "a~1.jsonl"
    here.write_bytes(b"{}\n")
    entry = {"ino": 1, "shard": 3, "seq": 0, "state": "rolled"}
    (state / "checkpoints.json").write_bytes(orjson.dumps(
        {"version": 1, "files": {str(here): entry, str(gone): entry}}))
    sdir = StateDir(state)
    try:
        cps = Checkpoints(sdir)
        assert list(cps.files) == [str(here)]
        cps.save()
    finally:
        sdir.close()
    assert list(json.loads((state / "checkpoints.json").read_text())["files"]) == [str(here)]


def test_kill9_writer_keeps_complete_events_and_marks_crashed(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    w = spawn(writer_code(spool, root, "crash", 600, chunk=300,
                          tail="print('ready', flush=True); time.sleep(300)"))
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        shard = root / "proj" / "crash" / "metrics.jsonl"
        wait_for(lambda: count_lines(shard) == 600, 20, "600 rows in the shard")
        # the half line a dying writer can leave behind, written while it still lives so
        # exprd cannot finish with the file first: at the end of the segment's data (it is
        # memory-mapped, zeros after its data)
        spool_file = next(spool.rglob("*.jsonl"))
        data = spool_file.read_bytes()
        with open(spool_file, "r+b") as fh:
            fh.seek(data.find(b"\0") if b"\0" in data else len(data))
            fh.write(b'{"_step":600,"_time":1.0,"lo')
        w.kill()
        w.wait()
        meta = shard.with_name("metrics.meta.json")
        wait_for(lambda: sidecar(meta).get("status") == "crashed", 20, "status crashed")
    finally:
        w.kill()
        w.wait()
        assert stop(d) == 0
    check_shard(shard, 600)
    index = lines_of(state / "quarantine" / "index.jsonl")
    assert [q["reason"] for q in index] == ["torn tail: its writer is gone"]
    assert (state / "quarantine" / index[0]["saved"]).read_bytes() == b'{"_step":600,"_time":1.0,"lo'
    status = json.loads((state / "status.json").read_text())
    assert status["files"][str(spool_file)]["state"] == "crashed"


def test_poll_mode_gives_the_same_result(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], rescan=1.0)
    d = start_exprd(cfg, "--poll")
    try:
        run_all([spawn(writer_code(spool, root, "poll", 2000, chunk=400, pause=0.05),
                       {"RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)])
        metas = [root / "proj" / "poll" / m for m in ("metrics.meta.json", "metrics.rank1.meta.json")]
        wait_for(lambda: all(sidecar(m).get("status") == "finished" for m in metas), 20, "finished")
    finally:
        assert stop(d) == 0
    for name in ("metrics.jsonl", "metrics.rank1.jsonl"):
        check_shard(root / "proj" / "poll" / name, 2000)
    assert json.loads((state / "status.json").read_text())["mode"] == "poll"


# -- bad input -------------------------------------------------------------------------


def _rewrite(path: Path, edit: Callable[[list[bytes]], list[bytes]]) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(edit(lines)))


def test_huge_and_garbage_lines_are_quarantined_the_rest_applied(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    path = make_spool(spool, root, "bad", 100)
    huge = b'{"_step":1,"blob":"' + b"a" * (20 * 1024 * 1024) + b'"}\n'
    _rewrite(path, lambda ls: [*ls[:30], b"garbage{{\n", *ls[30:60], huge, b"\xff\xfe\n", *ls[60:]])
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    exprd_once(cfg)
    check_shard(root / "proj" / "bad" / "metrics.jsonl", 100)
    index = lines_of(state / "quarantine" / "index.jsonl")
    assert [q["reason"] for q in index] == ["not JSON", "line over 16 MiB", "not UTF-8"]
    assert index[1]["length"] == len(huge)
    # a capped copy: the first 64 KiB, the full length in the index (issue 10 case 18)
    saved = (state / "quarantine" / index[1]["saved"]).read_bytes()
    assert saved == huge[: 64 * 1024] and index[1]["saved_bytes"] == 64 * 1024
    assert all(q["file"] == str(path) for q in index)
    assert sidecar(root / "proj" / "bad" / "metrics.meta.json")["status"] == "finished"


def test_unsafe_or_inconsistent_spools_are_refused_others_flow(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    good = make_spool(spool, root, "good", 50)
    noinit = make_spool(spool, root, "noinit", 5)
    _rewrite(noinit, lambda ls: ls[1:])
    repeat = make_spool(spool, root, "repeat", 20)
    _rewrite(repeat, lambda ls: [*ls[:6], ls[5], *ls[6:]])
    make_spool(spool, outside, "outside", 5)
    trav = make_spool(spool, root, "trav", 5)

    def traverse(ls: list[bytes]) -> list[bytes]:
        init = orjson.loads(ls[0])
        init["identity"]["name"] = "../../etc"
        return [orjson.dumps(init) + b"\n", *ls[1:]]

    _rewrite(trav, traverse)
    mismatch = make_spool(spool, root, "mismatch", 5)
    mismatch.rename(mismatch.with_name(mismatch.name.replace("metrics.", "metrics.rank1.")))
    make_spool(elsewhere, root, "linked", 5)
    (spool / "proj" / "linked").symlink_to(elsewhere / "proj" / "linked")
    make_spool(spool, root, "open", 5)
    os.chmod(spool / "proj" / "open", 0o777)

    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    proc = exprd_once(cfg)
    check_shard(root / "proj" / "good" / "metrics.jsonl", 50)
    check_shard(root / "proj" / "repeat" / "metrics.jsonl", 20)
    assert not outside.exists()
    for name in ("noinit", "trav", "mismatch", "linked", "open"):
        assert not (root / "proj" / name).exists(), name
    reasons = [q["reason"] for q in lines_of(state / "quarantine" / "index.jsonl")]
    assert reasons.count("event before its init") == 6
    assert "_seq repeat: 5 after 5" in reasons
    assert any("outside allowed_roots" in r for r in reasons)
    assert any("bad name in init" in r for r in reasons)
    assert any("init identity says" in r for r in reasons)
    assert any("symlink" in r for r in reasons)
    assert any("writable by other users" in r for r in reasons)
    assert proc.stderr.count("refusing") == 5, proc.stderr
    status = json.loads((state / "status.json").read_text())
    assert status["totals"]["refused"] == 3 and len(status["refused_paths"]) == 2
    assert status["files"][str(good)]["state"] == "finished"


def test_refuses_root_without_allow_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to check the root refusal")
    proc = subprocess.run([sys.executable, "-m", "exprd.main", "--spool", str(tmp_path / "s"),
                           "--state", str(tmp_path / "st"), "--once"], env=env_for(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "refusing to run as root" in proc.stderr
    assert not (tmp_path / "st").exists()


# -- alerts, backends, crash silence, retention, reload, several nodes -------------------


def test_alerts_in_spool_mode_are_delivered_once_by_exprd(tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    url = httpserver.url_for("/hook")
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    code = f"""
        import expr_tracker as et
        et.init("proj", "nan", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r},
                alert_rules=["isnan(loss) => critical: diverged"])
        for k in range(20):
            et.log({{"loss": 1.0 / (k + 1)}})
        et.log({{"loss": float("nan")}})
        for k in range(5):
            et.log({{"loss": 0.1}})
        assert et.info()["alerts"] == {{}}
        et.finish()
    """
    run_all([spawn(code, {"RANK": str(r), "WORLD_SIZE": "4"}) for r in range(4)])
    assert not any(url.encode() in p.read_bytes() for p in spool.rglob("*.jsonl"))
    extra = f'[alert.channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra)
    exprd_once(cfg)
    assert len(httpserver.log) == 1
    body = json.loads(httpserver.log[0][0].get_data())
    assert body["title"] == "diverged" and body["rank"] == 0 and body["level"] == "critical"
    run = root / "proj" / "nan"
    fired = lines_of(run / "alerts.jsonl")
    assert [(a["title"], a["delivered"]) for a in fired] == [("diverged", True)]
    for r in (1, 2, 3):
        assert [(a["title"], a["delivered"], a["rank"]) for a in lines_of(run / f"alerts.rank{r}.jsonl")] \
            == [("diverged", False, r)]
    # applying again delivers nothing twice
    exprd_once(cfg)
    assert len(httpserver.log) == 1
    assert len(lines_of(run / "alerts.jsonl")) == 1


def test_backends_get_every_event_with_its_id(tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/ingest", method="POST").respond_with_data("ok")
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    path = make_spool(spool, root, "fwd", 30,
                      backends=[{"type": "http", "url": "http://127.0.0.1:9/not-used"}])
    session = path.name.split(".")[1]
    extra = (f'[backends.http]\ntype = "http"\nurl = {json.dumps(httpserver.url_for("/ingest"))}\n'
             "batch = 10\n")
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra))
    events = [e for req, _ in httpserver.log for e in json.loads(req.get_data())["events"]]
    assert [e["_id"] for e in events] == [f"{session}:{s}" for s in range(1, 31)]
    assert [e["k"] for e in events] == list(range(30))
    keys = [req.headers["Idempotency-Key"] for req, _ in httpserver.log]
    assert keys[0] == f"{session}:1..{session}:10"
    cp = json.loads((state / "checkpoints.json").read_text())["files"][str(path)]
    assert cp["backends"]["http"] == path.stat().st_size


def test_silent_file_from_another_host_is_marked_crashed(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    path = make_spool(spool, root, "silent", 10)

    def other_host(ls: list[bytes]) -> list[bytes]:
        init = orjson.loads(ls[0])
        init["host"] = "some-other-node"
        return [orjson.dumps(init) + b"\n", *ls[1:-1]]  # and no finish

    _rewrite(path, other_host)
    old = time.time() - 120
    os.utime(path, (old, old))
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], extra="crash_silence = 60\n")
    exprd_once(cfg)
    assert sidecar(root / "proj" / "silent" / "metrics.meta.json")["status"] == "crashed"
    check_shard(root / "proj" / "silent" / "metrics.jsonl", 10)


def test_retention_deletes_only_finished_applied_files(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    done = make_spool(spool, root, "done", 10)
    live = make_spool(spool, root, "live", 10)
    _rewrite(live, lambda ls: ls[:-1])  # no finish; its writer (this process) is alive
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], extra="retention = 0\n")
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        wait_for(lambda: not done.exists(), 20, "the finished spool file to be deleted")
        time.sleep(0.5)
    finally:
        assert stop(d) == 0
    assert live.exists()
    check_shard(root / "proj" / "done" / "metrics.jsonl", 10)
    check_shard(root / "proj" / "live" / "metrics.jsonl", 10)
    assert str(done) not in json.loads((state / "checkpoints.json").read_text())["files"]


def test_sighup_reloads_and_a_bad_config_keeps_the_old_one(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    root2 = tmp_path / "runs2"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    try:
        wait_ready(state, d)
        cfg.write_text("this is = = not toml")
        d.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in log.read_text(), 10, "the reload error")
        write_config(cfg, spool, state, [root, root2])
        d.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in log.read_text(), 10, "the reload")
        make_spool(spool, root2, "after", 10)
        wait_for(lambda: count_lines(root2 / "proj" / "after" / "metrics.jsonl") == 10, 10,
                 "a run under the newly allowed root")
    finally:
        assert stop(d) == 0
    check_shard(root2 / "proj" / "after" / "metrics.jsonl", 10)


def _snapshot(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in sorted(run_dir.iterdir()):
        if p.name.endswith(".meta.json"):
            meta = json.loads(p.read_text())
            out[p.name] = (meta["status"], meta["cursor"], meta["rank"], meta["session"])
        else:
            out[p.name] = p.read_bytes()
    return out


def test_one_exprd_per_node_builds_the_same_run_dir(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    spools = {node: tmp_path / f"spool-{node}" for node in "ab"}
    procs = [spawn(writer_code(spools["a" if r < 2 else "b"], root, "multi", 400, chunk=200),
                   {"RANK": str(r), "WORLD_SIZE": "4"}) for r in range(4)]
    run_all(procs)
    merged = tmp_path / "spool-all"
    for sp in spools.values():
        subprocess.run(["cp", "-a", f"{sp}/.", str(merged)], check=True) if merged.exists() else \
            subprocess.run(["cp", "-a", str(sp), str(merged)], check=True)
    exprd_once(write_config(tmp_path / "one.toml", merged, tmp_path / "state-one", [root]))
    single = _snapshot(root / "proj" / "multi")
    subprocess.run(["rm", "-rf", str(root)], check=True)
    for node, sp in spools.items():
        exprd_once(write_config(tmp_path / f"{node}.toml", sp, tmp_path / f"state-{node}", [root]))
    nodes = _snapshot(root / "proj" / "multi")
    assert sorted(nodes) == sorted(single) and len(nodes) == 8
    assert nodes == single


def test_version_and_help() -> None:
    import subprocess
    import sys

    exprd = str(Path(sys.executable).parent / "exprd")
    out = subprocess.run([exprd, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("exprd (expr-tracker) ")
    out = subprocess.run([exprd, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--spool" in out.stdout and "--allow-root" in out.stdout


def test_signal_storm_never_deadlocks_and_sigterm_still_stops(tmp_path: Path) -> None:
    """Signals land at any moment, also while the main loop holds its wake-up's lock.

    exprd used a threading.Event set from the signal handler, which deadlocked when
    the signal arrived inside Event.wait(); the wake-up is now a self-pipe.
    """
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    try:
        wait_for(lambda: (state / "status.json").exists(), 20, "exprd ready")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # reload requests: each one wakes the loop
            d.send_signal(signal.SIGHUP)
        assert d.poll() is None, "exprd died under a burst of SIGHUP"
    finally:
        code = stop(d)
    assert code == 0
    # handlers nested in the one before them: once a RecursionError that ended exprd
    assert "Traceback" not in (tmp_path / "exprd.log").read_text()


def test_exprd_started_before_any_run_creates_the_spool_root_and_beats(tmp_path: Path) -> None:
    """The usual order (exprd first, training later): the first rank's init finds a
    heartbeat and does not warn that no exprd runs."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    d = start_exprd(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    try:
        wait_ready(state, d)
        wait_for(lambda: (spool / ".exprd.json").exists(), 10, "the heartbeat")
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700
        code = ("import warnings, expr_tracker as et\n"
                "with warnings.catch_warnings(record=True) as caught:\n"
                "    warnings.simplefilter('always')\n"
                f"    run = et.init('p', 'r', dir={str(root)!r}, upload_mode='spool', "
                f"spool_dir={str(spool)!r})\n"
                "    et.log({'x': 1.0}); et.finish()\n"
                "print(len([w for w in caught if 'no exprd' in str(w.message)]))\n")
        (out,) = run_all([spawn(code)])
        assert out.strip() == "0"
    finally:
        assert stop(d) == 0


def test_a_misspelt_config_key_is_one_line_naming_the_key_it_meant(tmp_path: Path) -> None:
    config = tmp_path / "exprd.toml"
    config.write_text(f'spool = "{tmp_path / "s"}"\nstate = "{tmp_path / "st"}"\n'
                      "rescan_intervall = 5\n")
    proc = subprocess.run([*EXPRD, "--config", str(config), "--once"], env=env_for(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("exprd: unknown key 'rescan_intervall' (did you mean "
                                  "'rescan_interval'? allowed: spool, state,"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "st").exists()
