"""What changed in a run directory, from the kernel (inotify), for a long-lived reader.

A `RunReader` that is kept for hours (`expr serve`'s live state) would otherwise learn
that nothing changed by `stat`ing every shard on every pass: a quarter of a second at
16,384 ranks. One inotify watch on the run directory reports every entry written,
created, removed or renamed in it; `DirChanges.drain()` hands the names seen since the
last drain to the reader without blocking (no thread: the reader drains at its pass).

inotify is a hint the reader checks, never the only truth (DESIGN 14): the queue can
overflow (`IN_Q_OVERFLOW`: then `drain` says "unknown" and the reader stats everything),
a network filesystem reports only this host's writes (so only local filesystem types get
a watch, and the reader's periodic full pass drops the watch if it ever finds a change
the kernel did not report), and any failure to set it up means no watch at all.

Linux only; nothing here reads or writes the files themselves.
"""

from __future__ import annotations

import ctypes
import os
import struct

from expr_tracker.health.mounts import libc, mount_of

# <sys/inotify.h>
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = (
    0x400, 0x800, 0x2000, 0x4000, 0x8000)
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
        | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW)
_LISTING = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE  # the entries themselves
_GONE = IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT  # the watch itself ends
_HEAD = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ = 1 << 20  # bytes per read of the queue (a 16,384-event queue is about 1 MB)
# filesystems whose every change, whoever makes it, is seen by this kernel's inotify; a
# network or cluster filesystem (nfs, lustre, gpfs, cifs, fuse...) reports only ours
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs",
                      "f2fs", "jfs", "reiserfs", "ramfs", "bcachefs"})

def _lib() -> ctypes.CDLL | None:
    """libc with the inotify calls' argument types set, or None (not Linux, no inotify)."""
    lib = libc()
    if lib is None:
        return None
    try:
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except AttributeError:
        return None
    return lib


def fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding `path` (/proc/self/mountinfo); None if unknown."""
    found = mount_of(path)
    return found[0] if found is not None else None


class DirChanges:
    """One inotify watch on one directory. `drain()`: the entry names written or touched
    since the last drain and whether any entry was created, removed or renamed; None when
    events may have been lost (overflow, the directory itself gone or moved)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.overflows = 0  # drains that found the queue had overflowed (or the watch gone)

    def drain(self) -> tuple[set[str], set[str]] | None:
        """(names changed, names created/removed/renamed), each a set of entry names."""
        if self.fd is None:
            return None
        names: set[str] = set()
        listing: set[str] = set()
        lost = gone = False
        while True:
            try:
                buf = os.read(self.fd, _READ)
            except BlockingIOError:
                break
            except OSError:
                self.close()
                return None
            if not buf:
                break
            pos, end = 0, len(buf)
            while pos + 16 <= end:
                _, mask, _, size = _HEAD.unpack_from(buf, pos)
                pos += 16
                if mask & (IN_Q_OVERFLOW | _GONE):
                    lost = True
                    gone = gone or bool(mask & _GONE)
                elif size:
                    name = buf[pos:pos + size].rstrip(b"\0").decode("utf-8", "surrogateescape")
                    names.add(name)
                    if mask & _LISTING:
                        listing.add(name)
                pos += size
        if gone:  # no more events will come: the reader stats everything from now on
            self.close()
        if lost:
            self.overflows += 1
            return None
        return names, listing

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


def watch_dir(path: str | os.PathLike[str], local_only: bool = True) -> DirChanges | None:
    """A `DirChanges` on `path`, or None: not Linux, not a local filesystem (`local_only`),
    the inotify limits reached, or any other failure (the caller then stats as before)."""
    lib = _lib()
    if lib is None:
        return None
    text = os.fspath(path)
    if local_only and fs_type(text) not in LOCAL_FS:
        return None
    fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        return None
    if lib.inotify_add_watch(fd, os.fsencode(text), MASK) < 0:
        os.close(fd)
        return None
    return DirChanges(fd)
