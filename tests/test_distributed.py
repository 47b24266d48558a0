"""Real rank processes writing real shards (the seed's distributed guide and the failure cases)."""

from __future__ import annotations

import json
import os
import signal
import time

import orjson
import pytest

import expr_tracker as et

from .procs import run_all, spawn

GUIDE = """
import json, expr_tracker as et
run = et.init("demo", "run-1", dir={root!r}, config={{"lr": 3e-4}})
for step in range(20):
    et.log({{"loss": 1.0 / (step + 1), "rank_seen": run.rank}})
print(json.dumps(et.info()))
et.finish()
"""


def test_seed_distributed_guide(tmp_path):
    procs = [spawn(GUIDE.format(root=str(tmp_path)), {"RANK": str(r), "WORLD_SIZE": "4"}) for r in range(4)]
    infos = [json.loads(out) for out in run_all(procs)]
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    run_dir = tmp_path / "demo" / "run-1"
    names = sorted(p.name for p in run_dir.glob("*.jsonl"))
    assert names == ["metrics.jsonl", "metrics.rank1.jsonl", "metrics.rank2.jsonl", "metrics.rank3.jsonl"]
    rank0 = et.history(-1, run=str(run_dir))
    assert len(rank0) == 20 and {r["rank_seen"] for r in rank0} == {0}
    rank2 = et.history(-1, run=f"{run_dir}/metrics.rank2.jsonl")
    assert len(rank2) == 20 and {r["rank_seen"] for r in rank2} == {2}
    assert et.history(5, run=str(run_dir), rank=3)[-1]["rank_seen"] == 3
    for r in range(4):
        side = orjson.loads((run_dir / (f"metrics.rank{r}.meta.json" if r else "metrics.meta.json")).read_bytes())
        assert side["rank"] == r and side["world_size"] == 4 and side["status"] == "finished"
        assert side["config"] == {"lr": 3e-4} and side["cursor"]["rows"] == 20


@pytest.mark.parametrize(("env", "rank"), [({"LOCAL_RANK": "3"}, 3), ({}, 0)])
def test_rank_from_local_rank_only_or_nothing(tmp_path, env, rank):
    code = f"import expr_tracker as et; et.init('p', 'r', dir={str(tmp_path)!r}); print(et.info()['rank'])"
    (out,) = run_all([spawn(code, env)])
    assert int(out) == rank


