"""One shard's tail, read again and again (DESIGN 13, 14): what `health.state` builds on.

A `ShardTail` keeps a shard's read offset, its identity (size, mtime, inode, and its
sidecar's), and the recent rows of a bounded window: the last `window` step rows as
arrays of (step, _time), and of the rank records either the last `window` per `_rank`
or, with a series key, that key's values and the latest value of each key (`Series`).
`refresh()` costs a `stat` of the shard (and of its sidecar) when nothing changed, reads
only the complete lines appended since the last pass, and reads the tail again after a
truncation, a replacement or a jump of more than `MAX_CATCHUP` bytes.

Nothing here writes.
"""

from __future__ import annotations

import marshal
import math
import os
from array import array
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import orjson

from expr_tracker.gcpause import paused_gc
from expr_tracker.store import records
from expr_tracker.store.cursor import read_sidecar
from expr_tracker.store.records import is_sample
from expr_tracker.store.safedir import open_read, open_regular_stat, read_all
from expr_tracker.store.window import WINDOW_BLOCK, Short, TailBytes, before_nuls

if TYPE_CHECKING:
    from expr_tracker.stats.scan import ShardScan

MAX_CATCHUP = 4 << 20  # bytes read forward per shard and pass; beyond it, re-read the tail
MAX_TAIL_LINES = 100_000  # records parsed by one tail read
TAIL_BLOCK = 16 << 10  # reverse-read block: a few dozen lines, not the 256 KiB of a full read
SMALL_WINDOW, SMALL_BLOCK = 8, 4 << 10  # ... and for a window of a few steps, a few lines
MIN_BLOCK = 512  # the least a first reverse block of a small window parses
_MIN_STEP, _MAX_STEP = -(1 << 63), (1 << 63) - 1  # steps an array("q") holds


