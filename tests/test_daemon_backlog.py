"""A spool backlog of thousands of segments, and what other processes do to spool files
(issue 52 items 3-4, DESIGN 6 and 8): segments written in the SDK's format
(`tests.segfiles`), real exprd processes, real files."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from typer.testing import CliRunner

from expr_cli.main import build_app
from tests.segfiles import init_line, row_line, segment_path, write_segments
from tests.test_daemon import (
    exprd_once,
    lines_of,
    sidecar,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)


def _shard(root: Path, name: str) -> Path:
    return root / "p" / name / "metrics.jsonl"


def _check_once_in_order(shard: Path, n: int) -> None:
    rows = lines_of(shard)
    assert [r["_seq"] for r in rows] == list(range(1, n + 1))
    assert [r["i"] for r in rows] == list(range(n))


def test_a_backlog_of_2000_segments_is_applied_once_in_order_after_a_restart(
        tmp_path: Path) -> None:
    """2,000 segments of one session (exprd was down a while): a daemon killed -9 while
    it applies them, then one with a fresh state directory, apply every row once, in
    `_seq` order, and leave only the last segment (RecursionError before, at every start)."""
    spool, root = tmp_path / "spool", tmp_path / "runs"
    write_segments(spool, root, "back", 2000)
    shard = _shard(root, "back")
    first = write_config(tmp_path / "a.toml", spool, tmp_path / "state-a", [root])
    d = start_exprd(first)
    try:
        wait_for(lambda: shard.exists(), 30, "the first rows")
    finally:
        os.kill(d.pid, signal.SIGKILL)
        d.wait()
    fresh = write_config(tmp_path / "b.toml", spool, tmp_path / "state-b", [root])
    d = start_exprd(fresh)
    try:
        wait_ready(tmp_path / "state-b", d, timeout=120)
        wait_for(lambda: sidecar(shard.with_name("metrics.meta.json")).get("status")
                 == "finished", 60, "the run to read finished")
        wait_for(lambda: len(list((spool / "p" / "back").glob("*.jsonl"))) == 1, 30,
                 "the applied segments to be deleted")
    finally:
        assert stop(d) == 0
    _check_once_in_order(shard, 2000)
    assert [p.name for p in (spool / "p" / "back").glob("*.jsonl")] == \
        [segment_path(spool, "back", "s0000000001", 1999).name]


def test_replay_of_a_backlog_applies_once_deletes_what_it_applied_and_says_so(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`expr replay` walks 2,000 segments (it died of RecursionError), applies each row
    once, deletes the rolled segments it applied (they stayed behind silently) and says
    how many; a second replay changes nothing."""
    monkeypatch.setenv("COLUMNS", "200")
    spool, root = tmp_path / "spool", tmp_path / "runs"
    write_segments(spool, root, "back", 2000)
    app, runner = build_app(), CliRunner()
    args = ["replay", str(spool), "--state", str(tmp_path / "state")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "applied 2000 events" in result.output, result.output
    assert "deleted 1999 applied segments" in result.output, result.output
    shard = _shard(root, "back")
    _check_once_in_order(shard, 2000)
    assert sidecar(shard.with_name("metrics.meta.json"))["status"] == "finished"
    assert len(list((spool / "p" / "back").glob("*.jsonl"))) == 1
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["applied"] == 0 and summary["deleted"] == 0, summary
    _check_once_in_order(shard, 2000)


def _status(state: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((state / "status.json").read_text())


def test_a_page_of_zeros_inside_a_finished_segment_is_skipped(tmp_path: Path) -> None:
    """A 4 KiB page of a finished segment reads as zeros (writeback order before a power
    loss): the rows after it and the finish are applied (the reader stopped at the first
    NUL: rows lost, the run read crashed); the lines it cut are quarantined and the rows
    it held are said missing."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    [seg] = write_segments(spool, root, "zero", 1, rows=300)
    data = bytearray(seg.read_bytes())
    lines, at = [], 0
    for line in bytes(data).split(b"\n")[:-1]:
        lines.append((at, at + len(line) + 1))
        at += len(line) + 1
    # rows (line 1 on: line 0 is the init) wholly outside the page
    kept = [i - 1 for i, (a, b) in enumerate(lines[:-1]) if i and (b <= 4096 or a >= 8192)]
    cut = sum(1 for a, b in lines if a < 4096 < b or a < 8192 < b)
    assert cut == 2 and len(kept) < 290
    data[4096:8192] = bytes(4096)
    seg.write_bytes(bytes(data))
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    proc = exprd_once(cfg)
    shard = _shard(root, "zero")
    assert [r["i"] for r in lines_of(shard)] == kept
    assert sidecar(shard.with_name("metrics.meta.json"))["status"] == "finished"
    assert "skipped 4096 NUL bytes at offset" in proc.stderr, proc.stderr
    st = _status(state)
    assert st["totals"]["quarantined"] + st["deleted"]["quarantined"] >= cut + 1, st


def test_zeros_at_the_live_end_of_a_segment_are_not_yet_written_rows(tmp_path: Path) -> None:
    """A live segment preallocated with zeros after its data: the zeros are where the
    writer goes on, not a gap; rows written into them later are applied, in order, with
    nothing skipped or quarantined."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    [seg] = write_segments(spool, root, "live", 1, rows=10, finish=False)
    end = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(1 << 16)  # zeros up to 64 KiB, as a preallocated segment has
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra='crash_silence = "1h"\n')
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        shard = _shard(root, "live")
        wait_for(lambda: len(lines_of(shard)) == 10, 20, "the first 10 rows")
        more = b"".join(row_line(seq) for seq in range(11, 31))
        with open(seg, "r+b") as f:
            f.seek(end)
            f.write(more)
        wait_for(lambda: len(lines_of(shard)) == 30, 20, "the 20 rows written later")
        st = _status(state)
        assert st["totals"]["quarantined"] == 0, st
        assert not [k for k in st["errors"] if k.startswith("nul:")], st["errors"]
    finally:
        assert stop(d) == 0
    _check_once_in_order(shard, 30)


def test_a_live_segment_moved_away_is_counted_and_its_session_goes_on(tmp_path: Path) -> None:
    """`mv` of the segment being written (no copy back): the writer's last rows went into
    the moved file. exprd counts them (`spool_moved`, 5 events) in status.json and the
    shard's sidecar, warns, and applies the session's next segment (before: counted
    nowhere)."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    [seg] = write_segments(spool, root, "mv", 1, rows=10, finish=False)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra='crash_silence = "1h"\n')
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    try:
        wait_ready(state, d)
        shard = _shard(root, "mv")
        wait_for(lambda: len(lines_of(shard)) == 10, 20, "the first 10 rows")
        away = tmp_path / "moved.jsonl"
        seg.rename(away)
        with open(away, "ab") as f:  # the writer goes on in its file until it notices
            f.write(b"".join(row_line(seq) for seq in range(11, 16)))
        nxt = segment_path(spool, "mv", "s0000000001", 1)
        body = [init_line(root, "mv", "s0000000001", 1, 16)]
        body += [row_line(seq) for seq in range(16, 21)]
        body.append(b'{"_event":"finish","_time":1.0e9,"status":"finished","_seq":21}\n')
        nxt.write_bytes(b"".join(body))
        side = shard.with_name("metrics.meta.json")
        wait_for(lambda: sidecar(side).get("status") == "finished", 20, "the finish")
        wait_for(lambda: _status(state).get("dropped") == {"spool_moved": 5}, 20,
                 "spool_moved in status.json")
    finally:
        assert stop(d) == 0
    assert [r["_seq"] for r in lines_of(shard)] == [*range(1, 11), *range(16, 21)]
    notes = sidecar(side).get("dropped")
    assert [(n["cause"], n["rows"]) for n in notes] == [("spool_moved", 5)], notes
    assert "was moved away while in use: 5 events after _seq 10" in log.read_text()


def test_segments_truncated_under_exprd_lose_only_what_was_cut_and_nothing_twice(
        tmp_path: Path) -> None:
    """Live segments shrunk under a running exprd (`: > f`, `truncate -s 100`, and a
    copytruncate whose writer goes on at its offset, leaving zeros before its new rows),
    then grown again: exprd keeps running, says what it lost, applies the new rows and
    never one row twice."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    names = ("empty", "cut", "hole", "again")
    segs = {name: write_segments(spool, root, name, 1, rows=10, finish=False,
                                 session=f"s{name}")[0] for name in names}
    before = segs["again"].read_bytes()
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra='crash_silence = "1h"\n')
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    more = b"".join(row_line(seq) for seq in range(11, 16)) + \
        b'{"_event":"finish","_time":1.0e9,"status":"finished","_seq":16}\n'
    try:
        wait_ready(state, d)
        for name in segs:
            wait_for(lambda n=name: len(lines_of(_shard(root, n))) == 10, 20, f"{name}: 10 rows")
        end = segs["hole"].stat().st_size
        with open(segs["empty"], "r+b") as f:
            f.truncate(0)
        with open(segs["cut"], "r+b") as f:
            f.truncate(100)
        for name in ("hole", "again"):
            with open(segs[name], "r+b") as f:
                f.truncate(0)
        time.sleep(1.0)  # exprd sees them shrunk (a rescan is 0.2 s)
        for name, seg in segs.items():
            with open(seg, "r+b") as f:
                if name == "hole":  # the writer goes on at its offset: zeros before
                    f.seek(end)
                elif name == "again":  # what was there comes back (a copy), and more
                    f.write(before)
                else:  # the writer appends (O_APPEND)
                    f.seek(0, os.SEEK_END)
                f.write(more)
        for name in segs:
            side = _shard(root, name).with_name("metrics.meta.json")
            wait_for(lambda s=side: sidecar(s).get("status") == "finished", 20, f"{name}: finish")
        assert d.poll() is None
    finally:
        assert stop(d) == 0
    for name in ("empty", "hole", "again"):
        _check_once_in_order(_shard(root, name), 15)
    # `truncate -s 100` left part of the init line, and row 11 was appended to it: that
    # line is quarantined and the _seq gap said; the rest is applied once
    assert [r["_seq"] for r in lines_of(_shard(root, "cut"))] == [*range(1, 11), *range(12, 16)]
    text = log.read_text()
    assert text.count("truncated to") == 4, text
    assert f"skipped {end} NUL bytes at offset 0" in text, text
    assert "_seq gap: 11..11 missing" in text, text
    st = _status(state)
    assert st["errors"][f"truncated:{segs['cut']}"] == 1, st["errors"]


