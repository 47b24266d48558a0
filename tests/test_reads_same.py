"""The readers changed for issue 24 give the answers of the reads before, on the same
synthetic runs (every rank, every step, NaNs, text values, garbage, torn tails, long
shards and shards of several ranks included): a shard's first tail read (one `pread`),
the scan's accumulator, the chart's reducers of many steps and the heatmap's cells."""

from __future__ import annotations

import json
import math
import os
from array import array
from itertools import islice, repeat
from operator import lt
from pathlib import Path
from typing import Any, cast

import pytest

from expr_tracker.health import tail
from expr_tracker.stats import scan
from expr_tracker.stats.scan import (
    _ABSENT,
    _MAX_RANKS,
    _NONFINITE,
    _NUMBER,
    _Absent,
    _get,
    _Irregular,
)
from expr_tracker.store import records
from expr_tracker.store.window import last_step, window_start
from tests.synthetic import write_run

RECENT = 66


class _OldAcc(scan._Acc):
    """`scan._Acc` as it was before issue 24 (one `map` per key), the reference."""

    def add(self, recs: list[dict[str, Any]]) -> None:
        """Append the records of this rank (file order); _Irregular if they don't fit."""
        n = len(recs)
        steps = cast("list[int]", list(map(_get, recs, repeat("_step"))))
        if set(map(type, steps)) != {int}:
            raise _Irregular
        try:
            step_array = array("q", steps)
        except OverflowError:
            raise _Irregular from None
        if (self.steps and steps[0] <= self.steps[-1]) or not all(
            map(lt, steps, islice(steps, 1, None))
        ):
            raise _Irregular  # a repeated step: the later record wins, per key
        keys = tuple(recs[0])
        if self.keys is None:
            self.keys = keys
        elif set(keys) != set(self.keys):
            raise _Irregular
        if n > 1 and set(map(len, recs)) != {len(keys)}:
            raise _Irregular
        cols: dict[str, array[float]] = {}
        for key in keys:
            if key in ("_kind", "_step", "_rank"):
                continue  # present in every record: checked by the caller and above
            if key[:1] == "_" and key not in ("_weight", "_world_size"):
                if sum(map(dict.__contains__, recs, repeat(key))) != n:
                    raise _Irregular  # the same number of keys, but other keys
                continue
            col = list(map(_get, recs, repeat(key), repeat(_ABSENT)))
            types = set(map(type, col))
            if _Absent in types:
                raise _Irregular  # the same number of keys, but other keys
            if key[:1] == "_":
                if key == "_weight":
                    self._add_weights(col, types)
                elif key == "_world_size":
                    sizes = [w for w in col if w.__class__ is int and w <= _MAX_RANKS]
                    self.world = max([self.world, *sizes])
                continue
            if str in types:
                # non-finite values are written as "NaN", "Infinity", "-Infinity"
                col = [_NONFINITE.get(x, x) if x.__class__ is str else x for x in col]
                types = set(map(type, col))
            if types <= _NUMBER:
                try:
                    cols[key] = array("d", col)
                except OverflowError:
                    raise _Irregular from None
            elif types & _NUMBER:
                raise _Irregular  # a number at some steps only
        if "_weight" not in keys:
            self._add_weights([1.0] * n, {float})
        if self.steps and set(cols) != set(self.columns):
            raise _Irregular
        for key, values in cols.items():
            self.columns.setdefault(key, array("d")).extend(values)
        self.steps.extend(step_array)


def _old_scan(path: Path, recent: int) -> scan.ShardScan:
    """`scan.scan_shard(path, recent=recent)` before issue 24: its own reads of the file,
    every line parsed (`parse_rank_lines` without `only`), the old accumulator."""
    accs: dict[int, Any] = {}
    garbage, regular = 0, True
    saved = scan._Acc
    scan._Acc = _OldAcc  # type: ignore[misc]
    try:
        with open(path, "rb") as fh:
            top = last_step(fh)
            lo = None if top is None else top - recent + 1
            start = window_start(fh, lo) if lo is not None else 0
            for _, data in records.complete_blocks(fh, 4 << 20, start):
                recs, bad = scan.parse_rank_lines(data)
                garbage += bad
                if regular:
                    try:
                        scan._add_chunk(accs, recs)
                    except _Irregular:
                        regular, accs = False, {}
    finally:
        scan._Acc = saved  # type: ignore[misc]
    return scan.ShardScan(os.fspath(path), [a.block() for a in accs.values()] if regular else None,
                          garbage)


