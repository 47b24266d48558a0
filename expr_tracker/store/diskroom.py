"""How much of its disk a spool segment takes (DESIGN 6, turn 5): the size of the next
segment, the space kept at its end, and reserving blocks without changing a file's size.

`plan_size` is pure: the first segment is small, the next twice the last while they fill
within GROW_WITHIN seconds, up to the bound, and never more than a fair share (1/FAIR) of
the free space: many ranks of one node share a spool disk sized for their data, not for
their preallocation. `fallocate` reserves blocks past a file's end (FALLOC_FL_KEEP_SIZE:
readers see no zeros) and gives them back (PUNCH_HOLE); where the platform or filesystem
cannot, it says so and the writer goes on without (a hint, then: writes find out).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

SEGMENT_BYTES = 4 << 20  # the bound of a segment's size (EXPR_SPOOL_SEGMENT_BYTES)
MAX_SEGMENT = 256 << 20  # the largest bound accepted
START_BYTES = 64 << 10  # the first segment's size (smaller if the bound is)
MIN_SEGMENT = 4096
PAGE = 4096  # reservations are rounded to it (the allocation unit of the usual filesystems)
FAIR = 4  # a new segment reserves at most 1/FAIR of the free space (other ranks share it)
GROW_WITHIN = 10.0  # a segment that filled within this many seconds: the next is twice as big


def pages(n: int) -> int:
    """`n` rounded up to whole pages."""
    return -(-n // PAGE) * PAGE


def reserve_for(size: int) -> int:
    """Bytes at the end of a segment of `size` kept for the marker, notes and finish."""
    return max(2048, min(16 << 10, size // 4))  # a note, the marker, a finish with its exit


def plan_size(last: int, took: float | None, free: int, bound: int) -> int:
    """The size of a session's next segment: START_BYTES first (`took` None), then twice
    the last one's if it filled within GROW_WITHIN seconds, else the same; at most `bound`,
    and at most a fair share (1/FAIR) of the `free` bytes of its disk, rounded down to a
    page; never below MIN_SEGMENT (a disk with less takes rows a page at a time)."""
    size = min(START_BYTES, bound) if took is None else \
        last * 2 if took < GROW_WITHIN else last
    share = free // FAIR // PAGE * PAGE
    return max(MIN_SEGMENT, min(size, bound, share))


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes free for an unprivileged writer on the filesystem of `directory`."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 1 << 62  # cannot tell: sizes follow the rate alone
    return st.f_bavail * st.f_frsize


_FALLOCATE: Any = None  # libc's fallocate(2), loaded at the first call; False: none here
_KEEP_SIZE, _PUNCH_HOLE = 1, 2  # FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE (linux/falloc.h)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)


def fallocate(fd: int, offset: int, length: int, punch: bool = False) -> bool | None:
    """Reserve (or with `punch`, give back) the blocks of [offset, offset+length) without
    changing the file's size: True if done, False if the disk is full (or another error),
    None where the filesystem or the platform cannot (a hint, then: writes find out)."""
    global _FALLOCATE
    if _FALLOCATE is None:
        _FALLOCATE = False
        if sys.platform.startswith("linux"):
            import ctypes  # (only here: spool mode on Linux)

            try:
                fn = ctypes.CDLL(None, use_errno=True).fallocate
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
                fn.restype = ctypes.c_int
                _FALLOCATE = (fn, ctypes.get_errno)
            except (OSError, AttributeError):
                pass
    if _FALLOCATE is False or length <= 0:
        return None if _FALLOCATE is False else True
    fn, get_errno = _FALLOCATE
    if fn(fd, _KEEP_SIZE | (_PUNCH_HOLE if punch else 0), offset, length) == 0:
        return True
    return None if get_errno() in _UNSUPPORTED else False
