"""exprd and spool lines it must not trust (issue 20): records checked as log() checks its
arguments, and the weak spots around them. Real spool files edited by hand, a real exprd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.procs import env_for, in_mount_namespace, run_all, spawn
from tests.test_daemon import (
    EXPRD,
    _rewrite,
    exprd_once,
    lines_of,
    make_spool,
    start_exprd,
    stop,
    wait_for,
    wait_ready,
    write_config,
)

# each replaces the record of one `_seq` (so no gap is reported): (line, reason quarantined)
BAD_RECORDS: list[tuple[str, str]] = [
    ('{{"_step":"7","_time":1.0,"_seq":{seq},"k":-1}}', "bad record: _step must be an int, got str"),
    ('{{"_step":-1,"_time":1.0,"_seq":{seq},"k":-1}}', "bad record: _step must be >= 0, got -1"),
    ('{{"_step":1180591620717411303424,"_time":1.0,"_seq":{seq},"k":-1}}',
     "bad record: _step must be at most 2**53 (9007199254740992), got a number past 2**64"),
    ('{{"_step":9223372036854775808,"_time":1.0,"_seq":{seq},"k":-1}}',
     "bad record: _step must be at most 2**53 (9007199254740992), got 9223372036854775808"),
    ('{{"_step":51,"_time":1.0,"_seq":{seq},"k":9223372036854775808}}',
     "bad record: value of key 'k' is an integer outside int64"),
    ('{{"_step":50,"_time":1.0,"_seq":{seq},"k":{{"a":1}}}}', "bad record: value of key 'k' must be"),
    ('{{"_step":50,"_time":1.0,"_seq":{seq},"k":[1]}}', "bad record: value of key 'k' must be"),
    ('{{"_step":50,"_time":1.0,"_seq":{seq},"k":{{}}}}', "bad record: value of key 'k' must be"),
    ('{{"_step":50,"_seq":{seq},"k":-1}}', "bad record: _time is missing"),
    ('{{"_step":50,"_time":"now","_seq":{seq},"k":-1}}', "bad record: _time must be a number"),
    ('{{"_step":50,"_time":1.0,"_seq":{seq},"k":-1,"":2}}', "bad record: metric keys must not be empty"),
    ('{{"_step":50,"_time":1.0,"_seq":{seq},"k":-1,"_loss":2}}', "bad record: field '_loss'"),
    ('{{"_kind":"rank","_step":50,"_time":1.0,"_rank":99999999,"_world_size":-5,"_seq":{seq},"x":1}}',
     "bad record: _world_size must be between 1 and 1,048,576"),
    ('{{"_kind":"rank","_step":50,"_time":1.0,"_rank":9,"_world_size":4,"_seq":{seq},"x":1}}',
     "bad record: _rank must satisfy 0 <= _rank < _world_size (4), got 9"),
    ('{{"_kind":"rank","_step":50,"_time":1.0,"_rank":1,"_world_size":4,"_seq":{seq},"x":true}}',
     "bad record: metric 'x' of a rank record must be a number"),
]


def _status(state: Path) -> dict[str, Any]:
    return json.loads((state / "status.json").read_text())


@pytest.mark.parametrize("feeds", [False, True], ids=["plain", "rules-and-backend"])
def test_bad_spool_records_are_quarantined_naming_the_field_the_rest_lands(
        tmp_path: Path, httpserver: Any, feeds: bool) -> None:
    """Plain: the tailer's fast case. With rules and a backend: the pipeline, and the
    backend's own reader of the spool (which must skip the same records)."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    init: dict[str, Any] = {}
    extra = ""
    if feeds:
        httpserver.expect_request("/ingest", method="POST").respond_with_data("ok")
        init = {"alert_rules": ["k < -100 => warning: never"],
                "backends": [{"type": "http", "url": "http://127.0.0.1:9/not-used"}]}
        extra = (f'[backends.http]\ntype = "http"\nurl = {json.dumps(httpserver.url_for("/ingest"))}\n'
                 "batch = 10\n")
    path = make_spool(spool, root, "bad", 60, **init)
    first = 10  # the records of _seq 10.. (k = 9..) are replaced by bad ones
    replaced = {first + i for i in range(len(BAD_RECORDS))}

    def edit(ls: list[bytes]) -> list[bytes]:
        out = list(ls)
        for i, (text, _why) in enumerate(BAD_RECORDS):
            out[first + i] = text.format(seq=first + i).encode() + b"\n"
        # a repeated key: readers (DuckDB) refuse the line, so what lands is the checked parse
        dup = orjson.loads(out[40])
        out[40] = out[40][:-2] + b',"k":' + str(dup["k"]).encode() + b"}\n"
        out[40] = out[40].replace(b'"k":', b'"k":{"x":1},"k":', 1)
        out.insert(45, b"null\n")  # no _seq: consumes none
        return out

    _rewrite(path, edit)
    # the same, but only the bad kinds a block with no list, no nested object and a
    # colon per key can hold: the tailer's cheaper in-line screen sees them
    scalar = [(text, why) for text, why in BAD_RECORDS if "[" not in text and "{{\"a" not in text]
    other = make_spool(spool, root, "bad-scalar", 60, **init)

    def edit_scalar(ls: list[bytes]) -> list[bytes]:
        out = list(ls)
        for i, (text, _why) in enumerate(scalar):
            out[first + i] = text.format(seq=first + i).encode() + b"\n"
        return out

    _rewrite(other, edit_scalar)
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root], extra=extra))
    shard = root / "proj" / "bad" / "metrics.jsonl"
    recs = lines_of(shard)
    good = [k for k in range(60) if k + 1 not in replaced]
    assert [r["k"] for r in recs] == good
    scalar_recs = lines_of(root / "proj" / "bad-scalar" / "metrics.jsonl")
    assert [r["k"] for r in scalar_recs] == [k for k in range(60) if not first <= k + 1 < first + len(scalar)]
    if feeds:
        events = [e for req, _ in httpserver.log for e in json.loads(req.get_data())["events"]]
        assert sorted(e["k"] for e in events if e["_id"].split(":")[0] in path.name) == good
    assert all(isinstance(r["_step"], int) and "" not in r for r in recs)
    assert shard.read_bytes().count(b'"k":') == len(good)  # the repeated key is gone
    index = [q for q in lines_of(state / "quarantine" / "index.jsonl") if q["file"] == str(path)]
    scalar_reasons = [q["reason"] for q in lines_of(state / "quarantine" / "index.jsonl")
                      if q["file"] == str(other)]
    assert len(scalar_reasons) == len(scalar) > 8
    for (_text, why), reason in zip(scalar, scalar_reasons, strict=True):
        assert reason.startswith(why), (reason, why)
    reasons = [q["reason"] for q in index]
    assert len(reasons) == len(BAD_RECORDS) + 1, reasons
    for (_text, why), reason in zip(BAD_RECORDS, reasons, strict=False):
        assert reason.startswith(why), (reason, why)
    assert reasons[-1] == "not an event: a JSON null, not an object"
    assert [q["offset"] for q in index] == sorted(q["offset"] for q in index)
    assert _status(state)["files"][str(path)]["quarantined"] == len(BAD_RECORDS) + 1
    # the query a user runs counts what is there (an "" key made DuckDB read no row)
    env = env_for({"NO_COLOR": "1", "COLUMNS": "200"})
    out = subprocess.run([sys.executable, "-m", "expr_cli.main", "query", str(root / "proj" / "bad"),
                          "select count(*) as n from metrics", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"n": len(good)}]
    out = subprocess.run([sys.executable, "-m", "expr_cli.main", "status", "--state", str(state)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{len(BAD_RECORDS) + 1 + len(scalar)} quarantined" in out.stdout


# -- weak spots ----------------------------------------------------------------------------


def test_a_read_only_state_dir_is_logged_once_not_every_second(tmp_path: Path) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    make_spool(spool, root, "ro", 20)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    exprd_once(cfg)  # the state dir with its files, then made read-only (root ignores modes)
    make_spool(spool, root, "ro2", 20)
    log = tmp_path / "exprd.log"
    result = in_mount_namespace(f"""
        import json, subprocess, time
        state = {str(state)!r}
        subprocess.run(["mount", "--bind", state, state], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", state], check=True)
        with open({str(log)!r}, "ab") as err:
            d = subprocess.Popen([*{EXPRD!r}, "--config", {str(cfg)!r}], stdout=subprocess.DEVNULL,
                                 stderr=err)
        time.sleep(4.0)  # status_interval 0.2 s: some 20 failed writes
        alive = d.poll() is None
        d.terminate()
        d.wait(20)
        print(json.dumps({{"alive": alive}}))
    """)
    assert result["alive"]
    text = log.read_text()
    assert text.count("cannot write status.json") == 1, text
    assert "Read-only file system" in text
    assert (root / "proj" / "ro2" / "metrics.jsonl").exists()  # the rows land all the same


def test_spool_files_of_another_user_are_logged_once_and_allowed_uids_refuses_them(
        tmp_path: Path) -> None:
    spool, root = tmp_path / "spool", tmp_path / "runs"
    mine = make_spool(spool, root, "mine", 10)
    theirs = make_spool(spool, root, "theirs", 10)
    os.chown(theirs, 4242, 4242)  # the test runs as root: the spool root is root's
    # the default: applied, and said once however many rescans see it
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    log = tmp_path / "exprd.log"
    d = start_exprd(cfg, log=log)
    try:
        wait_ready(state, d)
        wait_for(lambda: (root / "proj" / "theirs" / "metrics.jsonl").exists(), 20, "the rows")
        time.sleep(1.0)  # five rescans
    finally:
        assert stop(d) == 0
    text = log.read_text()
    assert text.count("owned by uid 4242") == 1, text
    assert str(mine) not in text
    # allowed_uids: refused, with the reason where a person looks
    state2 = tmp_path / "state2"
    shutil.rmtree(root)
    cfg = write_config(tmp_path / "exprd2.toml", spool, state2, [root], extra="allowed_uids = [0]\n")
    proc = exprd_once(cfg)
    assert (root / "proj" / "mine" / "metrics.jsonl").exists()
    assert not (root / "proj" / "theirs").exists()
    assert _status(state2)["refused_paths"] == {
        str(theirs): "owned by uid 4242, which allowed_uids does not list"}
    assert "refusing" in proc.stderr and str(theirs) in proc.stderr
    bad = write_config(tmp_path / "exprd3.toml", spool, state2, [root], extra='allowed_uids = ["x"]\n')
    out = subprocess.run([*EXPRD, "--config", str(bad), "--once"], env=env_for(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "allowed_uids must be a list of numeric user ids" in out.stderr


def test_one_rank_on_two_spool_roots_the_second_session_is_refused(tmp_path: Path) -> None:
    """On one spool root the SDK's writer lock refuses a second process of a rank; on two,
    both write, each from step 0, and the second exprd must not append its steps again."""
    root = tmp_path / "runs"
    first = make_spool(tmp_path / "spool-a", root, "twice", 60)
    second = make_spool(tmp_path / "spool-b", root, "twice", 30)  # also from step 0
    exprd_once(write_config(tmp_path / "a.toml", tmp_path / "spool-a", tmp_path / "state-a", [root]))
    proc = exprd_once(write_config(tmp_path / "b.toml", tmp_path / "spool-b", tmp_path / "state-b",
                                   [root]))
    recs = lines_of(root / "proj" / "twice" / "metrics.jsonl")
    assert [r["_step"] for r in recs] == list(range(60))
    assert {r["_sid"] for r in recs} == {first.name.split(".")[1]}
    reason = _status(tmp_path / "state-b")["files"][str(second)]["reason"]
    assert f"already holds steps up to 59, some of session {first.name.split('.')[1]}" in reason
    assert "starts again at step 0" in reason and "two spool roots" in reason
    assert "refusing" in proc.stderr
    # sessions of one spool root are never refused, in whatever order they are applied
    # (here the later one first: a crashed session, resumed, exprd down all along)
    shutil.rmtree(root)
    lone = tmp_path / "spool-c"
    early = make_spool(lone, root, "order", 10)
    late = make_spool(lone, root, "order", 10)  # resumes after the spooled rows: 10..19
    early.rename(tmp_path / "aside.jsonl")  # applied second: after the later session
    cfg = write_config(tmp_path / "c.toml", lone, tmp_path / "state-c", [root])
    exprd_once(cfg)
    (tmp_path / "aside.jsonl").rename(early)
    exprd_once(cfg)
    recs = lines_of(root / "proj" / "order" / "metrics.jsonl")
    assert [r["_step"] for r in recs] == [*range(10, 20), *range(10)]
    assert {r["_sid"] for r in recs[10:]} == {early.name.split(".")[1]} != {late.name.split(".")[1]}
    shutil.rmtree(root)
    exprd_once(write_config(tmp_path / "a.toml", tmp_path / "spool-a", tmp_path / "state-a2",
                            [root]))
    # a real resume on one root (after the shard's last step) is applied as before
    third = make_spool(tmp_path / "spool-a", root, "twice", 5)
    exprd_once(write_config(tmp_path / "a.toml", tmp_path / "spool-a", tmp_path / "state-a", [root]))
    recs = lines_of(root / "proj" / "twice" / "metrics.jsonl")
    assert [r["_step"] for r in recs] == list(range(65))
    assert recs[-1]["_sid"] == third.name.split(".")[1]


def _expr(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "expr_cli.main", *args], capture_output=True, text=True,
                         env=env_for({"NO_COLOR": "1", "COLUMNS": "160"}), timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_a_corrupt_sidecar_and_a_world_size_the_records_deny_are_said(tmp_path: Path) -> None:
    """Three ranks of a job launched as 8 (sidecars: world size 8) whose rank records say
    4; rank 2's sidecar is then corrupted (not running: its status is unknown)."""
    root = tmp_path / "runs"
    code = f"""
        import expr_tracker as et
        et.init("proj", "w", dir={str(root)!r})
        for k in range(5):
            et.log_rank_metrics({{"loss": 1.0 + k}}, step=k, world_size=4)
        et.finish()
    """
    # system metrics on, as a user has them: their samples carry the launcher's world size
    # (the sidecars'), and must not hide what the user's records say
    run_all([spawn(code, {"RANK": str(r), "WORLD_SIZE": "8", "EXPR_SYSTEM_METRICS": "1"})
             for r in range(3)])
    run = root / "proj" / "w"
    assert any("system/rss_mb" in line for line in (run / "metrics.jsonl").read_text().splitlines())
    (run / "metrics.rank2.meta.json").write_text('{"status": "running", "cursor": ')
    out = _expr("shards", str(run), "--json")
    rows = {r["rank"]: r for r in json.loads(out.stdout)}
    assert rows[2]["status"] == "corrupt" and rows[2]["sidecar"] == "corrupt sidecar"
    assert rows[0]["sidecar"] == "ok" and rows[0]["status"] == "finished"
    warn = ("the sidecars say world_size 8 (ranks 0-1), the rank records 4 (ranks 0-2); "
            "using 8")
    assert warn in out.stderr.replace("\n", " ")
    text = _expr("shards", str(run)).stdout
    assert "corrupt sidecar" in text and "corrupt" in text
    out = _expr("summary", str(run))
    assert warn in out.stderr.replace("\n", " ")
    assert json.loads(_expr("summary", str(run), "--json").stdout)["world_size_mismatch"] == warn
    top = json.loads(_expr("top", str(run), "--once", "--json").stdout)
    status = {r["rank"]: r["status"] for r in top["ranks"]}
    assert status == {0: "finished", 1: "finished", 2: "corrupt"}
    assert top["live"] == 0