class _OldTail(tail.ShardTail):
    """The reference for a first read's records: the reverse read gathered them, newest
    first, and `_take` sorted them (one loop more)."""

    def _read_tail(self, end: int, fh: Any = None) -> None:
        """`ShardTail._read_tail` as it was before (records gathered, then `_take`)."""
        if fh is None:
            with open(self._shard_name, "rb") as own:
                return self._read_tail(end, own)
        self._reset()
        got: list[dict[str, Any]] = []  # newest first
        n_steps = 0
        top: int | None = None  # the largest step seen
        oldest: int | None = None  # the step of the window-th step row from the end
        pos, block = end, self._first_block()
        done = False
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
            for rec in reversed(tail._parse_lines(data)):
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
                if len(got) >= tail.MAX_TAIL_LINES:
                    done = True
                    break
            if n_steps and not done:
                # the next block sized by the bytes a step took so far (a quarter more),
                # not doubled: parsing is most of a first read, and a doubled block can
                # parse up to twice the lines the window needs
                per_step = (end - start) / n_steps
                block = min(tail.MAX_CATCHUP, max(
                    int((self.window - n_steps) * per_step * 1.25), tail.SMALL_BLOCK))
            else:
                block = min(2 * block, tail.MAX_CATCHUP)
            pos = start
        got.reverse()
        self._take(got)
        self.offset = end


def _same(v: Any) -> Any:
    """A value to compare (NaN equal to NaN, arrays as lists, text as it is)."""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else v
    if isinstance(v, array):
        return [_same(x) for x in v]
    if isinstance(v, dict):
        return {k: _same(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_same(x) for x in v]
    return v


def _scan_view(sc: scan.ShardScan) -> Any:
    blocks = None if sc.blocks is None else [
        (b.rank, b.world, list(b.steps), _same(b.weights), _same(b.columns)) for b in sc.blocks]
    return blocks, sc.garbage


def _tail_view(t: tail.ShardTail) -> Any:
    return {k: _same(v) if not isinstance(v, Path) else str(v) for k, v in vars(t).items()
            if k not in ("version", "scan", "scan_recent", "read_now", "side_read_now", "rank_recs",
                         "series")} | {
        "rank_recs": {r: [_same(x) for x in q] for r, q in t.rank_recs.items()},
        "series": {r: (list(s.steps), _same(s.values), _same(s.latest)) for r, s in t.series.items()}}


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec) + "\n"


