"""Spool disk use stays bounded (issue 42): a spool-mode run writing about 5 MB a minute
per rank, with an exprd applying it, on a compressed time scale.

Each rank process logs rows of about 200 bytes at `SPEED` times 5 MB/min for `minutes`
of run time divided by `SPEED` (the default: 10 minutes of data in 60 s of wall time);
exprd (a real daemon) applies the segments and deletes each once applied. A sampler
reads the spool's size every 50 ms (the bytes of its files, and the blocks they hold).
The bound to compare with: (segments in flight + 1) x segment size per live session.

    python bench/spool_bound.py [minutes] [ranks] [speed]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATE = 5_000_000 / 60  # bytes per second per rank, at run time
WRITER = """
import os, sys, time, expr_tracker as et
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
os.environ["RANK"] = sys.argv[3]
run = et.init("bench", "bound", dir=sys.argv[4], upload_mode="spool", spool_dir=sys.argv[5],
              system_metrics=False)
row = {"loss": 0.5, "lr": 3e-4, "grad_norm": 1.25, "pad": "x" * 120}
size = len(b'{"_step":0,"_time":1764410000.123456,"loss":0.5,"lr":0.0003,"grad_norm":1.25,"pad":""}') + 120 + 12
per_tick = max(1, int(rate * 0.01 / size))  # rows every 10 ms
t0 = time.monotonic()
n = 0
while time.monotonic() - t0 < seconds:
    for _ in range(per_tick):
        et.log(row)
        n += 1
    time.sleep(max(0.0, t0 + n / per_tick * 0.01 - time.monotonic()))
et.finish()
print(n, flush=True)
"""


def spool_bytes(spool: Path) -> tuple[int, int, int]:
    """(bytes of the spool files, bytes of the blocks they hold, number of files)."""
    size = blocks = files = 0
    for dirpath, _dirs, names in os.walk(spool):
        for name in names:
            if not name.endswith(".jsonl"):
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            size += st.st_size
            blocks += st.st_blocks * 512
            files += 1
    return size, blocks, files


def main() -> None:
    minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    speed = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    seconds = minutes * 60 / speed
    with tempfile.TemporaryDirectory() as tmp:
        spool, state, root = Path(tmp, "spool"), Path(tmp, "state"), Path(tmp, "runs")
        spool.mkdir(mode=0o700)
        cfg = Path(tmp, "exprd.toml")
        cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                       f"allowed_roots = {json.dumps([str(root)])}\nrescan_interval = 0.5\n")
        d = subprocess.Popen([sys.executable, "-m", "exprd.main", "--allow-root", "--config",
                              str(cfg)], stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        seg = int(os.environ.get("EXPR_SPOOL_SEGMENT_BYTES", 4 << 20))
        writers = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", WRITER,
                                     str(RATE * speed), str(seconds), str(r), str(root), str(spool)],
                                    stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        peak = (0, 0, 0)
        samples = []
        while any(w.poll() is None for w in writers):
            now = spool_bytes(spool)
            samples.append(now[1])
            peak = max(peak, now, key=lambda x: x[1])
            time.sleep(0.05)
        rows = sum(int(w.stdout.read().split()[-1]) for w in writers if w.stdout)
        time.sleep(2.0)
        end = spool_bytes(spool)
        d.send_signal(signal.SIGTERM)
        d.wait(30)
        shard_rows = sum(p.read_bytes().count(b"\n") for p in root.rglob("metrics*.jsonl"))
    written = RATE * speed * seconds * ranks
    print(f"{ranks} ranks x {minutes:g} min of run time at 5 MB/min each, {speed:g}x compressed "
          f"({seconds:.0f} s of wall time); segments of {seg / 2**20:g} MiB\n")
    print("| measure | value |\n|---|---|")
    print(f"| written to the spool | {written / 1e6:.1f} MB, {rows:,} rows |")
    print(f"| rows in the shards | {shard_rows:,} |")
    print(f"| spool disk use, peak (blocks held) | {peak[1] / 2**20:.1f} MiB in {peak[2]} files "
          f"({peak[1] / ranks / seg:.1f} segments per rank) |")
    if samples:
        samples.sort()
        print(f"| spool disk use, median | {samples[len(samples) // 2] / 2**20:.1f} MiB |")
    print(f"| spool after the run | {end[1] / 2**20:.2f} MiB in {end[2]} files (finished "
          "segments, kept for the retention) |")
    print(f"| bound: ranks x (in flight + 1) x segment, with 2 in flight | "
          f"{ranks * 3 * seg / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
