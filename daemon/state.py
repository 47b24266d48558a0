"""The `{state}` file stores: checkpoints.json (per-file offsets) and the quarantine dir."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store.shard import write_atomic

log = logging.getLogger("exprd")


class Checkpoints:
    """`{state}/checkpoints.json`: per spool file, its offsets and what is known about it."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.files: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self.saved_at = 0.0
        try:
            data = orjson.loads(path.read_bytes())
            files = data.get("files") if isinstance(data, dict) else None
            if isinstance(files, dict):
                self.files = {k: v for k, v in files.items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning("checkpoints %s unreadable (%s); starting from the shards' own state",
                        path, exc)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        if self.files.get(key) != entry:
            self.files[key] = entry
            self.dirty = True

    def drop(self, key: str) -> None:
        if self.files.pop(key, None) is not None:
            self.dirty = True

    def save(self) -> None:
        """Atomically rewrite the file if something changed."""
        if not self.dirty or self.readonly:
            return
        try:
            write_atomic(self.path, orjson.dumps({"version": 1, "files": self.files}))
            self.dirty = False
            self.saved_at = time.monotonic()
        except OSError as exc:
            log.error("cannot write checkpoints %s: %s", self.path, exc.strerror or exc)


class Quarantine:
    """`{state}/quarantine/`: bad lines with their file, offset and reason in `index.jsonl`."""

    def __init__(self, root: Path, *, readonly: bool = False) -> None:
        self.root = root
        self.readonly = readonly
        self.count = 0

    def put(self, src: Path, start: int, end: int, reason: str, *, copy: bool = True) -> None:
        """Copy bytes [start, end) of `src` aside (streamed) and index them."""
        self.count += 1
        entry: dict[str, Any] = {"time": time.time(), "file": str(src), "offset": start,
                                 "length": end - start, "reason": reason}
        if self.readonly:
            return
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if copy and end > start:
                dest = self.root / f"{src.name}.{start}.bad"
                _copy_range(src, dest, start, end)
                entry["saved"] = dest.name
            fd = os.open(self.root / "index.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot write quarantine %s: %s", self.root, exc.strerror or exc)


def _copy_range(src: Path, dest: Path, start: int, end: int) -> None:
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        fin.seek(start)
        left = end - start
        while left > 0:
            chunk = fin.read(min(left, 1 << 20))
            if not chunk:
                break
            fout.write(chunk)
            left -= len(chunk)
