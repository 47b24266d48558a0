"""The SDK under faults (issue 10): real processes, real files, real full filesystems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import expr_tracker as et

from .procs import in_mount_namespace, run_all, spawn


@pytest.fixture(autouse=True)
def _finish():
    yield
    et.finish()


# -- case 10: a stream that spells another rank's shard ------------------------------


def test_stream_with_a_rank_segment_is_refused_at_init(tmp_path):
    """Rank 0 of stream `data.rank2` would write rank 2 of stream `data`'s shard."""
    code = f"""
    import json, expr_tracker as et
    try:
        et.init("p", "r", dir={str(tmp_path)!r}, stream="data.rank2")
    except ValueError as exc:
        print(json.dumps({{"error": str(exc)}}))
    else:
        et.log({{"x": 1}})
        et.finish()
        print(json.dumps({{"error": None}}))
    """
    (out,) = run_all([spawn(code, {"RANK": "0", "WORLD_SIZE": "4"})])
    assert json.loads(out)["error"] is not None and "data.rank2" in json.loads(out)["error"]
    run_all([spawn(code.replace('stream="data.rank2"', 'stream="data"'), {"RANK": "2", "WORLD_SIZE": "4"})])
    shard = tmp_path / "p" / "r" / "metrics.data.rank2.jsonl"
    assert [json.loads(x)["x"] for x in shard.read_text().splitlines()] == [1]


@pytest.mark.parametrize("stream", ["rank2.data", "a.rank10.b", "x.rank0",
                                    # `metrics.Rank1.jsonl` is rank 1's shard where case folds
                                    "Rank1", "data.RANK2", "x.rAnK0.y"])
def test_rank_segments_anywhere_are_refused(stream, tmp_path):
    with pytest.raises(ValueError, match=r"^stream .*'rank<N>' segment \(in any case\)"):
        et.init("p", "r", dir=tmp_path, stream=stream)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("stream", ["Metrics", "x.META", "TORN", "JsonL"])
