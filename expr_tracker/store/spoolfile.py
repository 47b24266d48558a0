"""Spool files on disk (DESIGN 6): names, event ids, and reading them, in bounded memory.

The SDK's spool sink (`expr_tracker.spool`) writes them; exprd's tailer, `expr replay`,
`expr runs`/`expr status` and the sink's own read-your-writes read them through this module.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store import records
from expr_tracker.store.cursor import Cursor, cursor_from, rank_last_step, read_sidecar
from expr_tracker.store.layout import ShardPaths, spool_segment

SPOOL_VERSION = 1
MAX_LINE = 16 * 1024 * 1024  # a longer spool line is quarantined by exprd
_BLOCK = 1024 * 1024
_SESSION_RE = r"[A-Za-z0-9_\-]+"
# the `_seq` key of a spool line: a `"` inside a JSON string is always escaped, so an
# unescaped `{"_seq":` or `,"_seq":` is the key itself, never text in a value
SEQ_RE = re.compile(rb'([{,])"_seq":(\d+)')
HEARTBEAT = ".exprd.json"  # exprd's heartbeat in the spool root: {"host", "pid", "time"}
HEARTBEAT_STALE = 60.0  # seconds without a heartbeat before init says no exprd is running


def event_id(session: str, seq: int) -> str:
    """The id of a spool event: the Idempotency-Key of every remote delivery of it."""
    return f"{session}:{seq}"


def spool_files_of(spool_dir: Path, stem: str) -> list[Path]:
    """Spool files of shard `stem` in one run's spool directory, oldest first."""
    pattern = re.compile(re.escape(stem) + r"\.(" + _SESSION_RE + r")(?:~[1-9]\d*)?\.jsonl\Z")
    try:
        names = [n for n in os.listdir(spool_dir) if pattern.match(n)]
    except OSError:
        return []
    # sessions by the time their segments were opened (the init line's `_time`), a
    # session's segments in their order: a file's mtime is its last write, and one
    # session's finish and the next one's first row fall in one clock tick
    first: dict[str, float] = {}
    for n in names:
        base = spool_segment(n)[0]
        t = _opened(spool_dir / n)
        first[base] = min(first.get(base, t), t)
    return [spool_dir / n for n in sorted(
        names, key=lambda n: (first[spool_segment(n)[0]], spool_segment(n)))]


_OPENED = re.compile(rb'"_time":(-?[0-9][0-9.eE+-]*)')


def _opened(path: Path) -> float:
    """When the segment was opened: its init line's `_time` (orjson writes it third, in
    the first hundred bytes), else its mtime."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return 0.0
    m = _OPENED.search(head) if head.startswith(b'{"_event":"init"') else None
    if m is not None:
        try:
            return float(m.group(1))
        except ValueError:
            pass
    return _mtime(path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def session_of(path: Path, stem: str) -> str:
    """The session part of `{stem}.{session}.jsonl` (or of its segment `~N`)."""
    return spool_segment(path.name)[0][len(stem) + 1 :]


# lines a segment writer adds that are not events of the session: no `_seq` of their own
NOTES = (b'{"_event":"segment"', b'{"_event":"dropped"')


def is_note(line: bytes) -> bool:
    """A segment marker or a dropped-rows note (`store.segment`)."""
    return line.startswith(NOTES)


def data_end(fd: int, size: int) -> int:
    """Where the data of a spool file ends: a memory-mapped segment is pre-sized and zeros
    after its data (a JSON line holds no NUL byte). Found by bisection; `size` if the file
    does not end in a NUL."""
    if size == 0 or os.pread(fd, 1, size - 1) != b"\0":
        return size
    lo, hi = 0, size - 1  # the first NUL is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if os.pread(fd, 1, mid) == b"\0":
            hi = mid
        else:
            lo = mid + 1
    return lo


def scan_shard(paths: ShardPaths, rank: int | None = None) -> Cursor:
    """The cursor of a shard (rows, largest step, applied spool seqs), reading only.

    Starts from the sidecar hint when it is consistent with the file, like the writer's
    repair scan, but never repairs: spool-mode processes and dry runs must not write.
    With `rank` (a shared rank_aware=False shard) the largest step is that rank's own.
    """
    try:
        fd = os.open(paths.shard, os.O_RDONLY)
    except OSError:
        return Cursor()
    try:
        cursor = cursor_from(fd, os.fstat(fd).st_size, read_sidecar(paths.sidecar))
        if rank is not None:
            cursor.last_step = rank_last_step(fd, cursor.bytes, rank)
        return cursor
    finally:
        os.close(fd)



def line_seq(line: bytes) -> int | None:
    m = SEQ_RE.search(line)
    return int(m.group(2)) if m else None


def iter_unapplied_reverse(path: Path, done: int) -> Iterator[bytes]:
    """The complete lines of a spool file whose `_seq` is above `done`, last first.

    Reads backwards in blocks and stops at the first line already applied: memory stays
    bounded by the block size, and a large spool that is mostly applied costs little.
    (`_seq` grows along a spool file.)
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        size = data_end(fd, os.fstat(fd).st_size)
        end = 0
        while size > 0:  # the last newline before `size`
            start = max(0, size - _BLOCK)
            nl = os.pread(fd, size - start, start).rfind(b"\n")
            if nl >= 0:
                end = start + nl + 1
                break
            size = start
        carry = b""
        while end > 0:
            start = max(0, end - _BLOCK)
            data = os.pread(fd, end - start, start) + carry
            lines = data.split(b"\n")
            lines.pop()  # data ends at a newline: the last piece is empty
            body = lines
            carry = b""
            if start > 0:
                # the first piece may be the end of a line that started in an earlier block
                carry = lines[0] + b"\n"
                body = lines[1:]
            for line in reversed(body):
                seq = line_seq(line)
                if seq is None or is_note(line):
                    continue
                if seq <= done:
                    return
                yield line
            end = start
    finally:
        os.close(fd)


