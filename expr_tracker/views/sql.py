"""SQL over a run with DuckDB (`expr query`): read-only views over the JSONL files, in place.

Views (DESIGN 15):

- `metrics`: the step rows of every shard of every stream, with `_rank` (the row's own
  `_rank` in a shared `rank_aware=False` file, else the rank in the file name), `_stream`
  (from the file name, NULL for the default stream), `_step`, `_time` and one column per key.
- `ranks`: the rank records (`log_rank_metrics`), with `_rank` (the record's own),
  `_stream`, `_step`, `_time`, `_world_size`, `_local_rank`, `_weight` and the keys.
- `alerts`: every `alerts[.rankN].jsonl` line; `incidents`: `incidents.jsonl` (DESIGN 13),
  an empty view with the same columns when the file does not exist.

DuckDB infers the columns and their types (`union_by_name`), over every file in a run of at
most EXACT_SHARDS shards. Detection costs DuckDB a fixed ~0.2 ms per file, several times the
scan itself at thousands of ranks, so in a bigger run it detects over a sample of the shards
(each stream's first shard plus up to SAMPLE_SHARDS spread over the ranks, the files the
key sample below reads) and the views read every shard with that schema given (`columns`): a
key or a type that appears only in shards outside the sample is not seen (a value of
another type is cast to the column's, or NULL). A key that mixes numbers
with the "NaN"/"Infinity"/"-Infinity" strings of the format comes out as JSON or text;
when the keys' values in a bounded sample of the files (the first 256 KiB of up to 64
shards) are all numbers once those strings are decoded, the view casts the column to
DOUBLE with TRY_CAST, so NaN and infinities are IEEE floats and any other text is NULL.
Keys seen only in rank records (in that sample) are left out of `metrics`, keys seen only in
step rows out of `ranks`. Lines that do not parse are skipped; exprd's `_sid`/`_seq` are
left out.

Read-only: the database lives in memory; before any file is read, external access is
turned off except for exactly the files of the views (`allowed_paths`), extensions cannot be
installed or loaded, and the configuration is locked: DuckDB refuses to open any other file
for reading or writing. It would still write to those allowed files (`COPY ... TO` a shard
with `USE_TMP_FILE false`), so `run_query` runs only a single SELECT statement: COPY, ATTACH,
CREATE, SET, PRAGMA, CALL and EXPLAIN (whose ANALYZE form runs its statement) are refused
before anything runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from expr_tracker.errors import TrackerError
from expr_tracker.store import records
from expr_tracker.store.layout import parse_shard_name
from expr_tracker.store.runread import ALL_STREAMS, run_shards

SAMPLE_SHARDS = 64
EXACT_SHARDS = 256  # up to this many shards DuckDB detects the columns over every one
SAMPLE_BYTES = 256 * 1024
MAX_OBJECT = 16 * 1024 * 1024  # the longest line DuckDB will read (its default is 16 MiB)
_ALERTS_RE = re.compile(r"alerts(?:\.rank\d+)?\.jsonl\Z")
_ROW_META = ("_step", "_time")
_RANK_META = ("_world_size", "_local_rank", "_weight")
_META_TYPES = {"_step": "BIGINT", "_time": "DOUBLE", "_world_size": "BIGINT",
               "_local_rank": "BIGINT", "_weight": "DOUBLE", "_rank": "BIGINT"}
ALERT_COLUMNS = {
    "time": "DOUBLE", "step": "BIGINT", "rank": "BIGINT", "level": "VARCHAR", "kind": "VARCHAR",
    "title": "VARCHAR", "text": "VARCHAR", "rule": "VARCHAR", "delivered": "BOOLEAN",
    "project": "VARCHAR", "run": "VARCHAR", "stream": "VARCHAR", "event_id": "VARCHAR",
}
INCIDENT_COLUMNS = {
    "kind": "VARCHAR", "ranks": "BIGINT[]", "hosts": "VARCHAR[]", "step": "BIGINT",
    "first_seen": "DOUBLE", "last_seen": "DOUBLE", "detail": "JSON", "state": "VARCHAR",
    "delivered": "BOOLEAN",
}
# what DuckDB may infer for a key whose sampled values are all numbers: kept as it is
_NUMERIC_TYPES = frozenset({"DOUBLE", "FLOAT", "BIGINT", "INTEGER", "SMALLINT", "TINYINT",
                            "HUGEINT", "UBIGINT", "UINTEGER", "USMALLINT", "UTINYINT"})
# not EXPLAIN: `EXPLAIN ANALYZE COPY ... TO` runs the COPY
READ_ONLY_TYPES = ("SELECT",)
# the rank and the stream of a row, from the path of its shard (DuckDB's `_file` column)
_FILE_RANK = r"coalesce(TRY_CAST(regexp_extract(_file, '\.rank([0-9]+)\.jsonl$', 1) AS BIGINT), 0)"
_FILE_STREAM = (r"NULLIF(regexp_extract(regexp_replace(_file, '(\.rank[0-9]+)?\.jsonl$', ''), "
                r"'/metrics\.?([^/]*)$', 1), '')")


class QueryError(TrackerError):
    """A query that DuckDB, or the read-only check, refused."""


class QueryTimeout(QueryError):
    """A query stopped at its time limit (`time_limit`)."""


class QueryMemory(QueryError):
    """A query that needed more memory than its `memory_limit`."""


DEFAULT_MEMORY = "25%"  # of the machine's RAM (DuckDB's own default is 80%)
_MEMORY_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(%|B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\Z", re.IGNORECASE)


def check_memory(value: str) -> str:
    """`value` if DuckDB reads it as a memory limit ("4GB", "512MiB", "25%"), else
    ValueError naming it."""
    m = _MEMORY_RE.match(value.strip())
    if m is None or not float(m.group(1)) > 0 or (m.group(2) == "%" and float(m.group(1)) > 100):
        raise ValueError(f"memory limit {value!r}: expected a size such as 4GB or 512MiB, "
                         "or a share of RAM such as 25%")
    return value.strip()


def query_error(exc: Exception) -> QueryError:
    """A DuckDB error as the QueryError to raise (the time and memory limits by name)."""
    duckdb = need_duckdb()
    if isinstance(exc, duckdb.InterruptException):
        return QueryTimeout("stopped at the time limit")
    if isinstance(exc, duckdb.OutOfMemoryException):
        return QueryMemory(first_line(exc))
    return QueryError(first_line(exc))


@contextlib.contextmanager
def time_limit(con: Any, seconds: float) -> Iterator[None]:
    """Interrupt whatever `con` runs (executing or fetching) after `seconds`; the DuckDB
    error that follows becomes QueryTimeout through `query_error`."""
    import threading

    timer = threading.Timer(seconds, con.interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def need_duckdb() -> Any:
    """`duckdb`, or ImportError naming the extra that installs it."""
    try:
        import duckdb
    except ImportError:
        raise ImportError("needs DuckDB: pip install 'expr-tracker[query]'") from None
    return duckdb


def ident(name: str) -> str:
    """A quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """A quoted SQL string."""
    return "'" + text.replace("'", "''") + "'"