def test_reserved_stream_names_are_refused_in_any_case(stream, tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        et.init("p", "r", dir=tmp_path, stream=stream)


@pytest.mark.parametrize("stream", ["ranks", "rank", "data.ranking2", "prerank2"])
def test_rank_like_words_are_fine(stream, tmp_path):
    run = et.init("p", "r", dir=tmp_path, stream=stream)
    et.finish()
    assert run.stream == stream


# -- case 12: a key or value orjson cannot encode -------------------------------------

UNENCODABLE = """
import glob, json, expr_tracker as et
run = et.init("p", "r", dir={root!r}, upload_mode={mode!r}, spool_dir={spool!r})
errors = []
et.log({{"x": 0.0}})
for bad, kw in (({{"\\ud800": 1.0}}, {{}}), ({{"ok": 1.0, "\\udfff": 2}}, {{"commit": False}}),
                ({{"text": "a\\ud800b"}}, {{}}), ({{"y": 1.0, "k\\udc80": 1.0}}, {{"step": 1}})):
    try:
        et.log(bad, **kw)
    except ValueError as exc:
        errors.append(str(exc))
for i in range(1, 4):
    et.log({{"x": float(i)}})
info = et.info()
et.finish()
if {mode!r} == "spool":
    (path,) = glob.glob({spool!r} + "/p/r/*.jsonl")
    lines = [json.loads(x) for x in open(path)]
    rows = [e["x"] for e in lines if "_event" not in e]
    seqs = [e["_seq"] for e in lines]
else:
    rows = [json.loads(x)["x"] for x in open(run.shard_path)]
    seqs = None
print(json.dumps({{"errors": errors, "rows": rows, "seqs": seqs, "dropped": info["dropped"],
                  "steps": info["last_step"]}}))
"""


@pytest.mark.parametrize("mode", ["direct", "spool"])
def test_unencodable_keys_and_values_are_refused_at_the_call(tmp_path, mode):
    code = UNENCODABLE.format(root=str(tmp_path / "runs"), mode=mode, spool=str(tmp_path / "spool"))
    (out,) = run_all([spawn(code)])
    got = json.loads(out)
    assert len(got["errors"]) == 4, got
    for err, key in zip(got["errors"], ["'\\ud800'", "'\\udfff'", "'text'", "'k\\udc80'"], strict=True):
        assert key in err, (err, key)
    assert got["rows"] == [0.0, 1.0, 2.0, 3.0]  # nothing else affected, nothing lost
    assert got["dropped"] == {} and got["steps"] == 3
    if mode == "spool":
        assert got["seqs"] == list(range(len(got["seqs"])))  # no hole in the numbering


# -- case 19: the string-size limit, at the call, in both modes ---------------------

BIG_STRING = """
import glob, json, expr_tracker as et
run = et.init("p", "r", dir={root!r}, upload_mode={mode!r}, spool_dir={spool!r})
errors = []
for row in ({{"sample": "x" * (17 * 1024 * 1024)}},
            {{f"t{{i}}": "y" * (1024 * 1024) for i in range(10)}}):
    try:
        et.log(row)
    except ValueError as exc:
        errors.append(str(exc)[:200])
for i in range(9):  # an open row merged from many calls must fit a line as well
    try:
        et.log({{f"m{{i}}": "m" * (1024 * 1024 - 16)}}, commit=False)
    except ValueError as exc:
        errors.append(str(exc)[:200])
et.log({{"x": 1.0}})
et.finish()
print(json.dumps(errors))
"""


@pytest.mark.parametrize("mode", ["direct", "spool"])
def test_a_huge_string_is_refused_at_the_call(tmp_path, mode):
    spool = tmp_path / "spool"
    code = BIG_STRING.format(root=str(tmp_path / "runs"), mode=mode, spool=str(spool))
    (out,) = run_all([spawn(code)])
    errors = json.loads(out)
    assert len(errors) == 3
    assert "'sample'" in errors[0] and "bytes" in errors[0]
    assert "'t" in errors[1] and "row" in errors[1]
    assert "'m8'" in errors[2] and "open row" in errors[2]
    # in spool mode the 8 MiB row goes in a segment of its own (DESIGN 6)
    files = sorted(spool.rglob("*.jsonl")) if mode == "spool" else [tmp_path / "runs/p/r/metrics.jsonl"]
    lines = [x for path in files for x in path.read_bytes().splitlines()]
    assert max(len(x) for x in lines) < 8 * 1024 * 1024 + 4096  # every line fits (spool: 16 MiB)
    rows = [json.loads(x) for x in lines]
    (row,) = [r for r in rows if "x" in r]  # nothing of the refused rows reached the disk
    assert sorted(k for k in row if k.startswith("m")) == [f"m{i}" for i in range(8)]


# -- case 13: rank options against an unknown world size -----------------------------

UNKNOWN_WORLD = """
import json, expr_tracker as et
run = et.init("p", "r", dir={root!r}, alert_on_rank=3, backend_on_rank=2, upload_mode={mode!r},
              spool_dir={spool!r})
for step in range(3):
    run.log_rank_metrics({{"step_time": 0.1 * (run.rank + 1)}}, step=step)
    et.log({{"loss": 1.0}})
info = et.info()
et.finish()
print(json.dumps({{"world_size": info["world_size"], "alerting": info["alerting"],
                  "backend_on_rank": run.backend_on_rank}}))
"""


@pytest.mark.parametrize("mode", ["direct", "spool"])
def test_rank_options_with_no_world_size_do_not_crash(tmp_path, mode):
    """`RANK=k python train.py` without WORLD_SIZE: the world size is unknown, not k + 1."""
    root, spool = tmp_path / "runs", tmp_path / "spool"
    code = UNKNOWN_WORLD.format(root=str(root), mode=mode, spool=str(spool))
    infos = [json.loads(o) for o in run_all([spawn(code, {"RANK": str(r)}) for r in range(4)])]
    assert [i["world_size"] for i in infos] == [None] * 4
    if mode == "direct":
        assert [i["alerting"] for i in infos] == [False, False, False, True]
        # no backend is configured, so no rank reports; the option itself survives unchecked
        assert [i["backend_on_rank"] for i in infos] == [2, 2, 2, 2]
    else:
        from .test_daemon import exprd_once, write_config

        exprd_once(write_config(tmp_path / "exprd.toml", spool, tmp_path / "state", [root]))
    run_dir = root / "p" / "r"
    for r in range(4):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        side = json.loads((run_dir / f"{stem}.meta.json").read_text())
        assert side["rank"] == r and side["world_size"] is None  # stored as null: unknown
        recs = [json.loads(x) for x in (run_dir / f"{stem}.jsonl").read_text().splitlines()]
        ranks = [x for x in recs if x.get("_kind") == "rank"]
        assert len(ranks) == 3 and all(x["_world_size"] is None for x in ranks)
    # readers keep working: the world is what the rank records show
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    result = CliRunner().invoke(build_app(), ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert '"step_time"' in result.output


def test_rank_options_are_checked_against_a_known_world_size(tmp_path):
    code = f"""
    import expr_tracker as et
    try:
        et.init("p", "r", dir={str(tmp_path)!r}, alert_on_rank=3)
    except ValueError as exc:
        print(exc)
    """
    (out,) = run_all([spawn(code, {"RANK": "0", "WORLD_SIZE": "2"})])
    assert "alert_on_rank=3" in out and "WORLD_SIZE=2" in out
    assert not (tmp_path / "p").exists()


# -- case 9: one writer per shard ------------------------------------------------------

HOLDER = """
import json, sys, expr_tracker as et
run = et.init("p", "r", dir={root!r}, rank_aware={aware!r}, upload_mode={mode!r},
              spool_dir={root!r} + "/spool")
for i in range(5):
    et.log({{"x": float(i)}})
et.flush()
print(json.dumps({{"pid": __import__("os").getpid()}}), flush=True)
sys.stdin.readline()  # hold the shard until the test says so
et.finish()
"""

SECOND = """
import json, expr_tracker as et
try:
    run = et.init("p", "r", dir={root!r}, rank_aware={aware!r}, upload_mode={mode!r},
                  spool_dir={root!r} + "/spool")
except Exception as exc:
    print(json.dumps({{"error": type(exc).__name__, "message": str(exc)}}))
else:
    first = run.step
    for i in range(3):
        et.log({{"x": 100.0 + i}})
    et.finish()
    print(json.dumps({{"error": None, "first_step": first}}))
"""


def _hold(root, rank: str, aware: bool, mode: str = "direct"):
    import subprocess

    proc = spawn(HOLDER.format(root=str(root), aware=aware, mode=mode), {"RANK": rank, "WORLD_SIZE": "4"},
                 stdin=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)["pid"]


def _release(proc) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    run_all([proc])


@pytest.mark.parametrize(("aware", "mode"), [(True, "direct"), (False, "direct"), (True, "spool"),
                                             (False, "spool")])
def test_a_second_writer_of_a_shard_fails_at_init_naming_the_holder(tmp_path, aware, mode):
    import socket

    second = SECOND.format(root=str(tmp_path), aware=aware, mode=mode)
    holder, pid = _hold(tmp_path, "2", aware, mode)
    try:
        (out,) = run_all([spawn(second, {"RANK": "2", "WORLD_SIZE": "4"})])
        got = json.loads(out)
        assert got["error"] == "UsageError", got
        shard = "metrics.rank2.jsonl" if aware else "metrics.jsonl"
        for part in ("rank 2", f"p/r/{shard}", f"pid {pid}", socket.gethostname()):
            assert part in got["message"], (part, got["message"])
        if not aware:
            # other ranks of the shared file are not held up by rank 2's lock
            (out,) = run_all([spawn(second, {"RANK": "1", "WORLD_SIZE": "4"})])
            assert json.loads(out) == {"error": None, "first_step": 0}
    finally:
        _release(holder)
    # the holder is gone: its lock went with it, and the next writer resumes its rows
    (out,) = run_all([spawn(second, {"RANK": "2", "WORLD_SIZE": "4"})])
    assert json.loads(out) == {"error": None, "first_step": 5}
    if mode == "direct":
        shard = tmp_path / "p" / "r" / ("metrics.rank2.jsonl" if aware else "metrics.jsonl")
        rows = [json.loads(x) for x in shard.read_text().splitlines()]
        mine = [r["_step"] for r in rows if aware or r["_rank"] == 2]
        assert mine == [0, 1, 2, 3, 4, 5, 6, 7]  # no step twice


def test_a_killed_holder_does_not_block_the_next_writer(tmp_path):
    holder, _ = _hold(tmp_path, "1", True)
    holder.kill()
    holder.wait()
    second = SECOND.format(root=str(tmp_path), aware=True, mode="direct")
    (out,) = run_all([spawn(second, {"RANK": "1", "WORLD_SIZE": "4"})])
    assert json.loads(out) == {"error": None, "first_step": 5}


def test_a_forked_child_that_outlives_the_writer_does_not_hold_the_shard(tmp_path):
    import os
    import signal

    code = f"""
    import os, time, expr_tracker as et
    et.init("p", "r", dir={str(tmp_path)!r})
    et.log({{"x": 1.0}})
    pid = os.fork()
    if pid == 0:  # a dataloader worker that lingers after the trainer is gone
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    et.finish()
    print(pid)
    """
    (out,) = run_all([spawn(code, {"RANK": "1", "WORLD_SIZE": "4"})])
    child = int(out)
    try:
        second = SECOND.format(root=str(tmp_path), aware=True, mode="direct")
        (out,) = run_all([spawn(second, {"RANK": "1", "WORLD_SIZE": "4"})])
        assert json.loads(out) == {"error": None, "first_step": 1}
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_live_writer_on_another_host_is_seen_in_the_sidecar(tmp_path):
    """Where locks do not reach (a network filesystem across hosts), the sidecar does."""
    run_dir = tmp_path / "p" / "r"
    run_dir.mkdir(parents=True)
    side = {"version": 1, "project": "p", "name": "r", "stream": None, "rank": 3, "world_size": 4,
            "host": "node-17", "pid": 4242, "status": "running",
            "cursor": {"bytes": 0, "rows": 0, "last_step": None, "next_step": 0, "applied": {}}}
    (run_dir / "metrics.rank3.meta.json").write_text(json.dumps(side))
    code = SECOND.format(root=str(tmp_path), aware=True, mode="direct")
    (out,) = run_all([spawn(code, {"RANK": "3", "WORLD_SIZE": "4"})])
    got = json.loads(out)
    assert got["error"] == "UsageError" and "host node-17 pid 4242" in got["message"]
    # a sidecar nobody rewrote for a while is a crashed writer, not a live one
    import os

    os.utime(run_dir / "metrics.rank3.meta.json", (1, 1))
    (out,) = run_all([spawn(code, {"RANK": "3", "WORLD_SIZE": "4"})])
    assert json.loads(out) == {"error": None, "first_step": 0}


# -- case 11: rank_aware=False resumes each rank after its own rows -----------------


def test_shared_shard_resume_cursor_is_per_rank(tmp_path):
    code = """
    import json, expr_tracker as et
    run = et.init("p", "shared", dir={root!r}, rank_aware=False)
    first = run.step
    for i in range({n}):
        et.log({{"i": i}})
    et.finish()
    print(first)
    """
    root = str(tmp_path)

    def start(rank: int, n: int) -> tuple[int, str]:
        proc = spawn(code.format(root=root, n=n), {"RANK": str(rank), "WORLD_SIZE": "3"})
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return int(out), err

    # ranks starting one after the other: each starts at 0, whatever the others wrote,
    # and says nothing about resuming (it resumes nothing of its own)
    fresh = [start(r, 100 * (r + 1)) for r in (2, 0, 1)]
    assert [step for step, _ in fresh] == [0, 0, 0]
    assert not any("resuming" in err for _, err in fresh), fresh
    # a resumed rank continues after its own largest step, not the file's, and says so
    again = [start(r, 10) for r in (0, 1, 2)]
    assert [step for step, _ in again] == [100, 200, 300]
    assert [err.count(f"resuming shared rank {r} at step {s}") for r, (s, err) in enumerate(again)] == [1] * 3
    rows = [json.loads(x) for x in (tmp_path / "p" / "shared" / "metrics.jsonl").read_text().splitlines()]
    for r, n in ((0, 110), (1, 210), (2, 310)):
        assert [x["_step"] for x in rows if x["_rank"] == r] == list(range(n))


# -- case 11 in spool mode: pending spool rows count for their own rank only ---------


def test_shared_shard_resume_in_spool_mode_is_per_rank(tmp_path):
    code = """
    import expr_tracker as et
    run = et.init("p", "shared", dir={root!r}, rank_aware=False, upload_mode="spool",
                  spool_dir={spool!r})
    print(run.step)
    for i in range({n}):
        et.log({{"i": i}})
    et.finish()
    """
    kw = {"root": str(tmp_path / "runs"), "spool": str(tmp_path / "spool")}
    starts = [int(run_all([spawn(code.format(n=50 * (r + 1), **kw), {"RANK": str(r), "WORLD_SIZE": "2"})])[0])
              for r in (0, 1, 0, 1)]
    assert starts == [0, 0, 50, 100]


# -- case 20: init and history(5) over a large spool not applied yet ------------------


def test_init_and_history_over_a_large_unapplied_spool_are_bounded(tmp_path):
    n = 200_000
    kw = {"root": str(tmp_path / "runs"), "spool": str(tmp_path / "spool")}
    fill = """
    import expr_tracker as et
    et.init("p", "big", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
    for i in range({n}):
        et.log({{"loss": 1.0 / (i + 1), "i": i, "lr": 3e-4}})
    et.finish()
    """
    run_all([spawn(fill.format(n=n, **kw))], timeout=120)
    size = sum(p.stat().st_size for p in (tmp_path / "spool").rglob("*.jsonl"))
    assert size > 10_000_000
    probe = """
    import json, resource, time, expr_tracker as et
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    run = et.init("p", "big", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
    rows = et.history(5)
    took = time.perf_counter() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({{"step": run.step, "rows": et.info()["rows"], "last": [r["i"] for r in rows],
                      "kib": grew, "s": took}}))
    et.finish()
    """
    (out,) = run_all([spawn(probe.format(**kw))], timeout=120)
    got = json.loads(out)
    assert got["step"] == n and got["rows"] == n
    assert got["last"] == list(range(n - 5, n))
    # parsing the whole spool into dicts took 83 MB here (and 0.8 s); reading from the end, 0
    assert got["kib"] < 32 * 1024, got


# -- case 21: a warning at init when no exprd is there to apply the spool -------------

CONSUMER = """
import warnings, expr_tracker as et
warnings.simplefilter("always")
et.init("p", "r", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
et.log({{"x": 1.0}})
et.finish()
"""


@pytest.mark.parametrize(("beat", "warned"), [(None, "no exprd heartbeat"), (-120.0, "120 s old"),
                                              (0.0, None)])
def test_spool_mode_warns_once_when_no_exprd_is_alive(tmp_path, beat, warned):
    import os
    import time

    spool = tmp_path / "spool"
    spool.mkdir()
    if beat is not None:
        (spool / ".exprd.json").write_text(json.dumps({"host": os.uname().nodename, "pid": 1,
                                                       "time": time.time() + beat}))
    proc = spawn(CONSUMER.format(root=str(tmp_path / "runs"), spool=str(spool)))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    if warned is None:
        assert "no exprd" not in err
    else:
        assert err.count("no exprd is running") == 1 and warned in err, err
    # the rows are in the spool either way
    (path,) = spool.rglob("*.jsonl")
    assert [json.loads(x).get("x") for x in path.read_text().splitlines()][1:] == [1.0, None]


# -- case 5: the spool file deleted while the SDK writes it ----------------------------

DELETED_SPOOL = """
import json, sys, expr_tracker as et
run = et.init("p", "gone", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
for i in range(100):
    et.log({{"i": i}})
et.flush()
print(json.dumps(et.info()["spool_file"]), flush=True)
sys.stdin.readline()  # the test deletes the spool file now
for i in range(100, 150):
    et.log({{"i": i}})
run.log_rank_metrics({{"t": 1.0}}, step=149)
et.flush()
for i in range(150, 200):
    et.log({{"i": i}})
info = et.info()
et.finish()
print(json.dumps({{"file": info["spool_file"], "session": info["session"], "step": info["step"]}}))
"""


def test_a_deleted_spool_file_goes_on_in_a_new_session_that_exprd_applies(tmp_path):
    import subprocess

    from .test_daemon import lines_of, start_exprd, stop, wait_for, wait_ready, write_config

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root])
    daemon = start_exprd(cfg)
    try:
        wait_ready(state, daemon)
        writer = spawn(DELETED_SPOOL.format(root=str(root), spool=str(spool)), stdin=subprocess.PIPE)
        first = json.loads(writer.stdout.readline())
        shard = root / "p" / "gone" / "metrics.jsonl"
        # exprd applies the first file, then it goes (a cleanup job, a person, a full /tmp)
        wait_for(lambda: len(lines_of(shard)) == 100, 20, "exprd to apply the first 100 rows")
        import os

        os.unlink(first)
        writer.stdin.write("\n")
        writer.stdin.flush()
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        got = json.loads(out.splitlines()[-1])
        assert got["file"] != first and got["step"] == 200
        assert err.count("was deleted or moved while in use") == 1, err
        new = lines_of(Path(got["file"]))
        assert new[0]["_event"] == "init" and new[0]["identity"]["session"] == got["session"]
        assert [e["_seq"] for e in new] == list(range(len(new)))  # a new session from seq 0
        assert [e["i"] for e in new if "i" in e] == list(range(100, 200))
        wait_for(lambda: len([r for r in lines_of(shard) if "i" in r]) == 200, 20,
                 "exprd to apply the new session")
    finally:
        stop(daemon)
    rows = lines_of(shard)
    steps = [r["_step"] for r in rows if "i" in r]
    assert steps == list(range(200))  # every step once, in order, across both sessions
    assert [r["i"] for r in rows if "i" in r] == list(range(200))
    assert [r["_step"] for r in rows if r.get("_kind") == "rank"] == [149]
    assert {r["_sid"] for r in rows} == {first.split(".")[-2], got["session"]}


