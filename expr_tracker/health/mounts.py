"""The filesystem under a run directory, as this host's kernel has it mounted: the mount
holding a path (its type and options, from /proc/self/mountinfo) and the C library, for
the calls Python does not wrap (inotify, statx). Linux only: None elsewhere.

Nothing here reads or writes a run's files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL | None:
    """The C library (loaded once), or None: not Linux, or it cannot be loaded."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            return None
    return _libc


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(filesystem type, "mount options,super options") of the mount holding `path`, or
    None when /proc/self/mountinfo cannot be read. Of mounts on the same point the last
    one is on top, and it is the one seen."""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    best, found = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts, rest = left.split(), right.split()
        if not sep or len(parts) < 6 or not rest:
            continue
        mount = parts[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:
            best = len(mount)
            found = (rest[0], f"{parts[5]},{rest[2]}" if len(rest) > 2 else parts[5])
    return found


# statx(2): AT_EMPTY_PATH | AT_STATX_FORCE_SYNC, STATX_SIZE; the struct is 256 bytes
_AT_EMPTY_PATH, _AT_STATX_FORCE_SYNC, _STATX_SIZE, _STATX_BYTES = 0x1000, 0x2000, 0x200, 256


def revalidate(fd: int) -> bool:
    """Ask the filesystem, not the client's attribute cache, for the open file's size, so
    that the reads that follow see what other hosts appended (an NFS client does this on
    open and on taking a lock; a FUSE mount with `attr_timeout`, bindfs, never does).
    `statx` with AT_STATX_FORCE_SYNC: a no-op on a local filesystem. False where libc has
    no `statx` or the call failed (the cached size is then what the reads see)."""
    statx = getattr(libc(), "statx", None)
    if statx is None:
        return False
    buf = ctypes.create_string_buffer(_STATX_BYTES)
    return bool(statx(fd, b"", _AT_EMPTY_PATH | _AT_STATX_FORCE_SYNC, _STATX_SIZE, buf) == 0)
