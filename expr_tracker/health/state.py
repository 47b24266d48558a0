"""The live state of one run, read cheaply from sidecars and shard tails (DESIGN 13, 14).

`read_run(run_dir)` answers, for every shard of one stream: who writes it (rank, host,
pid, world sizes), its status (`running`, `finished`, `crashed`; a `running` shard whose
writer process on this host is gone counts as `crashed`), its last step and last write
time, and its recent rows within a bounded tail window; and the run's **frontier**: the
latest step every live rank has reported.

A `RunReader` kept between calls (a watcher, `expr top`) reads each shard's tail once and
then only the complete lines appended since, so a pass over thousands of idle shards is a
`stat` per shard and per sidecar. Memory per shard is bounded by the window whatever the
shard's size: at most `window` step rows and `window` rank records per rank are kept, and a
shard that grew by more than `MAX_CATCHUP` bytes since the last pass is read from its tail
again rather than from the old offset.

Nothing here writes.
"""

from __future__ import annotations

import math
import os
import socket
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.cursor import read_sidecar
from expr_tracker.store.layout import parse_shard_name

DEFAULT_WINDOW = 64  # step rows (and rank records per rank) kept per shard
MAX_CATCHUP = 4 << 20  # bytes read forward per shard and pass; beyond it, re-read the tail
MAX_TAIL_LINES = 100_000  # records parsed by one tail read
TAIL_BLOCK = 16 << 10  # reverse-read block: a few dozen lines, not the 256 KiB of a full read
# First reads of at least this many shards are shared among forked processes: parsing
# is CPU work under the GIL (threads made a warm-cache pass slower, not faster), and a
# tail read costs several times what sending its compact result back does
_FORK_MIN = 256
STATUSES = ("running", "finished", "crashed")
_MIN_STEP, _MAX_STEP = -(1 << 63), (1 << 63) - 1  # steps an array("q") holds


@dataclass
class RankState:
    """One shard (one rank of one stream) as read now. Rows are oldest first."""

    rank: int
    stream: str | None
    path: Path
    host: str | None = None
    pid: int | None = None  # the writing (training) process; in spool mode the SDK's, not exprd's
    status: str = "running"  # running | finished | crashed
    status_reason: str | None = None  # why: "exception", "process gone", ...
    exit: dict[str, Any] | None = None  # the sidecar's {type, message, time} after a crash
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    session: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    last_step: int | None = None  # largest step of its step rows or of its own rank records
    last_write: float | None = None  # shard mtime
    size: int = 0
    steps: Sequence[int] = ()  # the recent step rows' steps, oldest first ...
    times: Sequence[float] = ()  # ... and their `_time`s
    last_row: dict[str, Any] | None = None  # the latest step row (for `expr top -m KEY`)

    @property
    def step_times(self) -> list[tuple[int, float]]:
        """The recent step rows' (step, _time), oldest first (built on each call: the
        reader keeps them as arrays)."""
        return list(zip(self.steps, self.times, strict=True))

    @property
    def live(self) -> bool:
        """Still training: status running (a dead writer on this host is already `crashed`)."""
        return self.status == "running"


