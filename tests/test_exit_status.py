"""Honest status (issue 11 item 3): a rank that raises is `crashed` with its exception; a
resume says so once on stderr. Real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import orjson


def _run(tmp_path, body: str, rank: int = 2) -> subprocess.CompletedProcess:
    code = "import expr_tracker as et, threading\n" + textwrap.dedent(body)
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4"}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def _sidecar(tmp_path, rank: int = 2) -> dict:
    return orjson.loads((tmp_path / "p" / "sft-1" / f"metrics.rank{rank}.meta.json").read_bytes())


def test_uncaught_exception_marks_the_shard_crashed(tmp_path):
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(tmp_path)!r})
        for i in range(5):
            et.log({{"loss": 1.0}})
        raise RuntimeError("CUDA error: an illegal memory access")
    """)
    assert proc.returncode == 1
    assert "RuntimeError: CUDA error" in proc.stderr  # the previous hook still prints it
    side = _sidecar(tmp_path)
    assert side["status"] == "crashed"
    assert side["exit"]["type"] == "RuntimeError"
    assert side["exit"]["message"] == "CUDA error: an illegal memory access"
    assert isinstance(side["exit"]["time"], float) and side["cursor"]["rows"] == 5


def test_exception_in_a_thread_is_recorded(tmp_path):
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(tmp_path)!r})
        et.log({{"loss": 1.0}})
        def work():
            raise ValueError("loader died")
        t = threading.Thread(target=work, name="loader")
        t.start(); t.join()
    """)
    assert proc.returncode == 0 and "ValueError: loader died" in proc.stderr
    side = _sidecar(tmp_path)
    assert side["status"] == "crashed"
    assert side["exit"] == {**side["exit"], "type": "ValueError", "message": "loader died",
                            "thread": "loader"}


def test_clean_exit_and_keyboard_interrupt_are_not_crashes(tmp_path):
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(tmp_path)!r})
        et.log({{"loss": 1.0}})
    """)
    assert proc.returncode == 0, proc.stderr
    side = _sidecar(tmp_path)
    assert side["status"] == "finished" and "exit" not in side
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(tmp_path)!r})
        raise KeyboardInterrupt
    """)
    assert proc.returncode != 0
    assert _sidecar(tmp_path)["status"] == "finished"


def test_resume_says_so_once_on_stderr(tmp_path):
    body = f"""
        et.init("p", "sft-1", dir={str(tmp_path)!r})
        for i in range(300):
            et.log({{"loss": 1.0}})
    """
    first = _run(tmp_path, body)
    assert first.returncode == 0 and "resuming" not in first.stderr
    second = _run(tmp_path, body)
    assert second.returncode == 0
    assert second.stderr.count("resuming") == 1
    assert "resuming sft-1 rank 2 at step 300\n" in second.stderr
    assert second.stdout == ""


def test_spool_mode_crash_reaches_the_sidecar_through_exprd(tmp_path):
    """A spool-mode rank that raises: its finish event's exit is applied by a real exprd,
    and `expr shards` and `expr watch --once` show the crash with its exception."""
    from tests.test_daemon import exprd_once, write_config

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r})
        for i in range(5):
            et.log({{"loss": 1.0}})
        raise ValueError("loss went to inf at step 5")
    """)
    assert proc.returncode == 1 and "ValueError: loss went to inf" in proc.stderr
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    side = _sidecar(root)
    assert side["status"] == "crashed" and side["cursor"]["rows"] == 5
    assert side["exit"]["type"] == "ValueError"
    assert side["exit"]["message"] == "loss went to inf at step 5"
    assert isinstance(side["exit"]["time"], float)
    run_dir = str(root / "p" / "sft-1")

    def expr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "NO_COLOR": "1"})

    shards = expr("shards", run_dir, "--json")
    assert shards.returncode == 0, shards.stderr
    row = next(r for r in orjson.loads(shards.stdout) if r["rank"] == 2)
    assert row["status"] == "crashed"
    assert row["exit"]["type"] == "ValueError"
    assert "crashed: ValueError: loss went to inf at step 5" in row["attention"]
    watch = expr("watch", run_dir, "--once", "--json", "--missing-after", "1h")
    assert watch.returncode == 1, watch.stderr  # an incident is open
    incidents = [orjson.loads(line) for line in watch.stdout.splitlines()]
    crashed = [i for i in incidents if i["kind"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["ranks"] == [2]
    assert "ValueError: loss went to inf at step 5" in crashed[0]["detail"]


def test_spool_mode_clean_finish_has_no_exit(tmp_path):
    """The same run without an exception: exprd marks it finished, with no exit."""
    from tests.test_daemon import exprd_once, write_config

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    proc = _run(tmp_path, f"""
        et.init("p", "sft-1", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r})
        et.log({{"loss": 1.0}})
    """)
    assert proc.returncode == 0, proc.stderr
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    side = _sidecar(root)
    assert side["status"] == "finished" and "exit" not in side
