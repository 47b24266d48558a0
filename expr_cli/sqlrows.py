"""Rows of a DuckDB result as JSON-ready values, a chunk at a time (`expr query`, and the
query tool of `expr mcp`)."""

from __future__ import annotations

import datetime
import decimal
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

FETCH = 10_000


def plain(v: Any) -> Any:
    """A DuckDB value as JSON-ready data (NaN and infinities spelled as in shards)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, decimal.Decimal):
        return plain(float(v))
    if isinstance(v, (datetime.date, datetime.time, datetime.timedelta)):
        return str(v) if isinstance(v, datetime.timedelta) else v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def chunks(result: Any, size: int = FETCH) -> Iterator[Sequence[Sequence[Any]]]:
    """The result's rows, a chunk at a time, JSON-typed columns decoded (`incidents.detail`
    came out as text holding JSON: "\\"rank 2 ...\\"" in `--json`, quoted in the table)."""
    from expr_tracker.views.sql import query_error

    decode = [i for i, d in enumerate(result.description) if str(d[1]) == "JSON"]
    while True:
        try:
            rows = result.fetchmany(size)
        except Exception as exc:  # DuckDB's: the time or memory limit, while fetching
            raise query_error(exc) from None
        if not rows:
            return
        yield [_decoded(row, decode) for row in rows] if decode else rows


def _decoded(row: Sequence[Any], columns: list[int]) -> Sequence[Any]:
    out = list(row)
    for i in columns:
        if isinstance(out[i], str):
            try:
                out[i] = json.loads(out[i])
            except ValueError:
                pass  # (DuckDB checks JSON values; kept as text if one is not)
    return out
