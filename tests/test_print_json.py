"""`--json` output: orjson's text means what `json.dumps(indent=2)` did, for any data."""

from __future__ import annotations

import io
import json
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from expr_cli.data import jsonable
from expr_cli.render import print_json

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats() | st.text(max_size=8))
data = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=5) | st.integers(-5, 5), kids, max_size=4), max_leaves=20)


def _printed(obj: object) -> str:
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        print_json(obj)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = out


@settings(max_examples=300, deadline=None)
@given(data)
def test_the_same_json_as_before(obj: object) -> None:
    text = _printed(obj)
    before = json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n"
    assert text.isascii()
    assert json.loads(text) == json.loads(before)
    # the same layout: only a float's spelling may differ
    assert text.count("\n") == before.count("\n")


def _old_jsonable(obj: object) -> object:
    """`jsonable` before its fast paths by class, the reference."""
    import math
    from collections.abc import Mapping

    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, Mapping):
        return {str(k): _old_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_old_jsonable(v) for v in obj]
    return obj


class _Float(float):
    pass


@settings(max_examples=300, deadline=None)
@given(st.recursive(scalars | st.floats().map(_Float), lambda kids: st.lists(kids, max_size=4)
                    | st.lists(kids, max_size=3).map(tuple) | st.dictionaries(
                        st.text(max_size=5) | st.integers(-5, 5) | st.booleans(), kids,
                        max_size=4), max_leaves=20))
def test_jsonable_is_what_it_was(obj: object) -> None:
    got, want = jsonable(obj), _old_jsonable(obj)
    assert repr(got) == repr(want)
    assert [type(x) for x in _leaves(got)] == [type(x) for x in _leaves(want)]


def _leaves(obj: object) -> list[object]:
    if isinstance(obj, dict):
        return [*obj, *(x for v in obj.values() for x in _leaves(v))]
    if isinstance(obj, list):
        return [x for v in obj for x in _leaves(v)]
    return [obj]
