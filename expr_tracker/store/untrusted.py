"""Records read from a file someone else wrote (exprd's spool lines), checked as the SDK
checks its own at the call.

A spool file is plain text any process of the training user can write: exprd must not
copy a line into a shard, or hand it to a backend, on the strength of it parsing. The
checks are `records`' own (one source of truth: `check_step`, `check_key`, `encode_row`,
the rank-record checks of `log_rank_metrics`); `screen` and `screen_block` let the usual
line through at a small fraction of their cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

import orjson

from expr_tracker.store.records import (
    MAX_STEP,
    MAX_STR,
    MAX_WORLD,
    NONFINITE_TEXT,
    SAMPLE_SOURCE,
    check_rank_fields,
    check_step,
    encode_row,
)

ROW_FIELDS = frozenset(("_step", "_time", "_seq", "_rank"))  # `_rank`: rank_aware=False
RANK_FIELDS = frozenset(("_kind", "_step", "_time", "_seq", "_rank", "_world_size",
                         "_local_rank", "_weight", "_source"))
_RANK_NAMES = ("_rank", "_world_size", "_local_rank", "_weight")


# an int of 19 digits or more: maybe outside int64 (orjson parses up to 2**64-1 as an int,
# and a longer one as a float that other readers take for an int), which the screens leave
# to `check_record` (int64 holds 19 digits, so a few of its own largest values take the
# full check too). Where the screens look, every ":" is a key's (one per key, no nested
# object, no list), so every value follows a ":" and some whitespace, and an int value is
# the digits (and "-") right after it: all digits read as "0", whitespace and "-" dropped,
# a ":" then 19 "0" is such an int, or a float with 19 digits before its "." (sent to the
# full check all the same). The digits of a float's fraction never follow a ":" (1 / 8191
# is 0.00012208521548040532: a run of 20 after its "0."), nor do those of text (its quote
# comes first). Everything but digits, ":", "." and '"' is dropped too (letters, commas,
# braces): that can only join a ":" to more digits, never part them (a number's exponent:
# 12345678901234567e10 is a false alarm, as huge as the numbers looked for), and the
# search goes over less.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_DROPPED = bytes(c for c in range(256) if c not in b'0123456789:."')
_LONG_INT = b":" + b"0" * 19


# A block's translation keeps "{" too (see screen_block): in a block whose every ":" is a
# key's and whose every "{" starts a line, a "{" never comes between a ":" and digits
_DROPPED_BLOCK = bytes(c for c in range(256) if c not in b'0123456789:."{')


def _long_int(data: bytes) -> bool:
    """True if `data` (lines whose every ":" is a key's) may hold an int of 19 digits."""
    # rfind: the same answer as `in`, and 4x faster here (its skips look at the ":",
    # rare in the text, where find's look at a "0", which is not)
    return data.translate(_DIGITS_AS_ZERO, _DROPPED).rfind(_LONG_INT) >= 0


def check_record(rec: Mapping[str, Any]) -> None:
    """Check a record read from an untrusted file (a spool line) as `log()` and
    `log_rank_metrics()` check theirs at the call; TypeError/ValueError naming the field.

    Only fields those calls write are allowed (with the spool's `_seq`); `_step` and
    `_time` are required, values are what `encode_row` takes (non-finite floats as text).
    """
    kind = rec.get("_kind")
    if kind is not None and kind != "rank":
        raise ValueError(f"_kind must be 'rank' or absent, got {kind!r}")
    allowed = ROW_FIELDS if kind is None else RANK_FIELDS
    user: dict[str, Any] = {}
    for key, value in rec.items():
        if key[:1] == "_" and key in allowed:
            continue
        if key[:1] == "_":
            raise ValueError(f"field {key!r}: keys starting with '_' are reserved, and log() "
                             "writes no such field")
        user[key] = value
    if "_step" not in rec:
        raise ValueError("_step is missing")
    step = rec["_step"]
    if step.__class__ is float and abs(step) >= 2.0**64:
        # orjson reads an integer past 64 bits as a float: say what the line held
        raise ValueError(f"_step must be at most 2**53 ({MAX_STEP}), got a number past 2**64 "
                         f"({step:.6g})")
    check_step(step, "_step")  # log()'s own bounds (records.MAX_STEP)
    when = rec.get("_time")
    if when is None:
        raise ValueError("_time is missing" if "_time" not in rec else "_time must be a number, got null")
    if when.__class__ is bool or not isinstance(when, (int, float)):
        raise TypeError(f"_time must be a number (seconds since the epoch), got {type(when).__name__}")
    if kind is None:
        rank = rec.get("_rank", 0)
        if rank.__class__ is not int or not 0 <= rank < MAX_WORLD:
            raise ValueError(f"_rank must be an int between 0 and {MAX_WORLD - 1:,}, got {rank!r}")
        if user:
            encode_row(user)
        return
    check_rank_fields(rec.get("_rank"), rec.get("_world_size"), rec.get("_local_rank"),
                       rec.get("_weight", 1.0), _RANK_NAMES)
    source = rec.get("_source", SAMPLE_SOURCE)
    if source != SAMPLE_SOURCE:
        raise ValueError(f"_source must be {SAMPLE_SOURCE!r} or absent, got {source!r}")
    if not user:
        raise ValueError("a rank record needs at least one metric")
    encode_row(user)
    for key, value in user.items():
        # numbers only (non-finite floats are written as text)
        if value.__class__ is bool or not (isinstance(value, (int, float))
                                           or value in NONFINITE_TEXT):
            raise TypeError(f"metric {key!r} of a rank record must be a number, "
                            f"got {type(value).__name__}")


def screen(rec: dict[str, Any], line: bytes, shapes: Sequence[frozenset[str] | None]) -> bool:
    """A fast screen for the usual spool record: True only if `check_record(rec)` passes
    and `line` holds exactly `rec` (no repeated key), so the line may be kept verbatim.
    False says nothing: the caller runs `check_record` (and writes `rec` out again).

    `shapes` are the key sets of the last step row and the last rank record that passed
    `check_record`: the same keys mean no empty, reserved or unknown `_` key. One colon
    per key means no repeated or nested key (and no colon in text), no `[` no list, no
    second `{` no empty object, a line under MAX_STR no text over the limits, no int of 19
    digits no int outside int64 (records.INT_MIN..INT_MAX: orjson parses up to 2**64-1);
    orjson parses only valid UTF-8.
    """
    kind = "_kind" in rec
    if rec.keys() != shapes[kind]:
        return False
    step = rec["_step"]
    if (step.__class__ is not int or not 0 <= step <= MAX_STEP or rec["_time"].__class__ is not float
            or line.count(58) != len(rec) or 91 in line or len(line) > MAX_STR
            or line.find(123, 1) >= 0  # 58 ":", 91 "[", 123 "{" (an empty `{}` has no colon)
            or _long_int(line)):
        return False
    if not kind:
        rank = rec.get("_rank", 0)
        return rank.__class__ is int and 0 <= rank < MAX_WORLD
    # a rank record as log_rank_metrics writes it: weight a float, metrics numbers
    if rec["_kind"] != "rank":
        return False  # the shape's keys, another kind (or null)
    rank, world, local = rec["_rank"], rec.get("_world_size"), rec.get("_local_rank")
    weight = rec.get("_weight", 1.0)
    if not ((world is None or (world.__class__ is int and world <= MAX_WORLD))
            and rank.__class__ is int and 0 <= rank < (MAX_WORLD if world is None else world)
            and (local is None or (local.__class__ is int and local >= 0))
            and weight.__class__ is float and weight >= 0.0):  # orjson parses no inf or nan
        return False
    for key, value in rec.items():
        if key[0] != "_" and value.__class__ is not float and value.__class__ is not int:
            return False  # bool, None, text ("NaN" too): the full check decides
    return True


def screen_block(parts: list[bytes], max_line: int, span: int = -1
                 ) -> tuple[list[Any] | None, bool]:
    """The lines of one block (without their newlines) parsed, each on its own, and
    whether the block passes the line-level half of `screen` (`clean`): then a record of
    it whose keys are a checked step row's (without `_rank`), with an int `_step` in range
    and a float `_time`, passes `screen`, and the caller may skip the call. In a clean
    block every line (but the events at its ends) starts with "{" and ends with "}".

    (None, False) when some line does not parse or is over `max_line`: the caller goes
    line by line. Across the block, colons == keys holds only if it holds on every line
    (a line of JSON objects never has fewer colons than keys). Events at the block's ends
    (a file's init, its finish) are left out of the sums: a line that starts with
    `{"_event"` has that key, which no checked step row has, so it is never screened so.
    `span`: the bytes of `parts` with their newlines if the caller knows them (a block no
    longer than MAX_STR needs no look for its longest line).
    """
    # `span`, if known: the bytes of `parts` with their newlines (no line is longer)
    longest = span if 0 <= span <= min(MAX_STR, max_line) else max(map(len, parts), default=0)
    if longest > max_line:
        return None, False
    lo, hi = 0, len(parts)
    while lo < hi and parts[lo].startswith(b'{"_event"'):
        lo += 1
    while hi > lo and parts[hi - 1].startswith(b'{"_event"'):
        hi -= 1
    whole = not lo and hi == len(parts)
    one = _as_one(parts if whole else parts[lo:hi]) if longest <= MAX_STR else None
    try:
        if one is None:
            return list(map(orjson.loads, parts)), False  # not clean: line by line
        rows, data = one  # `data`: the lines joined by "\n,", in "[" and "]"
        recs = rows if whole else [*map(orjson.loads, parts[:lo]), *rows,
                                   *map(orjson.loads, parts[hi:])]
    except orjson.JSONDecodeError:
        return None, False
    # 58 ":", 123 "{": a colon per key, one brace per line (no nested object, no `{}`),
    # counted in what the int bound's search looks at (a third shorter), which keeps them
    kept = data.translate(_DIGITS_AS_ZERO, _DROPPED_BLOCK)
    clean = (kept.count(58) == sum(map(len, rows)) and kept.count(123) == len(rows)
             and kept.rfind(_LONG_INT) < 0)
    return recs, clean


def _as_one(lines: list[bytes]) -> tuple[list[Any], bytes] | None:
    """The records of `lines` parsed by one `orjson.loads` of them as one array, and that
    array's text, when that is the same as parsing each line on its own (it saves the
    calls' overhead, a quarter of the parse); None if the lines are not of that kind (or
    one is not JSON).

    Each line starts with "{" and ends with "}", none holds a "[", and the array has as
    many elements as there are lines: then each line is one element. A newline is in no
    JSON token (a string holds none raw), so the "," after each line's "\n" is a comma of
    the array or of an object; after it comes "{", which starts no key: the array's. So
    each line starts an element, which ends before the next line's; the array has one per
    line, and each must end at its line's "}" (after which only the comma may come).
    """
    n = len(lines)
    if not n:
        return None
    try:
        if bytes(map(_FIRST, lines)) != b"{" * n or bytes(map(_LAST, lines)) != b"}" * n:
            return None
    except IndexError:  # an empty line
        return None
    if n == 1:
        data = b"[" + lines[0] + b"]"
    else:
        ends = lines[:]
        ends[0], ends[-1] = b"[" + ends[0], ends[-1] + b"]"
        data = b"\n,".join(ends)
    if data.find(91, 1) >= 0:  # "[" in a line: a list value, or an array the commas join
        return None
    try:
        rows = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return (rows, data) if len(rows) == n else None


_SEQ, _STEP, _TIME = itemgetter("_seq"), itemgetter("_step"), itemgetter("_time")
_FIRST, _LAST, _BUT_LAST = itemgetter(0), itemgetter(-1), itemgetter(slice(None, -1))
_NUMBERS = frozenset((int, float))


def plain_rows(parts: list[bytes], recs: list[Any], first_seq: int, end: bytes) -> bytes | None:
    """The lines of a run of step rows as they land: each without its closing "}", then
    `end` (the caller's `,"_sid":"...."}` and a newline), if every one passes `screen` and
    they are numbered `first_seq`, `first_seq + 1`...; else None (the caller goes record
    by record).

    For the records of a clean block (`screen_block`) whose keys are all keys of step rows
    that passed `check_record` (not `_rank`, whose value is not looked at here): what is
    left of `screen` is an int `_step` in range and a float `_time`, here for all of them
    at once, without a Python loop; and each line must end in "}".
    """
    if not numbered(parts, recs, first_seq):
        return None
    return end.join(map(_BUT_LAST, parts)) + end


def plain_ranks(parts: list[bytes], recs: list[Any], first_seq: int, end: bytes,
                shape: frozenset[str]) -> bytes | None:
    """`plain_rows` for a run of rank records, each with the key set `shape` (that of a
    rank record that passed `check_record`): what is left of `screen` is `_kind`, the rank
    fields and numbers as metrics, for all of them at once. A run whose world size
    changes (or that none of its records' own bounds fit) goes record by record."""
    if not numbered(parts, recs, first_seq) or not rank_run(recs, shape):
        return None
    return end.join(map(_BUT_LAST, parts)) + end


def rank_run(recs: list[Any], shape: frozenset[str]) -> bool:
    """What is left of `screen` for records of a clean block with the key set `shape` (that
    of a rank record that passed `check_record`): `_kind`, the rank fields and numbers as
    metrics, for all of them at once (see `plain_ranks`)."""
    try:
        if set(map(itemgetter("_kind"), recs)) != {"rank"}:
            return False
        worlds = set(map(itemgetter("_world_size"), recs)) if "_world_size" in shape else {None}
        if len(worlds) != 1:
            return False
        (world,) = worlds
        if world is None:
            world = MAX_WORLD
        elif world.__class__ is not int or not 1 <= world <= MAX_WORLD:
            return False
        ranks = list(map(itemgetter("_rank"), recs))
        if set(map(type, ranks)) != {int} or min(ranks) < 0 or max(ranks) >= world:
            return False
        if "_local_rank" in shape:
            local = set(map(itemgetter("_local_rank"), recs))
            local.discard(None)
            if not all(v.__class__ is int and v >= 0 for v in local):  # a few distinct values
                return False
        if "_weight" in shape:
            weights = list(map(itemgetter("_weight"), recs))
            if set(map(type, weights)) != {float} or min(weights) < 0.0:  # no inf or nan
                return False
        for key in shape:
            if key[0] != "_" and not set(map(type, map(itemgetter(key), recs))) <= _NUMBERS:
                return False
    except (KeyError, TypeError):
        return False
    return True


def numbered(parts: list[bytes], recs: list[Any], first_seq: int) -> bool:
    """Each record numbered `first_seq`, `first_seq + 1`... (ints), an int `_step` in range,
    a float `_time`. For the records of a clean block (`screen_block`), whose lines (`parts`)
    each end in "}" (the caller adds `_sid` in its place)."""
    if not recs:
        return False
    try:
        seqs, steps = list(map(_SEQ, recs)), list(map(_STEP, recs))
        # ints: equal to theirs, a float among them makes their sum one, and a bool
        # (False, True) can only be equal to one numbered 0 or 1: the first two
        return (seqs == list(range(first_seq, first_seq + len(recs)))
                and sum(seqs).__class__ is int and set(map(type, seqs[:2])) == {int}
                and set(map(type, steps)) == {int}
                and set(map(type, map(_TIME, recs))) == {float}
                and min(steps) >= 0 and max(steps) <= MAX_STEP)
    except (KeyError, IndexError):
        return False
