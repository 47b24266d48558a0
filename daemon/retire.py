"""The end of a spool file's life: a writer gone without `finish`, and retention.

A live file whose writer is gone (or silent for `crash_silence`) is read to its end and
its shard marked `crashed`; only an unterminated last line, read to the end without an
error, is quarantined as a torn tail. Finished, fully applied files are deleted after
`retention`.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from expr_tracker.procs import pid_alive

if TYPE_CHECKING:
    from .filetail import FileTail
    from .tailer import Tailer

log = logging.getLogger("exprd")
HOST = socket.gethostname()


def check_crash(tailer: Tailer, tail: FileTail, now: float,
                alive: dict[tuple[int, int | None], bool] | None = None) -> None:
    """No finish and the writer is gone (or silent too long): the shard is `crashed`.
    `alive`: the writers already looked at in this pass (one process writes many files)."""
    if tail.state != "live":
        return
    try:
        st = tail.path.stat()
    except OSError:
        return
    tail.size, tail.mtime = st.st_size, st.st_mtime
    if tail.host == HOST and tail.pid is not None:
        who = (tail.pid, tail.pid_start)
        found = alive.get(who) if alive is not None else None
        if found is None:
            found = pid_alive(tail.pid, tail.pid_start)
            if alive is not None:
                alive[who] = found
        if found:
            return
        why = f"writer pid {tail.pid} is gone"
    elif now - st.st_mtime > tailer.cfg.crash_silence:
        why = f"silent for {now - st.st_mtime:.0f} s"
    else:
        return
    while tailer.pump(tail, 64 << 20):
        pass
    if tail.state != "live" or not tail.drained:
        return  # not read to its end (a read error, a blocked shard): try again later
    if tail.size > tail.offset:
        tailer.log_bad(tail, tail.offset, tail.size, "torn tail: its writer is gone")
        tail.offset = tail.size
    if tail.run is not None and not tail.run.newest:
        # a stale copy of an older session (a rotated file copied back): no finish is
        # expected in it, and the shard's status is its newer session's
        log.info("%s: no finish and %s; %s keeps its status (a newer session %s wrote it)",
                 tail.path, why, tail.run.spec.paths.shard,
                 tail.run.slot.writer.identity.get("session"))
    else:
        log.warning("%s: no finish and %s; %s %s crashed", tail.path, why,
                    "would mark" if tailer.dry_run else "marking",
                    tail.run.spec.paths.shard if tail.run else "its shard")
    if tail.run is not None:
        tail.run.finish("crashed", now)
    tail.state = "crashed"


def expire(tailer: Tailer, now: float) -> int:
    """Delete finished, fully applied spool files older than the retention."""
    removed = 0
    for tail in list(tailer.tails.values()):
        if tail.state != "finished" or tail.run is not None or tail.committed < tail.size:
            continue
        if any(off < tail.size for off in tail.backends.values()):
            continue
        if now - tail.mtime < tailer.cfg.retention:
            continue
        try:
            tail.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            tailer.warn(f"unlink:{tail.path}", f"cannot delete {tail.path}: {exc.strerror}")
            continue
        log.info("deleted %s (finished and applied)", tail.path)
        tailer.forget(tail)
        removed += 1
    return removed
