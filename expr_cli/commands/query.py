"""`expr query RUN SQL`: DuckDB SQL over the run's views, read-only (see expr_tracker.views.sql)."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from expr_cli.errors import CLIError
from expr_cli.resolve import resolve_run, root_dir
from expr_cli.sqlrows import chunks as _chunks
from expr_cli.sqlrows import plain

if TYPE_CHECKING:
    import typer

TABLE_ROWS = 500  # rows a table shows; --csv and --json print every row
DEFAULT_TIMEOUT = 60.0  # seconds a query may take, locally or on the team store


def query_command(run: str, sql: str, dir: str | None, as_json: bool, as_csv: bool, *,
                  timeout: float = DEFAULT_TIMEOUT, memory: str | None = None) -> None:
    """Run `sql` over the views of RUN and print the result, within `timeout` seconds
    and `memory` (DuckDB's memory_limit, default 25% of RAM)."""
    if as_json and as_csv:
        raise CLIError("--json and --csv exclude each other", 2)
    from expr_cli.extras import require

    require("duckdb", "query")
    from expr_tracker.views.sql import (
        DEFAULT_MEMORY,
        QueryMemory,
        QueryTimeout,
        check_memory,
        connect,
        run_query,
        time_limit,
    )

    _check_timeout(timeout)
    try:
        limit = check_memory(memory or DEFAULT_MEMORY)
    except ValueError as exc:
        raise CLIError(f"--memory: {exc}", 2) from None
    ref = resolve_run(run, root_dir(dir))
    try:
        with connect(ref.path, memory_limit=limit) as con, time_limit(con, timeout):
            result = run_query(con, sql)
            print_result([d[0] for d in result.description], _chunks(result), as_json, as_csv)
    except QueryTimeout:
        raise CLIError(f"the query ran longer than --timeout {timeout:g} s and was stopped"
                       ) from None
    except QueryMemory as exc:
        raise CLIError(f"the query needs more memory than --memory {limit} ({exc}); "
                       "raise --memory or narrow the query") from None


def _check_timeout(timeout: float) -> None:
    if not (timeout > 0 and math.isfinite(timeout)):
        raise CLIError(f"--timeout must be a positive number of seconds, not {timeout:g}", 2)


def print_result(columns: list[str], chunks: Iterator[Sequence[Sequence[Any]]], as_json: bool,
                 as_csv: bool) -> None:
    """A result set as a JSON array, CSV or a table: the local views and the team store alike."""
    if as_json:
        _print_json(columns, chunks)
    elif as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for rows in chunks:
            writer.writerows([_csv(v) for v in row] for row in rows)
        sys.stdout.flush()
    else:
        from expr_cli.render import views as render_views

        shown: list[Sequence[Any]] = []
        more = 0
        for rows in chunks:
            room = TABLE_ROWS - len(shown)
            shown.extend(rows[:room])
            more += max(len(rows) - room, 0)
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


def _print_json(columns: list[str], chunks: Iterator[Sequence[Sequence[Any]]]) -> None:
    """A JSON array of row objects, written as rows arrive (memory bounded by a chunk)."""
    out = sys.stdout
    out.write("[")
    first = True
    for rows in chunks:
        for row in rows:
            obj = {c: plain(v) for c, v in zip(columns, row, strict=True)}
            out.write(("\n  " if first else ",\n  ") + json.dumps(obj, allow_nan=False))
            first = False
    out.write("\n]\n" if not first else "]\n")
    out.flush()


def register(app: typer.Typer) -> None:
    """Add `expr query`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT

    args_arg = typer.Argument(..., metavar="[RUN] SQL", show_default=False,
                              help="RUN and one SELECT over its views metrics, ranks, alerts, "
                                   "incidents; with --store only the SQL.")
    csv_opt = typer.Option(False, "--csv", help="Print CSV instead of a table.")
    store_opt = typer.Option(None, "--store", metavar="URL",
                             help="Query the team store (ClickHouse HTTP URL) instead of a run.")
    user_opt = typer.Option(None, "--user-env", metavar="VAR", show_default=False,
                            help="With --store: the variable holding the user name (must be "
                                 "set; default CLICKHOUSE_USER if set, else the server's "
                                 "default user).")
    password_opt = typer.Option(None, "--password-env", metavar="VAR", show_default=False,
                                help="With --store: the variable holding the password (must "
                                     "be set; default CLICKHOUSE_PASSWORD).")
    timeout_opt = typer.Option(DEFAULT_TIMEOUT, "--timeout", metavar="SECONDS",
                               help="Stop the query after this long (with --store: the wait "
                                    "for the server).")
    memory_opt = typer.Option(None, "--memory", metavar="SIZE", show_default=False,
                              help="DuckDB's memory limit, e.g. 4GB or 25% (default 25% of "
                                   "RAM); sorts and joins spill to disk beyond it.")

    @app.command(
        "query",
        epilog='Examples: expr query sft-1 "SELECT _rank, max(loss) AS worst FROM metrics GROUP BY _rank"'
               ' | expr query --store http://ch:8123 "SELECT name, max(step) FROM expr.metrics FINAL'
               ' GROUP BY name"',
    )
    def query(
        args: list[str] = args_arg,
        json: bool = JSON_OPT,
        as_csv: bool = csv_opt,
        dir: str | None = DIR_OPT,
        store: str | None = store_opt,
        user_env: str | None = user_opt,
        password_env: str | None = password_opt,
        timeout: float = timeout_opt,
        memory: str | None = memory_opt,
    ) -> None:
        """SQL over RUN with DuckDB, read-only: views metrics (step rows of every rank, with
        _rank and _stream), ranks (rank records), alerts and incidents; or, with --store, over
        the team store (ClickHouse tables metrics, rank_metrics, runs, alerts, incidents).

        Non-finite values are DOUBLE NaN/inf; see `expr query RUN "DESCRIBE metrics"`.
        """
        if store is not None:
            if len(args) != 1:
                raise CLIError("with --store, give only the SQL (no RUN)", 2)
            from expr_cli.storequery import run_store_query

            if json and as_csv:
                raise CLIError("--json and --csv exclude each other", 2)
            if memory is not None:
                raise CLIError("--memory is for a run's views (DuckDB), not --store", 2)
            _check_timeout(timeout)
            names, rows = run_store_query(store, args[0], user_env=user_env,
                                          password_env=password_env, timeout=timeout)
            print_result(names, iter([rows]), json, as_csv)
            return
        if len(args) != 2:
            raise CLIError("expr query takes RUN and SQL (or --store URL and SQL)", 2)
        query_command(args[0], args[1], dir, json, as_csv, timeout=timeout, memory=memory)
