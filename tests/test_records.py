"""Values and records (DESIGN 4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from expr_tracker.store import records


def test_nonfinite_roundtrip_as_strict_json():
    row, nonfinite = records.encode_row({"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5})
    assert nonfinite
    line = records.dumps({"_step": 0, **row}, nonfinite)
    assert line == b'{"_step":0,"a":"NaN","b":"Infinity","c":"-Infinity","d":1.5}\n'
    back = records.loads(line)
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf


def test_bare_nan_tokens_from_other_trackers_load():
    rec = records.loads(b'{"_step": 1, "loss": NaN, "x": Infinity, "y": -Infinity}')
    assert math.isnan(rec["loss"]) and rec["x"] == math.inf and rec["y"] == -math.inf


def test_dumps_checks_nonfinite_when_not_told():
    assert records.dumps({"a": math.nan}) == b'{"a":"NaN"}\n'


def test_numpy_scalars_unwrapped():
    row, nonfinite = records.encode_row(
        {"f": np.float32(0.5), "i": np.int64(3), "b": np.bool_(True), "z": np.array(2.0), "n": np.float64("nan")}
    )
    assert row["f"] == 0.5 and type(row["f"]) is float
    assert row["i"] == 3 and type(row["i"]) is int
    assert row["b"] is True
    assert row["z"] == 2.0
    assert nonfinite and math.isnan(row["n"])


def test_torch_zero_dim_tensor_unwrapped():
    torch = pytest.importorskip("torch")
    row, _ = records.encode_row({"loss": torch.tensor(0.25)})
    assert row == {"loss": 0.25}
    with pytest.raises(TypeError, match="'loss'"):
        records.encode_row({"loss": torch.tensor([0.25, 0.5])})


@pytest.mark.parametrize(
    ("data", "exc", "match"),
    [
        ([1, 2], TypeError, "data must be a dict"),
        ({"x": [1, 2]}, TypeError, "'x'"),
        ({"x": {"a": 1}}, TypeError, "'x'"),
        ({"x": np.zeros(3)}, TypeError, "'x'"),
        ({"_step": 1}, ValueError, "reserved"),
        ({1: 2.0}, TypeError, "keys must be str"),
        ({"": 2.0}, ValueError, "empty"),
        ({"big": 2**70}, ValueError, "'big'"),
        ({"s": "\ud800"}, ValueError, "'s'"),
    ],
)
def test_bad_values_name_the_key(data, exc, match):
    with pytest.raises(exc, match=match):
        records.encode_row(data)


def test_iter_lines_ignores_unterminated_tail():
    assert [line for _, line in records.iter_lines(b'{"a":1}\n{"b":2}\n{"c"')] == [b'{"a":1}', b'{"b":2}']

