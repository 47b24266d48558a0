"""exprd under hostile and unlucky conditions (issue 10): real processes, real files.

Symlinks in run directories (before and after the init is checked), untrusted spool
fields, a reload that narrows allowed_roots, a second exprd, rotation and truncation,
quarantine names and caps, a failed reload, the heartbeat. Full disks and descriptor
limits are in test_daemon_limits.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from tests.procs import env_for, spawn
from tests.test_daemon import (
    EXPRD,
    _rewrite,
    check_shard,
    count_lines,
    exprd_once,
    lines_of,
    make_spool,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)


def _status(state: Path) -> dict[str, Any]:
    return json.loads((state / "status.json").read_text())


def _reasons(state: Path) -> list[str]:
    return [q["reason"] for q in lines_of(state / "quarantine" / "index.jsonl")]


# -- 1, 2: symlinks ----------------------------------------------------------------------


def test_symlinked_shard_or_alerts_file_is_never_written_through(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victims = {name: elsewhere / f"{name}.txt" for name in ("shard", "alerts")}
    for v in victims.values():
        v.write_text("precious\n")
    make_spool(spool, root, "n", 20)
    make_spool(spool, root, "m", 20, alert_rules=["k >= 0 => warning: always"])
    (root / "proj" / "n").mkdir(parents=True)
    (root / "proj" / "n" / "metrics.jsonl").symlink_to(victims["shard"])
    (root / "proj" / "m").mkdir(parents=True)
    (root / "proj" / "m" / "alerts.jsonl").symlink_to(victims["alerts"])
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    exprd_once(cfg)
    for v in victims.values():
        assert v.read_text() == "precious\n"
    assert not (root / "proj" / "n" / "metrics.meta.json").exists()
    files = _status(state)["files"]
    refused = {Path(k).parent.name: f for k, f in files.items() if f["state"] == "refused"}
    assert "symlink" in refused["n"]["reason"] and str(victims["shard"]) in refused["n"]["reason"]
    assert "symlink" in refused["m"]["reason"]
    # what `expr status` shows a person: the refusal and its reason
    out = subprocess.run([sys.executable, "-m", "expr_cli.main", "status", "--state", str(state)],
                         env=env_for({"NO_COLOR": "1", "COLUMNS": "200"}), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused" in out.stdout and "is a symlink to" in out.stdout


def test_symlink_swapped_in_after_the_init_was_checked(tmp_path: Path) -> None:
    """The race: the run dir does not exist when the init is checked; `runs/proj` becomes a
    symlink before the first record. Nothing may appear outside the root."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    w = spawn(f"""
        import sys, expr_tracker as et
        et.init("proj", "race", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r})
        print("ready", flush=True)
        sys.stdin.readline()
        for k in range(50):
            et.log({{"loss": 1.0, "k": k}})
        et.finish()
    """, stdin=subprocess.PIPE)
    try:
        wait_ready(state, d)
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        wait_for(lambda: any(f["state"] == "live" for f in _status(state)["files"].values()),
                 20, "the init to be applied")
        assert not (root / "proj").exists()
        (root / "proj").symlink_to(elsewhere)
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.wait(30) == 0
        wait_for(lambda: any(f["state"] == "refused" for f in _status(state)["files"].values()),
                 20, "the run to be refused")
    finally:
        w.kill()
        w.wait()
        assert stop(d) == 0
    assert list(elsewhere.iterdir()) == []
    reason = next(f["reason"] for f in _status(state)["files"].values())
    assert "symlink" in reason and "proj" in reason


def test_spool_fields_are_not_trusted_and_init_is_checked_like_the_sdk(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    path = make_spool(spool, root, "sid", 10)
    session = path.name.split(".")[1]

    def forge(ls: list[bytes]) -> list[bytes]:
        out = list(ls)
        rec = orjson.loads(out[3])
        rec["_sid"] = "forged"
        out[3] = orjson.dumps(rec) + b"\n"
        rec = orjson.loads(out[5])
        rec["_kind"] = "weird"
        out[5] = orjson.dumps(rec) + b"\n"
        return out

    _rewrite(path, forge)
    bad = {"world": {"world_size": 2_000_000}, "local": {"local_rank": -1},
           "aware": {"rank_aware": "yes"}}
    for name, change in bad.items():
        p = make_spool(spool, root, name, 3)

        def edit(ls: list[bytes], change: dict[str, Any] = change) -> list[bytes]:
            init = orjson.loads(ls[0])
            init["identity"].update(change)
            return [orjson.dumps(init) + b"\n", *ls[1:]]

        _rewrite(p, edit)
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    recs = lines_of(root / "proj" / "sid" / "metrics.jsonl")
    assert {r["_sid"] for r in recs} == {session}
    assert [r["k"] for r in recs] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert "unknown _kind 'weird'" in _reasons(state)
    for name in bad:
        assert not (root / "proj" / name).exists(), name
    reasons = " ".join(_reasons(state))
    assert "world_size 2000000 is over" in reasons and "bad local_rank" in reasons
    assert "rank_aware must be true or false" in reasons


def test_reload_narrowing_allowed_roots_refuses_open_runs(tmp_path: Path) -> None:
    spool, state, root, root2 = (tmp_path / "spool", tmp_path / "state", tmp_path / "runs",
                                 tmp_path / "runs2")
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root, root2])
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    w = spawn(f"""
        import sys, expr_tracker as et
        et.init("proj", "narrow", dir={str(root2)!r}, upload_mode="spool",
                spool_dir={str(spool)!r})
        for k in range(10):
            et.log({{"k": k}})
        et.flush()
        print("ready", flush=True)
        sys.stdin.readline()
        for k in range(10, 20):
            et.log({{"k": k}})
        et.finish()
    """, stdin=subprocess.PIPE)
    shard = root2 / "proj" / "narrow" / "metrics.jsonl"
    try:
        wait_ready(state, d)
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        wait_for(lambda: count_lines(shard) == 10, 20, "10 rows under the second root")
        write_config(cfg, spool, state, [root])
        d.send_signal(signal.SIGHUP)
        wait_for(lambda: any(f["state"] == "refused" for f in _status(state)["files"].values()),
                 20, "the open run to be refused")
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.wait(30) == 0
        time.sleep(1.0)
    finally:
        w.kill()
        w.wait()
        assert stop(d) == 0
    assert count_lines(shard) == 10
    assert "outside allowed_roots (after a reload)" in log.read_text()


# -- 6: rotation and truncation ------------------------------------------------------------


def test_rotated_and_truncated_spool_files_are_reported_and_read_from_the_start(
        tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    rot = make_spool(spool, root, "rot", 50)
    trunc = make_spool(spool, root, "trunc", 50)
    for p in (rot, trunc):
        _rewrite(p, lambda ls: ls[:-1])  # no finish: still live (this process writes it)
    exprd_once(cfg)
    lines = {p: p.read_bytes().splitlines(keepends=True) for p in (rot, trunc)}

    def ev(seq: int, k: int) -> bytes:
        return orjson.dumps({"_step": k, "_time": 1.0, "k": k, "_seq": seq}) + b"\n"

    # rotated: the old file moves away with 10 unread events; a new one takes its name
    with open(rot, "ab") as fh:
        fh.write(b"".join(ev(s, s - 1) for s in range(51, 61)))
    rot.rename(rot.with_name(rot.name + ".old"))
    rot.write_bytes(lines[rot][0] + b"".join(ev(s, s - 1) for s in range(61, 71)))
    # truncated: cut back to its init line, then written on
    trunc.write_bytes(lines[trunc][0] + b"".join(ev(s, s - 1) for s in range(51, 61)))
    exprd_once(cfg)
    got = [r["k"] for r in lines_of(root / "proj" / "rot" / "metrics.jsonl")]
    assert got == [*range(50), *range(60, 70)]
    got = [r["k"] for r in lines_of(root / "proj" / "trunc" / "metrics.jsonl")]
    assert got == list(range(60))
    reasons = _reasons(state)
    assert any(r.startswith("rotated:") and "_seq 50" in r for r in reasons), reasons
    assert any(r.startswith("truncated:") and "below offset" in r for r in reasons), reasons
    assert not any("not JSON" in r for r in reasons), reasons


def test_live_truncation_is_detected_before_reading(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    path = make_spool(spool, root, "live", 40)
    _rewrite(path, lambda ls: ls[:-1])
    init = path.read_bytes().splitlines(keepends=True)[0]
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    shard = root / "proj" / "live" / "metrics.jsonl"
    try:
        wait_ready(state, d)
        wait_for(lambda: count_lines(shard) == 40, 20, "40 rows")
        # copy-truncate style: the file is emptied and written on with the next events
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(init + b"".join(
                orjson.dumps({"_step": k, "_time": 1.0, "k": k, "_seq": k + 1}) + b"\n"
                for k in range(40, 45)))
        wait_for(lambda: count_lines(shard) == 45, 20, "the 5 rows written after truncation")
    finally:
        assert stop(d) == 0
    check_shard(shard, 45)
    assert any(r.startswith("truncated:") for r in _reasons(state))


# -- 8: one exprd per state directory and spool root ----------------------------------------


def test_a_second_exprd_exits_2_naming_the_first(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    other = write_config(tmp_path / "other.toml", spool, tmp_path / "state2", [root])
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        for config, what in ((cfg, "the state directory"), (other, "the spool root")):
            out = subprocess.run([*EXPRD, "--config", str(config)], env=env_for(),
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().splitlines() == [
                f"exprd: another exprd (pid {d.pid}) holds {what} "
                f"{state if what.endswith('directory') else spool}"]
        make_spool(spool, root, "once", 30)
        shard = root / "proj" / "once" / "metrics.jsonl"
        wait_for(lambda: count_lines(shard) == 30, 20, "30 rows")
    finally:
        assert stop(d) == 0
    check_shard(shard, 30)


# -- 14: a reload that fails keeps the old config --------------------------------------------


def test_reload_with_an_unset_secret_keeps_the_old_config(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    try:
        wait_ready(state, d)
        write_config(cfg, spool, state, [root], extra=(
            '[alert.channels.ops]\ntype = "webhook"\nurl_env = "EXPR_TEST_UNSET_HOOK"\n'))
        d.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in log.read_text(), 10, "the reload error")
        assert d.poll() is None, log.read_text()
        make_spool(spool, root, "after", 10)
        wait_for(lambda: count_lines(root / "proj" / "after" / "metrics.jsonl") == 10, 20,
                 "a run applied after the failed reload")
    finally:
        assert stop(d) == 0
    text = log.read_text()
    assert "Traceback" not in text
    failed = [line for line in text.splitlines() if "reload failed" in line]
    assert len(failed) == 1 and "EXPR_TEST_UNSET_HOOK" in failed[0], failed


# -- 18: quarantine ------------------------------------------------------------------------


def test_quarantine_copies_are_capped_and_unique_per_spool_file(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    first = make_spool(spool, root, "a", 5)
    second = spool / "proj" / "b" / first.name  # same file name, another run
    second.parent.mkdir(mode=0o700)
    lines = first.read_bytes().splitlines(keepends=True)
    init = orjson.loads(lines[0])
    init["identity"]["name"] = "b"
    second.write_bytes(orjson.dumps(init) + b"\n" + b"".join(lines[1:]))
    big = b"x" * (200 * 1024) + b"\n"
    _rewrite(first, lambda ls: [*ls[:3], b"garbage-a\n", *ls[3:]])
    _rewrite(second, lambda ls: [*ls[:3], big, *ls[3:]])
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    index = lines_of(state / "quarantine" / "index.jsonl")
    assert [q["reason"] for q in index] == ["not JSON", "not JSON"]
    saved = {q["file"]: q for q in index}
    assert saved[str(first)]["saved"] != saved[str(second)]["saved"]
    assert (state / "quarantine" / saved[str(first)]["saved"]).read_bytes() == b"garbage-a\n"
    assert saved[str(first)]["offset"] == saved[str(second)]["offset"]
    kept = (state / "quarantine" / saved[str(second)]["saved"]).read_bytes()
    assert kept == big[: 64 * 1024] and saved[str(second)]["length"] == len(big)


# -- 15: a bare backend name in spool mode ---------------------------------------------------


def test_bare_backend_name_in_spool_mode_is_exprds_own(tmp_path: Path, httpserver: Any) -> None:
    httpserver.expect_request("/ingest", method="POST").respond_with_data("ok")
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    make_spool(spool, root, "bare", 12, backends=["http"])  # raised "url is required" before
    extra = (f'[backends.http]\ntype = "http"\nurl = {json.dumps(httpserver.url_for("/ingest"))}\n'
             "batch = 4\n")
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra))
    events = [e for req, _ in httpserver.log for e in json.loads(req.get_data())["events"]]
    assert [e["k"] for e in events] == list(range(12))


# -- 21: the heartbeat and spooled runs not applied -------------------------------------------


def test_heartbeat_and_spooled_runs_without_exprd(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    make_spool(spool, root, "waiting", 25)
    env = env_for({"NO_COLOR": "1", "COLUMNS": "200", "EXPR_DIR": str(root),
                   "EXPR_SPOOL": str(spool)})
    expr = [sys.executable, "-m", "expr_cli.main"]
    out = subprocess.run([*expr, "runs"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "1 spooled run(s) not applied yet" in out.stdout and "proj/waiting" in out.stdout
    assert "no exprd is running" in out.stdout
    rows = json.loads(subprocess.run([*expr, "runs", "--json"], env=env, capture_output=True,
                                     text=True, timeout=60).stdout)
    assert rows == [{"project": "proj", "name": "waiting",
                     "path": str(root / "proj" / "waiting"), "status": "spooled",
                     "spool_files": 1, "spooled_events": 26}]
    out = subprocess.run([*expr, "status", "--state", str(state)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "proj/waiting" in out.stdout
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        beat = json.loads((spool / ".exprd.json").read_text())
        assert beat["pid"] == d.pid and abs(beat["time"] - time.time()) < 30
        wait_for(lambda: count_lines(root / "proj" / "waiting" / "metrics.jsonl") == 25, 20,
                 "the spooled run to be applied")
        time.sleep(2.5)  # the sidecar says what is applied within a few seconds
        out = subprocess.run([*expr, "runs"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert "not applied yet" not in out.stdout, out.stdout
    finally:
        assert stop(d) == 0
