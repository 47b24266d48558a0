"""Helpers to run real rank processes in tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

CLEAN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_JOB_ID",
         "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
         "EXPR_DIR", "EXPR_MODE", "EXPR_SPOOL", "EXPR_ALERT_CONFIG", "TORCHELASTIC_RUN_ID",
         "EXPR_RUN_NAME")


def env_for(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(extra or {})
    return env


def spawn(code: str, env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start `python -c code` as a real process with a clean rank environment."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env_for(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def run_all(procs: list[subprocess.Popen], timeout: float = 60) -> list[str]:
    """Wait for every process; fail with its stderr if one fails."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank process failed ({p.returncode}):\n{err}"
        outs.append(out)
    return outs


def in_mount_namespace(code: str, timeout: float = 120) -> Any:
    """Run `code` as root of a private mount namespace (`unshare -m`: a tmpfs it mounts is
    its own); its last stdout line is JSON, returned parsed. Skips where there is none."""
    import json

    import pytest

    try:
        out = subprocess.run(["unshare", "-m", sys.executable, "-c", textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=timeout, env=env_for())
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if out.returncode != 0 and ("mount" in out.stderr or "unshare" in out.stderr) \
            and not out.stdout:
        pytest.skip(f"no private mount namespace here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
