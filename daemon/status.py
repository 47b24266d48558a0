"""`{state}/status.json`: files tracked, lag per file, backend queues, alerts, errors.

`expr status` reads it; it is rewritten atomically every few seconds and at exit.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from .state import StateDir
    from .tailer import Tailer

STATUS_FILE = "status.json"


def build(tailer: Tailer, *, started: float, mode: str, dispatcher: Any = None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status document of a running (or just finished) exprd."""
    now = time.time()
    mono = time.monotonic()
    files: dict[str, Any] = {}
    totals = {"files": 0, "live": 0, "rolled": 0, "finished": 0, "crashed": 0, "refused": 0, "new": 0,
              "lag_bytes": 0, "applied": 0, "skipped": 0, "quarantined": 0, "blocked": 0}
    backends: dict[str, dict[str, int]] = {}
    for key, tail in sorted(tailer.tails.items()):
        lag = max(tail.size - tail.offset, 0)
        entry: dict[str, Any] = {
            "state": tail.state,
            "size": tail.size,
            "offset": tail.offset,
            "committed": tail.committed,
            "lag_bytes": lag,
            "lag_seconds": round(mono - tail.behind_since, 3) if tail.behind_since else 0.0,
            "seq": tail.seq,
            "committed_seq": tail.committed_seq,
            "applied": tail.applied,
            "skipped": tail.skipped,
            "quarantined": tail.quarantined,
        }
        if tail.reason:
            entry["reason"] = tail.reason
        if tail.ended:
            entry["ended"] = tail.ended
        if tail.replaced is not None and tail.replaced[0] == "rotated":
            # a new file took the name: what it brought (a copy repeats what was applied)
            entry["replaced"] = {"applied": tail.applied - tail.replaced[1],
                                 "skipped": tail.skipped - tail.replaced[2]}
        run = tail.run
        if run is not None and run.blocked:
            # rows the shard could not take yet: they stay in the spool, retried
            entry["blocked"] = run.blocked
            entry["lag_bytes"] = max(tail.size - tail.committed, 0)
            totals["blocked"] += 1
        if tail.read_error:
            entry["read_error"] = tail.read_error
        if run is not None:
            entry["shard"] = str(run.spec.paths.shard)
            for name, stats in run.backend_stats().items():
                agg = backends.setdefault(name, {"pending": 0, "sent": 0, "failed": 0,
                                                 "dropped": 0})
                for k in agg:
                    agg[k] += int(stats.get(k, 0))
        files[key] = entry
        totals["files"] += 1
        # a file read to a finish event that says crashed counts as crashed: the numbers
        # are the sessions' ends, as `expr shards` tells the shards
        counted = tail.ended if tail.state in ("finished", "crashed") and tail.ended else tail.state
        totals[counted] = totals.get(counted, 0) + 1
        totals["lag_bytes"] += entry["lag_bytes"]
        totals["applied"] += tail.applied
        totals["skipped"] += tail.skipped
        totals["quarantined"] += tail.quarantined
    out: dict[str, Any] = {
        "version": 1,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "mode": mode,
        "started": started,
        "updated": now,
        "spool": str(tailer.spool_root),
        "totals": totals,
        "files": files,
        "backends": backends,
        "alerts": dispatcher.stats() if dispatcher is not None else {},
        "errors": dict(tailer.errors),
        # files deleted once applied (no longer in `files`) and what they brought
        "deleted": dict(tailer.deleted),
        # events lost to what another process did to spool files, by cause
        "dropped": dict(tailer.dropped),
        "open_files": tailer.pool.open_files(),
    }
    if extra:
        out.update(extra)
    return out


def encode(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def write(sdir: StateDir, doc: dict[str, Any]) -> None:
    """Atomically replace `{state}/status.json`."""
    sdir.write_atomic(STATUS_FILE, encode(doc))


def read(state: Path) -> dict[str, Any]:
    """The last status written under `state` (OSError or ValueError if there is none)."""
    data = orjson.loads((state / STATUS_FILE).read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{state / STATUS_FILE} is not a status document")
    return data
