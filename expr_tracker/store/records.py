"""Record schema and value encoding (DESIGN 4).

A record is one JSON object per line. User keys never start with `_`; values
are int, float, bool, str or None. Non-finite floats are written as the strings
"NaN", "Infinity" and "-Infinity" so the file stays strict JSON, and read back
as floats. numpy scalars and 0-d tensors are unwrapped with `.item()`.
"""

from __future__ import annotations

import errno
import io
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import orjson

from expr_tracker.store.window import before_nuls, end_of_data

# a sanity bound on world sizes (DESIGN 14): far above any job (16,384 ranks and more are
# supported), low enough that a corrupt value cannot make a reader list a billion ranks
MAX_WORLD = 1 << 20


Scalar = int | float | bool | str | None

NAN_TEXT = "NaN"
_ENCODE_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
DECODE_NONFINITE: dict[str, float] = {
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
}
# the integers every reader holds (int64: pandas, Arrow, DuckDB, ClickHouse, array("q")); orjson
# would write up to 2**64 - 1, which breaks them, so the rest is refused at the call
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
# the largest step accepted: exact as a double too (a browser's JSON, a pandas column with
# gaps), and far from INT_MAX, so the steps that follow it stay int64
MAX_STEP = 2**53
_DUMPS = orjson.dumps
# Text limits, the same in direct and spool mode and checked at the call: one str value
# at most MAX_STR bytes, the keys and str values of one row at most MAX_ROW, well under
# the spool's 16 MiB line limit (a longer line is quarantined by exprd).
MAX_STR = 1024 * 1024
MAX_ROW = 8 * 1024 * 1024
_NEWLINE = orjson.OPT_APPEND_NEWLINE


def _unwrap(key: str, value: Any) -> Scalar:
    """Turn a numpy scalar or a 0-d tensor into a Python scalar, else raise TypeError."""
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", ())
    if item is not None and callable(item) and tuple(shape or ()) == ():
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"value of key {key!r}: cannot convert {type(value).__name__}: {exc}") from None
        if out is None or isinstance(out, (bool, int, float, str)):
            return encode_value(key, out)
    raise TypeError(
        f"value of key {key!r} must be int, float, bool, str or None (or a numpy/torch scalar), "
        f"got {type(value).__name__}"
    )


def encode_value(key: str, value: Any) -> Scalar:
    """Return the on-disk form of one value, or raise TypeError/ValueError naming `key`."""
    cls = value.__class__
    if cls is float:
        if value - value == 0.0:
            return value
        if value != value:
            return NAN_TEXT
        return _ENCODE_NONFINITE[value]
    if cls is int:
        if INT_MIN <= value <= INT_MAX:
            return value
        raise ValueError(
            f"value of key {key!r} is an integer outside int64 (-2**63 .. 2**63-1), which "
            f"readers cannot hold: {value}; log it as a float or a str"
        )
    if cls is bool or value is None:
        return value
    if cls is str:
        if text_bytes(key, value) > MAX_STR:
            raise ValueError(
                f"value of key {key!r} is {text_bytes(key, value)} bytes of text; "
                f"at most {MAX_STR} allowed"
            )
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return encode_value(key, int(value))
    if isinstance(value, float):
        return encode_value(key, float(value))
    if isinstance(value, str):
        return encode_value(key, str(value))
    return _unwrap(key, value)


