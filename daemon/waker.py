"""The main loop's wake-up: safe to set from a signal handler and from any thread."""

from __future__ import annotations

import os
import select


class Waker:
    """An Event that a signal handler may set: a self-pipe, no lock.

    `threading.Event.set()` from a signal handler deadlocks when the signal lands while
    the main thread holds the Event's own lock inside `wait()`; writing a byte to a
    pipe is safe from a handler and from any thread.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe is already "set"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (or `timeout` seconds); True if set."""
        while True:
            try:
                ready, _, _ = select.select([self._r], [], [], timeout)
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
            return bool(ready)

    def is_set(self) -> bool:
        return self.wait(0)

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