def _odd_run(root: Path) -> Path:
    """A synthetic run (24 ranks, 150 steps) and shards that are anything but regular."""
    run = write_run(root / "p" / "odd", 24, 150, straggler=13, crashed=17)
    rr = {"_kind": "rank", "_world_size": 24, "_weight": 1.0}

    def add(rank: int, text: str) -> None:
        with open(run / f"metrics.rank{rank}.jsonl", "a") as fh:
            fh.write(text)

    # NaN, infinities and text among rank records and step rows
    add(3, "".join(_line({**rr, "_step": s, "_rank": 3, "_time": 1e9 + s,
                          "step_time": ("NaN", "Infinity", "-Infinity", "slow", 0.5)[s % 5],
                          "grad_norm": 1.0}) + _line({"_step": s, "_time": 1e9 + s, "loss": "NaN"})
                   for s in range(150, 170)))
    # garbage lines inside the window, and a torn tail
    add(4, "not json\n{\"_step\": 151, broken}\n" + _line({**rr, "_step": 150, "_rank": 4,
        "step_time": 0.5, "grad_norm": 1.0}) + '{"_kind":"rank","_step":15')
    # longer than any first read (a long text value per record): the file itself is read
    add(5, "".join(_line({**rr, "_step": s, "_rank": 5, "step_time": 0.5, "grad_norm": 1.0,
                          "note": "x" * 3000}) for s in range(150, 190)))
    # an escaped kind, a bare NaN token, a braced line that does not parse
    add(6, '{"_kind":"r\\u0061nk","_step":150,"_rank":6,"step_time":0.5,"grad_norm":1.0}\n')
    add(8, '{"_kind":"rank","_step":150,"_rank":8,"step_time":NaN,"grad_norm":1.0}\n')
    add(12, '{"_step": 150, "rank": }\n')
    # several ranks in one shard (an all-gather), with a repeated step
    add(7, "".join(_line({**rr, "_step": s, "_rank": r, "step_time": 0.5 + r, "grad_norm": 1.0})
                   for s in range(150, 160) for r in (7, 30, 31)) + _line(
        {**rr, "_step": 159, "_rank": 30, "step_time": 9.0, "grad_norm": 1.0}))
    # keys that come and go; a weight that varies; a string weight
    add(9, "".join(_line({**rr, "_step": s, "_rank": 9, "_weight": (1.0, 2.0, "NaN")[s % 3],
                          "step_time": 0.5, **({"extra": 1.0} if s % 4 == 0 else {})})
                   for s in range(150, 160)))
    add(10, "".join(_line({**rr, "_step": s, "_rank": 10, "_weight": float(s % 3 + 1),
                           "step_time": 0.5, "grad_norm": 1.0}) for s in range(150, 160)))
    add(11, "".join(_line({**rr, "_step": s, "_rank": 11, "_time": 1e9 + s, "_local_rank": 3, "step_time": (
        "NaN", "Infinity", 0.5)[s % 3], "grad_norm": 1.0}) for s in range(150, 160)))
    (run / "metrics.rank14.jsonl").write_bytes(b"")  # empty
    (run / "metrics.rank15.meta.json").unlink()  # no sidecar
    (run / "metrics.rank16.meta.json").write_text("{not json")  # a corrupt one
    (run / "metrics.rank18.meta.json").write_text("[1, 2]")  # not an object
    return run


@pytest.mark.parametrize("window", [2, 64])
def test_each_shard_reads_the_same_tail_and_scan(tmp_path: Path, window: int) -> None:
    run = _odd_run(tmp_path)
    shards = sorted(run.glob("metrics*.jsonl"))
    assert len(shards) == 24
    for i, path in enumerate(shards):
        new = tail.ShardTail(path, i, None, window)
        assert new.refresh()
        old = tail.ShardTail(path, i, None, window)
        old.ino = -1  # the path before issue 24: stat, then the file's own reads
        assert old.refresh()
        old.ino = new.ino
        assert _tail_view(new) == _tail_view(old), path.name
        assert _scan_view(scan.scan_shard(path, recent=RECENT)) == _scan_view(
            _old_scan(path, RECENT)), path.name
    # the odd shards are what they should be: the reference is not vacuous
    by_name = {Path(s).name: s for s in shards}
    assert scan.scan_shard(by_name["metrics.rank7.jsonl"], recent=RECENT).blocks is None  # repeated step
    assert scan.scan_shard(by_name["metrics.rank4.jsonl"], recent=RECENT).garbage == 1
    nan = scan.scan_shard(by_name["metrics.rank11.jsonl"], recent=RECENT).blocks
    assert nan is not None and sum(map(math.isnan, nan[0].columns["step_time"])) == 4
    # text among the numbers of step_time: irregular (the general reader's)
    assert scan.scan_shard(by_name["metrics.rank3.jsonl"], recent=RECENT).blocks is None
    big = tail.ShardTail(by_name["metrics.rank5.jsonl"], 5, None, window)
    assert os.path.getsize(big.path) > big._tail_bytes()  # read past the pread: the file itself
    assert big.refresh() and big.last_step == 189


