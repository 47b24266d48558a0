"""How `expr status` prints exprd's state: a head line, the totals, a row per spool file
grouped under its run, the backends, channels and errors. A render module (rich lazily,
as in `render`).

A spool file's path is `{project}/{name}/{shard-stem}.{session}.jsonl` under the spool
(DESIGN 6): as one cell it folded in two at 80 columns even for a short run name. The run
is a line of its own, above its files, each file named by the rest of its path (the stem
and session, without `.jsonl`), so the table keeps the numbers' columns at any width.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import STATUS_STYLE, console, fmt_age, fmt_bytes, prose

if TYPE_CHECKING:
    from rich.console import Console

COLUMNS = ("state", "seq", "in shard", "lag", "lag s", "quarantined")
INDENT = "  "  # a file under its run
MIN_FILE = 12  # the least a file name column takes before it folds


def file_rows(files: Mapping[str, Mapping[str, Any]], spool: str) -> list[dict[str, Any]]:
    """`status.json`'s files as rows: the run (its directory under the spool), the file
    name within it, and each column's text; by run, then file."""
    rows = []
    for path, f in files.items():
        rel = os.path.relpath(path, spool) if spool and path.startswith(spool) else path
        run, _, name = rel.rpartition(os.sep)
        raw = str(f.get("state"))
        if raw in ("finished", "crashed") and f.get("ended") in ("finished", "crashed"):
            raw = str(f["ended"])  # how its session ended, as `expr shards` says
        state = "blocked" if f.get("blocked") else raw
        rows.append({
            "run": run, "file": name.removesuffix(".jsonl"), "path": rel,
            "style": "bold red" if f.get("blocked") else STATUS_STYLE.get(
                {"live": "running"}.get(raw, raw), ""),
            "cells": [state, str(f.get("seq")), str(f.get("committed_seq", "")),
                      fmt_bytes(int(f.get("lag_bytes", 0))),
                      f"{float(f.get('lag_seconds', 0.0)):.1f}", str(f.get("quarantined", 0))],
            "why": (f"blocked: {f['blocked']}" if f.get("blocked") else
                    str(f["reason"]) if f.get("reason") else None),
            "blocked": bool(f.get("blocked")),
        })
    rows.sort(key=lambda r: (r["run"], r["file"]))
    return rows


def _fold(name: str, width: int) -> list[str]:
    """`name` under its run: indented, in pieces of `width` (the indent included)."""
    room = max(1, width - len(INDENT))
    return [INDENT + name[i:i + room] for i in range(0, len(name), room)] or [INDENT]


def status(doc: Mapping[str, Any], running: bool) -> None:
    """The head, the totals and the files of exprd's `status.json`, then its backends,
    alert channels and errors."""
    from rich.text import Text

    out = console()
    totals = doc.get("totals", {})
    # (the spool's path last: where a line is too long, it is what wraps)
    out.print(Text(f"exprd pid {doc.get('pid')} ({'running' if running else 'not running'}), "
                   f"updated {fmt_age(doc.get('updated'))}, {doc.get('mode')}, "
                   f"spool {doc.get('spool')}", style="bold"))
    out.print(Text(
        f"{totals.get('files', 0)} spool files: {totals.get('live', 0)} live, "
        f"{totals.get('rolled', 0)} rolled over, "
        f"{totals.get('finished', 0)} finished, {totals.get('crashed', 0)} crashed, "
        f"{totals.get('refused', 0)} refused, {totals.get('blocked', 0)} blocked", style="dim"))
    ended = _ended_by_run(doc.get("files", {}), str(doc.get("spool") or ""))
    if ended:  # what a user checks against `expr shards RUN`: its sessions' ends
        out.print(Text("ended here: " + "; ".join(
            f"{run} {', '.join(f'{n} {k}' for k, n in sorted(c.items()))}"
            for run, c in ended.items()), style="dim"))  # (folded at the width, as the rest)
    out.print(Text(f"lag {fmt_bytes(totals.get('lag_bytes', 0))}; "
                   f"{totals.get('quarantined', 0)} quarantined", style="dim"))
    rows = file_rows(doc.get("files", {}), str(doc.get("spool") or ""))
    if rows:
        _files(out, rows)
    for r in rows:
        if r["why"]:
            out.print(Text(f"{r['path']}: {r['why']}", style="red" if r["blocked"] else "dim"),
                      soft_wrap=True)


