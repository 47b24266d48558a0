"""The connections of `expr serve`: a deadline for a request's headers, a bound on how many
are open (issue 43).

uvicorn closes a keep-alive connection that stays idle, never one that sends half a
request and waits: 1,100 of those (a slowloris) took every descriptor of a server at
`ulimit -n 1024`, and a page's own request was refused. Here a connection must send a
whole request line and headers within `header_timeout` seconds of connecting (or of its
last response), and past `max_open` open connections the oldest one still sending its
headers is closed to make room for the new one. A request under way (a page's answer, an
event stream) is never closed by either.
"""

from __future__ import annotations

import os
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds for a request's line and headers (EXPR_SERVE_HEADER_TIMEOUT)


def max_connections() -> int:
    """Half this process's descriptor limit (the rest: shards, pipes, the workers' pipes)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 16
    return max(16, soft // 2)


def header_timeout() -> float:
    """`EXPR_SERVE_HEADER_TIMEOUT` seconds (0.1 or more), else `HEADER_TIMEOUT`."""
    raw = os.environ.get("EXPR_SERVE_HEADER_TIMEOUT", "").strip()
    if not raw:
        return HEADER_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"EXPR_SERVE_HEADER_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not value >= 0.1:
        raise ValueError(f"EXPR_SERVE_HEADER_TIMEOUT must be at least 0.1, got {raw!r}")
    return value


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a bound (see the module docs)."""

    max_open = 512
    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: Any = None
        self._arm()
        if len(self.connections) > self.max_open:
            self._make_room()

    def _arm(self) -> None:
        self.waiting_since = time.monotonic()
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _sending_headers(self) -> bool:
        """No whole request yet (half of one, or nothing since the last response)."""
        return self.conn.their_state is h11.IDLE

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._sending_headers() and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        waiting = [c for c in self.connections if isinstance(c, GuardedH11) and c is not self
                   and c._sending_headers() and not c.transport.is_closing()]
        if waiting:
            min(waiting, key=lambda c: c.waiting_since).transport.close()
        else:  # every one is a request under way: this one waits for none of them
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers get the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def protocol() -> type[GuardedH11]:
    """The protocol class for `uvicorn.Config(http=...)`, bound to this process's limits."""
    return type("ServeH11", (GuardedH11,), {"max_open": max_connections(),
                                            "header_timeout": header_timeout()})
