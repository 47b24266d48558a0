"""Health benchmarks: watcher passes over many live rank shards; exprd's CPU while watching.

    python bench/health.py [RANKS] [ROWS] [IDLE_SECONDS] [CURVE] [LIVE_RANKS] [LIVE_SECONDS] \
        [STALL_RANKS]
    python bench/health.py stall [STALL_RANKS] [ROWS]      # the stall table only (64 rows)

defaults 4096, 200, 30, "1024,4096,16384", 4096, 60 and 16384. Synthetic shards: every rank `ROWS`
step rows and rank records, a `running` sidecar naming this host and this (live) process.
Prints markdown tables:
- one watcher over RANKS shards: a first pass (tails read) and a pass with nothing new;
- the repeat-pass curve over CURVE rank counts: nothing new, and 1% of the shards (and
  their sidecars) written since the last pass; target: nothing new at 16,384 ranks well
  under 0.2 s;
- exprd watching through `watch_roots`: one idle 64-rank run (target under 1% of a core)
  and one live LIVE_RANKS-rank run a writer process appends a step to every second, for
  LIVE_SECONDS (target about 10% of a core at most: passes are paced by their cost);
- a stalled STALL_RANKS-rank run (no rank advanced for 10 minutes; every sidecar holds a
  probe, all but one rank's in a collective): the stall detector alone (suspects and
  detail), and a watcher's repeat pass with the stall open, beside a repeat pass over
  a run of the same size that is not stalled.
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
from typing import Any

import orjson

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.watch import Watcher

EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]
TICK = os.sysconf("SC_CLK_TCK")


COLLECTIVE = {"waiting": "collective", "spans": ["step"],
              "where": ["torch/distributed/distributed_c10d.py:2501 all_reduce",
                        "train.py:80 main [user]"]}
SLEEPING = {"waiting": "sleep", "spans": ["step", "data"],
            "where": ["train.py:88 time.sleep", "train.py:88 main [user]"]}


def make_run(run: Path, ranks: int, rows: int, pid: int | None = None, *,
             stalled_for: float | None = None) -> None:
    """`stalled_for`: every shard last written that long ago, every sidecar with a probe
    (rank ranks // 2 sleeping, the others in a collective)."""
    run.mkdir(parents=True)
    t0 = time.time() - rows - (stalled_for or 0.0)
    host, pid = socket.gethostname(), pid or os.getpid()
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
        if stalled_for is not None:
            probe = SLEEPING if r == ranks // 2 else COLLECTIVE
            side["probe"] = {"since": t0 + rows, "time": t0 + rows + 2, **probe}
        (run / f"{stem}.meta.json").write_bytes(orjson.dumps(side))
        if stalled_for is not None:
            os.utime(run / f"{stem}.jsonl", (t0 + rows, t0 + rows))


def _settle(run: Path) -> None:
    """Date the run directory back: a watcher trusts a directory listing only once the
    directory is a few seconds old (`health.state.DIR_SETTLE`); a real run's is."""
    past = time.time() - 60
    os.utime(run, (past, past))


def _timed(fn: object) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0, time.process_time() - c0


def _touch(run: Path, ranks: list[int], step: int, world: int) -> None:
    """Append a step row and a rank record to these ranks' shards and rewrite their sidecars
    (temp file and rename, as writers do)."""
    from expr_tracker.store.cursor import write_atomic

    t = time.time()
    for r in ranks:
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        with open(run / f"{stem}.jsonl", "ab") as fh:
            fh.write(orjson.dumps({"_step": step, "_time": t, "loss": 0.5}) + b"\n"
                     + orjson.dumps({"_kind": "rank", "_step": step, "_time": t, "_rank": r,
                                     "_world_size": world, "step_time": 1.0}) + b"\n")
        side = run / f"{stem}.meta.json"
        meta = orjson.loads(side.read_bytes())
        meta["last_write"] = t
        write_atomic(side, orjson.dumps(meta))


def repeat_curve(tmp: Path, sizes: list[int], rows: int) -> list[dict[str, float]]:
    """Per run size: a watcher's first pass, passes with nothing new and passes after 1%
    of the shards changed (best of five: the machine is shared)."""
    out = []
    for n in sizes:
        run = tmp / "curve" / "bench" / f"r{n}"
        make_run(run, n, rows)
        _settle(run)
        w = Watcher(run, HealthConfig())
        first, first_cpu = _timed(w.check)
        idle = min(_timed(w.check) for _ in range(5))
        changed = []
        step = rows
        for k in range(5):
            pick = list(range(k, n, 100))  # 1% of the ranks, a different 1% each time
            _touch(run, pick, step, n)
            step += 1
            changed.append((*_timed(w.check), w.reader.shards_read))
            assert w.reader.shards_read == len(pick), (w.reader.shards_read, len(pick))
        best = min(changed)
        out.append({"ranks": n, "first": first, "first_cpu": first_cpu, "idle": idle[0],
                    "idle_cpu": idle[1], "one_pct": best[0], "one_pct_cpu": best[1],
                    "read": best[2]})
    return out


def one_pass(run: Path) -> tuple[float, float, float, float, int]:
    w = Watcher(run, HealthConfig())
    c0, t0 = time.process_time(), time.perf_counter()
    w.check()
    c1, t1 = time.process_time(), time.perf_counter()
    w.check()  # nothing changed: a stat per shard and sidecar
    c2, t2 = time.process_time(), time.perf_counter()
    return c1 - c0, t1 - t0, c2 - c1, t2 - t1, len(w.state.ranks if w.state else {})


def stall_pass(tmp: Path, n: int, rows: int) -> dict[str, Any]:
    """The stall detector over a stalled n-rank run, and repeat passes with and without a
    stall (best of five each, side by side: the machine is shared)."""
    from expr_tracker.health.stall import stall

    cfg = HealthConfig(hang_after=60.0)
    run = tmp / "stall" / "bench" / f"s{n}"
    make_run(run, n, rows, stalled_for=600.0)
    now = time.time()  # every tracker thread rewrote its probe just now
    for side in run.glob("*.meta.json"):
        os.utime(side, (now, now))
    _settle(run)
    calm = tmp / "stall" / "bench" / f"c{n}"
    make_run(calm, n, rows)
    _settle(calm)
    stalled, steady = Watcher(run, cfg), Watcher(calm, cfg)
    opened = stalled.check()
    found = [(i.kind, i.ranks) for i in opened]
    assert found == [("stall", (n // 2,))], [(k, len(r)) for k, r in found]
    steady.check()
    state = stalled.state
    assert state is not None
    detector = min(_timed(lambda: stall(state, 60.0, time.time())) for _ in range(5))
    with_stall = min(_timed(stalled.check) for _ in range(5))
    without = min(_timed(steady.check) for _ in range(5))
    return {"ranks": n, "detector": detector[0], "detector_cpu": detector[1], "with": with_stall[0], "with_cpu": with_stall[1],
            "without": without[0], "without_cpu": without[1], "detail": opened[0].detail}


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of `pid` and of its children it waited for (forked readers)."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / TICK


WRITER = """
import os, sys, time, orjson
run, n = sys.argv[1], int(sys.argv[2])
step = int(sys.argv[3])
sys.stdin.readline()  # the run is written
fds = [os.open(os.path.join(run, ("metrics" if r == 0 else f"metrics.rank{r}") + ".jsonl"),
               os.O_WRONLY | os.O_APPEND) for r in range(n)]
print("ready", flush=True)
while True:  # one step a second on every rank, as a job with 1 s steps
    t = time.time()
    for r, fd in enumerate(fds):
        os.write(fd, orjson.dumps({"_step": step, "_time": t, "loss": 0.5}) + b"\\n"
                 + orjson.dumps({"_kind": "rank", "_step": step, "_time": t, "_rank": r,
                                 "_world_size": n, "step_time": 1.0}) + b"\\n")
    step += 1
    time.sleep(max(0.0, 1.0 - (time.time() - t)))
"""


def exprd_cpu(tmp: Path, root: Path, seconds: float, warmup: float = 15.0) -> float:
    tmp.mkdir(exist_ok=True)
    spool, state = tmp / "spool", tmp / "state"
    cfg = tmp / "exprd.toml"
    cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                   f"allowed_roots = {json.dumps([str(root)])}\n"
                   f"watch_roots = {json.dumps([str(root)])}\n")
    proc = subprocess.Popen([*EXPRD, "--config", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(warmup)  # start-up, the first root scan and the first (cold) passes
        c0, t0 = cpu_of(proc.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_of(proc.pid) - c0) / (time.monotonic() - t0)
    finally:
        proc.terminate()
        proc.wait(20)


def exprd_live(tmp: Path, ranks: int, rows: int, seconds: float) -> tuple[float, float]:
    """exprd's CPU (fraction of a core) over `seconds` watching a live run of `ranks` that a
    writer process appends a step to every second; and the writer's own CPU."""
    root = tmp / "live"
    run = root / "bench" / "live"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(ranks), str(rows)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # the sidecars name the writer: a live process on this host
        make_run(run, ranks, rows, pid=writer.pid)
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        w0, t0 = cpu_of(writer.pid), time.monotonic()
        used = exprd_cpu(tmp / "exprd-live", root, seconds, warmup=20.0)
        return used, (cpu_of(writer.pid) - w0) / (time.monotonic() - t0)
    finally:
        writer.kill()
        writer.wait(10)
        for f in (writer.stdin, writer.stdout):
            if f:
                f.close()


def _print_stall(st: dict[str, Any]) -> None:
    print("| stalled run | stall detector alone | repeat pass, stall open | repeat pass, "
          "not stalled | ratio |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {st['ranks']:,} live ranks | {st['detector'] * 1000:.1f} ms wall, "
          f"{st['detector_cpu'] * 1000:.1f} ms CPU | "
          f"{st['with'] * 1000:.0f} ms wall, {st['with_cpu'] * 1000:.0f} ms CPU | "
          f"{st['without'] * 1000:.0f} ms wall, {st['without_cpu'] * 1000:.0f} ms CPU | "
          f"{st['with'] / st['without']:.2f}x |")
    print(f"\nthe incident: {st['detail']}")


def main() -> None:
    if sys.argv[1:2] == ["stall"]:  # `python bench/health.py stall [RANKS] [ROWS]`: that table only
        with tempfile.TemporaryDirectory() as d:
            _print_stall(stall_pass(Path(d), int(sys.argv[2]) if len(sys.argv) > 2 else 16384,
                                    int(sys.argv[3]) if len(sys.argv) > 3 else 64))
        return
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    idle = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    sizes = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "1024,4096,16384").split(",")]
    live_ranks = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    live_s = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    stall_n = int(sys.argv[7]) if len(sys.argv) > 7 else 16384
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        big = tmp / "runs" / "bench" / "big"
        make_run(big, ranks, rows)
        _settle(big)
        cold_cpu, cold_wall, warm_cpu, warm_wall, n = one_pass(big)
        assert n == ranks, n
        curve = repeat_curve(tmp, sizes, rows)
        st = stall_pass(tmp, stall_n, rows)
        small_root = tmp / "small"
        make_run(small_root / "bench" / "live", 64, rows)
        idle_cpu = exprd_cpu(tmp, small_root, idle)
        live_cpu, writer_cpu = exprd_live(tmp, live_ranks, rows, live_s)
    print("| measure | value | target | met |")
    print("|---|---|---|---|")
    print(f"| watcher pass, {ranks:,} live shards x {rows} steps, first (tails read) | "
          f"{cold_wall * 1000:,.0f} ms wall, {cold_cpu * 1000:,.0f} ms CPU | | |")
    print(f"| watcher pass, same shards, nothing new | {warm_wall * 1000:,.0f} ms wall, "
          f"{warm_cpu * 1000:,.0f} ms CPU | | |")
    print(f"| `exprd` idle {idle:.0f} s, watching one live 64-rank run (watch_roots) | "
          f"{idle_cpu * 100:.2f}% of a core | < 1% | {'yes' if idle_cpu < 0.01 else 'no'} |")
    print(f"| `exprd` {live_s:.0f} s watching a live {live_ranks:,}-rank run (a step a second on "
          f"every rank; watch_roots) | {live_cpu * 100:.1f}% of a core (the writer: "
          f"{writer_cpu * 100:.0f}%) | <= ~10% | {'yes' if live_cpu <= 0.11 else 'no'} |")
    print()
    print("| ranks | first pass | nothing new | nothing new, CPU | 1% changed | 1% changed, CPU "
          "| shards read | nothing new, ms/rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in curve:
        print(f"| {c['ranks']:,} | {c['first']:.2f} s | {c['idle'] * 1000:.0f} ms | "
              f"{c['idle_cpu'] * 1000:.0f} ms | {c['one_pct'] * 1000:.0f} ms | "
              f"{c['one_pct_cpu'] * 1000:.0f} ms | {c['read']:,.0f} | "
              f"{c['idle'] * 1000 / c['ranks']:.4f} |")
    top = curve[-1]
    print()
    print(f"nothing new at {top['ranks']:,} ranks < 0.2 s: "
          f"{'yes' if top['idle'] < 0.2 else 'NO'} ({top['idle'] * 1000:.0f} ms)")
    print()
    _print_stall(st)


if __name__ == "__main__":
    main()
