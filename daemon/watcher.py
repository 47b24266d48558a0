"""The watchdog observer on the spool root: only a wake-up hint.

inotify overflows and network filesystems lose events, so the daemon also rescans
periodically; a missed event costs latency, never data. `--poll` swaps in the
PollingObserver (stat-based) for filesystems without inotify.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirMovedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from .waker import Waker

log = logging.getLogger("exprd")

# Opened/closed events are left out on purpose: exprd's own reads would wake it up.
_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent, FileModifiedEvent, FileMovedEvent, FileDeletedEvent,
    DirCreatedEvent, DirMovedEvent,
]


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = [event.src_path, getattr(event, "dest_path", "")]
        self.watcher._hint([p if isinstance(p, str) else p.decode() for p in paths if p],
                           event.is_directory)


class Watcher:
    """Collects paths of spool files that changed and wakes the main loop."""

    def __init__(self, root: Path, wake: Waker | threading.Event, *, poll: bool = False,
                 poll_interval: float = 1.0) -> None:
        self.root = root
        self.wake = wake
        self.poll = poll
        self.poll_interval = poll_interval
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self.rescan_needed = False
        self._observer: BaseObserver | None = None
        self._failed = False

    def _hint(self, paths: list[str], is_dir: bool) -> None:
        spool = [p for p in paths if p.endswith(".jsonl")]
        if not is_dir and not spool:
            return  # exprd's own heartbeat and lock files, temp files: nothing to read
        with self._lock:
            if is_dir:
                self.rescan_needed = True
            self._dirty.update(spool)
        self.wake.set()

    def take(self) -> tuple[set[str], bool]:
        """The changed file paths and whether a directory appeared, since the last call."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            rescan, self.rescan_needed = self.rescan_needed, False
        return dirty, rescan

    @property
    def running(self) -> bool:
        return self._observer is not None

    def start(self) -> bool:
        """Start observing (False if the spool root does not exist yet; retried by the caller)."""
        if self._observer is not None:
            return True
        if self._failed or not self.root.is_dir():
            return False
        observer: BaseObserver = (
            PollingObserver(timeout=self.poll_interval) if self.poll else Observer()
        )
        try:
            observer.schedule(_Handler(self), str(self.root), recursive=True, event_filter=_EVENTS)
            observer.daemon = True
            observer.start()
        except OSError as exc:
            # e.g. the inotify watch limit: the periodic rescan still finds everything
            log.warning("cannot watch %s (%s); relying on the periodic rescan",
                        self.root, exc.strerror or exc)
            self._failed = True
            return False
        self._observer = observer
        return True

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=2.0)
