"""`exprd --replay --progress json`: the lines `expr replay` reads from its child's stdout."""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

SUMMARY_KEYS = ("files", "applied", "skipped", "quarantined", "finished", "crashed", "refused",
                "live")


def replay_summary(doc: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    """What one pass did, from its status document (the object `expr replay --json` prints):
    the files it deleted once applied (`deleted`) are in the counts too."""
    totals, gone = doc.get("totals", {}), doc.get("deleted") or {}
    out = {k: int(totals.get(k, 0)) + int(gone.get(k, 0)) for k in SUMMARY_KEYS}
    return {"dry_run": dry_run, **out, "deleted": int(gone.get("files", 0))}


class JsonProgress:
    """`--progress json`: one JSON object per line on stdout, nothing else there.

    Lines: `{"type": "progress", "files_done", "files_total", "events", "events_per_s"}`
    (at most every `every` seconds, and once at the end), then one
    `{"type": "summary", ...replay_summary}` or `{"type": "error", "message"}`.
    """

    def __init__(self, every: float = 0.1) -> None:
        # stdout must carry only these lines: whatever else prints to it (a backend's
        # library, a stray print) is sent to stderr, next to the log lines
        self.out = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        self.every = every
        self.start = time.monotonic()
        self.due = 0.0
        self.last: tuple[int, int, int] | None = None
        self.shown = True

    def emit(self, obj: dict[str, Any]) -> None:
        """Write one object as a line and flush it (the reader renders as it goes)."""
        self.out.write(orjson.dumps(obj).decode() + "\n")
        self.out.flush()

    def __call__(self, done: int, total: int, events: int) -> None:
        self.last, self.shown = (done, total, events), False
        now = time.monotonic()
        if now >= self.due:
            self.due = now + self.every
            self._progress(now)

    def _progress(self, now: float) -> None:
        if self.last is None:
            return
        done, total, events = self.last
        self.shown = True
        self.emit({"type": "progress", "files_done": done, "files_total": total,
                   "events": events, "events_per_s": round(events / max(now - self.start, 1e-6), 1)})

    def summary(self, summary: dict[str, Any]) -> None:
        """The last progress (if not yet shown), then the summary."""
        if not self.shown:
            self._progress(time.monotonic())
        self.emit({"type": "summary", **summary})

    def error(self, message: str) -> None:
        """The one failure line; the exit code says it failed."""
        self.emit({"type": "error", "message": message})
