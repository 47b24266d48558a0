"""The block screen parses a block's lines as one JSON array (`untrusted._as_one`) only
where that is the same as parsing each line on its own: lines made of fragments that join
across the commas (an object split over two lines, two objects on one line, a list that
spans lines, text holding "},{") are never taken for the lines they are not."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from expr_tracker.store import untrusted

_PIECES = [b'{"a":1', b'"b":2}', b'{"c":1},{"d":2}', b'{"e":[{"f":1}', b'{"g":2}]}', b'{}',
           b'{"h":"},{"}', b'{"i":"x"}', b'{"j":{"k":1}}', b'{"l":1}', b'{"m":1} ', b' {"n":1}',
           b'{"o":{"p":1}', b'"q":{"r":2}}', b"1", b"null", b'{"s":1}', b'{"t":"\\u005d"}', b""]


def _each(lines: list[bytes]) -> list[object] | None:
    try:
        return [orjson.loads(line) for line in lines]
    except orjson.JSONDecodeError:
        return None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6))
def test_one_array_parse_is_taken_only_where_it_is_each_line_s(lines: list[bytes]) -> None:
    one = untrusted._as_one(lines)
    if one is not None:
        rows, data = one
        assert rows == _each(lines), lines
        assert data == b"[" + b"\n,".join(lines) + b"]"
    recs, _clean = untrusted.screen_block(lines, 1 << 24)
    assert recs == _each(lines), lines


def test_the_usual_lines_are_parsed_as_one_array() -> None:
    lines = [b'{"_step":%d,"_time":1.5,"_seq":%d,"loss":0.25}' % (k, k + 1) for k in range(50)]
    one = untrusted._as_one(lines)
    assert one is not None and one[0] == _each(lines)
    assert untrusted.screen_block(lines, 1 << 24) == (_each(lines), True)
    # one odd line sends the block line by line (or is parsed as one, as a nested object
    # is), and the block is not clean
    for odd in (b'{"_step":1,"_time":1.5,"_seq":2,"loss":[1]}', b'{"_step":1,"_time":1.5} ',
                b'{"_step":1,"_time":1.5,"_seq":2,"x":{}}', b'{"a":1},{"b":2}'):
        block = [*lines[:10], odd, *lines[10:]]
        one = untrusted._as_one(block)
        assert one is None or (b"{}" in odd and one[0] == _each(block)), odd
        recs, clean = untrusted.screen_block(block, 1 << 24)
        assert not clean, odd
        assert recs == _each(block), odd


def test_numbered_takes_ints_only() -> None:
    """`numbered` reads the seqs' types from their sum: a float, a bool or text among
    numbers equal to the seqs is never taken for an int."""
    def rows(seqs: list[object]) -> list[dict[str, object]]:
        return [{"_seq": s, "_step": k, "_time": 1.5} for k, s in enumerate(seqs)]

    lines = [b"{}"] * 4
    assert untrusted.numbered(lines, rows([0, 1, 2, 3]), 0)
    assert untrusted.numbered(lines, rows([5, 6, 7, 8]), 5)
    for bad, first in (([0, True, 2, 3], 0), ([True, 2, 3, 4], 1), ([False, 1, 2, 3], 0),
                       ([5, 6.0, 7, 8], 5), ([5, 6, 7, 8.0], 5), ([5, "6", 7, 8], 5),
                       ([5, None, 7, 8], 5), ([5, 7, 6, 8], 5)):
        assert not untrusted.numbered(lines, rows(bad), first), bad
    assert not untrusted.numbered(lines, [{"_seq": 1, "_step": True, "_time": 1.5}], 1)
    assert not untrusted.numbered(lines, [{"_seq": 1, "_step": 1, "_time": 2}], 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6), st.sampled_from([4, 16, 1 << 24]))
def test_the_block_s_span_says_what_its_longest_line_would(lines: list[bytes], max_line: int) -> None:
    span = sum(map(len, lines)) + len(lines)
    assert untrusted.screen_block(lines, max_line, span) == untrusted.screen_block(lines, max_line)
