"""The spool writer attacked as users would (issue 52; DESIGN 6, 8): 64 ranks sharing a
1 MiB spool with exprd down then up, a spool on a read-only filesystem, RLIMIT_NOFILE 64,
the live segment replaced by a symlink to a file in another directory. Real processes,
real tmpfs mounts in a private mount namespace (`unshare -m`; skipped where not
permitted). The spool directory deleted under a live session is in test_spool_disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.procs import in_mount_namespace, spawn
from tests.test_daemon import exprd_once, lines_of, sidecar, write_config

ATTACKS = r"""
import json, os, subprocess, sys, time
base = @BASE@
EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]
W = '''
import json, os, sys, time, resource, warnings, expr_tracker as et
warnings.simplefilter("ignore")
root, spool, go, name, n = sys.argv[1:6]
n = int(n)
if name == "nofile":
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
run = et.init("p", name, dir=root, upload_mode="spool", spool_dir=spool, system_metrics=False)
for i in range(n // 2):
    et.log({"i": i, "pad": "x" * 80})
print("ready", flush=True)
while go != "-" and not os.path.exists(go):
    time.sleep(0.05)
for i in range(n // 2, n):
    et.log({"i": i, "pad": "x" * 80})
et.finish()
print(json.dumps(run.info()["dropped"]), flush=True)
'''
def mount(path, opts):
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)
def config(name, spool, root):
    cfg = os.path.join(base, name + ".toml")
    open(cfg, "w").write(f"spool = {json.dumps(spool)}\nstate = "
                         f"{json.dumps(os.path.join(base, name + '.state'))}\n"
                         f"allowed_roots = {json.dumps([root])}\nrescan_interval = 0.2\n"
                         "status_interval = 0.2\n")
    return cfg
