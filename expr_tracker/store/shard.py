"""Rank shards on disk: the buffered writer, the sidecar, resume and the reader (DESIGN 3-5).

The shard file is the truth. Writers append whole lines with one `os.write` on an
O_APPEND descriptor; readers ignore an unterminated last line. The sidecar
`<stem>.meta.json` is a hint that a writer repairs from the file when they disagree.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store import records
from expr_tracker.store.layout import ShardPaths
from expr_tracker.store.lock import lock_writer
from expr_tracker.store.safedir import UnsafePath, open_dir, open_file, write_all, write_atomic_at

FLUSH_BYTES = 64 * 1024
# a retry after a failed write goes in pieces of whole lines this large, so that a disk
# with less room than the backlog keeps what fits (a normal flush is one piece)
_PIECE = 256 * 1024
MAX_BUFFER_BYTES = 64 * 1024 * 1024
_READ_BLOCK = 256 * 1024

Warn = Callable[[str, str], None]
Opener = Callable[[str, int], int]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temp file, fsync, rename; never a half-written file."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(dfd, path.name, data)
    finally:
        os.close(dfd)


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """The sidecar as a dict, or None if missing or unreadable."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Cursor:
    """Where a shard stands: bytes of complete lines, rows, largest step, applied spool seqs."""

    bytes: int = 0
    rows: int = 0
    last_step: int | None = None
    applied: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        nxt = 0 if self.last_step is None else self.last_step + 1
        return {
            "bytes": self.bytes,
            "rows": self.rows,
            "last_step": self.last_step,
            "next_step": nxt,
            "applied": dict(self.applied),
        }


def _scan(data: bytes, cursor: Cursor, base: int) -> None:
    """Advance `cursor` over the complete lines of `data` (which starts at file offset `base`)."""
    for _, line in records.iter_lines(data):
        cursor.rows += 1
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        step = rec.get("_step")
        if "_kind" not in rec and type(step) is int and (cursor.last_step is None or step > cursor.last_step):
            cursor.last_step = step
        sess, seq = rec.get("_sid"), rec.get("_seq")
        if type(sess) is str and type(seq) is int and seq >= cursor.applied.get(sess, -1):
            cursor.applied[sess] = seq
    cursor.bytes = base + data.rfind(b"\n") + 1


