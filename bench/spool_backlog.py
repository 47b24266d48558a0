"""A spool backlog of many segments of one session (issue 52 item 3): `exprd --replay`
applies it once, in `_seq` order, deleting each rolled segment once applied.

Segments of one row each are written in the SDK's format (`tests/segfiles.py`), then one
`exprd --replay` child applies them; its wall time and peak RSS are read for a small and
a large backlog, side by side. The ratios say whether the walk stays linear in time
(seconds per segment at the large size / at the small) and bounded in memory.

    python bench/spool_backlog.py [small] [large]      (defaults 2000 100000)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.segfiles import write_segments


def one(n: int) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of a replay of `n` one-row segments."""
    with tempfile.TemporaryDirectory() as tmp:
        spool, root, state = Path(tmp, "spool"), Path(tmp, "runs"), Path(tmp, "state")
        write_segments(spool, root, "back", n)
        os.sync()  # the writes' own writeback is not the replay's
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "exprd", "--replay", "--allow-root", "--log-level",
             "WARNING", f"--spool={spool}", f"--state={state}"],
            capture_output=True, text=True, check=False)
        took = time.monotonic() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = (root / "p" / "back" / "metrics.jsonl").read_bytes().count(b"\n")
        left = len(list((spool / "p" / "back").glob("*.jsonl")))
        assert rows == n and left == 1, (rows, left)
        return took, rss


def main() -> None:
    small, large = (int(a) for a in (sys.argv[1:3] + ["2000", "100000"][len(sys.argv[1:3]):]))
    ts, rs = one(small)
    tl, rl = one(large)  # (RUSAGE_CHILDREN's peak is of every child so far: the larger)
    print(f"load {os.getloadavg()[0]:.1f}")
    print(f"{small:>7} segments: {ts:7.1f} s  {ts / small * 1e3:6.2f} ms/segment  {rs:6.0f} MiB")
    print(f"{large:>7} segments: {tl:7.1f} s  {tl / large * 1e3:6.2f} ms/segment  {rl:6.0f} MiB")
    print(f"ratio per segment {tl / large / (ts / small):.2f}x, peak RSS {rl / rs:.1f}x for "
          f"{large / small:.0f}x the segments")


if __name__ == "__main__":
    main()
