"""Per-call cost of `et.log` against its floor, measured side by side in one process.

Floor: `orjson.dumps` of the same row with `_step` and `_time`, appended to a buffered
file. Also `log()` with five alert rules against `log()` without, and the import time
of `expr_tracker` (`python -X importtime`). Prints a markdown table.

    python bench/log_overhead.py [calls]
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


def per_call(fn, calls: int, repeats: int = 7) -> float:
    """Median over `repeats` of the mean time per call of `fn(i)` in a tight loop (ns)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(samples)


def floor(tmp: str, calls: int) -> float:
    fh = open(os.path.join(tmp, "floor.jsonl"), "ab")  # noqa: SIM115
    dumps, opt, now = orjson.dumps, orjson.OPT_APPEND_NEWLINE, time.time

    def one(i: int) -> None:
        fh.write(dumps({"_step": i, "_time": now(), "loss": 1.0 / (i + 1), "lr": 3e-4}, option=opt))

    try:
        return per_call(one, calls)
    finally:
        fh.close()


def et_log(tmp: str, calls: int, rules: list[str]) -> float:
    import expr_tracker as et

    et.init("bench", f"log-{len(rules)}", dir=tmp, alert_rules=rules)
    log = et.log
    try:
        return per_call(lambda i: log({"loss": 1.0 / (i + 1), "lr": 3e-4}), calls)
    finally:
        et.finish()


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
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        f = floor(tmp, calls)
        plain = et_log(tmp, calls, [])
        try:
            ruled = et_log(tmp, calls, RULES)
        except ImportError:
            ruled = float("nan")
        f2 = floor(tmp, calls)  # again after, to show the floor did not drift
    fl = min(f, f2)
    imp = import_ms()
    print("| measure | value | target |\n|---|---|---|")
    print(f"| floor: orjson.dumps + buffered append | {fl:.0f} ns/call | |")
    print(f"| et.log, no rules | {plain:.0f} ns/call ({plain / fl:.2f}x floor) | <= 2.5x |")
    print(f"| et.log, 5 rules | {ruled:.0f} ns/call ({ruled / plain:.2f}x no rules) | <= 3x |")
    print(f"| import expr_tracker | {imp:.1f} ms | <= 60 ms |")


if __name__ == "__main__":
    main()
