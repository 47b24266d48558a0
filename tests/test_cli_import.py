"""`expr import`: runs written by TensorBoard, wandb, MLflow and neptune-exporter's layout,
each by the real library in a child process, imported and read back through
`expr history --json` value for value at each step; damaged sources leave nothing; a
second import is refused, and --force replaces it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extras import need

ROOT = Path(__file__).resolve().parent.parent


def _child(code: str, tmp_path: Path, **env: str) -> None:
    """Run `code` in a fresh interpreter (the writing library's own process), in tmp_path."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def run(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """`run("import", ...)` -> typer Result, with the run root tmp_path/root."""
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    monkeypatch.setenv("EXPR_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("COLUMNS", "200")
    app, runner = build_app(), CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def history(run: Any, name: str) -> list[dict[str, Any]]:
    result = run("history", name, "-n", "-1", "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def nothing_written(tmp_path: Path) -> bool:
    """No run directory and no staging directory under the root."""
    root = tmp_path / "root"
    return not root.exists() or not [p for p in root.rglob("*") if p.is_dir() and p.parent != root]


# -- TensorBoard -------------------------------------------------------------

TB_WRITE = """
import sys
from torch.utils.tensorboard import SummaryWriter
for sub in sys.argv[1:]:
    w = SummaryWriter(sub)
    for i in range(50):
        w.add_scalar("train/loss", 1 / (i + 1) + 0.1, i * 10)
        if i % 5 == 0:
            w.add_scalar("eval/acc", i * 0.01, i * 10)
    w.close()
"""


def tb_expected(step: int, key: str) -> float | None:
    import numpy as np

    i = step // 10
    if key == "train/loss":
        return float(np.float32(1 / (i + 1) + 0.1))
    return float(np.float32(i * 0.01)) if i % 5 == 0 else None


def write_tb(tmp_path: Path, *subs: str) -> Path:
    need("torch.utils.tensorboard", "import-tensorboard")
    need("tensorboard", "import-tensorboard")
    _child(f"import sys; sys.argv = ['w', *{[f'tb/{s}' for s in subs]!r}]\n{TB_WRITE}", tmp_path)
    return tmp_path / "tb"


def test_tensorboard_tree_round_trips_float32_values_at_their_steps(run, tmp_path):
    logdir = write_tb(tmp_path, "lr=0.1", "seed/2")
    result = run("import", "tensorboard", str(logdir), "--project", "vision", "--name", "resnet",
                 "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [r["run"] for r in out["runs"]] == ["vision/resnet-lr_0.1", "vision/resnet-seed-2"]
    for name in ("resnet-lr_0.1", "resnet-seed-2"):
        rows = history(run, f"vision/{name}")
        assert [r["_step"] for r in rows] == [i * 10 for i in range(50)]
        for row in rows:
            assert isinstance(row["_time"], float)
            for key in ("train/loss", "eval/acc"):
                # exactly the float32 written, as its double: not rounded to fewer digits
                assert row.get(key) == tb_expected(row["_step"], key), (name, row)
    assert rows[1]["train/loss"] == 0.6000000238418579
    # the other readers know them as any run
    listed = run("runs", "--json")
    assert listed.exit_code == 0, listed.output
    assert {(r["project"], r["name"], r["status"]) for r in json.loads(listed.stdout)} >= \
        {("vision", "resnet-lr_0.1", "finished"), ("vision", "resnet-seed-2", "finished")}
    summary = run("summary", "vision/resnet-seed-2", "--json")
    assert summary.exit_code == 0 and "train/loss" in summary.stdout, summary.output


TB2_WRITE = """
import sys
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util
w = EventFileWriter(sys.argv[1])
meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
for i in range(20):
    value = summary_pb2.Summary.Value(tag="v2/acc", metadata=meta,
                                      tensor=tensor_util.make_tensor_proto(np.float32(i / 7)))
    w.add_event(event_pb2.Event(wall_time=1000.0 + i, step=i, summary=summary_pb2.Summary(value=[value])))
w.close()
"""


def test_tensorboard_scalar_tensors_round_trip_as_written(run, tmp_path):
    """TF2's `tf.summary.scalar` writes a float32 tensor with the scalars plugin's metadata."""
    import numpy as np

    need("tensorboard", "import-tensorboard")
    _child(f"import sys; sys.argv = ['w', 'tb2']\n{TB2_WRITE}", tmp_path)
    result = run("import", "tensorboard", str(tmp_path / "tb2"), "--project", "p", "--name", "v2")
    assert result.exit_code == 0, result.output
    assert [(r["_step"], r["_time"], r["v2/acc"]) for r in history(run, "p/v2")] == \
        [(i, 1000.0 + i, float(np.float32(i / 7))) for i in range(20)]


def test_a_damaged_event_file_leaves_nothing_and_names_the_file(run, tmp_path):
    logdir = write_tb(tmp_path, "a", "b")
    [events] = (logdir / "b").glob("*tfevents*")
    data = bytearray(events.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: a checksum fails
    events.write_bytes(bytes(data))
    result = run("import", "tensorboard", str(logdir), "--project", "p", "--name", "r")
    assert result.exit_code == 1
    assert str(events) in result.output and "damaged" in result.output, result.output
    assert nothing_written(tmp_path)  # not even run r-a, read before the damaged one

    events.write_bytes(bytes(data[: len(data) // 2]))  # cut short, as by a full disk
    result = run("import", "tensorboard", str(logdir), "--project", "p", "--name", "r")
    assert result.exit_code == 1 and "truncated" in result.output, result.output
    assert nothing_written(tmp_path)


def test_a_second_import_is_refused_and_force_replaces_it(run, tmp_path):
    logdir = write_tb(tmp_path, "a")
    args = ("import", "tensorboard", str(logdir / "a"), "--project", "p", "--name", "r")
    assert run(*args).exit_code == 0
    again = run(*args)
    assert again.exit_code == 1 and "--force" in again.output, again.output
    assert len(history(run, "p/r")) == 50  # not doubled
    forced = run(*args, "--force")
    assert forced.exit_code == 0, forced.output
    assert len(history(run, "p/r")) == 50
    assert [p.name for p in (tmp_path / "root" / "p").iterdir()] == ["r"]  # nothing aside


def test_the_same_source_under_another_name_is_refused_unless_forced(run, tmp_path):
    logdir = write_tb(tmp_path, "a")
    assert run("import", "tensorboard", str(logdir), "--project", "p", "--name", "r").exit_code == 0
    again = run("import", "tensorboard", str(logdir), "--project", "p", "--name", "other")
    assert again.exit_code == 1, again.output
    assert "imported already, as run p/r-a" in again.output, again.output
    assert sorted(p.name for p in (tmp_path / "root" / "p").iterdir()) == ["r-a"]
    forced = run("import", "tensorboard", str(logdir), "--project", "p", "--name", "other", "--force")
    assert forced.exit_code == 0, forced.output
    assert len(history(run, "p/other-a")) == 50


def test_force_never_replaces_a_run_training_wrote(run, tmp_path):
    import expr_tracker as et

    et.init(project="p", name="r", dir=str(tmp_path / "root"))
    et.log({"loss": 1.0})
    et.finish()
    logdir = write_tb(tmp_path, "a")
    result = run("import", "tensorboard", str(logdir / "a"), "--project", "p", "--name", "r",
                 "--force")
    assert result.exit_code == 1 and "not written by expr import" in result.output, result.output
    assert history(run, "p/r")[0]["loss"] == 1.0


def test_bad_inputs_are_one_line_each(run, tmp_path):
    missing = run("import", "tensorboard", str(tmp_path / "nope"), "--project", "p", "--name", "r")
    assert missing.exit_code == 1 and "no such directory" in missing.output
    (tmp_path / "empty").mkdir()
    empty = run("import", "tensorboard", str(tmp_path / "empty"), "--project", "p", "--name", "r")
    assert empty.exit_code == 1 and "no TensorBoard event files" in empty.output
    bad_name = run("import", "tensorboard", str(tmp_path / "empty"), "--project", "p",
                   "--name", "../x")
    assert bad_name.exit_code == 1 and "name" in bad_name.output, bad_name.output
    kind = run("import", "comet", str(tmp_path), "--project", "p", "--name", "r")
    assert kind.exit_code == 2
    assert nothing_written(tmp_path)


def test_a_missing_library_is_one_error_with_the_pip_command(tmp_path):
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"")
    code = ("import sys; sys.modules['tensorboard'] = None; sys.argv = ['expr', 'import', "
            f"'tensorboard', {str(tmp_path / 'tb')!r}, '--project', 'p', '--name', 'r', "
            f"'--dir', {str(tmp_path / 'root')!r}]; from expr_cli.main import entry; entry()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert "pip install 'expr-tracker[import-tensorboard]'" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "root" / "p").exists()


# -- wandb -------------------------------------------------------------------

WANDB_WRITE = """
import math, wandb
r = wandb.init(project="p", name="myrun", config={"lr": 0.001, "model": {"layers": 12}},
               tags=["baseline", "v2"], notes="first try")
for i in range(3000):  # a .wandb file of several 32 KiB blocks
    r.log({"loss": 1 / (i + 1), "acc": i / 3000, "phase": "warmup" if i < 10 else "main",
           "nan": math.nan if i == 5 else 0.0}, step=i * 2)
r.summary["best"] = 0.5
r.finish()
"""


def write_wandb(tmp_path: Path) -> Path:
    need("wandb", "wandb")
    _child(WANDB_WRITE, tmp_path, WANDB_MODE="offline", WANDB_DIR=str(tmp_path),
           WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    [rundir] = (tmp_path / "wandb").glob("offline-run-*")
    return rundir


def test_wandb_offline_run_round_trips_history_config_tags_notes(run, tmp_path):
    rundir = write_wandb(tmp_path)
    result = run("import", "wandb", str(rundir), "--project", "p", "--name", "w")
    assert result.exit_code == 0, result.output
    rows = history(run, "p/w")
    assert [r["_step"] for r in rows] == [i * 2 for i in range(3000)]
    for i, row in enumerate(rows):
        assert row["loss"] == 1 / (i + 1) and row["acc"] == i / 3000
        assert row["phase"] == ("warmup" if i < 10 else "main")
        assert isinstance(row["_time"], float)
    assert rows[5]["nan"] == "NaN" and rows[6]["nan"] == 0.0  # --json writes NaN as "NaN"
    side = json.loads((tmp_path / "root" / "p" / "w" / "metrics.meta.json").read_text())
    assert side["config"]["lr"] == 0.001 and side["config"]["model"] == {"layers": 12}
    assert side["tags"] == ["baseline", "v2"] and side["notes"] == "first try"
    assert side["summary"]["best"] == 0.5 and side["import"]["kind"] == "wandb"


def test_a_wandb_directory_of_runs_is_one_run_each(run, tmp_path):
    rundir = write_wandb(tmp_path)
    assert (tmp_path / "wandb" / "latest-run").is_symlink()  # wandb's link to the same run
    result = run("import", "wandb", str(tmp_path / "wandb"), "--project", "p", "--name", "w",
                 "--json")
    assert result.exit_code == 0, result.output
    assert [r["run"] for r in json.loads(result.stdout)["runs"]] == [f"p/w-{rundir.name}"]


def test_a_truncated_wandb_file_leaves_nothing(run, tmp_path):
    rundir = write_wandb(tmp_path)
    [log] = rundir.glob("*.wandb")
    whole = log.read_bytes()
    for cut in (50_000, len(whole) - 1, _last_record_start(whole)):  # mid-record, at a boundary
        log.write_bytes(whole[:cut])
        result = run("import", "wandb", str(rundir), "--project", "p", "--name", "w")
        assert result.exit_code == 1, result.output
        assert str(log) in result.output and "truncated" in result.output, result.output
        assert nothing_written(tmp_path)


def _last_record_start(data: bytes) -> int:
    """Where the last record of a .wandb file starts (a cut there ends on a whole record)."""
    from expr_tracker.imports.wandb import frames

    path = Path("probe.wandb")
    path.write_bytes(data)
    last = list(frames(path))[-1]
    return data.rindex(last) - 7


# -- MLflow ------------------------------------------------------------------

MLFLOW_WRITE = """
import mlflow
mlflow.set_tracking_uri("file://" + __import__("os").path.abspath("mlruns"))
for name in ("alpha", "beta"):
    with mlflow.start_run(run_name=name):
        mlflow.log_params({"lr": "0.01", "opt": name})
        mlflow.set_tag("team", "vision")
        mlflow.set_tag("mlflow.note.content", "note " + name)
        for i in range(40):
            mlflow.log_metric("loss", 1 / (i + 1), step=i * 3, timestamp=1_700_000_000_000 + i * 1000)
            mlflow.log_metric("lr", 0.01 * 0.9 ** i, step=i * 3, timestamp=1_700_000_000_000 + i * 1000)
"""


def test_mlflow_file_store_round_trips_metrics_params_tags(run, tmp_path, monkeypatch):
    need("mlflow", "import-mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _child(MLFLOW_WRITE, tmp_path, MLFLOW_ALLOW_FILE_STORE="true")
    before = tree(tmp_path / "mlruns")
    # not set here: an import opens the old file store without being told to
    result = run("import", "mlflow", str(tmp_path / "mlruns"), "--project", "p", "--name", "m")
    assert result.exit_code == 0, result.output
    assert tree(tmp_path / "mlruns") == before  # the source is read, never written
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    for name in ("alpha", "beta"):
        rows = history(run, f"p/m-{name}")
        assert [r["_step"] for r in rows] == [i * 3 for i in range(40)]
        for i, row in enumerate(rows):
            assert row["loss"] == 1 / (i + 1) and row["lr"] == 0.01 * 0.9 ** i
            assert row["_time"] == 1_700_000_000 + i
        side = json.loads((tmp_path / "root" / "p" / f"m-{name}" / "metrics.meta.json").read_text())
        assert side["config"]["lr"] == "0.01" and side["config"]["opt"] == name
        assert side["tags"] == ["team=vision"] and side["notes"] == f"note {name}"


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path` with its size and mtime."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


def test_a_missing_mlflow_store_is_one_line(run, tmp_path):
    need("mlflow", "import-mlflow")
    result = run("import", "mlflow", str(tmp_path / "mlruns"), "--project", "p", "--name", "m")
    assert result.exit_code == 1 and "no such directory" in result.output
    assert nothing_written(tmp_path)


# -- Neptune (neptune-exporter's Parquet) -----------------------------------

def write_neptune(path: Path, runs: dict[str, int]) -> None:
    """Parquet with neptune-exporter's schema (its `model.SCHEMA`), one file per run part."""
    from datetime import datetime, timezone
    from decimal import Decimal

    pa = need("pyarrow", "export")
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("project_id", pa.string()), ("run_id", pa.string()), ("attribute_path", pa.string()),
        ("attribute_type", pa.string()), ("step", pa.decimal128(18, 6)),
        ("timestamp", pa.timestamp("ms", tz="UTC")), ("int_value", pa.int64()),
        ("float_value", pa.float64()), ("string_value", pa.string()), ("bool_value", pa.bool_()),
        ("datetime_value", pa.timestamp("ms", tz="UTC")), ("string_set_value", pa.list_(pa.string())),
        ("file_value", pa.struct([("path", pa.string())])),
        ("histogram_value", pa.struct([("type", pa.string()), ("edges", pa.list_(pa.float64())),
                                       ("values", pa.list_(pa.float64()))])),
    ])
    path.mkdir(parents=True)
    for rid, n in runs.items():
        rows: list[dict[str, Any]] = [
            {"attribute_path": "parameters/lr", "attribute_type": "float", "float_value": 0.1},
            {"attribute_path": "parameters/epochs", "attribute_type": "int", "int_value": 3},
            {"attribute_path": "sys/tags", "attribute_type": "string_set", "string_set_value": ["a", "b"]},
            {"attribute_path": "sys/description", "attribute_type": "string", "string_value": "from neptune"},
            {"attribute_path": "logs/text", "attribute_type": "string_series", "step": Decimal(0),
             "string_value": "hello", "timestamp": datetime(2025, 1, 1, tzinfo=timezone.utc)},
        ]
        for i in range(n):
            ts = datetime.fromtimestamp(1_735_689_600 + i, tz=timezone.utc)
            rows.append({"attribute_path": "train/loss", "attribute_type": "float_series",
                         "step": Decimal(i), "timestamp": ts, "float_value": 1 / (i + 1)})
        for row in rows:
            row.update(project_id="ws/proj", run_id=rid)
        half = len(rows) // 2  # a run split into two parts, as the exporter does past ~50 MB
        for part, chunk in enumerate((rows[:half], rows[half:])):
            pq.write_table(pa.Table.from_pylist(chunk, schema=schema),
                           path / f"{rid}_part_{part}.parquet")


def test_neptune_parquet_round_trips_series_params_tags(run, tmp_path):
    write_neptune(tmp_path / "export", {"RUN-1": 30, "RUN-2": 10})
    result = run("import", "neptune", str(tmp_path / "export"), "--project", "p", "--name", "n")
    assert result.exit_code == 0, result.output
    for rid, n in (("RUN-1", 30), ("RUN-2", 10)):
        rows = history(run, f"p/n-{rid}")
        assert [(r["_step"], r["train/loss"], r["_time"]) for r in rows] == \
            [(i, 1 / (i + 1), 1_735_689_600.0 + i) for i in range(n)]
        side = json.loads((tmp_path / "root" / "p" / f"n-{rid}" / "metrics.meta.json").read_text())
        assert side["config"] == {"parameters/lr": 0.1, "parameters/epochs": 3}
        assert side["tags"] == ["a", "b"] and side["notes"] == "from neptune"
        assert side["import"]["skipped"] == {"string_series attributes": 1}


def test_a_fractional_neptune_step_is_refused_naming_the_attribute(run, tmp_path):
    import pyarrow.parquet as pq

    write_neptune(tmp_path / "export", {"RUN-1": 5})
    part = tmp_path / "export" / "RUN-1_part_1.parquet"
    table = pq.read_table(part).to_pylist()
    from decimal import Decimal

    table[-1]["step"] = Decimal("4.5")
    pq.write_table(pq.read_table(part).from_pylist(table, schema=pq.read_schema(part)), part)
    result = run("import", "neptune", str(tmp_path / "export"), "--project", "p", "--name", "n")
    assert result.exit_code == 1, result.output
    assert "'train/loss'" in result.output and "4.5" in result.output, result.output
    assert nothing_written(tmp_path)


def test_a_damaged_parquet_leaves_nothing(run, tmp_path):
    write_neptune(tmp_path / "export", {"RUN-1": 30})
    part = tmp_path / "export" / "RUN-1_part_1.parquet"
    part.write_bytes(part.read_bytes()[:-20])
    result = run("import", "neptune", str(tmp_path / "export"), "--project", "p", "--name", "n")
    assert result.exit_code == 1 and str(part) in result.output, result.output
    assert nothing_written(tmp_path)


def test_an_import_killed_midway_leaves_no_run_and_the_next_one_clears_its_remains(run, tmp_path):
    need("tensorboard", "import-tensorboard")
    logdir = tmp_path / "big"
    writer = (ROOT / "bench" / "imports.py").read_text().split('WRITE = """', 1)[1].split('"""', 1)[0]
    # two runs: `a` is staged whole while `b`, long enough to be killed in, is read
    for sub, steps in (("a", 1000), ("b", 60000)):
        _child(f"import sys; sys.argv = ['w', {str(logdir / sub)!r}, '{steps}', '10']\n{writer}",
               tmp_path)
    root = tmp_path / "root"
    args = ["import", "tensorboard", str(logdir), "--project", "p", "--name", "r", "--dir", str(root)]
    child = subprocess.Popen([sys.executable, "-c", "from expr_cli.main import entry; entry()", *args],
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        deadline = time.monotonic() + 120
        while not list((root / "p").glob(".import-*-r-a/metrics.meta.json")) and child.poll() is None:
            assert time.monotonic() < deadline, "the import never staged run r-a"
            time.sleep(0.01)
        assert child.poll() is None, "the import finished before it could be killed"
        os.kill(child.pid, 9)
    finally:
        child.wait(timeout=60)
    assert not (root / "p" / "r-a").exists()  # staged whole, but the import did not finish
    assert not (root / "p" / "r-b").exists()
    assert list((root / "p").glob(".import-*"))
    listed = run("runs", "--json", "--dir", str(root))
    assert listed.exit_code == 0 and "import" not in listed.stdout, listed.output
    again = run(*args)
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in (root / "p").iterdir()) == ["r-a", "r-b"]  # remains gone
    assert len(history(run, "p/r-b")) == 60000


def test_a_full_disk_fails_the_import_in_one_line_and_leaves_nothing(tmp_path):
    from tests.procs import in_mount_namespace

    need("tensorboard", "import-tensorboard")
    writer = (ROOT / "bench" / "imports.py").read_text().split('WRITE = """', 1)[1].split('"""', 1)[0]
    _child(f"import sys; sys.argv = ['w', {str(tmp_path / 'tb')!r}, '2000', '10']\n{writer}", tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    # a 64 KiB filesystem for the run root: the rows (about 500 KB of JSON) do not fit
    out = in_mount_namespace(f"""
        import json, os, subprocess, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", {str(root)!r}], check=True)
        done = subprocess.run([sys.executable, "-c", "from expr_cli.main import entry; entry()",
                               "import", "tensorboard", {str(tmp_path / 'tb')!r}, "--project", "p",
                               "--name", "r", "--dir", {str(root)!r}],
                              capture_output=True, text=True,
                              env={{**os.environ, "PYTHONPATH": {str(ROOT)!r}}})
        left = [os.path.relpath(os.path.join(d, f), {str(root)!r})
                for d, dirs, files in os.walk({str(root)!r}) for f in dirs + files]
        print(json.dumps({{"code": done.returncode, "err": done.stderr, "left": left}}))
    """)
    assert out["code"] == 1, out
    assert "No space left on device" in out["err"] and "Traceback" not in out["err"], out
    assert len(out["err"].strip().splitlines()) == 1, out["err"]
    assert out["left"] == [], out  # no run, no staging directory, not even the project
