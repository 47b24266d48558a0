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
