"""Health benchmarks: one watcher pass over many live rank shards; exprd idle CPU while watching.

    python bench/health.py [RANKS] [ROWS] [IDLE_SECONDS]

defaults 4096, 200 and 30. Synthetic shards: every rank `ROWS` step rows and rank
records, a `running` sidecar naming this host and this (live) process. Prints a
markdown table. Target (issue 11): exprd idle CPU with watching on under 1% of a core.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.watch import Watcher

EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]
TICK = os.sysconf("SC_CLK_TCK")


def make_run(run: Path, ranks: int, rows: int) -> None:
    run.mkdir(parents=True)
    t0 = time.time() - rows
    host, pid = socket.gethostname(), os.getpid()
    for r in range(ranks):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        lines = []
        for s in range(rows):
            lines.append(orjson.dumps({"_step": s, "_time": t0 + s, "loss": 1.0 / (s + 1)}))
            lines.append(orjson.dumps({"_kind": "rank", "_step": s, "_time": t0 + s, "_rank": r,
                                       "_world_size": ranks, "_local_rank": r % 8, "_weight": 1.0,
                                       "step_time": 1.0 + (r % 7) * 0.01}))
        (run / f"{stem}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        side = {"version": 1, "project": run.parent.name, "name": run.name, "stream": None,
                "rank": r, "world_size": ranks, "local_rank": r % 8, "local_world_size": 8,
                "session": "s", "host": host, "pid": pid, "status": "running",
                "start_time": t0, "end_time": None, "last_write": t0 + rows}
        (run / f"{stem}.meta.json").write_bytes(orjson.dumps(side))


def one_pass(run: Path) -> tuple[float, float, float, float, int]:
    w = Watcher(run, HealthConfig())
    c0, t0 = time.process_time(), time.perf_counter()
    w.check()
    c1, t1 = time.process_time(), time.perf_counter()
    w.check()  # nothing changed: a stat per shard and sidecar
    c2, t2 = time.process_time(), time.perf_counter()
    return c1 - c0, t1 - t0, c2 - c1, t2 - t1, len(w.state.ranks if w.state else {})


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def exprd_idle(tmp: Path, root: Path, seconds: float) -> float:
    spool, state = tmp / "spool", tmp / "state"
    cfg = tmp / "exprd.toml"
    cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                   f"allowed_roots = {json.dumps([str(root)])}\n"
                   f"watch_roots = {json.dumps([str(root)])}\n")
    proc = subprocess.Popen([*EXPRD, "--config", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(15)  # start-up, the first root scan and the first (cold) passes
        c0, t0 = cpu_of(proc.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_of(proc.pid) - c0) / (time.monotonic() - t0)
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    idle = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        big = tmp / "runs" / "bench" / "big"
        make_run(big, ranks, rows)
        cold_cpu, cold_wall, warm_cpu, warm_wall, n = one_pass(big)
        assert n == ranks, n
        small_root = tmp / "small"
        make_run(small_root / "bench" / "live", 64, rows)
        idle_cpu = exprd_idle(tmp, small_root, idle)
    print("| measure | value | target | met |")
    print("|---|---|---|---|")
    print(f"| watcher pass, {ranks:,} live shards x {rows} steps, first (tails read) | "
          f"{cold_wall * 1000:,.0f} ms wall, {cold_cpu * 1000:,.0f} ms CPU | | |")
    print(f"| watcher pass, same shards, nothing new | {warm_wall * 1000:,.0f} ms wall, "
          f"{warm_cpu * 1000:,.0f} ms CPU | | |")
    print(f"| `exprd` idle {idle:.0f} s, watching one live 64-rank run (watch_roots) | "
          f"{idle_cpu * 100:.2f}% of a core | < 1% | {'yes' if idle_cpu < 0.01 else 'no'} |")


if __name__ == "__main__":
    main()
