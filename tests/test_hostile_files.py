"""Files that are not what a reader expects (issue 43): an incidents file that is a symlink
or a FIFO, a read-only run directory, a FIFO as a shard, a shard with a NUL tail, a sidecar
that cannot be written. Real files, real FIFOs, real read-only bind mounts, real processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.procs import env_for, in_mount_namespace
from tests.synthetic import write_run
from tests.test_daemon import make_spool, start_exprd, stop, wait_for, wait_ready, write_config


def expr(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "expr_cli.main", *args], env=env_for(),
                          capture_output=True, text=True, timeout=timeout)


def _config(path: Path, url: str) -> Path:
    path.write_text(f'[channels.hook]\ntype = "webhook"\nurl = {json.dumps(url)}\nretries = 0\n'
                    '[policy]\nrate = 0\n[health]\nmissing_after = "10m"\n')
    return path


def _crashed_run(run: Path) -> Path:
    return write_run(run, 4, 30, crashed=2, status="finished")


def _posted(httpserver: Any) -> list[str]:
    return [json.loads(req.get_data())["rule"] for req, _ in httpserver.log]


# row 1: the open is shown and paged though it cannot be recorded


def test_a_symlinked_incidents_file_the_crash_is_shown_and_delivered_the_error_named(
        tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    run = _crashed_run(tmp_path / "runs" / "p" / "r")
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("")
    (run / "incidents.jsonl").symlink_to(outside)
    cfg = _config(tmp_path / "alert.toml", httpserver.url_for("/hook"))
    out = expr("watch", str(run), "--once", "--config", str(cfg))
    assert out.returncode != 0, out
    assert "crashed rank 2" in out.stdout, out.stdout
    assert "incidents.jsonl is a symlink" in out.stderr, out.stderr
    assert _posted(httpserver) == ["health:crashed:2"]
    assert outside.read_text() == ""  # nothing written through the link


def test_a_read_only_run_directory_the_crash_is_shown_and_delivered_the_error_named(
        tmp_path: Path, httpserver: Any) -> None:
    """A teammate's run on a read-only bind mount (`unshare -m`): the crash is paged and
    shown, `expr watch` names EROFS and exits non-zero."""
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    run = _crashed_run(tmp_path / "runs" / "p" / "r")
    cfg = _config(tmp_path / "alert.toml", httpserver.url_for("/hook"))
    got = in_mount_namespace(f"""
        import json, subprocess, sys
        run = {str(run)!r}
        subprocess.run(["mount", "--bind", run, run], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", run], check=True)
        out = subprocess.run([sys.executable, "-m", "expr_cli.main", "watch", run, "--once",
                              "--config", {str(cfg)!r}], capture_output=True, text=True, timeout=60)
        print(json.dumps([out.returncode, out.stdout, out.stderr]))
    """)
    code, stdout, stderr = got
    assert code != 0
    assert "crashed rank 2" in stdout, stdout
    assert "cannot record incidents" in stderr and "Read-only file system" in stderr, stderr
    assert _posted(httpserver) == ["health:crashed:2"]
    assert not (run / "incidents.jsonl").exists()


# row 2: a FIFO where incidents.jsonl belongs


def test_a_fifo_incidents_file_is_refused_by_watch_and_top(tmp_path: Path) -> None:
    run = _crashed_run(tmp_path / "runs" / "p" / "r")
    os.mkfifo(run / "incidents.jsonl")
    out = expr("watch", str(run), "--once")  # would block in open() for good
    assert out.returncode == 1
    assert "crashed rank 2" in out.stdout
    assert "incidents.jsonl is not a regular file" in out.stderr, out.stderr
    top = expr("top", str(run), "--once", "--json")
    assert top.returncode in (0, 1), top.stderr
    assert any(r["status"] == "crashed" for r in json.loads(top.stdout)["ranks"]), top.stdout


def test_a_fifo_incidents_file_under_watch_roots_exprd_warns_and_applies_the_rest(
        tmp_path: Path) -> None:
    """exprd watches a live run of this host under `watch_roots` whose incidents.jsonl is a
    FIFO: it names it in a warning and goes on applying every other run's spool file."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    run = write_run(root / "p" / "live", 2, 30, crashed=1)
    for side in run.glob("*.meta.json"):
        meta = json.loads(side.read_text())
        meta["host"] = socket.gethostname()
        side.write_text(json.dumps(meta))
    os.mkfifo(run / "incidents.jsonl")
    make_spool(spool, root, "other", 20)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra=f"watch_roots = {json.dumps([str(root)])}\n")
    log = tmp_path / "exprd.log"
    proc = start_exprd(cfg, log=log)
    try:
        wait_ready(state, proc)
        wait_for(lambda: (root / "proj" / "other" / "metrics.jsonl").exists()
                 and len((root / "proj" / "other" / "metrics.jsonl").read_bytes().splitlines()) == 20,
                 20, "the other run's spool file applied")
        wait_for(lambda: "incidents.jsonl is not a regular file" in log.read_text(), 20,
                 "the FIFO named in exprd's log")
    finally:
        assert stop(proc) == 0, log.read_text()