def text_bytes(key: str, text: str) -> int:
    """The UTF-8 size of `text` (the value of `key`); ValueError if it cannot be encoded
    (a lone surrogate such as "\\ud800", which orjson refuses too)."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"value of key {key!r} is not valid UTF-8 text (a lone surrogate?)") from None


def check_key(key: Any) -> str:
    """Validate a user metric key."""
    if key.__class__ is not str and not isinstance(key, str):
        raise TypeError(f"metric keys must be str, got {type(key).__name__} ({key!r})")
    if not key:
        raise ValueError("metric keys must not be empty")
    if key[0] == "_":
        raise ValueError(f"key {key!r}: keys starting with '_' are reserved")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"key {key!r} is not valid UTF-8 text (a lone surrogate?)") from None
    return str(key)


def encode_row(data: Any, field: str = "data") -> tuple[dict[str, Scalar], bool]:
    """Validate a user mapping; return (row, has_nonfinite). Raises before anything is kept.

    Floats stay floats in memory (rules and backends want NaN as a float); `dumps`
    writes non-finite ones as strings.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{field} must be a dict of metric name to value, got {type(data).__name__}")
    out: dict[str, Scalar] = {}
    nonfinite = False
    size = 0  # text bytes of keys and str values: a row must fit a spool line (MAX_ROW)
    for key, value in data.items():
        if key.__class__ is not str or not key or key[0] == "_" or not key.isascii():
            key = check_key(key)
        size += len(key)
        cls = value.__class__
        if cls is float:
            if value - value != 0.0:
                nonfinite = True
            out[key] = value
        elif cls is int and INT_MIN <= value <= INT_MAX:
            out[key] = value
        else:
            text = isinstance(value, str)
            value = encode_value(key, value)
            if text:
                size += text_bytes(key, value)  # type: ignore[arg-type]
                if size > MAX_ROW:
                    raise ValueError(
                        f"value of key {key!r} takes the row's text over {MAX_ROW} bytes; "
                        "log less text per row"
                    )
            elif value.__class__ is str and value in NONFINITE_TEXT:
                # encode_value spells non-finite floats as text; keep the float in memory
                value = DECODE_NONFINITE[value]
                nonfinite = True
            out[key] = value
    return out, nonfinite


NONFINITE_TEXT = frozenset(("NaN", "Infinity", "-Infinity"))


def check_merged(row: Mapping[str, Any], more: Mapping[str, Any]) -> None:
    """Raise ValueError if merging `more` into the open `row` (log(commit=False))
    takes its text over MAX_ROW, naming the first key of `more` that does."""
    size = 0
    merged = {**row, **more}
    for key, value in merged.items():
        size += len(key) + (text_bytes(key, value) if value.__class__ is str else 0)
        if size > MAX_ROW:
            culprit = next((k for k in more if merged[k].__class__ is str), key)
            raise ValueError(f"value of key {culprit!r} takes the open row's text over "
                             f"{MAX_ROW} bytes; commit the row first")


