"""The SDK in direct mode, in process: step semantics, info, bad input, failures after init."""

from __future__ import annotations

import errno
import math
import os
import shutil
import warnings

import orjson
import pytest

import expr_tracker as et
from expr_tracker.errors import UsageError

from .procs import in_mount_namespace


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_JOB_ID",
                "OMPI_COMM_WORLD_RANK", "EXPR_DIR", "EXPR_MODE", "EXPR_SPOOL", "EXPR_ALERT_CONFIG",
                "TORCHELASTIC_RUN_ID", "EXPR_RUN_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    et.finish()


def lines(path):
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def test_wandb_step_semantics(tmp_path):
    run = et.init("p", "r", dir=tmp_path)
    et.log({"a": 1})  # step 0, committed
    et.log({"b": 2}, commit=False)  # merges into step 1
    et.log({"c": 3})  # commits step 1 with b and c
    et.log({"d": 4}, step=5)  # open at 5
    et.log({"e": 5}, step=5)  # merge
    et.log({"f": 6}, step=6)  # commits 5, opens 6
    with pytest.warns(RuntimeWarning, match="step 2 is behind"):
        et.log({"g": 7}, step=2)  # backward: dropped
    et.log({"h": 8}, step=6, commit=True)  # commits 6, next is 7
    et.log({"i": 9})  # step 7
    assert run.step == 8
    et.finish()
    rows = lines(run.shard_path)
    got = [(r["_step"], {k: v for k, v in r.items() if not k.startswith("_")}) for r in rows]
    assert got == [
        (0, {"a": 1}),
        (1, {"b": 2, "c": 3}),
        (5, {"d": 4, "e": 5}),
        (6, {"f": 6, "h": 8}),
        (7, {"i": 9}),
    ]
    assert all(isinstance(r["_time"], float) for r in rows)
    assert run.info()["dropped"] == {"backward_step": 1}


def test_finish_commits_open_row_and_is_idempotent(tmp_path):
    with et.init("p", "r", dir=tmp_path) as run:
        et.log({"x": 1.0}, step=3)
    run.finish()
    et.finish()
    assert [r["_step"] for r in lines(run.shard_path)] == [3]
    side = orjson.loads(run.paths.sidecar.read_bytes())
    assert side["status"] == "finished"
    assert side["cursor"]["rows"] == 1 and side["cursor"]["next_step"] == 4


def test_idle_timeout_commits_open_row(tmp_path):
    run = et.init("p", "r", dir=tmp_path, idle_timeout=0.2)
    et.log({"x": 1.0}, commit=False)
    deadline = __import__("time").monotonic() + 5
    while __import__("time").monotonic() < deadline:
        if run.shard_path.exists() and run.shard_path.read_bytes():
            break
        __import__("time").sleep(0.05)
    assert [r["x"] for r in lines(run.shard_path)] == [1.0]


def test_second_init_raises_and_writes_nothing(tmp_path):
    et.init("p", "r", dir=tmp_path)
    with pytest.raises(UsageError, match="already called"):
        et.init("p", "other", dir=tmp_path)
    assert not (tmp_path / "p" / "other").exists()


def test_get_run_is_the_current_run_or_none(tmp_path):
    assert et.get_run() is None
    run = et.init("p", "r", dir=tmp_path)
    assert et.get_run() is run
    run.finish()
    assert et.get_run() is None
    with et.init("p", "r2", dir=tmp_path) as second:
        assert et.get_run() is second
    assert et.get_run() is None


def test_log_before_init_raises():
    with pytest.raises(UsageError, match="init"):
        et.log({"x": 1})


def test_info_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    run = et.init("p", "r", dir=tmp_path, stream="data")
    et.log({"x": 1})
    info = et.info()
    assert info["rank"] == 2 and info["world_size"] == 4 and info["local_rank"] == 0
    assert info["stream"] == "data" and info["mode"] == "direct"
    assert info["shard"] == str(tmp_path / "p" / "r" / "metrics.data.rank2.jsonl")
    assert info["rows"] == 1 and info["last_step"] == 0
    assert info["dropped"] == {} and info["rules"] == []
    assert run.shard_path.name == "metrics.data.rank2.jsonl"


