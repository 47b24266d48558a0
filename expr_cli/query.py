"""`expr query RUN SQL`: DuckDB SQL over the run's views, read-only (see expr_tracker.sqlviews)."""

from __future__ import annotations

import csv
import datetime
import decimal
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from .errors import CLIError
from .resolve import resolve_run, root_dir

if TYPE_CHECKING:
    import typer

TABLE_ROWS = 500  # rows a table shows; --csv and --json print every row
_FETCH = 10_000


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


def _chunks(result: Any) -> Any:
    while True:
        rows = result.fetchmany(_FETCH)
        if not rows:
            return
        yield rows


def query_command(run: str, sql: str, dir: str | None, as_json: bool, as_csv: bool) -> None:
    """Run `sql` over the views of RUN and print the result."""
    if as_json and as_csv:
        raise CLIError("--json and --csv exclude each other", 2)
    from .extras import require

    require("duckdb", "query")
    from expr_tracker.sqlviews import connect, run_query

    ref = resolve_run(run, root_dir(dir))
    with connect(ref.path) as con:
        result = run_query(con, sql)
        columns = [d[0] for d in result.description]
        if as_json:
            _print_json(columns, result)
        elif as_csv:
            writer = csv.writer(sys.stdout, lineterminator="\n")
            writer.writerow(columns)
            for rows in _chunks(result):
                writer.writerows([_csv(v) for v in row] for row in rows)
            sys.stdout.flush()
        else:
            from . import render_views

            shown = result.fetchmany(TABLE_ROWS)
            more = sum(len(rows) for rows in _chunks(result))
            render_views.query_table(columns, shown, more)


def _csv(v: Any) -> Any:
    v = plain(v)
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return v


def _print_json(columns: list[str], result: Any) -> None:
    """A JSON array of row objects, written as rows arrive (memory bounded by a chunk)."""
    out = sys.stdout
    out.write("[")
    first = True
    for rows in _chunks(result):
        for row in rows:
            obj = {c: plain(v) for c, v in zip(columns, row, strict=True)}
            out.write(("\n  " if first else ",\n  ") + json.dumps(obj, allow_nan=False))
            first = False
    out.write("\n]\n" if not first else "]\n")
    out.flush()


def register(app: typer.Typer) -> None:
    """Add `expr query`."""
    import typer

    from .resolve import DIR_OPT, JSON_OPT, RUN_ARG

    sql_arg = typer.Argument(..., metavar="SQL", show_default=False,
                             help="One SELECT over the views metrics, ranks, alerts, incidents.")
    csv_opt = typer.Option(False, "--csv", help="Print CSV instead of a table.")

    @app.command(
        "query",
        epilog='Example: expr query sft-1 "SELECT _rank, max(loss) AS worst FROM metrics GROUP BY _rank"',
    )
    def query(
        run: str = RUN_ARG,
        sql: str = sql_arg,
        json: bool = JSON_OPT,
        as_csv: bool = csv_opt,
        dir: str | None = DIR_OPT,
    ) -> None:
        """SQL over RUN with DuckDB, read-only: views metrics (step rows of every rank, with
        _rank and _stream), ranks (rank records), alerts and incidents.

        Non-finite values are DOUBLE NaN/inf; see `expr query RUN "DESCRIBE metrics"`.
        """
        query_command(run, sql, dir, json, as_csv)