def _mixed_shard(path: Path) -> None:
    """Several `_rank`s in an order that changes, system samples, step rows with and
    without a time, steps beyond an int64, other kinds, bad ranks."""
    lines = []
    for s in range(120):
        lines.append(_line({"_step": s, **({"_time": 1e9 + s} if s % 3 else {"_time": s})}
                           if s % 7 else {"_step": s}))
        for r in ((40, 3, 41) if s % 2 else (41, 40)):
            lines.append(_line({"_kind": "rank", "_step": s, "_rank": r, "step_time": 0.1 * r,
                                **({"grad_norm": 1.0} if r != 3 else {})}))
        if s % 5 == 0:
            lines.append(_line({"_kind": "rank", "_step": s, "_rank": 40, "system/rss_mb": s,
                                "system/cpu_percent": 5}))
        if s % 11 == 0:
            lines += [_line({"_kind": "span", "_step": s, "name": "fwd"}),
                      _line({"_kind": "rank", "_step": s, "_rank": -1, "step_time": 1.0}),
                      _line({"_kind": "rank", "_step": s, "_rank": "x", "step_time": 1.0}),
                      _line({"_step": 1 << 63, "_time": 1.0})]
    path.write_text("".join(lines))


@pytest.mark.parametrize("window", [2, 64])
@pytest.mark.parametrize("series", [None, "step_time"])
def test_a_first_read_keeps_the_records_take_kept(tmp_path: Path, window: int,
                                                  series: str | None) -> None:
    """The reverse read sorts its records as it reads them; `_take` sorted them after."""
    from expr_tracker.store.layout import parse_shard_name

    run = _odd_run(tmp_path)
    _mixed_shard(run / "metrics.rank40.jsonl")
    several = 0
    for path in sorted(run.glob("metrics*.jsonl")):
        shard = parse_shard_name(path.name)
        assert shard is not None
        new = tail.ShardTail(path, shard.rank, None, window, series)
        old = _OldTail(path, shard.rank, None, window, series)
        assert new.refresh() == old.refresh(), path.name
        assert _tail_view(new) == _tail_view(old), path.name
        # the same ranks in the same order (what iterates them sees no change)
        assert list(new.rank_recs) == list(old.rank_recs), path.name
        assert list(new.series) == list(old.series), path.name
        assert list(new.system) == list(old.system), path.name
        several += len(new.rank_recs or new.series) > 2
    assert several >= 1  # the shards of several ranks were among them


def test_one_read_of_each_shard_gives_the_tail_and_scan_of_two(tmp_path: Path) -> None:
    """`tail.read_scanned` (what `expr summary` reads of each shard: the state's tail and
    the scan from one `pread`) against a tail's own first read and `scan_shard`, here and
    sent back from a worker process (pickled as `parallel.iter_forked` sends it)."""
    import pickle

    run = _odd_run(tmp_path)
    shards = sorted(run.glob("metrics*.jsonl"))
    (run / "metrics.rank19.jsonl").unlink()  # listed, then gone: no tail, no scan
    fresh = [tail.ShardTail(path, i, None, 2) for i, path in enumerate(shards)]
    got = tail.read_scanned(fresh, RECENT)
    back = pickle.loads(pickle.dumps(got))
    assert len(got) == len(back) == len(shards)
    for i, path in enumerate(shards):
        alone = tail.ShardTail(path, i, None, 2)
        ok = alone.refresh()
        for t, sc in (got[i], back[i]):
            assert t.ok is ok, path.name
            if not ok:
                assert sc is None
                continue
            assert _tail_view(t) == _tail_view(alone), path.name
            assert sc is not None and _scan_view(sc) == _scan_view(_old_scan(path, RECENT)), path.name
    assert sum(t.ok for t, _ in got) == len(shards) - 1
    # the shard whose last steps reach back beyond the read was scanned from the file
    long = run / "metrics.rank5.jsonl"
    assert os.path.getsize(long) - os.path.getsize(run / "metrics.rank6.jsonl") > 100_000