def _file_list(paths: list[str]) -> str:
    return "[" + ", ".join(literal(p) for p in paths) + "]"


def _spread(paths: list[Any]) -> list[Any]:
    """Up to SAMPLE_SHARDS of `paths`, evenly spread, the first one included."""
    if len(paths) > SAMPLE_SHARDS:
        stride = len(paths) / SAMPLE_SHARDS
        paths = [paths[int(i * stride)] for i in range(SAMPLE_SHARDS)]
    return paths


def detect_sample(shard_files: list[str]) -> list[str]:
    """The shards DuckDB detects the columns over: every one in a run of at most
    EXACT_SHARDS shards, else each stream's first shard and the key sample's shards."""
    if len(shard_files) <= EXACT_SHARDS:
        return shard_files
    picked = dict.fromkeys(_spread(shard_files))
    seen: set[str | None] = set()
    for p in shard_files:  # sorted by stream then rank: the first of a stream is its lowest rank
        parsed = parse_shard_name(Path(p).name)
        stream = parsed.stream if parsed is not None else None
        if stream not in seen:
            seen.add(stream)
            picked[p] = None
    order = {p: i for i, p in enumerate(shard_files)}
    return sorted(picked, key=order.__getitem__)


def sample_keys(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """key -> {"step": seen in step rows, "rank": seen in rank records, "numeric": bool}
    from the first SAMPLE_BYTES of up to SAMPLE_SHARDS shards spread over the run."""
    paths = _spread(paths)
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path, "rb") as fh:
                data = fh.read(SAMPLE_BYTES)
        except OSError:
            continue
        for _, line in records.iter_lines(data):
            try:
                rec = records.loads(line)
            except ValueError:
                continue
            where = "rank" if rec.get("_kind") == "rank" else "step"
            for k, v in rec.items():
                if k[:1] == "_":
                    continue
                info = out.setdefault(k, {"step": False, "rank": False, "numeric": True, "seen": False})
                info[where] = True
                if v is not None:
                    info["seen"] = True
                    if type(v) not in (int, float):
                        info["numeric"] = False
    return out


