"""The public surface of expr_tracker and what importing it costs."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import expr_tracker as et


def test_all_is_sorted_and_is_the_public_surface():
    public = {
        name for name, value in vars(et).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
        and name not in ("annotations", "Any", "Mapping", "Sequence", "os")
    } | {"__version__"}
    assert et.__all__ == sorted(et.__all__)
    assert set(et.__all__) == public


def test_import_pulls_in_no_heavy_module():
    code = (
        "import sys, json, expr_tracker as et; "
        "print(json.dumps(sorted(m for m in ('typer', 'rich', 'watchdog', 'httpx', 'wandb', 'trackio',"
        " 'numpy', 'pandas', 'torch', 'expr_cli', 'exprd') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_functions_have_docstrings():
    for name in et.__all__:
        obj = getattr(et, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), name


def test_init_takes_exactly_the_options_parse_options_checks():
    """`init` spells its options out, `Run` passes them to `parse_options`: one list, one
    set of defaults, so an option added to one and not the other fails here."""
    import inspect

    from expr_tracker.options import parse_options

    def shape(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    assert shape(et.init) == shape(parse_options)
    run_params = list(inspect.signature(et.Run.__init__).parameters)
    assert run_params == ["self", "project", "name", "options"]
