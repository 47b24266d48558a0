"""Probes (DESIGN 13): where a silent rank is, written by the SDK's background thread.

Once the process has logged nothing for `probe_after` (default max(10 s, 5x its own
median step period)), the background thread samples the main thread's stack with
`sys._current_frames()` (no signal, no ptrace) and puts a probe into the shard's sidecar:

    "probe": {"since": <epoch s of the last log()>, "time": <epoch s of this probe>,
              "where": ["train.py:88 time.sleep", "train.py:88 main [user]", ...],
              "spans": ["data", "data/load"], "waiting": "collective"|"io"|"sleep"|null}

`where` is innermost first, at most 8 entries; when the innermost Python frame is
calling into C code (time.sleep, a gloo wait), the first entry names that callee at the
call's line. User code (not the standard library, site-packages or this package) ends
in " [user]". The probe is rewritten every few seconds while the process stays silent
and removed once it logs again.

Nothing here runs on the `log()` hot path: the background thread notices activity by
`Run._rows_committed` (derived from the hot path's one counter, `_step`) and `Run._last_log` changing between
its ticks, so `since` is known to within a tick. A process whose tracker thread cannot
run (C code holding the GIL, SIGSTOP) writes no probe at all; watchers read that
absence as evidence too.
"""

from __future__ import annotations

import collections
import functools
import linecache
import math
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

from expr_tracker import spans as _spans

DEFAULT_AFTER = 10.0
PERIODS = 5.0  # probe_after = max(DEFAULT_AFTER, PERIODS x the median step period)
REWRITE_EVERY = 3.0
MAX_WHERE = 8
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.lru_cache(maxsize=1)
def _call_ops() -> frozenset[int]:
    import dis

    # Python 3.11 stops a frame inside a C call at its PRECALL, later versions at the CALL
    return frozenset(op for op, name in enumerate(dis.opname) if name.startswith(("CALL", "PRECALL")))


@functools.lru_cache(maxsize=1)
def _libs() -> tuple[str, ...]:
    """The library roots, longest first: computed at the first probe, never at import
    (sysconfig takes milliseconds, and exprd imports this module for `clean_probe`)."""
    import sysconfig

    roots = {os.path.abspath(p) + os.sep
             for key in ("stdlib", "platstdlib", "purelib", "platlib")
             if (p := sysconfig.get_paths().get(key))}
    roots |= {os.path.abspath(p) + os.sep for p in sys.path
              if "site-packages" in p or "dist-packages" in p}
    return tuple(sorted(roots, key=len, reverse=True))

# what a frame's file (with "/" separators) or a C callee says about a wait
_COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py", "c10d",
                     "torch/distributed/fsdp/", "deepspeed/comm/")
_COLLECTIVE_CALLS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                     "broadcast", "barrier", "all_to_all", "_sync_params", "wait")
_SLEEP_CALLS = ("sleep",)
_SLEEP_FILES = ("/threading.py", "/queue.py", "concurrent/futures/")
_IO_CALLS = ("read", "readinto", "readline", "readlines", "recv", "recv_into", "recvfrom",
             "accept", "select", "poll", "connect", "sendall", "write")
_IO_FILES = ("/socket.py", "/selectors.py", "/ssl.py", "/subprocess.py", "/_pyio.py",
             "/http/client.py")


def _library(filename: str) -> str | None:
    """The path of `filename` below its library root, or None for user code."""
    if filename.startswith("<"):
        # `python -c` and a REPL are the user's code; <frozen ...> modules are not
        return None if filename in ("<string>", "<stdin>") else filename
    path = os.path.abspath(filename)
    if path.startswith(_HERE):
        return "expr_tracker/" + path[len(_HERE):]
    for root in _libs():
        if path.startswith(root):
            return path[len(root):]
    return None


