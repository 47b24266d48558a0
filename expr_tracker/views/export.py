"""A whole run as one table: `et.read_run` (pandas, Arrow) and the writers of `expr export`.

Every writer streams `RunReader` batches (memory bounded by the batch size) into a temp
file beside the output and renames it into place at the end, so a failure never leaves a
half-written file under the output's name. Parquet and CSV need the columns first:
`RunReader.columns()` is a first pass over the run, the rows are the second. Parquet,
when DuckDB is installed, takes its first pass from `duckcopy.scan` (the same columns)
and lets DuckDB read the rows of every shard it reads exactly as `RunReader` does.

Column types (parquet, Arrow, pandas): `_rank`, `_step`, `_world_size`, `_local_rank` int64;
`_time`, `_weight` float64; `_stream` string; a metric key is int64 when every value is an
integer, float64 when every value is a number (NaN/Infinity included, stored as IEEE
floats), bool, string, or, for a key whose values mix types, a string holding each value's
JSON text. CSV writes non-finite floats as `NaN`, `Infinity`, `-Infinity`, booleans as
`true`/`false` and nulls as empty cells; JSONL rows are written as shards are (strict JSON).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from expr_tracker.errors import RunNotFoundError
from expr_tracker.optional import importable
from expr_tracker.outputs import output_kind
from expr_tracker.store import records
from expr_tracker.store.runread import ALL_STREAMS, BATCH_ROWS, RunReader

FORMATS = ("parquet", "csv", "jsonl")


def open_run(
    run: str | os.PathLike[str],
    *,
    stream: Any = ALL_STREAMS,
    rank_records: bool = False,
    metrics: Sequence[str] | str | None = None,
) -> RunReader:
    """A RunReader over a run directory (a shard file stands for its directory)."""
    path = Path(run)
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise RunNotFoundError(f"no run directory at {path}")
    if isinstance(metrics, str):
        metrics = [metrics]
    reader = RunReader(path, stream=stream, rank_records=rank_records, metrics=metrics)
    if not reader.shards:
        what = "" if stream is ALL_STREAMS else f" of stream {stream or '(default)'}"
        raise RunNotFoundError(f"no metrics*.jsonl shards{what} in {path}")
    return reader


def need_pyarrow() -> Any:
    """`pyarrow`, or ImportError naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise ImportError("needs pyarrow: pip install 'expr-tracker[export]'") from None
    return pyarrow


def have_pyarrow() -> bool:
    """Whether pyarrow can be imported, without importing it (0.15-0.2 s of CPU, which
    an export that DuckDB writes whole never needs)."""
    return importable("pyarrow")


def _json_text(v: Any) -> str | None:
    if v is None or type(v) is str:
        return v
    return orjson.dumps(records._finite_copy({"v": v})["v"]).decode()


def arrow_schema(columns: dict[str, str]) -> Any:
    """The Arrow schema of `RunReader.columns()`."""
    pa = need_pyarrow()
    types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string(),
             "json": pa.string()}
    return pa.schema([pa.field(k, types[kind]) for k, kind in columns.items()])


