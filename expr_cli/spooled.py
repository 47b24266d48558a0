"""Spooled runs not applied yet, and whether exprd is alive (read from the spool itself).

`expr runs` and `expr status` mention them: in spool mode the rows are safe in the
node's spool until an exprd applies them, and the run root may not even exist yet.
exprd's heartbeat `{spool}/.exprd.json` (host, pid, time) says whether one is running.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import orjson
import typer

from expr_tracker.procs import pid_alive
from expr_tracker.store.layout import default_spool
from expr_tracker.store.spoolfile import data_end, is_note

HEARTBEAT_FILE = ".exprd.json"
HEARTBEAT_STALE = 30.0  # seconds without a heartbeat before exprd counts as gone
_TAIL = 64 * 1024

SPOOL_OPT = typer.Option(None, "--spool", metavar="DIR", show_default=False,
                         help="Spool root to look for runs not applied yet "
                              "(default $EXPR_SPOOL or ~/.local/state/expr/spool).")


def spool_root(spool: str | None) -> Path:
    return Path(spool) if spool else default_spool()


def heartbeat(spool: Path) -> dict[str, Any] | None:
    """exprd's last heartbeat in `spool`, or None."""
    try:
        doc = orjson.loads((spool / HEARTBEAT_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def consumer_alive(spool: Path, now: float | None = None) -> bool:
    """True if an exprd left a recent heartbeat (and, on this host, its process lives)."""
    doc = heartbeat(spool)
    if doc is None or not isinstance(doc.get("time"), (int, float)):
        return False
    if (now or time.time()) - doc["time"] > HEARTBEAT_STALE:
        return False
    pid = doc.get("pid")
    if doc.get("host") == socket.gethostname() and type(pid) is int:
        return pid_alive(pid)
    return True


def _first_line(fh: Any) -> dict[str, Any] | None:
    line = fh.readline(1 << 20)
    try:
        ev = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) and ev.get("_event") == "init" else None


def _last_seq(fh: Any, size: int) -> int | None:
    """`_seq` of the last complete event line (read from the end, 64 KiB at most; a
    memory-mapped segment's data ends at its first NUL)."""
    size = data_end(fh.fileno(), size)
    start = max(0, size - _TAIL)
    fh.seek(start)
    data = fh.read(size - start)
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    for line in reversed(lines):
        if is_note(line):
            continue  # a segment marker or a dropped note: no `_seq` of its own
        try:
            seq = orjson.loads(line).get("_seq")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        return seq if type(seq) is int else None
    return None


def _applied(run_dir: Path, stem: str, session: str) -> int:
    """The last seq of `session` the shard's sidecar says is applied (-1 if none)."""
    try:
        side = orjson.loads((run_dir / f"{stem}.meta.json").read_bytes())
        value = side["cursor"]["applied"].get(session, -1)
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return -1
    return value if type(value) is int else -1


def pending(spool: Path, root: Path | None = None,
            committed: Mapping[str, int] | None = None,
            skip: Collection[str] = ()) -> list[dict[str, Any]]:
    """Spool files whose events are not all in their shard yet, per run: project, name,
    run dir, files, events waiting. With `root`, only runs whose run root is `root`.
    `committed` (spool file path -> last seq in its shard, from exprd's status) overrides
    the sidecar's cursor, which exprd rewrites only every few seconds; files in `skip`
    (absolute paths: those exprd refused) are left out."""
    want = str(root.absolute()) if root is not None else None
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        projects = [e for e in os.scandir(spool) if not e.name.startswith(".")
                    and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for proj in projects:
        try:
            names = [e for e in os.scandir(proj.path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for run in names:
            try:
                files = [e for e in os.scandir(run.path) if e.name.endswith(".jsonl")
                         and e.is_file(follow_symlinks=False)]
            except OSError:
                continue
            for f in files:
                if skip and os.path.abspath(f.path) in skip:
                    continue
                try:
                    with open(f.path, "rb") as fh:
                        init = _first_line(fh)
                        last = _last_seq(fh, os.fstat(fh.fileno()).st_size)
                except OSError:
                    continue
                if init is None or last is None or not isinstance(init.get("dir"), str):
                    continue
                if want is not None and init["dir"] != want:
                    continue
                ident = init.get("identity") or {}
                session, stem = str(ident.get("session", "")), str(init.get("stem", ""))
                run_dir = Path(init["dir"]) / proj.name / run.name
                done = max(_applied(run_dir, stem, session), (committed or {}).get(os.path.abspath(f.path), -1))
                waiting = last - max(done, 0)
                if waiting <= 0:
                    continue
                row = runs.setdefault((proj.name, run.name), {
                    "project": proj.name, "name": run.name, "path": str(run_dir),
                    "status": "spooled", "spool_files": 0, "spooled_events": 0})
                row["spool_files"] += 1
                row["spooled_events"] += waiting
    return [runs[k] for k in sorted(runs)]


def mention(rows: list[dict[str, Any]], spool: Path) -> str:
    """One line about spooled runs waiting for exprd."""
    names = ", ".join(f"{r['project']}/{r['name']}" for r in rows[:5])
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    events = sum(r["spooled_events"] for r in rows)
    who = ("exprd is applying them" if consumer_alive(spool)
           else "no exprd is running for it: start exprd to apply them")
    return (f"{len(rows)} spooled run(s) not applied yet ({events} events in {spool}): "
            f"{names}{more}; {who}")