def test_segments_moved_away_before_exprd_saw_them_are_counted(tmp_path: Path) -> None:
    """Segments moved away (`mv`, no copy back) while exprd was down, never read: their
    events are counted (`spool_moved`, from the gap between the shard's last `_seq` of the
    session and the next segment's first) in the sidecar, the others applied (found by
    test_spool_property: the first and a middle segment moved, counted nowhere)."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    segs = write_segments(spool, root, "mvd", 4, rows=10)
    segs[0].rename(tmp_path / "moved0.jsonl")
    segs[2].rename(tmp_path / "moved2.jsonl")
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    shard = _shard(root, "mvd")
    assert [r["_seq"] for r in lines_of(shard)] == [*range(11, 21), *range(31, 41)]
    side = sidecar(shard.with_name("metrics.meta.json"))
    assert side["status"] == "finished"
    assert [(n["cause"], n["rows"]) for n in side.get("dropped", [])] == [("spool_moved", 20)]


def test_rows_under_a_page_of_zeros_are_counted(tmp_path: Path) -> None:
    """A page of zeros inside a finished segment (writeback order before a power loss):
    the rows after it are applied, and the events it took (the rows it covers and the two
    it cut) are counted (`spool_zeroed`) in the sidecar (found by test_spool_property:
    they were counted nowhere)."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    [seg] = write_segments(spool, root, "zp", 1, rows=1000)
    data = seg.read_bytes()
    lost, at = [], 0
    for line in data.splitlines(keepends=True):
        if at < 12288 and at + len(line) > 8192:
            lost.append(json.loads(line)["_seq"])
        at += len(line)
    with open(seg, "r+b") as f:
        f.seek(8192)
        f.write(b"\0" * 4096)
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    shard = _shard(root, "zp")
    assert [r["_seq"] for r in lines_of(shard)] == [s for s in range(1, 1001) if s not in lost]
    side = sidecar(shard.with_name("metrics.meta.json"))
    assert side["status"] == "finished"
    assert [(n["cause"], n["rows"]) for n in side.get("dropped", [])] == \
        [("spool_zeroed", len(lost))]


