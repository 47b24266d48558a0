"""Read-only SQL for an agent, under row, byte and time caps the databases enforce.

A run's views (`expr query`): DuckDB in memory over the run's files only
(`views.sql.connect`: external access off but for those files, so `read_csv('/etc/passwd')`
is refused by DuckDB; extensions neither installed nor loaded; the configuration locked),
one statement whose type DuckDB's parser says is SELECT (`run_query`: no COPY, ATTACH,
CREATE, SET, PRAGMA), a memory limit, and a timer thread that interrupts the connection
at the time cap (an endless recursive CTE stops there). Rows are taken with `fetchmany`,
never by editing the text: the answer holds at most `Caps.rows` rows and the answer's
byte cap; with an output directory the rest (up to `Caps.file_rows` rows and
`Caps.file_bytes`) goes to a JSON-lines file.

The team store (ClickHouse, `--store`): the same single-statement check as `expr query
--store` and the server's own settings, `readonly=1` (after the caps, so the query's own
SETTINGS clause cannot lift them), `max_result_rows` and `max_result_bytes` with
`result_overflow_mode=break`, `max_execution_time` and `max_memory_usage`.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef
from expr_cli.sqlrows import chunks, plain

from .fit import Caps, OutDir, encode

STORE_ROW_BYTES = 4096  # the bytes a row may take, for the store's max_result_bytes


class SQLRefused(Exception):
    """SQL the databases refused, or stopped at a cap (the message says which)."""


def _take(columns: list[str], chunks: Iterator[Sequence[Sequence[Any]]], caps: Caps,
          out: OutDir, tool: str) -> dict[str, Any]:
    """The rows of a result: up to the caps in the answer, the rest to a file."""
    rows: list[dict[str, Any]] = []
    size = 0
    total = 0
    cut = False
    file = fh = None
    file_bytes = file_cap = 0
    room = caps.answer_bytes // 2  # (the rest of the answer: columns, covers, notes)
    try:
        for chunk in chunks:
            for raw in chunk:
                obj = {c: plain(v) for c, v in zip(columns, raw, strict=True)}
                total += 1
                if not cut:
                    line = encode(obj)
                    if len(rows) < caps.rows and size + len(line) <= room:
                        rows.append(obj)
                        size += len(line) + 1
                        continue
                    cut = True
                    if out.fd is None:
                        return _result(columns, rows, cut, None, None)
                    head = [encode(r) + b"\n" for r in rows]
                    if sum(map(len, head)) >= out.room():
                        return _result(columns, rows, cut, None, None, full=True)
                    path, fh = out.create(tool, ".jsonl")
                    file = str(path)
                    # this file's cap, and what the directory may still hold (--out-max)
                    file_cap = min(caps.file_bytes, out.room())
                    for h in head:
                        fh.write(h)
                        file_bytes += len(h)
                assert fh is not None
                line = encode(obj) + b"\n"
                if total > caps.file_rows or file_bytes + len(line) > file_cap:
                    return _result(columns, rows, True, file, total - 1, file_cut=True)
                fh.write(line)
                file_bytes += len(line)
    finally:
        if fh is not None:
            fh.close()
            out.held += file_bytes
    return _result(columns, rows, cut, file, total if file else None)


def _result(columns: list[str], rows: list[dict[str, Any]], cut: bool, file: str | None,
            file_rows: int | None, file_cut: bool = False, full: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"columns": columns, "rows": rows, "n_rows": len(rows), "cut": cut}
    if cut:
        out["file"] = file
        out["file_rows"] = file_rows
        if full:
            out["note"] = ("more rows than the answer holds, and the output directory holds "
                           "what it may (--out-max); aggregate in SQL")
        elif file is None:
            out["note"] = ("more rows than the answer holds; aggregate in SQL, or start expr mcp "
                           "with --out DIR to get them as a file")
        elif file_cut:
            out["note"] = f"the file holds the first {file_rows:,} rows (its cap)"
        else:
            out["note"] = f"every row ({file_rows:,}) is in {file}"
    return out


class ViewCache:
    """The DuckDB connections of the runs queried last, their views built once.

    Building the views is most of a query's time at thousands of ranks (DuckDB's schema
    detection, a file list of every shard). The views read the files at each query, so
    rows appended since are seen; a file created or removed (a new rank, an alerts or
    incidents file) changes the run directory's mtime, and the views are built again.
    One query at a time per connection (its lock); at most `keep` runs kept.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.open: OrderedDict[str, tuple[int, contextlib.ExitStack, Any, threading.Lock]] = \
            OrderedDict()

    def get(self, ref: RunRef, memory: str) -> tuple[Any, threading.Lock]:
        """A connection with the views of `ref`, and the lock to hold while using it."""
        from expr_tracker.views.sql import connect

        key = str(ref.path)
        mark = os.stat(ref.path).st_mtime_ns
        with self.lock:
            hit = self.open.get(key)
            if hit is not None and hit[0] == mark:
                self.open.move_to_end(key)
                return hit[2], hit[3]
            if hit is not None:
                self._close(key)
            stack = contextlib.ExitStack()
            try:
                con = stack.enter_context(connect(ref.path, memory_limit=memory))
            except BaseException:
                stack.close()
                raise
            self.open[key] = (mark, stack, con, threading.Lock())
            while len(self.open) > self.keep:
                self._close(next(iter(self.open)))
            return con, self.open[key][3]

    def _close(self, key: str) -> None:
        _, stack, _, lock = self.open.pop(key)
        with lock:  # (a query running on it ends first)
            stack.close()

    def close(self) -> None:
        """Close every connection (their spill directories removed)."""
        with self.lock:
            for key in list(self.open):
                self._close(key)


