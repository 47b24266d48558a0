"""`expr export --format parquet` through DuckDB: export's own columns, DuckDB's scan and writer.

Parquet export needs each column's type before the first row, decided over the whole run
(`RunReader.columns()`: int64 only when every value is an integer, float64 for numbers with
"NaN"/"Infinity" strings, a mixed key as JSON text, strings never sniffed as dates).
DuckDB's own detection differs on each of these, so the first pass stays in Python
(`firstpass`, split over two processes by `scan`): it finds the same columns as
`RunReader.columns()` (a test compares them) and notes anything DuckDB would read
differently from `RunReader`:

- a block that orjson does not take as whole objects (a torn, blank or foreign line, a
  bare NaN token: `RunReader` goes line by line there) or an unterminated last line;
- a `_step`, `_rank`, `_time` (or a rank record's `_world_size`, `_local_rank`, `_weight`)
  of a type `RunReader` does not take, or a non-text `_kind`: DuckDB would cast 3.0 or
  "3" to a step where the reader skips the row;
- a key whose values mix types (a JSON-text column), an integer beyond int64;
- a metric filter (`--metric`) over a key present with null (DuckDB cannot tell it from
  absent), a rank or step filter.

When there is none, DuckDB reads every shard with exactly those columns given
(no detection: on DuckDB 2.0 each line's JSON text typed by `json_transform`, else
`read_json(columns=...)`, see `transform_scan`), each row's rank and stream come from its
file's position in the list (`file_index`, DuckDB 1.3 on), and `COPY ... TO` writes the
parquet file, in the shards' order. Any DuckDB error (a
duplicate key in a line, a value that does not cast in a record that is not exported, a
file that changed meanwhile) drops its output and the rows are written by the Python
path, with the columns already found. A line appended between the two passes is in the
rows but not in the column types, as on the Python path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.optional import importable
from expr_tracker.store.runread import RESERVED_KINDS, RunReader, RunShard
from expr_tracker.views.firstpass import MAX_OBJECT, Scan, merge_parts, scan_part

_SQL_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "str": "VARCHAR"}


PARALLEL_SHARDS = 512  # from this many shards a second process reads the last 45% of them


def _start_part(shards: list[RunShard], offset: int, want: str | None,
                metrics: list[str] | None) -> Any:
    """A `python -c` process scanning `shards` (a plain child, not multiprocessing: that
    would import the caller's __main__ again); None when it cannot start."""
    import subprocess

    job = orjson.dumps({"shards": [[str(s.path), s.stream, s.rank] for s in shards],
                        "offset": offset, "want": want, "metrics": metrics})
    root = str(Path(__file__).resolve().parents[2])  # where this expr_tracker is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from expr_tracker.views.duckcopy import _part_main; _part_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    except OSError:
        return None
    assert proc.stdin is not None
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except OSError:
        proc.kill()
        proc.wait()
        return None
    return proc


def _finish_part(proc: Any) -> Scan | None:
    """The helper's Scan, or None when it failed (the caller reads that half itself)."""
    if proc is None:
        return None
    try:
        data = proc.stdout.read()
    finally:
        proc.stdout.close()
        code = proc.wait()
    if code != 0:
        return None
    try:
        got = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    part = Scan()
    part.kinds = dict(got["kinds"])
    part.rows, part.garbage = got["rows"], got["garbage"]
    part.keys_twice = bool(got["keys_twice"])
    part.python = {int(i): why for i, why in got["python"]}
    return part


def _part_main() -> None:
    """The helper process: a job on stdin, its Scan on stdout (JSON)."""
    job = orjson.loads(sys.stdin.buffer.read())
    shards = [RunShard(Path(p), stream, rank) for p, stream, rank in job["shards"]]
    part = scan_part(shards, job["offset"], job["want"], job["metrics"])
    sys.stdout.buffer.write(orjson.dumps({
        "kinds": list(part.kinds.items()), "rows": part.rows, "garbage": part.garbage,
        "python": list(part.python.items()), "keys_twice": part.keys_twice}))


def _helpers() -> int:
    from expr_tracker.stats.parallel import cpus_here

    return (cpus_here() or 1) - 1


def scan(reader: RunReader) -> Scan:
    """One pass over the run: its columns (as `reader.columns()`), and whether DuckDB can
    write its rows exactly. Sets `reader.garbage` as a pass of the reader does. A run of
    PARALLEL_SHARDS shards or more is read by this process and a spawned one, a half
    each, when there is a second core (only the small answers cross between them)."""
    if reader.ranks is not None or reader.step_range != (None, None):
        out = Scan()
        out.flag_run("a rank or step filter")
        out.columns = reader.columns()
        return out
    want = "rank" if reader.rank_records else None
    shards = reader.shards
    if len(shards) >= PARALLEL_SHARDS and _helpers() > 0:
        # the helper takes a little less: it starts (Python, the imports) ~0.1 s later
        half = len(shards) * 11 // 20
        child = _start_part(shards[half:], half, want, reader.metrics)
        out = scan_part(shards[:half], 0, want, reader.metrics)
        available()  # imported while the helper finishes its part
        second = _finish_part(child)
        if second is None:  # the helper failed: this process reads its half too
            second = scan_part(shards[half:], half, want, reader.metrics)
        out = merge_parts(out, second)
    else:
        out = scan_part(shards, 0, want, reader.metrics)
    if reader.metrics is not None and any(k[:1] == "_" for k in reader.metrics):
        out.flag_run("a --metric that is a reserved field")
    reader.garbage = out.garbage
    kinds = out.kinds
    if reader.metrics is not None:
        kinds = {k: kinds[k] for k in reader.metrics if k in kinds}
    if any(v == "json" for v in kinds.values()):
        out.flag_run("a key whose values mix types (JSON text)")
    out.columns = {k: RESERVED_KINDS[k] for k in reader.reserved}
    out.columns.update((k, v or "str") for k, v in kinds.items())
    return out


def installed() -> bool:
    """Whether DuckDB looks importable, without importing it: the first pass starts
    first, and `scan` imports DuckDB (0.13 s of CPU) while its helper process finishes."""
    return importable("duckdb")


def available() -> Any:
    """`duckdb`, or None when it is not installed (the Python path writes then)."""
    try:
        import duckdb
    except ImportError:
        return None
    return duckdb


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _segments(shards: list[RunShard]) -> list[tuple[int, int, int, str | None]]:
    """(first file index, last + 1, rank of the first, stream) of each run of shards whose
    ranks go up by one in one stream: one for each stream of a run with every rank."""
    segs: list[tuple[int, int, int, str | None]] = []
    for i, shard in enumerate(shards):
        if segs:
            start, end, rank, stream = segs[-1]
            if stream == shard.stream and shard.rank == rank + (end - start):
                segs[-1] = (start, end + 1, rank, stream)
                continue
        segs.append((i, i + 1, shard.rank, shard.stream))
    return segs


MAX_SEGMENTS = 32  # beyond, each row looks its file's rank and stream up in a list


def file_exprs(shards: list[RunShard], prefix: str = "expr_export") -> tuple[str, str]:
    """SQL for the rank and the stream of a row's shard, from DuckDB's `file_index` (the
    position of the row's file in the list): arithmetic over a few CASE branches, not a
    join (a hash join loses the rows' order) nor a regex over every row's path. With
    many segments, a lookup in the lists `{prefix}_ranks` and `{prefix}_streams`
    (DuckDB variables the caller sets). A key named file_index hides the column: the
    caller does not use this then."""
    segs = _segments(shards)
    idx = "file_index::BIGINT"
    if len(segs) > MAX_SEGMENTS:
        return (f"getvariable('{prefix}_ranks')[{idx} + 1]",
                f"getvariable('{prefix}_streams')[{idx} + 1]")

    def stream_sql(stream: str | None) -> str:
        return "NULL::VARCHAR" if stream is None else _literal(stream)

    if len(segs) == 1:
        start, _, rank, stream = segs[0]
        return f"({idx} + {rank - start})", stream_sql(stream)
    ranks = " ".join(f"WHEN {idx} < {end} THEN {idx} + {rank - start}"
                     for start, end, rank, _ in segs[:-1])
    streams = " ".join(f"WHEN {idx} < {end} THEN {stream_sql(stream)}"
                       for _, end, _, stream in segs[:-1])
    last = segs[-1]
    return (f"(CASE {ranks} ELSE {idx} + {last[2] - last[0]} END)",
            f"(CASE {streams} ELSE {stream_sql(last[3])} END)")


TRANSFORM_SCAN = True  # on DuckDB 2.0, each line as JSON text typed by json_transform


def transform_scan(first: Scan) -> bool:
    """Whether DuckDB is to read the rows as JSON text typed once by `json_transform`
    (DuckDB 2.0 on, and no line that may name a key twice), not by `read_json` with
    `columns`.

    DuckDB 2.0 binds `read_json` again for each file of a list, parsing the type of every
    entry of `columns` each time (see `views.sql._given_source`): over 4,096 shards that
    was most of the export's DuckDB pass, 2.3-3.1 s of CPU against 1.1-1.6 s for the same
    COPY through `read_ndjson_objects` and `json_transform`. Both type a value with the
    same code; they differ where a line names a key twice (`read_json` refuses the line,
    `json_transform` keeps the first value, orjson the last) and where a value does not
    cast (`read_json` refuses, `json_transform` gives NULL): the first pass saw every
    exported value's type, so only records that are not exported can hold such a value,
    and the rows are the same (`tests/test_export_duckdb.py` compares both scans).
    """
    if not TRANSFORM_SCAN or first.keys_twice:
        return False
    duckdb = available()
    try:
        return int(getattr(duckdb, "__version__", "0").split(".")[0]) >= 2
    except ValueError:
        return False


# A line that starts so is a rank record as DuckDB reads it (`json_transform` takes a
# key's first value), never a step row; the SDK writes `_kind` first. Left out before
# the transform, a scan of the step rows skips parsing them (half the lines of a run
# that logs rank records). A rank record written otherwise is parsed and filtered out.
NOT_RANK_LINE = """NOT starts_with(json, '{"_kind":"rank",')"""


def transformed(keep: str, structure: str, objects: str, where: str | None = None) -> str:
    """A subquery of the columns `keep` of the table function `objects` (a row of JSON
    text per line, column `json`) and the fields of each line typed by `json_transform`
    to `structure` (SQL text of a JSON structure).

    The struct goes through `unnest` of a one-element list: DuckDB pushes a filter on
    its fields (`_kind IS NULL AND _step IS NOT NULL`) below a plain projection, and there
    rewrites each field as `struct_extract(json_transform(json, ...))`, transforming
    every line up to three times (0.8 s more CPU over 4,096 shards: a third of the scan);
    it does not push a filter below an UNNEST (`OFFSET 0` fences too, but DuckDB then
    scans on one thread). `where`: a filter on the line's text
    (`json`), before any transform.
    """
    cond = f" WHERE {where}" if where else ""
    return (f"(SELECT {keep}, unnest(s) FROM (SELECT {keep}, unnest([json_transform(json, "
            f"{structure})]) AS s FROM {objects}{cond}))")


def select_sql(reader: RunReader, shards: list[RunShard], columns: dict[str, str],
               transform: bool = False) -> str:
    """The SELECT of the rows of `shards` with `columns`, in their order, reading the
    files of the variable `expr_export_files` (set by `_set_files`), by `read_json` with
    the columns given, or with `transform` by `json_transform` over each line's text."""
    rank_records = reader.rank_records
    spec = {"_kind": "VARCHAR", "_step": "BIGINT", "_rank": "BIGINT", "_time": "DOUBLE"}
    if rank_records:
        spec.update(_world_size="BIGINT", _local_rank="BIGINT", _weight="DOUBLE")
    keys = [k for k in columns if k not in RESERVED_KINDS]
    spec.update((k, _SQL_TYPES[columns[k]]) for k in keys)
    file_rank, file_stream = file_exprs(shards)
    cols = [f'CASE WHEN "_rank" >= 0 THEN "_rank" ELSE {file_rank} END AS "_rank"',
            f'{file_stream} AS "_stream"', '"_step"', '"_time"']
    if rank_records:
        cols += ['"_world_size"', '"_local_rank"', '"_weight"']
    cols += [_ident(k) for k in keys]
    where = ["_kind = 'rank'" if rank_records else "_kind IS NULL", "_step IS NOT NULL"]
    if reader.metrics is not None:
        present = [f"{_ident(k)} IS NOT NULL" for k in dict.fromkeys(reader.metrics) if k in keys]
        where.append("(" + (" OR ".join(present) or "false") + ")")
    files = f"getvariable('expr_export_files'), maximum_object_size={MAX_OBJECT}"
    if transform:
        source = transformed("file_index", _literal(json.dumps(spec)), f"read_ndjson_objects({files})",
                             None if rank_records else NOT_RANK_LINE)
    else:
        struct = "{" + ", ".join(f"{_literal(k)}: {_literal(t)}" for k, t in spec.items()) + "}"
        source = f"read_json({files}, format='newline_delimited', columns={struct})"
    return f"SELECT {', '.join(cols)} FROM {source} WHERE {' AND '.join(where)}"


def plan(reader: RunReader, first: Scan) -> list[tuple[bool, list[RunShard]]] | None:
    """(by DuckDB, shards) groups of consecutive shards, in order; None when the Python
    path is to write every row (a problem of the whole run, or too many groups)."""
    if first.problem is not None or available() is None or "file_index" in first.columns:
        return None
    groups: list[tuple[bool, list[RunShard]]] = []
    for i, shard in enumerate(reader.shards):
        duck = i not in first.python
        if groups and groups[-1][0] == duck:
            groups[-1][1].append(shard)
        else:
            groups.append((duck, [shard]))
    if sum(1 for duck, _ in groups if duck) > MAX_GROUPS or not any(d for d, _ in groups):
        return None
    return groups


MAX_GROUPS = 16  # DuckDB queries per export: more (shards to read in Python between) and
# the Python path writes it all


def _set_files(con: Any, shards: list[RunShard]) -> None:
    """The variables `select_sql` reads: the files, and each one's rank and stream (for
    `file_exprs`' lookup)."""
    con.execute("SET VARIABLE expr_export_files = ?", [[str(s.path) for s in shards]])
    con.execute("SET VARIABLE expr_export_ranks = ?::BIGINT[]", [[s.rank for s in shards]])
    con.execute("SET VARIABLE expr_export_streams = ?::VARCHAR[]", [[s.stream for s in shards]])


def duck_batches(con: Any, reader: RunReader, shards: list[RunShard], columns: dict[str, str],
                 batch_rows: int, transform: bool = False) -> Any:
    """Arrow RecordBatches of the rows of `shards`, read by DuckDB on `con`."""
    _set_files(con, shards)
    duckdb = available()
    try:
        rel = con.sql(select_sql(reader, shards, columns, transform))
        stream = (rel.to_arrow_reader(batch_rows) if hasattr(rel, "to_arrow_reader")
                  else rel.fetch_arrow_reader(batch_rows))  # DuckDB < 1.4
        it = iter(stream)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch
    except duckdb.Error as exc:
        raise Refused(str(exc)) from None
    except OSError as exc:  # DuckDB's error, through the Arrow stream
        raise Refused(str(exc)) from None


def copy_parquet(con: Any, reader: RunReader, columns: dict[str, str], out: Path,
                 row_group: int, transform: bool = False) -> int:
    """Every row written by DuckDB's own `COPY ... TO` (parallel, no Arrow in between),
    when DuckDB reads every shard: the number of rows. Refused when DuckDB refuses."""
    duckdb = available()
    try:
        _set_files(con, reader.shards)
        sql = select_sql(reader, reader.shards, columns, transform)
        row = con.execute(f"COPY ({sql}) TO {_literal(str(out))} "
                          f"(FORMAT parquet, ROW_GROUP_SIZE {int(row_group)})").fetchone()
    except duckdb.Error as exc:
        raise Refused(str(exc)) from None
    return int(row[0]) if row else 0


class Refused(Exception):
    """DuckDB would not read the rows (a line with a duplicate key, a value that does
    not cast); the Python path writes them instead."""


@contextlib.contextmanager
def connect(memory_limit: str = "25%") -> Iterator[Any]:
    """An in-memory DuckDB connection for the scan: rows in file order, a bounded memory
    and a spill directory of its own, no extension loaded."""
    duckdb = available()
    spill = tempfile.mkdtemp(prefix="expr-export-")
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"SET temp_directory = {_literal(spill)}")
        con.execute(f"SET memory_limit = {_literal(memory_limit)}")
        con.execute("SET enable_progress_bar = false")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET preserve_insertion_order = true")  # rows in the shards' order
        yield con
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)
