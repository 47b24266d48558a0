"""sd_notify: READY=1, WATCHDOG=1, STOPPING=1 over $NOTIFY_SOCKET (AF_UNIX datagram).

No libsystemd needed: the protocol is one datagram of newline-separated KEY=VALUE
pairs to the socket named in $NOTIFY_SOCKET (a leading `@` means the abstract
namespace). Without $NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("exprd")


class Notifier:
    """Sends sd_notify messages; never raises (a lost notification is logged once)."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls) -> Notifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID (the watchdog is for us only)."""
        env = os.environ
        addr = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        try:
            usec = int(env.get("WATCHDOG_USEC", "")) or None
        except ValueError:
            usec = None
        pid = env.get("WATCHDOG_PID")
        if pid and pid.isdigit() and int(pid) != os.getpid():
            usec = None
        return cls(addr, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, as systemd advises."""
        if not self.address or not self.watchdog_usec:
            return None
        return self.watchdog_usec / 2e6

    def send(self, message: str) -> bool:
        """Send one notification; False if there is no socket or it failed."""
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message.encode(), addr)
            return True
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %s failed: %s (further failures not logged)",
                            self.address, exc.strerror or exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