def _finite_copy(record: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(record)
    for key, value in out.items():
        if value.__class__ is float and value - value != 0.0:
            out[key] = NAN_TEXT if value != value else _ENCODE_NONFINITE[value]
    return out


def dumps(record: Mapping[str, Any], nonfinite: bool | None = None) -> bytes:
    """One record as a JSON line ending in a newline; non-finite floats become strings.

    `nonfinite=False` is the caller's promise that no value is NaN or infinite (the
    hot path knows it from `encode_row`); None checks.
    """
    if nonfinite is None:
        nonfinite = any(v.__class__ is float and v - v != 0.0 for v in record.values())
    if nonfinite:
        record = _finite_copy(record)
    return _DUMPS(record, option=_NEWLINE)


def decode_nonfinite(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with its "NaN"/"Infinity"/"-Infinity" metric values as floats (in place)."""
    for key, value in obj.items():
        if value.__class__ is str and value in DECODE_NONFINITE and key[:1] != "_":
            obj[key] = DECODE_NONFINITE[value]
    return obj


def loads(line: bytes | str) -> dict[str, Any]:
    """Parse one line into a record; accepts bare NaN/Infinity tokens. Raises ValueError."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        import json  # only for files with bare NaN tokens, written by other trackers

        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a JSON record: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return decode_nonfinite(obj)


def loads_block(data: bytes) -> list[dict[str, Any]] | None:
    """Whole lines (`data` ends in a newline) parsed as one JSON array, in C: the objects as
    they are (no NaN decoding), or None when a line is not exactly one JSON object (a torn
    or foreign line: the caller then goes line by line with `loads`)."""
    try:
        recs = orjson.loads(b"[" + data[:-1].replace(b"\n", b",") + b"]")
    except orjson.JSONDecodeError:
        return None
    if len(recs) != data.count(b"\n") or set(map(type, recs)) != {dict}:
        return None
    return recs


def iter_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, line) for each complete line; an unterminated tail is ignored."""
    pos = 0
    end = data.rfind(b"\n") + 1
    while pos < end:
        nl = data.index(b"\n", pos)
        yield pos, data[pos:nl]
        pos = nl + 1


def complete_blocks(fh: BinaryIO, size: int, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(offset, data) chunks of an open file from `start`, each ending at a newline.

    About `size` bytes at a time; an unterminated last line (a writer mid-append, or a
    torn tail) is never yielded. A run of NUL bytes (what a node crash leaves in a
    shard, often gigabytes of a sparse hole) ends a line as a newline does: it is skipped
    without holding it (holes jumped over with SEEK_DATA), with a warning (`nul_skipped`),
    and so is the line it cut, if any (a crash mid-append: no newline will end it).
    """
    fh.seek(start)
    pos, carry = start, b""
    while True:
        block = fh.read(size)
        if not block:
            return
        data = carry + block if carry else block
        carry = b""
        nul = data.find(b"\0")
        while nul >= 0:
            end = data.rfind(b"\n", 0, nul) + 1
            if end:
                yield pos, data[:end]
            # data[end:nul] is a line the NULs cut: never ended, dropped
            kept = data[nul:].lstrip(b"\0")
            nul_start, pos, data = pos + nul, pos + len(data) - len(kept), kept
            if not data:  # the run goes on past this block: jump to the next data
                nxt = _next_data(fh, pos)
                nul_skipped(fh, nul_start, (fh.seek(0, 2) if nxt is None else nxt) - nul_start)
                if nxt is None:
                    return
                fh.seek(pos := nxt)
                break
            nul_skipped(fh, nul_start, pos - nul_start)
            nul = data.find(b"\0")
        end = data.rfind(b"\n") + 1
        if end:
            yield pos, data[:end]
            pos += end
        carry = data[end:]


def _next_data(fh: BinaryIO, pos: int) -> int | None:
    """The offset of the next byte at or after `pos` that is not in a hole (`pos` itself
    where the filesystem cannot say), None at the end of the file."""
    try:
        return os.lseek(fh.fileno(), pos, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        return pos
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return pos


_nul_warned: set[str] = set()


def nul_skipped(fh: BinaryIO, at: int, n: int) -> None:
    """One warning per file and process: a run of `n` NUL bytes at offset `at` skipped."""
    if n <= 0:
        return
    name = str(getattr(fh, "name", "a file"))
    if name in _nul_warned:
        return
    _nul_warned.add(name)
    import logging

    logging.getLogger("expr_tracker").warning(
        "expr_tracker: %s: skipped %s NUL bytes at offset %s (a node crash leaves them); "
        "the lines around them are read", name, f"{n:,}", f"{at:,}")


def complete_end(fh: BinaryIO, size: int = 256 * 1024) -> int:
    """The offset just past the last newline of an open file (0 if it has none).

    A NUL tail is not searched byte by byte: holes are stepped over with SEEK_HOLE and
    written NUL blocks skipped as they are read (a warning names the file); a line that
    NULs cut off (a crash mid-append, then lines after) has no end and is passed over."""
    size_all = fh.seek(0, 2)
    end = end_of_data(fh, size_all)
    if end < size_all:
        nul_skipped(fh, end, size_all - end)
    grow = max(size, MAX_BACK_BLOCK)
    while end > 0:
        start = max(0, end - size)
        fh.seek(start)
        block = fh.read(end - start)
        nl = block.rfind(b"\n")
        nul = block.rfind(b"\0")
        if nl > nul:
            return start + nl + 1
        if nul >= 0:  # the bytes after the NULs never ended: what precedes the NULs may
            end = before_nuls(fh, start + nul + 1)
            nul_skipped(fh, end, start + nul + 1 - end)
            continue
        end = start
        size = min(2 * size, grow)  # a long line: larger reads, bounded
    return 0


MAX_BACK_BLOCK = 1 << 20  # bytes: the largest block a backward search reads at once


def is_rank_record(record: Mapping[str, Any]) -> bool:
    """True for records written by `log_rank_metrics`."""
    return record.get("_kind") == "rank"


def user_items(record: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """The non-reserved (metric) items of a record."""
    for key, value in record.items():
        if key[:1] != "_":
            yield key, value


def check_step(step: object, field: str = "step") -> int:
    """A step: an int from 0 to MAX_STEP (numpy/torch integer scalars unwrapped);
    TypeError/ValueError naming `field` otherwise."""
    if step.__class__ is not int:
        if isinstance(step, bool) or not isinstance(step, int):
            item = getattr(step, "item", None)
            if callable(item) and getattr(step, "shape", ()) == ():
                return check_step(item(), field)
            raise TypeError(f"{field} must be an int, got {type(step).__name__}")
        step = int(step)
    assert isinstance(step, int)
    if step < 0:
        raise ValueError(f"{field} must be >= 0, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"{field} must be at most 2**53 ({MAX_STEP}), got {step}")
    return step



def check_rank_fields(rank: Any, world_size: Any, local_rank: Any, weight: Any,
                       names: tuple[str, str, str, str]) -> None:
    """The checks of `log_rank_metrics` on its rank, world size, local rank and weight;
    errors name the field (`names`: the arguments' names, or a record's fields)."""
    rank_n, world_n, local_n, weight_n = names
    # world_size None: unknown (the launcher did not set WORLD_SIZE); written as null
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"{world_n} must be an int, got {type(world_size).__name__}")
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(
                f"{world_n} must be between 1 and {MAX_WORLD:,} (the sanity cap), got {world_size}"
            )
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{rank_n} must be an int, got {type(rank).__name__}")
    bound = MAX_WORLD if world_size is None else world_size
    if not 0 <= rank < bound:
        raise ValueError(f"{rank_n} must satisfy 0 <= {rank_n} < {world_n} ({bound}), got {rank}")
    if local_rank is not None and (
        isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0
    ):
        raise ValueError(f"{local_n} must be an int >= 0 or None, got {local_rank!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"{weight_n} must be a number, got {type(weight).__name__}")
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"{weight_n} must be finite and >= 0, got {weight}")


def rank_record(
    metrics: Any,
    step: Any,
    rank: Any,
    world_size: Any,
    local_rank: Any,
    weight: Any,
    source: str | None = None,
) -> tuple[dict[str, Any], bool]:
    """Validate `log_rank_metrics` arguments and build its record; errors name the argument.

    `source` ("system": the SDK's own samples, DESIGN 19) is written as `_source`, which
    tells a reader the record is not the user's, whatever its keys are named."""
    import time

    step = check_step(step)
    check_rank_fields(rank, world_size, local_rank, weight,
                       ("rank", "world_size", "local_rank", "weight"))
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of metric name to number, got {type(metrics).__name__}")
    if not metrics:
        raise ValueError("metrics must not be empty")
    for key, value in metrics.items():
        if isinstance(value, bool) or value is None or isinstance(value, str):
            raise TypeError(f"metrics[{key!r}] must be a number, got {type(value).__name__}")
    row, nonfinite = encode_row(metrics, "metrics")
    for key, value in row.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"metrics[{key!r}] must be a number, got {type(value).__name__}")
    record: dict[str, Any] = {
        "_kind": "rank",
        "_step": step,
        "_time": time.time(),
        "_rank": rank,
        "_world_size": world_size,
        "_local_rank": local_rank,
        "_weight": float(weight),
    }
    if source is not None:
        record["_source"] = source
    record.update(row)
    return record, nonfinite


SAMPLE_SOURCE = "system"  # `_source` of the SDK's system-metrics samples (DESIGN 19)
# A sample written before `_source` existed holds this key: psutil is a dependency, so every
# sample of those versions has it (and a user record with that very name is told apart by
# `_source` once written by this version)
_LEGACY_SAMPLE_MARK = "system/rss_mb"


def is_sample(rec: Mapping[str, Any]) -> bool:
    """True for a system-metrics sample of the SDK (DESIGN 19), False for a user's record,
    by the record's `_source` (older files: by the sampler's `system/rss_mb`)."""
    source = rec.get("_source")
    if source is None:
        return _LEGACY_SAMPLE_MARK in rec and rec.get("_kind") == "rank"
    return source == SAMPLE_SOURCE

