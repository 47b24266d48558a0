"""Records read from a file someone else wrote (exprd's spool lines): the full check
and the fast screens that stand in for it."""

from __future__ import annotations

import json
import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expr_tracker.store import records, untrusted

_SHAPE = frozenset(("_step", "_time", "_seq", "loss", "k"))
_RANK_SHAPE = frozenset(("_kind", "_step", "_time", "_seq", "_rank", "_world_size", "_local_rank",
                         "_weight", "loss"))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)


def _shapes(rec: dict) -> list[tuple]:
    """Shapes `screen` may be given: the key sets of a step row and of a rank record that
    passed the full check (here: the record's own keys, if a good record can have them)."""
    keys = frozenset(rec)
    out = [(_SHAPE, _RANK_SHAPE)]
    good = dict.fromkeys((k for k in keys if k[:1] != "_"), 1)
    good.update({"_step": 1, "_time": 1.0, "_seq": 1})
    if "_kind" in keys:
        good.update({"_kind": "rank", "_rank": 0})
    good.update(dict.fromkeys(keys & {"_world_size", "_local_rank", "_weight", "_rank"}, 1))
    if frozenset(good) == keys and _passes(good):
        out.append((keys, _RANK_SHAPE) if "_kind" not in keys else (_SHAPE, keys))
    return out


def _passes(rec: dict) -> bool:
    try:
        untrusted.check_record(rec)
    except (TypeError, ValueError):
        return False
    return True


_near_valid = st.fixed_dictionaries(
    {"_step": st.integers(-2, 2**64) | _json_values, "_time": st.floats(0, 2e9) | _json_values,
     "_seq": st.integers(0, 9)},
    optional=dict.fromkeys(("_rank", "_kind", "_world_size", "_local_rank", "_weight", "_x", "",
                            "loss", "k", "a:b", "["), _json_values),
)


@settings(max_examples=120, deadline=None)
@given(_near_valid, st.booleans())
def test_the_fast_screen_never_passes_what_the_full_check_refuses(rec, spaced):
    """`screen` lets exprd keep a spool line verbatim without `check_record`: it may say
    no to a good record (the full check then runs), never yes to a bad one, and never
    to a line that does not hold exactly the record (a repeated key)."""

    line = json.dumps(rec, separators=(", ", ": ") if spaced else (",", ":")).encode()
    try:
        parsed = orjson.loads(line)
    except orjson.JSONDecodeError:
        return
    for shape in _shapes(parsed):
        if untrusted.screen(parsed, line, shape):
            assert _passes(parsed), line
            pairs = json.loads(line, object_pairs_hook=lambda kv: kv)
            assert len(pairs) == len(parsed), line  # the line holds no key twice
    # the block screen's cheap half (what the tailer's fast case checks inline)
    evs, clean = untrusted.screen_block([line, b'{"_step":1,"_time":1.0,"_seq":1,"loss":1,"k":2}'],
                                        1 << 24)
    assert evs is not None and evs[0] == parsed
    step = parsed.get("_step")
    if (clean and parsed.keys() == _SHAPE and parsed["_time"].__class__ is float
            and step.__class__ is int and 0 <= step <= untrusted.MAX_STEP):
        assert _passes(parsed), line
        assert len(json.loads(line, object_pairs_hook=lambda kv: kv)) == len(parsed), line
    # a repeated key: the parse keeps the last one, the line both
    if parsed:
        key = next(iter(parsed))
        twice = line[:-1] + b"," + json.dumps(key).encode() + b":" + json.dumps(parsed[key]).encode() + b"}"
        for shape in _shapes(parsed):
            assert not untrusted.screen(orjson.loads(twice), twice, shape)
        assert not untrusted.screen_block([line, twice], 1 << 24)[1]


def test_the_fast_screen_trusts_orjson_for_the_integer_range():
    """The screen does not look at integer values: orjson parses only what INT_MIN..INT_MAX
    allow. If INT_MAX is ever narrowed, the screen must learn to look (this fails first)."""
    for value in (records.INT_MIN, records.INT_MAX, records.INT_MAX + 1, records.INT_MIN - 1):
        line = b'{"_step":1,"_time":1.5,"_seq":2,"loss":0.5,"k":%d}' % value
        rec = orjson.loads(line)
        if untrusted.screen(rec, line, (_SHAPE, _RANK_SHAPE)):
            assert _passes(rec), value


def test_spool_records_are_checked_as_log_checks_its_arguments():
    ok = {"_step": 3, "_time": 1.5, "_seq": 4, "loss": "NaN", "text": "x", "flag": True, "none": None}
    untrusted.check_record(ok)
    untrusted.check_record({"_kind": "rank", "_step": 3, "_time": 1.5, "_rank": 2, "_world_size": 4,
                          "_local_rank": None, "_weight": 2, "_seq": 9, "loss": "-Infinity"})
    bad = {
        "_step": ({"_step": True, "_time": 1.0}, "_step must be an int, got bool"),
        "time": ({"_step": 1, "_time": None}, "_time must be a number, got null"),
        "rank": ({"_step": 1, "_time": 1.0, "_rank": 2**20}, "_rank must be an int between 0"),
        "kind": ({"_kind": "span", "_step": 1, "_time": 1.0}, "_kind must be 'rank' or absent"),
        "event": ({"_event": "x", "_step": 1, "_time": 1.0}, "field '_event'"),
        "weight": ({"_kind": "rank", "_step": 1, "_time": 1.0, "_rank": 0, "_weight": -1, "a": 1},
                   "_weight must be finite and >= 0"),
        "local": ({"_kind": "rank", "_step": 1, "_time": 1.0, "_rank": 0, "_local_rank": -2, "a": 1},
                  "_local_rank must be an int >= 0"),
        "empty": ({"_kind": "rank", "_step": 1, "_time": 1.0, "_rank": 0}, "at least one metric"),
        "text": ({"_step": 1, "_time": 1.0, "s": "x" * (records.MAX_STR + 1)}, "bytes of text"),
    }
    for name, (rec, message) in bad.items():
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            untrusted.check_record(rec)
        for shape in _shapes(rec):
            assert not untrusted.screen(rec, orjson.dumps(rec), shape), name


def test_the_block_screen_leaves_out_the_events_at_its_ends_only():
    init = b'{"_event":"init","_seq":0,"rules":[],"identity":{"a":1}}'
    row = b'{"_step":1,"_time":1.5,"_seq":1,"loss":0.5,"k":2}'
    finish = b'{"_event":"finish","_seq":3,"_time":2.0,"status":"finished"}'
    alert = b'{"_event":"alert","_seq":2,"title":"x","tags":["a"]}'
    evs, clean = untrusted.screen_block([init, row, row, finish], 1 << 24)
    assert clean and evs is not None and evs[1]["k"] == 2
    assert not untrusted.screen_block([row, alert, row], 1 << 24)[1]
    assert not untrusted.screen_block([row, b'{"_step":1,"_time":1.5,"k":[2]}'], 1 << 24)[1]
    assert untrusted.screen_block([row, b"null"], 1 << 24) == ([orjson.loads(row), None], False)
    assert untrusted.screen_block([row, b"{"], 1 << 24) == (None, False)