# -- issue 20: the spool file rotated (mv, then cp back) while the SDK writes it --------

ROTATED_SPOOL = """
import json, sys, expr_tracker as et
run = et.init("p", "rot", dir={root!r}, upload_mode="spool", spool_dir={spool!r})
for i in range(20):
    et.log({{"i": i}})
et.flush()
print(json.dumps(et.info()["spool_file"]), flush=True)
sys.stdin.readline()  # the test rotates the spool file now
for i in range(20, 60):
    et.log({{"i": i}})
et.finish()
print(json.dumps(run.info()["spool_file"]))
"""


def test_a_rotated_spool_file_goes_on_in_a_new_session_and_every_row_lands_once(tmp_path):
    """logrotate without copytruncate: the file moves away and a copy takes its name. The
    SDK would write on into the moved file, which exprd no longer reads: 40 rows lost, and
    no finish anywhere exprd looks. (In which order exprd applies the copy and the new
    session, and so the final status, is exprd's part: see the issue.)"""
    import shutil
    import subprocess

    from .test_daemon import exprd_once, lines_of, write_config

    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    writer = spawn(ROTATED_SPOOL.format(root=str(root), spool=str(spool)), stdin=subprocess.PIPE)
    first = Path(json.loads(writer.stdout.readline()))
    first.rename(first.with_name(first.name + ".1"))
    shutil.copyfile(first.with_name(first.name + ".1"), first)
    out, err = writer.communicate("\n", timeout=60)
    assert writer.returncode == 0, err
    second = Path(json.loads(out.splitlines()[-1]))
    assert second != first and err.count("was deleted or moved while in use") == 1, err
    # the moved file got nothing more; the new session has the rest and the finish
    assert [e["i"] for e in lines_of(first.with_name(first.name + ".1")) if "i" in e] == list(range(20))
    events = lines_of(second)
    assert events[0]["_event"] == "init" and events[-1]["_event"] == "finish"
    assert [e["i"] for e in events if "i" in e] == list(range(20, 60))
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    rows = lines_of(root / "p" / "rot" / "metrics.jsonl")
    assert sorted((r["_step"], r["i"]) for r in rows) == [(i, i) for i in range(60)]


