"""Shared test set-up: every test runs in its own directory with a clean environment."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import browser, page  # noqa: F401  (the page's tests' fixtures)

# Variables that change what the code under test does: rank detection, run roots,
# spool and mode, terminal width and colour, shell completion.
_EXACT = frozenset((
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "TORCHELASTIC_RUN_ID", "NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE",
    "COLUMNS", "LINES", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES",
    "_EXPR_COMPLETE", "_TYPER_COMPLETE_ARGS",
))
_PREFIXES = ("SLURM_", "OMPI_COMM_WORLD_", "PMI_", "EXPR_")


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Drop rank/world, SLURM_*, EXPR_*, NO_COLOR/COLUMNS and friends; UTC; chdir to tmp_path."""
    for name in list(os.environ):
        if name in _EXACT or name.startswith(_PREFIXES):
            monkeypatch.delenv(name)
    # system metrics (DESIGN 19) add rank records to every run; the tests that pin exact
    # shard contents predate them, and tests/test_sysmetrics.py turns them on
    monkeypatch.setenv("EXPR_SYSTEM_METRICS", "0")
    # the default spool (and direct mode's node-local step marks) under the test's tmp
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    # wall-clock times in CLI output must not depend on the machine's time zone
    old_tz = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if old_tz is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old_tz
        time.tzset()


# -- CLI fixtures: run directories with fixed contents, times and mtimes --------------

T0 = 1_764_410_000.0  # 2025-11-29 09:53:20 UTC, the `_time` of step 0
NOW = T0 + 3 * 3600.0  # what `EXPR_NOW` says in CLI tests: ages are relative to it
WORLD = 8
STEPS = 40


def _line(rec: dict) -> bytes:
    import json

    return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def write_shard(path: Path, recs: list[dict], tail: bytes = b"", mtime: float | None = None) -> int:
    """Write records as JSONL (plus a raw `tail`); returns the size of the complete lines."""
    body = b"".join(_line(r) for r in recs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body + tail)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return len(body)


def write_sidecar(path: Path, *, rank: int, stream: str | None, rows: int, nbytes: int,
                  last_step: int | None, status: str = "finished", world: int = WORLD) -> None:
    """A sidecar as the writer makes it (DESIGN 5), with fixed identity and times."""
    import json

    meta = {
        "version": 1, "project": path.parent.parent.name, "name": path.parent.name,
        "stream": stream, "rank": rank, "world_size": world, "local_rank": rank,
        "session": "s0", "rank_aware": True, "config": {}, "host": "node-1", "pid": 4242,
        "cursor": {"bytes": nbytes, "rows": rows, "last_step": last_step,
                   "next_step": (last_step or 0) + 1, "applied": {}},
        "status": status, "start_time": T0, "end_time": None if status == "running" else T0 + STEPS,
        "last_write": T0 + STEPS,
    }
    path.write_text(json.dumps(meta, indent=2))


def rank_value(rank: int, step: int) -> float:
    """train/loss of `rank` at `step`: a decaying curve, small fixed jitter, rank 6 drifting late."""
    jitter = ((rank * 7 + step * 3) % 11 - 5) * 0.001
    return round(2.0 / (step + 1) + 0.3 + jitter + (0.5 if rank == 6 and step >= 35 else 0.0), 6)


