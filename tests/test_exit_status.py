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