def _column_expr(name: str, dtype: str, sample: dict[str, Any] | None) -> str:
    col = ident(name)
    numeric = sample is not None and sample["seen"] and sample["numeric"]
    if numeric and dtype == "JSON":
        return f"TRY_CAST({col} ->> '$' AS DOUBLE) AS {col}"
    if numeric and dtype not in _NUMERIC_TYPES:
        # VARCHAR, or a type DuckDB guessed from the strings alone: a key that is only
        # ever "Infinity" reads as DATE 'infinity' (9999-12-31 in Python); its text is
        # "infinity", which casts to the float
        cast = col if dtype == "VARCHAR" else f"CAST({col} AS VARCHAR)"
        return f"TRY_CAST({cast} AS DOUBLE) AS {col}"
    return col


def _meta_expr(name: str, have: dict[str, str]) -> str:
    t = _META_TYPES[name]
    if name not in have:
        return f"NULL::{t} AS {ident(name)}"
    return f"TRY_CAST({ident(name)} AS {t}) AS {ident(name)}"


def _shard_views(con: Any, shard_files: list[str]) -> list[str]:
    """CREATE VIEW statements for `metrics` and `ranks`."""
    if not shard_files:
        empty = ", ".join(f"NULL::{_META_TYPES[c]} AS {c}" for c in ("_rank", *_ROW_META))
        return [f"CREATE VIEW metrics AS SELECT {empty}, NULL::VARCHAR AS _stream LIMIT 0",
                f"CREATE VIEW ranks AS SELECT {empty}, NULL::VARCHAR AS _stream LIMIT 0"]
    options = f"filename='_file', ignore_errors=true, maximum_object_size={MAX_OBJECT}"
    detect = detect_sample(shard_files)
    source = (f"read_json({_file_list(detect)}, format='newline_delimited', "
              f"union_by_name=true, {options})")
    described = con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()
    have = {row[0]: row[1] for row in described}
    if len(detect) < len(shard_files):
        spec = ", ".join(f"{literal(c)}: {literal(t)}" for c, t in have.items() if c != "_file")
        source = (f"read_json({_file_list(shard_files)}, format='newline_delimited', "
                  f"columns={{{spec}}}, {options})")
    sample = sample_keys([Path(p) for p in shard_files])
    keys = [k for k in have if k[:1] != "_"]
    own_rank = "coalesce(TRY_CAST(_rank AS BIGINT), {f})" if "_rank" in have else "{f}"
    kind_is = "_kind IS NULL" if "_kind" in have else "true"
    rank_kind = "_kind = 'rank'" if "_kind" in have else "false"
    step_ok = "_step IS NOT NULL" if "_step" in have else "false"

    def select(where: str, meta: tuple[str, ...], drop: str) -> str:
        cols = [own_rank.format(f=_FILE_RANK) + " AS _rank", f"{_FILE_STREAM} AS _stream"]
        cols += [_meta_expr(m, have) for m in meta]
        for k in keys:
            info = sample.get(k)
            if info is not None and info[drop] and not info["step" if drop == "rank" else "rank"]:
                continue  # only ever seen in the other kind of record
            cols.append(_column_expr(k, have[k], info))
        return f"SELECT {', '.join(cols)} FROM {source} WHERE {where} AND {step_ok}"

    return [
        f"CREATE VIEW metrics AS {select(kind_is, _ROW_META, 'rank')}",
        f"CREATE VIEW ranks AS {select(rank_kind, _ROW_META + _RANK_META, 'step')}",
    ]