def test_rank_aware_false_four_writers_intact(tmp_path):
    code = f"""
    import expr_tracker as et
    et.init("p", "shared", dir={str(tmp_path)!r}, rank_aware=False)
    for i in range(10_000):
        et.log({{"i": i, "pad": "x" * 40}})
    et.finish()
    """
    run_all([spawn(code, {"RANK": str(r), "WORLD_SIZE": "4"}) for r in range(4)], timeout=120)
    run_dir = tmp_path / "p" / "shared"
    assert sorted(p.name for p in run_dir.glob("*.jsonl")) == ["metrics.jsonl"]
    data = (run_dir / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n")
    rows = [orjson.loads(line) for line in data.splitlines()]
    assert len(rows) == 40_000
    for r in range(4):
        mine = [row["i"] for row in rows if row["_rank"] == r]
        assert mine == list(range(10_000))


def test_kill9_then_resume_repairs_torn_tail(tmp_path):
    code = f"""
    import sys, expr_tracker as et
    et.init("p", "crash", dir={str(tmp_path)!r})
    i = 0
    while True:
        et.log({{"i": i}})
        if i % 100 == 99:
            et.flush()
            print(i, flush=True)
        i += 1
    """
    proc = spawn(code)
    for line in proc.stdout:
        if int(line) >= 999:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()
    shard = tmp_path / "p" / "crash" / "metrics.jsonl"
    flushed = [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    assert len(flushed) >= 1000
    # a write torn by the kill: half a line at the end of the file
    with open(shard, "ab") as fh:
        fh.write(b'{"_step": 99999, "_time": 1.0, "i": 4')
    run = et.init("p", "crash", dir=tmp_path)
    try:
        assert run.step == flushed[-1]["_step"] + 1
        et.log({"i": -1})
    finally:
        et.finish()
    assert (tmp_path / "p" / "crash" / "metrics.jsonl.torn").read_bytes() == b'{"_step": 99999, "_time": 1.0, "i": 4\n'
    rows = et.history(-1, run=tmp_path / "p" / "crash")
    steps = [r["_step"] for r in rows]
    assert steps == list(range(len(flushed) + 1))
    assert [r["i"] for r in rows[:-1]] == list(range(len(flushed)))
    side = orjson.loads((tmp_path / "p" / "crash" / "metrics.meta.json").read_bytes())
    assert side["cursor"]["rows"] == len(flushed) + 1


def test_reader_sees_growing_parseable_history(tmp_path):
    code = f"""
    import time, expr_tracker as et
    et.init("p", "live", dir={str(tmp_path)!r})
    for i in range(3000):
        et.log({{"i": i, "blob": "y" * (i % 200)}})
        if i % 50 == 0:
            et.flush()
            time.sleep(0.002)
    et.finish()
    """
    proc = spawn(code)
    run_dir = tmp_path / "p" / "live"
    seen = []
    while proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists():
            rows = et.history(-1, run=run_dir)
            assert [r["i"] for r in rows] == list(range(len(rows)))
            seen.append(len(rows))
        time.sleep(0.01)
    run_all([proc])
    assert seen == sorted(seen), "history shrank between reads"
    assert len(set(seen)) > 3, "the reader never saw the file grow"
    assert len(et.history(-1, run=run_dir)) == 3000


def test_forked_child_does_not_duplicate_rows(tmp_path):
    code = f"""
    import os, expr_tracker as et
    et.init("p", "fork", dir={str(tmp_path)!r})
    for i in range(5):
        et.log({{"i": i}})
    pid = os.fork()
    if pid == 0:
        et.log({{"child": 1}})  # a dataloader worker logging: ignored, never raises
        raise SystemExit(0)      # runs atexit in the child
    os.waitpid(pid, 0)
    et.log({{"i": 5}})
    et.finish()
    """
    run_all([spawn(code)])
    rows = et.history(-1, run=tmp_path / "p" / "fork")
    assert [r["i"] for r in rows] == list(range(6))


def test_sigterm_flushes_buffered_rows(tmp_path):
    code = f"""
    import time, expr_tracker as et
    et.init("p", "term", dir={str(tmp_path)!r})
    for i in range(100):
        et.log({{"i": i}})
    print("ready", flush=True)
    time.sleep(60)
    """
    proc = spawn(code)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == -signal.SIGTERM  # still dies of SIGTERM, as before
    proc.stdout.close()
    proc.stderr.close()
    rows = et.history(-1, run=tmp_path / "p" / "term")
    assert [r["i"] for r in rows] == list(range(100))
    side = orjson.loads((tmp_path / "p" / "term" / "metrics.meta.json").read_bytes())
    assert side["status"] == "crashed"


def test_sigterm_during_a_tight_logging_loop_never_hangs(tmp_path):
    """torchrun and Slurm send SIGTERM whenever they like, often in the middle of log():
    the handler must not wait for a lock the interrupted code holds."""
    code = f"""
    import expr_tracker as et
    et.init("p", "busy", dir={str(tmp_path)!r})
    print("ready", flush=True)
    i = 0
    while True:
        et.log({{"i": i}})
        i += 1
        if i % 1000 == 0:
            et.flush()
    """
    for attempt in range(8):
        proc = spawn(code.replace('"busy"', f'"busy{attempt}"'))
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.05 + 0.03 * attempt)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=10) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        rows = et.history(-1, run=tmp_path / "p" / f"busy{attempt}")
        assert [r["i"] for r in rows] == list(range(len(rows)))  # a prefix, nothing torn
        assert len(rows) > 0