def arrow_batch(batch: list[dict[str, Any]], columns: dict[str, str], schema: Any) -> Any:
    """One Arrow RecordBatch of rows, with every column of `columns` (absent = null)."""
    pa = need_pyarrow()
    arrays = []
    for (key, kind), field in zip(columns.items(), schema, strict=True):
        values = [row.get(key) for row in batch]
        if kind == "json":
            values = [_json_text(v) for v in values]
        arrays.append(pa.array(values, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def iter_arrow(reader: RunReader, batch_rows: int = BATCH_ROWS,
               columns: dict[str, str] | None = None) -> tuple[Any, Iterator[Any]]:
    """(schema, iterator of RecordBatches) of the run; two passes over the files (one
    when `columns`, the first pass's answer, is given)."""
    if columns is None:
        columns = reader.columns()
    schema = arrow_schema(columns)
    return schema, (arrow_batch(b, columns, schema) for b in reader.batches(batch_rows))


@contextlib.contextmanager
def _atomic_output(out: Path, binary: bool) -> Iterator[tuple[Path, IO[Any]]]:
    """A temp file beside `out`, renamed to `out` only when the body finishes."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fh: IO[Any] = open(tmp, "wb") if binary else open(tmp, "w", newline="", encoding="utf-8")  # noqa: SIM115
    try:
        yield tmp, fh
        fh.close()
        os.replace(tmp, out)
    except BaseException:
        fh.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_parquet(reader: RunReader, out: str | os.PathLike[str], batch_rows: int = BATCH_ROWS,
                  engine: str = "auto") -> int:
    """Write the run as one parquet file (row groups of at most `batch_rows`); the number
    of rows.

    `engine` "auto": when DuckDB is installed, it scans the shards that it reads exactly
    as `RunReader` does (see `duckcopy`), `RunReader` the others; "python": `RunReader`
    all of them. Both give the same rows, columns and types.
    """
    if engine not in ("auto", "python"):
        raise ValueError(f"engine must be 'auto' or 'python', not {engine!r}")
    if not have_pyarrow():
        need_pyarrow()  # the ImportError naming the extra
    columns = None
    if engine == "auto":
        from expr_tracker.views import duckcopy

        if duckcopy.installed():
            first = duckcopy.scan(reader)
            columns = first.columns
            groups = duckcopy.plan(reader, first)
            if groups is not None:
                n = _write_parquet_duck(reader, Path(out), batch_rows, columns, groups,
                                        duckcopy.transform_scan(first))
                if n is not None:
                    reader.garbage = first.garbage
                    return n
    if columns is None:
        columns = reader.columns()
    schema = arrow_schema(columns)
    batches = (arrow_batch(b, columns, schema) for b in reader.batches(batch_rows))
    return _write_batches(Path(out), schema, batches)


def _write_batches(out: Path, schema: Any, batches: Iterator[Any]) -> int:
    import pyarrow.parquet as pq

    n = 0
    with _atomic_output(out, binary=True) as (_, fh):
        writer = pq.ParquetWriter(fh, schema)
        try:
            for batch in batches:
                writer.write_batch(batch)
                n += batch.num_rows
        finally:
            writer.close()
    return n


def _write_parquet_duck(reader: RunReader, out: Path, batch_rows: int, columns: dict[str, str],
                        groups: list[tuple[bool, list[Any]]], transform: bool) -> int | None:
    """The parquet file with DuckDB reading the groups it can; None (and no file) when
    DuckDB refused one, as it does a line with a duplicate key or a value that does not
    cast (in a record that is not exported)."""
    from expr_tracker.views import duckcopy

    duckdb = duckcopy.available()

    def python_batches(shards: list[Any]) -> Iterator[Any]:
        schema = arrow_schema(columns)
        batch: list[dict[str, Any]] = []
        for shard in shards:
            for row in reader._rows_of(shard):
                batch.append(row)
                if len(batch) >= batch_rows:
                    yield arrow_batch(batch, columns, schema)
                    batch = []
        if batch:
            yield arrow_batch(batch, columns, schema)

    def duck_rows(con: Any, shards: list[Any]) -> Iterator[Any]:
        # DuckDB streams a small batch per file: gathered into batches of batch_rows
        # rows (a row group each, as on the Python path), cast to the schema once each
        pa = need_pyarrow()
        schema = arrow_schema(columns)
        held: list[Any] = []
        rows = 0
        for batch in duckcopy.duck_batches(con, reader, shards, columns, batch_rows, transform):
            held.append(batch)
            rows += batch.num_rows
            if rows >= batch_rows:
                table = pa.Table.from_batches(held).cast(schema).combine_chunks()
                for start in range(0, rows - batch_rows + 1, batch_rows):
                    yield from table.slice(start, batch_rows).to_batches()
                done = rows - rows % batch_rows
                held = table.slice(done).to_batches() if done < rows else []
                rows -= done
        if rows:
            yield from pa.Table.from_batches(held).cast(schema).combine_chunks().to_batches()

    def batches(con: Any) -> Iterator[Any]:
        for duck, shards in groups:
            yield from duck_rows(con, shards) if duck else python_batches(shards)

    try:
        with duckcopy.connect() as con:
            if len(groups) == 1 and groups[0][0]:
                with _atomic_output(out, binary=True) as (tmp, fh):
                    fh.close()  # DuckDB writes the file itself
                    return duckcopy.copy_parquet(con, reader, columns, tmp, batch_rows, transform)
            return _write_batches(out, arrow_schema(columns), batches(con))
    except (duckdb.Error, duckcopy.Refused):
        return None


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    t = type(v)
    if t is float:
        if not math.isfinite(v):
            return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
        return repr(v)
    if t is bool:
        return "true" if v else "false"
    if t in (int, str):
        return v
    return _json_text(v)


def write_csv(reader: RunReader, out: str | os.PathLike[str], batch_rows: int = BATCH_ROWS) -> int:
    """Write the run as one CSV file with a header row; the number of rows."""
    columns = list(reader.columns())
    n = 0
    with _atomic_output(Path(out), binary=False) as (_, fh):
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(columns)
        for batch in reader.batches(batch_rows):
            writer.writerows([_csv_cell(row.get(c)) for c in columns] for row in batch)
            n += len(batch)
    return n


def write_jsonl(reader: RunReader, out: str | os.PathLike[str], batch_rows: int = BATCH_ROWS) -> int:
    """Write the run as JSON lines (one pass); the number of rows."""
    n = 0
    with _atomic_output(Path(out), binary=True) as (_, fh):
        for batch in reader.batches(batch_rows):
            fh.write(b"".join(records.dumps(row) for row in batch))
            n += len(batch)
    return n


WRITERS: dict[str, Callable[[RunReader, str | os.PathLike[str], int], int]] = {
    "parquet": write_parquet, "csv": write_csv, "jsonl": write_jsonl,
}


def read_run(
    run: str | os.PathLike[str],
    *,
    stream: Any = ALL_STREAMS,
    rank_records: bool = False,
    metrics: Sequence[str] | str | None = None,
    output_type: str = "pandas",
) -> Any:
    """Every rank's rows of a run as one table: pandas DataFrame, Arrow table or list of dicts."""
    output_type = output_kind(output_type)
    reader = open_run(run, stream=stream, rank_records=rank_records, metrics=metrics)
    if output_type == "dict":
        return list(reader.rows())
    if output_type == "arrow":
        pa = need_pyarrow()
        schema, batches = iter_arrow(reader)
        return pa.Table.from_batches(list(batches), schema=schema)
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("output_type='pandas' needs pandas: pip install pandas") from None
    try:
        need_pyarrow()
    except ImportError:
        columns = list(reader.columns())
        return pd.DataFrame.from_records(list(reader.rows()), columns=columns)
    schema, batches = iter_arrow(reader)
    return need_pyarrow().Table.from_batches(list(batches), schema=schema).to_pandas()
