"""Scanning many shards in worker processes (`scan.scan_shard` over a share each).

Worker processes are forked, so they start at once with this process's imports (from a
fork server when this process has threads: `_context`); a big run's shards are shared
among them by size. `ScanJob` starts them and returns, so the
caller can read something else (the live state of the run) while they work.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from expr_tracker.stats.scan import ShardScan, scan_all, scan_shard

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_BYTES = 8 << 20  # below this, starting worker processes costs more than it saves
MAX_WORKERS = 4
PIECES = 4  # shares of a ScanJob per worker (its progress counts the shares done)
_IN_PROCESS_PIECE = 1024  # shards a ScanJob without workers scans between two counts
PIECES = 4  # a share of `iter_forked` is read (and sent back) in this many pieces
# this process's share of `iter_forked`, to a worker's: it takes in the workers' results
# too, and the caller does its work on each (RunReader: 20 us a shard, against the read's
# 250; unpickling a tail, 20-30 us)
OWN_SHARE = 0.85
POLL = 0.05  # s: a wait for a worker's result looks at the pool this often (`_result`)
STUCK = 1.0  # s a worker may be dead before a pool that has not noticed is given up


def scan_shards(paths: Sequence[str | os.PathLike[str]], lo: int | None = None,
                expected_bytes: int | None = None) -> list[ShardScan]:
    """`scan_shard` of each path, in order; shared among processes when the shards are big
    (or, reading tails from `lo`, when `expected_bytes` says the tails are)."""
    names = [os.fspath(p) for p in paths]
    sizes = []
    for name in names:
        try:
            sizes.append(os.path.getsize(name))
        except OSError:
            sizes.append(0)  # let the reader raise the error
    cpus = cpus_here()
    workers = min(cpus or 1, MAX_WORKERS, len(names))
    total = sum(sizes) if expected_bytes is None else expected_bytes
    ctx = _context() if workers >= 2 and total >= PARALLEL_BYTES else None
    if ctx is None:
        return scan_all(names, lo)
    from concurrent.futures import BrokenExecutor

    # largest first onto the least loaded share: shares of about equal bytes
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in sorted(range(len(names)), key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        shares[k].append(i)
        loads[k] += sizes[i]
    out: list[ShardScan | None] = [None] * len(names)

    def put(share: list[int], results: list[ShardScan]) -> None:
        for i, result in zip(share, results, strict=True):
            out[i] = result

    try:
        pool = _start_pool(workers - 1, ctx)
        try:
            with _forking():
                futures = [(share, pool.submit(scan_all, [names[i] for i in share], lo))
                           for share in shares[1:]]
            # this process reads the first share itself instead of waiting
            put(shares[0], scan_all([names[i] for i in shares[0]], lo))
            for share, future in futures:
                put(share, _result(pool, future))
            pool.shutdown()
        except BaseException:
            _abandon(pool)
            raise
    except (OSError, BrokenExecutor):  # no fork allowed, a worker killed
        for share in shares:
            if out[share[0]] is None:
                put(share, scan_all([names[i] for i in share], lo))  # a real read error raises here
    return cast("list[ShardScan]", out)


def _worker_start() -> None:
    """A worker dies quietly at Ctrl-C: the terminal signals the whole process group, and
    the parent reports the interrupt once (a worker's own KeyboardInterrupt would print a
    traceback from every worker). SIGINT was held from the fork (`_forking`) until here.
    And a worker dies with its parent: one whose parent was killed (`kill -9`, the OOM
    killer) would otherwise wait for work for ever."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()


