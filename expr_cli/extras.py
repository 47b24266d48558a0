"""Optional packages of the view commands: a missing one is one line naming the extra."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CLIError

# module -> (extra, what it is)
EXTRAS = {
    "plotext": ("plot", "plotext"),
    "matplotlib": ("plot", "matplotlib"),
    "pyarrow": ("export", "pyarrow"),
    "duckdb": ("query", "DuckDB"),
    "starlette": ("serve", "starlette"),
    "uvicorn": ("serve", "uvicorn"),
    "mcp": ("mcp", "the MCP SDK"),
}


def require(module: str, command: str) -> Any:
    """Import `module` for `expr <command>`, or CLIError with the pip command of its extra."""
    extra, name = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CLIError(f"expr {command} needs {name}: pip install 'expr-tracker[{extra}]'") from None
