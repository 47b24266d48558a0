"""Ctrl-C while a big run is read by forked worker processes: the terminal signals the
whole process group, so the workers get SIGINT too. The user sees at most one line,
not a KeyboardInterrupt traceback from every worker, nor a hang (a worker killed while it
wrote its result left the pool's reader waiting for the rest), and no worker outlives
the command."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.synthetic import write_run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc")
EXPR = Path(sys.executable).parent / "expr"
WORLD, STEPS = 640, 80  # past PARALLEL_BYTES of expected tail bytes: the reads fork workers


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("interrupt")
    write_run(root / "p" / "big", WORLD, STEPS, straggler=3, crashed=7)
    return root


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _first_workers(proc: subprocess.Popen) -> list[int]:
    """The worker processes of `proc`, as soon as it has started one."""
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while not workers and proc.poll() is None and time.monotonic() < deadline:
        workers = _children(proc.pid)
        time.sleep(0.002)
    assert workers, f"{proc.args}: no worker process was started (exit {proc.poll()})"
    return workers


def _interrupt(root: Path, args: tuple[str, ...], delay: float) -> tuple[int, str, list[int]]:
    """Run `expr ARGS`, Ctrl-C it `delay` s after its first worker started; (exit code,
    stderr, the workers seen)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    env.update(EXPR_DIR=str(root), COLUMNS="100", NO_COLOR="1", EXPR_SYSTEM_METRICS="0",
               PYTHONFAULTHANDLER="1")  # a hang's stacks, at the SIGABRT below
    proc = subprocess.Popen([str(EXPR), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own group, as a shell's job
    try:
        workers = _first_workers(proc)
        time.sleep(delay)
        seen = set(workers) | set(_children(proc.pid))
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a hang: fail with where each thread waits
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"{args} hung {delay} s after its first worker; its threads:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err, sorted(seen)


@pytest.mark.parametrize("args", [("summary", "big"), ("watch", "big", "--once"),
                                  ("top", "big", "--once")])
def test_ctrl_c_while_workers_read_prints_one_line_and_leaves_no_worker(
        root: Path, args: tuple[str, ...]) -> None:
    # at several moments: while the workers read, send their results, wait for more work
    for delay in (0.0, 0.03, 0.08, 0.15, 0.25, 0.4):
        code, err, workers = _interrupt(root, args, delay)
        if code == 0 or (args[0] == "watch" and code == 1 and not err):
            continue  # it had finished (watch --once: 1 for the crashed rank's incident)
        # every command stops quietly, 130, as coreutils tools do (summary said "error:
        # aborted" and exited 1: issue 54)
        assert err.strip() == "", f"at +{delay} s:\n{err}"
        # (-SIGINT: it came as the interpreter was exiting, its handlers gone)
        assert code in (130, -signal.SIGINT), (delay, code, err)
        assert not [w for w in workers if _alive(w)], f"at +{delay} s a worker outlived it"


def test_workers_die_with_a_killed_parent(root: Path) -> None:
    """`kill -9` of the command (or the OOM killer): its workers do not wait for work for
    ever."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    env.update(EXPR_DIR=str(root), EXPR_SYSTEM_METRICS="0")
    proc = subprocess.Popen([str(EXPR), "summary", "big"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        workers = _first_workers(proc)
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone, not its group
        proc.wait()
        deadline = time.monotonic() + 10
        while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "a worker outlived its killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):  # (a worker left alive by a failure)
            os.killpg(proc.pid, signal.SIGKILL)
