"""A spool file rotated while exprd runs (issue 20): `mv f f.1`, then `cp f.1 f`.

logrotate without copytruncate: the SDK notices its file moved and goes on in a new
session (tests/test_sdk_faults.py); the copy that takes the old name repeats records
exprd may have applied already, under the same session and `_seq`s. Each record is
applied once whatever file it comes in, and a stale copy of an older session never
changes the status its newer session gave the shard. Real exprd processes (a daemon,
`--once`, `kill -9` between the move and the copy), real spool files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.procs import spawn
from tests.test_daemon import (
    count_lines,
    exprd_once,
    lines_of,
    sidecar,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)

# a writer in three parts of 20 rows; it waits for a line on stdin after the first two
WRITER = """
import json, sys, expr_tracker as et
run = et.init("p", "rot", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
for part in range(3):
    for i in range(20 * part, 20 * part + 20):
        et.log({{"i": i}})
    et.flush()
    print(json.dumps(run.info()["spool_file"]), flush=True)
    if part < 2:
        sys.stdin.readline()
et.finish()
"""


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.spool, self.state, self.root = tmp / "spool", tmp / "state", tmp / "runs"
        self.cfg = write_config(tmp / "exprd.toml", self.spool, self.state, [self.root])
        self.log = self.cfg.with_suffix(".log")
        self.shard = self.root / "p" / "rot" / "metrics.jsonl"
        self.writer = spawn(WRITER.format(root=str(self.root), spool=str(self.spool)),
                            stdin=subprocess.PIPE)
        self.first = self.next_part()
        self.moved = self.first.with_name(self.first.name + ".1")

    def next_part(self, go: bool = False) -> Path:
        """The spool file after the writer's next 20 rows (flushed)."""
        w = self.writer
        assert w.stdin is not None and w.stdout is not None
        if go:
            w.stdin.write("\n")
            w.stdin.flush()
        return Path(json.loads(w.stdout.readline()))

    def finish(self) -> None:
        _, err = self.writer.communicate("\n", timeout=60)
        assert self.writer.returncode == 0, err
        assert err.count("was deleted or moved while in use") == 1, err

    def rows(self) -> list[tuple[int, int]]:
        """(i, _step) of every step row in the shard, in shard order."""
        return [(r["i"], r["_step"]) for r in lines_of(self.shard) if "i" in r]

    def status(self) -> str | None:
        return sidecar(self.shard.with_name("metrics.meta.json")).get("status")

    def check(self) -> None:
        """Every row once (as many rows as (session, seq) pairs), the run finished."""
        recs = [r for r in lines_of(self.shard) if "i" in r]
        assert sorted(self.rows()) == [(i, i) for i in range(60)]
        assert len({(r["_sid"], r["_seq"]) for r in recs}) == 60
        assert self.status() == "finished"


def _files(state: Path) -> dict[str, Any]:
    return json.loads((state / "status.json").read_text())["files"]


def test_a_copy_of_an_applied_file_is_not_applied_again_by_a_running_exprd(tmp_path):
    s = Setup(tmp_path)
    d = start_exprd(s.cfg)
    try:
        wait_ready(s.state, d)
        wait_for(lambda: len(s.rows()) == 20, 20, "the first 20 rows")
        s.first.rename(s.moved)
        second = s.next_part(go=True)  # the SDK went on in a new session, still live
        assert second != s.first
        wait_for(lambda: len(s.rows()) == 40, 20, "the new session's 20 rows")
        shutil.copyfile(s.moved, s.first)  # the copy: same session, same _seqs, a new inode
        size = s.first.stat().st_size
        wait_for(lambda: _files(s.state).get(str(s.first), {}).get("offset") == size, 20,
                 "exprd to read the copy")
        assert len(s.rows()) == 40  # not 60: the copy's 20 rows are in the shard already
        s.finish()
        wait_for(lambda: s.status() == "finished" and len(s.rows()) >= 60, 20, "the finish")
        wait_for(lambda: _files(s.state).get(str(s.first), {}).get("state") == "crashed", 20,
                 "the copy's writer to be seen gone")
    finally:
        assert stop(d) == 0
    s.check()
    assert _files(s.state)[str(s.first)]["replaced"] == {"applied": 0, "skipped": 20}
    log = s.log.read_text()
    # what the copy brought: one line, not one per record
    assert log.count("are in the shard already") == 1, log
    assert f"records of session {s.first.name.split('.')[1]} up to _seq 20" in log, log
    assert "keeps its status (a newer session" in log and "marking" not in log, log


def test_kill9_of_exprd_between_the_move_and_the_copy(tmp_path):
    s = Setup(tmp_path)
    d = start_exprd(s.cfg)
    try:
        wait_ready(s.state, d)
        wait_for(lambda: len(s.rows()) == 20, 20, "the first 20 rows")
        s.first.rename(s.moved)
        s.next_part(go=True)
        wait_for(lambda: len(s.rows()) == 40, 20, "the new session's 20 rows")
        d.kill()  # SIGKILL: whatever checkpoints were not saved yet are lost
        d.wait()
        shutil.copyfile(s.moved, s.first)
        d = start_exprd(s.cfg)
        wait_ready(s.state, d)
        s.finish()
        wait_for(lambda: s.status() == "finished" and len(s.rows()) >= 60, 20, "the finish")
        wait_for(lambda: _files(s.state).get(str(s.first), {}).get("state") == "crashed", 20,
                 "the copy read to its end")
    finally:
        assert stop(d) == 0
    s.check()


def test_once_a_stale_copy_after_the_run_finished_leaves_it_finished(tmp_path):
    """`exprd --once` after the job applied both sessions; the copy comes back later."""
    s = Setup(tmp_path)
    exprd_once(s.cfg)
    s.first.rename(s.moved)
    s.next_part(go=True)
    s.finish()
    exprd_once(s.cfg)
    assert s.status() == "finished"
    shutil.copyfile(s.moved, s.first)
    out = exprd_once(s.cfg)
    s.check()
    assert "keeps its status" in out.stderr and "marking" not in out.stderr, out.stderr


def test_once_a_copy_with_rows_never_applied_adds_them_and_the_run_stays_finished(tmp_path):
    """The moved file was never read: its copy, applied after the new session finished
    the run, brings its 20 rows and leaves the status alone (not `running`, not
    `crashed`); a running exprd does the same."""
    s = Setup(tmp_path)
    s.first.rename(s.moved)
    s.next_part(go=True)
    s.finish()
    exprd_once(s.cfg)
    assert s.status() == "finished" and len(s.rows()) == 40
    shutil.copyfile(s.moved, s.first)
    exprd_once(s.cfg)
    s.check()


def test_a_running_exprd_applies_a_late_copy_without_reopening_the_run(tmp_path):
    s = Setup(tmp_path)
    s.first.rename(s.moved)
    s.next_part(go=True)
    s.finish()
    d = start_exprd(s.cfg)
    try:
        wait_ready(s.state, d)
        wait_for(lambda: s.status() == "finished" and len(s.rows()) == 40, 20, "the run")
        shutil.copyfile(s.moved, s.first)
        wait_for(lambda: len(s.rows()) == 60, 20, "the copy's 20 rows")
        wait_for(lambda: _files(s.state).get(str(s.first), {}).get("state") == "crashed", 20,
                 "the copy read to its end")
        assert count_lines(s.shard) >= 60
    finally:
        assert stop(d) == 0
    s.check()