@dataclass
class RunState:
    """Every shard of one stream of a run, and the rank records of the tail windows."""

    run_dir: Path
    stream: str | None
    ranks: dict[int, RankState]  # by rank, ascending
    rank_records: dict[int, list[dict[str, Any]]]  # by the records' own `_rank`, oldest first
    read_time: float  # wall clock when the pass started
    # read with `RunReader(series=KEY)`: rank_records holds one record per rank (the latest
    # value of each key) and `series` the KEY values of the window, oldest first
    series_key: str | None = None
    series: dict[int, Sequence[float]] = field(default_factory=dict)

    # computed once per pass: the detectors ask for them per rank
    @cached_property
    def world_size(self) -> int | None:
        """The largest world size any sidecar or rank record names (None if none does)."""
        sizes = [r.world_size for r in self.ranks.values() if r.world_size]
        for recs in self.rank_records.values():
            ws = recs[-1].get("_world_size") if recs else None
            if type(ws) is int and ws > 0:
                sizes.append(ws)
        return max(sizes) if sizes else None

    @cached_property
    def live(self) -> list[RankState]:
        """The live ranks (status running), ascending."""
        return [r for r in self.ranks.values() if r.live]

    @cached_property
    def frontier(self) -> int | None:
        """The latest step every live rank has reported (DESIGN 13).

        Finished and crashed ranks are not live and do not hold it back; nor does a live
        rank that has reported no step yet (it is behind, not a bound on the others). With
        no live rank left, the run is over and the frontier is the latest step of any rank.
        None when no rank has reported a step.
        """
        live = [r.last_step for r in self.ranks.values() if r.live and r.last_step is not None]
        if live:
            return min(live)
        steps = [r.last_step for r in self.ranks.values() if r.last_step is not None]
        return max(steps) if steps else None

    @cached_property
    def lead(self) -> int | None:
        """The latest step any live rank has reported (any rank once none is live)."""
        steps = [r.last_step for r in self.live if r.last_step is not None]
        if not steps:
            steps = [r.last_step for r in self.ranks.values() if r.last_step is not None]
        return max(steps) if steps else None

    def behind(self, rank: int) -> int | None:
        """How many steps `rank` is short of the lead (0 for the leaders; None if unknown).

        The frontier is the slowest live rank, so nobody is behind *it*: a rank is behind
        the ranks ahead of it (DESIGN 13's `behind` detector counts from the lead).
        """
        lead = self.lead
        state = self.ranks.get(rank)
        if lead is None or state is None or state.last_step is None:
            return None
        return max(0, lead - state.last_step)


class _Series:
    """One rank's rank records in a compact tail (`RunReader(series=KEY)`): the steps and
    KEY's values of its last `window` records (NaN where a record has no number), and the
    latest value of every key. Arrays, not records: 16,384 ranks of 64 records cost a few
    MB instead of the ~1 GB of parsed records (DESIGN 14)."""

    __slots__ = ("latest", "steps", "values")

    def __init__(self) -> None:
        self.steps: array[int] = array("q")
        self.values: array[float] = array("d")
        self.latest: dict[str, Any] = {}


def _pushed(arr: array[Any], more: array[Any], window: int) -> array[Any]:
    """`arr` then `more`, the last `window` items, as a new array: a RunState handed out
    earlier shares the old one, so it is never changed in place."""
    out = arr + more
    if len(out) > window:
        del out[: len(out) - window]
    return out


def _series_value(v: Any) -> float:
    """A record's value as a float for a series (NaN when it is not a number)."""
    if v.__class__ is float:
        return v
    if v.__class__ is int:
        try:
            return float(v)
        except OverflowError:
            return math.nan
    if v.__class__ is str:
        return records.DECODE_NONFINITE.get(v, math.nan)
    return math.nan


