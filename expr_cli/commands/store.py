"""`expr query --store URL "SQL"`: read-only SQL against the team store (ClickHouse, DESIGN 16).

The statement goes to ClickHouse's HTTP interface with `readonly=1`, so the server itself
refuses anything that writes; the answer comes back as JSONCompact (names, types, rows),
which `expr_cli.query` prints like a result of the local views.
Credentials come from the environment variables named by `--user-env`/`--password-env`.
"""

from __future__ import annotations

import os
from typing import Any

from expr_cli.errors import CLIError

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
