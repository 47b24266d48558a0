"""exprd against real limits (issue 10 cases 3, 4, 17): a full filesystem and a descriptor
limit below the number of spool files.

The full disk is a small tmpfs mounted in a private mount namespace (`unshare -m`), so
root cannot write past it either; the test skips where no namespace can be made.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import orjson

import expr_tracker as et
from tests.procs import env_for, in_mount_namespace
from tests.test_daemon import EXPRD, check_shard, lines_of, make_spool, sidecar, write_config


def test_full_disk_blocks_keeps_the_checkpoint_behind_and_lands_every_row_once(
        tmp_path: Path) -> None:
    n = 30_000
    spool, state, mnt = tmp_path / "spool", tmp_path / "state", tmp_path / "mnt"
    mnt.mkdir()
    path = make_spool(spool, mnt, "full", n)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [mnt])
    log = tmp_path / "exprd.log"
    result = in_mount_namespace(f"""
        import atexit, json, os, signal, subprocess, sys, time
        EXPRD, cfg, state, mnt = {EXPRD!r}, {str(cfg)!r}, {str(state)!r}, {str(mnt)!r}
        shard = os.path.join(mnt, "proj", "full", "metrics.jsonl")
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt], check=True)

        started = []
        # whatever happens, no exprd outlives this script (sys.exit runs atexit too)
        atexit.register(lambda: [p.kill() for p in started if p.poll() is None])

        def start():
            err = open({str(log)!r}, "ab")
            started.append(subprocess.Popen([*EXPRD, "--config", cfg],
                                            stdout=subprocess.DEVNULL, stderr=err))
            return started[-1]

        def status():
            try:
                return json.load(open(os.path.join(state, "status.json")))
            except (OSError, ValueError):
                return {{}}

        def wait(pred, what, timeout=60):
            deadline = time.monotonic() + timeout
            while not pred():
                if time.monotonic() > deadline:
                    sys.exit(f"timed out waiting for {{what}}")
                time.sleep(0.05)

        d = start()
        wait(lambda: any(f.get("blocked") for f in status().get("files", {{}}).values()),
             "the file to be blocked")
        time.sleep(1.5)  # retries go on; each is counted, the cause is logged once
        blocked = status()
        shown = subprocess.run([sys.executable, "-m", "expr_cli.main", "status", "--state",
                                state], capture_output=True, text=True,
                               env={{**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}}).stdout
        d.kill()  # kill -9 while blocked: the checkpoint on disk must not pass the shard
        d.wait()
        try:  # none at all is fine: nothing was committed
            cps = json.load(open(os.path.join(state, "checkpoints.json")))["files"]
        except FileNotFoundError:
            cps = {{}}
        rows_then = open(shard, "rb").read().count(b"\\n")
        subprocess.run(["mount", "-o", "remount,size=64m", mnt], check=True)
        d = start()
        meta = os.path.join(mnt, "proj", "full", "metrics.meta.json")
        def finished():
            try:
                done = json.load(open(meta))["status"] == "finished"
            except (OSError, ValueError, KeyError):
                return False
            return done and open(shard, "rb").read().count(b"\\n") >= {n}
        wait(finished, "the shard to be finished")
        d.send_signal(signal.SIGTERM)
        assert d.wait(15) == 0
        print(json.dumps({{"blocked": blocked, "shown": shown, "checkpoints": cps,
                          "rows_then": rows_then,
                          "shard": open(shard, "rb").read().decode()}}))
    """)
    entry = result["blocked"]["files"][str(path)]
    assert "No space left on device" in entry["blocked"], entry
    # every segment of the session waits on the one full shard: each is blocked, counted once
    # (segments start at 64 KiB and grow: 30,000 rows are several files)
    files = result["blocked"]["files"]
    assert entry["lag_bytes"] > 0 and result["blocked"]["totals"]["blocked"] == len(files)
    assert all("No space left on device" in f["blocked"] for f in files.values()), files
    assert "blocked" in result["shown"] and "No space left on device" in result["shown"]
    # the checkpoint never passes rows the shard does not hold
    offset = result["checkpoints"].get(str(path), {}).get("shard", 0)
    covered = path.read_bytes()[:offset].count(b"\n") - 1  # minus the init line
    assert covered <= result["rows_then"] < n, (covered, result["rows_then"])
    # every row once, in order, after space came back and exprd restarted
    recs = [orjson.loads(line) for line in result["shard"].splitlines()]
    assert [r["_seq"] for r in recs] == list(range(1, n + 1))
    assert [r["k"] for r in recs] == list(range(n))
    # 17: the cause is logged once, and counted in status.json
    text = log.read_text()
    assert text.count("cannot write shard") == 1, text
    assert result["blocked"]["errors"]["shard:ENOSPC"] > 1


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_more_spool_files_than_descriptors(tmp_path: Path) -> None:
    """200 spool files of dead writers under a limit of 48 descriptors: every shard gets
    every row, every file is marked crashed, no complete line is called torn."""
    count, rows, limit = 200, 100, 48
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    dead = _dead_pid()
    for i in range(count):
        run = et.init("proj", f"many-{i}", dir=root, upload_mode="spool", spool_dir=spool)
        for k in range(rows):
            et.log({"loss": 1.0 / (k + 1), "k": k})
        path = Path(run.info()["spool_file"])
        et.finish()
        lines = path.read_bytes().splitlines(keepends=True)
        init = orjson.loads(lines[0])
        init["pid"] = dead  # its writer is gone: exprd marks it crashed after reading it all
        path.write_bytes(orjson.dumps(init) + b"\n" + b"".join(lines[1:-1]))
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    out = subprocess.run([*EXPRD, "--config", str(cfg), "--once"], env=env_for(),
                         capture_output=True, text=True, timeout=120, preexec_fn=low_limit)
    assert out.returncode == 0, out.stderr
    for i in range(count):
        run_dir = root / "proj" / f"many-{i}"
        check_shard(run_dir / "metrics.jsonl", rows)
        assert sidecar(run_dir / "metrics.meta.json")["status"] == "crashed"
    reasons = [q["reason"] for q in lines_of(state / "quarantine" / "index.jsonl")]
    assert not any("torn" in r for r in reasons), reasons[:5]
    assert "Too many open files" not in out.stderr