def test_a_segment_applied_and_deleted_that_ended_in_an_event_is_not_counted_moved(
        tmp_path: Path) -> None:
    """A segment whose last event is not a record (a rules event) is applied and deleted
    before its session's next segment is there: its absence then is no move, and nothing
    is counted (the shard's last `_seq` is its last row's, below the next first_seq - 1)."""
    spool, root, state = tmp_path / "spool", tmp_path / "runs", tmp_path / "state"
    [seg0, seg1] = write_segments(spool, root, "ev", 2, rows=5)
    seg1.unlink()
    lines = seg0.read_bytes().splitlines(keepends=True)
    config = b'{"_event":"rules","_time":1.0e9,"rules":[],"_seq":6}\n'
    seg0.write_bytes(b"".join([*lines[:-1], config, lines[-1]]))
    # segment 1 starts at _seq 7, past the rules event
    head = init_line(root, "ev", "s0000000001", 1, 7)
    rows = [row_line(s + 1) for s in range(6, 11)] + \
        [b'{"_event":"finish","_time":1.0e9,"status":"finished","_seq":12}\n']
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        wait_for(lambda: not seg0.exists(), 20, "segment 0 applied and deleted")
        seg1.write_bytes(b"".join([head, *rows]))
        side = _shard(root, "ev").with_name("metrics.meta.json")
        wait_for(lambda: sidecar(side).get("status") == "finished", 20, "the finish")
    finally:
        assert stop(d) == 0
    assert [r["_seq"] for r in lines_of(_shard(root, "ev"))] == [1, 2, 3, 4, 5, *range(7, 12)]
    assert sidecar(side).get("dropped", []) == []
