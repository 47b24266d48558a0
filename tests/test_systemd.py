"""The systemd units verify, and exprd speaks the sd_notify protocol on a real socket."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import env_for
from tests.test_daemon import EXPRD, write_config

UNITS = Path(__file__).resolve().parent.parent / "daemon"
VENV_EXPRD = Path(sys.executable).parent / "exprd"


def _verify(unit: Path, tmp_path: Path, *, user: bool) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart is this venv's exprd."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    assert VENV_EXPRD.exists(), VENV_EXPRD
    text = unit.read_text()
    start = "%h/.local/bin/exprd" if user else "/usr/local/bin/exprd"
    assert f"ExecStart={start} " in text
    copy = tmp_path / ("exprd.service" if not user else "exprd-user.service")
    copy.write_text(text.replace(f"ExecStart={start} ", f"ExecStart={VENV_EXPRD} "))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    cmd = ["systemd-analyze", *(["--user"] if user else []), "verify", str(copy)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**env_for(), "XDG_RUNTIME_DIR": str(runtime)})
    # verify exits 0 on unknown keys too: any message is a finding
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_system_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    unit = UNITS / "exprd.service"
    text = unit.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=exprd",
                 "StateDirectory=exprd", "ReadWritePaths=", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes"):
        assert line in text, line
    _verify(unit, tmp_path, user=False)


def test_user_unit_verifies(tmp_path: Path) -> None:
    unit = UNITS / "exprd-user.service"
    assert "Type=notify" in unit.read_text()
    _verify(unit, tmp_path, user=True)


def _recv(sock: socket.socket, want: str, timeout: float) -> list[str]:
    """Datagrams until one contains `want`; returns all of them."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want!r} within {timeout} s; got {got}"
        sock.settimeout(left)
        msg = sock.recv(4096).decode()
        got.append(msg)
        if want in msg.split("\n"):
            return got


def test_notify_ready_watchdog_stopping_over_a_real_socket(tmp_path: Path) -> None:
    name = f"exprd-test-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)  # `@name` in NOTIFY_SOCKET: the abstract namespace
    spool, state = tmp_path / "spool", tmp_path / "state"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [tmp_path / "runs"], rescan=5.0)
    env = env_for({"NOTIFY_SOCKET": f"@{name}", "WATCHDOG_USEC": "300000"})
    proc = subprocess.Popen([*EXPRD, "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert any(m.startswith("READY=1") for m in _recv(sock, "READY=1", 15))
        t0 = time.monotonic()
        _recv(sock, "WATCHDOG=1", 2)
        _recv(sock, "WATCHDOG=1", 2)
        # half of WATCHDOG_USEC: two pings in well under the 0.3 s deadline each
        assert time.monotonic() - t0 < 1.0
        proc.send_signal(signal.SIGTERM)
        _recv(sock, "STOPPING=1", 10)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        sock.close()
    assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
