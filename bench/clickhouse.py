"""The team store benchmark: events/s forwarded by exprd into ClickHouse vs shard-only ingest.

    python bench/clickhouse.py [EVENTS_PER_WRITER]

default 50000. Starts Debian's clickhouse-server on a free 127.0.0.1 port in a temporary
directory (as the tests do), writes one spool of 8 spool-mode writers x N events (3 values
each, the run asking for the clickhouse backend), then applies that same spool twice with
`exprd --once`, each time into a fresh run root and state: once with no backend configured
(shards only), once with `[backends.clickhouse]`. Prints a markdown table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon import EXPRD, spawn_writer
from tests.chserver import ClickHouse

WRITERS = 8


def write_spool(tmp: Path, n: int) -> Path:
    spool, root = tmp / "spool", tmp / "runs-writers"
    code = f"""
        import expr_tracker as et
        et.init("bench", "team", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r},
                backends=[{{"type": "clickhouse", "url": "http://127.0.0.1:9"}}])
        for k in range({n}):
            et.log({{"loss": 1.0 / (k + 1), "lr": 1e-4, "k": k}})
        et.finish()
    """
    procs = [spawn_writer(code, r, WRITERS) for r in range(WRITERS)]
    assert all(p.wait() == 0 for p in procs)
    return spool


def apply(tmp: Path, spool: Path, tag: str, backend: str) -> float:
    """Seconds `exprd --once` takes to apply the spool into an empty run root, fresh state."""
    root, state = tmp / "runs-writers", tmp / f"state-{tag}"
    shutil.rmtree(root / "bench", ignore_errors=True)  # the run dir the spool names
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                   f"allowed_roots = [{json.dumps(str(root))}]\n" + backend)
    t0 = time.perf_counter()
    subprocess.run([*EXPRD, "--config", str(cfg), "--once", "--log-level", "WARNING"],
                   check=True, stderr=subprocess.DEVNULL)
    took = time.perf_counter() - t0
    lines = sum(p.read_bytes().count(b"\n") for p in root.rglob("metrics*.jsonl"))
    assert lines == events_of(spool), (lines, events_of(spool))
    return took


def events_of(spool: Path) -> int:
    """Record events in the spool (every line but each file's init and finish)."""
    return sum(f.read_bytes().count(b"\n") - 2 for f in spool.rglob("*.jsonl"))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ch = ClickHouse(tmp / "clickhouse")
        ch.start()
        try:
            spool = write_spool(tmp, n)
            events = events_of(spool)
            assert events == WRITERS * n, events
            shards_only = apply(tmp, spool, "shards", "")
            backend = (f'[backends.clickhouse]\ntype = "clickhouse"\nurl = {json.dumps(ch.url)}\n'
                       'database = "bench"\nbatch = 5000\n')
            forwarded = apply(tmp, spool, "clickhouse", backend)
            rows = ch.count("SELECT count() FROM bench.metrics FINAL")
            assert rows == 3 * events, (rows, 3 * events)
            version = ch.query("SELECT version()").strip()
        finally:
            ch.stop()
    print(f"ClickHouse {version}, {WRITERS} writers x {n:,} events (3 values each), "
          "one spool applied twice by `exprd --once`:\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| shard-only ingest (no backend configured) | {events / shards_only:,.0f} events/s |")
    print(f"| shards + forwarded into ClickHouse, until every row is acknowledged | "
          f"{events / forwarded:,.0f} events/s ({3 * events / forwarded:,.0f} rows/s) |")
    print(f"| forwarded / shard-only | {shards_only / forwarded:.0%} |")
    print(f"| `metrics` rows under FINAL after the run | {rows:,} (= 3 x events) |")


if __name__ == "__main__":
    main()
