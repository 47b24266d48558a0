"""What the read commands answer, as plain data: one function per answer, called by the
command (which hands it to a renderer or prints it with `--json`) and by `expr serve`'s
JSON API, so a page and a terminal never disagree. No rich, no typer here.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

from expr_cli.errors import CLIError


def now() -> float:
    """The current time, or `$EXPR_NOW` (seconds since the epoch) to make ages reproducible.

    A value that is not a finite number is a CLIError naming the variable, not Python's
    "could not convert string to float".
    """
    frozen = os.environ.get("EXPR_NOW")
    if not frozen:
        return time.time()
    try:
        value = float(frozen)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise CLIError(f"EXPR_NOW must be a time in seconds since the epoch (such as "
                       f"{int(time.time())}), got {frozen!r}; unset it to use the clock")
    return value


def jsonable(obj: Any) -> Any:
    """Non-finite floats become "NaN"/"Infinity"/"-Infinity", as in shards (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