def run_sql(ref: RunRef, sql: str, caps: Caps, out: OutDir,
            views: ViewCache | None = None) -> dict[str, Any]:
    """`sql` over the views of run `ref` (DuckDB), capped; `views` keeps the connection."""
    from expr_tracker.views.sql import QueryError, QueryMemory, QueryTimeout, run_query, time_limit

    own = views is None
    cache = ViewCache(1) if views is None else views
    try:
        con, lock = cache.get(ref, caps.sql_memory)
        with lock, time_limit(con, caps.sql_seconds):
            result = run_query(con, sql)
            columns = [d[0] for d in result.description]
            return _take(columns, chunks(result, 1024), caps, out, "query")
    except QueryTimeout:
        raise SQLRefused(f"the query ran past the time cap ({caps.sql_seconds:g} s) and was "
                         "stopped") from None
    except QueryMemory as exc:
        raise SQLRefused(f"the query needs more memory than the cap ({caps.sql_memory}): "
                         f"{exc}") from None
    except QueryError as exc:
        raise SQLRefused(str(exc)) from None
    finally:
        if own:
            cache.close()


def store_limits(caps: Caps, with_file: bool) -> dict[str, str]:
    """ClickHouse settings of the caps (the server stops a bigger result at them)."""
    rows = caps.file_rows if with_file else caps.rows + 1
    return {
        "max_result_rows": str(rows),
        "max_result_bytes": str(caps.file_bytes if with_file else
                                 max(caps.answer_bytes, (caps.rows + 1) * STORE_ROW_BYTES)),
        "result_overflow_mode": "break",
        "max_execution_time": str(max(1, math.ceil(caps.sql_seconds))),
        "timeout_overflow_mode": "throw",
        "max_memory_usage": str(_bytes(caps.sql_memory)),
    }


def _bytes(size: str) -> int:
    """`1GB` -> bytes (a share of RAM, `25%`, as 1 GiB: ClickHouse takes bytes)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", size, re.IGNORECASE)
    if m is None:
        return 1 << 30
    unit = m.group(2).upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30,
                                    "TB": 1 << 40}[unit])


def run_store_sql(url: str, sql: str, caps: Caps, out: OutDir, *, user_env: str | None,
                  password_env: str | None) -> dict[str, Any]:
    """`sql` on the team store, capped by the server's settings."""
    from expr_cli.storequery import run_store_query

    limits = store_limits(caps, out.fd is not None)
    try:
        columns, rows = run_store_query(url, sql, user_env=user_env, password_env=password_env,
                                        timeout=caps.sql_seconds + 5, limits=limits)
    except CLIError as exc:
        raise SQLRefused(exc.message) from None
    answer = _take(columns, iter([rows]), caps, out, "store-query")
    if len(rows) >= int(limits["max_result_rows"]):
        answer["cut"] = True
        answer.setdefault("note", "")
        answer["note"] = (answer["note"] + "; " if answer["note"] else "") + (
            f"the server stopped the result at max_result_rows={limits['max_result_rows']}")
    return answer
