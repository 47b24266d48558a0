"""`expr import` on what users meet past the happy path: symlinks out of the log dir, a
directory it may not read, an event file still being written, a directory or database
that is not an MLflow store (left as it was found), and a property: any float32 values
at any steps come back from a TensorBoard import exactly, the later of two at one step."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.extras import need
from tests.test_cli_import import history, nothing_written

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """`run("import", ...)` -> typer Result, with the run root tmp_path/root."""
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    monkeypatch.setenv("EXPR_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("COLUMNS", "200")
    app, runner = build_app(), CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def write_events(logdir: Path, points: list[tuple[str, int, float]], wall: float = 1000.0) -> Path:
    """An event file written by TensorBoard's own writer: one scalar event per point."""
    need("tensorboard", "import-tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(logdir))
    for i, (tag, step, value) in enumerate(points):
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        writer.add_event(event_pb2.Event(wall_time=wall + i, step=step, summary=summary))
    writer.close()
    [path] = [p for p in logdir.iterdir() if "tfevents" in p.name]
    return path


def test_a_symlink_leading_out_of_the_log_dir_is_refused_unless_followed(run, tmp_path):
    logdir, outside = tmp_path / "logs", tmp_path / "elsewhere"
    write_events(logdir / "a", [("loss", 0, 1.0)])
    write_events(outside / "b", [("loss", 0, 2.0)])
    (logdir / "b").symlink_to(outside / "b")  # a run kept on another disk
    args = ("import", "tensorboard", str(logdir), "--project", "p", "--name", "r")
    refused = run(*args)
    assert refused.exit_code == 1, refused.output
    assert str(logdir / "b") in refused.output and "--follow-symlinks" in refused.output
    assert nothing_written(tmp_path)
    followed = run(*args, "--follow-symlinks")
    assert followed.exit_code == 0, followed.output
    assert history(run, "p/r-b")[0]["loss"] == 2.0 and history(run, "p/r-a")[0]["loss"] == 1.0
    assert sorted(p.name for p in outside.rglob("*")) == ["b", next((outside / "b").iterdir()).name]


def test_an_event_file_symlinked_from_outside_is_refused_and_one_inside_is_read(run, tmp_path):
    logdir = tmp_path / "logs"
    secret = write_events(tmp_path / "secret", [("loss", 0, 3.0)])
    write_events(logdir / "a", [("loss", 0, 1.0)])
    (logdir / "a" / "events.out.tfevents.9.link").symlink_to(secret)
    args = ("import", "tensorboard", str(logdir), "--project", "p", "--name", "r")
    refused = run(*args)
    assert refused.exit_code == 1 and "events.out.tfevents.9.link" in refused.output, refused.output
    assert nothing_written(tmp_path)
    # a link within the log dir to a directory of it would import that run twice: not read
    (logdir / "a" / "events.out.tfevents.9.link").unlink()
    (logdir / "again").symlink_to(logdir / "a")
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "root" / "p").iterdir()) == ["r-a"]