def test_default_dir_and_name(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPR_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    run = et.init("p")
    assert run.name == "slurm-1234"
    assert run.paths.run_dir == tmp_path / "root" / "p" / "slurm-1234"
    et.finish()
    monkeypatch.delenv("EXPR_DIR")
    monkeypatch.delenv("SLURM_JOB_ID")
    run = et.init("p")
    assert run.name.startswith("run-")
    assert run.paths.run_dir.parent == tmp_path / "tracker" / "jsonl" / "p"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"project": ""}, ValueError, "project must not be empty"),
        ({"project": "a/b"}, ValueError, "project"),
        ({"name": "../x"}, ValueError, "name"),
        ({"name": ".x"}, ValueError, "name"),
        ({"name": "x" * 129}, ValueError, "name"),
        ({"name": "a\x00"}, ValueError, "name"),
        ({"stream": "rank3"}, ValueError, "stream"),
        ({"stream": "a..b"}, ValueError, "stream"),
        ({"resume": "sometimes"}, ValueError, "resume"),
        ({"upload_mode": "s3"}, ValueError, "upload_mode"),
        ({"config": [1]}, TypeError, "config"),
        ({"config": {"f": object()}}, TypeError, "config"),
        ({"alert_on_rank": 2**40}, ValueError, "alert_on_rank"),  # over any world size
        ({"backend_on_rank": -1}, ValueError, "backend_on_rank"),
        ({"rank_aware": "yes"}, TypeError, "rank_aware"),
        ({"idle_timeout": 0}, ValueError, "idle_timeout"),
    ],
)
def test_bad_init_raises_naming_the_field_and_writes_nothing(tmp_path, kwargs, exc, match):
    args = {"project": "p", "name": "r", "dir": tmp_path / "d"}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        et.init(**args)
    assert not (tmp_path / "d").exists()


