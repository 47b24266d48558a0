"""Every rank's traced spans as one Chrome trace (`expr trace`, DESIGN 17).

`trace_spans=True` makes each rank write `spans[.rankN].jsonl` in the run directory,
one line per closed span: `{"path", "start" (epoch s), "dur_ms", "step", "thread"}`.
The trace is the Trace Event Format's JSON object form that chrome://tracing and
Perfetto read: one complete event (`"ph": "X"`) per span, a process per rank named
"rank N" (process_name / process_sort_index metadata), a thread per thread name, and
times in microseconds from the earliest span of the run (its epoch time is kept in
`otherData`). Ranks on different hosts line up only as well as their clocks agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from expr_tracker.store.layout import parse_spans_name


def span_files(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """rank -> its span trace file in `run_dir` (empty when nothing was traced)."""
    out: dict[int, Path] = {}
    for path in Path(run_dir).iterdir():
        rank = parse_spans_name(path.name)
        if rank is not None and path.is_file():
            out[rank] = path
    return dict(sorted(out.items()))


def read_spans(path: Path) -> Iterator[dict[str, Any]]:
    """The span lines of one file; an unterminated or unreadable line is skipped."""
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                return  # a torn tail: its writer is still at it (or was killed)
            try:
                span = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if (isinstance(span, dict) and isinstance(span.get("path"), str)
                    and isinstance(span.get("start"), (int, float))
                    and isinstance(span.get("dur_ms"), (int, float))):
                yield span


def write_chrome_trace(run_dir: str | os.PathLike[str], out: IO[bytes]) -> dict[str, Any]:
    """Write the run's spans to `out` as a Chrome trace; returns {ranks, spans}.

    Two passes over the files (the first finds the earliest start), so memory stays
    bounded by one line whatever the trace's size.
    """
    files = span_files(run_dir)
    base = min((s["start"] for path in files.values() for s in read_spans(path)), default=0.0)
    out.write(b'{"displayTimeUnit":"ms","otherData":')
    out.write(orjson.dumps({"run": str(run_dir), "epoch_start": base}))
    out.write(b',"traceEvents":[')
    first = True
    count = 0

    def emit(event: dict[str, Any]) -> None:
        nonlocal first
        if not first:
            out.write(b",\n")
        first = False
        out.write(orjson.dumps(event))

    for rank, path in files.items():
        emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
              "args": {"name": f"rank {rank}"}})
        emit({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
              "args": {"sort_index": rank}})
        tids: dict[str, int] = {}
        for span in read_spans(path):
            thread = str(span.get("thread") or "")
            tid = tids.get(thread)
            if tid is None:
                tid = tids[thread] = len(tids) + 1
                emit({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                      "args": {"name": thread or "thread"}})
            spath = span["path"]
            emit({"name": spath.rsplit("/", 1)[-1], "cat": "span", "ph": "X",
                  "ts": round((span["start"] - base) * 1e6, 3),
                  "dur": round(span["dur_ms"] * 1e3, 3), "pid": rank, "tid": tid,
                  "args": {"path": spath, "step": span.get("step")}})
            count += 1
    out.write(b"]}\n")
    return {"ranks": list(files), "spans": count}