def _ended_by_run(files: Mapping[str, Mapping[str, Any]], spool: str) -> dict[str, dict[str, int]]:
    """By run (its directory under the spool): how many sessions ended in its files,
    finished or crashed (a session ends in one file, its last segment)."""
    out: dict[str, dict[str, int]] = {}
    for path, f in files.items():
        ended = f.get("ended")
        if ended not in ("finished", "crashed"):
            continue
        rel = os.path.relpath(path, spool) if spool and path.startswith(spool) else path
        c = out.setdefault(rel.rpartition(os.sep)[0] or ".", {})
        c[ended] = c.get(ended, 0) + 1
    return dict(sorted(out.items()))


def refused(paths: Mapping[str, str], files: Mapping[str, Any]) -> None:
    """The spool files exprd refused that its file table does not show (a symlink, another
    user's file: never tailed), each with the reason, in red."""
    from rich.text import Text

    shown = {os.path.abspath(p) for p in files}
    rest = sorted((p, r) for p, r in paths.items() if p not in shown)
    if not rest:
        return
    out = console()
    out.print(Text(f"{len(rest)} spool file(s) refused by exprd (not applied):", style="bold red"))
    for path, why in rest:
        out.print(Text(f"  {path}: {why}", style="red"), soft_wrap=True)


def _files(out: Console, rows: Sequence[Mapping[str, Any]]) -> None:
    """The file table: numbers right-aligned in columns as wide as their widest cell, the
    file name in the room left (folded, never cut, when a name is longer than that)."""
    from rich.text import Text

    widths = [max(len(h), *(len(r["cells"][i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    gap = 2
    name_w = max(len(INDENT) + len(r["file"]) for r in rows)
    if name_w + sum(widths) + gap * len(widths) > out.width:
        gap = 1
    room = out.width - sum(widths) - gap * len(widths)
    name_w = max(MIN_FILE, min(max(name_w, len("file")), room))

    def line(name: str, cells: Sequence[str], style: str = "", state_style: str = "") -> Text:
        text = Text(name.ljust(name_w), style=style)
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            text.append(" " * gap)
            text.append(cell.ljust(w) if i == 0 else cell.rjust(w),
                        style=state_style if i == 0 else style)
        return text

    out.print(line("file", COLUMNS, "bold"), no_wrap=True, crop=False)
    run = None
    for r in rows:
        if r["run"] != run:
            run = r["run"]
            prose(out, Text(run or ".", style="bold"))
        parts = _fold(r["file"], name_w)
        out.print(line(parts[0], r["cells"], state_style=r["style"]), no_wrap=True, crop=False)
        for more in parts[1:]:
            out.print(Text(more), no_wrap=True, crop=False)


def services(doc: Mapping[str, Any]) -> None:
    """exprd's backends, alert channels and error counts, a line each."""
    from rich.text import Text

    out = console()
    for name, b in (doc.get("backends") or {}).items():
        out.print(f"backend {name}: {b.get('pending', 0)} queued, {b.get('sent', 0)} sent, "
                  f"{b.get('failed', 0)} failed, {b.get('dropped', 0)} dropped",
                  soft_wrap=True, highlight=False)
    for name, a in (doc.get("alerts") or {}).items():
        out.print(f"alert channel {name}: {a.get('sent', 0)} sent, {a.get('failed', 0)} failed, "
                  f"{a.get('pending', 0)} pending", soft_wrap=True, highlight=False)
    for cause, n in (doc.get("dropped") or {}).items():
        out.print(Text(f"dropped {cause}: {n} events", style="red"), soft_wrap=True)
    for cause, n in (doc.get("errors") or {}).items():
        out.print(Text(f"error {cause}: {n}", style="red"), soft_wrap=True)