def system_values(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The values of a system-metrics sample (DESIGN 19, `records.is_sample`) and its
    `_step`; None for any other record."""
    if not (("_source" in rec or "system/rss_mb" in rec) and is_sample(rec)):
        return None
    out = {k: v for k, v in rec.items() if k[:1] != "_"}
    out["_step"] = rec.get("_step")
    return out


class Series:
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


def _sampled(rec: dict[str, Any]) -> bool:
    """A system-metrics sample: not a step the rank reported (issue 54: a live rank whose
    only record was its first sample, at step 0, held the frontier at 0 while the others
    were at 39). Two lookups before the call: most rank records are not samples."""
    return ("_source" in rec or "system/rss_mb" in rec) and is_sample(rec)


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


def _series_values(vals: list[Any]) -> array[float]:
    """`_series_value` of each: converted in C when all are floats and ints (most tails:
    a function call per record was a tenth of a first pass), else one at a time."""
    if set(map(type, vals)) <= {float, int}:  # (not bool, None, text: those are NaN)
        try:
            return array("d", vals)
        except OverflowError:  # an int beyond a float
            pass
    return array("d", [_series_value(v) for v in vals])


def decoded(rec: dict[str, Any] | None) -> dict[str, Any] | None:
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


class ShardTail:
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
        self.series: dict[int, Series] = {}  # by `_rank` (with a series key)
        # by `_rank`: its latest system-metrics sample read (whatever the window keeps)
        self.system: dict[int, dict[str, Any]] = {}
        self.sidecar: dict[str, Any] | None = None
        self.sidecar_stat: tuple[int, int, int] | None = None  # (mtime_ns, size, inode)
        self.sidecar_corrupt = False  # a sidecar file is there but is no JSON object
        self._side_fails = 0  # reads in a row that failed while a good copy was kept
        # plain strings: a pass stats every shard and sidecar, and a Path costs a conversion
        self._shard_name = os.fspath(path)
        self._side_name = self._shard_name[: -len(".jsonl")] + ".meta.json"
        self.version = 0  # bumped whenever the shard or its sidecar is read again
        self.ok = False  # the last refresh found the shard (and could read it)
        self.read_now = False  # the last refresh read shard data ...
        self.side_read_now = False  # ... or the sidecar

    # -- sent from a worker process ---------------------------------------------
    def _packed(self) -> dict[str, Any]:
        """The tail's state in the types `marshal` writes (see `TailList`)."""
        state = dict(vars(self))
        state["path"] = self._shard_name
        state["steps"], state["times"] = self.steps.tobytes(), self.times.tobytes()
        state["rank_recs"] = {r: list(q) for r, q in self.rank_recs.items()}
        state["series"] = {r: (s.steps.tobytes(), s.values.tobytes(), s.latest)
                           for r, s in self.series.items()}
        return state

    @classmethod
    def _unpacked(cls, state: dict[str, Any]) -> ShardTail:
        state["path"] = Path(state["path"])
        for name, code in (("steps", "q"), ("times", "d")):
            arr = array(code)
            arr.frombytes(state[name])
            state[name] = arr
        window = state["window"]
        state["rank_recs"] = {r: deque(q, maxlen=window) for r, q in state["rank_recs"].items()}
        series = {}
        for r, (steps, values, latest) in state["series"].items():
            s = series[r] = Series()
            s.steps.frombytes(steps)
            s.values.frombytes(values)
            s.latest = latest
        state["series"] = series
        tail = cls.__new__(cls)
        vars(tail).update(state)
        return tail

    # -- records -----------------------------------------------------------
    def _take(self, recs: list[dict[str, Any]]) -> None:
        """Add records read forward (oldest first). One loop sorts them, then each kind
        is added in bulk, its last `window` only: a first read takes ~130 records per
        shard, and at 16,384 shards a method call per record would be most of the pass."""
        rank = self.rank
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
                if r != rank or _sampled(rec):
                    continue
            else:
                continue
            if top is None or step > top:
                top = step
        self._store(row_steps, row_times, last_row, top, by_rank)

    def _store(self, row_steps: list[int], row_times: list[float], last_row: Any,
               top: int | None, by_rank: dict[int, list[dict[str, Any]]]) -> None:
        """What `_take` sorted out of its records (each list oldest first), kept."""
        window = self.window
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
            # the latest system-metrics sample: two lookups inline before the call (a call
            # of `system_values` per record was most of this loop's time)
            sample = next((rec for rec in reversed(group) if ("_source" in rec or "system/rss_mb"
                           in rec) and is_sample(rec)), None)
            if sample is not None:
                self.system[r] = system_values(sample)  # type: ignore[assignment]
            group = group[-window:]
            if self.series_key is None:
                q = self.rank_recs.get(r)
                if q is None:
                    q = self.rank_recs[r] = deque(maxlen=window)
                q.extend(group)
                continue
            s = self.series.get(r)
            if s is None:
                s = self.series[r] = Series()
            key = self.series_key
            s.steps = _pushed(s.steps, array("q", [rec["_step"] for rec in group]), window)
            s.values = _pushed(s.values, _series_values([rec.get(key) for rec in group]), window)
            s.latest = latest = dict(s.latest)  # a new dict: see `_pushed`
            for rec in group:
                latest.update(rec)

    def _reset(self) -> None:
        self.offset = 0
        self.steps = array("q")
        self.times = array("d")
        self.rank_recs.clear()
        self.series.clear()
        self.system.clear()
        self.last_step = None
        self.last_row = None

    def _read_tail(self, end: int, fh: BinaryIO | None = None) -> None:
        """Fill the window from the end of the file backwards (first pass, or a big jump).

        Enough lines for `window` step rows (and the rank records of their steps), or for
        `window` steps of rank records when the shard holds only those (an all-gathering
        rank 0 writes world_size of them per step), and never more than MAX_TAIL_LINES.
        Blocks are read backwards, growing, each parsed in one go. `fh`: the shard open
        (or its tail read, `TailBytes`); else it is opened here.
        """
        if fh is None:
            with open_read(self._shard_name) as own:
                return self._read_tail(end, own)
        self._reset()
        # the records kept, sorted as `_take` sorts them, newest first
        row_steps: list[int] = []
        row_times: list[float] = []
        last_row = None
        mine: int | None = None  # the last step of a step row or of this rank's records
        by_rank: dict[int, list[dict[str, Any]]] = {}
        oldest_at: dict[int, int] = {}  # `_rank` -> when its oldest record was taken
        rank, taken = self.rank, 0
        n_steps = 0
        top: int | None = None  # the largest step seen
        oldest: int | None = None  # the step of the window-th step row from the end
        pos, block = end, self._first_block()
        done = False
        while pos > 0 and not done:
            start = max(0, pos - block)
            fh.seek(start)
            data = fh.read(pos - start)
            nul = data.rfind(b"\0")
            if nul == len(data) - 1:  # a crash's NUL run ends the line before: jump it
                pos = before_nuls(fh, pos)
                continue
            if nul >= 0:  # the lines after the NULs are whole (those before: next block)
                data, start = data[nul + 1:], start + nul + 1
            elif start > 0:
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
                kind = rec.get("_kind")
                if kind is None:
                    n_steps += 1
                    if n_steps >= self.window:
                        oldest = step
                elif n_steps == 0 and step <= top - self.window:
                    done = True
                    break
                # what `_take` does with each record, here, newest first (one loop over
                # the records, not two: this is most of a first read's Python)
                if _MIN_STEP <= step <= _MAX_STEP:
                    if kind is None:
                        t = rec.get("_time")
                        if t.__class__ is float or t.__class__ is int:
                            row_steps.append(step)
                            row_times.append(t)
                        if last_row is None:
                            last_row = rec
                        if mine is None or step > mine:
                            mine = step
                    elif kind == "rank":
                        r = rec.get("_rank")
                        if r.__class__ is int and r >= 0:
                            group = by_rank.get(r)
                            if group is None:
                                by_rank[r] = [rec]
                            else:
                                group.append(rec)
                            oldest_at[r] = taken
                            if r == rank and (mine is None or step > mine) \
                                    and not _sampled(rec):
                                mine = step
                taken += 1
                if taken >= MAX_TAIL_LINES:
                    done = True
                    break
            if n_steps and not done:
                # the next block sized by the bytes a step took so far (a quarter more),
                # not doubled: parsing is most of a first read, and a doubled block can
                # parse up to twice the lines the window needs
                # (a small window's first block fell short by a line or two: a step more)
                per_step = (end - start) / n_steps
                small = self.window <= SMALL_WINDOW
                more = max(self.window - n_steps, 0) + 1 if small else self.window - n_steps
                block = min(MAX_CATCHUP, max(int(more * per_step * 1.25),
                                             MIN_BLOCK if small else SMALL_BLOCK))
            else:
                block = min(2 * block, MAX_CATCHUP)
            pos = start
        row_steps.reverse()
        row_times.reverse()
        for group in by_rank.values():
            group.reverse()
        if len(by_rank) > 1:  # in the order `_take` finds them: by their oldest record
            by_rank = {r: by_rank[r] for r in sorted(by_rank, key=oldest_at.__getitem__,
                                                       reverse=True)}
        self._store(row_steps, row_times, last_row, mine, by_rank)
        self.offset = end

    def _first_block(self) -> int:
        """The first reverse read: the state of a run (window 2) needs a few lines, and
        at 16,384 shards parsing 16 KiB of each would be most of the pass. For a small
        window, about its steps and one more by the sidecar's cursor (bytes per step so
        far, a quarter more), at most `SMALL_BLOCK`: parsing 4 KiB of each shard where a
        window of 2 takes 5 lines was half of `expr serve`'s first pass (issue 44)."""
        if self.window > SMALL_WINDOW:
            return TAIL_BLOCK
        cursor = (self.sidecar or {}).get("cursor")
        if isinstance(cursor, dict):
            n, last = cursor.get("bytes"), cursor.get("last_step")
            if type(n) is int and type(last) is int and n > 0 and last >= 0:
                return min(SMALL_BLOCK, max(MIN_BLOCK, int(n / (last + 1) * (self.window + 1) * 1.25)))
        return SMALL_BLOCK

    def _read_forward(self, end: int) -> None:
        with open_read(self._shard_name) as fh:
            for _, data in records.complete_blocks(fh, 1 << 20, self.offset):
                self._take(_parse_lines(data))
                self.offset += len(data)
                if self.offset >= end:
                    break

    def refresh(self, sidecar: bool = True) -> bool:
        """Read what changed since the last pass; False if the shard is gone. An unchanged
        shard (size, mtime and inode as before) and sidecar cost two `stat`s, no read;
        with `sidecar=False` (the reader knows no sidecar was replaced) the sidecar is
        checked only when the shard changed."""
        self.ok = self.read_now = self.side_read_now = False
        if self.ino is None:
            return self._first_read()
        try:
            st = os.stat(self._shard_name)
        except OSError:
            return False
        same = st.st_mtime_ns == self.mtime_ns and st.st_size == self.size and st.st_ino == self.ino
        if (sidecar or not same) and self._refresh_sidecar():
            self.version += 1
        if same:
            self.ok = True
            return True
        replaced = self.ino is not None and st.st_ino != self.ino
        self.ino, self.mtime_ns, self.size = st.st_ino, st.st_mtime_ns, st.st_size
        self.version += 1
        self.read_now = True
        try:
            with open_read(self._shard_name) as fh:
                end = records.complete_end(fh, self._first_block())
            if replaced or end < self.offset or end - self.offset > MAX_CATCHUP or self.offset == 0:
                self._read_tail(end)
            elif end > self.offset:
                self._read_forward(end)
        except OSError:
            return False
        self.ok = True
        return True

    def _first_read(self, steps: int = 0,
                    also: Callable[[BinaryIO, BinaryIO], None] | None = None) -> bool:
        """The first refresh: one open, `fstat` and `pread` of the shard's tail, which the
        reverse read then reads from memory; the file itself only when it reaches back
        further (`window.Short`). What `refresh` does for a shard never read, in fewer
        system calls (and no file object per read): at 16,384 shards they add up.

        `also(tail, file)`: called with the same read of the tail (a `TailBytes`) and the
        file, open, for a caller that reads more of it (`read_scanned`); the read then
        takes about the shard's last `steps` steps too (`_bytes_for`)."""
        try:
            fd, st = open_regular_stat(self._shard_name)
        except OSError:
            return False
        try:
            if self._refresh_sidecar(first=True):
                self.version += 1
            self.ino, self.mtime_ns, self.size = st.st_ino, st.st_mtime_ns, st.st_size
            self.version += 1
            self.read_now = True
            size = st.st_size
            want = min(size, max(self._tail_bytes(), self._bytes_for(steps)))
            data = os.pread(fd, want, size - want) if want else b""
            block = self._first_block()
            whole = len(data) == want
            if whole and also is None:
                # the usual first read of a small window: from memory, no file object
                tail = cast("BinaryIO", TailBytes(data, size - want))
                try:
                    self._read_tail(records.complete_end(tail, block), tail)
                    self.ok = True
                    return True
                except Short:
                    pass
            with open(fd, "rb", closefd=False) as fh:
                fh.raw.name = self._shard_name  # type: ignore[attr-defined]  # (for messages)
                # (what fell short from memory above is read from the file, not parsed again)
                held = cast("BinaryIO", TailBytes(data, size - want)
                            if whole and also is not None else fh)
                try:
                    self._read_tail(records.complete_end(held, block), held)
                except Short:
                    self._read_tail(records.complete_end(fh, block), fh)
                if also is not None:
                    also(held, fh)
        except OSError:
            return False
        finally:
            os.close(fd)
        self.ok = True
        return True

    def _tail_bytes(self) -> int:
        """How much of the end of a shard a first read takes in one `pread`: the last line's
        end and the first reverse block (and, for a long window, the next ones)."""
        return 2 * SMALL_BLOCK if self.window <= SMALL_WINDOW else 4 * TAIL_BLOCK

    def _bytes_for(self, steps: int) -> int:
        """About the bytes of the shard's last `steps` steps (0 for none), by its sidecar's
        cursor (the bytes and steps written so far) and a quarter more, and at least the
        block in which `window.window_start` looks for a window's start: where a guess
        falls short, the reader reads the file itself."""
        if steps <= 0:
            return 0
        guess = 4 * TAIL_BLOCK
        cursor = (self.sidecar or {}).get("cursor")
        if isinstance(cursor, dict):
            n, last = cursor.get("bytes"), cursor.get("last_step")
            if type(n) is int and type(last) is int and n > 0 and last >= 0:
                guess = int(n / (last + 1) * steps * 1.25)
        return min(MAX_CATCHUP, max(WINDOW_BLOCK, guess))

    def _refresh_sidecar(self, first: bool = False) -> bool:
        """Read the sidecar again if it changed (it is rewritten by a rename: a new inode);
        True if it did. `first`: never read yet, so it is opened at once (no `stat` first)."""
        if first:
            try:
                # a descriptor, no file object: 16,384 of them were a tenth of a first pass
                fd, st = open_regular_stat(self._side_name)
                try:
                    raw = read_all(fd, st.st_size)
                finally:
                    os.close(fd)
            except OSError:
                pass  # missing (or unreadable: the `stat` below tells which)
            else:
                self.sidecar = _json_object(raw)
                self.sidecar_corrupt = self.sidecar is None
                self.sidecar_stat = (st.st_mtime_ns, st.st_size, st.st_ino)
                self.side_read_now = True
                return True
        try:
            st = os.stat(self._side_name)
        except OSError:
            if self.sidecar is not None and self._side_fails < 1:
                self._side_fails += 1  # gone once (a rename seen half, a stale handle): kept
                return False
            changed = self.sidecar_stat is not None
            self.sidecar, self.sidecar_stat, self.sidecar_corrupt = None, None, False
            return changed
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self.sidecar_stat:
            self._side_fails = 0
            return False
        got = read_sidecar(Path(self._side_name))
        if got is None and self.sidecar is not None and self._side_fails < 1:
            # a read that fails once (a network filesystem's cached size over new bytes, a
            # rename under the read) keeps the last good copy; its stat is not taken, so the
            # next pass reads again, and a second failure in a row is believed
            self._side_fails += 1
            return False
        self._side_fails = 0
        self.sidecar = got
        self.sidecar_corrupt = self.sidecar is None
        self.sidecar_stat = key
        self.side_read_now = True
        return True


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """`cursor.read_sidecar` of bytes read already: the JSON object, else None."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class TailList(list[ShardTail]):
    """Tails, pickled as one `marshal` blob of their states: a first read of many shards
    is shared among forked processes (`state.RunReader`), and pickling 8,192 tails back
    (paths, deques, arrays, the records' dicts) cost as long as reading them (0.3 s to
    write and 0.5 s to read here); one blob of them all takes about a third, its keys
    written once. Every value in a tail is a JSON value, a number, text or bytes."""

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _unpack_tails, (marshal.dumps([t._packed() for t in self]),)


def _unpack_tails(blob: bytes) -> TailList:
    return TailList(ShardTail._unpacked(state) for state in marshal.loads(blob))


class ScannedTails(list[tuple[ShardTail, "ShardScan | None"]]):
    """(tail, scan) pairs of `read_scanned`, sent back from a worker process as a
    `TailList` is (the scans pickled as they are)."""

    def __reduce__(self) -> tuple[Any, tuple[bytes, list[ShardScan | None]]]:
        return _unpack_scanned, (marshal.dumps([t._packed() for t, _ in self]),
                                 [sc for _, sc in self])


def _unpack_scanned(blob: bytes, scans: list[ShardScan | None]) -> ScannedTails:
    tails = [ShardTail._unpacked(state) for state in marshal.loads(blob)]
    return ScannedTails(zip(tails, scans, strict=True))


def read_scanned(tails: list[ShardTail], recent: int) -> ScannedTails:
    """The first read of each tail (`refresh` of a tail never read), and from the same
    read of the shard the rank records of its last `recent` steps as columns
    (`stats.scan.scan_tail`; None where the shard could not be read): what `expr summary`
    reads of each shard, one open and one `pread` of each where two readers took three
    opens and half a dozen reads. Run in worker processes too (`parallel.iter_forked`)."""
    from expr_tracker.stats.scan import scan_tail

    out = ScannedTails()
    with paused_gc():
        for t in tails:
            got: list[ShardScan] = []
            name = t._shard_name

            def scan(held: BinaryIO, fh: BinaryIO, name: str = name,
                     got: list[ShardScan] = got) -> None:
                got.append(scan_tail(held, fh, name, recent))

            t.ok = t.read_now = t.side_read_now = False
            t._first_read(recent, scan)
            out.append((t, got[0] if t.ok and got else None))
    return out


def refresh_all(tails: list[ShardTail], sidecars: bool = True) -> TailList:
    """Refresh each tail (see `ShardTail.refresh`; `ok` says how it went); run in worker
    processes too. No (ok, tail) pairs: 16,384 tuples alive through a pass would be
    promoted by the garbage collector and bring on a full collection every few passes.

    The cyclic garbage collector is off meanwhile (`gcpause`): a first read of 16,384
    shards makes millions of dicts (none in a cycle), and the collections they set off
    were a third of its CPU time (in one process, window 64: about 5.8 s with it, 3.9 s
    without); here for the worker processes (`RunReader.read` pauses it in its own)."""
    with paused_gc():
        for t in tails:
            t.refresh(sidecars)
    return TailList(tails)