def _decoded(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """`rec` with non-finite values written as text ("NaN", "Infinity") turned back into
    floats, as `records.loads` does (the bulk parse below skips that per line)."""
    if rec is None or str not in set(map(type, rec.values())):  # (in C: most records)
        return rec
    bad = [k for k, v in rec.items() if v.__class__ is str and k[:1] != "_" and v in records.DECODE_NONFINITE]
    if not bad:
        return rec
    out = dict(rec)
    for k in bad:
        out[k] = records.DECODE_NONFINITE[out[k]]
    return out


def _parse_lines(data: bytes) -> list[dict[str, Any]]:
    """The records of `data` (whole lines, each ending in a newline), in file order; lines
    that are not a JSON object are skipped. The lines are parsed as one JSON array, in C,
    as `stats.scan` does; line by line only when that fails (a torn or foreign line)."""
    if not data:
        return []
    recs = records.loads_block(data)
    if recs is not None:
        return recs
    out = []
    for _, line in records.iter_lines(data):
        if line.strip():
            try:
                out.append(records.loads(line))
            except ValueError:
                continue
    return out


class _ShardTail:
    """What a reader keeps of one shard between passes: offsets and bounded recent rows."""

    def __init__(self, path: Path, rank: int, stream: str | None, window: int,
                 series: str | None = None) -> None:
        self.path = path
        self.rank = rank
        self.stream = stream
        self.window = window
        self.series_key = series
        self.offset = 0  # end of the last complete line read
        self.ino: int | None = None
        self.mtime_ns = -1
        self.size = 0
        # the step rows' (step, _time), oldest first, at most `window`
        self.steps: array[int] = array("q")
        self.times: array[float] = array("d")
        self.last_step: int | None = None
        self.last_row: dict[str, Any] | None = None
        self.rank_recs: dict[int, deque[dict[str, Any]]] = {}  # by `_rank` (no series key)
        self.series: dict[int, _Series] = {}  # by `_rank` (with a series key)
        self.sidecar: dict[str, Any] | None = None
        self.sidecar_mtime_ns = -1

    # -- records -----------------------------------------------------------
    def _take(self, recs: list[dict[str, Any]]) -> None:
        """Add records read forward (oldest first). One loop sorts them, then each kind
        is added in bulk, its last `window` only: a first read takes ~130 records per
        shard, and at 16,384 shards a method call per record would be most of the pass."""
        rank, window = self.rank, self.window
        row_steps: list[int] = []
        row_times: list[float] = []
        last_row = None
        top = self.last_step
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for rec in recs:
            step = rec.get("_step")
            if step.__class__ is not int or not _MIN_STEP <= step <= _MAX_STEP:
                continue
            kind = rec.get("_kind")
            if kind is None:
                t = rec.get("_time")
                if t.__class__ is float or t.__class__ is int:
                    row_steps.append(step)
                    row_times.append(t)
                last_row = rec
            elif kind == "rank":
                r = rec.get("_rank")
                if r.__class__ is not int or r < 0:
                    continue
                group = by_rank.get(r)
                if group is None:
                    by_rank[r] = [rec]
                else:
                    group.append(rec)
                if r != rank:
                    continue
            else:
                continue
            if top is None or step > top:
                top = step
        self.last_step = top
        if last_row is not None:
            self.last_row = last_row
        if row_steps:
            try:
                times = array("d", row_times[-window:])
            except OverflowError:  # an int _time beyond a float
                times = array("d", (_series_value(t) for t in row_times[-window:]))
            self.steps = _pushed(self.steps, array("q", row_steps[-window:]), window)
            self.times = _pushed(self.times, times, window)
        for r, group in by_rank.items():
            group = group[-window:]
            if self.series_key is None:
                q = self.rank_recs.get(r)
                if q is None:
                    q = self.rank_recs[r] = deque(maxlen=window)
                q.extend(group)
                continue
            s = self.series.get(r)
            if s is None:
                s = self.series[r] = _Series()
            key = self.series_key
            s.steps = _pushed(s.steps, array("q", [rec["_step"] for rec in group]), window)
            s.values = _pushed(s.values, array("d", [_series_value(rec.get(key)) for rec in group]),
                               window)
            s.latest = latest = dict(s.latest)  # a new dict: see `_pushed`
            for rec in group:
                latest.update(rec)

    def _reset(self) -> None:
        self.offset = 0
        self.steps = array("q")
        self.times = array("d")
        self.rank_recs.clear()
        self.series.clear()
        self.last_step = None
        self.last_row = None

    def _read_tail(self, end: int) -> None:
        """Fill the window from the end of the file backwards (first pass, or a big jump).

        Enough lines for `window` step rows (and the rank records of their steps), or for
        `window` steps of rank records when the shard holds only those (an all-gathering
        rank 0 writes world_size of them per step), and never more than MAX_TAIL_LINES.
        Blocks are read backwards, growing, each parsed in one go.
        """
        self._reset()
        got: list[dict[str, Any]] = []  # newest first
        n_steps = 0
        top: int | None = None  # the largest step seen
        oldest: int | None = None  # the step of the window-th step row from the end
        pos, block = end, TAIL_BLOCK
        done = False
        with open(self.path, "rb") as fh:
            while pos > 0 and not done:
                start = max(0, pos - block)
                fh.seek(start)
                data = fh.read(pos - start)
                if start > 0:
                    cut = data.find(b"\n") + 1  # the block's first line may be cut
                    if cut == 0 or cut >= len(data):
                        block *= 2  # not one whole line in the block: a longer block
                        continue
                    data, start = data[cut:], start + cut
                for rec in reversed(_parse_lines(data)):
                    step = rec.get("_step")
                    if step.__class__ is not int:
                        continue
                    if top is None or step > top:
                        top = step
                    if oldest is not None and step < oldest:
                        done = True
                        break
                    if rec.get("_kind") is None:
                        n_steps += 1
                        if n_steps >= self.window:
                            oldest = step
                    elif n_steps == 0 and step <= top - self.window:
                        done = True
                        break
                    got.append(rec)
                    if len(got) >= MAX_TAIL_LINES:
                        done = True
                        break
                pos = start
                block = min(2 * block, MAX_CATCHUP)
        got.reverse()
        self._take(got)
        self.offset = end

    def _read_forward(self, end: int) -> None:
        with open(self.path, "rb") as fh:
            for _, data in records.complete_blocks(fh, 1 << 20, self.offset):
                self._take(_parse_lines(data))
                self.offset += len(data)
                if self.offset >= end:
                    break

    def refresh(self) -> bool:
        """Read what changed since the last pass; False if the shard is gone."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        self._refresh_sidecar()
        if st.st_mtime_ns == self.mtime_ns and st.st_size == self.size and st.st_ino == self.ino:
            return True
        replaced = self.ino is not None and st.st_ino != self.ino
        self.ino, self.mtime_ns, self.size = st.st_ino, st.st_mtime_ns, st.st_size
        try:
            with open(self.path, "rb") as fh:
                end = records.complete_end(fh, TAIL_BLOCK)
            if replaced or end < self.offset or end - self.offset > MAX_CATCHUP or self.offset == 0:
                self._read_tail(end)
            elif end > self.offset:
                self._read_forward(end)
        except OSError:
            return False
        return True

    def _refresh_sidecar(self) -> None:
        side = self.path.with_name(self.path.name[: -len(".jsonl")] + ".meta.json")
        try:
            mtime = os.stat(side).st_mtime_ns
        except OSError:
            self.sidecar, self.sidecar_mtime_ns = None, -1
            return
        if mtime != self.sidecar_mtime_ns:
            self.sidecar = read_sidecar(side)
            self.sidecar_mtime_ns = mtime

    # -- the snapshot --------------------------------------------------------
    def state(self, here: str) -> RankState:
        """This shard as a RankState; `here` is this host's name (to check pids)."""
        meta = self.sidecar or {}
        out = RankState(
            rank=self.rank,
            stream=self.stream,
            path=self.path,
            last_step=self.last_step,
            last_write=self.mtime_ns / 1e9 if self.mtime_ns >= 0 else None,
            size=self.size,
            steps=self.steps,
            times=self.times,
            last_row=_decoded(self.last_row),
        )
        # spool mode: exprd writes the shard, the sidecar names the training process as origin
        spool = meta.get("source") == "spool"
        host = meta.get("origin_host" if spool else "host")
        pid = meta.get("origin_pid" if spool else "pid")
        out.host = host if isinstance(host, str) else None
        out.pid = pid if type(pid) is int and pid > 0 else None
        out.world_size = _int(meta.get("world_size"))
        out.local_rank = _int(meta.get("local_rank"), zero=True)
        out.local_world_size = _int(meta.get("local_world_size"))
        session = meta.get("session")
        out.session = session if isinstance(session, str) else None
        out.start_time = _num(meta.get("start_time"))
        out.end_time = _num(meta.get("end_time"))
        ex = meta.get("exit")
        out.exit = dict(ex) if isinstance(ex, Mapping) else None
        status = meta.get("status")
        out.status = status if status in STATUSES else "running"
        if out.status == "crashed":
            out.status_reason = "exception" if out.exit else "crashed"
        elif (out.status == "running" and out.host == here and out.pid is not None
              and not pid_alive(out.pid)):
            out.status, out.status_reason = "crashed", "process gone"
        return out


def _int(value: Any, zero: bool = False) -> int | None:
    ok = type(value) is int and (value >= 0 if zero else value > 0)
    return value if ok else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def list_shards(run_dir: str | os.PathLike[str], stream: str | None = None) -> dict[int, Path]:
    """The shard files of one stream of a run, by rank (no sidecar is read)."""
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return out
    for entry in entries:
        parsed = parse_shard_name(entry.name)
        if parsed is not None and parsed.stream == stream:
            out[parsed.rank] = Path(entry.path)
    return out


class RunReader:
    """Reads one stream of a run again and again, keeping offsets and windows in memory."""

    def __init__(
        self, run_dir: str | os.PathLike[str], stream: str | None = None, *,
        window: int = DEFAULT_WINDOW, series: str | None = None,
    ) -> None:
        """`series`: keep of the rank records only that key's values and the latest value
        of each key (`RunState.series`), not whole records: what a watcher of thousands
        of ranks needs, in bounded memory."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        if series is not None and (not isinstance(series, str) or not series):
            raise ValueError(f"series must be a metric name, got {series!r}")
        self.run_dir = Path(run_dir)
        self.stream = stream
        self.window = window
        self.series = series
        self._tails: dict[int, _ShardTail] = {}
        self._here = socket.gethostname()

    def read(self) -> RunState:
        """One pass: list the shards, refresh each (a first read of many in processes)."""
        import time

        now = time.time()
        found = list_shards(self.run_dir, self.stream)
        for rank in [r for r in self._tails if r not in found or self._tails[r].path != found[r]]:
            del self._tails[rank]
        for rank, path in found.items():
            if rank not in self._tails:
                self._tails[rank] = _ShardTail(path, rank, self.stream, self.window, self.series)
        live = []
        fresh = [t for t in self._tails.values() if t.ino is None]  # never read: a whole tail each
        if len(fresh) >= _FORK_MIN:
            from expr_tracker.stats.parallel import map_forked

            for good, t in map_forked(_refresh, fresh):
                self._tails[t.rank] = t  # a copy, from a worker process
                if good:
                    live.append(t)
            fresh_ranks = {t.rank for t in fresh}
            rest = [t for r, t in self._tails.items() if r not in fresh_ranks]
        else:
            rest = list(self._tails.values())
        live.extend(t for good, t in _refresh(rest) if good)
        live.sort(key=lambda t: t.rank)
        state = RunState(
            run_dir=self.run_dir,
            stream=self.stream,
            ranks={t.rank: t.state(self._here) for t in live},
            rank_records={},
            read_time=now,
            series_key=self.series,
        )
        if self.series is None:
            state.rank_records = _merge_records(live, self.window)
        else:
            state.rank_records, state.series = _merge_series(live, self.window)
        return state


def _merge_records(tails: list[_ShardTail], window: int) -> dict[int, list[dict[str, Any]]]:
    """The rank records of every shard by `_rank`; a rank named in several shards keeps
    its latest `window` records by step."""
    by_rank: dict[int, deque[dict[str, Any]]] = {}
    for t in tails:
        for r, q in t.rank_recs.items():
            mine = by_rank.get(r)
            if mine is None:
                by_rank[r] = deque(q, maxlen=window)
            else:
                mine.extend(q)
                by_rank[r] = deque(sorted(mine, key=_step_of)[-window:], maxlen=window)
    return {r: list(q) for r, q in sorted(by_rank.items())}


def _merge_series(tails: list[_ShardTail], window: int) -> tuple[
        dict[int, list[dict[str, Any]]], dict[int, Sequence[float]]]:
    """`_merge_records` for compact tails: per rank one record (the latest value of each
    key; the shard with the latest step wins) and the series values. Shared with the
    tails, which replace rather than change them."""
    by_rank: dict[int, list[_Series]] = {}
    for t in tails:
        for r, s in t.series.items():
            by_rank.setdefault(r, []).append(s)
    latest: dict[int, list[dict[str, Any]]] = {}
    values: dict[int, Sequence[float]] = {}
    for r in sorted(by_rank):
        parts = by_rank[r]
        rec: dict[str, Any]
        if len(parts) == 1:
            s = parts[0]
            rec, vals = s.latest, s.values
        else:
            parts.sort(key=lambda s: s.steps[-1] if s.steps else -1)
            rec = {}
            for s in parts:
                rec.update(s.latest)
            pairs = sorted((p for s in parts for p in zip(s.steps, s.values, strict=True)),
                           key=lambda p: p[0])
            vals = array("d", (v for _, v in pairs[-window:]))
        latest[r] = [_decoded(rec) or rec]
        values[r] = vals
    return latest, values


def _step_of(rec: Mapping[str, Any]) -> int:
    step = rec.get("_step")
    return step if type(step) is int else -1


def _refresh(tails: list[_ShardTail]) -> list[tuple[bool, _ShardTail]]:
    """Refresh each tail (see `_ShardTail.refresh`); run in worker processes too."""
    return [(t.refresh(), t) for t in tails]


def read_run(
    run_dir: str | os.PathLike[str], stream: str | None = None, *, window: int = DEFAULT_WINDOW
) -> RunState:
    """One-shot: the live state of one stream of the run in `run_dir` (see `RunReader`)."""
    return RunReader(run_dir, stream, window=window).read()
