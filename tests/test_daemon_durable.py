"""exprd's writer thread (daemon/durable.py): order, replacement, and "saved" only once on disk."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
from exprd.durable import Durable
from exprd.state import Checkpoints, StateDir


def _blocker(durable: Durable) -> threading.Event:
    """A job that holds the writer thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()

    def write() -> None:
        started.set()
        release.wait(10)

    durable.submit("blocker", write, lambda exc: None)
    assert started.wait(10)
    return release


def test_jobs_run_in_order_and_a_queued_file_takes_the_newer_bytes_in_its_place(tmp_path: Path) -> None:
    durable = Durable()
    written: list[str] = []
    results: list[tuple[str, BaseException | None]] = []
    release = _blocker(durable)

    def job(key: str, data: str) -> None:
        def write() -> None:
            (tmp_path / key).write_text(data)
            written.append(f"{key}={data}")

        durable.submit(key, write, lambda exc: results.append((data, exc)))

    job("sidecar", "old")
    job("checkpoint", "c1")
    job("sidecar", "new")  # queued, not started: replaced where it stands, before c1
    assert durable.pending("sidecar") and durable.pending("checkpoint")
    release.set()
    assert durable.wait(timeout=10)
    assert written == ["sidecar=new", "checkpoint=c1"]
    # callbacks ran here, on this thread, once each per job that ran
    assert results == [("new", None), ("c1", None)]
    assert not durable.pending("sidecar") and not durable.busy()
    durable.close()


def test_a_callback_runs_only_when_collected_and_gets_the_error(tmp_path: Path) -> None:
    durable = Durable()
    got: list[BaseException | None] = []
    durable.submit("x", lambda: os.open(tmp_path / "missing" / "f", os.O_RDONLY),
                   got.append)
    with durable._cond:  # wait for the job itself, not for its callback
        durable._cond.wait_for(lambda: durable._done, 10)
    assert got == [] and durable.pending("x")
    durable.collect()
    assert len(got) == 1 and isinstance(got[0], FileNotFoundError)
    assert not durable.pending("x")
    durable.close()


def test_a_checkpoint_counts_as_saved_only_once_it_is_on_disk(tmp_path: Path) -> None:
    durable = Durable()
    sdir = StateDir(tmp_path / "state")
    cp = Checkpoints(sdir, durable=durable)
    release = _blocker(durable)
    cp.put("a.jsonl", {"ino": 1, "shard": 10, "seq": 3})
    on_disk: list[int] = []
    cp.save(lambda: on_disk.append(1))
    assert cp.writing and not cp.dirty and cp.saved_at == 0.0
    assert not (tmp_path / "state" / "checkpoints.json").exists()
    # a newer state waits: one snapshot on its way at a time (it never overtakes a sidecar)
    cp.put("a.jsonl", {"ino": 1, "shard": 20, "seq": 5})
    cp.save(lambda: on_disk.append(2))
    assert cp.dirty
    durable.collect()
    assert on_disk == []
    release.set()
    durable.wait(timeout=10)
    assert on_disk == [1] and cp.saved_at > 0 and not cp.writing
    saved = orjson.loads((tmp_path / "state" / "checkpoints.json").read_bytes())
    assert saved["files"]["a.jsonl"]["shard"] == 10
    cp.save(lambda: on_disk.append(2))
    durable.wait(timeout=10)
    assert on_disk == [1, 2]
    saved = orjson.loads((tmp_path / "state" / "checkpoints.json").read_bytes())
    assert saved["files"]["a.jsonl"]["shard"] == 20
    durable.close()
    sdir.close()


def test_a_checkpoint_that_cannot_be_written_stays_dirty_and_is_reported(tmp_path: Path) -> None:
    durable = Durable()
    state = tmp_path / "state"
    sdir = StateDir(state)
    warned: list[str] = []
    cp = Checkpoints(sdir, lambda cause, message: warned.append(message), durable=durable)
    state.rmdir()  # the descriptor stays; nothing can be created in a removed directory
    cp.put("a.jsonl", {"ino": 1, "shard": 10, "seq": 3})
    on_disk: list[int] = []
    cp.save(lambda: on_disk.append(1))
    durable.wait(timeout=10)
    assert on_disk == [] and cp.dirty and not cp.writing and cp.saved_at == 0.0
    assert len(warned) == 1 and "cannot write checkpoints" in warned[0]
    durable.close()
    sdir.close()
