"""Neptune runs from the Parquet files neptune-exporter writes, read with pyarrow
(DESIGN 22).

neptune-exporter writes one row per value: `project_id`, `run_id`, `attribute_path`,
`attribute_type`, `step` (decimal(18,6)), `timestamp` and one typed value column
(`float_value`, `int_value`, `string_value`, `bool_value`, `datetime_value`,
`string_set_value`, ...), a run split into `<run>_part_<n>.parquet` files. Float series
become rows (their steps must be whole numbers); single values become the sidecar's
config, `sys/tags` its tags, `sys/description` its notes. String series, histograms and
files do not come over. One run is the run `--name`, several are `{name}-{run_id}`.
"""

from __future__ import annotations

import errno
import os
from functools import partial
from pathlib import Path
from typing import Any

from expr_tracker.imports.model import (
    Found,
    Imported,
    ImportFailed,
    Steps,
    check_step,
    need,
    safe_part,
    unreadable,
)

EXTRA = "export"  # pyarrow
LIBRARY, WHAT = "pyarrow.parquet", "neptune-exporter Parquet"
_PARAMS = {"float": "float_value", "int": "int_value", "string": "string_value",
           "bool": "bool_value", "datetime": "datetime_value", "string_set": "string_set_value"}
_NEEDED = ("run_id", "attribute_path", "attribute_type", "step", "timestamp")


def _files(source: str) -> list[Path]:
    path = Path(source).resolve()  # one source, one origin, whatever link it is named by
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory")
    files: list[Path] = []
    for here, _, names in os.walk(path, onerror=unreadable):  # rglob skips one quietly
        files.extend(Path(here) / n for n in names if n.endswith(".parquet"))
    files.sort()
    if not files:
        raise ImportFailed(f"{source}: no .parquet files in it or below")
    return files


def _read(path: Path, run_id: str | None = None) -> Any:
    need("pyarrow.parquet", EXTRA, "neptune-exporter Parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        missing = [c for c in _NEEDED if c not in schema.names]
        if missing:
            raise ImportFailed(f"{path}: not a neptune-exporter file (no column "
                               f"{', '.join(missing)})")
        if run_id is None:
            return pq.read_table(path, columns=["run_id"])
        return pq.read_table(path, filters=[("run_id", "=", run_id)])
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
            raise ImportFailed(f"{path}: {os.strerror(exc.errno)}") from None
        raise ImportFailed(f"{path}: damaged Parquet file ({exc})") from None


def find(source: str) -> list[Found]:
    """Every run in the Parquet files under `source` (a run may span several files)."""
    where: dict[str, list[Path]] = {}
    for path in _files(source):
        for rid in _read(path).column("run_id").unique().to_pylist():
            if rid is not None:
                where.setdefault(str(rid), []).append(path)
    if not where:
        raise ImportFailed(f"{source}: no Neptune runs in its Parquet files")
    several = len(where) > 1
    label = Path(source).resolve()
    return [Found(safe_part(rid) if several else None, f"{label} run {rid}",
                  partial(load, rid, files))
            for rid, files in sorted(where.items())]


def load(run_id: str, files: list[Path]) -> Imported:
    """One Neptune run's float series (rows) and single values (config)."""
    run = Imported(rows=[])
    steps = Steps(run)
    for path in files:
        rows = _read(path, run_id).to_pylist()
        for row in rows:
            _one(run, steps, row, path)
    run.rows = steps.done()
    return run


def _one(run: Imported, steps: Steps, row: dict[str, Any], path: Path) -> None:
    attr, kind = row.get("attribute_path") or "", row.get("attribute_type")
    if kind in ("float_series", "int_series"):
        value = row.get("float_value") if kind == "float_series" else row.get("int_value")
        step = row.get("step")
        if step is None or value is None:
            run.skip("series values without a step or value")
            return
        step = check_step(float(step) if step == int(step) else step, str(path),
                          f"attribute {attr!r}")
        ts = row.get("timestamp")
        steps.add(step, ts.timestamp() if ts is not None else None, attr, value)
    elif kind in _PARAMS:
        value = row.get(_PARAMS[kind])
        if kind == "datetime" and value is not None:
            value = value.isoformat()
        if attr == "sys/tags" and isinstance(value, list):
            run.tags.extend(str(t) for t in value)
        elif attr == "sys/description" and isinstance(value, str):
            run.notes = value
        else:
            run.config[attr] = value
    else:
        run.skip(f"{kind} attributes")
