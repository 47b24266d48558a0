"""What `expr query` prints as a table: the one rich module of the view commands.

(`expr_cli/render.py` draws every other command; plot drawing is in `plotdraw.py`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _table, console, fmt_num, prose


def cell(v: Any) -> str:
    """One query value as table text."""
    if v is None:
        return ""
    if isinstance(v, (int, float)):
        return fmt_num(v, 6)
    if isinstance(v, (dict, list)):  # a JSON value, a STRUCT or a LIST: as JSON, not repr
        import json

        return json.dumps(v, default=str)
    return str(v)


def _numeric(rows: Sequence[Sequence[Any]], i: int) -> bool:
    values = [row[i] for row in rows if row[i] is not None]
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def query_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], more: int) -> None:
    """A result set; `more` rows were left out."""
    numeric = [c for i, c in enumerate(columns) if _numeric(rows, i)]
    table = _table(columns, right=numeric)
    for row in rows:
        table.add_row(*(cell(v) for v in row))
    out = console()
    out.print(table)
    n = len(rows) + more
    tail = f" ({more} not shown: use --csv, --json or LIMIT)" if more else ""
    from rich.text import Text

    prose(out, Text(f"{n} row{'s' if n != 1 else ''}{tail}", style="dim"))
