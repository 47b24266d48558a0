"""`make demo`: a 4-rank job end to end, then what each shard holds.

Starts 4 real rank processes (RANK=0..3) of examples/train.py in direct mode,
waits for them, and prints the run's shards, its history and the per-rank summary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def sh(*args: str) -> None:
    print(f"\n$ {' '.join(args)}", flush=True)
    subprocess.run(args, check=False)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="expr-demo-"))
    env = {**os.environ, "EXPR_DIR": str(root), "WORLD_SIZE": "4"}
    print(f"run root: {root}")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "train.py"), "--steps", "120", "--nan-at", "90", "--slow-rank", "2"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(4)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    run_dir = root / "demo" / "sft-1"
    print("\nshards written:")
    for shard in sorted(run_dir.glob("*.jsonl")):
        lines = shard.read_bytes().splitlines()
        print(f"  {shard.name:28} {len(lines):5} lines   last: {lines[-1][:100].decode()}")
    expr = shutil.which("expr", path=str(BIN)) or str(BIN / "expr")
    os.environ["EXPR_DIR"] = str(root)
    if Path(expr).exists():
        sh(expr, "shards", "sft-1")
        sh(expr, "history", "sft-1", "-n", "5")
        sh(expr, "summary", "sft-1", "--heatmap", "step_time")
        sh(expr, "alerts", "sft-1")
    print(f"\nthe run stays in {root}; `rm -r {root}` when done")


if __name__ == "__main__":
    main()