@dataclasses.dataclass
class Pending:
    """What the spool holds for a shard that the shard does not (yet): counted, not kept."""

    rows: int = 0
    last_step: int | None = None


def _is_record(line: bytes) -> bool:
    return not line.startswith(b'{"_event"')


def _own(ev: Mapping[str, Any], rank: int | None) -> bool:
    return rank is None or ev.get("_rank") == rank


def pending_of(paths: ShardPaths, spool_dir: Path, cursor: Cursor, rank: int | None = None) -> Pending:
    """Rows of this shard's spool files not applied yet, and the largest step among them
    (of rank `rank` only, for a shared rank_aware=False shard), in bounded memory."""
    out = Pending()
    for path in spool_files_of(spool_dir, paths.stem):
        done = cursor.applied.get(session_of(path, paths.stem), -1)
        found = False
        for line in iter_unapplied_reverse(path, done):
            if not _is_record(line):
                continue
            out.rows += 1
            if found or line.startswith(b'{"_kind"'):
                continue
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            step = ev.get("_step")
            if "_kind" not in ev and type(step) is int and _own(ev, rank):
                found = True  # steps grow along a file: the last row has the largest
                if out.last_step is None or step > out.last_step:
                    out.last_step = step
    return out


def unapplied_rows(paths: ShardPaths, spool_dir: Path, cursor: Cursor,
                   limit: int | None = None) -> list[dict[str, Any]]:
    """Record events in the spool files of this shard that the shard does not hold yet,
    oldest first; with `limit`, only the last `limit` step rows (no rank records), read
    from the end."""
    out: list[dict[str, Any]] = []
    for path in reversed(spool_files_of(spool_dir, paths.stem)):
        done = cursor.applied.get(session_of(path, paths.stem), -1)
        for line in iter_unapplied_reverse(path, done):
            if limit is not None and len(out) >= limit:
                break
            if not _is_record(line):
                continue
            try:
                ev = records.loads(line)
            except ValueError:
                continue
            if limit is None or "_kind" not in ev:
                out.append(ev)
    out.reverse()
    return out


MARK_BYTES = 256  # of a line's end: its `_seq` and `_time` (a record ends with them)


def line_mark(line: bytes) -> tuple[int, int]:
    """What tells the line that ends at a read offset from other bytes put there later:
    the length and CRC-32 of its last bytes (without its newline, or the NUL that cut it)."""
    tail = line[-MARK_BYTES:]
    return len(tail), zlib.crc32(tail)


def _holds(fd: int, offset: int, mark: tuple[int, int]) -> bool:
    """Does the file still hold the marked line's end just before `offset` - 1?"""
    n, crc = mark
    at = offset - 1 - n
    if at < 0:
        return False
    data = os.pread(fd, n, at)
    return len(data) == n and zlib.crc32(data) == crc