def test_a_file_where_the_run_root_or_the_spool_should_be_is_an_error_at_init(tmp_path, monkeypatch):
    """A file in the way of the run root (or of the spool) is said at `init`, naming where
    it came from; before, init went on and every row was kept in memory, retried, and
    counted as not written at finish."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=rf"^dir {blocker}/runs is not a directory: {blocker} is a file$"):
        et.init("p", "r", dir=blocker / "runs")
    monkeypatch.setenv("EXPR_DIR", str(blocker))
    with pytest.raises(ValueError, match=rf"^EXPR_DIR {blocker} is not a directory: it is a file$"):
        et.init("p", "r")
    with pytest.raises(ValueError, match=r"^spool_dir .* is not a directory"):
        et.init("p", "r", dir=tmp_path / "d", upload_mode="spool", spool_dir=blocker)
    monkeypatch.setenv("EXPR_SPOOL", str(blocker / "spool"))
    with pytest.raises(ValueError, match=r"^EXPR_SPOOL .* is not a directory"):
        et.init("p", "r", dir=tmp_path / "d", upload_mode="spool")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # a spooled run's root is exprd's to check (no stat of a shared filesystem at init)
    monkeypatch.setenv("EXPR_SPOOL", str(tmp_path / "spool"))
    with et.init("p", "r", dir=blocker, upload_mode="spool", system_metrics=False):
        et.log({"loss": 1.0})


def test_a_bad_expr_backends_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPR_BACKENDS", "wandb, wandbb")
    with pytest.raises(ValueError, match=r"^EXPR_BACKENDS: backend type 'wandbb' is unknown; expected one of: .*wandb"):
        et.init("p", "r", dir=tmp_path / "d")
    assert not (tmp_path / "d").exists()
    # in spool mode a bare name is one of exprd's [backends.NAME], checked as a name only
    monkeypatch.setenv("EXPR_BACKENDS", "team-store")
    monkeypatch.setenv("EXPR_SPOOL", str(tmp_path / "spool"))
    with et.init("p", "r", dir=tmp_path / "d", upload_mode="spool", system_metrics=False):
        et.log({"loss": 1.0})
    monkeypatch.setenv("EXPR_BACKENDS", "team store")
    with pytest.raises(ValueError, match=r"^EXPR_BACKENDS: backends "):
        et.init("p", "r", dir=tmp_path / "d", upload_mode="spool")


def test_a_bad_expr_mode_names_the_variable(tmp_path, monkeypatch):
    """EXPR_MODE set in a job script: the error names it, not the argument nobody passed."""
    monkeypatch.setenv("EXPR_MODE", "spol")
    with pytest.raises(ValueError, match=r"^EXPR_MODE must be 'direct' or 'spool', got 'spol'$"):
        et.init("p", "r", dir=tmp_path / "d")
    with pytest.raises(ValueError, match=r"^upload_mode must be"):
        et.init("p", "r", dir=tmp_path / "d", upload_mode="s3")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (([1],), {}, TypeError, "data must be a dict"),
        (({"x": [1]},), {}, TypeError, "'x'"),
        (({"_x": 1},), {}, ValueError, "reserved"),
        (({"x": 1},), {"step": -1}, ValueError, "step must be >= 0"),
        (({"x": 1},), {"step": 1.5}, TypeError, "step must be an int"),
        (({"x": 1},), {"step": True}, TypeError, "step must be an int"),
        (({"x": 1},), {"commit": "yes"}, TypeError, "commit"),
    ],
)
def test_bad_log_raises_at_call_and_writes_nothing(tmp_path, args, kwargs, exc, match):
    run = et.init("p", "r", dir=tmp_path)
    et.log({"ok": 1}, commit=False)
    with pytest.raises(exc, match=match):
        et.log(*args, **kwargs)
    et.finish()
    assert lines(run.shard_path) == [{"_step": 0, "_time": pytest.approx(lines(run.shard_path)[0]["_time"]), "ok": 1}]


def test_log_rank_metrics_validation(tmp_path):
    run = et.init("p", "r", dir=tmp_path)
    cases = [
        (({"t": 1.0}, -1), {}, ValueError, "step"),
        (({"t": 1.0}, 0), {"rank": 4, "world_size": 4}, ValueError, "rank"),
        (({"t": 1.0}, 0), {"world_size": (1 << 20) + 1}, ValueError, "sanity cap"),
        (({"t": 1.0}, 0), {"world_size": 0}, ValueError, "world_size"),
        (({"t": 1.0}, 0), {"local_rank": -1}, ValueError, "local_rank"),
        (({"t": 1.0}, 0), {"weight": math.nan}, ValueError, "weight"),
        (({"t": 1.0}, 0), {"weight": -1.0}, ValueError, "weight"),
        (({}, 0), {}, ValueError, "metrics must not be empty"),
        (({"t": True}, 0), {}, TypeError, r"metrics\['t'\]"),
        (({"t": "x"}, 0), {}, TypeError, r"metrics\['t'\]"),
        (([1], 0), {}, TypeError, "metrics"),
    ]
    for args, kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            run.log_rank_metrics(*args, **kwargs)
    run.log_rank_metrics({"t": 1.5, "n": 3}, step=4, rank=3, world_size=8, local_rank=3, weight=2.0)
    et.finish()
    (rec,) = lines(run.shard_path)
    assert rec["_kind"] == "rank" and rec["_rank"] == 3 and rec["_world_size"] == 8
    assert rec["_weight"] == 2.0 and rec["_step"] == 4 and rec["t"] == 1.5 and rec["n"] == 3
    assert et.history(-1, run=run.paths.run_dir) == []  # rank records are not step rows


def test_integers_outside_int64_and_huge_steps_are_refused_at_the_call(tmp_path):
    """orjson writes up to 2**64-1 and Python has no bound; readers hold int64: refuse the
    rest at the call, naming the key or the step, and nothing of the row is kept."""
    import numpy as np

    run = et.init("p", "r", dir=tmp_path)
    for bad in (2**63, 2**64 - 1, np.uint64(2**64 - 1), 2**70, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"key 'big' is an integer outside int64"):
            et.log({"big": bad})  # the hot path's dict of ints
        with pytest.raises(ValueError, match="'big'"):
            et.log({"ok": 1.0, "big": bad}, step=1)
        with pytest.raises(ValueError, match="'big'"):
            run.log_rank_metrics({"big": bad}, step=1)
    for call in (lambda: et.log({"a": 2}, step=2**70), lambda: et.log({"a": 2}, step=2**53 + 1),
                 lambda: run.log_rank_metrics({"a": 2.0}, step=2**63)):
        with pytest.raises(ValueError, match=r"step must be at most 2\*\*53"):
            call()
    et.log({"a": 2**63 - 1})  # int64's own ends are kept
    et.log({"a": -(2**63)})
    et.log({"a": 1}, step=2**53, commit=True)
    et.log({"a": 2})  # the largest step, then the next: logging goes on
    et.finish()
    assert [(r["_step"], r["a"]) for r in lines(run.shard_path)] == [
        (0, 2**63 - 1), (1, -(2**63)), (2**53, 1), (2**53 + 1, 2)]
    frame = et.read_run(run.paths.run_dir)  # a reader that needs int64 reads them all
    assert frame["a"].tolist() == [2**63 - 1, -(2**63), 1, 2]


def test_streams_have_independent_cursors(tmp_path):
    a = et.init("p", "r", dir=tmp_path)
    for i in range(3):
        et.log({"x": i})
    et.finish()
    b = et.init("p", "r", dir=tmp_path, stream="data")
    et.log({"y": 1})
    et.finish()
    assert [r["_step"] for r in lines(a.shard_path)] == [0, 1, 2]
    assert b.shard_path.name == "metrics.data.jsonl"
    assert [r["_step"] for r in lines(b.shard_path)] == [0]
    assert et.history(-1, run=a.paths.run_dir, stream="data")[0]["y"] == 1


def test_resume_continues_step_and_modes(tmp_path):
    run = et.init("p", "r", dir=tmp_path)
    et.log({"x": 1})
    et.log({"x": 2})
    et.finish()
    with pytest.raises(ValueError, match="resume='never'"):
        et.init("p", "r", dir=tmp_path, resume="never")
    with pytest.raises(ValueError, match="resume='must'"):
        et.init("p", "new", dir=tmp_path, resume="must")
    run = et.init("p", "r", dir=tmp_path, resume="must")
    assert run.step == 2
    et.log({"x": 3})
    et.finish()
    assert [r["_step"] for r in lines(run.shard_path)] == [0, 1, 2]


def test_history_self_and_filters(tmp_path):
    et.init("p", "r", dir=tmp_path)
    for i in range(10):
        et.log({"loss": i / 10, "acc": i})
    rows = et.history(3)  # read-your-writes before any background flush
    assert [r["_step"] for r in rows] == [7, 8, 9]
    rows = et.history(-1, metrics=["acc"], step_range=(2, 5))
    assert rows == [{"_step": s, "_time": rows[s - 2]["_time"], "acc": s} for s in (2, 3, 4)]
    assert len(et.history(None)) == 10
    pytest.importorskip("pandas")
    df = et.history(-1, output_type="pandas")
    assert list(df["acc"]) == list(range(10))


def _warnings_from(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_enospc_is_one_warning_rows_kept_and_retried(tmp_path, monkeypatch):
    run = et.init("p", "r", dir=tmp_path)
    real_write = os.write
    shard_fd = {"fd": None}

    def full_disk(fd, data):
        if shard_fd["fd"] is not None and fd == shard_fd["fd"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    et.log({"x": 0})
    et.flush()
    shard_fd["fd"] = run._sink.writer._fd
    monkeypatch.setattr(os, "write", full_disk)

    def burst():
        for i in range(1, 50):
            et.log({"x": i})
            et.flush()

    msgs = _warnings_from(burst)
    assert len([m for m in msgs if "No space left" in m]) == 1, msgs
    assert run.info()["buffered_bytes"] > 0
    monkeypatch.setattr(os, "write", real_write)
    et.flush()
    et.finish()
    assert [r["x"] for r in lines(run.shard_path)] == list(range(50))
    assert run.info()["dropped"] == {}


def test_buffer_bound_counts_drops(tmp_path, monkeypatch):
    run = et.init("p", "r", dir=tmp_path)
    writer = run._sink.writer
    writer.max_buffer_bytes = 2000
    real_write = os.write
    et.log({"x": 0})
    et.flush()
    fd = writer._fd
    monkeypatch.setattr(os, "write", lambda f, d: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")) if f == fd else real_write(f, d))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(1, 200):
            et.log({"x": i})
            et.flush()
    monkeypatch.setattr(os, "write", real_write)
    et.finish()
    dropped = run.info()["dropped"]["buffer_full"]
    kept = [r["x"] for r in lines(run.shard_path)]
    assert dropped > 0
    assert len(kept) + dropped == 200
    assert kept[-1] == 199 and kept == sorted(kept)


def test_deleted_run_directory_is_recreated(tmp_path):
    run = et.init("p", "r", dir=tmp_path)
    et.log({"x": 0})
    et.flush()
    shutil.rmtree(run.paths.run_dir)
    msgs = _warnings_from(lambda: (et.log({"x": 1}), et.flush()))
    assert any("deleted" in m for m in msgs)
    et.log({"x": 2})
    et.finish()
    assert [r["x"] for r in lines(run.shard_path)] == [1, 2]


def test_readonly_filesystem_never_raises(tmp_path):
    """A run root on a read-only filesystem that becomes writable later in the run.

    Root ignores permission bits, so this uses a real read-only mount: a tmpfs in a
    private mount namespace (`unshare -m`), remounted writable mid-run. (A file that is
    already open keeps writing when its directory turns read-only; the open is what fails.)
    """

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = f"""
import json, subprocess, warnings, expr_tracker as et
mnt = {str(mnt)!r}
subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", mnt], check=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run = et.init("p", "r", dir=mnt)  # the run root is read-only: init must not raise
    for i in range(20):
        et.log({{"x": i}})
        et.flush()
    buffered = run.info()["buffered_bytes"]
    subprocess.run(["mount", "-o", "remount,rw", mnt], check=True)
    et.log({{"x": 20}})
et.finish()
rows = [json.loads(x)["x"] for x in open(run.shard_path)]
print(json.dumps({{"warnings": [str(w.message) for w in caught], "buffered": buffered,
                  "rows": rows, "dropped": run.info()["dropped"]}}))
"""
    got = in_mount_namespace(code, timeout=60)
    ro = [w for w in got["warnings"] if "Read-only file system" in w]
    assert len(ro) == 1, got["warnings"]  # one warning per cause, not one per flush
    assert got["buffered"] > 0
    assert got["rows"] == list(range(21))
    assert got["dropped"] == {}
