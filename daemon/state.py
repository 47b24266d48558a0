"""The `{state}` directory: checkpoints.json (per-file offsets) and the quarantine dir.

The directory is opened once; every file exprd writes in it is opened from that
descriptor without following a symlink (DESIGN 8).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store.safedir import open_below, open_file, write_all, write_atomic_at

from .durable import Durable

log = logging.getLogger("exprd")
Warn = Callable[[str, str], None]
QUARANTINE_COPY = 64 * 1024  # bytes of a bad line kept; the index has its full length


class StateDir:
    """exprd's state directory, held open for the daemon's life (no descriptor in dry runs)."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.fd: int | None = None
        if not readonly:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace `{state}/name` (temp file, fsync, rename; no symlink followed)."""
        if self.fd is None:
            return
        write_atomic_at(self.fd, name, data, mode=0o600)

    def subdir(self, name: str) -> int:
        """A new descriptor of `{state}/name`, created 0700 if missing (the caller closes it)."""
        assert self.fd is not None
        return open_below(self.fd, [name], mode=0o700, where=self.path)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _log_warn(cause: str, message: str) -> None:
    log.error("%s", message)


def _cause(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


class Checkpoints:
    """`{state}/checkpoints.json`: per spool file, its offsets and what is known about it."""

    NAME = "checkpoints.json"

    def __init__(self, sdir: StateDir, warn: Warn = _log_warn,
                 durable: Durable | None = None) -> None:
        self.sdir = sdir
        self.warn = warn
        self.path = sdir.path / self.NAME
        self.readonly = sdir.readonly
        self.files: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self.saved_at = 0.0
        self.durable = durable  # the writer thread that stores it (None: written here)
        self.writing = False  # a snapshot is on its way to the disk
        try:
            data = orjson.loads(self.path.read_bytes())
            files = data.get("files") if isinstance(data, dict) else None
            if isinstance(files, dict):
                self.files = {k: v for k, v in files.items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning("checkpoints %s unreadable (%s); starting from the shards' own state",
                        self.path, exc)
        self._prune_gone()

    def _prune_gone(self) -> None:
        """Drop the entries of files that no longer exist: an exprd killed after deleting
        a rolled segment but before saving left its entry on disk, and nothing would ever
        track that file again to drop it (the next save writes the pruned set)."""
        for key in list(self.files):
            try:
                os.lstat(key)
            except FileNotFoundError:
                del self.files[key]
                self.dirty = True
            except OSError:
                pass  # unreadable is not gone: keep what is known about it

    def put(self, key: str, entry: dict[str, Any]) -> None:
        if self.files.get(key) != entry:
            self.files[key] = entry
            self.dirty = True

    def drop(self, key: str) -> None:
        if self.files.pop(key, None) is not None:
            self.dirty = True

    def save(self, on_disk: Callable[[], None] | None = None) -> None:
        """Atomically rewrite the file if something changed; `on_disk()` once what is in
        `files` now is on disk (at once if nothing changed).

        With a writer thread the bytes are taken here and written there: the snapshot
        counts as saved (`saved_at`, `on_disk`) only once it is durable, a failed write
        leaves the state dirty (retried at the next save), and a new snapshot waits until
        the last one is done, so that a checkpoint never overtakes a sidecar it covers
        (see `durable`). Until then a restart reads from the last one on disk: the
        shard's `_sid`/`_seq` make that re-read harmless."""
        if self.readonly or self.writing:
            return
        if not self.dirty:
            if on_disk is not None:
                on_disk()
            return
        data = orjson.dumps({"version": 1, "files": self.files})
        self.dirty = False
        if self.durable is None:
            try:
                self.sdir.write_atomic(self.NAME, data)
            except OSError as exc:
                self._stored(exc, on_disk)
                return
            self._stored(None, on_disk)
            return
        self.writing = True
        sdir, name = self.sdir, self.NAME
        self.durable.submit(str(self.path), lambda: sdir.write_atomic(name, data),
                            lambda exc: self._stored(exc, on_disk))

    def _stored(self, exc: BaseException | None, on_disk: Callable[[], None] | None) -> None:
        self.writing = False
        if exc is not None:
            self.dirty = True
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.warn(f"checkpoints:{_cause(exc) if isinstance(exc, OSError) else 'error'}",
                      f"cannot write checkpoints {self.path}: {why}")
            return
        self.saved_at = time.monotonic()
        if on_disk is not None:
            on_disk()


def quarantine_name(src: Path, start: int) -> str:
    """`<hash of the spool path>.<file name>.<offset>.bad`: two runs' files of the same
    name never share a quarantine file."""
    digest = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    return f"{digest}.{src.name}.{start}.bad"


class Quarantine:
    """`{state}/quarantine/`: bad lines with their file, offset and reason in `index.jsonl`.

    A bad line is copied up to `QUARANTINE_COPY` bytes (its full length is in the index).
    """

    def __init__(self, sdir: StateDir, warn: Warn = _log_warn) -> None:
        self.sdir = sdir
        self.warn = warn
        self.root = sdir.path / "quarantine"
        self.readonly = sdir.readonly
        self.count = 0

    def put(self, src: Path, start: int, end: int, reason: str, *, copy: bool = True) -> None:
        """Copy bytes [start, end) of `src` aside (capped) and index them."""
        self.count += 1
        entry: dict[str, Any] = {"time": time.time(), "file": str(src), "offset": start,
                                 "length": end - start, "reason": reason}
        if self.readonly or self.sdir.fd is None:
            return
        try:
            dfd = self.sdir.subdir("quarantine")
            try:
                if copy and end > start:
                    name = quarantine_name(src, start)
                    kept = _copy_range(src, dfd, name, start, min(end, start + QUARANTINE_COPY))
                    entry["saved"] = name
                    if kept < end - start:
                        entry["saved_bytes"] = kept
                fd = open_file(dfd, "index.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                               0o600, where=self.root)
                try:
                    write_all(fd, orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))
                finally:
                    os.close(fd)
            finally:
                os.close(dfd)
        except OSError as exc:
            self.warn(f"quarantine:{_cause(exc)}",
                      f"cannot write quarantine {self.root}: {exc.strerror or exc}")


def _copy_range(src: Path, dfd: int, name: str, start: int, end: int) -> int:
    """Copy bytes [start, end) of `src` to `name` in directory `dfd`; returns bytes copied."""
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = open_file(dfd, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pos = start
            while pos < end:
                chunk = os.pread(sfd, min(end - pos, 1 << 20), pos)
                if not chunk:
                    break
                write_all(out, chunk)
                pos += len(chunk)
            return pos - start
        finally:
            os.close(out)
    finally:
        os.close(sfd)
