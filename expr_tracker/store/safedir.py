"""Opening directories and files below a root without following symlinks (DESIGN 8).

A path checked once (when exprd reads a run's init event) proves nothing about the
moment of writing: a symlink can appear in the run directory later. So every directory
below the root is opened with O_NOFOLLOW from the descriptor of its parent, starting at
the root's own, and every file from the descriptor of its directory. A symlink, or
anything that is not what it should be, fails the open with `UnsafePath`, whatever
happened between the check and the write.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR | os.O_NOFOLLOW


class UnsafePath(OSError):
    """A symlink, hard link or special file where exprd would write (the message says where)."""


class NotRegular(UnsafePath):
    """A FIFO, socket, device or directory where a regular file belongs (the message says where)."""


def _link_target(name: str, dir_fd: int) -> str:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return "?"


def _unsafe(exc: OSError, name: str, dir_fd: int, where: Path) -> OSError:
    """UnsafePath for an open refused because `name` is a symlink; `exc` itself otherwise."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return exc
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return exc
    if stat.S_ISLNK(st.st_mode):
        return UnsafePath(errno.ELOOP, f"{where / name} is a symlink to "
                                       f"{_link_target(name, dir_fd)!r}")
    if exc.errno == errno.ENOTDIR:
        return UnsafePath(errno.ENOTDIR, f"{where / name} is not a directory")
    return exc


def open_dir(root: Path, parts: Sequence[str], *, create: bool = True, mode: int = 0o755,
             made: list[str] | None = None) -> int:
    """A descriptor of `root/parts...`, every part opened without following symlinks.

    `root` itself is the configured (already resolved) root; it is created if missing
    when `create`, like the parts below it (those this call made are added to `made`).
    """
    try:
        fd = os.open(root, _DIR)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, _DIR)
    try:
        return open_below(fd, parts, create=create, mode=mode, where=root, made=made)
    finally:
        os.close(fd)


def open_below(dir_fd: int, parts: Sequence[str], *, create: bool = True, mode: int = 0o755,
               where: Path | None = None, made: list[str] | None = None) -> int:
    """A new descriptor of `parts...` below directory `dir_fd` (which stays open), every
    part opened without following symlinks and created if missing when `create` (the
    parts this call made are added to `made`)."""
    fd = os.dup(dir_fd)
    base = where or Path(".")
    # the path of a part is built only for an error message (pathlib is slow on the way)
    try:
        for i, name in enumerate(parts):
            try:
                nfd = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                    if made is not None:
                        made.append(name)
                except FileExistsError:
                    pass  # made meanwhile (or a symlink put there: the open below says so)
                try:
                    nfd = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
                except OSError as exc:
                    raise _unsafe(exc, name, fd, base.joinpath(*parts[:i])) from None
            except OSError as exc:
                raise _unsafe(exc, name, fd, base.joinpath(*parts[:i])) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, flags: int, mode: int = 0o644, *,
              where: Path | None = None) -> int:
    """Open `name` in directory `dir_fd` without following a symlink; only a regular file
    with one link is accepted (a hard link to a file elsewhere is refused too)."""
    # O_NONBLOCK: a FIFO put there must not hang the open; it is refused just below
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                     dir_fd=dir_fd)
    except OSError as exc:
        raise _unsafe(exc, name, dir_fd, where or Path(".")) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, f"{(where or Path('.')) / name} is not a regular file")
        if st.st_nlink > 1:
            raise UnsafePath(errno.EMLINK, f"{(where or Path('.')) / name} has "
                                           f"{st.st_nlink} hard links")
    except BaseException:
        os.close(fd)
        raise
    if flags & (os.O_WRONLY | os.O_RDWR):
        os.set_blocking(fd, True)
    return fd


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A read-only descriptor of `path`, refused (`NotRegular`) unless it is a regular file.

    A FIFO put where a shard, sidecar or incidents file belongs would block the open, and
    every run a watcher serves behind it, for good: O_NONBLOCK makes the open return, and
    the `fstat` refuses it. `follow=False` refuses a symlink too (ELOOP)."""
    return open_regular_stat(path, follow=follow)[0]


def open_regular_stat(path: str | os.PathLike[str], *, follow: bool = True) -> tuple[
        int, os.stat_result]:
    """`open_regular`, and the `fstat` it took of the descriptor."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            refused_special(os.fspath(path))
            raise NotRegular(errno.EINVAL, f"{os.fspath(path)} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_all(fd: int, size: int) -> bytes:
    """The bytes of an open regular file from its start to its end (`size` as `fstat` gave
    it, and whatever it grew by since)."""
    parts = []
    pos = 0
    while True:
        want = max(size - pos, 0) + 4096
        got = os.pread(fd, want, pos)
        parts.append(got)
        pos += len(got)
        if len(got) < want:  # (a regular file's short read is its end)
            return got if len(parts) == 1 else b"".join(parts)


_said: set[str] = set()


def refused_special(path: str) -> None:
    """Say once per path and process that `path`, not a regular file, is not read (the
    readers skip it; a watcher would say so every pass)."""
    if path in _said or len(_said) >= 10_000:
        return
    _said.add(path)
    import logging

    logging.getLogger("expr_tracker").warning(
        "expr_tracker: %s is not a regular file (a FIFO, socket or device): not read", path)


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    """`open(path, "rb")` of a regular file only (`open_regular`), named by its path."""
    fh = open(open_regular(path), "rb")  # noqa: SIM115 - the caller's
    fh.raw.name = os.fspath(path)  # type: ignore[attr-defined]  # (for messages)
    return fh


def write_atomic_at(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `name` in `dir_fd` with `data`: temp file, fsync, rename, no symlink followed."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        # rename never follows a symlink at the destination: it replaces the link itself
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        # a full disk, or a directory in the way: no temp file left behind, each attempt
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until everything is written (short writes happen on some filesystems)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def make_private_dirs(path: Path) -> None:
    """Create `path` and any missing parents with mode 0700 (the spool and
    the node-local marks are private; also made again under a live session whose
    directory was deleted)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # the umask must not widen or narrow it