# -- case 7: direct mode, a full disk that frees less than the backlog ------------------

DISK_FULL = """
import json, os, subprocess, warnings, expr_tracker as et
mnt = {mnt!r}
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], check=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run = et.init("p", "r", dir=mnt)
    et.log({{"i": 0, "pad": "x" * 60}})
    et.flush()
    # fill the filesystem to the last byte
    filler = os.path.join(mnt, "filler")
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"f" * 65536)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"f")
        except OSError:
            pass
    for i in range(1, {n}):
        et.log({{"i": i, "pad": "x" * 60}})
        if i % 5000 == 0:
            et.flush()
    et.flush()
    backlog = run.info()["buffered_bytes"]
    os.truncate(filler, os.path.getsize(filler) - {free})  # less than the backlog comes free
    et.flush()
    info = run.info()
    et.finish()
rows = [json.loads(x)["i"] for x in open(run.shard_path)]
print(json.dumps({{"backlog": backlog, "rows": rows, "dropped": info["dropped"],
                  "final": run.info()["dropped"], "warnings": [str(w.message) for w in caught]}}))
"""


def test_disk_full_keeps_the_rows_that_fit_when_space_returns(tmp_path):

    n, free = 60_000, 2 * 1024 * 1024
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = DISK_FULL.format(mnt=str(mnt), n=n, free=free)
    got = in_mount_namespace(code, timeout=120)
    line = len(json.dumps({"_step": 0, "_time": 1764410000.123456, "i": 0, "pad": "x" * 60}))
    assert got["backlog"] > free  # the backlog is larger than the space that came free
    kept = got["rows"]
    # measured: about 17,400 of 60,000 rows kept, the rest counted; all-or-nothing kept 1
    assert kept == list(range(len(kept)))  # a prefix, whole lines, each row once
    assert len(kept) > free // line // 2, len(kept)  # most of the freed space holds rows
    # only what did not fit is counted, exactly
    assert got["final"] == {"unwritable": n - len(kept)}, got["final"]
    assert sum("No space left" in w for w in got["warnings"]) == 1


