"""Per-call cost of `et.log` against its floor, measured side by side in one process.

Floor: `orjson.dumps` of the same row with `_step` and `_time`, appended to a buffered
file. Also `log()` with five alert rules against `log()` without, and the import time
of `expr_tracker` (`python -X importtime`). Prints a markdown table.

    python bench/log_overhead.py [calls per round] [rounds]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import orjson

RULES = [
    "isnan(loss) or isinf(loss)",
    "loss > 100",
    "zscore(loss[50]) > 4",
    "lr < 0",
    "stalled(loss[100])",
]


def per_call(fn, calls: int) -> float:
    """Mean time per call of `fn(i)` over `calls` calls in a tight loop (ns)."""
    t0 = time.perf_counter_ns()
    for i in range(calls):
        fn(i)
    return (time.perf_counter_ns() - t0) / calls


def measure(tmp: str, calls: int, rounds: int) -> tuple[float, float, float]:
    """Median per-call ns of the floor, et.log and et.log with RULES, interleaved in rounds.

    Each round measures the three side by side, so a noisy machine slows all of them
    alike; the medians over rounds are reported.
    """
    import expr_tracker as et

    fh = open(os.path.join(tmp, "floor.jsonl"), "ab")  # noqa: SIM115
    dumps, opt, now = orjson.dumps, orjson.OPT_APPEND_NEWLINE, time.time

    def floor_one(i: int) -> None:
        fh.write(dumps({"_step": i, "_time": now(), "loss": 1.0 / (i + 1), "lr": 3e-4}, option=opt))

    et.init("bench", "log", dir=tmp)
    log = et.log

    def log_one(i: int) -> None:
        log({"loss": 1.0 / (i + 1), "lr": 3e-4})

    floors, plains, ruled = [], [], []
    try:
        for _ in range(rounds):
            floors.append(per_call(floor_one, calls))
            plains.append(per_call(log_one, calls))
            names = [et.add_alert_rule(rule) for rule in RULES]
            ruled.append(per_call(log_one, calls))
            for name in names:
                et.remove_alert_rule(name)
    finally:
        et.finish()
        fh.close()
    return statistics.median(floors), statistics.median(plains), statistics.median(ruled)


def spool_vs_direct(tmp: str, calls: int, rounds: int) -> tuple[float, float]:
    """Median per-call ns of `Run.log` in direct mode and in spool mode, interleaved."""
    from expr_tracker.run import Run

    direct = Run("bench", "direct", dir=tmp)
    spool = Run("bench", "spool", dir=tmp, upload_mode="spool", spool_dir=os.path.join(tmp, "spool"))
    d_log, s_log = direct.log, spool.log
    d, sp = [], []
    try:
        for _ in range(rounds):
            d.append(per_call(lambda i: d_log({"loss": 1.0 / (i + 1), "lr": 3e-4}), calls))
            sp.append(per_call(lambda i: s_log({"loss": 1.0 / (i + 1), "lr": 3e-4}), calls))
    finally:
        direct.finish()
        spool.finish()
    return statistics.median(d), statistics.median(sp)


def import_ms() -> float:
    best = []
    for _ in range(5):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import expr_tracker"],
            capture_output=True, text=True, check=True,
        ).stderr
        line = [x for x in out.splitlines() if re.search(r"\|\s+expr_tracker$", x)][-1]
        best.append(int(line.split("|")[1]) / 1000)
    return statistics.median(best)


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    with tempfile.TemporaryDirectory() as tmp:
        fl, plain, ruled = measure(tmp, calls, rounds)
        direct, spooled = spool_vs_direct(tmp, calls, rounds)
    imp = import_ms()
    print(f"{rounds} rounds of {calls:,} calls each, medians\n")
    print("| measure | value | target |\n|---|---|---|")
    print(f"| floor: orjson.dumps + buffered append | {fl:.0f} ns/call | |")
    print(f"| et.log, no rules | {plain:.0f} ns/call ({plain / fl:.2f}x floor) | <= 2.5x |")
    print(f"| et.log, 5 rules | {ruled:.0f} ns/call ({ruled / plain:.2f}x no rules) | <= 3x |")
    print(f"| Run.log, spool mode vs direct mode | {spooled:.0f} vs {direct:.0f} ns/call "
          f"({spooled / direct:.2f}x) | <= 1x (no more than direct) |")
    print(f"| import expr_tracker | {imp:.1f} ms | <= 60 ms |")


if __name__ == "__main__":
    main()
