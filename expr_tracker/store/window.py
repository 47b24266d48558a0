"""Where a recent window of a shard starts, read from its end (DESIGN 14). File reading only.

Readers of a live run want the last few dozen steps of thousands of shards: these find
the byte offset of that window by reading blocks backwards from the end of the file, so
the cost is the window's, whatever the shard's length. Records are in (nearly)
increasing step order, as writers append them; `_step` is found by a pattern, without
parsing the lines.
"""

from __future__ import annotations

import errno
import io
import os
import re
from typing import BinaryIO

_STEP_RE = re.compile(rb'"_step":\s*(\d+)')
_RANK_RE = re.compile(rb'"_kind":\s*"rank"')
_SAMPLE_RE = re.compile(rb'"_source":\s*"system"')  # the SDK's system samples (DESIGN 19)
WINDOW_BLOCK = 64 << 10  # reverse-read block when looking for the start of a recent window


def _bound(data: bytes, pos: int) -> tuple[int, int | None]:
    """The first line at or after `pos` that has a step: its offset, and the step that
    every line before it stays under (None: not known from `data`).

    Rank records are in step order, and so are step rows, but not the two together: the
    row of step N is committed only when step N+1 opens (`et.log(step=N+1)`), after that
    step's rank records, so those precede it. A rank record of step s bounds what precedes
    it by s; a step row bounds it by the step of the next row (the rank records before it
    belong to that step at most). A system sample is dated like a step row (the step of
    the last row committed, behind the rank records of the open step) and bounds alike."""
    m = _STEP_RE.search(data, pos)
    if m is None:
        return len(data), None
    line = data.rfind(b"\n", 0, m.start()) + 1
    nl = data.find(b"\n", m.end())
    nl = len(data) if nl < 0 else nl
    if _RANK_RE.search(data, line, nl) is not None and _SAMPLE_RE.search(data, line, nl) is None:
        return line, int(m.group(1))
    # a step row (or a sample): the step of the next step row
    pos = nl + 1
    while pos < len(data):
        nl = data.find(b"\n", pos)
        nl = len(data) if nl < 0 else nl
        m = _STEP_RE.search(data, pos, nl)
        if m is not None and _RANK_RE.search(data, pos, nl) is None:
            return line, int(m.group(1))
        pos = nl + 1
    return line, None


def _before(bound: int | None, lo: int) -> bool:
    """Every line before this one has a step under `lo` (see `_bound`)."""
    return bound is not None and bound < lo


