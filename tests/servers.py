"""A real `expr serve` in a subprocess on 127.0.0.1 (its port chosen by `--port 0`), and
the real rank processes of examples/train.py, for the serve tests. Stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPR = Path(sys.executable).parent / "expr"
TRAIN = ROOT / "examples" / "train.py"


class Server:
    """`expr serve ARGS` until `stop()`; `url` is what it printed (with any token)."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        self._err = ""  # stderr read so far by status_line
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
        self.proc = subprocess.Popen([str(EXPR), "serve", "--dir", str(root), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://"):
            self.proc.kill()
            raise AssertionError(f"expr serve printed {line!r}; stderr: {self.proc.stderr.read()}")
        self.url = line
        self.port = int(line.split(":")[2].split("/")[0])
        self.base = f"http://127.0.0.1:{self.port}"

    def status_line(self, text: str, within: float = 5.0) -> str | None:
        """The first line of its stderr holding `text` (the status lines come before the
        URL on stdout), or None after `within` seconds of no such line. Reads the pipe's
        bytes itself: nothing else reads this stderr while the server runs."""
        import select

        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            for line in self._err.splitlines(keepends=True):
                if text in line and line.endswith("\n"):
                    return line
            if not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._err += chunk.decode(errors="replace")
        return None

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Stop it with `sig` (Ctrl-C by default); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def train(root: Path, name: str, ranks: Sequence[int], world: int, *args: str) -> list[subprocess.Popen[bytes]]:
    """Start examples/train.py as ranks `ranks` of a `world`-rank job `demo/NAME`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    env.update(EXPR_MODE="direct", WORLD_SIZE=str(world))
    return [subprocess.Popen([sys.executable, str(TRAIN), "--dir", str(root), "--name", name, *args],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for r in ranks]


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    """Wait for rank processes; each must exit 0."""
    deadline = time.monotonic() + timeout
    for p in procs:
        code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        assert code == 0, p.stderr.read().decode() if p.stderr else code


def kill_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """kill -9 each still running, by pid, and reap it."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