# row 5: a FIFO as a shard


def test_a_fifo_shard_is_refused_by_summary_and_watch(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs" / "p" / "r", 3, 20)
    (run / "metrics.rank1.jsonl").unlink()
    os.mkfifo(run / "metrics.rank1.jsonl")
    started = time.monotonic()
    out = expr("summary", str(run), "--json")
    assert time.monotonic() - started < 25
    assert out.returncode == 0, out.stderr
    assert f"{run / 'metrics.rank1.jsonl'} is not a regular file" in out.stderr, out.stderr
    assert json.loads(out.stdout)["ranks"]["no_shard"] == [1]
    watch = expr("watch", str(run), "--once", "--json")
    assert watch.returncode in (0, 1), watch.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# row 6: a NUL tail, as a node crash leaves


def _nul_tail(run: Path, sparse: int, written: int) -> Path:
    shard = run / "metrics.rank1.jsonl"
    with open(shard, "ab") as fh:
        fh.write(b"\0" * written)
    if sparse:
        os.truncate(shard, shard.stat().st_size + sparse)
    return shard


def test_a_nul_tail_is_skipped_with_a_warning_in_bounded_reads(tmp_path: Path) -> None:
    """A 1 GiB hole after 4 MiB of written NULs (the 20 GB case: `make torture`)."""
    run = write_run(tmp_path / "runs" / "p" / "r", 4, 200, status="finished")
    shard = _nul_tail(run, 1 << 30, 4 << 20)
    for args in (["summary", str(run), "--json"], ["watch", str(run), "--once", "--json"]):
        started = time.monotonic()
        out = expr(*args, timeout=60)
        took = time.monotonic() - started
        assert out.returncode == 0, out.stderr
        assert took < 15, (args, took)
        assert f"{shard}: skipped" in out.stderr and "NUL bytes" in out.stderr, out.stderr
        if args[0] == "summary":  # rank 1's lines before the NULs all read
            assert json.loads(out.stdout)["ranks"]["frontier"] == 199


def test_lines_after_a_nul_run_are_read(tmp_path: Path) -> None:
    """A node crashed mid-run and the rank resumed appending after the NULs."""
    run = write_run(tmp_path / "runs" / "p" / "r", 2, 100, status="finished")
    shard = run / "metrics.rank1.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    shard.write_bytes(b"".join(lines[:100]) + b"\0" * (8 << 20) + b"".join(lines[100:]))
    from expr_tracker.store.reader import ShardReader

    recs = ShardReader(shard).records()
    assert [r["_step"] for r in recs if "_kind" not in r] == list(range(100))


# row 16: a sidecar that cannot be written


def test_a_sidecar_that_cannot_be_written_leaves_no_temp_files_and_says_so_truly(
        tmp_path: Path) -> None:
    from tests.procs import spawn

    run = tmp_path / "runs" / "p" / "r"
    (run / "metrics.meta.json").mkdir(parents=True)  # a directory in its place
    p = spawn(f"""
        import time, expr_tracker as et
        et.init("p", "r", dir={str(tmp_path / "runs")!r}, system_metrics=False)
        for i in range(30):
            et.log({{"loss": float(i)}})
        time.sleep(2.5)  # the background thread's flushes and sidecar writes
        et.finish()
    """)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 30
    assert [e.name for e in run.iterdir() if e.name.endswith(".tmp")] == []
    assert f"cannot write sidecar {run / 'metrics.meta.json'}" in err, err
    assert "the rows are written" in err and "rows are kept in memory" not in err, err
    assert err.count("cannot write sidecar") == 1, err


# row 18: expr status names what exprd refused


def test_expr_status_lists_refused_spool_files_with_the_reason(tmp_path: Path) -> None:
    """A symlinked spool file (never tailed) and a run outside allowed_roots: both listed
    as refused with the reason, not omitted, not "exprd is applying them"."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    elsewhere, outside = tmp_path / "elsewhere", tmp_path / "outside"
    make_spool(spool, root, "good", 5)
    make_spool(spool, outside, "away", 5)
    target = make_spool(elsewhere, root, "linked", 5)
    (spool / "proj" / "linked").mkdir(parents=True)
    link = spool / "proj" / "linked" / target.name
    link.symlink_to(target)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    proc = start_exprd(cfg)
    try:
        wait_ready(state, proc)
        wait_for(lambda: "symlink" in (state / "status.json").read_text()
                 and "outside allowed_roots" in (state / "status.json").read_text(), 20,
                 "both refusals in status.json")
        out = expr("status", "--state", str(state), "--spool", str(spool))
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert "refused by exprd" in text, out.stdout
        assert str(link) in text and "symlink" in text, out.stdout
        assert "outside allowed_roots" in text, out.stdout
        assert "exprd is applying them" not in out.stdout + out.stderr
        js = json.loads(expr("status", "--state", str(state), "--spool", str(spool), "--json").stdout)
        reasons = {r["path"]: r["reason"] for r in js["refused"]}
        assert "symlink" in reasons[str(link)]
        assert any("outside allowed_roots" in r for r in reasons.values()), reasons
        assert js["spooled"] == [], js["spooled"]
    finally:
        assert stop(proc) == 0


# row 15: a screenful for thousands of keys


def _wide_run(run: Path, n: int, prefix: str) -> Path:
    run.mkdir(parents=True)
    for r in range(2):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        rows = [json.dumps({"_step": s, "_time": 1e9 + s,
                            **{f"{prefix}k{i}": float(i % 97 + r) for i in range(n)}})
                for s in range(3)]
        (run / f"{stem}.jsonl").write_text("\n".join(rows) + "\n")
        (run / f"{stem}.meta.json").write_text(json.dumps({
            "version": 1, "project": run.parent.name, "name": run.name, "stream": None,
            "rank": r, "world_size": 2, "local_rank": r, "session": "s", "rank_aware": True,
            "config": {}, "host": "h", "pid": 1_000_000, "status": "finished",
            "cursor": {"bytes": 1, "rows": 3, "last_step": 2, "next_step": 3, "applied": {}},
            "start_time": 1e9, "end_time": 1e9 + 3, "last_write": 1e9 + 3}))
    return run


def test_thousands_of_keys_print_a_screenful_and_json_keeps_all(tmp_path: Path) -> None:
    run = _wide_run(tmp_path / "runs" / "p" / "keys", 2000, "")
    out = expr("summary", str(run))
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) < 100, len(out.stdout.splitlines())
    assert "... and 1,990 more keys (-m KEY to show one; --json for all)" in " ".join(out.stdout.split())
    js = json.loads(expr("summary", str(run), "--json").stdout)
    assert len(js["keys"]) == 2000


def test_thousands_of_span_keys_print_the_slowest_first_the_rest_counted(tmp_path: Path) -> None:
    run = _wide_run(tmp_path / "runs" / "p" / "spans", 1000, "time_ms/")
    out = expr("summary", str(run), "--spans")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 60, len(lines)
    assert "... and 960 more span keys (faster than those shown; --json for all)" in " ".join(out.stdout.split())
    medians = [float(ln.split()[1]) for ln in lines if ln.strip().startswith("k")]
    assert len(medians) == 40 and medians == sorted(medians, reverse=True) and medians[0] >= 96
    js = json.loads(expr("summary", str(run), "--spans", "--json").stdout)
    assert len(js["spans"]) == 1000
