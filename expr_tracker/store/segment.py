"""The spool's segment files (DESIGN 6, turn 4): memory-mapped, bounded, rolled at a size.

A session's spool is a chain of segments `{stem}.{session}.jsonl`, `{stem}.{session}~1.jsonl`,
... Each is created at its full size with its blocks allocated (`posix_fallocate`: a write
into the mapping can never meet a full disk, which would be SIGBUS), mapped, and written
with `mmap.write`: a row is in the kernel's page cache when `log()` returns, so a
`kill -9` (the OOM killer) loses nothing. A reader stops at the first NUL byte: a JSON
line never holds one, and the rest of a segment is zeros until written.

The last `reserve` bytes of a segment are not for rows: the roll marker, a note of
dropped rows and the finish event go there, so a full disk never keeps a finished run
from saying so. At the size bound the writer opens the next segment (its first line the
init event again, so it can be applied alone), writes a `segment` marker at the end of the
full one and cuts it to its length; exprd deletes a segment once everything consumed it.
When no segment can be opened (a full disk), lines wait in memory up to `max_buffer`
bytes and go out as space returns; rows past that are dropped, counted, and a `dropped`
note (cause, rows, since, host) tells exprd, which puts it in the shard's sidecar.

Everything here runs under the run's lock (the hot path's `mm.write` included): the
writer is not thread-safe on its own.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

SEGMENT_BYTES = 4 << 20  # a segment's size (EXPR_SPOOL_SEGMENT_BYTES)
BUFFER_BYTES = 64 << 20  # lines kept in memory while no segment can be opened
MIN_SEGMENT = 4096
_RETRY = 0.5  # seconds between attempts to open a segment while lines wait in memory

Warn = Callable[[str, str], None]


def reserve_for(size: int) -> int:
    """Bytes at the end of a segment of `size` kept for the marker, notes and finish."""
    return max(1024, min(64 << 10, size // 4))


def _cause(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


class Segments:
    """The segment chain of one spool session.

    `path_of(index)` names segment `index`; `head(index, first_seq)` is its first line (the
    init event, saying which `_seq` the segment's events start at). `fast_append` is the
    open segment's `mmap.write` while nothing waits in memory (else None): the hot path
    writes a row with one C call, which raises ValueError when the row does not fit, and
    then calls `overflow`. `on_switch()` runs whenever `fast_append` changes.
    """

    flush_bytes = 1 << 62  # Run.log's check of a buffer to flush: never (rows are in the kernel)

    def __init__(self, path_of: Callable[[int], Path], head: Callable[[int, int], bytes], *,
                 size: int = SEGMENT_BYTES, max_buffer: int = BUFFER_BYTES,
                 warn: Warn, dropped: dict[str, int]) -> None:
        self.path_of = path_of
        self.head = head
        self.size = max(MIN_SEGMENT, size)
        self.reserve = reserve_for(self.size)
        self.limit = self.size - self.reserve  # rows end here (in the open segment)
        self.seg_size = self.size  # the open segment's size (larger for a huge line)
        self.max_buffer = max_buffer
        self.warn = warn
        self.dropped = dropped
        self.index = -1  # the open (or last) segment's
        self.path: Path = path_of(0)
        self.fd: int | None = None
        self.mm: mmap.mmap | None = None
        self.fast_append: Callable[[bytes], int] | None = None
        self.on_switch: Callable[[], None] = lambda: None
        # the segment was moved away: the sink starts a new session and numbers these lines
        # (what waits to be written) in it
        self.new_session: Callable[[list[bytes]], list[bytes]] = lambda lines: lines
        self._tail = 0  # end of what was written into the reserve (0: nothing)
        self._good = 0  # the end of the data as of the last check that the path is ours
        self.memory: list[bytes] = []  # lines waiting for a segment, in order
        self.memory_bytes = 0
        self.drops = 0  # rows dropped because the spool was full
        self.drops_since: float | None = None
        self._noted = 0  # drops a note in the spool already counts
        self._next_try = 0.0
        self.errors: dict[str, int] = {}
        self.rolled = 0  # segments closed and handed over
        self.closed = False

    # -- where we are -----------------------------------------------------------------
    def end(self) -> int:
        """The end of the data in the open segment."""
        if self.mm is None:
            return 0
        return max(self.mm.tell(), self._tail)

    def data(self) -> bytes:
        """The open segment's data (the summary at finish reads it)."""
        return self.mm[: min(self.end(), self.limit)] if self.mm is not None else b""

    def buffered(self) -> int:
        return self.memory_bytes

    def flush_nowait(self) -> None:
        """Nothing to do: rows are in the kernel once written (Run.log's hook)."""

    def _publish(self) -> None:
        """The hot path writes into the open segment only while nothing waits in memory
        (rows keep their order)."""
        new = self.mm.write if self.mm is not None and not self.memory else None
        if new != self.fast_append:
            self.fast_append = new
            self.on_switch()

    # -- opening and rolling ------------------------------------------------------------
    def open_first(self) -> bool:
        return self._open(0, 1)

    def _open(self, index: int, first_seq: int, need: int = 0) -> bool:
        """Create segment `index` at full size (larger if a line of `need` bytes would not
        fit), map it, write its head: True if it is open (the previous one, if any, is
        then closed with a marker)."""
        path = self.path_of(index)
        head = self.head(index, first_seq)
        size = self.size
        if len(head) + need > size - self.reserve:
            size = len(head) + need + self.reserve
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            _allocate(fd, size)  # the blocks exist: no SIGBUS on a full disk
            mm = mmap.mmap(fd, size - self.reserve, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
            mm.write(head)
        except (OSError, ValueError) as exc:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._failed("open", exc if isinstance(exc, OSError) else OSError(str(exc)), path)
            return False
        if self.mm is not None:
            self._close_current(_note_line({"_event": "segment", "_seq": 0,
                                            "_time": time.time(), "next": path.name}))
        self.index, self.path, self.fd, self.mm = index, path, fd, mm
        self.limit, self.seg_size = size - self.reserve, size
        self._tail = 0
        self._good = mm.tell()
        self._publish()
        return True

    def _close_current(self, last: bytes) -> None:
        """Write `last` (a marker or the finish) and cut the segment to its data."""
        assert self.mm is not None and self.fd is not None
        end = self._put_reserved(last)
        with contextlib.suppress(OSError, ValueError):
            self.mm.close()
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, end)  # the unused blocks go back to the disk
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.mm, self.fd = None, None
        self.rolled += 1
        self._publish()

    def _put_reserved(self, line: bytes) -> int:
        """Write `line` after the data (into the reserve if the rows reached it: no more
        rows go into this segment then). Returns the new end of the data."""
        assert self.mm is not None and self.fd is not None
        start = self.end()
        if start + len(line) <= self.limit:
            self.mm.write(line)
            return start + len(line)
        if start + len(line) > self.seg_size:
            return start  # never half a line (callers make it fit)
        os.pwrite(self.fd, line, start)
        self._tail = start + len(line)
        self.mm.seek(self.limit)  # the rows' part is over: mm.write raises from now on
        return self._tail

    def _failed(self, op: str, exc: OSError, path: Path) -> None:
        cause = _cause(exc)
        self.errors[f"{op}:{cause}"] = self.errors.get(f"{op}:{cause}", 0) + 1
        self.warn(f"spool:{cause}", f"expr_tracker: cannot {op} spool segment {path}: "
                  f"{exc.strerror or exc}; lines wait in memory (up to {self.max_buffer} "
                  "bytes) until exprd frees space; rows past that are dropped and counted in "
                  "info()['dropped']['spool_full']")

    # -- writing ------------------------------------------------------------------------
    def overflow(self, line: bytes, record: bool = True) -> bool:
        """A line the hot path's `fast_append` could not take: into this or the next
        segment, else into memory; False if it was dropped (a record past the bound)."""
        if not self.memory:
            if self.mm is not None and self.end() + len(line) <= self.limit:
                self.mm.write(line)
                return True
            if self._open(self.index + 1, _seq_of(line), len(line)) \
                    and len(line) <= self.limit - self.end():
                assert self.mm is not None
                self.mm.write(line)
                return True
            self._next_try = time.monotonic() + _RETRY
        if record and self.memory_bytes + len(line) > self.max_buffer:
            self._drop()
            return False
        self.memory.append(line)
        self.memory_bytes += len(line)
        self._publish()
        return True

    def _drop(self) -> None:
        if self.drops_since is None:
            self.drops_since = time.time()
        self.drops += 1
        self.dropped["spool_full"] = self.dropped.get("spool_full", 0) + 1
        self.warn("spool_full", f"expr_tracker: the spool is full and {self.max_buffer} bytes "
                  "of rows wait in memory: rows are dropped from now on, counted in "
                  "info()['dropped']['spool_full'] and in the shard's sidecar")
        if self._noted == 0:
            self._note()  # readers learn now, from the space kept for it

    def _note(self) -> None:
        """A `dropped` note (the count so far) after the data, in the reserve if need be."""
        if self.mm is None or self.drops == self._noted:
            return
        note = _note_line({"_event": "dropped", "_seq": 0, "_time": time.time(),
                           "cause": "spool_full", "rows": self.drops, "since": self.drops_since,
                           "host": socket.gethostname()})
        if self.end() + len(note) <= self.seg_size - 1024:  # the marker and the finish still fit
            self._put_reserved(note)
            self._noted = self.drops

    def drain(self) -> bool:
        """Write what waits in memory into segments as they can be opened; True if nothing
        waits any more."""
        if not self.memory:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        while self.memory:
            line = self.memory[0]
            if self.mm is None or self.end() + len(line) > self.limit:
                if not self._open(self.index + 1, _seq_of(line), len(line)):
                    self._next_try = now + _RETRY
                    return False
                continue
            self.mm.write(line)
            self.memory.pop(0)
            self.memory_bytes -= len(line)
        self._note()
        self._publish()
        return True

    def tick(self) -> None:
        """About once a second: lines in memory go out, a moved or deleted segment is left
        for a new one, and exprd is woken up."""
        self.drain()
        if self.mm is None or self.fd is None:
            return
        if not self._is_current():
            self._moved()
            return
        end = self.end()
        if end != self._good:
            self._good = end
            with contextlib.suppress(OSError):
                # mmap writes move no mtime and wake no inotify watch: exprd is told here
                os.utime(self.fd)

    def _is_current(self) -> bool:
        """Is the open segment still the file at its path? (logrotate moves files away.)"""
        assert self.fd is not None
        try:
            at = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: write on where we are
        mine = os.fstat(self.fd)
        return (at.st_ino, at.st_dev) == (mine.st_ino, mine.st_dev)

    def _moved(self) -> None:
        """The segment was moved or deleted under us: what was written since the last check
        goes on in a new session (exprd follows names); the moved file keeps what it had."""
        assert self.mm is not None and self.fd is not None
        good, end = self._good, self.end()
        since = self.mm[good:min(end, self.limit)] if end > good else b""
        self.warn("spool_deleted", f"expr_tracker: spool file {self.path} was deleted or moved "
                  "while in use; going on in a new segment (if it was deleted, rows exprd had "
                  "not read from it yet are lost)")
        mm, fd = self.mm, self.fd
        self.mm = self.fd = None
        self._tail = 0
        with contextlib.suppress(OSError, ValueError):
            mm.close()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, good)
        with contextlib.suppress(OSError):
            os.close(fd)
        if since:
            self.memory.insert(0, since)
        # a new session: a copy of the moved file may come back and be applied after what
        # follows, which one session's seqs could not tell apart from a repeat
        self.memory = self.new_session(self.memory)
        self.memory_bytes = sum(map(len, self.memory))
        self.index = -1
        self._next_try = 0.0
        self._publish()
        self.drain()

    def check(self) -> None:
        """`et.flush()`: the same checks as `tick`, now."""
        self._next_try = 0.0
        self.tick()

    # -- the end ------------------------------------------------------------------------
    def finish(self, line: bytes, wait: float) -> None:
        """Write the finish event `line`: what waits in memory first (for up to `wait` s
        while exprd frees space; what still waits then is dropped and counted), then
        the finish, into the space kept for it."""
        if self.mm is not None and self.fd is not None and not self._is_current():
            self._moved()
        deadline = time.monotonic() + wait
        while not self.drain() and time.monotonic() < deadline:
            time.sleep(0.05)
            self._next_try = 0.0
        if self.memory:
            lost = sum(m.count(b"\n") for m in self.memory if not m.startswith(b'{"_event"'))
            self.memory.clear()
            self.memory_bytes = 0
            for _ in range(lost):
                self._drop()
        if self.mm is None and not self._open(self.index + 1, _seq_of(line)):
            self.warn("spool_finish", "expr_tracker: no spool segment could be opened for the "
                      "finish event: exprd will read this run as crashed")
            self.closed = True
            return
        self._note()
        if self.end() + len(line) > self.seg_size:
            # a summary too large for what is left: the finish goes without it, in a segment
            # of its own if it still does not fit
            ev = orjson.loads(line)
            ev.pop("summary", None)
            line = orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)
            if self.end() + len(line) > self.seg_size:
                self._open(self.index + 1, _seq_of(line), len(line))
        self._close_current(line)
        self.closed = True

    def close(self, status: str = "crashed", flush_timeout: float | None = None) -> None:
        """SIGTERM (Run._terminate): nothing to flush, the rows are in the kernel; the
        process is about to die and exprd reads the segment as its writer left it."""

    def crash_close(self) -> None:
        """A forked child: unmap without writing anything."""
        if self.mm is not None:
            with contextlib.suppress(OSError, ValueError):
                self.mm.close()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.mm = self.fd = None
        self.fast_append = None
        self.memory.clear()

    def info(self) -> dict[str, Any]:
        return {"segment": self.index, "segment_bytes": self.size,
                "segments_rolled": self.rolled}


def _allocate(fd: int, size: int) -> None:
    """Give the file `size` bytes of real blocks (ENOSPC now, not SIGBUS later). Where the
    filesystem has no fallocate, zeros are written (the blocks are then allocated too)."""
    fallocate = getattr(os, "posix_fallocate", None)  # (not on macOS)
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                raise
    zeros = bytes(min(size, 1 << 20))
    for pos in range(0, size, len(zeros)):
        n = min(len(zeros), size - pos)
        if os.pwrite(fd, zeros[:n], pos) != n:
            raise OSError(errno.ENOSPC, "short write")


def _note_line(ev: dict[str, Any]) -> bytes:
    return orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)


def _seq_of(data: bytes) -> int:
    """The `_seq` of the first line of `data` (the events a new segment starts with)."""
    m = _SEQ.search(data, 0, data.find(b"\n") + 1 or len(data))
    return int(m.group(1)) if m else 0


_SEQ = re.compile(rb'[{,]"_seq":(\d+)')
