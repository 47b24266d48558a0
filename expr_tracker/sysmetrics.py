"""System metrics per rank (DESIGN 19): process CPU, RSS and I/O, and this rank's GPU.

A `Sampler` lives in `Run` and samples on a thread of its own every `system_interval`
seconds (at least `MIN_INTERVAL`), once soon after `init` and once at `finish`; the SDK's
background thread takes what it sampled (`take`, never waiting) and `Run` logs it as a
rank record of its own rank at its last committed step, so the records never advance
the step and reach the summary, heatmap, plot and team store like any other rank record.

Sampling is off the flush path: an NVML call that never returns (a bad GPU node) holds
the sampler's thread only, so it costs its samples, never rows, probes or `finish`
(which waits `FINAL_WAIT` seconds at most for its last sample).

psutil and NVML (`pynvml`, from nvidia-ml-py, the `gpu` extra) are imported on the first
sample, never at `import expr_tracker`. No GPU, no NVML or an NVML error means no GPU keys
and one info line on the `expr_tracker` logger, never an exception: a tracker must not
take training down because a driver is missing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_INTERVAL = 10.0
MIN_INTERVAL = 1.0  # seconds: a sample costs a few ms of the process (and NVML's time)
FINAL_WAIT = 2.0  # seconds `finish` waits for its last sample
FIRST_AFTER = 1.0  # the first sample, "soon after init": the background thread's first tick
_MB = float(1 << 20)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

def parse_enabled(value: object) -> bool:
    """`system_metrics=` (None: `EXPR_SYSTEM_METRICS`, default on); errors name the field."""
    if value is None:
        raw = os.environ.get("EXPR_SYSTEM_METRICS", "").strip().lower()
        if not raw or raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise ValueError(f"EXPR_SYSTEM_METRICS must be 0 or 1 (or true/false), got {raw!r}")
    if not isinstance(value, bool):
        raise TypeError(f"system_metrics must be True or False, got {type(value).__name__}")
    return value


def gpu_index(local_rank: int, env: Mapping[str, str] | None = None) -> str | int | None:
    """The NVML device of this rank: `LOCAL_RANK` within `CUDA_VISIBLE_DEVICES`.

    An int index, a "GPU-..." UUID, or None when the rank sees no GPU (an empty or "-1"
    list, or a MIG slice NVML cannot open by this name). With one visible device per rank
    (a launcher that gives each rank its own) that device, whatever the local rank.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank
    items = [v.strip() for v in visible.split(",") if v.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU
    cut = next((i for i, v in enumerate(items) if v.startswith("-")), len(items))
    items = items[:cut]
    if not items:
        return None
    pick = items[0] if len(items) == 1 else items[local_rank] if local_rank < len(items) else None
    if pick is None or pick.startswith("MIG-"):
        return None
    if pick.isdigit():
        return int(pick)
    return pick if pick.startswith("GPU-") else None


class Sampler:
    """Samples this process and its GPU; `sample()` returns the `system/*` values."""

    def __init__(self, interval: float, local_rank: int, *,
                 info: Callable[[str], None] | None = None) -> None:
        self.interval = interval
        self.local_rank = local_rank
        self.samples = 0
        self.gpu: str | int | None = None  # the NVML device, once opened
        self._info = info or logging.getLogger("expr_tracker").info
        self._said: set[str] = set()
        self._next = time.monotonic() + FIRST_AFTER
        self._proc: Any = None  # psutil.Process; False once psutil turned out missing
        self._last: tuple[float, float, int | None, int | None] | None = None
        self._nvml: Any = None  # the pynvml module once initialised; False: no GPU keys
        self._handle: Any = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ready: list[dict[str, float]] = []  # sampled, not yet taken
        self._asked = False  # a sample asked for now (the one at finish)
        self._closed = False
        self._busy: float | None = None  # when the sample under way started (monotonic)
        self._done = 0  # samples finished (empty ones too)
        self.stuck_for: float | None = None  # at finish: how long a sample had not returned

    def due(self, now: float) -> bool:
        """Is a sample due at monotonic time `now`?"""
        return now >= self._next

    def take(self) -> list[dict[str, float]]:
        """The samples taken since the last call (never waits); starts the sampler's thread
        on the first call (from the SDK's background thread: after a fork, the child's)."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._start()
            out, self._ready = self._ready, []
        return out

    def _start(self) -> None:
        self._busy = None  # (after a fork: the parent's sample is not under way here)
        self._thread = threading.Thread(target=self._loop, name="expr-tracker-sysmetrics",
                                        daemon=True)
        self._thread.start()

    def last(self, timeout: float = FINAL_WAIT) -> list[dict[str, float]]:
        """At finish: one more sample, waited for `timeout` seconds at most, with those not
        taken yet; then the thread stops. A sampler stuck in a call (NVML that hangs) gives
        what it has, and `stuck_for` says for how long it had been stuck."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._start()  # never started (a short run), or a fork's copy
            target = self._done + (2 if self._busy is not None else 1)
            self._asked = True
            self._cond.notify_all()
            while self._done < target and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            stuck = self._busy
            self._closed = True
            self._cond.notify_all()
            out, self._ready = self._ready, []
        self.stuck_for = None if stuck is None else time.monotonic() - stuck
        return out

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._asked and time.monotonic() < self._next:
                    # (at most a minute at a time: the loop looks again; a far `_next`
                    # must not overflow the lock's timeout)
                    self._cond.wait(min(60.0, max(0.0, self._next - time.monotonic())))
                if self._closed and not self._asked:
                    return
                self._asked = False
                self._busy = time.monotonic()
            out = self.sample()
            with self._cond:
                self._busy = None
                self._done += 1
                if out:
                    self._ready.append(out)
                self._cond.notify_all()

    def say(self, cause: str, message: str) -> None:
        """One info line per cause for the life of the sampler (never raises)."""
        if cause in self._said:
            return
        self._said.add(cause)
        try:
            self._info(message)
        except Exception:  # a broken logging handler must not stop the samples
            pass

    def sample(self) -> dict[str, float]:
        """Take one sample now (and schedule the next); never raises."""
        self._next = time.monotonic() + self.interval
        out: dict[str, float] = {}
        # BaseException: a library that raises KeyboardInterrupt or SystemExit from a
        # call must not end the sampler's thread, or a finish that samples on its own
        try:
            self._process(out)
        except BaseException as exc:
            self.say(f"psutil:{type(exc).__name__}", f"expr_tracker: no process metrics: {exc!r}")
        try:
            self._gpu(out)
        except BaseException as exc:  # NVML raises its own errors, and drivers go away
            self.say(f"nvml:{type(exc).__name__}", f"expr_tracker: no GPU metrics: {exc!r}")
        if out:
            self.samples += 1
        return out

    # -- the process (psutil) ----------------------------------------------
    def _process(self, out: dict[str, float]) -> None:
        if self._proc is False:
            return
        if self._proc is None:
            try:
                import psutil
            except ImportError:
                self._proc = False
                self.say("psutil", "expr_tracker: psutil is not installed: no system/cpu_percent, "
                                   "rss_mb, read_mb_s or write_mb_s")
                return
            self._proc = psutil.Process()
            # the first sample covers the process's life so far
            self._last = (self._proc.create_time(), 0.0, 0, 0)
        proc = self._proc
        now = time.time()
        with proc.oneshot():
            cpu = proc.cpu_times()
            rss = proc.memory_info().rss
            rd: int | None
            wr: int | None
            try:
                io = proc.io_counters()
                rd, wr = int(io.read_bytes), int(io.write_bytes)
            except Exception:  # macOS has none; psutil.AccessDenied on a locked /proc/PID/io
                rd = wr = None
        used = float(cpu.user + cpu.system)
        assert self._last is not None
        t0, used0, rd0, wr0 = self._last
        self._last = (now, used, rd, wr)
        dt = now - t0
        if dt > 0:
            out["system/cpu_percent"] = round(100.0 * max(0.0, used - used0) / dt, 2)
        out["system/rss_mb"] = round(rss / _MB, 2)
        if dt > 0 and rd is not None and wr is not None and rd0 is not None and wr0 is not None:
            out["system/read_mb_s"] = round(max(0, rd - rd0) / _MB / dt, 4)
            out["system/write_mb_s"] = round(max(0, wr - wr0) / _MB / dt, 4)

    # -- this rank's GPU (NVML) --------------------------------------------
    def _open_gpu(self) -> bool:
        """Initialise NVML and open this rank's device once; False (and one info line) if not."""
        if self._nvml is not None:
            return self._nvml is not False
        self._nvml = False
        index = gpu_index(self.local_rank)
        if index is None:
            self.say("gpu", "expr_tracker: this rank sees no GPU (CUDA_VISIBLE_DEVICES): no system/gpu_* metrics")
            return False
        try:
            import pynvml
        except ImportError:
            self.say("gpu", "expr_tracker: NVML is not installed (pip install 'expr-tracker[gpu]'): "
                            "no system/gpu_* metrics")
            return False
        try:
            pynvml.nvmlInit()
            if isinstance(index, int):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(index)
        except BaseException as exc:  # pynvml.NVMLError: no driver, no device, no permission
            self.say("gpu", f"expr_tracker: NVML cannot open GPU {index}: {exc}; no system/gpu_* metrics")
            return False
        self._nvml, self._handle, self.gpu = pynvml, handle, index
        return True

    def _gpu(self, out: dict[str, float]) -> None:
        if not self._open_gpu():
            return
        nv, h = self._nvml, self._handle
        throttle = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        reads: tuple[tuple[str, Callable[[], float]], ...] = (
            ("system/gpu_util", lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
            ("system/gpu_mem_mb", lambda: round(nv.nvmlDeviceGetMemoryInfo(h).used / _MB, 2)),
            ("system/gpu_temp_c", lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            ("system/gpu_power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("system/gpu_sm_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            ("system/gpu_throttle", lambda: float(throttle(h))),
        )
        for key, read in reads:
            try:
                out[key] = read()
            except nv.NVMLError as exc:  # one metric a device does not support: the others
                self.say(f"nvml:{key}", f"expr_tracker: NVML gives no {key}: {exc}")


def check_interval(seconds: float, field: str = "system_interval") -> float:
    """`seconds`, or a ValueError naming `field` below the floor `MIN_INTERVAL`."""
    if seconds < MIN_INTERVAL:
        raise ValueError(f"{field} must be at least {MIN_INTERVAL:g} s (a sample costs the "
                         f"process a few ms and a GPU library call), got {seconds:g}")
    return seconds


def make_sampler(enabled: bool, interval: float, local_rank: int) -> Sampler | None:
    """The run's sampler, or None when system metrics are off."""
    return Sampler(interval, local_rank) if enabled else None