def _die_with_parent() -> None:
    """SIGKILL to this process when its parent ends (Linux `PR_SET_PDEATHSIG`)."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the call
        os._exit(1)


@contextmanager
def _forking() -> Iterator[None]:
    """SIGINT held while this thread forks workers (a pool's first `submit`): one that
    came between a fork and the worker's `_worker_start` would raise KeyboardInterrupt in
    the child's after-fork code; held, it waits, and kills the worker once it is started.
    In this process it is delivered as the block ends (the caller's KeyboardInterrupt)."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_pool(workers: int, ctx: Any) -> Any:
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_start)
    _pools.add(pool)
    return pool


_pools: weakref.WeakSet[Any] = weakref.WeakSet()  # pools not yet collected (`stop_children`)


def stop_children() -> None:
    """Stop what this process started to read in parallel: every pool's workers (killed,
    by pid), the fork server and multiprocessing's resource tracker. For a server's exit:
    a SIGTERM during a read stuck in a worker left them, 150 MB, alive for good."""
    import signal
    import threading
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        # killed, not asked: a fork server that does not answer (stopped, or blocked) would
        # hold this exit and every request thread waiting on it; its workers die with it
        # (`_die_with_parent`)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pool in list(_pools):
        _abandon(pool)
    for helper in (server, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)
        if stop is None:
            continue
        # it closes the helper's pipe and waits for it: a second at most
        waiter = threading.Thread(target=_quietly, args=(stop,), daemon=True)
        waiter.start()
        waiter.join(1.0)
        pid = getattr(helper, "_pid", None)
        if waiter.is_alive() and pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _result(pool: Any, future: Any) -> Any:
    """`future.result()` of `pool`, waited for in rounds of `POLL` s; `BrokenExecutor` when
    a worker has been dead for `STUCK` s and the pool has not noticed (then it is
    abandoned). Both guard against a wait for ever:
    - A worker killed while it wrote its result (by the Ctrl-C that interrupts this
      process too, or the OOM killer) leaves the pool's manager thread reading the rest of
      the message for ever, and the result never comes.
    - A Ctrl-C can come and go without waking a wait that has no bound (a clean clone's
      `expr top --once` slept in `future.result()` with its workers dead); a wait with a
      timeout returns to the interpreter, which raises it."""
    from concurrent.futures import BrokenExecutor, TimeoutError

    dead_at: float | None = None
    while True:
        try:
            return future.result(POLL)
        except TimeoutError:
            pass
        procs = getattr(pool, "_processes", None)
        if procs is None:  # shut down, or abandoned by an earlier wait
            raise BrokenExecutor("the worker pool was stopped")
        if dead_at is None:
            if _any_dead(list(procs.values())):
                dead_at = time.monotonic()
        elif time.monotonic() - dead_at >= STUCK:
            _abandon(pool)
            raise BrokenExecutor("a worker died while it sent its result")


def _quietly(call: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):  # not running, or gone already
        call()


def _any_dead(procs: list[Any]) -> bool:
    """Some of `procs` (started `multiprocessing` processes) has ended. Its sentinel says
    so without reaping it, which the pool's own manager thread does."""
    from multiprocessing.connection import wait

    return bool(procs) and bool(wait([p.sentinel for p in procs], timeout=0))


def _abandon(pool: Any) -> None:
    """Stop a pool at once (Ctrl-C in this process): its workers killed, its manager thread
    freed. A worker killed in the middle of writing its result leaves the manager thread
    reading the rest of the message for ever, so waiting for the pool (and the
    interpreter's exit, which joins that thread) would hang: with the workers dead and
    this process's own end of their result pipe closed, the read ends, and the thread
    with it."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
            proc.join()
        except (OSError, ValueError, AssertionError):  # already reaped
            pass
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    if manager is not None:
        # ended before this process exits: the exit's wake-up of a manager thread closing
        # its pipe at that moment fails (EBADF, "Exception ignored" on stderr; Python 3.11)
        manager.join(5.0)


def cpus_here() -> int | None:
    """The CPUs this process may run on (None if unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def can_fork() -> bool:
    """Worker processes by fork: they start at once with this process's imports, where
    a fresh interpreter would import them again (and run the caller's `__main__`). Fork is
    safe on Linux while this process has a single thread; with more (`expr serve`'s
    request threads) the workers come from a fork server (`_context`)."""
    import sys
    import threading

    return sys.platform == "linux" and threading.active_count() == 1


# what a fork server's workers run: imported once in the server, not in every worker
_PRELOAD = ["expr_tracker.health.tail", "expr_tracker.stats.scan", "expr_tracker.stats.parallel"]
_fork_server = False


def use_fork_server() -> None:
    """Let this process, once it has threads, fork its workers from a fork server (and
    start that now, while it has none). For a long-lived process with threads whose main
    module imports without side effects (`expr serve`: a fork server's workers import it
    again, and a script without an `if __name__ == "__main__"` guard would run again)."""
    global _fork_server
    import multiprocessing
    import sys

    if sys.platform != "linux":
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()
    _fork_server = True


def _context() -> Any:
    """The multiprocessing context of the workers, None for none (this process alone).

    Fork while this process has one thread. A process with threads (a web server's request
    threads) must not fork (a lock another thread held at the fork stays held in the child
    for ever): with `use_fork_server` its workers are forked from a fork server, a fresh
    single-threaded process with this package preloaded, started once (about a third of a
    second) and alive as long as this one; else there are none. Without workers a
    16,384-rank page is built on one core of two.
    """
    import multiprocessing

    if can_fork():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver") if _fork_server and _idle_core() else None


def _idle_core() -> bool:
    """Some core is idle now: half a core or more of idle time over the last tenth of a
    second (`/proc/stat`), else, where that cannot be read, a 1-minute load average half
    a core under the cores. On a busy machine a fork server's workers got a long-lived
    server no more CPU, and cost their pickling: a 16,384-rank page built in workers took
    15 s of CPU and 22 s where one process took 12 s of each (bench/HISTORY.md, issue 19).
    The load average alone lags by a minute: a server asked for its first page right after
    other work read in one process on an idle machine (the first render took twice the
    CLI's `expr summary` of the same run)."""
    import time

    cpus = cpus_here()
    first = _cpu_times()
    if first is not None:
        time.sleep(0.1)
        second = _cpu_times()
        if second is not None and second[1] > first[1]:
            idle = (second[0] - first[0]) / (second[1] - first[1])  # of all the machine's CPUs
            return idle * (os.cpu_count() or 1) >= 0.5
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load <= (cpus or 1) - 0.5


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) clock ticks of every CPU since boot, from /proc/stat (Linux)."""
    try:
        with open("/proc/stat", "rb") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if fields[:1] != [b"cpu"] or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[3] + ticks[4], sum(ticks)


def iter_forked(fn: Callable[[list[T]], list[R]], items: Sequence[T],
                max_workers: int = MAX_WORKERS) -> Iterator[tuple[list[int], list[R]]]:
    """`fn` over pieces of `items` (interleaved: neighbouring items cost about the same),
    some in this process and the rest in forked worker processes at the same time, each
    piece given as it is done: (its positions in `items`, `fn` of those, one result per
    item, in order). In this process alone (one piece) when there is one CPU or fork is
    not safe, and for the pieces of a worker that failed.

    This process takes in the workers' pieces between its own, so the caller's work on
    each (`RunReader` building the state of a rank) is done while the workers read; it
    takes a smaller share (`OWN_SHARE`) for that, and for unpickling their results."""
    cpus = cpus_here()
    workers = min(cpus or 1, max_workers, len(items))
    ctx = _context() if workers >= 2 else None
    if ctx is None:
        yield list(range(len(items))), fn(list(items))
        return
    from concurrent.futures import BrokenExecutor

    mine, theirs = _shares(len(items), workers)
    pieces = [piece for share in theirs for piece in _pieces(share, PIECES)]
    pending: list[tuple[list[int], Any]] = []
    failed: list[list[int]] = []  # pieces of a worker that failed: read here at the end
    pool: Any = None
    try:
        try:
            pool = _start_pool(workers - 1, ctx)
            with _forking():
                pending = [(piece, pool.submit(fn, [items[i] for i in piece]))
                           for piece in pieces]
        except (OSError, BrokenExecutor):  # no fork allowed, no descriptors for the pipes
            if pool is not None:
                _abandon(pool)
            pool, pending, failed = None, [], pieces
        for piece in _pieces(mine, PIECES):
            yield piece, fn([items[i] for i in piece])
            for got in [p for p in pending if p[1].done()]:
                pending.remove(got)
                yield from _taken(pool, got, failed)
        while pending:
            yield from _taken(pool, pending.pop(0), failed)
        if pool is not None:
            pool.shutdown()
    except BaseException:  # Ctrl-C, an error in `fn`, a caller that stopped iterating
        if pool is not None:
            _abandon(pool)
        raise
    for piece in failed:
        yield piece, fn([items[i] for i in piece])


def map_forked(fn: Callable[[list[T]], list[R]], items: Sequence[T],
               max_workers: int = MAX_WORKERS) -> list[R]:
    """`fn` over `items` as `iter_forked` shares it out, the results in `items`' order."""
    out: list[Any] = [None] * len(items)
    for where, done in iter_forked(fn, items, max_workers):
        for i, result in zip(where, done, strict=True):
            out[i] = result
    return out


def _taken(pool: Any, sent: tuple[list[int], Any], failed: list[list[int]]) -> Iterator[
        tuple[list[int], Any]]:
    """A worker's piece as `iter_forked` gives it; none, and the piece put in `failed`, if
    its worker failed (killed: the pool is broken, and so its other pieces too)."""
    from concurrent.futures import BrokenExecutor

    piece, future = sent
    try:
        results = _result(pool, future)
    except (OSError, BrokenExecutor):
        failed.append(piece)
        return
    yield piece, results


def _shares(n: int, workers: int) -> tuple[list[int], list[list[int]]]:
    """Positions 0..n-1 shared among this process (`OWN_SHARE` of a worker's) and
    `workers - 1` workers, interleaved."""
    own = OWN_SHARE / (OWN_SHARE + workers - 1)
    mine: list[int] = []
    rest: list[int] = []
    for i in range(n):
        (mine if math.floor(i * own) > math.floor((i - 1) * own) else rest).append(i)
    return mine, [rest[k::workers - 1] for k in range(workers - 1)]


def _pieces(share: list[int], n: int) -> list[list[int]]:
    """`share` in at most `n` pieces of about equal length, in order."""
    n = max(1, min(n, len(share)))
    return [share[j * len(share) // n:(j + 1) * len(share) // n] for j in range(n)]


class ScanJob:
    """`scan_shard` of each path (`lo`, `recent` as there) started at once in worker
    processes, so the caller can read other things meanwhile; `result()` waits. Runs in
    this process, at `result()`, when the shards are few or fork is not safe."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], lo: int | None = None,
                 recent: int | None = None, expected_bytes: int = 0) -> None:
        self.names = [os.fspath(p) for p in paths]
        self.lo, self.recent = lo, recent
        self._pool: Any = None
        self._futures: list[tuple[list[int], Any]] = []
        self._done = 0  # shards scanned in this process so far
        cpus = cpus_here()
        workers = min(cpus or 1, MAX_WORKERS, len(self.names))
        ctx = _context() if workers >= 2 and expected_bytes >= PARALLEL_BYTES else None
        if ctx is None:
            return
        try:
            self._pool = _start_pool(workers, ctx)
            with _forking():
                # interleaved shares: neighbouring ranks (similar sizes) over the workers,
                # a few per worker so that `progress` can tell a page how far it is
                pieces = min(len(self.names), workers * PIECES)
                for k in range(pieces):
                    share = list(range(k, len(self.names), pieces))
                    names = [self.names[i] for i in share]
                    self._futures.append((share, self._pool.submit(scan_all, names, lo, recent)))
        except OSError:
            self._pool, self._futures = None, []
        except BaseException:
            self.abandon()
            raise

    @property
    def parallel(self) -> bool:
        """Whether worker processes scan (else `result` does, in this process)."""
        return self._pool is not None

    def progress(self) -> tuple[int, int]:
        """(shards scanned so far, shards): the shares done (0 until `result` when the job
        runs in this process)."""
        done = sum(len(share) for share, future in self._futures if future.done())
        return done + self._done, len(self.names)

    def close(self) -> None:
        """Drop a job whose result nobody will ask for: its workers stop."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._futures = None, []

    def abandon(self) -> None:
        """Stop the workers now (the caller was interrupted): `_abandon`."""
        if self._pool is not None:
            _abandon(self._pool)
            self._pool, self._futures = None, []

    def result(self) -> list[ShardScan]:
        """The scans, in the order of the paths."""
        from concurrent.futures import BrokenExecutor

        if self._pool is None:  # (in pieces, counted: `progress`)
            scans: list[ShardScan] = []
            for i in range(0, len(self.names), _IN_PROCESS_PIECE):
                scans.extend(scan_all(self.names[i:i + _IN_PROCESS_PIECE], self.lo, self.recent))
                self._done = len(scans)
            return scans
        out: list[ShardScan | None] = [None] * len(self.names)
        try:
            try:
                for share, future in self._futures:
                    for i, result in zip(share, _result(self._pool, future), strict=True):
                        out[i] = result
            except (OSError, BrokenExecutor):  # a worker killed: read the rest here
                pass
            self._pool.shutdown()
        except BaseException:
            self.abandon()
            raise
        for i, sc in enumerate(out):
            if sc is None:
                out[i] = scan_shard(self.names[i], self.lo, self.recent)
        return cast("list[ShardScan]", out)