def window_start(fh: BinaryIO, lo: int, block: int = WINDOW_BLOCK) -> int:
    """An offset before which every line has a step under `lo`, close to the first line
    with a step >= `lo`, reading the open shard backwards a block at a time: a recent
    window costs its own bytes, whatever the shard's length (DESIGN 14). Rank records and
    step rows are each in increasing step order, and the two are interleaved as writers
    append them (`_bound`); lines after the offset may still have smaller steps, which
    readers skip or keep as they do any line. 0 when the window reaches back to the start.

    A shared `rank_aware=False` file (DESIGN 3) holds each rank's lines in step order, but
    the ranks' flushes follow one another in any order (rank 1's steps 0-9 after rank 0's
    steps 0-20): no line bounds the steps before it, and the window is the whole file. Its
    step rows carry `_rank` (those of a rank's own shard do not), which tells it."""
    end = data_end(fh)
    while end > 0:
        start = max(0, end - block)
        fh.seek(start)
        data = fh.read(end - start)  # ends where a line starts (or at the end of the file)
        nul = data.rfind(b"\0")
        if nul == len(data) - 1:  # a crash's NUL run ends the line before: jump it
            end = before_nuls(fh, end)
            continue
        if nul >= 0:  # the lines after the NULs are whole: those before, in the next block
            data, start = data[nul + 1:], start + nul + 1
        # the first line of a block may be cut, unless the block starts the file (or NULs)
        pos = 0 if start == 0 or nul >= 0 else data.find(b"\n") + 1
        if data.count(b'"_rank"', pos) > data.count(b'"rank"', pos):
            return 0  # step rows with `_rank` (`"_kind":"rank"` marks the rank records)
        if start > 0 and nul < 0 and (pos == 0 or pos >= len(data)):
            end = start  # no whole line in the block (a long line): look further back
            continue
        first, bound = _bound(data, pos)
        if start == 0 or _before(bound, lo):
            # the window starts in this block: after the last line that bounds what
            # precedes it under lo; halve the span while a line start falls inside it,
            # then walk the last few lines
            if _before(bound, lo):
                pos = first
                top = len(data)
                while top - pos > 1024:
                    nl = data.find(b"\n", (pos + top) // 2, top)
                    if nl < 0 or nl + 1 >= top:
                        break
                    at, bound = _bound(data, nl + 1)
                    if at < top and _before(bound, lo):
                        pos = at
                    else:
                        top = nl + 1
            else:
                pos = 0
            while pos < len(data):
                at, bound = _bound(data, pos)
                if at >= len(data) or not _before(bound, lo):
                    return start + pos
                nl = data.find(b"\n", at)
                if nl < 0:
                    return start + pos
                pos = nl + 1
            return start + pos
        end = start + pos
    return 0


def last_step(fh: BinaryIO, block: int = 4096) -> int | None:
    """The step of the shard's last line that has one (records are in about step order)."""
    end = data_end(fh)
    while end > 0:
        start = max(0, end - block)
        fh.seek(start)
        data = fh.read(end - start)
        if data[-1:] == b"\0":  # a crash's NUL run (a hole, maybe a GiB of one): jump it
            end = before_nuls(fh, end)
            continue
        found = _STEP_RE.findall(data)  # (the last match's group, without a match object each)
        if found:
            return int(found[-1])
        end = start
        block = min(4 * block, MAX_BLOCK)  # (a 20 GB NUL tail was read whole, growing)
    return None


MAX_BLOCK = 1 << 20  # bytes read at once going backwards


def end_of_data(fh: BinaryIO, size: int) -> int:
    """Where the file's trailing hole starts (`size` when it has none or the filesystem
    cannot say): a crashed node's shard may end in gigabytes of one."""
    try:
        fd = fh.fileno()
        if size < (1 << 20) or os.lseek(fd, size - 1, os.SEEK_HOLE) >= size:
            return size  # small, or its last byte is data
        return _hole_start(fd, size)
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return size


def _hole_start(fd: int, pos: int) -> int:
    """Where the hole that holds byte `pos - 1` starts. There is no seek to the data
    before an offset: a binary search for the lowest offset with no data up to `pos`
    (about 30 `lseek`s for a terabyte, whatever the number of extents)."""
    lo, hi = 0, pos - 1  # no data in [hi, pos); some in [lo, pos) unless lo is the answer
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            data = os.lseek(fd, mid, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            data = pos  # no data after mid at all
        if data >= pos:
            hi = mid
        else:
            lo = max(mid + 1, os.lseek(fd, data, os.SEEK_HOLE))
    return lo


def before_nuls(fh: BinaryIO, pos: int) -> int:
    """Where the run of NUL bytes that ends at `pos` starts (`pos` if byte `pos - 1` is no
    NUL). A run of NULs is what a node crash leaves in a shard, often gigabytes of a
    sparse hole, and it ends a line as a newline does: backward readers jump it, holes
    with `SEEK_DATA` and written NULs read back a bounded block at a time, so the cost is
    the data's, whatever the hole (issue 54)."""
    block = 4096
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        data = fh.read(pos - start)
        kept = data.rstrip(b"\0")
        if kept:
            return start + len(kept)  # (the usual case: one read, its last byte no NUL)
        pos = start
        try:  # a hole: jumped whole
            fd = fh.fileno()
            if pos > 0 and os.lseek(fd, pos - 1, os.SEEK_HOLE) == pos - 1:
                pos = _hole_start(fd, pos)
        except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
            pass  # no holes known here (bytes in memory): read on
        block = min(2 * block, MAX_BLOCK)
    return 0


def data_end(fh: BinaryIO) -> int:
    """The end of the file without its NUL tail (a trailing hole, then NUL bytes read
    backwards a bounded block at a time): where a backward search for lines starts."""
    return before_nuls(fh, end_of_data(fh, fh.seek(0, 2)))


class Short(Exception):
    """A `TailBytes` was asked for bytes before those it holds: read the file itself."""


class TailBytes:
    """The last bytes of a file, read once (one `pread`), as a read-only binary file: the
    readers above, `records.complete_end` and `ShardTail`'s reverse read all seek from
    the end, and several of them share one read of each shard's tail instead of opening
    it each (16,384 shards: three opens and a dozen reads each). A read that reaches
    before the bytes held raises `Short`; the caller then reads the file, and gets the
    same answer, since these are the file's bytes at their own offsets."""

    __slots__ = ("base", "data", "pos", "size")

    def __init__(self, data: bytes, base: int) -> None:
        self.data, self.base = data, base
        self.size = self.pos = base + len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos if whence == 1 else self.size) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        pos = self.pos
        if pos < self.base:
            raise Short
        end = self.size if n is None or n < 0 else min(self.size, pos + n)
        if end <= pos:
            return b""
        self.pos = end
        return self.data[pos - self.base:end - self.base]
