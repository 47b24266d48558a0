"""`expr tail`: the last rows, then live rows from a shard another process appends to."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.conftest import T0

EXPR = Path(sys.executable).parent / "expr"


def test_last_rows_without_following(cli):
    result = cli("tail", "run-1", "--rank", "2", "-n", "3", "--no-follow")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["37", "38", "39"]
    assert lines[-1].split()[2:] == ["09:53:59", "loss=0.07", "lr=0.0001"]


def test_all_ranks_interleave_by_step_with_a_rank_column(cli):
    result = cli("tail", "run-1", "--rank", "all", "-n", "2", "--no-follow", "-m", "loss")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()]
    # -n counts per rank: the last 2 rows of each of the 8 ranks
    assert [(r[0], r[2]) for r in rows] == [
        *((f"r{k}", "38") for k in range(8)),
        *((f"r{k}", "39") for k in range(8)),
    ]
    assert rows[-1][-1] == "loss=0.12"  # 2/40 + 0.01 * 7


def test_rank_records_are_marked_apart_under_all(cli):
    result = cli("tail", "run-1", "--rank", "all", "-n", "2", "--no-follow", "--rank-records")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    marked = [line for line in lines if "[rank " in line]
    plain = [line for line in lines if "[rank " not in line]
    assert len(marked) == 8 and len(plain) == 8
    assert all("train/loss=" in line for line in marked)
    assert not any("train/loss=" in line for line in plain)


def test_json_lines_with_the_rank_under_all(cli):
    import json

    result = cli("tail", "run-1", "--rank", "all", "-n", "3", "--no-follow", "-m", "loss", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["_rank"], r["_step"]) for r in rows] == [(k, s) for s in (37, 38, 39) for k in range(8)]
    assert all(set(r) == {"_step", "_time", "_rank", "loss"} for r in rows)


def test_rank_records_on_request(cli):
    result = cli("tail", "run-1", "-n", "2", "--no-follow", "--rank-records", "-m", "train/loss")
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    assert "[rank 0]" in last and "train/loss=" in last


def test_a_named_rank_metric_shows_without_the_flag(cli):
    """`-m grad_norm`, a key only rank records hold: its records, marked (before: nothing
    at all, then a silent wait)."""
    result = cli("tail", "run-1", "-n", "2", "--no-follow", "-m", "grad_norm")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("[rank 0]" in ln and "grad_norm=" in ln for ln in lines)
    plain = cli("tail", "run-1", "-n", "2", "--no-follow", "-m", "loss").stdout.splitlines()
    assert len(plain) == 2 and not any("[rank" in ln for ln in plain)


def test_bad_rank(cli):
    result = cli("tail", "run-1", "--rank", "two")
    assert result.exit_code == 2
    assert result.stderr == "error: --rank must be a rank number >= 0 or 'all', got 'two'\n"


class Lines:
    """Lines of a subprocess's stdout, with the time each arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.q: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.q.put((time.time(), line))

    def next(self, timeout: float = 10.0) -> tuple[float, str]:
        return self.q.get(timeout=timeout)


def _start_tail(cli_root: Path, *args: str) -> tuple[subprocess.Popen, Lines]:
    assert EXPR.exists(), f"console script missing: {EXPR}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    env.update(EXPR_DIR=str(cli_root), COLUMNS="100", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(EXPR), "tail", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    return proc, Lines(proc)


def _append(path: Path, step: int, pause: float = 0.0) -> float:
    """Append one row from another process, in two writes `pause` apart; when it completed."""
    code = textwrap.dedent(f"""
        import json, os, sys, time
        line = json.dumps({{"_step": {step}, "_time": {T0 + step}, "loss": 0.5}}).encode() + b"\\n"
        fd = os.open({str(path)!r}, os.O_WRONLY | os.O_APPEND)
        os.write(fd, line[:10])  # half a line: a reader must not show it
        time.sleep({pause})
        os.write(fd, line[10:])
        print(time.time())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tail_follows_a_shard_and_exits_130_on_sigint(cli_root):
    shard = cli_root / "proj" / "run-1" / "metrics.rank2.jsonl"
    proc, lines = _start_tail(cli_root, "run-1", "--rank", "2", "-n", "2", "-m", "loss")
    try:
        assert [lines.next()[1].split()[1] for _ in range(2)] == ["38", "39"]
        written = _append(shard, 40, pause=0.8)
        arrived, line = lines.next(timeout=5)
        assert line.split()[:2] == ["step", "40"] and "loss=0.5" in line
        assert arrived - written < 2.0, f"row took {arrived - written:.2f}s to appear"
        written = _append(shard, 41)
        arrived, line = lines.next(timeout=5)
        assert line.split()[1] == "41" and arrived - written < 2.0
    finally:
        code = _stop(proc)
    err = proc.stderr.read() if proc.stderr else ""
    assert code == 130, err
    # nothing after Ctrl-C: only the "following" line on stderr, no stray stdout
    assert err.splitlines() == ["following proj/run-1 (metrics.rank2.jsonl); Ctrl-C to stop"]
    assert proc.stdout is not None and proc.stdout.read() == ""


def test_tail_all_ranks_picks_up_new_shards(cli_root):
    run = cli_root / "proj" / "run-1"
    proc, lines = _start_tail(cli_root, "proj/run-1", "--rank", "all", "-n", "1")
    try:
        assert [lines.next()[1].split()[:3] for _ in range(8)] == [
            [f"r{k}", "step", "39"] for k in range(8)
        ]  # -n 1 per rank
        (run / "metrics.rank8.jsonl").touch()  # a late rank starts
        time.sleep(1.0)
        written = _append(run / "metrics.rank8.jsonl", 40)
        arrived, line = lines.next(timeout=5)
        assert line.split()[:3] == ["r8", "step", "40"] and arrived - written < 2.0
    finally:
        code = _stop(proc)
    assert code == 130


def test_tail_waits_for_a_run_that_does_not_exist_yet(cli_root):
    proc, lines = _start_tail(cli_root, "proj/later", "-n", "5")
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert first.startswith("waiting for proj/later to appear"), first
        time.sleep(0.7)
        assert proc.poll() is None  # still waiting, not "no run"
        run = cli_root / "proj" / "later"
        run.mkdir()
        (run / "metrics.jsonl").touch()
        assert proc.stderr.readline().startswith("following proj/later")
        written = _append(run / "metrics.jsonl", 0)
        arrived, line = lines.next(timeout=5)
        assert line.split()[:2] == ["step", "0"] and arrived - written < 2.0
    finally:
        code = _stop(proc)
    assert code == 130 and proc.stderr.read() == ""


def test_sigint_while_waiting_exits_130_quietly(cli_root):
    proc, _ = _start_tail(cli_root, "nothing-here")
    assert proc.stderr is not None and proc.stderr.readline().startswith("waiting for nothing-here")
    code = _stop(proc)
    assert code == 130
    assert proc.stderr.read() == "" and proc.stdout is not None and proc.stdout.read() == ""


def test_no_follow_still_fails_on_a_missing_run(cli):
    result = cli("tail", "nothing-here", "--no-follow")
    assert result.exit_code == 1 and result.stderr.startswith("error: no run 'nothing-here'")


def test_a_rank_past_the_world_size_is_an_error_not_a_wait(cli_root):
    """run-1 has 8 ranks: rank 9 will never start writing, so --follow does not wait for it."""
    proc, _ = _start_tail(cli_root, "run-1", "--rank", "9")
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert err == "error: run proj/run-1 has no rank 9: its world size is 8 (ranks: 0-7)\n"