def build_cli_root(root: Path) -> Path:
    """The CLI test runs under `root`:

    - proj/run-1: 8 ranks x 40 steps of step rows and rank records; rank 6 an outlier
      from step 35; rank 3 misses steps 36 and 38; rank 5's grad_norm is NaN at step 39.
      Sidecars: rank 2 running and behind, rank 5 with a torn tail, rank 7 none.
      A second stream `data` on rank 0. Alerts from ranks 0 and 3.
    - proj/run-2: one shard, step rows only, one garbage line.
    - proj/zero: an empty shard.  proj/hollow: a run directory without shards.
    - other/run-3: one small shard.
    """
    run = root / "proj" / "run-1"
    for r in range(WORLD):
        recs: list[dict] = []
        for s in range(STEPS):
            t = T0 + s
            recs.append({"_step": s, "_time": t, "loss": round(2.0 / (s + 1) + 0.01 * r, 6), "lr": 1e-4})
            if r == 3 and s in (36, 38):
                continue
            grad = float("nan") if (r == 5 and s == 39) else round(1.0 + 0.05 * ((r + s) % 5), 6)
            recs.append({"_kind": "rank", "_step": s, "_time": t + 0.5, "_rank": r, "_world_size": WORLD,
                         "_local_rank": r, "_weight": 1000.0 + 10 * r, "train/loss": rank_value(r, s),
                         "grad_norm": grad})
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        tail = b'{"_step":40,"_time":1764410040.0,"lo' if r == 5 else b""
        nbytes = write_shard(run / f"{stem}.jsonl", recs, tail, mtime=T0 + STEPS + r)
        if r == 7:
            continue
        if r == 2:
            write_sidecar(run / f"{stem}.meta.json", rank=r, stream=None, rows=len(recs) - 10,
                          nbytes=nbytes - 1000, last_step=34, status="running")
        else:
            write_sidecar(run / f"{stem}.meta.json", rank=r, stream=None, rows=len(recs),
                          nbytes=nbytes, last_step=STEPS - 1)
    data = [{"_step": s, "_time": T0 + 10 * s, "tokens": 4096 * (s + 1), "source": "web"} for s in range(3)]
    nbytes = write_shard(run / "metrics.data.jsonl", data, mtime=T0 + 30)
    write_sidecar(run / "metrics.data.meta.json", rank=0, stream="data", rows=3, nbytes=nbytes, last_step=2)
    alert = {"project": "proj", "run": "run-1", "stream": None, "kind": "fire"}
    write_shard(run / "alerts.jsonl", [
        {**alert, "title": "loss spike", "text": "train/loss 0.81 > 0.8", "level": "warning",
         "rule": "train/loss > 0.8", "step": 36, "time": T0 + 36, "rank": 0, "delivered": True},
        {**alert, "title": "manual", "text": "checkpoint saved", "level": "info", "rule": None,
         "kind": "manual", "step": None, "time": T0 + 20, "rank": 0, "delivered": True},
    ])
    write_shard(run / "alerts.rank3.jsonl", [
        {**alert, "title": "grad", "text": "grad_norm 1.2 > 1.15", "level": "error",
         "rule": "grad_norm > 1.15", "step": 3, "time": T0 + 3, "rank": 3, "delivered": False},
    ], tail=b"not json\n")
    run2 = root / "proj" / "run-2"
    recs = [{"_step": s, "_time": T0 + s, "loss": 1.0 / (s + 1), "acc": s / 10} for s in range(10)]
    body = b"".join(_line(r) for r in recs[:5]) + b"garbage{{\n" + b"".join(_line(r) for r in recs[5:])
    run2.mkdir(parents=True)
    (run2 / "metrics.jsonl").write_bytes(body)
    os.utime(run2 / "metrics.jsonl", (T0 + 100, T0 + 100))
    write_shard(root / "proj" / "zero" / "metrics.jsonl", [], mtime=T0)
    (root / "proj" / "hollow").mkdir(parents=True)
    write_shard(root / "other" / "run-3" / "metrics.jsonl",
                [{"_step": 0, "_time": T0, "loss": 3.0}], mtime=T0 + 5)
    return root


@pytest.fixture
def cli_root(tmp_path: Path) -> Path:
    """A run root with the CLI test runs (see `build_cli_root`)."""
    return build_cli_root(tmp_path / "runs")


@pytest.fixture
def cli(cli_root: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`cli("summary", "run-1")` -> typer Result; width 100, frozen clock, root = cli_root."""
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    app = build_app()
    runner = CliRunner()
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("EXPR_NOW", str(NOW))
    monkeypatch.setenv("EXPR_DIR", str(cli_root))

    def invoke(*args: str, **env: str):  # type: ignore[no-untyped-def]
        return runner.invoke(app, list(args), env=env or None)

    return invoke


GOLDEN_DIR = Path(__file__).parent / "golden"
_UPDATE_GOLDEN = bool(os.environ.get("UPDATE_GOLDEN"))  # read before the env is cleaned


@pytest.fixture
def golden():  # type: ignore[no-untyped-def]
    """`golden("name.txt", text)`: compare with tests/golden/name.txt (UPDATE_GOLDEN=1 rewrites)."""

    def check(name: str, text: str) -> None:
        # rich pads table cells with spaces; editors strip them, so neither side keeps them
        text = "\n".join(line.rstrip() for line in text.split("\n"))
        path = GOLDEN_DIR / name
        if _UPDATE_GOLDEN:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
        assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
        expected = path.read_text(encoding="utf-8")
        assert text == expected, f"output differs from {path}:\n{text}"

    return check
