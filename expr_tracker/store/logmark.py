"""The last step `log()` handed over, kept where a `kill -9` cannot take it (DESIGN 6).

Direct mode writes its rows at each flush (about a second): a process killed in between
loses what it queued. To say so, each `log()` also stores its step in a small
memory-mapped file (8 bytes that the kernel keeps when the process dies). The next
session of the shard compares it with the shard's last step: "steps 138-150 not
written: the process was killed" goes into the sidecar and on stderr.

The mapped file is node-local, under the spool directory (`.marks/`, which exprd
skips), never on the run root: a shared mapping of a file on NFS or FUSE blocks the
thread that stores into it while the kernel writes the page back to a server that
does not answer, and blocks the process's exit until it does. The writer thread copies
the step into `.<shard>.logged` beside the shard at each flush, so a session on another
node reads it as of the last flush; one on the same node reads the exact step.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from expr_tracker.store.safedir import make_private_dirs

_STEP = struct.Struct("=q")  # the mapping's memoryview cast("q") writes native order
SIZE = 4096
_INODE = 1  # slot of the shard's inode: a mark is its shard's, not a later one's at its path


def mark_name(shard_name: str) -> str:
    return f".{shard_name}.logged"


def local_path(spool_root: Path, shard: Path) -> Path:
    """The node-local mark of `shard` (any run root, any rank: its absolute path's hash)."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(shard))).hexdigest()[:24]
    return spool_root / ".marks" / f"{digest}.logged"


def read_mark(open_file: Callable[[str, int], int], shard_name: str) -> int | None:
    """The step the previous session stored last beside the shard (None: no mark, or
    nothing logged)."""
    try:
        fd = open_file(mark_name(shard_name), os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, _STEP.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) < _STEP.size:
        return None
    step = _STEP.unpack(data)[0]
    return step if step >= 0 else None


def read_local(path: Path, inode: int) -> int | None:
    """The step in the node-local mark `path`, if it was stored for the shard `inode`."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(2 * _STEP.size)
    except OSError:
        return None
    if len(data) < 2 * _STEP.size or not inode:
        return None
    step, ino = _STEP.unpack_from(data, 0)[0], _STEP.unpack_from(data, _INODE * _STEP.size)[0]
    return step if step >= 0 and ino == inode else None


class LogMark:
    """The mark of this session: `mark[0] = step` stores `step` (a memoryview of the
    node-local mapping: one subscript store, the cheapest write Python has)."""

    def __init__(self, path: Path, inode: int) -> None:
        self.path = path
        self.mm: Any = None
        self.mark: memoryview | None = None
        self._copied = -1
        try:
            make_private_dirs(path.parent)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return  # no mark: a kill's gap goes unreported, nothing else changes
        try:
            os.ftruncate(fd, SIZE)
            # real blocks: the page never faults for space
            os.pwrite(fd, _STEP.pack(-1), 0)
            os.pwrite(fd, _STEP.pack(inode), _INODE * _STEP.size)
            self.mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        self.mark = memoryview(self.mm).cast("q")  # native int64: read on this node, or
        # copied beside the shard by `copy_to` in the same order, as `read_mark` reads it

    def copy_to(self, fd: int) -> None:
        """Store the current step in `fd` (the mark beside the shard), if it changed. Raises
        OSError (the caller, the writer thread, counts it)."""
        mark = self.mark
        if mark is None:
            return
        step = mark[0]
        if step != self._copied:
            os.pwrite(fd, _STEP.pack(step), 0)
            self._copied = step

    def close(self, *, remove: bool = False) -> None:
        """Unmap; `remove`: every row is in the shard (a clean finish), the mark goes too."""
        if self.mark is not None:
            self.mark.release()
            self.mark = None
        if self.mm is not None:
            with contextlib.suppress(OSError, ValueError, BufferError):
                self.mm.close()
            self.mm = None
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
