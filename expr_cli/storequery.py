"""Read-only SQL against the team store (ClickHouse, DESIGN 16): `expr query --store URL "SQL"`
and `expr mcp --store URL`'s query tool.

Two locks keep it read-only: the CLI sends only text that is exactly one SELECT (or WITH,
SHOW, DESCRIBE, EXPLAIN) statement (expr_cli.storesql: `KILL QUERY` and `SYSTEM` pass the
server's own check), and the server runs it with `readonly=1`, refusing anything that
writes. The answer comes back as JSONCompact (names, types, rows), which `expr_cli.query`
prints like a result of the local views.

A user whose profile already says `readonly=1` (what docs/backends.md recommends for
dashboards) may not change any setting, not even to the value it has, so the CLI first
asks the server for the user's `readonly` and then sends only what that user may set:
nothing for `readonly=1` (64-bit integers come back quoted, as the server's default, and
are read by their column type; NaN and infinities come back as null unless the profile
sets `output_format_json_quote_denormals = 1`).
Credentials come from the environment variables named by `--user-env`/`--password-env`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from expr_cli.errors import CLIError

_FLOAT_WORDS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                "+inf": float("inf")}
MAX_ERROR = 300  # characters of a server error shown
DEFAULT_USER_ENV, DEFAULT_PASSWORD_ENV = "CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD"
_READONLY_PROBE = "SELECT value FROM system.settings WHERE name = 'readonly' FORMAT TSV"
_WRAPPERS = re.compile(r"^(?:Nullable|LowCardinality)\((.*)\)\Z")
_ARRAY = re.compile(r"^Array\((.*)\)\Z")
_INTEGER = re.compile(r"^U?Int\d+\Z")
_NEEDS = re.compile(r"Int(?:64|128|256)|Float")


def _post(client: Any, url: str, sql: str, params: dict[str, str]) -> Any:
    """The server's 200 answer to `sql`, or CLIError with its first line."""
    import httpx

    try:
        resp = client.post(url.rstrip("/") + "/", params=params, content=sql.encode())
    except httpx.HTTPError as exc:
        raise CLIError(f"cannot reach the team store at {url}: {type(exc).__name__}") from None
    if resp.status_code != 200:
        text = resp.text.strip().splitlines()[0] if resp.text.strip() else ""
        raise CLIError(f"the team store refused the query (HTTP {resp.status_code}): "
                       f"{text[:MAX_ERROR]}")
    return resp


def _settings(client: Any, url: str) -> dict[str, str]:
    """The settings this user may send: `readonly=1` unless the profile is read-only
    already, and quoted NaN/infinities unless it forbids every setting (readonly=1)."""
    level = _post(client, url, _READONLY_PROBE, {}).text.strip()
    params = {"default_format": "JSONCompact"}
    if level in ("", "0"):
        params["readonly"] = "1"  # the server refuses INSERT, ALTER, DROP, SET
    if level != "1":
        params["output_format_json_quote_denormals"] = "1"
    return params


def convert(value: Any, ctype: str) -> Any:
    """A JSONCompact value as Python, by its ClickHouse type: 64-bit (and wider) integers
    arrive as strings, non-finite floats as "nan"/"inf" words (or null)."""
    while (m := _WRAPPERS.match(ctype)) is not None:
        ctype = m.group(1)
    if value is None:
        return None
    if (m := _ARRAY.match(ctype)) is not None and isinstance(value, list):
        return [convert(v, m.group(1)) for v in value]
    if isinstance(value, str):
        if _INTEGER.match(ctype):
            try:
                return int(value)
            except ValueError:
                return value
        if ctype.startswith("Float"):
            return _FLOAT_WORDS.get(value, value)
    return value


def _credentials(user_env: str | None, password_env: str | None) -> tuple[str, str] | None:
    """(user, password) from the environment; a variable named by an option must be set
    (else the server would silently answer as its `default` user)."""
    for option, var in (("--user-env", user_env), ("--password-env", password_env)):
        if var is not None and var not in os.environ:
            raise CLIError(f"{option} names {var}, which is not set in the environment", 2)
    user = os.environ.get(user_env or DEFAULT_USER_ENV)
    if not user:
        return None
    return user, os.environ.get(password_env or DEFAULT_PASSWORD_ENV, "")


def run_store_query(url: str, sql: str, *, user_env: str | None, password_env: str | None,
                    timeout: float, limits: dict[str, str] | None = None,
                    ) -> tuple[list[str], list[list[Any]]]:
    """(column names, rows) of `sql` run read-only on the ClickHouse server at `url`.

    `limits`: settings the server must apply to the query (`expr mcp`'s caps:
    max_result_rows, max_execution_time, ...); a user whose profile says `readonly=1`
    may set none, and such a query is refused rather than run without them."""
    import httpx
    import orjson

    from expr_cli.storesql import StoreSQLError, check_read_only
    from expr_tracker.backends.registry import CLICKHOUSE_SECRET_PARAMS, check_url

    try:
        check_url(url, "--store", CLICKHOUSE_SECRET_PARAMS)
    except ValueError as exc:
        raise CLIError(str(exc).replace("user_env/password_env or token_env",
                                        "--user-env/--password-env"), 2) from None
    try:
        check_read_only(sql)
    except StoreSQLError as exc:
        raise CLIError(str(exc), 2) from None
    creds = _credentials(user_env, password_env)
    auth = httpx.BasicAuth(*creds) if creds else None
    with httpx.Client(auth=auth, timeout=timeout) as client:
        params = _settings(client, url)
        if limits:
            if "readonly" not in params:  # the profile's readonly is 1 or 2 already
                # 1 forbids setting the caps; 2 lets the query's SETTINGS clause lift them
                raise CLIError("the team store's user has a read-only profile (readonly=1 "
                               "forbids setting the row, byte and time caps, readonly=2 lets a "
                               "query lift them); give expr mcp a user without readonly in its "
                               "profile: it sets readonly=1 itself, after the caps")
            # the caps first, then readonly=1 (it forbids the query's own SETTINGS clause)
            params = {**limits, **params, "readonly": "1"}
        resp = _post(client, url, sql, params)
    try:
        doc = orjson.loads(resp.content)
        names = [str(col["name"]) for col in doc["meta"]]
        types = [str(col["type"]) for col in doc["meta"]]
        rows = [list(row) for row in doc["data"]]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise CLIError("the team store answered something other than JSONCompact; "
                       "leave FORMAT out of the query") from None
    # only columns that can hold a quoted integer or a non-finite word need a look
    needs = [(i, t) for i, t in enumerate(types) if _NEEDS.search(t)]
    for row in rows:
        for i, ctype in needs:
            row[i] = convert(row[i], ctype)
    return names, rows
