"""Optional extras (wandb, pyarrow, duckdb...): whether one can be imported, without
importing it (some take a fifth of a second of CPU to import)."""

from __future__ import annotations

import importlib.util
import sys


def importable(module: str) -> bool:
    """True if `module` is imported already or `find_spec` finds it; False if it is not
    installed, or its import is blocked (`sys.modules[module] = None`)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or no __spec__
        return False
