"""The spool's segment files (DESIGN 6, turns 4 and 5): appended row by row, sized to
their disk, rolled at a size.

A session's spool is a chain of segments `{stem}.{session}.jsonl`, `{stem}.{session}~1.jsonl`,
... Each row is one `os.write` to an `O_APPEND` descriptor: it is in the kernel when
`log()` returns, so a `kill -9` (the OOM killer) loses nothing, and nothing another
process does to the file (`: > file`, `truncate`, logrotate's copytruncate, `mv`) can
fault the writer, as a memory mapping of a file that shrinks does (SIGBUS). A segment
only ever holds whole lines: no zeros, no partial line left by a short write.

Sizes follow the disk (`plan_size`): the first segment is small, the next twice the last
while they fill fast, up to the bound, and never more than a fair share of the free space.
Blocks are reserved ahead of the data with `fallocate(FALLOC_FL_KEEP_SIZE)` (the file's
size is its data; readers see no zeros), and the last `reserve` bytes reserved are not for
rows: the roll marker, a note of dropped rows and the finish event go there, so a full
disk never keeps a finished run from saying so. Where the disk has less than a segment,
rows still go out, a page reserved at a time; when nothing can be reserved, lines wait in
memory up to `max_buffer` bytes and go out as space returns; rows past that are dropped,
counted, and a `dropped` note (cause, rows, since, host) tells exprd, which puts it in the
shard's sidecar. Unused reserved blocks go back to the disk when a segment is closed.

Everything here runs under the run's lock (the hot path's `append` included): the writer
is not thread-safe on its own.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store.diskroom import (
    MAX_SEGMENT,
    MIN_SEGMENT,
    SEGMENT_BYTES,
    fallocate,
    free_bytes,
    pages,
    plan_size,
    reserve_for,
)
from expr_tracker.store.safedir import make_private_dirs

BUFFER_BYTES = 64 << 20  # lines kept in memory while no segment can take them
MAX_BUFFER = 1 << 30  # the largest memory bound accepted
_RETRY = 0.5  # seconds between attempts to open a segment while the disk is full

Warn = Callable[[str, str], None]


def _cause(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


class Segments:
    """The segment chain of one spool session.

    `path_of(index)` names segment `index`; `head(index, first_seq)` is its first line (the
    init event, saying which `_seq` the segment's events start at). `fast_append` is
    `os.write` bound to the open segment's descriptor while nothing waits in memory (else
    None): Run.log's hot path checks the room (`end`, `limit`) and the count written
    itself, because a Python function call between it and the write costs more than
    everything it would do (docs/spool.md), and hands a row that was not written whole to
    `unwritten`, then to `overflow`. `append` is the same with its checks, for the other
    events. `on_switch()` runs whenever `fast_append` changes.
    """

    flush_bytes = 1 << 62  # Run.log's check of a buffer to flush: never (rows are in the kernel)

    def __init__(self, path_of: Callable[[int], Path], head: Callable[[int, int], bytes], *,
                 size: int = SEGMENT_BYTES, max_buffer: int = BUFFER_BYTES,
                 warn: Warn, dropped: dict[str, int]) -> None:
        self.path_of = path_of
        self.head = head
        self.size = min(MAX_SEGMENT, max(MIN_SEGMENT, size))  # the bound
        self.max_buffer = max_buffer
        self.warn = warn
        self.dropped = dropped
        self.index = -1  # the open (or last) segment's
        self.path: Path = path_of(0)
        self.fd: int | None = None
        self.cap = 0  # the open segment's planned size (larger for a huge line)
        self.sealed = False  # no more rows in the open segment (a note took its reserve)
        self.cut = False  # the open segment was truncated by another process
        self.reserve = 0  # the open segment's space kept for the marker, notes and finish
        self.held: int | None = None  # bytes reserved on disk from its start (None: cannot)
        self.end = 0  # bytes written into it (its size, unless another process cut it)
        self.limit = 0  # rows end here: min(cap, held) - reserve
        self.opened = 0.0  # when (monotonic), for the rate the next size follows
        self.fast_append: Callable[[bytes], int] | None = None
        self._fast_fd: int | None = None  # the descriptor `fast_append` writes to
        self.on_switch: Callable[[], None] = lambda: None
        # the segment was moved away: the sink starts a new session and numbers these lines
        # (what waits to be written) in it
        self.new_session: Callable[[list[bytes]], list[bytes]] = lambda lines: lines
        self._good = 0  # the end of the data as of the last check that the path is ours
        self.memory: list[bytes] = []  # lines waiting for a segment, in order
        self.memory_bytes = 0
        self.drops = 0  # rows dropped because the spool was full
        self.drops_since: float | None = None
        self.notes: dict[str, tuple[int, float]] = {}  # cause: (rows so far, since)
        self._noted: dict[str, int] = {}  # cause: rows a note in the spool already counts
        self.first_seq = 1  # the open segment's first event
        self.next_seq: Callable[[], int] = lambda: 0  # the sink's next event number
        self._next_try = 0.0
        self.errors: dict[str, int] = {}
        self.rolled = 0  # segments closed and handed over
        self.closed = False

    # -- where we are -----------------------------------------------------------------
    def data(self) -> bytes:
        """The open segment's data (the summary at finish reads it)."""
        if self.fd is None:
            return b""
        try:
            return os.pread(self.fd, self.end, 0)
        except OSError:
            return b""

    def buffered(self) -> int:
        return self.memory_bytes

    def flush_nowait(self) -> None:
        """Nothing to do: rows are in the kernel once written (Run.log's hook)."""

    def _publish(self) -> None:
        """The hot path writes into the open segment only while nothing waits in memory
        (rows keep their order)."""
        fd = self.fd if not self.memory else None
        if fd != self._fast_fd:
            self._fast_fd = fd
            self.fast_append = None if fd is None else functools.partial(os.write, fd)
            self.on_switch()

    # -- the hot path -------------------------------------------------------------------
    def append(self, line: bytes) -> None:
        """Write one event into the open segment (under the run's lock; Run.log's hot path
        does the same inline); ValueError if it was not written: the caller hands it to
        `overflow`."""
        end = self.end + len(line)
        if end <= self.limit:
            try:
                n = os.write(self.fd, line)  # type: ignore[arg-type]  # (open: published)
            except OSError as exc:
                self.unwritten(exc)
                raise ValueError("spool write failed") from None
            if n == len(line):
                self.end = end
                return
            self.unwritten(n)
        raise ValueError("the open segment is full")

    def unwritten(self, got: int | OSError) -> None:
        """A row's write into the open segment failed (`got` its error) or was cut short
        (`got` bytes of it written: they are taken back)."""
        if isinstance(got, OSError):
            self._failed("write", got, self.path)
        else:
            self._cut(got)

    def _write(self, line: bytes) -> bool:
        """Write `line` whole at the end of the open segment (no room check)."""
        assert self.fd is not None
        try:
            n = os.write(self.fd, line)
        except OSError as exc:
            self._failed("write", exc, self.path)
            return False
        if n == len(line):
            self.end += n
            return True
        self._cut(n)
        return False

    def _cut(self, n: int) -> None:
        """A short write (the disk filled mid-line): the `n` bytes of it are taken back, so
        the next line does not run on from half a line."""
        assert self.fd is not None
        self._failed("write", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), self.path)
        with contextlib.suppress(OSError):
            size = os.fstat(self.fd).st_size
            if size >= n:
                os.ftruncate(self.fd, size - n)

    # -- room on disk -------------------------------------------------------------------
    def _relimit(self) -> None:
        """Where rows end in the open segment: before the reserve at the end of what is held
        (or of its size, where the filesystem cannot reserve); nowhere once it is sealed."""
        if self.sealed:
            self.limit = 0
        else:
            top = self.cap if self.held is None else min(self.cap, self.held)
            self.limit = top - self.reserve

    def _hold(self, upto: int) -> bool:
        """Reserve the open segment's blocks up to offset `upto` (rounded up to a page);
        True if they are held (or the filesystem cannot say: writes then find out)."""
        assert self.fd is not None
        if self.held is None or upto <= self.held:
            return True
        upto = pages(upto)
        got = fallocate(self.fd, self.held, upto - self.held)
        if got is False:
            return False
        self.held = None if got is None else upto
        self._relimit()
        return True

    def _fit(self, n: int) -> bool:
        """Room for `n` more bytes of rows in the open segment, within its size: a segment
        opened on a nearly full disk holds only what it needed, and reserves more here."""
        if self.fd is None or self.sealed:
            return False
        end = self.end + n
        if end <= self.limit:
            return True
        if end + self.reserve > self.cap or not self._hold(end + self.reserve):
            return False
        return end <= self.limit

    def _room_for(self, line: bytes, keep: int = 0) -> bool:
        """Does `line` fit after the data with `keep` bytes to spare, in what the open
        segment holds (reserving more if need be)?"""
        end = self.end + len(line) + keep
        if self.held is None:
            return end <= max(self.cap, self.size)
        return end <= self.held or self._hold(end)

    # -- opening and rolling ------------------------------------------------------------
    def open_first(self) -> bool:
        return self._open(0, 1)

    def _open(self, index: int, first_seq: int, need: int = 0) -> bool:
        """Create segment `index`, reserve its blocks, write its head: True if it is open
        (the previous one, if any, is then closed with a marker)."""
        path = self.path_of(index)
        head = self.head(index, first_seq)
        took = None if self.fd is None and index == 0 else time.monotonic() - self.opened
        cap = plan_size(self.cap, took, free_bytes(path.parent), self.size)
        reserve = reserve_for(cap)
        cap = max(cap, len(head) + need + reserve)  # a line larger than a segment
        fd = -1
        try:
            fd = _create(path)
            # all of it, else what the head, the line and the reserve need: a disk with
            # less than a segment still takes rows (a page at a time, see `_fit`)
            held: int | None = cap
            got = fallocate(fd, 0, cap)
            if got is False:
                held = pages(len(head) + need + reserve)
                got = fallocate(fd, 0, held)
                if got is False:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if got is None:
                held = None
            if os.write(fd, head) != len(head):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._failed("open", exc, path)
            return False
        if self.fd is not None:
            self._close_current(_note_line({"_event": "segment", "_seq": 0,
                                            "_time": time.time(), "next": path.name}))
        self.index, self.path, self.fd, self.first_seq = index, path, fd, first_seq
        self.cap = cap
        self.reserve, self.held, self.end, self.sealed = reserve, held, len(head), False
        self.cut = False
        self._relimit()
        self.opened = time.monotonic()
        self._good = self.end
        self._publish()
        return True

    def _close_current(self, last: bytes) -> bool:
        """Write `last` (a marker or the finish), give back the blocks reserved past it;
        False if `last` could not be written."""
        assert self.fd is not None
        done = self._put_reserved(last)
        if self.held is not None and self.held > self.end:
            fallocate(self.fd, self.end, self.held - self.end, punch=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None
        self.rolled += 1
        self._publish()
        return done

    def _put_reserved(self, line: bytes) -> bool:
        """Write `line` after the data, into the space kept for it if the rows reached it
        (the segment then takes no more rows)."""
        assert self.fd is not None
        if self.end + len(line) > self.limit:
            self.sealed = True
            self._relimit()
            self._room_for(line)  # more blocks if it can; else the write finds out
        return self._write(line)

    def _failed(self, op: str, exc: OSError, path: Path) -> None:
        cause = _cause(exc)
        self.errors[f"{op}:{cause}"] = self.errors.get(f"{op}:{cause}", 0) + 1
        self.warn(f"spool:{cause}", f"expr_tracker: cannot {op} spool segment {path}: "
                  f"{exc.strerror or exc}; lines wait in memory (up to {self.max_buffer} "
                  "bytes) until exprd frees space; rows past that are dropped and counted in "
                  "info()['dropped']['spool_full']")

    # -- writing ------------------------------------------------------------------------
    def _place(self, line: bytes) -> bool:
        """Write `line` into the open segment, else into a new one: False if it fits
        nowhere now (a new segment is tried again after _RETRY seconds)."""
        n = len(line)
        if self._fit(n) and self._write(line):
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        if self._open(self.index + 1, _seq_of(line), n) and self._fit(n) and self._write(line):
            return True
        self._next_try = now + _RETRY
        return False

    def overflow(self, line: bytes, record: bool = True) -> bool:
        """A line the hot path's `fast_append` could not take: into this or the next
        segment, else into memory; False if it was dropped (a record past the bound)."""
        if not self.memory and self._place(line):
            return True
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
        self.notes["spool_full"] = (self.drops, self.drops_since)
        if not self._noted.get("spool_full"):
            self._note()  # readers learn now, from the space kept for it

    def _note(self) -> None:
        """`dropped` notes (the counts so far) after the data, in the reserve if need be."""
        if self.fd is None or self.cut:
            return  # (a cut segment: they go in the next one)
        for cause, (rows, since) in self.notes.items():
            if rows == self._noted.get(cause, 0):
                continue
            note = _note_line({"_event": "dropped", "_seq": 0, "_time": time.time(),
                               "cause": cause, "rows": rows, "since": since,
                               "host": socket.gethostname()})
            # only while the marker and the finish still fit after it
            if self._room_for(note, keep=1024) and self._put_reserved(note):
                self._noted[cause] = rows

    def drain(self, force: bool = False) -> bool:
        """Write what waits in memory into segments as they can take it; True if nothing
        waits any more."""
        if not self.memory:
            return True
        now = time.monotonic()
        if now < self._next_try and not force:
            return False
        self._next_try = 0.0
        while self.memory:
            line = self.memory[0]
            if not self._place(line):
                self._next_try = now + _RETRY
                return False
            self.memory.pop(0)
            self.memory_bytes -= len(line)
        self._note()
        self._publish()
        return True

    def tick(self) -> None:
        """About once a second: lines in memory go out, a moved, deleted or truncated
        segment is left for a new one."""
        self.drain()
        self._look()

    def _look(self) -> None:
        """Is the open segment still ours and whole? Moved or cut: left for a new one."""
        if self.fd is None:
            return
        if not self._is_current():
            self._moved()
            return
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return
        if size < self.end and not self.cut:  # (a cut is counted once)
            self._truncated(size)
        self._good = self.end

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

    def _truncated(self, size: int) -> None:
        """Another process cut the open segment (`: > file`, copytruncate). The writer goes
        on in a new segment: the whole lines still in the cut file go there first (the
        cut took its init line: a replay could not apply them from it), and the events
        cut are counted (`spool_truncated`: exprd may have applied some before the cut,
        the shard then holds them once)."""
        assert self.fd is not None
        try:
            data = os.pread(self.fd, size, 0)
        except OSError:
            data = b""
        kept = [line + b"\n" for line in data.split(b"\n")[:-1]
                if line.startswith(b"{") and not line.startswith(b'{"_event":"init"')
                and not line.startswith(_NOTES) and _SEQ.search(line) and _parses(line)]
        first = _seq_of(kept[0]) if kept else self.next_seq()
        cut = max(0, first - self.first_seq)
        self.errors["truncated"] = self.errors.get("truncated", 0) + 1
        if cut:
            self.dropped["spool_truncated"] = self.dropped.get("spool_truncated", 0) + cut
            rows, since = self.notes.get("spool_truncated", (0, time.time()))
            self.notes["spool_truncated"] = (rows + cut, since)
        self.warn("spool_truncated", f"expr_tracker: spool file {self.path} was truncated by "
                  f"another process (to {size} bytes); events exprd had not read from it yet "
                  "are lost, counted in info()['dropped']['spool_truncated'] and the "
                  "sidecar; going on in a new segment")
        self.held = None  # the cut gave its reserved blocks back
        self.sealed = True  # no more rows here
        self.cut = True  # nor notes, nor the finish: nobody would apply them from here
        self._relimit()
        if kept:
            self.memory.insert(0, b"".join(kept))
            self.memory_bytes += sum(map(len, kept))
        self._next_try = 0.0
        self._publish()
        self.drain(force=True)
        if not self.memory:
            self._note()

    def _moved(self) -> None:
        """The segment was moved or deleted under us: what was written since the last check
        goes on in a new session (exprd follows names); the moved file keeps what it had."""
        assert self.fd is not None
        good, end = self._good, self.end
        since = b""
        if end > good:
            with contextlib.suppress(OSError):
                since = os.pread(self.fd, end - good, good)
        self.warn("spool_deleted", f"expr_tracker: spool file {self.path} was deleted or moved "
                  "while in use; going on in a new segment (if it was deleted, rows exprd had "
                  "not read from it yet are lost)")
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, good)
        if self.held is not None and self.held > good:
            fallocate(fd, good, self.held - good, punch=True)
        with contextlib.suppress(OSError):
            os.close(fd)
        if since:
            self.memory.insert(0, since)
        # a new session: a copy of the moved file may come back and be applied after what
        # follows, which one session's seqs could not tell apart from a repeat
        self.memory = self.new_session(self.memory)
        self.memory_bytes = sum(map(len, self.memory))
        self.index = -1
        self.cap = 0
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
        # a cut since the last tick (up to a second ago) is counted before the finish
        # goes out, else the sidecar would miss it
        self._look()
        deadline = time.monotonic() + wait
        while not self.drain(force=True) and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.memory:
            lost = sum(m.count(b"\n") for m in self.memory if not m.startswith(b'{"_event"'))
            self.memory.clear()
            self.memory_bytes = 0
            for _ in range(lost):
                self._drop()
        if (self.fd is None or self.cut) and not self._open(self.index + 1, _seq_of(line)):
            self.warn("spool_finish", "expr_tracker: no spool segment could be opened for the "
                      "finish event: exprd will read this run as crashed")
            self.closed = True
            return
        self._note()
        if not self._room_for(line):
            # a summary too large for what is left: the finish goes without it, in a segment
            # of its own if it still does not fit
            ev = orjson.loads(line)
            ev.pop("summary", None)
            line = orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)
            if not self._room_for(line):
                self._open(self.index + 1, _seq_of(line), len(line))
        if not self._close_current(line):
            self.warn("spool_finish", "expr_tracker: the finish event could not be written "
                      f"to {self.path} (the spool disk is full): exprd will read this run as "
                      "crashed")
        self.closed = True

    def close(self, status: str = "crashed", flush_timeout: float | None = None) -> None:
        """SIGTERM (Run._terminate): nothing to flush, the rows are in the kernel; the
        process is about to die and exprd reads the segment as its writer left it."""

    def crash_close(self) -> None:
        """A forked child: let go of the parent's segment without writing anything."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = self._fast_fd = None
        self.fast_append = None
        self.memory.clear()

    def info(self) -> dict[str, Any]:
        return {"segment": self.index, "segment_bytes": self.size,
                "segment_size": self.cap, "segments_rolled": self.rolled}


def _create(path: Path) -> int:
    """A new segment file; its directory made again (0700) if someone deleted it under a
    live session (`rm -rf` of the spool): the rows after that land, not dropped."""
    flags = (os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
             | os.O_CLOEXEC)
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        make_private_dirs(path.parent)
        return os.open(path, flags, 0o600)


def _parses(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True


def _note_line(ev: dict[str, Any]) -> bytes:
    return orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)


def _seq_of(data: bytes) -> int:
    """The `_seq` of the first line of `data` (the events a new segment starts with)."""
    m = _SEQ.search(data, 0, data.find(b"\n") + 1 or len(data))
    return int(m.group(1)) if m else 0


# a segment writer's own lines, not events (spoolfile.NOTES; not imported: layers)
_NOTES = (b'{"_event":"segment"', b'{"_event":"dropped"')
_SEQ = re.compile(rb'[{,]"_seq":(\d+)')
