"""The last step `log()` handed over, kept where a `kill -9` cannot take it (DESIGN 6, turn 4).

Direct mode writes its rows at each flush (about a second): a process killed in between
loses what it buffered. To say so, each `log()` also stores its step in a small
memory-mapped file beside the shard, `.<shard>.logged` (8 bytes that the kernel keeps when
the process dies). The next session of the shard compares it with the shard's last step:
"steps 138-150 not written: the process was killed" goes into the sidecar and on stderr.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

_STEP = struct.Struct("=q")  # the mapping's memoryview cast("q") writes native order
SIZE = 4096


def mark_name(shard_name: str) -> str:
    return f".{shard_name}.logged"


def read_mark(open_file: Callable[[str, int], int], shard_name: str) -> int | None:
    """The step the previous session stored last (None: no mark, or nothing logged)."""
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


class LogMark:
    """The mark of this session: `mark[0] = step` stores `step` (a memoryview of the
    mapping: one subscript store, the cheapest write Python has)."""

    def __init__(self, open_file: Callable[[str, int], int], shard_name: str) -> None:
        self.mm: Any = None
        self.mark: memoryview | None = None
        try:
            fd = open_file(mark_name(shard_name), os.O_RDWR | os.O_CREAT)
        except OSError:
            return  # no mark: a kill's gap goes unreported, nothing else changes
        try:
            os.ftruncate(fd, SIZE)
            os.pwrite(fd, _STEP.pack(-1), 0)  # real blocks: the page never faults for space
            self.mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        self.mark = memoryview(self.mm).cast("q")  # native int64: the file is node-local
        # in practice; `read_mark` reads it with the same byte order on the same machine

    def close(self) -> None:
        """Unmap (a clean finish: every row is in the shard, the mark equals its last step)."""
        if self.mark is not None:
            self.mark.release()
            self.mark = None
        if self.mm is not None:
            with contextlib.suppress(OSError, ValueError, BufferError):
                self.mm.close()
            self.mm = None