def _user_path(filename: str) -> str:
    """A user file as the training script names it: relative to the cwd when below it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return os.path.basename(filename)
    return rel if not rel.startswith("..") else os.path.basename(filename)


def _callee(frame: FrameType) -> str | None:
    """The call the innermost frame is making (into C code), as written in its source:
    "time.sleep", "work.wait". None when it is not in a call or the source is unknown."""
    code = frame.f_code
    lasti = frame.f_lasti
    try:
        if lasti < 0 or code.co_code[lasti] not in _call_ops():
            return None
        positions = getattr(code, "co_positions", None)  # Python 3.11+
        if positions is None:
            return None
        for i, pos in enumerate(positions()):
            if i == lasti // 2:
                line, _end_line, col, end_col = pos
                break
        else:
            return None
        if line is None or col is None:
            return None
        text = linecache.getline(code.co_filename, line)
        if not text:
            return None
        text = text[col:end_col] if end_col is not None and _end_line == line else text[col:]
        name = text.split("(", 1)[0].strip()
        return name[:120] if name and name.replace(".", "").replace("_", "").isalnum() else None
    except (IndexError, ValueError, TypeError, AttributeError):
        return None


def _process_group() -> bool:
    """True when torch.distributed has a process group in this process (DDP's reducer
    all-reduces inside `backward()`, in C++: only the backward frame shows)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # a half-imported torch: no verdict
        return False


def _waiting(files: list[str], callee: str | None, group: bool = False) -> str | None:
    """collective | sleep | io | None, from the C callee and the library frames inside the
    innermost user frame (`files`: those, innermost first; a launcher's wrapper around
    the whole script, such as torch.distributed.elastic's `@record`, is not a wait).
    With a process group (`group`), a long `backward()` is DDP's gradient all-reduce."""
    name = (callee or "").lower()
    last = name.rsplit(".", 1)[-1]
    if any(marker in f for f in files for marker in _COLLECTIVE_FILES) or (
            last in _COLLECTIVE_CALLS and (last != "wait" or "work" in name)) or (
            group and any("torch/autograd/" in f for f in files)):
        return "collective"
    if any(s in last for s in _SLEEP_CALLS) or any(m in f for f in files[:2] for m in _SLEEP_FILES):
        return "sleep"
    if last in _IO_CALLS or any(m in f for f in files[:3] for m in _IO_FILES):
        return "io"
    return None


def sample(ident: int | None = None) -> dict[str, Any] | None:
    """`where`, `spans` and `waiting` of thread `ident` (default: the main thread), or None
    if that thread is not running Python code now."""
    if ident is None:
        ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident or 0)
    if frame is None:
        return None
    where: list[str] = []
    files: list[str] = []  # library files inside the innermost user frame
    in_user = False
    callee = _callee(frame)
    f: FrameType | None = frame
    depth = 0
    while f is not None and depth < 256:
        depth += 1
        code = f.f_code
        lib = _library(code.co_filename)
        shown = lib if lib is not None else _user_path(code.co_filename)
        if lib is None:
            in_user = True
        elif not in_user:
            files.append(lib.replace(os.sep, "/"))
        if len(where) < MAX_WHERE:
            if callee is not None and not where:
                where.append(f"{shown}:{f.f_lineno} {callee}")
            if len(where) < MAX_WHERE:
                where.append(f"{shown}:{f.f_lineno} {code.co_name}" + (" [user]" if lib is None else ""))
        if in_user and len(where) >= MAX_WHERE:
            break
        f = f.f_back
    return {"where": where, "spans": _spans.open_spans(ident),
            "waiting": _waiting(files, callee, _process_group())}