def _without_root_powers() -> list[str]:
    """A prefix that runs a command without the power to read what mode 000 forbids."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: mode 000 does not stop a read")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", "--"]


def test_a_directory_it_may_not_read_fails_the_import_naming_it(tmp_path):
    logdir = tmp_path / "logs"
    write_events(logdir / "ok", [("loss", 0, 1.0)])
    write_events(logdir / "locked", [("loss", 0, 2.0)])
    (logdir / "locked").chmod(0)
    try:
        done = subprocess.run(
            [*_without_root_powers(), sys.executable, "-m", "expr_cli.main", "import",
             "tensorboard", str(logdir), "--project", "p", "--name", "r",
             "--dir", str(tmp_path / "root")],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        (logdir / "locked").chmod(0o755)
    assert done.returncode == 1, done.stdout + done.stderr  # not run r-ok alone, quietly
    assert str(logdir / "locked") in done.stderr and "Permission denied" in done.stderr
    assert "Traceback" not in done.stderr and nothing_written(tmp_path)


def test_an_event_file_still_being_written_is_refused_saying_so(run, tmp_path):
    events = write_events(tmp_path / "live", [("loss", i, float(i)) for i in range(100)])
    data = events.read_bytes()
    events.write_bytes(data[:-5])  # the writer's last record, half flushed
    result = run("import", "tensorboard", str(tmp_path / "live"), "--project", "p", "--name", "r")
    assert result.exit_code == 1, result.output
    assert "still being written" in result.output and str(events) in result.output
    assert nothing_written(tmp_path)


def test_a_directory_that_is_not_an_mlflow_store_is_left_as_it_was(run, tmp_path):
    need("mlflow", "import-mlflow")
    write_events(tmp_path / "tb", [("loss", 0, 1.0)])  # the wrong KIND for it
    before = sorted(p.name for p in (tmp_path / "tb").iterdir())
    result = run("import", "mlflow", str(tmp_path / "tb"), "--project", "p", "--name", "r")
    assert result.exit_code == 1 and "not an MLflow" in result.output, result.output
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == before  # no .trash made
    assert nothing_written(tmp_path)


def test_a_sqlite_uri_of_no_file_is_refused_without_making_the_database(run, tmp_path):
    need("mlflow", "import-mlflow")
    db = tmp_path / "typo.db"
    result = run("import", "mlflow", f"sqlite:///{db}", "--project", "p", "--name", "r")
    assert result.exit_code == 1 and str(db) in result.output, result.output
    assert not db.exists() and nothing_written(tmp_path)


def _float32s() -> Any:
    from hypothesis import strategies as st

    return st.floats(width=32, allow_nan=True, allow_infinity=True)


def test_tensorboard_values_and_steps_round_trip_exactly() -> None:
    """Any float32 (NaN and infinities too) at any steps, in any order, repeated: each
    (tag, step) comes back as the last value written there, rows in step order."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from expr_tracker.imports import import_runs
    from expr_tracker.store.reader import ShardReader

    points = st.lists(st.tuples(st.sampled_from(["loss", "a b/ü", "x" * 300]),
                                st.integers(0, 2**62), _float32s()), min_size=1, max_size=40)

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(points)
    def check(points: list[tuple[str, int, float]]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            write_events(Path(tmp) / "tb", points)
            import_runs("tensorboard", str(Path(tmp) / "tb"), Path(tmp) / "root", "p", "r")
            rows = ShardReader(Path(tmp) / "root" / "p" / "r" / "metrics.jsonl").records()
        want: dict[int, dict[str, float]] = {}
        for tag, step, value in points:
            want.setdefault(step, {})[tag] = value
        assert [r["_step"] for r in rows] == sorted(want)
        for row in rows:
            got = {k: v for k, v in row.items() if not k.startswith("_")}
            expected = want[row["_step"]]
            assert got.keys() == expected.keys()
            for k, v in expected.items():
                assert got[k] == v or (math.isnan(v) and math.isnan(got[k])), (k, v, got[k])

    check()


def test_an_mlruns_store_without_its_trash_folder_is_read_and_left_without_one(tmp_path):
    """MLflow's file store makes `.trash` when opened (a copy made without dot files has
    none): the import reads the store and the process leaves no `.trash` behind."""
    need("mlflow", "import-mlflow")
    from tests.test_cli_import import MLFLOW_WRITE, _child

    _child(MLFLOW_WRITE, tmp_path, MLFLOW_ALLOW_FILE_STORE="true")
    shutil.rmtree(tmp_path / "mlruns" / ".trash")
    before = sorted(str(p) for p in (tmp_path / "mlruns").rglob("*"))
    done = subprocess.run(
        [sys.executable, "-m", "expr_cli.main", "import", "mlflow", str(tmp_path / "mlruns"),
         "--project", "p", "--name", "m", "--dir", str(tmp_path / "root"), "--json"],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"},
             "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "root" / "p" / "m-alpha").is_dir()
    assert sorted(str(p) for p in (tmp_path / "mlruns").rglob("*")) == before


def test_the_sidecar_summary_holds_each_keys_last_value_as_a_finished_run_does(run, tmp_path):
    """A finished SDK run's sidecar summary has each key's last value, NaN as "NaN" (JSON
    has no NaN: written as a float it would read back null)."""
    import json

    write_events(tmp_path / "tb", [("loss", 0, 1.0), ("eval/acc", 0, 0.5), ("loss", 1, math.nan),
                                   ("loss", 2, -math.inf)])
    assert run("import", "tensorboard", str(tmp_path / "tb"), "--project", "p",
               "--name", "r").exit_code == 0
    side = json.loads((tmp_path / "root" / "p" / "r" / "metrics.meta.json").read_text())
    assert side["summary"] == {"loss": "-Infinity", "eval/acc": 0.5}


def test_a_file_that_is_not_an_event_file_is_named_as_such(run, tmp_path):
    """Not "truncated, still being written": a text file or random bytes given as SOURCE."""
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "rand.bin").write_bytes(bytes(range(256)) * 40)
    for name in ("notes.txt", "rand.bin"):
        result = run("import", "tensorboard", str(tmp_path / name), "--project", "p", "--name", "r")
        assert result.exit_code == 1, result.output
        assert f"{tmp_path / name}: not a TensorBoard event file" in result.output, result.output
    assert nothing_written(tmp_path)


def test_one_log_dir_named_through_a_symlink_is_still_one_source(run, tmp_path):
    """`~/logs -> /data/logs`: importing it by either name under another run name would
    double its rows; it is refused as the same source."""
    write_events(tmp_path / "data" / "a", [("loss", 0, 1.0)])
    (tmp_path / "logs").symlink_to(tmp_path / "data")
    assert run("import", "tensorboard", str(tmp_path / "logs"), "--project", "p",
               "--name", "r").exit_code == 0
    again = run("import", "tensorboard", str(tmp_path / "data"), "--project", "p", "--name", "s")
    assert again.exit_code == 1 and "imported already, as run p/r-a" in again.output, again.output


def test_neptune_non_finite_params_and_odd_series_are_kept_or_counted(run, tmp_path):
    """A float param of inf stays "Infinity" in the config (not null); string and bool
    series are counted as not imported; a NaN point is a NaN value."""
    import json
    from datetime import datetime, timezone
    from decimal import Decimal

    pa = need("pyarrow", "export")
    import pyarrow.parquet as pq

    ts = datetime(2025, 1, 1, tzinfo=timezone.utc)
    rows = [
        {"attribute_path": "params/clip", "attribute_type": "float", "float_value": math.inf},
        {"attribute_path": "logs/s", "attribute_type": "string_series", "step": Decimal(1),
         "timestamp": ts, "string_value": "hi"},
        {"attribute_path": "logs/b", "attribute_type": "bool_series", "step": Decimal(1),
         "timestamp": ts, "bool_value": True},
        {"attribute_path": "train/loss", "attribute_type": "float_series", "step": Decimal(1),
         "timestamp": ts, "float_value": math.nan},
    ]
    for row in rows:
        row.update(project_id="ws/proj", run_id="RUN-1")
    schema = pa.schema([
        ("project_id", pa.string()), ("run_id", pa.string()), ("attribute_path", pa.string()),
        ("attribute_type", pa.string()), ("step", pa.decimal128(18, 6)),
        ("timestamp", pa.timestamp("ms", tz="UTC")), ("float_value", pa.float64()),
        ("string_value", pa.string()), ("bool_value", pa.bool_())])
    (tmp_path / "nep").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "nep" / "RUN-1_part_0.parquet")
    result = run("import", "neptune", str(tmp_path / "nep"), "--project", "p", "--name", "r", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"][0]["skipped"] == {
        "string_series attributes": 1, "bool_series attributes": 1}
    side = json.loads((tmp_path / "root" / "p" / "r" / "metrics.meta.json").read_text())
    assert side["config"] == {"params/clip": "Infinity"}
    [row] = history(run, "p/r")
    assert row["_step"] == 1 and row["train/loss"] == "NaN"  # as `history --json` spells NaN


