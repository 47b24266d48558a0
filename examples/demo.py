"""`make demo`: the main job end to end on one simulated node.

1. starts `exprd` (the per-node daemon) on a fresh spool;
2. runs 4 real rank processes (RANK=0..3) of examples/train.py in spool mode: they
   only append to the node-local spool; rank 2 is a straggler and rank 0's loss
   diverges at step 90, which the rule `isnan(loss) => critical` catches;
3. waits until exprd has applied every event, stops it with SIGTERM;
4. shows what landed: the shards, history, the per-rank summary with outliers and
   a heatmap, the alerts, and the daemon's status;
5. prints the `expr serve` command that shows the run in a browser.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
RANKS = 4


def sh(*args: str) -> None:
    print(f"\n$ {' '.join(args)}", flush=True)
    subprocess.run([str(BIN / args[0]), *args[1:]], check=False)


def all_finished(run_dir: Path) -> bool:
    sidecars = list(run_dir.glob("metrics*.meta.json"))
    if len(sidecars) < RANKS:
        return False
    return all(orjson.loads(p.read_bytes()).get("status") == "finished" for p in sidecars)


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="expr-demo-"))
    root, spool, state = base / "runs", base / "spool", base / "exprd"
    config = base / "exprd.toml"
    config.write_text(f'allowed_roots = ["{root}"]\nrescan_interval = 1\n')
    env = {**os.environ, "EXPR_DIR": str(root), "EXPR_SPOOL": str(spool), "EXPR_MODE": "spool",
           "WORLD_SIZE": str(RANKS)}
    print(f"demo directory: {base}")
    cmd = [str(BIN / "exprd"), "--spool", str(spool), "--state", str(state), "--config", str(config)]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # the demo may run as root in a container
    daemon = subprocess.Popen(cmd, env=env)
    try:
        # ranks start once exprd's heartbeat is there (else init warns that none runs)
        deadline = time.monotonic() + 15
        while not (spool / ".exprd.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "train.py"), "--steps", "120", "--nan-at", "90",
                 "--slow-rank", "2", "--sleep", "0.04"],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(RANKS)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        run_dir = root / "demo" / "sft-1"
        deadline = time.monotonic() + 30
        while not all_finished(run_dir):
            if time.monotonic() > deadline:
                raise SystemExit("exprd did not apply the spool within 30 s")
            time.sleep(0.2)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
    print(f"\nexprd applied the spool and exited with {daemon.returncode}. Shards written:")
    for shard in sorted(run_dir.glob("*.jsonl")):
        print(f"  {shard.name:24} {len(shard.read_bytes().splitlines()):5} lines")
    os.environ.update(EXPR_DIR=str(root), COLUMNS=os.environ.get("COLUMNS", "100"))
    sh("expr", "shards", "sft-1")
    sh("expr", "history", "sft-1", "-n", "5")
    sh("expr", "summary", "sft-1", "--metric", "step_time", "--heatmap", "step_time")
    sh("expr", "alerts", "sft-1")
    sh("expr", "query", "sft-1", "SELECT kind, ranks, state, detail FROM incidents")
    sh("expr", "plot", "sft-1", "-m", "loss")
    sh("expr", "status", "--state", str(state))
    print(f"\neverything is in {base}; `rm -r {base}` when done")
    print("\nto look at the run in a browser (the Distributed tab: ranks, outliers, heatmap, incidents):")
    print(f"  {BIN / 'expr'} serve --dir {root}    # then open http://127.0.0.1:8321/runs/demo/sft-1")


if __name__ == "__main__":
    main()
