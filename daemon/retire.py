"""The end of a spool file's life: a writer gone without `finish`, and retention.

A live file whose writer is gone (or silent for `crash_silence`) is read to its end and
its shard marked `crashed`; only an unterminated last line, read to the end without an
error, is quarantined as a torn tail. Finished, fully applied files are deleted after
`retention`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from expr_tracker.procs import pid_alive
from expr_tracker.store.layout import spool_segment

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
    tail.mtime = st.st_mtime
    if tail.reader is None or not tail.reader.zeros:
        tail.size = st.st_size  # (a segment's data ends at its zeros: the pump says where)
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
    prefix, index = spool_segment(tail.path.name)
    if tail.path.with_name(f"{prefix}~{index + 1}.jsonl").exists():
        # its session went on in the next segment (this is a copy of a moved segment, or
        # the writer died between the two): that one says how the session ended
        log.info("%s: no segment marker, but its session went on in segment %d", tail.path,
                 index + 1)
        tail.state = "rolled"
        tailer.rolled_seen = True
        if tail.run is not None:
            tail.run.rolled()
        return
    if tail.size > tail.offset:
        tailer.log_bad(tail, tail.offset, tail.size, "torn tail: its writer is gone")
        tail.offset, tail.mark = tail.size, None
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
    tail.state = tail.ended = "crashed"
    _cut_zeros(tailer, tail)


def _cut_zeros(tailer: Tailer, tail: FileTail) -> None:
    """A memory-mapped segment whose writer died is zeros after its data: cut them, so the
    file reads like any other (and is not read again at each rescan)."""
    if tailer.dry_run:
        return
    try:
        fd = os.open(tail.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_ino == tail.ino and os.fstat(fd).st_size > tail.offset:
            os.ftruncate(fd, tail.offset)
    except OSError:
        pass
    finally:
        os.close(fd)


def expire_rolled(tailer: Tailer, only: list[FileTail] | None = None) -> bool:
    """Delete the rolled segments every consumer is done with, at once (the daemon loop,
    after a commit); True while some rolled segment is still waiting for a consumer.
    `only`: look at these files alone (a batch of a long round; True then)."""
    expire(tailer, time.time(), only_rolled=True, only=only)
    return only is not None or any(t.state == "rolled" for t in tailer.tails.values())


def expire(tailer: Tailer, now: float, *, only_rolled: bool = False,
           only: list[FileTail] | None = None) -> int:
    """Delete spool files every consumer is done with: a segment its session went on
    from at once (the spool holds only segments in flight), a finished file after the
    retention."""
    removed = 0
    for tail in list(tailer.tails.values()) if only is None else only:
        if tailer.tails.get(tail.key) is not tail:
            continue  # forgotten meanwhile
        if tail.state not in (("rolled",) if only_rolled else ("finished", "rolled")) \
                or tail.run is not None \
                or tail.committed < tail.size:
            continue
        if any(off < tail.size for off in tail.backends.values()):
            continue
        if tail.state == "finished" and now - tail.mtime < tailer.cfg.retention:
            continue
        if tailer.dry_run:
            continue
        try:
            tail.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            tailer.warn(f"unlink:{tail.path}", f"cannot delete {tail.path}: {exc.strerror}")
            continue
        log.info("deleted %s (%s and applied)", tail.path, tail.state)
        tailer.deleted_file(tail)
        removed += 1
    return removed