class Prober:
    """The background thread's watch over its own process's silence (one per Run)."""

    def __init__(self, run: Any, probe_after: float | None) -> None:
        self.run = run
        self.fixed = probe_after
        now = time.monotonic()
        self._seen = (run._rows_committed, run._last_log)
        self._changed = now  # monotonic time the thread first saw the last activity
        self._periods: collections.deque[float] = collections.deque(maxlen=64)
        self._written: float | None = None  # monotonic time of the probe in the sidecar
        self._names: dict[int, str] = {}

    def after(self) -> float:
        """Seconds of silence before a probe: `probe_after`, else max(10 s, 5x median)."""
        if self.fixed is not None:
            return self.fixed
        if not self._periods:
            return DEFAULT_AFTER
        ordered = sorted(self._periods)
        return max(DEFAULT_AFTER, PERIODS * ordered[len(ordered) // 2])

    def own_row(self) -> None:
        """The background thread committed a row of its own (a system-metrics sample): not
        the training code's activity. Counted as seen, so a silent rank keeps its probe and
        its `since` (every rank samples at about the same time: taking every probe away at
        once would leave a stall's watcher with no probe to tell the suspect by)."""
        rows, last = self._seen
        self._seen = (rows + 1, last)

    def tick(self, now: float) -> None:
        """Once a second on the background thread: trace lines, then probe or clear."""
        run = self.run
        self._trace()
        if len(run._spans.pending) > _spans.FOLD_AT:
            with run._lock:
                _spans.fold(run._spans)
        token = (run._rows_committed, run._last_log)
        if token != self._seen:
            rows = token[0] - self._seen[0]
            if rows > 0:
                self._periods.append((now - self._changed) / rows)
            self._seen, self._changed = token, now
            if self._written is not None:
                self._written = None
                self._set(None)
            return
        if now - self._changed < self.after():
            return
        if self._written is not None and now - self._written < REWRITE_EVERY:
            return
        probe = sample()
        if probe is None:
            return
        wall = time.time()
        probe = {"since": wall - (now - self._changed), "time": wall, **probe}
        self._written = now
        self._set(probe)

    def _set(self, probe: dict[str, Any] | None) -> None:
        run = self.run
        with run._lock:
            if run._finished or run._detached:
                return
            run._sink.set_probe(probe)
        run._sink.checkpoint()  # direct mode: the sidecar now; spool mode: an event went

    def _trace(self) -> None:
        """`trace_spans=True`: hand the spans closed since the last tick to the sink."""
        sink = self.run._spans
        items = _spans.take_trace(sink)
        if not items:
            return
        names = self._names
        if any(item[4] not in names for item in items):
            names.update((t.ident, t.name) for t in threading.enumerate() if t.ident is not None)
        epoch = _spans.epoch_of
        cut = len(_spans.PREFIX)
        lines = [{"path": key[cut:], "start": round(epoch(start), 6), "dur_ms": dur / 1e6,
                  "step": step, "thread": names.get(ident, str(ident))}
                 for key, start, dur, step, ident in items]
        run = self.run
        with run._lock:
            if not run._detached:
                run._sink.spans(lines)

    def close(self) -> None:
        """At finish (the background thread is stopped): the last spans; no probe stays."""
        try:
            self._trace()
        except Exception as exc:  # finish must not fail because of the trace
            self.run.warn_once("spans_trace", f"expr_tracker: cannot write span trace: {exc!r}")
        if self._written is not None:
            self._written = None
            self.run._sink.set_probe(None)


def _text(value: object, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def clean_probe(value: object) -> dict[str, Any] | None:
    """A probe from a spool event, checked and bounded (exprd writes it into a sidecar;
    the spool is a file anyone with the training user's rights could have written)."""
    if not isinstance(value, dict):
        return None
    where = value.get("where")
    spans = value.get("spans")
    waiting = value.get("waiting")
    return {
        "since": _number(value.get("since")),
        "time": _number(value.get("time")),
        "where": [t for w in where[:MAX_WHERE] if (t := _text(w, 300)) is not None]
        if isinstance(where, list) else [],
        "spans": [t for w in spans[:32] if (t := _text(w, 1000)) is not None]
        if isinstance(spans, list) else [],
        "waiting": waiting if waiting in ("collective", "io", "sleep") else None,
    }


def clean_spans(value: object) -> bytes:
    """The lines of a `spans` spool event, checked: only the fields the SDK writes."""
    import orjson

    if not isinstance(value, list):
        return b""
    out = []
    for item in value:
        if not isinstance(item, dict):
            continue
        path, start, dur = _text(item.get("path"), 1000), _number(item.get("start")), _number(item.get("dur_ms"))
        step = item.get("step")
        if path is None or start is None or dur is None:
            continue
        out.append(orjson.dumps({
            "path": path, "start": start, "dur_ms": dur,
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "thread": _text(item.get("thread"), 200) or "",
        }, option=orjson.OPT_APPEND_NEWLINE))
    return b"".join(out)