def repair_and_scan(paths: ShardPaths, hint: Mapping[str, Any] | None,
                    opener: Opener | None = None) -> tuple[Cursor, bool]:
    """Move a torn tail to `<shard>.torn`, truncate, and compute the cursor.

    Uses the sidecar hint to avoid rescanning the whole file when it is consistent.
    Returns (cursor, repaired) where repaired says the sidecar disagreed with the file.
    The caller holds whatever lock protects the shard. `opener(name, flags)` opens a
    file of the run directory (the writer's, which follows no symlink).
    """
    if opener is None:
        def opener(name: str, flags: int) -> int:
            return os.open(paths.run_dir / name, flags | os.O_CLOEXEC, 0o644)
    try:
        fd = opener(paths.shard.name, os.O_RDWR)
    except FileNotFoundError:
        return Cursor(), hint is not None and bool(hint.get("cursor", {}).get("bytes"))
    try:
        size = os.fstat(fd).st_size
        with open(fd, "rb", closefd=False) as fh:
            tail_start = records.complete_end(fh, _READ_BLOCK)
        original = size
        if tail_start < size:
            torn = os.pread(fd, size - tail_start, tail_start)
            tfd = opener(paths.torn.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                write_all(tfd, torn if torn.endswith(b"\n") else torn + b"\n")
                os.fsync(tfd)
            finally:
                os.close(tfd)
            os.ftruncate(fd, tail_start)
            size = tail_start
        hint_bytes = ((hint or {}).get("cursor") or {}).get("bytes")
        repaired = original != size or (original > 0 and hint_bytes != size)
        return cursor_from(fd, size, hint), repaired
    finally:
        os.close(fd)


def cursor_from(fd: int, size: int, hint: Mapping[str, Any] | None) -> Cursor:
    """The cursor of the first `size` bytes of a shard, reading only.

    Starts from the sidecar `hint` when its byte count ends on a line boundary, then
    scans the complete lines after it: the whole file only when the hint is no use.
    """
    cur = (hint or {}).get("cursor") or {}
    cursor = Cursor()
    hint_bytes = cur.get("bytes")
    if isinstance(hint_bytes, int) and 0 < hint_bytes <= size and _line_boundary(fd, hint_bytes):
        cursor.bytes = hint_bytes
        cursor.rows = int(cur.get("rows") or 0)
        step = cur.get("last_step")
        cursor.last_step = step if isinstance(step, int) else None
        cursor.applied = {str(k): int(v) for k, v in (cur.get("applied") or {}).items()}
    pos = cursor.bytes
    while pos < size:
        block = os.pread(fd, min(16 * _READ_BLOCK, size - pos), pos)
        last_nl = block.rfind(b"\n")
        if last_nl < 0:
            break
        _scan(block[: last_nl + 1], cursor, pos)
        pos = cursor.bytes
    return cursor


def _last_row_step(data: bytes) -> int | None:
    """`_step` of the last step row (not a `_kind` record) in `data`, parsing just that line."""
    end = len(data) - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        if not data.startswith(b'{"_kind"', start):
            try:
                step = orjson.loads(data[start:end]).get("_step")
            except (orjson.JSONDecodeError, AttributeError):
                return None
            return step if type(step) is int else None
        end = start - 1
    return None


def rank_last_step(fd: int, size: int, rank: int) -> int | None:
    """The largest `_step` of rank `rank`'s own step rows in a shared (rank_aware=False)
    shard, reading backwards from `size`: a rank's rows are appended in step order, so its
    last row holds its largest step. None if the rank has no row (a fresh rank starts at 0)."""
    needle = b'"_rank":%d' % rank
    end, carry = size, b""
    while end > 0:
        start = max(0, end - _READ_BLOCK)
        data = os.pread(fd, end - start, start) + carry
        lines = data.split(b"\n")
        carry = lines[0] if start > 0 else b""
        for line in reversed(lines[1:] if start > 0 else lines):
            if needle not in line or line.startswith(b'{"_kind"'):
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            step = rec.get("_step") if isinstance(rec, dict) else None
            if rec.get("_rank") == rank and "_kind" not in rec and type(step) is int:
                return step
        end = start
    return None


def _line_boundary(fd: int, offset: int) -> bool:
    """True if `offset` is the start of a line (the byte before it is a newline)."""
    return os.pread(fd, 1, offset - 1) == b"\n"


class ShardWriter:
    """Buffered, append-only writer of one shard file and its sidecar.

    `append` (one thread) and `flush` (any thread) may run concurrently: the buffer is
    a bytearray taken and trimmed by single operations under the GIL, and flushes are
    serialized by a lock.
    Failures never raise: they are reported once per cause through `warn` and
    counted in `dropped` when data had to be given up.
    """

    def __init__(
        self,
        paths: ShardPaths,
        identity: Mapping[str, Any],
        *,
        shared: bool = False,
        write_sidecar: bool = True,
        warn: Warn | None = None,
        dropped: dict[str, int] | None = None,
        flush_bytes: int = FLUSH_BYTES,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        exclusive: bool = False,
        own_rank: int | None = None,
        anchor: Path | None = None,
    ) -> None:
        """`exclusive`: hold the shard's writer lock (a second writer gets ShardBusyError
        from `open`). `own_rank` (shared files): the cursor's last step is that rank's."""
        self.paths = paths
        self.exclusive = exclusive
        self.own_rank = own_rank
        self._lock_fd: int | None = None
        # exprd: the allowed root the run directory lies in; every directory below it is
        # opened without following symlinks (see `_run_dir_fd`)
        self.anchor = anchor
        self.unsafe: str | None = None  # why a path was refused (a symlink...), if one was
        self.last_error = ""  # the last failure's reason (strerror), for status displays
        self.identity = dict(identity)
        self.shared = shared
        self.sidecar_enabled = write_sidecar
        self.flush_bytes = flush_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self._warn = warn or (lambda cause, msg: None)
        self.dropped = dropped if dropped is not None else {}
        self.errors: dict[str, int] = {}
        self.cursor = Cursor()
        self.repaired = False
        self.status = "running"
        self.exit: dict[str, Any] | None = None  # {type, message, time} of a crash (DESIGN 5)
        self.start_time = time.time()
        self.end_time: float | None = None
        self.last_write: float | None = None
        # whole lines appended by the training thread, taken by the flusher: bytearray
        # extend and slice-delete are single operations under the GIL, so the hot path
        # takes no lock and allocates nothing that lives past the flush
        self._buf = bytearray()
        self.queue = self._buf.extend  # the hot path's append: whole lines only
        self._pending = b""  # data of a failed write, retried first
        self._pending_rows = 0
        self._io_lock = threading.Lock()
        self._fd: int | None = None
        # hooks of the spool writer (None for shards): `on_deleted()` when the file was
        # deleted under us, before a new one is opened at `self.paths` (it may change
        # them); `transform(data, offset)` rewrites what is written at `offset`
        self.on_deleted: Callable[[], None] | None = None
        self.transform: Callable[[bytes, int], bytes] | None = None

    # -- opening ---------------------------------------------------------
    def open(self) -> Cursor:
        """Create the run directory, repair a torn tail, compute the cursor, open for append.

        Failures are reported and retried at the next flush; they never raise.
        """
        try:
            hint = self.read_hint()
            if self.exclusive:
                # the SDK's own shard (never exprd's, which has an anchor): the lock file
                # sits in the run directory the user named
                self.paths.run_dir.mkdir(parents=True, exist_ok=True)
                self._take_lock(hint)
            with self._locked_file():
                self.cursor, self.repaired = repair_and_scan(self.paths, hint, self.open_file)
                if self.shared and self.own_rank is not None:
                    self.cursor.last_step = self._own_last_step()
            if hint and isinstance(hint.get("start_time"), (int, float)) and self.cursor.rows:
                self.start_time = float(hint["start_time"])
            self._open_fd()
        except OSError as exc:
            self._fail("open", exc)
        return self.cursor

    def forget_lock(self) -> None:
        """In a forked child: close this copy of the lock descriptor. The parent keeps the
        lock (an flock lasts while any copy is open), and a child that outlives it, a
        dataloader worker say, does not hold the shard from the next writer."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def _own_last_step(self) -> int | None:
        try:
            fd = os.open(self.paths.shard, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            assert self.own_rank is not None
            return rank_last_step(fd, self.cursor.bytes, self.own_rank)
        finally:
            os.close(fd)

    def _take_lock(self, hint: Mapping[str, Any] | None) -> None:
        """Take the shard's writer lock (see `lock_writer`); ShardBusyError if held."""
        rank = self.own_rank if self.own_rank is not None else int(self.identity.get("rank") or 0)
        self._lock_fd = lock_writer(
            self.paths, rank, self.shared,
            sidecar_hint=None if self.shared else hint,
            sidecar=self.paths.sidecar,
        )

    # -- files of the run directory ----------------------------------------
    def _run_dir_fd(self, create: bool = True) -> int:
        """A descriptor of the run directory, created if missing (when `create`).

        With `anchor` (exprd: the allowed root) every directory below the anchor is opened
        without following a symlink; without one (the SDK) the run directory is the path
        the user gave. Files in it are never opened through a symlink either way.
        """
        run_dir = self.paths.run_dir
        if self.anchor is None:
            if create:
                run_dir.mkdir(parents=True, exist_ok=True)
            return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_dir(self.anchor, run_dir.relative_to(self.anchor).parts, create=create)
        except UnsafePath as exc:
            self.unsafe = str(exc)
            raise

    def open_file(self, name: str, flags: int) -> int:
        """Open file `name` of the run directory (the shard, its torn file, an alerts file),
        at this moment, following no symlink (`UnsafePath` if one is in the way). The run
        directory is created only for a file opened with O_CREAT."""
        dfd = self._run_dir_fd(create=bool(flags & os.O_CREAT))
        try:
            return open_file(dfd, name, flags, where=self.paths.run_dir)
        except UnsafePath as exc:
            self.unsafe = str(exc)
            raise
        finally:
            os.close(dfd)

    def scan(self) -> Cursor:
        """The shard's cursor, reading only (nothing is created or repaired)."""
        try:
            fd = self.open_file(self.paths.shard.name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return Cursor()
        try:
            return cursor_from(fd, os.fstat(fd).st_size, self.read_hint())
        finally:
            os.close(fd)

    def read_hint(self) -> dict[str, Any] | None:
        """The sidecar, read without following a symlink; None if missing or unreadable."""
        try:
            fd = self.open_file(self.paths.sidecar.name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            with open(fd, "rb", closefd=False) as fh:
                data = orjson.loads(fh.read())
        except (OSError, orjson.JSONDecodeError):
            return None
        finally:
            os.close(fd)
        return data if isinstance(data, dict) else None

    @contextlib.contextmanager
    def _locked_file(self) -> Iterator[None]:
        if not self.shared:
            yield
            return
        # the same lock every flush of a shared shard takes: a repair must not cut off
        # a line another rank appends meanwhile
        fd = self.open_file(self.paths.shard.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _open_fd(self) -> int:
        if self._fd is not None:
            try:
                if os.fstat(self._fd).st_nlink > 0:
                    return self._fd
            except OSError:
                pass
            # the file (or its run directory) was deleted under us: start a new one
            self.errors["deleted"] = self.errors.get("deleted", 0) + 1
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            if self.on_deleted is not None:
                self.on_deleted()
            else:
                self._warn("deleted", f"shard {self.paths.shard} was deleted; recreating it")
        # never opened (the run root was unwritable or missing at init), deleted, or closed
        # to give its descriptor back: (re)open it now, creating the run directory
        self._fd = self.open_file(self.paths.shard.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return self._fd

    # -- writing ---------------------------------------------------------
    def append(self, line: bytes) -> None:
        """Queue one complete line (ending in newline); flushes inline at `flush_bytes`."""
        self._buf += line
        if len(self._buf) >= self.flush_bytes:
            self.flush_nowait()

    def flush_nowait(self) -> None:
        """Flush unless another thread is flushing (it will take our lines too)."""
        if self._io_lock.acquire(blocking=False):
            # a background flush already running picks the data up otherwise
            try:
                self._flush_locked()
            finally:
                self._io_lock.release()

    def buffered(self) -> int:
        """Bytes waiting to be written."""
        return len(self._buf) + len(self._pending)

    def flush(self) -> bool:
        """Write everything buffered; False if some data is still pending after a failure."""
        with self._io_lock:
            return self._flush_locked()

    def flush_within(self, timeout: float) -> bool:
        """Flush unless the write lock stays taken for `timeout` s (a signal handler must
        not wait forever on a lock the code it interrupted may hold)."""
        if not self._io_lock.acquire(timeout=timeout):
            return False
        try:
            return self._flush_locked()
        finally:
            self._io_lock.release()

    def _flush_locked(self) -> bool:
        buf = self._buf
        n = len(buf)
        if not n and not self._pending:
            return True
        chunk = bytes(buf[:n])
        del buf[:n]
        data = self._pending + chunk if self._pending else chunk
        nrows = self._pending_rows + chunk.count(b"\n")
        done = 0  # bytes of `data` written, whole lines only
        failed: OSError | None = None
        try:
            fd = self._open_fd()
            if self.shared:
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                end = os.fstat(fd).st_size
                done, end, failed = self._write_lines(fd, data, end)
            finally:
                if self.shared:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            failed = exc
        if done:
            written = data if done == len(data) else data[:done]
            rows = nrows if written is data else written.count(b"\n")
            self.cursor.bytes = end
            self.cursor.rows += rows
            step = _last_row_step(written)
            if step is not None and (self.cursor.last_step is None or step > self.cursor.last_step):
                self.cursor.last_step = step
            self.last_write = time.time()
            if failed is not None:
                data, nrows = data[done:], nrows - rows
        if failed is not None:
            self._fail("write", failed)
            self._keep_pending(data, nrows)
            return False
        self._pending = b""
        self._pending_rows = 0
        return True

    def _write_lines(self, fd: int, data: bytes, end: int) -> tuple[int, int, OSError | None]:
        """Append `data` in pieces of whole lines (about _PIECE bytes) at file size `end`.

        A piece that fails is cut off again, so the file never ends in half a line; the
        pieces before it stay. On a disk that frees less space than the backlog, the
        rows that fit are kept and only the rest waits (and is counted if it never fits).
        Returns (bytes of `data` written, the file size after them, the error or None).
        """
        pos = 0
        while pos < len(data):
            cut = len(data) if len(data) - pos <= _PIECE else data.rfind(b"\n", pos, pos + _PIECE) + 1
            if cut <= pos:  # one line longer than a piece
                nl = data.find(b"\n", pos)
                cut = len(data) if nl < 0 else nl + 1
            piece = data[pos:cut]
            if self.transform is not None:
                piece = self.transform(piece, end)
            try:
                write_all(fd, piece)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                return pos, end, exc
            pos, end = cut, end + len(piece)
        return pos, end, None

    @property
    def is_open(self) -> bool:
        """True while the shard's descriptor is open."""
        return self._fd is not None

    def release_fd(self) -> None:
        """Close the descriptor (a pool of open files gives it back); the next flush reopens
        the shard and writes what is buffered."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def discard(self) -> int:
        """Forget buffered and pending rows (their caller keeps them elsewhere, as exprd's
        spool does); returns how many rows that was."""
        rows = self._pending_rows + self._buf.count(b"\n")
        self._buf.clear()
        self._pending, self._pending_rows = b"", 0
        return rows

    def _keep_pending(self, data: bytes, nrows: int) -> None:
        """Keep failed data for a retry, within `max_buffer_bytes`; count what must go."""
        if len(data) > self.max_buffer_bytes:
            cut = data.find(b"\n", len(data) - self.max_buffer_bytes) + 1
            lost = data[:cut].count(b"\n")
            self.dropped["buffer_full"] = self.dropped.get("buffer_full", 0) + lost
            self._warn(
                "buffer_full",
                f"shard {self.paths.shard}: write buffer over {self.max_buffer_bytes} bytes; "
                "dropping the oldest rows (counted in info()['dropped'])",
            )
            data = data[cut:]
            nrows -= lost
        self._pending = data
        self._pending_rows = nrows

    def _fail(self, op: str, exc: OSError) -> None:
        if isinstance(exc, UnsafePath):
            self.unsafe = str(exc)
        self.last_error = exc.strerror or str(exc)
        cause = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        key = f"{op}:{cause}"
        self.errors[key] = self.errors.get(key, 0) + 1
        self._warn(
            f"shard:{cause}",  # one warning per cause (ENOSPC, EROFS...), whatever the operation
            f"expr_tracker: cannot {op} shard {self.paths.shard}: {exc.strerror or exc}; "
            "rows are kept in memory and retried",
        )

    # -- sidecar ---------------------------------------------------------
    def sidecar(self) -> dict[str, Any]:
        """The sidecar contents for the current state."""
        out = {
            "version": 1,
            **self.identity,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "cursor": self.cursor.as_dict(),
            "status": self.status,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "last_write": self.last_write,
        }
        if self.exit is not None and self.status == "crashed":
            out["exit"] = self.exit
        return out

    def write_sidecar(self) -> bool:
        """Atomically rewrite the sidecar; failures are reported (False), never raised."""
        if not self.sidecar_enabled:
            return True
        try:
            dfd = self._run_dir_fd()
            try:
                write_atomic_at(dfd, self.paths.sidecar.name,
                                orjson.dumps(self.sidecar(), option=orjson.OPT_INDENT_2))
            finally:
                os.close(dfd)
        except OSError as exc:
            self._fail("sidecar", exc)
            return False
        return True

    def close(self, status: str = "finished", flush_timeout: float | None = None) -> None:
        """Flush, mark the status in the sidecar and close the file.

        With `flush_timeout`, the write lock is waited for at most that long (see
        `flush_within`): a signal handler calls this.
        """
        if flush_timeout is None:
            self.flush()
        else:
            self.flush_within(flush_timeout)
        self.status = status
        self.end_time = time.time()
        self.write_sidecar()
        if self._pending:
            lost = self._pending_rows
            self.dropped["unwritable"] = self.dropped.get("unwritable", 0) + lost
            self._warn("unwritable", f"shard {self.paths.shard}: {lost} rows could not be written")
            self._pending = b""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = None


# -- reading -------------------------------------------------------------


class ShardReader:
    """Reads complete lines of a shard that another process may be appending to."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.garbage = 0  # lines that did not parse, skipped

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        try:
            return records.loads(line)
        except ValueError:
            self.garbage += 1
            return None

    def iter_records(self, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (end offset, record) for every complete, parseable line from `start`."""
        with open(self.path, "rb") as fh:
            for base, data in records.complete_blocks(fh, 4 * _READ_BLOCK, start):
                for off, line in records.iter_lines(data):
                    rec = self._parse(line) if line.strip() else None
                    if rec is not None:
                        yield base + off + len(line) + 1, rec

    def records(self) -> list[dict[str, Any]]:
        """Every complete record in file order."""
        return [rec for _, rec in self.iter_records()]

    def iter_reverse(self) -> Iterator[dict[str, Any]]:
        """Complete records from the last to the first, reading the file backwards in blocks."""
        return self.iter_reverse_from()

    def iter_reverse_from(
        self, end: int | None = None, block: int = _READ_BLOCK
    ) -> Iterator[dict[str, Any]]:
        """`iter_reverse` from offset `end` (where complete lines end; None: find it).

        `block` bytes are read at a time: a reader that wants a few lines of each of many
        shards passes a small one. A given `end` keeps the view stable while the file grows.
        """
        with open(self.path, "rb") as fh:
            if end is None:
                end = records.complete_end(fh, block)  # only terminated lines count
            carry = b""
            while end > 0:
                start = max(0, end - block)
                fh.seek(start)
                data = fh.read(end - start) + carry
                lines = data.split(b"\n")
                # lines[0] may be the end of a line that started in an earlier block
                carry = lines[0] if start > 0 else b""
                body = lines[1:] if start > 0 else lines
                for line in reversed(body):
                    if line.strip():
                        rec = self._parse(line)
                        if rec is not None:
                            yield rec
                end = start


def select_rows(
    reader: ShardReader,
    n: int | None,
    *,
    metrics: list[str] | None = None,
    step_range: tuple[int | None, int | None] | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """The last `n` matching rows (all if n is None or negative), oldest first.

    `kind` None selects step rows (records without `_kind`); "rank" selects rank
    records; "*" everything. `step_range` is half-open [lo, hi). With `metrics`, a
    row matches if it has at least one of them, and is projected to them.
    """
    lo, hi = step_range or (None, None)
    want = set(metrics) if metrics else None

    def keep(rec: dict[str, Any]) -> dict[str, Any] | None:
        if kind != "*" and rec.get("_kind") != kind:
            return None
        step = rec.get("_step")
        if lo is not None and (not isinstance(step, int) or step < lo):
            return None
        if hi is not None and (not isinstance(step, int) or step >= hi):
            return None
        if want is None:
            if "_sid" in rec:  # exprd's exactly-once bookkeeping, not the user's data
                rec = {k: v for k, v in rec.items() if k not in _SPOOL_KEYS}
            return rec
        picked = {k: v for k, v in rec.items() if k in want}
        if not picked:
            return None
        out = {k: v for k, v in rec.items() if k[:1] == "_" and k in _ROW_META}
        out.update(picked)
        return out

    if n is None or n < 0:
        out = []
        for _, rec in reader.iter_records():
            row = keep(rec)
            if row is not None:
                out.append(row)
        return out
    picked_rows: list[dict[str, Any]] = []
    if n == 0:
        return picked_rows
    for rec in reader.iter_reverse():
        row = keep(rec)
        if row is not None:
            picked_rows.append(row)
            if len(picked_rows) >= n:
                break
    picked_rows.reverse()
    return picked_rows


_SPOOL_KEYS = ("_sid", "_seq")
_ROW_META = ("_step", "_time", "_kind", "_rank", "_world_size", "_local_rank", "_weight")
