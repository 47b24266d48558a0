"""`expr query --store URL "SQL"`: read-only SQL against the team store (ClickHouse, DESIGN 16).

The statement goes to ClickHouse's HTTP interface with `readonly=1`, so the server itself
refuses anything that writes; the answer comes back as JSONCompact (names, types, rows)
and is printed as JSON lines (`--json`), CSV with a header (`--csv`) or a table.
Credentials come from the environment variables named by `--user-env`/`--password-env`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from .errors import CLIError

_FLOAT_WORDS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                "+inf": float("inf")}
MAX_ERROR = 300  # characters of a server error shown


def run_store_query(url: str, sql: str, *, user_env: str, password_env: str,
                    timeout: float) -> tuple[list[str], list[list[Any]]]:
    """(column names, rows) of `sql` run read-only on the ClickHouse server at `url`."""
    import httpx
    import orjson

    if not url.startswith(("http://", "https://")):
        raise CLIError(f"--store must be an http:// or https:// URL, not {url!r}", 2)
    if not sql.strip():
        raise CLIError("SQL is empty", 2)
    user = os.environ.get(user_env)
    auth = httpx.BasicAuth(user, os.environ.get(password_env, "")) if user else None
    params = {
        "readonly": "1",  # the server refuses INSERT, ALTER, DROP, SET
        "default_format": "JSONCompact",
        "output_format_json_quote_64bit_integers": "0",
        "output_format_json_quote_denormals": "1",
    }
    try:
        resp = httpx.post(url.rstrip("/") + "/", params=params, content=sql.encode(),
                          auth=auth, timeout=timeout)
    except httpx.HTTPError as exc:
        raise CLIError(f"cannot reach the team store at {url}: {type(exc).__name__}") from None
    if resp.status_code != 200:
        text = resp.text.strip().splitlines()[0] if resp.text.strip() else ""
        raise CLIError(f"the team store refused the query (HTTP {resp.status_code}): "
                       f"{text[:MAX_ERROR]}")
    try:
        doc = orjson.loads(resp.content)
        names = [str(col["name"]) for col in doc["meta"]]
        types = [str(col["type"]) for col in doc["meta"]]
        rows = [list(row) for row in doc["data"]]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise CLIError("the team store answered something other than JSONCompact; "
                       "leave FORMAT out of the query") from None
    floats = [i for i, t in enumerate(types) if "Float" in t]
    for row in rows:
        for i in floats:
            if isinstance(row[i], str):
                row[i] = _FLOAT_WORDS.get(row[i], row[i])
    return names, rows


def store_command(url: str, sql: str, as_json: bool, as_csv: bool, user_env: str,
                  password_env: str, timeout: float) -> None:
    """Run `sql` against the team store and print the rows."""
    from . import render

    if as_json and as_csv:
        raise CLIError("--json and --csv cannot be combined", 2)
    names, rows = run_store_query(url, sql, user_env=user_env, password_env=password_env,
                                  timeout=timeout)
    if as_json:
        import json

        out = sys.stdout
        for row in rows:
            out.write(json.dumps(render.jsonable(dict(zip(names, row, strict=True))), allow_nan=False) + "\n")
        out.flush()
    elif as_csv:
        import csv

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(names)
        for row in rows:
            writer.writerow(["" if v is None else render.jsonable(v) for v in row])
        sys.stdout.flush()
    elif rows:
        render.query_table(names, rows, f"{len(rows)} row{'s' if len(rows) != 1 else ''}")
    else:
        render.note("no rows")


def register(app: typer.Typer) -> None:
    """Add `expr query` with the team store path only (until `expr query RUN SQL` lands)."""

    @app.command(
        "query",
        epilog="Example: expr query --store http://ch:8123 "
               "\"SELECT name, max(step) FROM expr.metrics FINAL GROUP BY name\"",
    )
    def query(
        sql: str = typer.Argument(..., help="A read-only SQL statement (no FORMAT clause)."),
        store: str = typer.Option(..., "--store", metavar="URL",
                                  help="The team store's ClickHouse HTTP URL."),
        json: bool = typer.Option(False, "--json", help="One JSON object per row."),
        csv: bool = typer.Option(False, "--csv", help="CSV with a header line."),
        user_env: str = typer.Option("CLICKHOUSE_USER", "--user-env", metavar="VAR",
                                     help="Environment variable holding the user name."),
        password_env: str = typer.Option("CLICKHOUSE_PASSWORD", "--password-env", metavar="VAR",
                                         help="Environment variable holding the password."),
        timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the answer."),
    ) -> None:
        """Run read-only SQL on the team store (ClickHouse): tables metrics, rank_metrics,
        runs, alerts, incidents. Add FINAL to count each event once."""
        store_command(store, sql, json, csv, user_env, password_env, timeout)
