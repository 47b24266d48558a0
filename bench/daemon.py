"""exprd benchmarks: ingest vs a floor, append->shard latency, idle CPU, RSS with many files.

    python bench/daemon.py [EVENTS_PER_WRITER] [IDLE_SECONDS]

defaults 200000 and 60. Prints a markdown table. Targets (issue 24): ingest at least 50%
of the floor (read the same spool lines, orjson.loads, write them out), p99 append->shard
latency under 50 ms at 8 x 1,000 events/s, idle CPU under 0.5% of a core with 64 idle
spool files; RSS under 150 MB with 512 spool files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import orjson

EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]
TICK = os.sysconf("SC_CLK_TCK")


def config(tmp: Path, spool: Path, state: Path, root: Path) -> Path:
    path = tmp / f"{state.name}.toml"
    path.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                    f"allowed_roots = [{json.dumps(str(root))}]\nrescan_interval = 5\n")
    return path


def spawn_writer(code: str, rank: int, world: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)}
    for k in ("EXPR_MODE", "EXPR_SPOOL", "EXPR_DIR"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_ready(state: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((state / "status.json").read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise RuntimeError("exprd did not get ready")


# -- 1. ingest ------------------------------------------------------------------------------


def ingest(tmp: Path, n: int) -> tuple[float, float]:
    spool, root = tmp / "spool-ingest", tmp / "runs-ingest"
    code = f"""
        import expr_tracker as et
        et.init("bench", "ingest", dir={str(root)!r}, upload_mode="spool", spool_dir={str(spool)!r})
        for k in range({n}):
            et.log({{"loss": 1.0 / (k + 1), "lr": 1e-4, "k": k}})
        et.finish()
    """
    procs = [spawn_writer(code, r, 8) for r in range(8)]
    assert all(p.wait() == 0 for p in procs)
    files = sorted(spool.rglob("*.jsonl"))
    events = sum(f.read_bytes().count(b"\n") for f in files)
    # the floor: the same lines read, parsed and written out, nothing else
    out = tmp / "floor"
    out.mkdir()
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fin, open(out / f.name, "wb") as fout:
            buf = []
            for line in fin:
                orjson.loads(line)
                buf.append(line)
                if len(buf) >= 1000:
                    fout.write(b"".join(buf))
                    buf.clear()
            fout.write(b"".join(buf))
    floor = events / (time.perf_counter() - t0)
    state = tmp / "state-ingest"
    t0 = time.perf_counter()
    subprocess.run([*EXPRD, "--config", str(config(tmp, spool, state, root)), "--once"], check=True,
                   stderr=subprocess.DEVNULL)
    rate = events / (time.perf_counter() - t0)
    shard_lines = sum(p.read_bytes().count(b"\n") for p in root.rglob("metrics*.jsonl"))
    assert shard_lines == 8 * n, (shard_lines, 8 * n)
    return rate, floor


# -- 2. latency -----------------------------------------------------------------------------


def latency(tmp: Path, seconds: float = 5.0, rate: int = 1000) -> tuple[float, float, int]:
    spool, root, state = tmp / "spool-lat", tmp / "runs-lat", tmp / "state-lat"
    spool.mkdir(mode=0o700)
    d = subprocess.Popen([*EXPRD, "--config", str(config(tmp, spool, state, root))],
                         stderr=subprocess.DEVNULL)
    wait_ready(state, d)
    n = int(seconds * rate)
    # the SDK writes the init line; then raw lines, one os.write per event at `rate`/s
    code = f"""
        import os, time, orjson, expr_tracker as et
        run = et.init("bench", "latency", dir={str(root)!r}, upload_mode="spool",
                      spool_dir={str(spool)!r})
        fd = os.open(run.info()["spool_file"], os.O_WRONLY | os.O_APPEND)
        start = time.monotonic()
        for k in range({n}):
            delay = start + k / {rate} - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            os.write(fd, orjson.dumps({{"_step": k, "_time": time.time(), "x": 1.0, "_seq": k + 1}})
                     + b"\\n")
        os.write(fd, orjson.dumps({{"_event": "finish", "_time": time.time(), "status": "finished",
                                    "_seq": {n} + 1}}) + b"\\n")
        os._exit(0)
    """
    lat: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        offsets: dict[Path, int] = {}
        while not stop.is_set():
            for shard in root.rglob("metrics*.jsonl"):
                off = offsets.get(shard, 0)
                with open(shard, "rb") as fh:
                    fh.seek(off)
                    data = fh.read()
                end = data.rfind(b"\n") + 1
                now = time.time()
                for line in data[:end].splitlines():
                    lat.append(now - orjson.loads(line)["_time"])
                offsets[shard] = off + end
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    procs = [spawn_writer(code, r, 8) for r in range(8)]
    assert all(p.wait() == 0 for p in procs)
    deadline = time.monotonic() + 10
    while len(lat) < 8 * n and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    watcher.join()
    d.send_signal(signal.SIGTERM)
    d.wait(15)
    lat.sort()
    return lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000, len(lat)


# -- 3./4. idle CPU and RSS -----------------------------------------------------------------


def many_files(tmp: Path, tag: str, count: int, events: int = 100) -> tuple[Path, Path, Path]:
    """`count` live spool files (no finish; their writer, this process, is alive)."""
    import expr_tracker as et

    spool, root = tmp / f"spool-{tag}", tmp / f"runs-{tag}"
    for i in range(count):
        run = et.init("bench", f"{tag}-{i}", dir=root, upload_mode="spool", spool_dir=spool)
        for k in range(events):
            et.log({"loss": 1.0 / (k + 1), "k": k})
        path = Path(run.info()["spool_file"])
        et.finish()
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:-1]))  # drop `finish`: the file stays live
    return spool, root, tmp / f"state-{tag}"


def idle_cpu(tmp: Path, seconds: float) -> float:
    spool, root, state = many_files(tmp, "idle", 64)
    d = subprocess.Popen([*EXPRD, "--config", str(config(tmp, spool, state, root))],
                         stderr=subprocess.DEVNULL)
    wait_ready(state, d)
    time.sleep(1.0)
    c0, t0 = cpu_seconds(d.pid), time.monotonic()
    time.sleep(seconds)
    used = (cpu_seconds(d.pid) - c0) / (time.monotonic() - t0)
    d.send_signal(signal.SIGTERM)
    d.wait(15)
    return used * 100


def rss_many(tmp: Path) -> tuple[float, int]:
    spool, root, state = many_files(tmp, "rss", 512)
    d = subprocess.Popen([*EXPRD, "--config", str(config(tmp, spool, state, root))],
                         stderr=subprocess.DEVNULL)
    wait_ready(state, d)
    time.sleep(2.0)
    rss = rss_mb(d.pid)
    tracked = json.loads((state / "status.json").read_text())["totals"]["files"]
    d.send_signal(signal.SIGTERM)
    d.wait(15)
    return rss, tracked


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    idle_s = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    with tempfile.TemporaryDirectory(prefix="exprd-bench-") as t:
        tmp = Path(t)
        rate, floor = ingest(tmp, n)
        p50, p99, count = latency(tmp)
        cpu = idle_cpu(tmp, idle_s)
        rss, tracked = rss_many(tmp)
    ratio = rate / floor
    rows = [
        (f"ingest, 8 writers x {n:,} events", f"{rate:,.0f} events/s", "", ""),
        ("floor (read + orjson.loads + write)", f"{floor:,.0f} events/s", "", ""),
        ("exprd / floor", f"{ratio:.0%}", ">= 50%", "yes" if ratio >= 0.5 else "NO"),
        (f"append->shard p50, 8 x 1,000 events/s ({count:,} events)", f"{p50:.1f} ms", "", ""),
        ("append->shard p99", f"{p99:.1f} ms", "< 50 ms", "yes" if p99 < 50 else "NO"),
        (f"idle CPU, 64 spool files, {idle_s:.0f} s", f"{cpu:.2f}% of a core", "< 0.5%",
         "yes" if cpu < 0.5 else "NO"),
        (f"RSS with 512 spool files ({tracked} tracked)", f"{rss:.0f} MB", "< 150 MB",
         "yes" if rss < 150 else "NO"),
    ]
    print("| measure | value | target | met |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
