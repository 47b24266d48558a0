"""Scripts written for expr-tracker 0.4 run unchanged: its other calls, as 0.4 documents them."""

from __future__ import annotations

from pathlib import Path

import pytest

import expr_tracker as et


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    et.init("p", "r", dir=tmp_path)
    for k in range(3):
        et.log({"loss": 1.0 / (k + 1)})
    et.finish()
    return tmp_path / "p" / "r"


@pytest.mark.parametrize(("alias", "kind"), [
    ("pandas", "DataFrame"), ("pd", "DataFrame"), ("df", "DataFrame"), ("PANDAS", "DataFrame"),
    ("arrow", "Table"), ("Arrow", "Table"), ("dict", "list"), ("records", "list"),
    ("list", "list"), ("Dict", "list"),
])
def test_history_and_read_run_take_0_4s_output_types(run_dir: Path, alias: str, kind: str) -> None:
    for got in (et.history(-1, run=run_dir, output_type=alias),
                et.read_run(run_dir, output_type=alias)):
        assert type(got).__name__ == kind
        rows = got if isinstance(got, list) else got.to_pylist() if kind == "Table" else got.to_dict("records")
        assert [r["loss"] for r in rows] == [1.0, 0.5, 1 / 3]


def test_an_unknown_output_type_lists_the_choices(run_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"output_type must be one of .*'pd'.*'records'.*got 'polars'"):
        et.history(-1, run=run_dir, output_type="polars")
    with pytest.raises(ValueError, match="output_type must be one of"):
        et.read_run(run_dir, output_type=3)


def test_dir_of_the_package_is_its_public_api() -> None:
    assert dir(et) == sorted(et.__all__)
    assert not {"os", "Any", "Mapping", "Sequence", "annotations"} & set(dir(et))


def test_a_backend_module_imported_without_a_spec_counts_as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    import warnings

    from expr_tracker.backends.base import require

    fake = types.ModuleType("expr_fake_backend_lib")
    fake.__spec__ = None  # as a module some test harnesses or notebooks put in sys.modules
    monkeypatch.setitem(sys.modules, "expr_fake_backend_lib", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert require("expr_fake_backend_lib", "fake") is True
