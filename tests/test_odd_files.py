"""Readers under odd files (issue 54): a NUL hole followed by lines, as a rank that resumed
after its node crashed leaves it. Real sparse files (truncate), real processes; the
memory a reader holds is measured (tracemalloc in process, the child's peak RSS from
`wait4`), and the bytes it reads (`/proc/self/io`), never its time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.procs import env_for
from tests.synthetic import write_run

HOLE = 1 << 30  # a GiB of sparse hole: free on disk, 4 GB of RSS to a reader that holds it
STEPS = 200


def _holed(root: Path, how: str) -> Path:
    """A 4-rank finished run whose rank 1 has its first 100 steps, a 1 GiB hole, then its
    last steps: "many" (steps 100-199), "one" (only the rank record of step 100), or "torn"
    (a line cut by the crash before the hole, then steps 100-199)."""
    run = write_run(root / "p" / "r", 4, STEPS, status="finished")
    shard = run / "metrics.rank1.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    head = b"".join(lines[:STEPS])
    if how == "torn":
        head += lines[STEPS][:30]
    shard.write_bytes(head)
    os.truncate(shard, len(head) + HOLE)
    with open(shard, "ab") as fh:
        fh.write(lines[STEPS + 1] if how == "one" else b"".join(lines[STEPS:]))
    return shard


def _read_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


@contextmanager
def _bounded(limit: int = 48 << 20) -> Iterator[None]:
    """The block holds at most `limit` bytes of Python memory and reads at most `limit`
    bytes through system calls (a hole read through is a GiB of zeros)."""
    tracemalloc.start()
    before = _read_bytes()
    try:
        yield
        read = _read_bytes() - before
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"held {peak:,} bytes"
    assert read < limit, f"read {read:,} bytes"


@pytest.mark.parametrize("how", ["many", "one", "torn"])
def test_the_shard_readers_step_over_a_hole_in_bounded_memory_and_reads(
        tmp_path: Path, how: str) -> None:
    from expr_tracker.store import records, window
    from expr_tracker.store.reader import ShardReader, select_rows

    shard = _holed(tmp_path, how)
    after = [STEPS // 2] if how == "one" else list(range(STEPS // 2, STEPS))
    rank_steps = list(range(STEPS // 2)) + after
    with _bounded():
        recs = ShardReader(shard).records()
    assert [r["_step"] for r in recs if r.get("_kind") == "rank"] == rank_steps
    with _bounded():
        back = list(ShardReader(shard).iter_reverse())
    assert back == recs[::-1]
    with _bounded():
        rows = select_rows(ShardReader(shard), 5, kind="rank")
    assert [r["_step"] for r in rows] == rank_steps[-5:]
    with _bounded(), open(shard, "rb") as fh:
        assert window.last_step(fh) == rank_steps[-1]
        assert records.complete_end(fh) == fh.seek(0, 2)
        start = window.window_start(fh, STEPS // 2)
        fh.seek(start)
        assert fh.read(1) == b"{"  # a line's start, after the hole
        fh.seek(0)
        assert window.window_start(fh, 10) < 4096


# runs the command and writes its peak RSS (its own and its reaped workers') to fd argv[1]
_LAUNCH = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
os.write(int(sys.argv[1]), str(usage.ru_maxrss * 1024).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _expr(*args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run `expr ARGS` as a child: its result and its peak resident memory in bytes.

    Measured by a small launcher process (`_LAUNCH`) that starts it and reaps it with
    `wait4`, not by this process: Linux carries a process's peak RSS across its exec
    (`ru_maxrss` keeps the larger of the two), so a child forked from a test process that
    earlier tests grew (an xdist worker, a whole serial run) reported that process's
    peak, hundreds of MB, whatever the command read."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(w), sys.executable, "-m",
                                 "expr_cli.main", *args], env=env_for(), pass_fds=(w,),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.close(w)
        w = -1
        out, err = proc.communicate()
        with os.fdopen(r, "rb") as fh:
            r = -1
            rss = int(fh.read() or b"0")
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    return (subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode()),
            rss)


def test_a_childs_measured_memory_is_its_own_not_the_test_process(tmp_path: Path) -> None:
    """The test process holding (or having held) 300 MB does not make `_expr` report a
    command's memory as 300 MB: under `pytest -n 4` a worker's earlier tests did, and the
    holed-run test failed on a 760 MB it never read."""
    run = write_run(tmp_path / "p" / "r", 2, 20, status="finished")
    held = b"\1" * (300 << 20)
    try:
        out, rss = _expr("summary", str(run), "--json")
    finally:
        del held
    assert out.returncode == 0, out.stderr
    assert 0 < rss < 200 << 20, f"{rss:,} bytes resident"


@pytest.mark.parametrize("how", ["one", "torn"])
def test_every_command_reads_a_holed_run_in_tens_of_megabytes(tmp_path: Path, how: str) -> None:
    """Before: 4.4 GB of RSS and 15-100 s each (the reverse reads doubled their block over
    the hole, the forward read carried the torn line and the hole after it)."""
    _holed(tmp_path, how)
    run = str(tmp_path / "p" / "r")
    for args in (["summary", run, "--json"], ["top", run, "--once", "--json"],
                 ["shards", run, "--json"], ["watch", run, "--once", "--json"]):
        out, rss = _expr(*args)
        assert out.returncode == 0, (args, out.stderr)
        assert rss < 200 << 20, (args, f"{rss:,} bytes resident")
        if args[0] == "summary":
            assert json.loads(out.stdout)["ranks"]["frontier"] == STEPS - 1


def test_expr_shards_counts_the_rows_around_a_hole_without_reading_it(tmp_path: Path) -> None:
    from expr_cli.data.runs import _count_lines

    shard = _holed(tmp_path, "many")
    before = _read_bytes()
    with open(shard, "rb") as fh:
        assert _count_lines(fh.fileno(), 0, fh.seek(0, 2)) == 2 * STEPS
    assert _read_bytes() - before < 16 << 20


# row 2: an incidents file over the 4 MiB read per pass


def test_a_one_pass_reader_sees_the_whole_incidents_file_in_bounded_memory(tmp_path: Path) -> None:
    """64 MiB of incidents opened and resolved, between an incident opened first and
    resolved last and a crash opened last: before, a reader of one pass (`watch --once`,
    `top --once`, `summary`, MCP) read the first 4 MiB: the first open, the crash missed."""
    from expr_tracker.health.incidentlog import open_incidents
    from expr_tracker.health.incidents import Incident

    run = write_run(tmp_path / "p" / "r", 4, 20, status="running")

    def line(inc: Incident, **kw: object) -> bytes:
        return json.dumps({**inc.as_line(), **kw}).encode() + b"\n"

    first = Incident("stall", (), (), 3, 1.0, 2.0, "stalled", id="first")
    crash = Incident("crashed", (2,), ("gpu-0000",), 10, 9.0, 9.0, "crashed", id="crash")
    filler = [Incident("straggler", (1,), ("gpu-0000",), s, 3.0, 4.0, "x" * 300, id=f"f{s}")
              for s in range(1000)]
    body = b"".join(line(f) + line(f, state="resolved") for f in filler)
    with open(run / "incidents.jsonl", "wb") as fh:
        fh.write(line(first))
        while fh.tell() < 64 << 20:
            fh.write(body)
        fh.write(line(first, state="resolved") + line(crash))
    tracemalloc.start()
    try:
        opened = open_incidents(run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [i.id for i in opened] == ["crash"]
    assert peak < 32 << 20, f"held {peak:,} bytes"  # (10,000 lines kept as `others`)
    out, _ = _expr("watch", str(run), "--once", "--json")
    assert "crash" in out.stdout and '"first"' not in out.stdout, out.stdout[-2000:]


# row 4: MCP arguments


def test_mcp_arguments_are_checked_strictly_and_errors_capped(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from tests.mcpclient import McpClient

    root = tmp_path / "runs"
    write_run(root / "proj" / "big", 4, 40)
    with McpClient(["--dir", str(root)], env_for()) as c:
        huge = c.call("run_summary", run="big", steps="0:99999999999999999999")
        assert huge.error and "run_summary: steps: " in huge.text, huge.text[:500]
        long = c.call("run_summary", run="r" * 3_000_000)
        assert long.error and len(long.text.encode()) <= 48_000, len(long.text)
        assert "run_summary: run: " in long.text, long.text[:200]
        for bad in ("0", True, 1.0):
            a = c.call("rank_vs_median", run="big", rank=bad)
            assert a.error and "rank" in a.text, (bad, a.text[:300])
        assert not c.call("rank_vs_median", run="big", rank=1).error


# row 5: host names


EVIL = "../../evil\nx\u202e"


def test_control_and_bidi_characters_in_a_host_name_print_as_escapes(tmp_path: Path) -> None:
    run = write_run(tmp_path / "p" / "r", 4, 30, crashed=2, status="running")
    side = run / "metrics.rank2.meta.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "host": EVIL}))
    for args in (["watch", str(run), "--once"], ["top", str(run), "--once"], ["summary", str(run)]):
        out, _ = _expr(*args)
        assert "evil" in out.stdout, (args, out.stdout, out.stderr)
        assert "\u202e" not in out.stdout and "\nx" not in out.stdout, (args, out.stdout)
        assert "evil\\nx\\u202e" in out.stdout.replace("\n", "").replace("│", ""), out.stdout


def test_host_names_that_differ_have_heartbeats_of_their_own() -> None:
    from expr_tracker.health.clock import heartbeat_host, heartbeat_name, safe_host

    hosts = ["gpu 1", "gpu_1", "gpu-1", "gpu.1", EVIL, "x" * 300, "x" * 299 + "y"]
    names = [heartbeat_name(h) for h in hosts]
    assert len(set(names)) == len(hosts), names
    for host, name in zip(hosts, names, strict=True):
        assert "/" not in name and "\n" not in name and len(name) < 255, name
        assert heartbeat_host(name) == safe_host(host)


# row 9: alert texts


def test_a_reserved_field_in_an_alert_message_is_an_error_naming_it() -> None:
    from expr_tracker.alerts.rules.rule import parse_rule
    from expr_tracker.errors import RuleError

    with pytest.raises(RuleError, match=r"\{_rank\}"):
        parse_rule("isnan(loss) => critical: rank {_rank} at step {step}")
    with pytest.raises(RuleError, match=r"\{_step:d\}"):
        parse_rule({"condition": "loss > 1", "message": "loss at {_step:d}"})
    ok = parse_rule("isnan(loss) => critical: rank {rank} at step {step}: {loss:.3f} {value}")
    assert ok.message == "rank {rank} at step {step}: {loss:.3f} {value}"


def test_an_alert_that_says_its_step_is_not_told_it_again(tmp_path: Path) -> None:
    run = write_run(tmp_path / "p" / "r", 2, 30, status="running")
    line = {"kind": "fire", "rank": 1, "step": 20, "rule": "isnan(loss)", "level": "critical",
            "title": "rank 1 at step 20", "suppressed": "rank", "delivered": False,
            "time": 1.0, "project": "p", "run": "r"}
    (run / "alerts.rank1.jsonl").write_text(json.dumps(line) + "\n")
    out, _ = _expr("watch", str(run), "--once")
    assert "rank 1 at step 20" in out.stdout, out.stdout
    assert out.stdout.count("at step 20") == 1, out.stdout


# row 6: durations


def test_one_duration_parser_zero_as_text_and_a_warning_past_an_hour(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from daemon.config import ConfigError
    from daemon.config import duration as exprd_duration
    from expr_tracker.health.config import parse_health

    assert parse_health({"page_after": "0", "fs_cache": "0s"}).page_after == 0.0
    for text, secs in (("500ms", 0.5), ("1.5h", 5400.0), (" 2m ", 120.0), ("0", 0.0)):
        assert exprd_duration(text, "retention") == secs
    for bad in ("1w", "-1s", True, "nan"):
        with pytest.raises(ConfigError, match="retention"):
            exprd_duration(bad, "retention")
        with pytest.raises(ValueError, match="hang_after"):
            parse_health({"hang_after": bad})
    with caplog.at_level("WARNING", logger="expr_tracker"):
        assert parse_health({"fs_cache": "1d"}).fs_cache == 86400.0
    assert "'fs_cache' is 1d, over an hour" in caplog.text, caplog.text
    run = write_run(tmp_path / "p" / "r", 2, 10, status="finished")
    out, _ = _expr("watch", str(run), "--once", "--fs-cache", "1d", "--page-after", "0")
    assert out.returncode == 0, out.stderr
    assert "'fs_cache' is 1d, over an hour" in out.stderr, out.stderr


# MCP metric_series: thinning


def test_a_thinned_series_keeps_its_non_finite_points_and_extremes(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from tests.mcpclient import McpClient

    root = tmp_path / "runs"
    run = write_run(root / "proj" / "nan", 2, 400)
    shard = run / "metrics.rank1.jsonl"
    import re

    text = re.sub(r'(\{"_step":100,"_time":[\d.]+,"loss":)', r'\1"NaN","x":', shard.read_text())
    text = re.sub(r'(\{"_step":201,"_time":[\d.]+,"loss":)', r'\1-5.0,"x":', text)
    assert text.count('"x":') == 2
    shard.write_text(text)
    with McpClient(["--dir", str(root)], env_for()) as c:
        a = c.call("metric_series", run="nan", metric="loss", ranks="1", points=20)
    assert not a.error, a.text
    line = a.json["series"]["panels"][0]["lines"][0]
    got = dict(zip(line["steps"], line["values"], strict=True))
    assert got.get(100) == "NaN" and got.get(201) == -5.0, got
    assert len(line["steps"]) <= 20 and line["steps"][0] == 0 and line["steps"][-1] == 399


def test_what_mcp_writes_under_out_is_capped_in_all(tmp_path: Path) -> None:
    """An SQL result of 200 MB was written from one call; the directory had no total cap."""
    pytest.importorskip("mcp")
    pytest.importorskip("duckdb")
    from tests.mcpclient import McpClient

    root, out = tmp_path / "runs", tmp_path / "out"
    write_run(root / "proj" / "big", 8, 500)
    out.mkdir()
    (out / "earlier.json").write_bytes(b"x" * 50_000)  # what it holds counts
    sql = "SELECT _rank, _step, loss, tokens FROM metrics ORDER BY _rank, _step"
    with McpClient(["--dir", str(root), "--out", str(out), "--out-max", "200000",
                    "--max-rows", "10"], env_for()) as c:
        first = c.call("query", run="proj/big", sql=sql)
        assert not first.error, first.text
        second = c.call("query", run="proj/big", sql=sql)
        assert not second.error, second.text
    held = sum(f.stat().st_size for f in out.iterdir())
    assert held <= 200_000, held
    assert first.json["file"] is not None and first.json["file_rows"] < 4000
    assert second.json["file"] is None and "--out-max" in second.json["note"], second.json
