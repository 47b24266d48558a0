"""The screens' int bound read from the bytes: a long int is sent to the full check, the
long digit runs of ordinary floats are not (they once sent almost every row there)."""

from __future__ import annotations

import json

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from expr_tracker.store import records, untrusted

_SHAPE = frozenset(("_step", "_time", "_seq", "loss", "k"))
_RANK = frozenset(("_kind", "_step", "_time", "_seq", "_rank", "_world_size", "_local_rank",
                   "_weight", "loss"))


def _row(k: str, sep: str = ":") -> bytes:
    return ('{"_step"SEP3,"_time"SEP1.5,"_seq"SEP4,"loss"SEP0.25,"k"SEP' + k + "}").replace(
        "SEP", sep).encode()


def _screens(line: bytes) -> tuple[bool, bool]:
    rec = orjson.loads(line)
    _evs, clean = untrusted.screen_block([line], 1 << 24)
    return untrusted.screen(rec, line, (_SHAPE, _RANK)), clean


def test_an_int_past_int64_or_that_orjson_reads_as_a_float_is_never_screened_through() -> None:
    for value in (records.INT_MAX + 1, 2**64 - 1, 2**64, 10**30, records.INT_MIN - 1, -(10**25)):
        for sep in (":", ": ", ":\t", " : "):
            line = _row(str(value), sep)
            assert _screens(line) == (False, False), line
            # and the full check refuses what it parses to (an int out of range, or a float
            # that a reader of the verbatim line would take for an int)
            if type(orjson.loads(line)["k"]) is int:
                try:
                    untrusted.check_record(orjson.loads(line))
                except (TypeError, ValueError):
                    continue
                raise AssertionError(line)


def test_floats_with_long_digit_runs_pass_the_screens() -> None:
    for k in range(1, 3000):
        value = 1.0 / (k + 1)
        line = _row(orjson.dumps(value).decode())
        assert _screens(line) == (True, True), line
    # an int of 18 digits passes; the largest int64 values take the full check, and pass it
    assert _screens(_row(str(10**17))) == (True, True)
    assert _screens(_row(str(records.INT_MAX))) == (False, False)
    untrusted.check_record(orjson.loads(_row(str(records.INT_MAX))))


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**80), 2**80) | st.floats(allow_nan=False, allow_infinity=False),
       st.sampled_from([":", ": ", ":  ", ":\t"]))
def test_whatever_the_screens_pass_the_full_check_passes(value: int | float, sep: str) -> None:
    line = _row(json.dumps(value), sep)
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return
    one, clean = _screens(line)
    if one or clean:
        untrusted.check_record(rec)
        assert type(rec["k"]) is type(json.loads(line)["k"])  # what another reader sees


def test_a_record_of_the_rank_shape_but_another_kind_is_not_screened_through() -> None:
    line = b'{"_kind":"rank","_step":3,"_time":1.5,"_seq":4,"_rank":0,"_world_size":2,"loss":0.5}'
    shape = frozenset(orjson.loads(line))
    assert untrusted.screen(orjson.loads(line), line, (_SHAPE, shape))
    for kind in (b'"span"', b"null", b"1"):
        other = line.replace(b'"rank"', kind, 1)
        rec = orjson.loads(other)
        assert not untrusted.screen(rec, other, (_SHAPE, shape)), other
        assert untrusted.plain_ranks([other], [rec], 4, b"}\n", shape) is None
    assert untrusted.plain_ranks([line], [orjson.loads(line)], 4, b"}\n", shape) == line + b"\n"