# -- case 16: a webhook that hangs holds neither finish() nor another channel ------------

HANGING = """
import json, sys, time, expr_tracker as et
got = {got!r}
cmd = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + chr(10))", got]
policy = {{"timeout": 30, "retries": 0, "rate": 0, "dedup_seconds": 0{exit}}}
run = et.init("p", "r", dir={root!r}, alert={{"channels": {{
    "hook": {{"type": "webhook", "url": {url!r}}},
    "pager": {{"type": "command", "argv": cmd}}}}, "policy": policy}})
t0 = time.monotonic()
et.alert("first", level="error")
et.alert("second", level="error")
while time.monotonic() - t0 < 20:
    try:
        if open(got).read().count(chr(10)) >= 2:
            break
    except OSError:
        pass
    time.sleep(0.02)
pager = time.monotonic() - t0
t1 = time.monotonic()
et.finish()
took = time.monotonic() - t1
print(json.dumps({{"pager": pager, "finish": took, "alerts": run.info()["alerts"]}}))
"""


@pytest.mark.parametrize(("exit_timeout", "bound"), [(None, 5.0), (1.0, 1.0)])
def test_a_hanging_webhook_holds_neither_finish_nor_the_other_channels(tmp_path, exit_timeout, bound):
    import socket

    with socket.socket() as hole:  # a real server on 127.0.0.1 that accepts and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/hook"
        extra = "" if exit_timeout is None else f', "exit_timeout": {exit_timeout}'
        code = HANGING.format(got=str(tmp_path / "paged.jsonl"), root=str(tmp_path / "runs"), url=url,
                              exit=extra)
        (out,) = run_all([spawn(code)], timeout=90)
    got = json.loads(out)
    assert got["pager"] < 3.0, got  # the command channel did not wait behind the webhook
    assert got["finish"] < bound + 1.5, got  # finish() waited at most the exit bound
    hook, pager = got["alerts"]["hook"], got["alerts"]["pager"]
    assert pager["sent"] == 2 and pager["undelivered"] == 0
    assert hook["sent"] == 0 and hook["undelivered"] == 2 and hook["pending"] == 0
