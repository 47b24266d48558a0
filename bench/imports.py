"""`expr import tensorboard` of a million-point TensorBoard log, against its floor.

The log: STEPS steps of TAGS scalars each (10 x 100,000 = 1,000,000 points), one event per
step as TensorBoard's own `EventFileWriter` writes it (cached in $EXPR_BENCH_CACHE or a
temp dir). Each measure runs in a fresh process, wall time around it, best of ROUNDS,
interleaved (the machine may be shared):

- floor: reading every event of the file with TensorBoard's record reader (the one the
  import uses, checksums included) and parsing each into an `Event`, touching every value:
  what any importer through the library must pay.
- `expr import tensorboard LOGDIR --project bench --name tb` into a fresh root.
- for reference, TensorBoard's `EventAccumulator` (what tbparse reads with) loading every
  scalar (`size_guidance` 0: no sampling).

    python bench/imports.py [steps] [tags]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = int(os.environ.get("EXPR_BENCH_ROUNDS", "3"))
TARGET = 1.5  # the import's reading is the floor's; rows, JSON and the fsync cost the rest

WRITE = """
import sys, time
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
steps, tags = int(sys.argv[2]), int(sys.argv[3])
w = EventFileWriter(sys.argv[1], max_queue_size=1000, flush_secs=1000)
t0 = 1_735_689_600.0
for step in range(steps):
    values = [summary_pb2.Summary.Value(tag=f"train/m{k}", simple_value=1.0 / (step + k + 1))
              for k in range(tags)]
    w.add_event(event_pb2.Event(wall_time=t0 + step * 0.1, step=step,
                                summary=summary_pb2.Summary(value=values)))
w.close()
"""

FLOOR = """
import sys, glob
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
n = 0
for path in sorted(glob.glob(sys.argv[1] + "/*tfevents*")):
    reader = PyRecordReader_New(path)
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        event = event_pb2.Event()
        event.ParseFromString(reader.record())
        for v in event.summary.value:
            n += v.simple_value == v.simple_value
print(n)
"""

ACCUMULATOR = """
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS
acc = EventAccumulator(sys.argv[1], size_guidance={SCALARS: 0})
acc.Reload()
print(sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"]))
"""

EXPR = [sys.executable, "-c", "from expr_cli.main import entry; entry()"]


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB, the child's own: `os.wait4`) of one command."""
    t = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    took = time.perf_counter() - t
    err = child.stderr.read().decode() if child.stderr else ""
    if status != 0:
        raise SystemExit(f"{cmd[:3]} failed: {err[-2000:]}")
    return took, usage.ru_maxrss / 1024


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    tags = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    cache = Path(os.environ.get("EXPR_BENCH_CACHE") or tempfile.gettempdir())
    logdir = cache / f"expr-bench-tb-{steps}x{tags}"
    if not logdir.exists():
        tmp = logdir.with_name(logdir.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run([sys.executable, "-c", WRITE, str(tmp), str(steps), str(tags)],
                       check=True, timeout=3600)
        tmp.rename(logdir)
    size = sum(p.stat().st_size for p in logdir.iterdir())
    best: dict[str, float] = {}
    rss: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        for i in range(ROUNDS):
            root = Path(work) / f"root{i}"
            runs = {
                "floor": [sys.executable, "-c", FLOOR, str(logdir)],
                "import": [*EXPR, "import", "tensorboard", str(logdir), "--project", "bench",
                           "--name", "tb", "--dir", str(root)],
                "accumulator": [sys.executable, "-c", ACCUMULATOR, str(logdir)],
            }
            for what, cmd in runs.items():
                took, peak = timed(cmd)
                best[what] = min(best.get(what, took), took)
                rss[what] = max(rss.get(what, 0.0), peak)
            shutil.rmtree(root, ignore_errors=True)
    points = steps * tags
    print(f"{points:,} points ({steps:,} steps x {tags} tags), {size / 1e6:.1f} MB of events, "
          f"best of {ROUNDS}, load {os.getloadavg()[0]:.1f}")
    print("| measure | wall | ratio to floor | peak RSS |")
    print("|---|---|---|---|")
    for what, label in (("floor", "floor: TensorBoard's record reader + Event parse"),
                        ("import", "`expr import tensorboard` (read, write, fsync, rename)"),
                        ("accumulator", "TensorBoard's EventAccumulator (tbparse's reader)")):
        print(f"| {label} | {best[what]:.2f} s | {best[what] / best['floor']:.2f}x "
              f"| {rss[what]:.0f} MiB |")
    ratio = best["import"] / best["floor"]
    print(f"import / floor: {ratio:.2f}x (target <= {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
