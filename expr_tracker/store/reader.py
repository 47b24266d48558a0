"""Reading a shard that another process may be appending to: complete lines only, forwards,
backwards from the end, and `select_rows` for history (DESIGN 4)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from expr_tracker.store import records
from expr_tracker.store.safedir import open_read
from expr_tracker.store.window import before_nuls

_READ_BLOCK = 256 * 1024


class ShardReader:
    """Reads complete lines of a shard that another process may be appending to."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.garbage = 0  # lines that did not parse, skipped

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        try:
            return records.loads(line)
        except ValueError:
            self.garbage += 1
            return None

    def iter_records(self, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (end offset, record) for every complete, parseable line from `start`."""
        with open_read(self.path) as fh:
            for base, data in records.complete_blocks(fh, 4 * _READ_BLOCK, start):
                for off, line in records.iter_lines(data):
                    rec = self._parse(line) if line.strip() else None
                    if rec is not None:
                        yield base + off + len(line) + 1, rec

    def iter_all(self) -> Iterator[dict[str, Any]]:
        """The records of `iter_records`, without offsets, parsed a block at a time: one
        orjson call per block of whole lines (the common case; a long run read whole spends
        most of its time in per-line Python otherwise), line by line for a block that holds
        a torn, blank or foreign line."""
        with open_read(self.path) as fh:
            for _, data in records.complete_blocks(fh, 4 * _READ_BLOCK):
                recs = records.loads_block(data)
                if recs is None:
                    for _, line in records.iter_lines(data):
                        rec = self._parse(line) if line.strip() else None
                        if rec is not None:
                            yield rec
                    continue
                if b'"NaN"' in data or b'Infinity"' in data:  # else no value to decode
                    recs = [records.decode_nonfinite(r) for r in recs]
                yield from recs

    def records(self) -> list[dict[str, Any]]:
        """Every complete record in file order."""
        return [rec for _, rec in self.iter_records()]

    def iter_reverse(self) -> Iterator[dict[str, Any]]:
        """Complete records from the last to the first, reading the file backwards in blocks."""
        return self.iter_reverse_from()

    def iter_reverse_from(
        self, end: int | None = None, block: int = _READ_BLOCK
    ) -> Iterator[dict[str, Any]]:
        """`iter_reverse` from offset `end` (where complete lines end; None: find it).

        `block` bytes are read at a time: a reader that wants a few lines of each of many
        shards passes a small one. A given `end` keeps the view stable while the file grows.
        """
        with open_read(self.path) as fh:
            if end is None:
                end = records.complete_end(fh, block)  # only terminated lines count
            carry = b""
            while end > 0:
                start = max(0, end - block)
                fh.seek(start)
                data = fh.read(end - start) + carry
                nul = data.rfind(b"\0")
                if nul >= 0:
                    # a crash's NUL run ends the line before it, as a newline does: the
                    # lines after it are whole, and the run is jumped, holes and all
                    body, carry = data[nul + 1:].split(b"\n"), b""
                    start = before_nuls(fh, start + nul + 1)
                else:
                    lines = data.split(b"\n")
                    # lines[0] may be the end of a line that started in an earlier block
                    carry = lines[0] if start > 0 else b""
                    body = lines[1:] if start > 0 else lines
                for line in reversed(body):
                    if line.strip():
                        rec = self._parse(line)
                        if rec is not None:
                            yield rec
                end = start


def select_rows(
    reader: ShardReader,
    n: int | None,
    *,
    metrics: list[str] | None = None,
    step_range: tuple[int | None, int | None] | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """The last `n` matching rows (all if n is None or negative), oldest first.

    `kind` None selects step rows (records without `_kind`); "rank" selects rank
    records; "*" everything. `step_range` is half-open [lo, hi). With `metrics`, a
    row matches if it has at least one of them, and is projected to them.
    """
    lo, hi = step_range or (None, None)
    want = set(metrics) if metrics else None

    def keep(rec: dict[str, Any]) -> dict[str, Any] | None:
        if kind != "*" and rec.get("_kind") != kind:
            return None
        step = rec.get("_step")
        if lo is not None and (not isinstance(step, int) or step < lo):
            return None
        if hi is not None and (not isinstance(step, int) or step >= hi):
            return None
        if want is None:
            if "_sid" in rec:  # exprd's exactly-once bookkeeping, not the user's data
                rec = {k: v for k, v in rec.items() if k not in _SPOOL_KEYS}
            return rec
        picked = {k: v for k, v in rec.items() if k in want}
        if not picked:
            return None
        out = {k: v for k, v in rec.items() if k[:1] == "_" and k in _ROW_META}
        out.update(picked)
        return out

    if n is None or n < 0:
        out = []
        for _, rec in reader.iter_records():
            row = keep(rec)
            if row is not None:
                out.append(row)
        return out
    picked_rows: list[dict[str, Any]] = []
    if n == 0:
        return picked_rows
    for rec in reader.iter_reverse():
        row = keep(rec)
        if row is not None:
            picked_rows.append(row)
            if len(picked_rows) >= n:
                break
    picked_rows.reverse()
    return picked_rows


_SPOOL_KEYS = ("_sid", "_seq")
_ROW_META = ("_step", "_time", "_kind", "_rank", "_world_size", "_local_rank", "_weight")


SUMMARY_TAIL = 1 << 20  # bytes of a shard's end that `last_values` reads


def last_values(path: Path, tail: int = SUMMARY_TAIL) -> dict[str, Any]:
    """The last value of each key among the step rows in the last `tail` bytes of a shard or
    spool file, and the largest `_step` (the summary `finish` saves)."""

    with open_read(path) as fh:
        end = fh.seek(0, 2)
        start = max(0, end - tail)
        fh.seek(start)
        data = fh.read(end - start)
    if start:
        data = data[data.find(b"\n") + 1:]
    return last_values_of(data)


def last_values_of(data: bytes, tail: int = SUMMARY_TAIL) -> dict[str, Any]:
    """`last_values` of whole lines in memory (a spool segment's data)."""
    import orjson

    if len(data) > tail:
        data = data[data.find(b"\n", len(data) - tail) + 1:]
    out: dict[str, Any] = {}
    for line in data.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn or foreign line: the summary is best effort
        if not isinstance(rec, dict) or "_event" in rec or "_kind" in rec or "_step" not in rec:
            continue
        step = rec["_step"]
        if type(step) is int and step >= out.get("_step", step):
            out["_step"] = step  # the largest: a row kept out of order (step_policy) may be last
        out.update((k, v) for k, v in rec.items() if not k.startswith("_"))
    return out

