"""Optional packages in tests: skip with the reason `make test` recorded when installing them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

# the Makefile writes one file per extra it could not install: .venv/missing/<extra>
MISSING = Path(sys.prefix) / "missing"


def need(module: str, extra: str) -> ModuleType:
    """Import `module` or skip the test, naming the extra and why it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = MISSING / extra
        reason = why.read_text().strip() if why.exists() else str(exc)
        pytest.skip(f"extra [{extra}] not installed ({module}): {reason}")
