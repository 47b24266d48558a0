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


_PLAIN = frozenset((str, int, bool, type(None)))


def jsonable(obj: Any) -> Any:
    """Non-finite floats become "NaN"/"Infinity"/"-Infinity", as in shards (strict JSON).
    The usual types are told by their class first: a 16,384-rank `expr top --json` holds
    about 190,000 values, and the `Mapping` check alone (an ABC) cost a microsecond each."""
    cls = obj.__class__
    if cls in _PLAIN:
        return obj
    if cls is float:
        return obj if obj - obj == 0.0 else jsonable_float(obj)
    if cls is dict:
        return {k if k.__class__ is str else str(k): jsonable(v) for k, v in obj.items()}
    if cls is list:
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):  # a subclass
        return jsonable_float(obj)
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def jsonable_float(x: float) -> Any:
    """A float as strict JSON holds it: a non-finite one as its text."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


RANKS_TEXT = 120  # characters of `ranks_text` before its ranges are cut


def brief(line: dict[str, Any], limit: int = 100) -> dict[str, Any]:
    """An incident line for a reader: past `limit` ranks (or hosts), the first `limit` of
    them, their count (`rank_count`, `host_count`), `ranks_cut: true` and the ranges as
    text (`ranks_text`); incidents.jsonl keeps them all. A job-wide silence names 16,383
    ranks: a reader gets a line, not 16,383 numbers."""
    from expr_cli.resolve import compact_ranks

    ranks, hosts = line.get("ranks") or [], line.get("hosts") or []
    if len(ranks) <= limit and len(hosts) <= limit:
        return line
    out = {**line, "rank_count": len(ranks), "host_count": len(hosts)}
    if len(ranks) > limit:
        text = compact_ranks(list(ranks))
        if len(text) > RANKS_TEXT:
            text = text[:RANKS_TEXT].rpartition(",")[0] + ",..."
        out.update(ranks=list(ranks[:limit]), ranks_cut=True, ranks_text=text)
    if len(hosts) > limit:
        out.update(hosts=list(hosts[:limit]), hosts_cut=True)
    return out
