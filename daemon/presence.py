"""Who consumes this spool: one exprd per state directory and per spool root, and a heartbeat.

Each of the two directories is held with an `flock` on the directory itself, so a
second exprd exits 2 with one line naming the first one's pid. `{spool}/.exprd.json` (host, pid, time, state directory), rewritten every few
seconds, tells the SDK and `expr status` that a consumer is alive (DESIGN 8).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

import orjson

from expr_tracker.store.safedir import write_atomic_at

from .durable import Durable

log = logging.getLogger("exprd")
HEARTBEAT_FILE = ".exprd.json"
HEARTBEAT_EVERY = 5.0  # seconds between heartbeat rewrites


class Locked(Exception):
    """Another exprd holds the state directory or the spool root (the message names it)."""


def hold(dir_path: Path, what: str) -> int:
    """Take an exclusive flock on directory `dir_path` for the life of this process; returns
    its fd. Raises Locked naming the holder's pid if another process has it.

    The lock is on the directory itself, so taking it writes nothing (a replay leaves the
    spool as it found it); the holder's pid comes from /proc/locks.
    """
    fd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        st = os.fstat(fd)
        os.close(fd)
        raise Locked(f"another exprd (pid {_holder(st.st_dev, st.st_ino)}) holds {what} "
                     f"{dir_path}") from None
    except OSError:
        os.close(fd)
        raise
    return fd


def _holder(dev: int, ino: int) -> str:
    """The pid holding an flock on (dev, ino), from /proc/locks ("?" if not found)."""
    want = (os.major(dev), os.minor(dev), ino)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters have "->")
                if len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                major, minor, inode = parts[5].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == want:
                    return parts[4]
    except (OSError, ValueError):
        pass
    return "?"


class Presence:
    """The spool root's lock and heartbeat (taken once the spool root exists)."""

    def __init__(self, spool: Path, state: Path | None = None) -> None:
        self.spool = spool
        self.state = state  # named in the heartbeat, so `expr status` finds status.json
        self.fd: int | None = None
        self.next_beat = 0.0
        self.warned = False
        # exprd's writer thread: a heartbeat that is not forced is stored there (its
        # fsync never holds the loop); None writes it here
        self.durable: Durable | None = None

    def claim(self) -> bool:
        """Lock the spool root if not yet done; False if it does not exist yet.

        Raises Locked if another exprd consumes this spool.
        """
        if self.fd is not None:
            return True
        try:
            self.fd = hold(self.spool, "the spool root")
        except FileNotFoundError:
            return False
        except Locked:
            raise
        except OSError as exc:
            if not self.warned:
                self.warned = True
                log.warning("cannot lock the spool root %s: %s", self.spool, exc.strerror or exc)
            return False
        return True

    def beat(self, force: bool = False) -> None:
        """Rewrite `{spool}/.exprd.json` if it is due (every few seconds)."""
        now = time.monotonic()
        if self.fd is None or (not force and now < self.next_beat):
            return
        self.next_beat = now + HEARTBEAT_EVERY
        doc: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        if self.state is not None:
            doc["state"] = str(self.state.absolute())
        data = orjson.dumps(doc)
        if self.durable is not None and not force:
            self.durable.submit(str(self.spool / HEARTBEAT_FILE), lambda: self._store(data),
                                self._stored)
            return
        try:
            self._store(data)
        except OSError as exc:
            self._stored(exc)

    def _store(self, data: bytes) -> None:
        dfd = os.open(self.spool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            write_atomic_at(dfd, HEARTBEAT_FILE, data, mode=0o644)
        finally:
            os.close(dfd)

    def _stored(self, exc: BaseException | None) -> None:
        if exc is not None and not self.warned:
            self.warned = True
            log.warning("cannot write the heartbeat in %s: %s", self.spool,
                        getattr(exc, "strerror", None) or exc)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
