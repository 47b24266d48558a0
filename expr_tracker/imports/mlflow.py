"""MLflow runs, read with MLflow's own client from an `mlruns` file store or any tracking
URI (a server, a database) (DESIGN 22).

Every run of every experiment (deleted ones too) comes over: one run is the run
`--name`, several are `{name}-{run name}`. Each metric's whole history keeps its steps
and times (milliseconds, as seconds); params go to the sidecar's config, user tags to
its tags as `key=value`, the note (`mlflow.note.content`) to its notes, the latest metrics
to its summary. Artifacts, models and traces do not come over.
"""

from __future__ import annotations

import atexit
import contextlib
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
)

EXTRA = "import-mlflow"
LIBRARY, WHAT = "mlflow", "MLflow runs"
_URI_PREFIXES = ("http://", "https://", "file:", "sqlite:", "postgresql", "mysql", "mssql",
                 "databricks")


def tracking_uri(source: str) -> str:
    """`source` as a tracking URI: a directory becomes `file://` + its absolute path. A
    store MLflow would create or change by opening it (a directory that is not an mlruns
    store, a sqlite file that is not there) is refused: an import leaves its source as is."""
    if source.startswith("file:"):
        _check_store(Path(source.removeprefix("file://").removeprefix("file:")), source)
        return source
    if source.startswith("sqlite:"):
        _check_sqlite(source)
        return source
    if source.startswith(_URI_PREFIXES):
        return source
    path = Path(source)
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory (give an mlruns directory or a "
                           "tracking URI)")
    _check_store(path, source)
    return path.resolve().as_uri()


def _check_store(path: Path, source: str) -> None:
    """An mlruns file store: experiment directories, each with its `meta.yaml` (deleted
    experiments' in `.trash`, which come over too)."""
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory")
    if not any(path.glob("*/meta.yaml")) and not any(path.glob(".trash/*/meta.yaml")):
        raise ImportFailed(f"{source}: not an MLflow file store (no experiment directory "
                           "with a meta.yaml in it)")


def _check_sqlite(source: str) -> None:
    """A sqlite URI's file exists: MLflow would make an empty database of a typo."""
    from sqlalchemy.engine.url import make_url

    try:
        db = make_url(source).database
    except ValueError as exc:
        raise ImportFailed(f"{source}: not a database URI ({exc})") from None
    if not db or db == ":memory:" or not Path(db).is_file():
        raise ImportFailed(f"{source}: no database file {db or '(none named)'} (MLflow would "
                           "create an empty one)")


def _client(uri: str, source: str) -> Any:
    need("mlflow", EXTRA, "MLflow runs")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    # MLflow 3 opens a file store only with this set ("maintenance mode"); importing the
    # old `mlruns` folders people have is the point, and reading one changes nothing
    allow = uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    if allow:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    trash = Path(uri.removeprefix("file://").removeprefix("file:")) / ".trash"
    if uri.startswith("file:") and not trash.exists():
        # the file store makes its `.trash` when opened and reads it to list runs: it
        # stays while this process imports, and goes when it ends, however it ends
        atexit.register(_remove_if_empty, trash)
    try:
        return MlflowClient(tracking_uri=uri)
    except MlflowException as exc:
        raise ImportFailed(f"{source}: MLflow could not open it ({exc.message})") from None
    finally:
        if allow:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def find(source: str) -> list[Found]:
    """Every run of the store, named by its run name (its id when names repeat)."""
    uri = tracking_uri(source)
    client = _client(uri, source)
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    try:
        experiments = client.search_experiments(view_type=ViewType.ALL)
        runs: list[Any] = []
        for exp in experiments:
            token = None
            while True:
                page = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL,
                                          max_results=1000, page_token=token)
                runs.extend(page)
                token = page.token
                if not token:
                    break
    except MlflowException as exc:
        raise ImportFailed(f"{source}: MLflow could not read it ({exc.message})") from None
    if not runs:
        raise ImportFailed(f"{source}: no MLflow runs in it")
    runs.sort(key=lambda r: (r.info.start_time or 0, r.info.run_id))
    names = [r.info.run_name or r.info.run_id for r in runs]
    found = []
    for run, label in zip(runs, names, strict=True):
        suffix = None
        if len(runs) > 1:
            suffix = safe_part(label if names.count(label) == 1 else f"{label}-{run.info.run_id}")
        origin = f"{uri} run {run.info.run_id}"
        found.append(Found(suffix, origin, partial(load, client, run, origin)))
    return found


def load(client: Any, info_run: Any, origin: str) -> Imported:
    """One MLflow run: its metrics' histories, params, tags and note."""
    from mlflow.exceptions import MlflowException

    info, data = info_run.info, info_run.data
    run = Imported(rows=[], config=dict(data.params), summary=dict(data.metrics))
    for key, value in sorted(data.tags.items()):
        if key == "mlflow.note.content":
            run.notes = value
        elif not key.startswith("mlflow."):
            run.tags.append(f"{key}={value}" if value else key)
    if info.run_name:
        run.config.setdefault("mlflow_run_name", info.run_name)
    run.start_time = info.start_time / 1000 if info.start_time else None
    run.end_time = info.end_time / 1000 if info.end_time else None
    steps = Steps(run)
    try:
        for key in sorted(data.metrics):
            for m in client.get_metric_history(info.run_id, key):
                step = check_step(m.step, origin, f"metric {key!r}")
                steps.add(step, m.timestamp / 1000 if m.timestamp else None, key, float(m.value))
    except MlflowException as exc:
        raise ImportFailed(f"{origin}: MLflow could not read it ({exc.message})") from None
    run.rows = steps.done()
    return run
