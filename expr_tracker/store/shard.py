"""The shard writer: buffered whole-line appends, the sidecar, resume and one writer (DESIGN 3-5).

Writers append whole lines with one `os.write` on an O_APPEND descriptor; readers
(`store.reader`) ignore an unterminated last line. Failures are reported once per cause,
counted and retried within a bound; they never raise into the training loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store import nonfinite
from expr_tracker.store.cursor import (
    Cursor,
    cursor_from,
    last_row_step,
    rank_last_step,
    repair_and_scan,
)
from expr_tracker.store.layout import ShardPaths
from expr_tracker.store.lock import lock_writer
from expr_tracker.store.safedir import (
    NotRegular,
    UnsafePath,
    open_dir,
    open_file,
    write_all,
    write_atomic_at,
)

FLUSH_BYTES = 64 * 1024
# a retry after a failed write goes in pieces of whole lines this large, so that a disk
# with less room than the backlog keeps what fits (a normal flush is one piece)
_PIECE = 256 * 1024
MAX_BUFFER_BYTES = 64 * 1024 * 1024
LOOK = -1  # `append_many`'s last step: not known, read from the lines (a step is >= 0)

Warn = Callable[[str, str], None]


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
        self.probe: dict[str, Any] | None = None  # where a silent rank is (DESIGN 13)
        # rows the SDK dropped before they reached the spool (a full spool disk), per
        # (cause, session): {cause, session, rows, since, host}; exprd fills it (DESIGN 6)
        self.spool_dropped: list[dict[str, Any]] = []
        # key -> where it was first non-finite in this shard (`store.nonfinite`)
        self.nonfinite: dict[str, dict[str, Any]] = {}
        self.notes_new = False  # a key or rank went non-finite since the sidecar was written
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
        self._held_dir: tuple[int, int] | None = None  # (descriptor, thread) in `walked`
        self._below: tuple[str, ...] | None = None  # the run directory's parts below `anchor`
        # hooks of the spool writer (None for shards): `on_deleted()` when the file was
        # deleted (or `is_current(fd)` says moved) under us, before a new one is opened at
        # `self.paths` (it may change them); `transform(data, offset)` rewrites what is
        # written at `offset`
        self.on_deleted: Callable[[], None] | None = None
        self.is_current: Callable[[int], bool] | None = None
        self.transform: Callable[[bytes, int], bytes] | None = None

    # -- opening ---------------------------------------------------------
    def open(self) -> Cursor:
        """Create the run directory, repair a torn tail, compute the cursor, open for append.

        Failures are reported and retried at the next flush; they never raise.
        """
        try:
            # exprd: the run directory walked to once for the files `open` touches (the
            # sidecar, the shard, its torn file...), not once per file
            with self.walked(create=True) as new_dir:
                # a run directory this walk made is empty: no sidecar, no shard to repair
                hint = None if new_dir else self.read_hint()
                if self.exclusive:
                    # the SDK's own shard (never exprd's, which has an anchor): the lock file
                    # sits in the run directory the user named
                    self.paths.run_dir.mkdir(parents=True, exist_ok=True)
                    self._take_lock(hint)
                with self._locked_file():
                    self.cursor, self.repaired = (Cursor(), False) if new_dir else \
                        repair_and_scan(self.paths, hint, self.open_file)
                    if self.shared and self.own_rank is not None:
                        self.cursor.last_step = self._own_last_step()
                if hint and isinstance(hint.get("start_time"), (int, float)) and self.cursor.rows:
                    self.start_time = float(hint["start_time"])
                self._keep_notes(hint)
                self._open_fd()
        except OSError as exc:
            self._fail("open", exc)
        return self.cursor

    def _keep_notes(self, hint: Mapping[str, Any] | None) -> None:
        """The sidecar's notes of rows that never reached the shard (earlier sessions'
        too) stay in it: those already known here win."""
        for key, n in nonfinite.kept((hint or {}).get("nonfinite")).items():
            self.nonfinite.setdefault(key, n)  # the earlier session's first stays first
        old = (hint or {}).get("dropped")
        if not isinstance(old, list):
            return
        have = {(d.get("cause"), d.get("session")) for d in self.spool_dropped}
        kept = [d for d in old if isinstance(d, dict)
                and (d.get("cause"), d.get("session")) not in have]
        self.spool_dropped = [*kept, *self.spool_dropped][-64:]

    def walked(self, *, create: bool = False) -> _Walked:
        """Within (`with writer.walked():`): the files of the run directory are opened (on
        this thread) from one descriptor of it, walked to once: with an anchor (exprd) each
        walk is an open per directory below it. FileNotFoundError if the directory is
        missing and not `create`; without an anchor (the SDK) nothing is walked."""
        return _Walked(self, create)

    def forget_lock(self) -> None:
        """In a forked child: close this copy of the lock descriptor. The parent keeps the
        lock (an flock lasts while any copy is open), and a child that outlives it, a
        dataloader worker say, does not hold the shard from the next writer."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def _rank(self) -> int | None:
        """The rank of this shard's rows that carry no `_rank`."""
        rank = self.own_rank if self.own_rank is not None else self.identity.get("rank")
        return rank if type(rank) is int else None

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
    def _run_dir_fd(self, create: bool = True, made: list[str] | None = None) -> int:
        """A descriptor of the run directory, created if missing (when `create`; with an
        anchor, the directories made are added to `made`).

        With `anchor` (exprd: the allowed root) every directory below the anchor is opened
        without following a symlink; without one (the SDK) the run directory is the path
        the user gave. Files in it are never opened through a symlink either way.
        """
        held = self._held_dir
        if held is not None and held[1] == threading.get_ident():
            return os.dup(held[0])  # within `open`, on its thread (see there)
        run_dir = self.paths.run_dir
        if self.anchor is None:
            if create:
                run_dir.mkdir(parents=True, exist_ok=True)
            return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if self._below is None:
            self._below = run_dir.relative_to(self.anchor).parts
        try:
            return open_dir(self.anchor, self._below, create=create, made=made)
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

    def scan(self, hint: Mapping[str, Any] | None = None, *, hinted: bool = False) -> Cursor:
        """The shard's cursor, reading only (nothing is created or repaired); `hinted`:
        `hint` is the sidecar just read (else it is read here)."""
        try:
            fd = self.open_file(self.paths.shard.name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return Cursor()
        try:
            return cursor_from(fd, os.fstat(fd).st_size, hint if hinted else self.read_hint())
        finally:
            os.close(fd)

    def read_hint(self) -> dict[str, Any] | None:
        """The sidecar, read without following a symlink; None if missing or unreadable."""
        try:
            fd = self.open_file(self.paths.sidecar.name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, NotRegular):
            return None  # (a directory in its place: its write says so, not the shard's open)
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
                if os.fstat(self._fd).st_nlink > 0 and (
                        self.is_current is None or self.is_current(self._fd)):
                    return self._fd
            except OSError:
                pass
            # the file (or its run directory) was deleted, or moved, under us: start a new one
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

    def append_many(self, data: bytes, rows: int, last_step: int | None = LOOK) -> None:
        """`append` of `rows` whole lines at once (a block of exprd's, up to a megabyte):
        with nothing buffered before them they are written as they are, not copied into
        the buffer and out again (three copies of each block). `last_step`: the `_step`
        of their last step row, None if none is a step row (LOOK: read from the lines)."""
        if self._buf or len(data) < self.flush_bytes or not self._io_lock.acquire(blocking=False):
            self.append(data)
            return
        try:
            self._flush_locked(data, rows, last_step)
        finally:
            self._io_lock.release()

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

    def _flush_locked(self, block: bytes = b"", block_rows: int = 0,
                      block_step: int | None = LOOK) -> bool:
        """Write what is pending, buffered, then `block` (`block_rows` whole lines, the last
        step row's `_step` `block_step`, see `append_many`)."""
        buf = self._buf
        n = len(buf)
        if not n and not self._pending and not block:
            return True
        if n:
            chunk = bytes(buf[:n])
            del buf[:n]
            rows = chunk.count(b"\n")
            if block:
                chunk, rows = chunk + block, rows + block_rows
        else:
            chunk, rows = block, block_rows
        data = self._pending + chunk if self._pending else chunk
        nrows = self._pending_rows + rows
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
            known = written is block and block_step != LOOK
            step = block_step if known else last_row_step(written)
            if step is not None and (self.cursor.last_step is None or step > self.cursor.last_step):
                self.cursor.last_step = step
            self.last_write = time.time()
            if nonfinite.note(written, self.nonfinite, self._rank):
                self.notes_new = True
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
        if op == "sidecar":  # the rows are not what failed: say what is
            what = (f"cannot write sidecar {self.paths.sidecar}: {exc.strerror or exc}; "
                    "the rows are written, the sidecar is retried")
        else:
            what = (f"cannot {op} shard {self.paths.shard}: {exc.strerror or exc}; "
                    "rows are kept in memory and retried")
        # one warning per cause (ENOSPC, EROFS...), whatever the operation: the first says
        # what failed first (the shard's open, on a read-only run root)
        self._warn(f"shard:{cause}", f"expr_tracker: {what}")

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
        if self.probe is not None and self.status == "running":
            out["probe"] = self.probe
        if self.spool_dropped:
            out["dropped"] = self.spool_dropped
        if self.nonfinite:
            out["nonfinite"] = self.nonfinite
        return out

    def write_sidecar(self) -> bool:
        """Atomically rewrite the sidecar; failures are reported (False), never raised."""
        if not self.sidecar_enabled:
            return True
        self.notes_new = False
        try:
            self.store_sidecar(self.sidecar_bytes())
        except OSError as exc:
            self.sidecar_failed(exc)
            return False
        return True

    def sidecar_bytes(self) -> bytes:
        return orjson.dumps(self.sidecar(), option=orjson.OPT_INDENT_2)

    def store_sidecar(self, data: bytes) -> None:
        """Replace the sidecar with `data` (from `sidecar_bytes`), raising OSError: exprd
        builds the bytes on its loop and stores them on its writer thread, which reports
        a failure back through `sidecar_failed`."""
        dfd = self._run_dir_fd()
        try:
            write_atomic_at(dfd, self.paths.sidecar.name, data)
        finally:
            os.close(dfd)

    def sidecar_failed(self, exc: OSError) -> None:
        self._fail("sidecar", exc)

    def append_file(self, name: str, data: bytes) -> bool:
        """Append whole lines to file `name` of the run directory (the span trace): opened
        now, following no symlink. Failures are reported (False), never raised."""
        try:
            fd = self.open_file(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self._fail(name, exc)
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


class _Walked:
    """`ShardWriter.walked` (a class: exprd enters one per new spool file, and a generator
    context manager costs several times as much)."""

    __slots__ = ("create", "fd", "writer")

    def __init__(self, writer: ShardWriter, create: bool) -> None:
        self.writer, self.create, self.fd = writer, create, -1

    def __enter__(self) -> bool:
        """True if this walk made the run directory (it is new, and empty)."""
        writer = self.writer
        if writer.anchor is None or writer._held_dir is not None:
            return False
        made: list[str] = []
        self.fd = writer._run_dir_fd(create=self.create, made=made)
        writer._held_dir = (self.fd, threading.get_ident())
        return bool(made) and made[-1] == writer.paths.run_dir.name

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            self.writer._held_dir = None
            os.close(self.fd)
            self.fd = -1
