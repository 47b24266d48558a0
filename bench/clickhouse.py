"""The team store benchmark: events/s forwarded by exprd into ClickHouse vs shard-only ingest.

    python bench/clickhouse.py [EVENTS_PER_WRITER] [--stages]

default 50000. Starts Debian's clickhouse-server on a free 127.0.0.1 port in a temporary
directory (as the tests do), writes one spool of 8 spool-mode writers x N events (3 values
each, the run asking for the clickhouse backend), then applies that same spool twice with
`exprd --once`, each time into a fresh run root and state: once with no backend configured
(shards only), once with `[backends.clickhouse]`. Prints a markdown table.

With EXPR_BENCH_BEFORE=<another checkout of the project> the exprd of that tree runs too
(PYTHONPATH, as bench/daemon.py does; the spool is this tree's SDK's either way), in the
same rounds, alternately (EXPR_BENCH_ROUNDS, 2 by default): both trees' shard-only and
forwarded rates side by side, the best of each over the rounds (and the least CPU), with
every round's figures on stderr. Target (issue 24 item 5): forwarded
at least 50% of shard-only.

`--stages` times, in-process and per event (thread CPU, best of 5), the two stages of
forwarding that are exprd's own, for each tree on the same spool file: the backend reader
(`Forwarder._feed`: read, parse, screen, queue) and the row encoder
(`ClickHouseBackend.rows`), beside `orjson.loads` of each line (the parse's floor).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon import EXPRD, spawn_writer, tree_env
from tests.chserver import ClickHouse

WRITERS = 8
TICK = os.sysconf("SC_CLK_TCK")


def write_spool(tmp: Path, n: int) -> Path:
    spool, root = tmp / "spool", tmp / "runs-writers"
    code = f"""
        import expr_tracker as et
        et.init("bench", "team", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r},
                backends=[{{"type": "clickhouse", "url": "http://127.0.0.1:9"}}], system_metrics=False)
        for k in range({n}):
            et.log({{"loss": 1.0 / (k + 1), "lr": 1e-4, "k": k}})
        et.finish()
    """
    procs = [spawn_writer(code, r, WRITERS) for r in range(WRITERS)]
    assert all(p.wait() == 0 for p in procs)
    return spool


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def apply(tmp: Path, spool: Path, tag: str, backend: str, env: dict[str, str] | None = None,
          server: int | None = None) -> tuple[float, float, float]:
    """Seconds `exprd --once` takes to apply the spool into an empty run root, fresh state,
    and the CPU seconds exprd and the server (pid `server`) used meanwhile."""
    root, state = tmp / "runs-writers", tmp / f"state-{tag}"
    shutil.rmtree(root / "bench", ignore_errors=True)  # the run dir the spool names
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                   f"allowed_roots = [{json.dumps(str(root))}]\n" + backend)
    cpu0, server0 = children_cpu(), (cpu_of(server) if server else 0.0)
    t0 = time.perf_counter()
    # in the temporary directory: `-m` never finds a checkout's packages before PYTHONPATH's
    subprocess.run([*EXPRD, "--config", str(cfg), "--once", "--log-level", "WARNING"],
                   check=True, stderr=subprocess.DEVNULL, env=env, cwd=tmp)
    took = time.perf_counter() - t0
    cpu, server_cpu = children_cpu() - cpu0, (cpu_of(server) - server0 if server else 0.0)
    lines = sum(p.read_bytes().count(b"\n") for p in root.rglob("metrics*.jsonl"))
    assert lines == events_of(spool), (lines, events_of(spool))
    return took, cpu, server_cpu


def events_of(spool: Path) -> int:
    """Record events in the spool (every line but each file's init and finish)."""
    return sum(f.read_bytes().count(b"\n") - 2 for f in spool.rglob("*.jsonl"))


STAGES = """
import sys, time
from pathlib import Path
import orjson
from exprd.forwarder import Forwarder
from expr_tracker.backends.base import Identity
from expr_tracker.backends.clickhouse import ClickHouseBackend

path = Path(sys.argv[1])
size, lines = path.stat().st_size, path.read_bytes().splitlines()
class Queue:
    def __init__(self): self.got = []
    def submit_many(self, records): self.got.extend(records)
def forwarder():  # the reader's state, without a run (what Forwarder.__init__ sets first)
    fwd = Forwarder.__new__(Forwarder)
    fwd._session = path.name.split(".")[-2]
    fwd._prefix, fwd._shapes, fwd._row_keys = fwd._session + ":", [None, None], set()
    fwd._max_line = 16 << 20
    return fwd
best = [1e9, 1e9, 1e9]
for _ in range(5):
    fwd, queue, off, seq = forwarder(), Queue(), 0, None
    t0 = time.thread_time()
    while off < size:
        off, seq = fwd._feed(queue, path, off, seq, size, 5000)
    best[0] = min(best[0], time.thread_time() - t0)
    backend = ClickHouseBackend(url="http://127.0.0.1:9")
    backend.identity = Identity("bench", "team", rank=0, world_size=8, session="s")
    backend._client = object()  # rows() needs an open backend, never a request
    t0 = time.thread_time()
    for i in range(0, len(queue.got), 5000):
        backend.rows(queue.got[i : i + 5000])
    best[1] = min(best[1], time.thread_time() - t0)
    t0 = time.thread_time()
    list(map(orjson.loads, lines))
    best[2] = min(best[2], time.thread_time() - t0)
n = len(queue.got)
print(n, *(f"{t / n * 1e6:.2f}" for t in best))
"""


def stages(n: int) -> None:
    """Per-event CPU of the reader and the encoder, each tree on one spool file."""
    before = os.environ.get("EXPR_BENCH_BEFORE")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spool = tmp / "spool"
        code = f"""
            import expr_tracker as et
            et.init("bench", "team", dir={str(tmp / "runs")!r}, upload_mode="spool",
                    spool_dir={str(spool)!r}, system_metrics=False)
            for k in range({n}):
                et.log({{"loss": 1.0 / (k + 1), "lr": 1e-4, "k": k}})
            et.finish()
        """
        assert spawn_writer(code, 0, 1).wait() == 0
        (path,) = spool.rglob("*.jsonl")
        trees: dict[str, dict[str, str] | None] = {"after": None}
        if before:
            trees = {"before": tree_env(Path(before).resolve(), tmp), "after": None}
        print(f"{n:,} events (3 values each), per event, thread CPU, best of 5:\n")
        print("| tree | backend reader | row encoder | `orjson.loads` of the line |")
        print("|---|---|---|---|")
        for tree, env in trees.items():
            out = subprocess.run([sys.executable, "-c", STAGES, str(path)], env=env, cwd=tmp,
                                 check=True, capture_output=True, text=True).stdout.split()
            print(f"| {tree} | {out[1]} us | {out[2]} us | {out[3]} us |")


def main() -> None:
    if "--stages" in sys.argv:
        args = [a for a in sys.argv[1:] if a != "--stages"]
        stages(int(args[0]) if args else 50_000)
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    before = os.environ.get("EXPR_BENCH_BEFORE")
    rounds = int(os.environ.get("EXPR_BENCH_ROUNDS", "2")) if before else 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trees: dict[str, dict[str, str] | None] = {"after": None}
        if before:
            trees = {"before": tree_env(Path(before).resolve(), tmp), "after": None}
        best: dict[str, dict[str, float]] = {tree: {} for tree in trees}
        ch = ClickHouse(tmp / "clickhouse")
        ch.start()
        try:
            spool = write_spool(tmp, n)
            events = events_of(spool)
            assert events == WRITERS * n, events
            for r in range(rounds):
                for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    env, got = trees[tree], best[tree]
                    took, cpu, _ = apply(tmp, spool, f"shards-{tree}-{r}", "", env)
                    shards = events / took
                    db = f"bench_{tree}_{r}"
                    backend = (f'[backends.clickhouse]\ntype = "clickhouse"\n'
                               f'url = {json.dumps(ch.url)}\ndatabase = "{db}"\nbatch = 5000\n')
                    assert ch.proc is not None
                    took, fcpu, scpu = apply(tmp, spool, f"ch-{tree}-{r}", backend, env,
                                             ch.proc.pid)
                    forwarded = events / took
                    rows = ch.count(f"SELECT count() FROM {db}.metrics FINAL")
                    assert rows == 3 * events, (tree, rows, 3 * events)
                    print(f"round {r} {tree} (load {os.getloadavg()[0]:.1f}): shard-only "
                          f"{shards:,.0f} events/s ({cpu:.2f} s CPU), forwarded {forwarded:,.0f} "
                          f"events/s ({fcpu:.2f} s CPU, the server {scpu:.2f} s): "
                          f"{forwarded / shards:.0%}", file=sys.stderr)
                    # the best of each measure, the least CPU: interference only makes
                    # them worse
                    got["shards"] = max(got.get("shards", 0.0), shards)
                    got["forwarded"] = max(got.get("forwarded", 0.0), forwarded)
                    got["ratio"] = got["forwarded"] / got["shards"]
                    for k, v in (("cpu", cpu), ("fcpu", fcpu), ("scpu", scpu)):
                        got[k] = min(got.get(k, v), v)
            version = ch.query("SELECT version()").strip()
        finally:
            ch.stop()
    print(f"ClickHouse {version}, {WRITERS} writers x {n:,} events (3 values each), "
          f"one spool applied by `exprd --once`, shards only and forwarded, best of {rounds}:\n")
    print("| measure | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    print("| shard-only ingest (no backend configured) | " + " | ".join(
        f"{best[t]['shards']:,.0f} events/s" for t in trees) + " |")
    print("| shards + forwarded into ClickHouse, until every row is acknowledged | " + " | ".join(
        f"{best[t]['forwarded']:,.0f} events/s ({3 * best[t]['forwarded']:,.0f} rows/s)"
        for t in trees) + " |")
    print("| forwarded / shard-only (target >= 50%) | " + " | ".join(
        f"{best[t]['ratio']:.0%}" for t in trees) + " |")
    print("| exprd CPU: shard-only / forwarded (least of the rounds) | " + " | ".join(
        f"{best[t]['cpu']:.2f} s / {best[t]['fcpu']:.2f} s" for t in trees) + " |")
    print("| the server's CPU while forwarding | " + " | ".join(
        f"{best[t]['scpu']:.2f} s" for t in trees) + " |")
    print("| shard-only CPU / forwarded CPU (exprd) | " + " | ".join(
        f"{best[t]['cpu'] / best[t]['fcpu']:.0%}" for t in trees) + " |")
    if before:
        print(f"| forwarded, after / before | | "
              f"{best['after']['forwarded'] / best['before']['forwarded']:.2f}x |")
    print(f"\n`metrics` rows under FINAL after each forwarded run: {3 * events:,} (= 3 x events)")


if __name__ == "__main__":
    main()
