"""SQL over a run with DuckDB (`expr query`): read-only views over the JSONL files, in place.

Views (DESIGN 15):

- `metrics`: the step rows of every shard of every stream, with `_rank` (the row's own
  `_rank` in a shared `rank_aware=False` file, else the rank in the file name), `_stream`
  (from the file name, NULL for the default stream), `_step`, `_time` and one column per key.
  The rank and stream of a row come from its file's position in the file list
  (DuckDB's `file_index`, arithmetic over a CASE branch per run of consecutive ranks),
  or, on a DuckDB without `file_index`, from a join of its path to a small table
  (`_expr_shards`: file, rank, stream); not from regexes over every row's path.
- `ranks`: the rank records (`log_rank_metrics`), with `_rank` (the record's own),
  `_stream`, `_step`, `_time`, `_world_size`, `_local_rank`, `_weight` and the keys.
- `alerts`: every `alerts[.rankN].jsonl` line; `incidents`: `incidents.jsonl` (DESIGN 13),
  an empty view with the same columns when the file does not exist.

DuckDB infers the columns and their types (`union_by_name`), over every file in a run of at
most EXACT_SHARDS shards. Detection costs DuckDB a fixed ~0.2 ms per file, several times the
scan itself at thousands of ranks, so in a bigger run it detects over a sample of the shards
(each stream's first shard plus up to SAMPLE_SHARDS spread over the ranks, the files the
key sample below reads) and the views read every shard with that schema given (`columns`;
on DuckDB 2.0 each line as JSON text typed by `json_transform`, see `_given_source`): a
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
import json
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
from expr_tracker.store.runread import ALL_STREAMS, RunShard, run_shards
from expr_tracker.views import duckcopy

SAMPLE_SHARDS = 64
EXACT_SHARDS = 256  # up to this many shards DuckDB detects the columns over every one
TRANSFORM_SCAN = True  # on DuckDB 2.0, a big run's shards as JSON text typed once (_given_source)
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
# each shard's file -> its rank and stream (from its name), joined to every row by the
# row's file (DuckDB's `_file` column); the variable holds the files the views read
SHARD_TABLE = "_expr_shards"
SHARD_VAR = "expr_shard_files"


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


def detect_sample(shard_files: list[str], streams: list[str | None] | None = None) -> list[str]:
    """The shards DuckDB detects the columns over: every one in a run of at most
    EXACT_SHARDS shards, else each stream's first shard and the key sample's shards
    (`streams`: each file's stream, default from its name)."""
    if len(shard_files) <= EXACT_SHARDS:
        return shard_files
    if streams is None:
        parsed = [parse_shard_name(Path(p).name) for p in shard_files]
        streams = [p.stream if p is not None else None for p in parsed]
    picked = dict.fromkeys(_spread(shard_files))
    seen: set[str | None] = set()
    # sorted by stream then rank: the first of a stream is its lowest rank
    for p, stream in zip(shard_files, streams, strict=True):
        if stream not in seen:
            seen.add(stream)
            picked[p] = None
    order = {p: i for i, p in enumerate(shard_files)}
    return sorted(picked, key=order.__getitem__)


_NOT_AN_OBJECT = re.compile(rb"(?:^|\n)[ \t\r]*[^{\s]")  # a line that does not start an object


def head(path: str | os.PathLike[str]) -> bytes | None:
    """The first SAMPLE_BYTES of a shard; None when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read(SAMPLE_BYTES)
    except OSError:
        return None


def records_only(path: str, data: bytes | None = None) -> bool:
    """No line in the first SAMPLE_BYTES of `path` (`data`: those bytes, already read) is
    JSON that is not an object (`5`, `[1, 2]`, `"x"`: a foreign or broken writer's).
    DuckDB's detection reads a file with such a line as a file of values, and the views
    over it would have no `_step` at all; a torn or garbled line is fine (it is an error
    DuckDB skips)."""
    if data is None:
        data = head(path)
    if data is None:
        return True  # DuckDB will say what is wrong with it
    starts = data.count(b"\n") + (0 if data.endswith(b"\n") else 1) if data else 0
    if (data[:1] == b"{") + data.count(b"\n{") == starts:
        return True  # every line starts with "{" (the usual case: two counts in C)
    if not _NOT_AN_OBJECT.search(data):
        return True  # every line starts an object, after spaces (the regex: 1 ms a head)
    for _, line in records.iter_lines(data):
        if line.strip() and not line.lstrip().startswith(b"{"):
            try:
                json.loads(line)
            except ValueError:
                continue  # not JSON at all: an error DuckDB skips
            return False
    return True


def sample_keys(paths: list[Path], heads: dict[str, bytes | None] | None = None
                ) -> dict[str, dict[str, Any]]:
    """key -> {"step": seen in step rows, "rank": seen in rank records, "numeric": bool}
    from the first SAMPLE_BYTES of up to SAMPLE_SHARDS shards spread over the run
    (`heads`: path -> those bytes, when the caller read them already)."""
    paths = _spread(paths)
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        data = heads[str(path)] if heads is not None and str(path) in heads else head(path)
        if data is None:
            continue
        whole = data[:data.rfind(b"\n") + 1]
        recs = records.loads_block(whole) if whole else []
        if recs is None:  # a torn or foreign line: line by line
            recs = []
            for _, line in records.iter_lines(whole):
                try:
                    recs.append(records.loads(line))
                except ValueError:
                    continue
        elif b'"NaN"' in whole or b'Infinity"' in whole or b"\\u" in whole:
            recs = [records.decode_nonfinite(r) for r in recs]
        for rec in recs:
            if type(rec) is not dict:
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
    src = "j." + col
    numeric = _numeric(sample)
    if numeric and dtype == "JSON":
        return f"TRY_CAST({src} ->> '$' AS DOUBLE) AS {col}"
    if numeric and dtype not in _NUMERIC_TYPES:
        # VARCHAR, or a type DuckDB guessed from the strings alone: a key that is only
        # ever "Infinity" reads as DATE 'infinity' (9999-12-31 in Python); its text is
        # "infinity", which casts to the float
        cast = src if dtype == "VARCHAR" else f"CAST({src} AS VARCHAR)"
        return f"TRY_CAST({cast} AS DOUBLE) AS {col}"
    return f"{src} AS {col}"


def _meta_expr(name: str, have: dict[str, str]) -> str:
    t = _META_TYPES[name]
    if name not in have:
        return f"NULL::{t} AS {ident(name)}"
    return f"TRY_CAST(j.{ident(name)} AS {t}) AS {ident(name)}"


def _shard_table(con: Any, shards: list[RunShard], shard_files: list[str], *, table: bool,
                 lists: bool) -> None:
    """What the views read besides the files (SHARD_VAR, their list, is set before):
    with `lists`, `expr_shard_ranks` and `expr_shard_streams` (each file's, for a lookup
    by `file_index`); with `table`, the table SHARD_TABLE (file -> rank, stream) that a
    DuckDB without `file_index` joins each row to by its path (two symlinks to one file:
    read twice, with the first's rank). Each only when used: at 16,384 shards the three
    cost 0.1 s.

    A variable instead of a list literal in each view saves DuckDB binding thousands of
    constants at every query.
    """
    if table:
        first: dict[str, RunShard] = {}
        for shard, path in zip(shards, shard_files, strict=True):
            first.setdefault(path, shard)
        con.execute(f"CREATE TABLE {SHARD_TABLE} (_file VARCHAR, _rank BIGINT, _stream VARCHAR)")
        con.execute(f"INSERT INTO {SHARD_TABLE} SELECT unnest(?), unnest(?), unnest(?)",
                    [list(first), [s.rank for s in first.values()],
                     [s.stream for s in first.values()]])
    if lists:
        con.execute("SET VARIABLE expr_shard_ranks = ?::BIGINT[]", [[s.rank for s in shards]])
        con.execute("SET VARIABLE expr_shard_streams = ?::VARCHAR[]",
                    [[s.stream for s in shards]])


def _shard_views(con: Any, shards: list[RunShard], shard_files: list[str] | None = None
                 ) -> list[str]:
    """CREATE VIEW statements for `metrics` and `ranks` over `shards` (read through
    `shard_files`, their paths as DuckDB opens them; default each shard's own path)."""
    if not shards:
        empty = ", ".join(f"NULL::{_META_TYPES[c]} AS {c}" for c in ("_rank", *_ROW_META))
        return [f"CREATE VIEW metrics AS SELECT {empty}, NULL::VARCHAR AS _stream LIMIT 0",
                f"CREATE VIEW ranks AS SELECT {empty}, NULL::VARCHAR AS _stream LIMIT 0"]
    if shard_files is None:
        shard_files = [str(s.path) for s in shards]
    con.execute(f"SET VARIABLE {SHARD_VAR} = ?", [shard_files])
    options = f"filename='_file', ignore_errors=true, maximum_object_size={MAX_OBJECT}"
    detect = detect_sample(shard_files, [s.stream for s in shards])
    # the detection's files hold the key sample's: each file's head read once for both
    heads = {p: head(p) for p in detect}
    # a file DuckDB would read as bare values gives no columns: read it with the others'
    detect = [p for p in detect if records_only(p, heads[p])] or detect
    source = (f"read_json({_file_list(detect)}, format='newline_delimited', "
              f"union_by_name=true, {options})")
    described = con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()
    have = {row[0]: row[1] for row in described}
    # each row's shard: its position in the file list (DuckDB >= 1.3), else a join by path
    by_index = "file_index" not in have and _has_file_index(con, shard_files[0])
    files = f"getvariable({literal(SHARD_VAR)})"
    sample = sample_keys([Path(p) for p in _spread(shard_files)], heads)
    if len(detect) < len(shard_files):
        given = {c: t for c, t in have.items() if c != "_file"}
        source, step_source, read_as = _given_source(con, files, given, options, by_index,
                                                     sample)
        have.update(read_as)
    else:
        source = f"read_json({files}, format='newline_delimited', union_by_name=true, {options})"
        step_source = source
    keys = [k for k in have if k[:1] != "_"]
    kind_is = "j._kind IS NULL" if "_kind" in have else "true"
    rank_kind = "j._kind = 'rank'" if "_kind" in have else "false"
    step_ok = "j._step IS NOT NULL" if "_step" in have else "false"
    file_rank, file_stream = duckcopy.file_exprs(shards, "expr_shard")
    _shard_table(con, shards, shard_files, table=not by_index,
                 lists=by_index and "getvariable(" in file_rank)
    if not by_index:
        join = f" AS j JOIN {SHARD_TABLE} AS f ON j._file = f._file"
        source, step_source = source + join, step_source + join
        file_rank, file_stream = "f._rank", "f._stream"
    else:
        source, step_source = source + " AS j", step_source + " AS j"
    rank = (f"coalesce(TRY_CAST(j._rank AS BIGINT), {file_rank})" if "_rank" in have
            else file_rank)

    def select(source: str, where: str, meta: tuple[str, ...], drop: str) -> str:
        cols = [f"{rank} AS _rank", f"{file_stream} AS _stream"]
        cols += [_meta_expr(m, have) for m in meta]
        for k in keys:
            info = sample.get(k)
            if info is not None and info[drop] and not info["step" if drop == "rank" else "rank"]:
                continue  # only ever seen in the other kind of record
            cols.append(_column_expr(k, have[k], info))
        return f"SELECT {', '.join(cols)} FROM {source} WHERE {where} AND {step_ok}"

    return [
        f"CREATE VIEW metrics AS {select(step_source, kind_is, _ROW_META, 'rank')}",
        f"CREATE VIEW ranks AS {select(source, rank_kind, _ROW_META + _RANK_META, 'step')}",
    ]


def _given_source(con: Any, files: str, given: dict[str, str], options: str, by_index: bool,
                  sample: dict[str, dict[str, Any]]) -> tuple[str, str, dict[str, str]]:
    """The scan of every shard with the columns `given` (name -> DuckDB type), the same
    for the step rows (`metrics`: it may leave out lines that are rank records by their
    text, `duckcopy.NOT_RANK_LINE`), and the keys it reads as another type than given
    (name -> type).

    DuckDB 2.0 binds `read_json` again for each file of a list, parsing the type of every
    column of `columns` with its SQL parser each time: ~0.15 ms a file for a handful of
    columns, 0.6-0.9 s of CPU over 4,096 shards where the same bytes in one file take
    0.15-0.25 s (and DuckDB 1.4 about 0.45 s). Its `read_ndjson_objects` binds once
    per file without types, so on 2.0 each line is read as JSON text and `json_transform`
    types it with the same rules (`tests/test_views_schema.py` compares both on every
    kind of value): about a third less CPU. A JSON key that the view casts to DOUBLE
    anyway (numbers and the NaN/Infinity strings) is read as text, the same text
    `->> '$'` gives, without writing each value back as JSON. On 1.x, or if this
    DuckDB refuses the structure, `read_json` with `columns`.
    """
    spec = ", ".join(f"{literal(c)}: {literal(t)}" for c, t in given.items())
    plain = f"read_json({files}, format='newline_delimited', columns={{{spec}}}, {options})"
    if not TRANSFORM_SCAN or _duckdb_major() < 2:
        return plain, plain, {}
    duckdb = need_duckdb()
    read_as = {k: "VARCHAR" for k, t in given.items()
               if t == "JSON" and k[:1] != "_" and _numeric(sample.get(k))}
    structure = literal(json.dumps({**given, **read_as}))
    index = "file_index, " if by_index else ""
    objects = f"read_ndjson_objects({files}, {options})"
    source = duckcopy.transformed(f"{index}_file", structure, objects)
    try:
        con.execute(f"SELECT * FROM {source} LIMIT 0")
    except duckdb.Error:
        return plain, plain, {}
    steps = duckcopy.transformed(f"{index}_file", structure, objects, duckcopy.NOT_RANK_LINE)
    return source, steps, read_as


def _numeric(sample: dict[str, Any] | None) -> bool:
    """Whether the key sample saw only numbers (NaN/Infinity strings decoded) for a key."""
    return sample is not None and bool(sample["seen"]) and bool(sample["numeric"])


def _duckdb_major() -> int:
    version = getattr(need_duckdb(), "__version__", "0")
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def _has_file_index(con: Any, path: str) -> bool:
    """Whether this DuckDB's file readers have the `file_index` column (1.3 on)."""
    duckdb = need_duckdb()
    try:
        con.execute(f"SELECT file_index FROM read_json({literal(path)}, "
                    "columns={'_step': 'BIGINT'}) LIMIT 0")
    except duckdb.Error:
        return False
    return True


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
    shards = run_shards(run, ALL_STREAMS)
    shard_files = [str(s.path.resolve() if s.path.is_symlink() else s.path) for s in shards]
    # names first: a Path for each of 32,768 entries (16,384 ranks) cost 0.1 s
    alert_files = sorted(str((run / name).resolve()) for name in os.listdir(run)
                         if _ALERTS_RE.match(name) and (run / name).is_file())
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
        # through a variable: a list literal of thousands of paths costs DuckDB ~0.1 s to bind
        con.execute("SET VARIABLE expr_allowed_paths = ?", [allowed])
        con.execute("SET allowed_paths = getvariable('expr_allowed_paths')")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        try:
            statements = _shard_views(con, shards, shard_files)
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