@pytest.mark.parametrize("kind", ["wandb", "neptune"])
def test_a_run_directory_it_may_not_read_fails_a_wandb_or_neptune_import(tmp_path, kind):
    """A `wandb/` directory (or a Parquet export) with a run directory it may not list:
    the import fails naming it, rather than importing the other runs (or saying there are
    none) quietly."""
    source = tmp_path / "src"
    for sub in ("run-a", "run-b"):
        (source / sub).mkdir(parents=True)
        (source / sub / ("run.wandb" if kind == "wandb" else "part_0.parquet")).write_bytes(b"x")
    (source / "run-b").chmod(0)
    try:
        done = subprocess.run(
            [*_without_root_powers(), sys.executable, "-m", "expr_cli.main", "import", kind,
             str(source), "--project", "p", "--name", "r", "--dir", str(tmp_path / "root")],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        (source / "run-b").chmod(0o755)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{source / 'run-b'}: Permission denied" in done.stderr, done.stderr
    assert nothing_written(tmp_path)


def test_ctrl_c_mid_import_exits_130_and_leaves_nothing(tmp_path):
    """SIGINT while runs are being staged: exit 130, no run, no staging directory, no
    empty project directory (the import made it)."""
    import signal
    import time

    events = write_events(tmp_path / "one", [("loss", i, float(i)) for i in range(2000)])
    for i in range(300):
        (tmp_path / "logs" / f"r{i:03}").mkdir(parents=True)
        shutil.copy(events, tmp_path / "logs" / f"r{i:03}")
    root = tmp_path / "root"
    child = subprocess.Popen(
        [sys.executable, "-m", "expr_cli.main", "import", "tensorboard", str(tmp_path / "logs"),
         "--project", "p", "--name", "r", "--dir", str(root)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((root / "p").glob(".import-*-r-r001")) and child.poll() is None:
            assert time.monotonic() < deadline, "the import never staged a run"
            time.sleep(0.01)
        assert child.poll() is None, "the import finished before it could be interrupted"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err
    assert "Traceback" not in err and not root.joinpath("p").exists(), err
