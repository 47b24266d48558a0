"""The direct-mode shard writer: the training thread queues, a writer thread writes (DESIGN 6).

A run root on NFS or FUSE can hang (its server stalls): every call that touches it
blocks until the server answers. In direct mode that must never be the training loop.
`log()` appends whole lines to a bytes-bounded queue and returns; one writer thread
takes the queue about every second (`TICK`, as the background flush did), or as soon as
a flush's worth is queued, and does every shard write, sidecar rewrite and append to the
run's other files (alerts, spans). A full queue drops its oldest rows and counts them
(`root_hung` while a file operation has not returned for HUNG_AFTER s, else `buffer_full`): in
`info()["dropped"]` at once, in the sidecar's `dropped` when the root answers again. Callers that need the rows on disk wait a
bounded time: `flush` until they are written or the root is seen hung, `close` at most
its timeout, after which the rows still in memory are counted (`finish_timeout`) and
the writer goes on writing them if the process lives.

Every public method may be called from any thread: off the writer thread it queues (or
waits, bounded); on the writer thread, and before `start`, it is ShardWriter's own.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from expr_tracker.store.shard import ShardWriter

QUEUE_BYTES = 64 * 1024 * 1024  # rows queued for the writer thread (about 500k rows)
FILE_BYTES = 16 * 1024 * 1024  # queued appends to the run's other files (alerts, spans)
TICK = 1.0  # the writer takes the queue at least this often: kill -9 loses at most a tick
HUNG_AFTER = 2.0  # a call into the run root that has not returned for this long: hung
CLOSE_WAIT = 30.0  # `close`'s default bound, and `flush`'s while the root answers


class QueuedWriter(ShardWriter):
    """A ShardWriter whose file operations run on its own thread (see the module docs)."""

    def __init__(self, *args: Any, session: str = "", queue_bytes: int = QUEUE_BYTES,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.session = session
        self.queue_bytes = queue_bytes
        self._q = bytearray()
        self.queue = self._q.extend  # the hot path's append (whole lines), as ShardWriter's
        # the queue's front is taken (writer thread) or trimmed (a full queue, the training
        # thread) under this lock, never held across a file operation; appends at the end
        # need no lock (bytearray.extend is one operation under the GIL)
        self._take = threading.Lock()
        self._cond = threading.Condition()  # guards the counters below
        self._asked = 0  # wake-ups asked for; `_served`: those the writer has answered
        self._served = 0
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._files: collections.deque[tuple[str, bytes]] = collections.deque()
        self._file_bytes = 0
        self._sidecar_due = False
        self._inflight = 0  # rows taken from the queue and not yet written (or pending)
        self.busy_since: float | None = None  # when the current file operation began
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stopping = False
        self._left = 0  # rows counted `finish_timeout` by a close that timed out
        self._closed = False  # the writer has closed the shard
        self.on_drain: Callable[[], None] | None = None  # (writer thread) after each write
        self.queue_dropped: dict[str, tuple[int, float]] = {}  # cause -> (rows, first drop)
        # the writer thread's warnings are said by the next caller that waits on it: on the
        # main thread a RuntimeWarning, as when the training thread wrote (see `say`)
        self._warn_now = self._warn
        self._warn = self._warn_later
        self._said: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=64)

    # -- the writer thread -----------------------------------------------------
    def start(self) -> None:
        """Start the writer thread: from now on file operations leave the caller's thread."""
        self._thread = threading.Thread(target=self._loop, name="expr-tracker-writer", daemon=True)
        self._thread.start()

    def _here(self) -> bool:
        """True where file operations run inline: the writer thread, or before `start`."""
        return self._thread is None or threading.get_ident() == self._ident

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        while True:
            with self._cond:
                if self._asked == self._served and not self._stopping:
                    self._cond.wait(TICK)
                target = self._asked
            self.busy_since = time.monotonic()
            try:
                self._write_queued()
                if self.on_drain is not None:
                    self.on_drain()
                while self._jobs:
                    self._jobs.popleft()()
                if self._sidecar_due or self.notes_new:  # (a key went non-finite: watchers learn it now)
                    self._sidecar_due = False
                    ShardWriter.write_sidecar(self)
            except BaseException as exc:  # never end the thread: every later row would wait
                self._warn(f"writer:{type(exc).__name__}",
                           f"expr_tracker: shard writer error: {exc!r}")
            finally:
                self.busy_since = None
            with self._cond:
                self._served = target
                self._cond.notify_all()
                if self._stopping and not self._jobs and not self._q and self._asked == target:
                    return

    def _write_queued(self) -> None:
        """Write the queued rows, then the queued lines of the run's other files."""
        with self._take:
            n = len(self._q)
            data = bytes(self._q[:n])
            del self._q[:n]
            self._inflight = data.count(b"\n")
        if data or self._pending:
            with self._io_lock:
                self._flush_locked(data, self._inflight)
        self._inflight = 0
        while self._files:
            name, lines = self._files.popleft()
            self._file_bytes -= len(lines)
            ShardWriter.append_file(self, name, lines)

    def _warn_later(self, cause: str, message: str) -> None:
        if self._thread is not None and self._here():
            self._said.append((time.monotonic(), cause, message))
        else:
            self._warn_now(cause, message)

    def say(self) -> None:
        """Say the writer thread's warnings: all of them on the main thread; elsewhere (the
        background thread logs them) those two ticks old, that the main thread did not say."""
        main = threading.current_thread() is threading.main_thread()
        while self._said and (main or time.monotonic() - self._said[0][0] >= 2 * TICK):
            try:
                _, cause, message = self._said.popleft()
            except IndexError:  # (said by another thread meanwhile)
                return
            self._warn_now(cause, message)

    # `_cond` is taken by `with` only: acquire() then try would leave it taken when a
    # KeyboardInterrupt lands between the two (a signal is handled at the end of a call),
    # and the writer would never take the queue again. Its holders never wait in it (the
    # writer's file operations run outside it), and a signal handler on the thread that
    # holds it takes it again (a Condition's RLock): so no timeout is needed to take it.
    def _ask(self) -> int:
        """Wake the writer; returns the ticket `_wait` waits for."""
        with self._cond:
            self._asked += 1
            self._cond.notify()
            return self._asked

    def _wait(self, ticket: int, timeout: float, *, until_hung: bool = False) -> bool:
        """Wait until the writer answered `ticket`: False after `timeout` s, or (`until_hung`)
        as soon as a file operation has not returned for HUNG_AFTER s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._served < ticket:
                now = time.monotonic()
                if now >= deadline or not self.alive or (until_hung and self.hung(now)):
                    return False
                self._cond.wait(min(deadline - now, 0.1))
            return True

    def hung(self, now: float | None = None) -> bool:
        """True while a file operation has not returned for HUNG_AFTER s."""
        since = self.busy_since
        return since is not None and (now or time.monotonic()) - since >= HUNG_AFTER

    @property
    def alive(self) -> bool:
        """True while the writer thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- the callers' side -----------------------------------------------------
    def append(self, line: bytes) -> None:
        if self._here():
            super().append(line)
            return
        self._q += line
        if len(self._q) >= self.flush_bytes:
            self.flush_nowait()

    def flush_nowait(self) -> None:
        """A flush's worth is queued: wake the writer; drop the oldest rows past the bound."""
        if self._here():
            super().flush_nowait()
            return
        if len(self._q) > self.queue_bytes:
            self._trim()
        if self._asked == self._served:  # (else a wake-up is pending: the slow path's rows
            self._ask()  # would each ask again while a hung writer does not answer)

    def _trim(self) -> None:
        """Drop the oldest whole lines down to 3/4 of the bound (not at every call), counted."""
        with self._take:
            q = self._q
            over = len(q) - self.queue_bytes * 3 // 4
            if over <= 0:
                return
            cut = q.find(b"\n", over - 1) + 1 or len(q)
            rows = q.count(b"\n", 0, cut)
            del q[:cut]  # (from the front of a bytearray: no copy of the rest)
        # the root hangs when a file operation has not returned for HUNG_AFTER s; one that
        # is merely running (a healthy disk writing megabytes) means rows come too fast
        cause = "root_hung" if self.hung() else "buffer_full"
        self.dropped[cause] = self.dropped.get(cause, 0) + rows
        was = self.queue_dropped.get(cause, (0, time.time()))
        self.queue_dropped[cause] = (was[0] + rows, was[1])
        why = ("the run root does not answer" if cause == "root_hung"
               else "rows come faster than the run root takes them")
        self._warn(cause, f"expr_tracker: {why}: shard {self.paths.shard} drops its oldest "
                   f"queued rows past {self.queue_bytes} bytes (counted in "
                   f"info()['dropped']['{cause}']); log() does not wait")

    def buffered(self) -> int:
        return len(self._q) + len(self._buf) + len(self._pending)

    def unwritten(self) -> int:
        """Rows logged and not yet written: queued, being written, or kept after a failure."""
        return self._q.count(b"\n") + self._inflight + self._pending_rows

    def flush(self) -> bool:
        """Off the writer thread: wait until what is queued now is written, or until the root
        is seen hung (False then, and while a failed write is kept for a retry)."""
        if self._here():
            return super().flush()
        done = self._wait(self._ask(), CLOSE_WAIT, until_hung=True)
        self.say()
        return done and not self._pending

    def flush_within(self, timeout: float) -> bool:
        if self._here():
            return super().flush_within(timeout)
        return self._wait(self._ask(), timeout) and not self._pending

    def call(self, fn: Callable[[], Any], default: Any, *, wait: bool = True) -> Any:
        """`fn()` on the writer thread after what is queued now (a read of the run's own
        files): its value, or `default` if the root is seen hung first (or not `wait`)."""
        if self._here():
            return fn()
        box = [default]
        self._jobs.append(lambda: box.__setitem__(0, fn()))
        ticket = self._ask()
        if wait:
            self._wait(ticket, CLOSE_WAIT, until_hung=True)
            self.say()
        return box[0]

    def write_sidecar(self) -> bool:
        """Off the writer thread: rewritten at the writer's next wake-up (True)."""
        if self._here():
            return super().write_sidecar()
        self._sidecar_due = True
        self._ask()
        return True

    def append_file(self, name: str, data: bytes) -> bool:
        """Off the writer thread: queued (False when FILE_BYTES are queued already)."""
        if self._here():
            return super().append_file(name, data)
        if self._file_bytes + len(data) > FILE_BYTES:
            return False
        self._file_bytes += len(data)
        self._files.append((name, data))
        return True

    def sidecar(self) -> dict[str, Any]:
        """ShardWriter's, with the rows this session's queue dropped in `dropped`."""
        if self.queue_dropped:
            host = socket.gethostname()
            notes = [{"cause": cause, "session": self.session, "rows": rows, "since": since,
                      "host": host} for cause, (rows, since) in list(self.queue_dropped.items())]
            causes = {n["cause"] for n in notes}
            self.spool_dropped = [*[d for d in self.spool_dropped if d.get("session") !=
                                    self.session or d.get("cause") not in causes], *notes][-64:]
        return super().sidecar()

    def close(self, status: str = "finished", flush_timeout: float | None = None) -> None:
        """Off the writer thread: the writer closes the shard after what is queued; this
        waits at most `flush_timeout` (CLOSE_WAIT), then counts the rows still in memory
        as `finish_timeout` (warned): lost if the process ends before the root answers,
        written and uncounted if it lives until then."""
        if self._here():
            super().close(status, flush_timeout)
            return
        if self._closed:  # (a finish cut short by an interrupt after the writer closed it)
            return
        timeout = CLOSE_WAIT if flush_timeout is None else flush_timeout
        if not self._stopping:  # (else a close is queued already, cut short by an interrupt:
            self._jobs.append(lambda: self._close_now(status))  # this one waits for it)
            self._stopping = True
        if self._wait(self._ask(), timeout):
            return
        with self._cond:
            if self._closed:
                return
            self._left = self.unwritten()
            if self._left:
                self.dropped["finish_timeout"] = self.dropped.get("finish_timeout", 0) + self._left
        if self._left:
            self._warn("finish_timeout", f"expr_tracker: finish() waited {timeout:g}s for the run "
                       f"root: {self._left} rows of {self.paths.shard} are not written (counted "
                       "in info()['dropped']['finish_timeout']; lost if the process ends first)")

    def _close_now(self, status: str) -> None:
        self._write_queued()  # (queued after the take of the drain that runs this job)
        ShardWriter.flush(self)
        with self._cond:
            if self._left:  # finish gave up on these rows, and here they are written
                left = self.dropped.get("finish_timeout", 0) - self._left
                if left > 0:
                    self.dropped["finish_timeout"] = left
                else:
                    self.dropped.pop("finish_timeout", None)
                self._left = 0
            self._closed = True
        ShardWriter.close(self, status)

    def detach(self) -> None:
        """In a forked child: forget everything queued (the parent writes it) and do nothing
        from now on (the writer thread does not exist here)."""
        self._q.clear()
        self._files.clear()
        self._jobs.clear()
        self._buf.clear()
        self._pending = b""
        self._take = threading.Lock()  # (held by the parent's writer at the fork, perhaps)
        self._cond = threading.Condition()
        self._stopping = True
        self._thread = threading.Thread(target=lambda: None)  # never started: not `alive`
        self._ident = -1
        self.forget_lock()
