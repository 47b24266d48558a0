"""exprd's durable writes on a thread of their own: the main loop never waits for a disk.

Checkpoints, sidecars, status.json and the heartbeat are each replaced atomically (temp
file, fsync, rename). An fsync takes up to 160 ms on a busy disk, and the events that
arrive meanwhile waited for it: that was the append -> shard p99. Now the loop builds a
file's bytes (a snapshot of what is already flushed) and hands them here; one thread
writes them, in the order they came.

Order is what keeps exactly-once: a checkpoint must never reach the disk before a
sidecar it relies on (a config event the checkpoint covers is in the sidecar). Jobs run
first in, first out; a job for a file that is still queued (not started) takes the newer
bytes in its place, ahead of whatever was queued after it. That is safe for files that
only ever describe flushed state (sidecars, status, heartbeat): a newer one is as right
as the old one at any point. A checkpoint is never replaced: `state.Checkpoints` submits
the next one only once the last is done.

What happened comes back to the main thread (`collect`, `wait`), which runs each job's
callback there: failures are reported and "on disk" is counted by the daemon's own
code, single-threaded as before. Nothing here touches the daemon's state.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger("exprd")
Write = Callable[[], None]
Done = Callable[[BaseException | None], None]


class Durable:
    """One writer thread with a queue of atomic file replacements, keyed by file."""

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        self.wake = wake  # called (on the writer thread) after each job: the loop collects
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, tuple[Write, Done]] = OrderedDict()
        self._running: str | None = None
        self._done: list[tuple[str, Done, BaseException | None]] = []
        self._outstanding: dict[str, int] = {}  # key -> jobs whose callback has not run
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, key: str, write: Write, done: Done) -> None:
        """Run `write()` on the writer thread, then `done(error or None)` at the next
        `collect` on the main thread. A queued job of the same `key` is replaced (its
        callback never runs: the newer job's stands for it)."""
        with self._cond:
            if key not in self._queue:
                self._outstanding[key] = self._outstanding.get(key, 0) + 1
            self._queue[key] = (write, done)  # an existing key keeps its place
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="exprd-durable",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self, key: str) -> bool:
        """True while a job of `key` is queued, running, or done without its callback run."""
        return self._outstanding.get(key, 0) > 0

    def busy(self) -> bool:
        return bool(self._outstanding)

    def collect(self) -> None:
        """Run the callbacks of the jobs done since the last call (main thread)."""
        with self._cond:
            done, self._done = self._done, []
        for key, callback, exc in done:
            n = self._outstanding.get(key, 0) - 1
            if n > 0:
                self._outstanding[key] = n
            else:
                self._outstanding.pop(key, None)
            callback(exc)

    def wait(self, key: str | None = None, timeout: float | None = None) -> bool:
        """Block until the jobs of `key` (or all jobs) are done, then collect; False if
        `timeout` ran out first."""
        with self._cond:
            ok = self._cond.wait_for(lambda: not self._busy(key), timeout)
        self.collect()
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the thread."""
        self.wait(timeout=timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._stop = False

    def _busy(self, key: str | None) -> bool:
        if key is None:
            return bool(self._queue) or self._running is not None
        return key in self._queue or self._running == key

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                key, (write, done) = self._queue.popitem(last=False)
                self._running = key
            exc: BaseException | None = None
            try:
                write()
            except Exception as err:  # reported by the callback, on the main thread
                exc = err
                if not isinstance(err, OSError):
                    log.exception("writing %s failed", key)
            with self._cond:
                self._running = None
                self._done.append((key, done, exc))
                self._cond.notify_all()
            if self.wake is not None:
                self.wake()

