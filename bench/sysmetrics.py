"""What system metrics (DESIGN 19) cost a rank, measured side by side in one process.

1. One sample (`Sampler.sample`: psutil's CPU times, RSS and I/O counters, and NVML when a
   GPU is there): the CPU time of the calling thread per sample, scaled to the 10 s
   default interval and to 1 s.
2. The SDK's background thread of two idle runs side by side, one sampling every second
   and one with `system_metrics=False`: each thread's own CPU time over the same seconds
   (`/proc/self/task/TID/schedstat`), the difference scaled to 10 s.
3. `Run.log` of a run sampling every second against one that does not, in interleaved
   rounds long enough that samples fall inside them (ns per call, medians).

    python bench/sysmetrics.py [samples] [idle seconds] [calls per round] [rounds]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time


def sample_cost(n: int) -> tuple[float, float, int]:
    """CPU and wall microseconds per `Sampler.sample()` (after a first one), and its keys."""
    from expr_tracker.sysmetrics import Sampler

    s = Sampler(10.0, 0, info=lambda _msg: None)
    keys = len(s.sample())  # imports psutil (and tries NVML) once
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        s.sample()
    c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
    return (c1 - c0) / n / 1e3, (w1 - w0) / n / 1e3, keys


def thread_cpu(native_id: int) -> float:
    """CPU seconds of one thread of this process: Linux's schedstat (nanoseconds) where
    there is one, else psutil's per-thread times (clock ticks: 10 ms steps)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except OSError:
        pass
    import psutil

    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    raise LookupError(native_id)


def idle_threads(tmp: str, seconds: float) -> tuple[float, float, int]:
    """CPU seconds of the background thread of a run sampling every 1 s and of one that
    does not, over the same `seconds`; and the samples taken."""
    from expr_tracker.run import Run

    on = Run("bench", "sys-on", dir=tmp, system_interval=1.0, system_metrics=True)
    off = Run("bench", "sys-off", dir=tmp, system_metrics=False)
    on.log({"x": 1.0})
    off.log({"x": 1.0})
    time.sleep(1.5)  # past the first sample (and psutil's import)
    ids = (on._thread.native_id, off._thread.native_id)
    assert None not in ids
    before = [thread_cpu(i) for i in ids if i is not None]
    n0 = on.info()["system_metrics"]["samples"]
    time.sleep(seconds)
    after = [thread_cpu(i) for i in ids if i is not None]
    n1 = on.info()["system_metrics"]["samples"]
    on.finish()
    off.finish()
    return after[0] - before[0], after[1] - before[1], n1 - n0


def per_call(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter_ns()
    for i in range(calls):
        fn(i)
    return (time.perf_counter_ns() - t0) / calls


def log_side_by_side(tmp: str, calls: int, rounds: int) -> tuple[float, float, int]:
    """Median ns per `Run.log` call with system metrics every 1 s and without, interleaved."""
    from expr_tracker.run import Run

    on = Run("bench", "log-on", dir=tmp, system_interval=1.0, system_metrics=True)
    off = Run("bench", "log-off", dir=tmp, system_metrics=False)
    on_log, off_log = on.log, off.log
    ons, offs = [], []
    try:
        for _ in range(rounds):
            ons.append(per_call(lambda i: on_log({"loss": 1.0 / (i + 1), "lr": 3e-4}), calls))
            offs.append(per_call(lambda i: off_log({"loss": 1.0 / (i + 1), "lr": 3e-4}), calls))
        samples = on.info()["system_metrics"]["samples"]
    finally:
        on.finish()
        off.finish()
    return statistics.median(ons), statistics.median(offs), samples


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    idle = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 200_000
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    os.environ.pop("EXPR_SYSTEM_METRICS", None)
    cpu_us, wall_us, keys = sample_cost(n)
    with tempfile.TemporaryDirectory() as tmp:
        t_on, t_off, taken = idle_threads(tmp, idle)
        log_on, log_off, log_samples = log_side_by_side(tmp, calls, rounds)
    extra = max(0.0, t_on - t_off)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| one sample ({keys} keys), CPU / wall | {cpu_us:.0f} us / {wall_us:.0f} us |")
    print(f"| one sample at the 10 s default | {cpu_us / 1e6 / 10 * 100:.4f}% of a core |")
    print(f"| one sample every 1 s | {cpu_us / 1e6 * 100:.3f}% of a core |")
    print(f"| background thread, idle {idle:.0f} s, sampling every 1 s ({taken} samples) | "
          f"{t_on * 1e3:.2f} ms CPU ({t_on / idle * 100:.3f}% of a core) |")
    print(f"| background thread, idle {idle:.0f} s, system_metrics=False | "
          f"{t_off * 1e3:.2f} ms CPU ({t_off / idle * 100:.3f}% of a core) |")
    print(f"| the difference, scaled to 10 s | {extra / idle / 10 * 100:.4f}% of a core |")
    print(f"| `Run.log`, sampling every 1 s ({log_samples} samples in the rounds) | "
          f"{log_on:.0f} ns/call |")
    print(f"| `Run.log`, system_metrics=False | {log_off:.0f} ns/call |")
    print(f"| ratio | {log_on / log_off:.3f}x |")


if __name__ == "__main__":
    main()
