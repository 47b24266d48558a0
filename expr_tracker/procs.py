"""Is a process alive? By pid, and by its start time so a recycled pid does not count.

Sidecars and spool init events record `pid` and `pid_start`; exprd, the health readers and
`expr shards`/`expr status` ask whether that writer still runs.
"""

from __future__ import annotations

import os


def proc_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None.

    Stored in the init event so exprd can tell a dead writer from a reused pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """True if process `pid` runs (not a zombie) and, when known, started at `start`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    tail = stat[stat.rfind(b")") + 2 :].split()
    if not tail or tail[0] in (b"Z", b"X"):
        return False
    if start is None:
        return True
    try:
        return int(tail[19]) == start  # what proc_start reads, from the same read
    except (ValueError, IndexError):
        return False
