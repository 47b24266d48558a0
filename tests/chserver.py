"""A real ClickHouse server for tests: Debian's `clickhouse-server`, on a free 127.0.0.1
port, with its config, data and logs under a test's temporary directory.

The server listens on HTTP only (no native TCP port, no interserver port) and is stopped
by its pid. Tests that need it skip, naming the reason, when the binary is not installed
(`.ci/run` installs it with apt-get).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BINARY = "clickhouse-server"

CONFIG = """<?xml version="1.0"?>
<yandex>
    <logger>
        <level>warning</level>
        <log>{dir}/log/server.log</log>
        <errorlog>{dir}/log/error.log</errorlog>
        <console>0</console>
    </logger>
    <http_port>{port}</http_port>
    <listen_host>127.0.0.1</listen_host>
    <path>{dir}/data/</path>
    <tmp_path>{dir}/tmp/</tmp_path>
    <user_files_path>{dir}/user_files/</user_files_path>
    <format_schema_path>{dir}/format_schemas/</format_schema_path>
    <users_config>users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <mark_cache_size>67108864</mark_cache_size>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
    <max_concurrent_queries>50</max_concurrent_queries>
</yandex>
"""

USERS = """<?xml version="1.0"?>
<yandex>
    <profiles>
        <default></default>
        <readonly><readonly>1</readonly></readonly>
    </profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
        <writer>
            <password>{password}</password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </writer>
        <reader>
            <password>{password}</password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>readonly</profile>
            <quota>default</quota>
        </reader>
    </users>
    <quotas><default></default></quotas>
</yandex>
"""

PASSWORD = "s3cret-test-only"  # the `writer` and `reader` users', for the credentials tests
# `reader` has the profile `readonly` (readonly=1), as docs/backends.md recommends for dashboards


def binary() -> str:
    """The server binary, or skip the test naming why."""
    path = shutil.which(BINARY) or (f"/usr/sbin/{BINARY}" if Path(f"/usr/sbin/{BINARY}").exists()
                                    else None)
    if path is None:
        pytest.skip("clickhouse-server is not installed (apt-get install clickhouse-server; "
                    ".ci/run does it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ClickHouse:
    """One server process; `start()`/`stop()` may be called again (same data, same port)."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        for sub in ("log", "data", "tmp", "user_files", "format_schemas"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        (workdir / "config.xml").write_text(CONFIG.format(dir=workdir, port=self.port))
        (workdir / "users.xml").write_text(USERS.format(password=PASSWORD))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until `/ping` answers."""
        assert self.proc is None
        out = open(self.dir / "log" / "stdout.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(
                [binary(), f"--config-file={self.dir / 'config.xml'}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir)
        finally:
            out.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/ping", timeout=1) as resp:
                    if resp.read().strip() == b"Ok.":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "log" / "error.log")
                text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                self.stop()
                raise AssertionError(f"clickhouse-server did not start:\n{text}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM by pid, wait; SIGKILL if it does not go."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def query(self, sql: str) -> str:
        """Run `sql` as the default user; the answer as text (raises on an error)."""
        url = self.url + "/?" + urllib.parse.urlencode({"query": sql})
        req = urllib.request.Request(url, data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{sql}: {exc.read().decode(errors='replace')}") from None

    def count(self, sql: str) -> int:
        return int(self.query(sql).strip())