def test_chart_reducers_are_those_of_each_step(tmp_path: Path) -> None:
    """`ColumnTable.reduce_steps` (the chart's 50 steps at once) against `reduce_step` at
    each step: blocks of the same steps (NaN, infinities, weights per step or one per
    rank) and the odd run's blocks, whose steps differ."""
    steps = array("q", range(100, 150))
    blocks = []
    for r in range(40):
        vals = array("d", [0.5 + 0.01 * ((r * 7 + s) % 5) for s in steps])
        if r == 3:
            vals[10], vals[20], vals[30] = math.nan, math.inf, -math.inf
        weights: float | array[float] = (array("d", [1.0 + (s % 3) for s in steps]) if r == 5
                                         else float(1 + r % 2))
        blocks.append(scan.Block(r, 48, steps, weights, {"step_time": vals,
                                                          "loss": array("d", [1.0] * len(steps))}))
    # a late rank and a crashed one in the middle, with other steps and another weight
    mixed = [b if b.rank not in (7, 30) else scan.Block(
        b.rank, 48, array("q", range(90 + b.rank, 140 + b.rank, 2)), 3.0,
        {k: array("d", v[:25]) for k, v in b.columns.items()}) for b in blocks]
    run = _odd_run(tmp_path)
    odd = {}
    for p in sorted(run.glob("metrics*.jsonl")):
        for b in scan.scan_shard(p, recent=RECENT).blocks or ():
            odd[b.rank] = b
    for table in (scan.ColumnTable(blocks), scan.ColumnTable([b for b in blocks if b.rank != 5]),
                  scan.ColumnTable(mixed), scan.ColumnTable(odd.values())):
        for key in table.keys:
            ks = table.key_steps(key)
            assert len(ks) >= 25
            got = [_same(st.as_dict()) for st in table.reduce_steps(key, ks)]
            assert got == [_same(table.reduce_step(key, s).as_dict()) for s in ks], key


def test_heatmap_cells_are_those_of_the_rank_table(tmp_path: Path) -> None:
    """`ColumnTable.heatmap` against `reduce.heatmap` of its `rank_table([key])` (the path
    before): a bucket per step (read in C) and buckets of several steps (their slices summed
    in C), NaN, infinities, -0.0, a sum past the largest float, a late and a crashed rank,
    the odd run's blocks."""
    from expr_tracker.stats import reduce

    steps = array("q", range(100, 150))
    blocks = []
    for r in range(40):
        vals = array("d", [0.5 + 0.01 * ((r * 7 + s) % 5) for s in steps])
        if r == 3:
            vals[10], vals[20], vals[30], vals[40] = math.nan, math.inf, -math.inf, -0.0
        if r == 4:
            vals[5] = -0.0
        if r == 5:  # a bucket whose sum overflows a float, another with one NaN only
            vals[0], vals[1], vals[49] = 1.5e308, 1.7e308, math.nan
        blocks.append(scan.Block(r, 48, steps, 1.0, {"step_time": vals}))
    mixed = [b if b.rank not in (7, 30) else scan.Block(
        b.rank, 48, array("q", range(90 + b.rank, 140 + b.rank, 2)), 1.0,
        {k: array("d", v[:25]) for k, v in b.columns.items()}) for b in blocks]
    run = _odd_run(tmp_path)
    odd = {}
    for p in sorted(run.glob("metrics*.jsonl")):
        for b in scan.scan_shard(p, recent=RECENT).blocks or ():
            odd[b.rank] = b
    for table in (scan.ColumnTable(blocks), scan.ColumnTable(mixed), scan.ColumnTable(odd.values())):
        for key in table.keys:
            ks = table.key_steps(key)
            for width, hsteps in ((60, ks[-50:]), (50, None), (7, ks[-50:]), (1, None)):
                got = table.heatmap(key, width, steps=hsteps)
                want = reduce.heatmap(table.rank_table([key]), key, width, steps=hsteps)
                assert json.dumps(_same(got)) == json.dumps(_same(want)), (key, width)