class SpoolReader:
    """Reads the complete lines of a spool file from a byte offset, bounded in memory.

    `lines()` yields `(start, end, line)` with `end` the offset after the newline; `line`
    is None for a line longer than `max_line` (skipped without holding it in memory).
    An unterminated last line is not yielded: its writer may still be writing it.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_line: int = MAX_LINE,
                 block: int = _BLOCK) -> None:
        self.path = Path(path)
        self.max_line = max_line
        self.block = block
        self.size = 0  # the file size when `lines()` started
        self.more = False  # `lines()` stopped at its limit with more data after it
        self.span = 0  # bytes of the lines `chunks()` yielded last, with their newlines
        self.zeros = False  # the last read ended at a NUL byte (a segment's unwritten part)
        # (offset, length) of the NUL runs with data after them the last read skipped
        self.nul_runs: list[tuple[int, int]] = []
        self._zeros: tuple[int, int] = (-1, -1)  # [start, size): zeros to the end, seen last
        self.cut = False  # the last read found the file no longer holds its `mark`

    def lines(self, offset: int, limit: int | None = None) -> Iterator[tuple[int, int, bytes | None]]:
        """Complete lines from `offset`; stops after about `limit` bytes at a line end."""
        for start, parts, big_end in self.chunks(offset, limit):
            if big_end is not None:
                yield start, big_end, None
                continue
            for line in parts:
                end = start + len(line) + 1
                yield start, end, (line if len(line) <= self.max_line else None)
                start = end

    def chunks(self, offset: int, limit: int | None = None, mark: tuple[int, int] | None = None
               ) -> Iterator[tuple[int, list[bytes], int | None]]:
        """`lines()` a block at a time: (offset of the first line, lines, None), or
        (start, [], end) for one line over `max_line` (a complete line in `parts` may
        also be longer than `max_line`: callers check).

        `mark`: what `line_mark` said of the line that ends at `offset`; if the file no
        longer holds it there, nothing is read and `cut` is set (the file was cut and
        written again past `offset` since: its bytes there are not the stream's)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = self.size = os.fstat(fd).st_size
            self.more = False
            self.zeros = False
            self.nul_runs = []
            self.cut = mark is not None and not _holds(fd, offset, mark)
            if self.cut:
                return
            stop = size if limit is None else min(size, offset + limit)
            pos = rd = offset  # pos: start of the line being assembled; rd: next read
            carry = b""
            oversize = False
            while rd < size:
                # a line longer than a block: each read at least its length so far, so
                # that assembling it copies it a few times, not once per block
                block = os.pread(fd, min(max(self.block, len(carry)), size - rd), rd)
                if not block:
                    break
                cut, after = -1, 0  # a NUL run with data after it: [cut, after)
                nul = block.find(0)
                if nul >= 0:
                    found = self._data_after(fd, rd + nul, size)
                    if found is None:
                        # a memory-mapped segment's zeros: its data ends here, for now
                        size = self.size = rd + nul
                        self.zeros = True
                    else:
                        # a page of zeros inside the data (a node crash before writeback):
                        # skipped, as in shards; a line it cut is yielded as it is (bad)
                        cut, after = rd + nul, found
                        self.nul_runs.append((cut, after - cut))
                    block = block[:nul]
                rd += len(block)
                if oversize:
                    nl = block.find(b"\n")
                    if nl < 0:
                        if cut >= 0:
                            yield pos, [], cut
                            pos = rd = after
                            oversize = False
                        continue
                    end = rd - len(block) + nl + 1
                    yield pos, [], end
                    pos, oversize = end, False
                    block = block[nl + 1 :]
                data = carry + block if carry else block
                parts = data.split(b"\n")
                carry = parts.pop()
                if parts:
                    self.span = len(data) - len(carry)
                    yield pos, parts, None
                    pos += len(data) - len(carry)
                if cut >= 0:
                    if carry:
                        self.span = len(carry) + 1
                        yield pos, [carry], None
                    pos = rd = after
                    carry = b""
                    if rd >= stop and pos > offset:
                        self.more = rd < size
                        break
                    continue
                if len(carry) > self.max_line:
                    oversize, carry = True, b""
                elif rd >= stop and pos > offset:
                    # progress made: a partial line is read again next time
                    self.more = rd < size
                    break
        finally:
            os.close(fd)

    def _data_after(self, fd: int, at: int, size: int) -> int | None:
        """The first byte after `at` that is not NUL, None if zeros run to `size`. A
        segment's zeros seen to its end last time are not read again: its writer fills
        them in order, so they still end it."""
        start, seen = self._zeros
        if seen == size and 0 <= start <= at:
            return None
        pos = at
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)  # a hole is zeros: jumped over
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # only a hole is left
                # (no SEEK_DATA on this filesystem: read on)
            if pos >= size:
                break
            block = os.pread(fd, min(_BLOCK, size - pos), pos)
            if not block:
                break
            kept = block.lstrip(b"\0")
            if kept:
                return pos + len(block) - len(kept)
            pos += len(block)
        self._zeros = (at, size)
        return None
