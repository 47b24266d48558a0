"""One writer per shard (DESIGN 5): the writer lock and its holder.

A writer holds an flock on a lock file next to its shard for as long as it writes;
a second process claiming the same shard (a mis-set `RANK`) is refused at `init`,
named by the host and pid the holder wrote into the lock file. Where locks do not
reach (a network filesystem seen from two hosts), a sidecar that names a running
writer on another host and was rewritten lately refuses too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store.layout import ShardPaths


class ShardBusyError(RuntimeError):
    """Another live process holds the exclusive writer lock of a shard (DESIGN 5)."""


def lock_writer(paths: ShardPaths, rank: int, shared: bool, *,
                sidecar_hint: Mapping[str, Any] | None = None,
                sidecar: Path | None = None) -> int | None:
    """Take the writer lock of shard `paths` for `rank`: the descriptor holding it (keep
    it open; closing it releases the lock), None if the lock file cannot be used.

    An flock on `.{stem}.jsonl.lock` in the shard's directory (`.rank{N}` added in a
    shared rank_aware=False file: one lock per rank), holding the writer's host and pid.
    Raises ShardBusyError naming rank, shard and holder when another process holds it,
    or when `sidecar_hint` names a live writer on another host (where locks may not
    reach; see `_live_writer`).
    """
    path = paths.run_dir / f".{paths.stem}.jsonl{f'.rank{rank}' if shared else ''}.lock"
    fd: int | None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        try:  # another user's lock file: a read-only descriptor takes the lock as well
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = None  # no lock here (read-only or missing directory): writes report it
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ShardBusyError(_busy_message(paths, rank, path, _holder(path))) from None
        except OSError:
            os.close(fd)  # a filesystem without locks: the sidecar check below still runs
            fd = None
    other = _live_writer(sidecar, sidecar_hint) if sidecar is not None else None
    if other:
        if fd is not None:
            os.close(fd)
        raise ShardBusyError(_busy_message(paths, rank, path, other))
    if fd is not None:
        me = orjson.dumps({"host": os.uname().nodename, "pid": os.getpid()})
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
    return fd


def _busy_message(paths: ShardPaths, rank: int, lock: Path, holder: str) -> str:
    return (f"rank {rank}: shard {paths.shard} already has a writer, {holder} "
            f"(lock {lock.name}); two processes with the same rank? check RANK")


def _holder(path: Path) -> str:
    """`host H pid P` from a lock file's contents (best effort)."""
    try:
        info = orjson.loads(path.read_bytes())
        return f"host {info['host']} pid {info['pid']}"
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return "an unknown process"


STALE_SIDECAR = 15.0  # three sidecar periods: a writer that rewrote it since is alive


def _live_writer(sidecar: Path, hint: Mapping[str, Any] | None) -> str | None:
    """`host H pid P` if the sidecar names another writer that looks alive, else None."""
    if not hint or hint.get("status") != "running":
        return None
    host, pid = hint.get("host"), hint.get("pid")
    if type(pid) is not int or not isinstance(host, str):
        return None
    if host == os.uname().nodename:
        return None  # one kernel: the flock has already answered
    try:
        age = time.time() - sidecar.stat().st_mtime
    except OSError:
        return None
    if age > STALE_SIDECAR:
        return None  # crashed a while ago (kill -9 leaves `running`)
    return f"host {host} pid {pid}"
