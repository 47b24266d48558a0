"""`parallel.iter_forked`: every item read once, in pieces from this process and from real
forked workers; a killed worker's pieces read here; a caller that stops early leaves no
worker behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from expr_tracker.stats import parallel

PARENT = os.getpid()


def _square(xs: list[int]) -> list[tuple[int, int, int]]:
    """(x, x squared, the pid that computed it) of each x."""
    return [(x, x * x, os.getpid()) for x in xs]


def _dies_in_a_worker(xs: list[int]) -> list[tuple[int, int, int]]:
    if os.getpid() != PARENT:  # the worker's first piece
        os.kill(os.getpid(), signal.SIGKILL)
    return _square(xs)


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers by fork, whatever threads pytest has, and as if on two cores or more."""
    monkeypatch.setattr(parallel, "_context", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(parallel, "cpus_here", lambda: 2)


def _children() -> set[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as fh:
        return {int(p) for p in fh.read().split()}


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_every_item_once_some_from_a_worker(forked: None, n: int) -> None:
    pieces = list(parallel.iter_forked(_square, list(range(n))))
    positions = [i for piece, _ in pieces for i in piece]
    assert sorted(positions) == list(range(n))
    for piece, results in pieces:
        assert [(x, y) for x, y, _ in results] == [(i, i * i) for i in piece]
    pids = {pid for _, results in pieces for _, _, pid in results}
    # this process and one worker (2 cores), or this process alone for one item
    assert PARENT in pids and len(pids) == min(n, 2)
    # this process's share is the smaller one (it takes in the worker's pieces too)
    mine = sum(len(p) for p, r in pieces if r[0][2] == PARENT)
    assert mine <= n - mine + 1


def test_a_killed_workers_pieces_are_read_here(forked: None) -> None:
    pieces = list(parallel.iter_forked(_dies_in_a_worker, list(range(40))))
    assert sorted(i for piece, _ in pieces for i in piece) == list(range(40))
    # the worker's pieces too (it died at its first): it had more than half of them
    assert {pid for _, results in pieces for _, _, pid in results} == {PARENT}
    assert len(pieces) > parallel.PIECES
    assert not _children()


def test_a_worker_killed_while_it_sends_its_result_does_not_hang_the_read(tmp_path) -> None:
    """A worker killed halfway through writing its result (the Ctrl-C that stops this
    process too, the OOM killer) leaves the pool's reader waiting for the rest of the
    message for ever, and the pool never breaks: its pieces are read here all the same,
    soon, and no worker is left. Half a message written by hand into the worker's real
    result pipe, then a real SIGKILL (a process of its own: before the fix it hung)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, signal, struct, time
        from expr_tracker.stats import parallel
        parallel.cpus_here = lambda: 2
        pools = []
        start = parallel._start_pool
        parallel._start_pool = lambda *a: pools.append(start(*a)) or pools[-1]
        parent = os.getpid()
        def f(xs):
            if os.getpid() != parent:  # the worker's first piece
                fd = pools[-1]._result_queue._writer.fileno()  # this worker's copy of it
                os.write(fd, struct.pack("!i", 1 << 20) + bytes(1000))  # 1 MiB announced
                os.kill(os.getpid(), signal.SIGKILL)
            return [(x, os.getpid()) for x in xs]
        t = time.monotonic()
        out = list(parallel.iter_forked(f, list(range(40))))
        took = time.monotonic() - t
        kids = open(f"/proc/{parent}/task/{parent}/children").read().split()
        here = {pid for _, r in out for _, pid in r} == {parent}
        print(sorted(i for p, _ in out for i in p) == list(range(40)), here, kids, took)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    every, here, kids, took = done.stdout.split(" ", 3)
    assert (every, here, kids) == ("True", "True", "[]"), done.stdout
    assert float(took) < 30, done.stdout  # STUCK (1 s) and the abandon, not a wait for ever


def test_a_caller_that_stops_early_leaves_no_worker(forked: None) -> None:
    it = parallel.iter_forked(_square, list(range(1000)))
    next(it)
    assert _children()
    it.close()
    deadline = time.monotonic() + 10
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children()


def test_one_cpu_reads_everything_here_in_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "cpus_here", lambda: 1)
    ((piece, results),) = parallel.iter_forked(_square, [3, 4])
    assert piece == [0, 1] and results == [(3, 9, PARENT), (4, 16, PARENT)]


def test_no_descriptors_for_a_pool_reads_everything_here(tmp_path) -> None:
    """Under a real descriptor limit the worker pool's pipes cannot be made: every piece
    is read in this process, nothing raises (a process of its own: the limit is its)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, resource
        from expr_tracker.stats import parallel
        parallel.cpus_here = lambda: 2
        def f(xs):
            return [(x, os.getpid()) for x in xs]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        out = list(parallel.iter_forked(f, list(range(10))))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print(sorted(i for p, _ in out for i in p), {pid for _, r in out for _, pid in r}
              == {os.getpid()})
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("]")[0] + "]" == str(list(range(10)))
    assert done.stdout.strip().endswith("True")