def _fixed_view(name: str, files: list[str], columns: dict[str, str], first: str) -> str:
    """A view over JSONL files with known columns; empty when there is no file."""
    if not files:
        cols = ", ".join(f"NULL::{t} AS {ident(c)}" for c, t in columns.items())
        return f"CREATE VIEW {name} AS SELECT {cols} LIMIT 0"
    spec = "{" + ", ".join(f"{literal(c)}: {literal(t)}" for c, t in columns.items()) + "}"
    return (f"CREATE VIEW {name} AS SELECT * FROM read_json({_file_list(files)}, "
            f"format='newline_delimited', columns={spec}, ignore_errors=true, "
            f"maximum_object_size={MAX_OBJECT}) WHERE {ident(first)} IS NOT NULL")


@contextlib.contextmanager
def connect(run_dir: str | os.PathLike[str], memory_limit: str = DEFAULT_MEMORY) -> Iterator[Any]:
    """An in-memory, locked-down DuckDB connection with the run's views, using at most
    `memory_limit` of memory (beyond it, sorts and joins spill to a temporary directory
    and what cannot spill fails with QueryMemory)."""
    duckdb = need_duckdb()
    run = Path(run_dir).resolve()
    # `run` is resolved: a shard's own path is its real one unless it is a symlink (and
    # resolving 4,096 paths costs more than the views' 64-shard detection)
    shard_files = [str(s.path.resolve() if s.path.is_symlink() else s.path)
                   for s in run_shards(run, ALL_STREAMS)]
    alert_files = sorted(str(p.resolve()) for p in run.iterdir()
                         if _ALERTS_RE.match(p.name) and p.is_file())
    incidents = run / "incidents.jsonl"
    incident_files = [str(incidents)] if incidents.is_file() else []
    spill = tempfile.mkdtemp(prefix="expr-query-")
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"SET temp_directory = {literal(spill)}")
        con.execute(f"SET memory_limit = {literal(check_memory(memory_limit))}")
        con.execute("SET enable_progress_bar = false")  # DuckDB draws it on stdout
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        allowed = [*shard_files, *alert_files, *incident_files]
        con.execute(f"SET allowed_paths = {_file_list(allowed)}")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        try:
            statements = _shard_views(con, shard_files)
            statements.append(_fixed_view("alerts", alert_files, ALERT_COLUMNS, "time"))
            statements.append(_fixed_view("incidents", incident_files, INCIDENT_COLUMNS, "kind"))
            for sql in statements:
                con.execute(sql)
        except duckdb.Error as exc:  # reading the files' schema can hit the memory limit too
            raise query_error(exc) from None
        yield con
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)


def first_line(exc: BaseException) -> str:
    """DuckDB's message on one line (its errors add the query and a caret below)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def run_query(con: Any, sql: str) -> Any:
    """Run one read-only statement; the DuckDB result (`description`, `fetchmany`)."""
    duckdb = need_duckdb()
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise query_error(exc) from None
    if len(statements) != 1:
        raise QueryError(f"expected one SQL statement, got {len(statements)}")
    kind = getattr(statements[0].type, "name", str(statements[0].type))
    if kind not in READ_ONLY_TYPES:
        raise QueryError(f"only SELECT queries run here (read-only), not {kind}")
    try:
        return con.execute(sql)
    except duckdb.Error as exc:
        raise query_error(exc) from None
