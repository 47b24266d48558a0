"""What spans and probes cost the training process, measured side by side in one run.

1. `et.log` with three nested spans per step against `et.log` alone (and three nested
   empty context managers, the floor of any `with` in Python), interleaved in rounds;
   the per-span cost is (log + 3 spans - log) / 3. Part of it is the row itself: it holds
   three more numbers, so `et.log` with the same three `time_ms/...` keys passed by hand
   is measured too. Also with `span_count=True` and with `trace_spans=True`.
2. The tracker thread's CPU while the process is idle with probes on
   (`probe_after=1`: the probe is sampled and rewritten every few seconds), as process
   CPU time over an idle period, against the same period idle without a run.

    python bench/spans.py [calls per round] [rounds] [idle seconds]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time


class _Empty:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def per_call(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    """Mean ns per call of `fn(i)` in a tight loop, in CPU time of this thread: on a
    machine shared with other jobs, wall time also counts the waits for a core."""
    t0 = time.thread_time_ns()
    for i in range(calls):
        fn(i)
    return (time.thread_time_ns() - t0) / calls


def measure(tmp: str, calls: int, rounds: int, **init: bool) -> dict[str, float]:
    """Median ns per step of: log alone, log + 3 nested spans, log + 3 empty `with`s."""
    import expr_tracker as et

    et.init("bench", "spans-" + "-".join(k for k, v in init.items() if v) or "spans", dir=tmp,
            **init)  # type: ignore[arg-type]
    log, span = et.log, et.span

    def plain(i: int) -> None:
        log({"loss": 1.0 / (i + 1)})

    def spanned(i: int) -> None:
        with span("step"), span("forward"), span("attention"):
            pass
        log({"loss": 1.0 / (i + 1)})

    def empty(i: int) -> None:
        with _Empty(), _Empty(), _Empty():
            pass
        log({"loss": 1.0 / (i + 1)})

    def by_hand(i: int) -> None:
        log({"loss": 1.0 / (i + 1), "time_ms/step": 0.003, "time_ms/step/forward": 0.002,
             "time_ms/step/forward/attention": 0.001})

    variants = {"plain": plain, "spanned": spanned, "empty": empty, "by_hand": by_hand}
    got: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(rounds):
            for key, fn in variants.items():
                got[key].append(per_call(fn, calls))
    finally:
        et.finish()
    return {k: statistics.median(v) for k, v in got.items()}


def idle_cpu(tmp: str, seconds: float) -> tuple[float, float, float, int]:
    """Process CPU s over `seconds` idle without a run, with a run that never probes
    (probe_after=1e6), and with a run probing; and how many probes that run wrote."""
    import json

    import expr_tracker as et

    t0 = time.process_time()
    time.sleep(seconds)
    bare = time.process_time() - t0
    et.init("bench", "quiet", dir=tmp, probe_after=1e6)
    et.log({"loss": 1.0})
    t0 = time.process_time()
    time.sleep(seconds)
    quiet = time.process_time() - t0
    et.finish()
    run = et.init("bench", "idle", dir=tmp, probe_after=1.0)
    et.log({"loss": 1.0})
    sidecar = run.paths.sidecar
    probes: set[float] = set()
    t0 = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.5)  # the main thread is as idle as a rank stuck in a sleep
        try:
            p = json.loads(sidecar.read_text()).get("probe")
        except (OSError, ValueError):
            p = None
        if p:
            probes.add(p["time"])
    probing = time.process_time() - t0
    et.finish()
    return bare, quiet, probing, len(probes)


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    idle = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for label, init in (("spans", {}), ("span_count=True", {"span_count": True}),
                            ("trace_spans=True", {"trace_spans": True})):
            m = measure(os.path.join(tmp, label), calls, rounds, **init)
            per_span = (m["spanned"] - m["plain"]) / 3
            floor = (m["empty"] - m["plain"]) / 3
            rows.append((label, m, per_span, floor))
        bare, quiet, probing, n = idle_cpu(os.path.join(tmp, "idle"), idle)
    print(f"{rounds} interleaved rounds of {calls:,} steps, medians (ns of the training "
          "thread's CPU time per step)\n")
    print("| init | et.log alone | et.log + 3 nested spans | et.log with the 3 keys by hand | "
          "et.log + 3 empty `with` | per span | per span, beyond the row's 3 keys | "
          "per empty `with` |")
    print("|---|---|---|---|---|---|---|---|")
    for label, m, per_span, floor in rows:
        beyond = (m["spanned"] - m["by_hand"]) / 3
        print(f"| {label} | {m['plain']:.0f} | {m['spanned']:.0f} | {m['by_hand']:.0f} | "
              f"{m['empty']:.0f} | {per_span:.0f} ns | {beyond:.0f} ns | {floor:.0f} ns |")
    print(f"\nidle {idle:.0f} s, process CPU: {bare * 1e3:.1f} ms without a run, "
          f"{quiet * 1e3:.1f} ms with a run that does not probe, {probing * 1e3:.1f} ms with a "
          f"run probing (probe_after=1 s, {n} probes written, the main thread polling the "
          f"sidecar twice a second): {probing / idle * 100:.3f}% of a core")


if __name__ == "__main__":
    main()