def ranks(name, root, spool, n, go="-", world=1):
    return [subprocess.Popen([sys.executable, "-c", W, root, spool, go, name, str(n)],
                             env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]
def results(ps):
    out = []
    for p in ps:
        o, e = p.communicate(timeout=300)
        out.append({"code": p.returncode, "err": e[-1000:],
                    "dropped": json.loads(o.splitlines()[-1]) if p.returncode == 0 else None})
    return out
def shard_rows(root, name, r):
    b = os.path.join(root, "p", name, "metrics" if r == 0 else f"metrics.rank{r}")
    try:
        rows = [json.loads(x)["i"] for x in open(b + ".jsonl")]
    except OSError:
        rows = []
    try:
        status = json.load(open(b + ".meta.json")).get("status")
    except OSError:
        status = None
    return rows, status
out = {}
# 64 ranks share a 1 MiB spool; exprd is down while each logs its first half (about
# 640 KB in all: more than half the disk), up for the second
spool, root, go = (os.path.join(base, x) for x in ("many", "runs", "go"))
mount(spool, "size=1m,mode=700")
ps = ranks("many", root, spool, 200, go, 64)
for p in ps:
    p.stdout.readline()
cfg = config("many", spool, root)
d = subprocess.Popen([*EXPRD, "--config", cfg], stdout=subprocess.DEVNULL,
                     stderr=open(cfg + ".log", "ab"))
open(go, "w").close()
res = results(ps)
t = time.monotonic() + 120
while time.monotonic() < t and sum(len(shard_rows(root, "many", r)[0]) for r in range(64)) < 64 * 200:
    time.sleep(0.5)
time.sleep(1.0)  # the sidecars' last writes
d.send_signal(15)
d.wait(60)
out["many"] = [{**x, "rows": shard_rows(root, "many", r)} for r, x in enumerate(res)]
# a spool on a read-only filesystem
ro = os.path.join(base, "ro")
mount(ro, "size=1m,ro")
out["ro"] = results(ranks("ro", root, os.path.join(ro, "spool"), 600))
# RLIMIT_NOFILE 64 in the training process
spool = os.path.join(base, "nofile")
res = results(ranks("nofile", root, spool, 3000))
subprocess.run([*EXPRD, "--config", config("nofile", spool, root), "--once"], check=True,
               capture_output=True, timeout=120)
out["nofile"] = [{**res[0], "rows": shard_rows(root, "nofile", 0)}]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def attacks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("attacks")
    return in_mount_namespace(ATTACKS.replace("@BASE@", repr(str(base))), timeout=600)


def test_64_ranks_share_a_1mib_spool_exprd_down_then_up(attacks: dict) -> None:
    """64 ranks, a 1 MiB spool, exprd down for the first half of the rows (more than half
    the disk): every rank lives, every row lands once and in order, nothing dropped."""
    for r, rank in enumerate(attacks["many"]):
        assert rank["code"] == 0, rank["err"]
        assert rank["dropped"] == {}, (r, rank["dropped"])
        rows, status = rank["rows"]
        assert rows == list(range(200)), r
        assert status == "finished"


def test_a_spool_on_a_read_only_filesystem_counts_and_lives(attacks: dict) -> None:
    """The spool directory on a read-only filesystem: the rank lives and exits 0, and
    every row is counted as dropped (none can be kept anywhere)."""
    (rank,) = attacks["ro"]
    assert rank["code"] == 0, rank["err"]
    assert sum(rank["dropped"].values()) == 600


def test_rlimit_nofile_64_loses_no_row(attacks: dict) -> None:
    """RLIMIT_NOFILE 64 in the training process: 3,000 rows over several segments all
    land (a segment holds one descriptor at a time)."""
    (rank,) = attacks["nofile"]
    assert rank["code"] == 0, rank["err"]
    assert rank["dropped"] == {}
    rows, status = rank["rows"]
    assert rows == list(range(3000)) and status == "finished"


SYMLINK = """
import json, os, time, warnings, expr_tracker as et
warnings.simplefilter("ignore")
run = et.init("p", "ln", dir={root!r}, upload_mode="spool", spool_dir={spool!r},
              system_metrics=False)
for i in range(200):
    et.log({{"i": i}})
d = {spool!r} + "/p/ln"
seg = sorted(n for n in os.listdir(d) if n.endswith(".jsonl"))[-1]
os.unlink(os.path.join(d, seg))
os.symlink({victim!r}, os.path.join(d, seg))  # the segment's name now points outside
time.sleep(1.5)  # (the writer looks once a second)
for i in range(200, 400):
    et.log({{"i": i}})
et.finish()
print(json.dumps(run.info()["dropped"]))
"""


def test_a_segment_replaced_by_a_symlink_writes_nothing_outside(tmp_path: Path) -> None:
    """The live segment's name replaced by a symlink to a passwd-like file in another
    directory: nothing is written through it (the file is byte for byte the same), the
    rank lives, the rows after the swap land; exprd follows no symlink either."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    outside = tmp_path / "etc"
    outside.mkdir()
    victim = outside / "passwd"
    victim.write_bytes(b"root:x:0:0:root:/root:/bin/sh\n")
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    w = spawn(SYMLINK.format(root=str(root), spool=str(spool), victim=str(victim)))
    out, err = w.communicate(timeout=60)
    assert w.returncode == 0, err
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert sorted(os.listdir(outside)) == ["passwd"]
    got = [r["i"] for r in lines_of(root / "p" / "ln" / "metrics.jsonl")]
    assert got == sorted(set(got)) and set(range(200, 400)) <= set(got)
    assert sidecar(root / "p" / "ln" / "metrics.meta.json")["status"] == "finished"
    assert json.loads(out.splitlines()[-1]) == {}


FORK = """
import json, os, warnings, expr_tracker as et
warnings.simplefilter("ignore")
run = et.init("p", "fk", dir={root!r}, upload_mode="spool", spool_dir={spool!r},
              system_metrics=False)
for i in range(100):
    et.log({{"i": i}})
pid = os.fork()
if pid == 0:  # a dataloader worker that logs and finishes on its own
    code = 0
    try:
        for i in range(50):
            et.log({{"child": i}})
        et.finish()
    except BaseException:
        code = 3
    os._exit(code)
_, status = os.waitpid(pid, 0)
for i in range(100, 200):
    et.log({{"i": i}})
et.finish()
print(json.dumps({{"child": os.waitstatus_to_exitcode(status), "dropped": run.info()["dropped"]}}))
"""


def test_fork_after_init_in_spool_mode_leaves_the_parents_segment_whole(tmp_path: Path) -> None:
    """A child forked after init logs and finishes: it raises nothing and writes nothing
    into the parent's segment (no child row, no early finish); every parent row lands
    and the run reads finished."""
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    w = spawn(FORK.format(root=str(root), spool=str(spool)))
    out, err = w.communicate(timeout=60)
    assert w.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"child": 0, "dropped": {}}
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    rows = lines_of(root / "p" / "fk" / "metrics.jsonl")
    assert [r["i"] for r in rows if "i" in r] == list(range(200))
    assert not [r for r in rows if "child" in r]
    assert sidecar(root / "p" / "fk" / "metrics.meta.json")["status"] == "finished"
