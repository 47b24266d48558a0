"""The time of each tool of `expr mcp` at 16,384 ranks, through the `mcp` SDK's own client
over stdio (issue 45, DESIGN 20).

The run is `bench/scale.py`'s synthetic one (16,384 ranks x 200 steps, a straggler and a
crashed rank, cached under $EXPR_SCALE_CACHE, default /tmp/expr-scale-cache: ~0.8 GB,
written once). Each tool is called twice in one server: the first call reads the run
(the live state, the shards' tails), the second is what an agent's follow-up question
costs (the server keeps the run's state and answers between calls). Prints a table of
seconds and answer bytes, and whether the answer was cut.

    python bench/mcp.py [WORLD] [STEPS]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the repository, not this script's directory, first: this file's name would hide the SDK's
# `mcp` package from the client
sys.path[0] = str(REPO)

from bench.scale import cached_run  # noqa: E402
from tests.mcpclient import McpClient  # noqa: E402


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    t0 = time.monotonic()
    root = cached_run(world, steps)
    print(f"run: {world:,} ranks x {steps} steps under {root} ({time.monotonic() - t0:.1f} s "
          "to find or write)")
    run = "bench/big"
    straggler = world // 2 + 1
    calls = [
        ("list_runs", {}),
        ("run_summary", {"run": run}),
        ("run_summary", {"run": run, "steps": f"{steps - 50}:{steps}"}),
        ("run_incidents", {"run": run}),
        ("rank_vs_median", {"run": run, "rank": straggler}),
        ("metric_series", {"run": run, "metric": "step_time"}),
        ("first_crossing", {"run": run, "metric": "loss", "value": 0.5, "direction": "below"}),
        ("compare_runs", {"runs": [run], "metric": "loss"}),
        ("query", {"run": run, "sql": "SELECT _rank, avg(step_time) AS st FROM ranks "
                                      "GROUP BY _rank ORDER BY st DESC LIMIT 5"}),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
    t0 = time.monotonic()
    with McpClient(["--dir", str(root)], env) as c:
        print(f"server started and initialized: {time.monotonic() - t0:.2f} s")
        print(f"{'tool':<16} {'arguments':<40} {'first':>8} {'again':>8} {'bytes':>7}  cut")
        for tool, args in calls:
            first = c.call(tool, timeout=600, **args)
            again = c.call(tool, timeout=600, **args)
            shown = ", ".join(f"{k}={v}" for k, v in args.items() if k != "run")[:40]
            cut = "error: " + first.text[:60] if first.error else str(first.json["cut"]).lower()
            print(f"{tool:<16} {shown:<40} {first.seconds:>7.2f}s {again.seconds:>7.2f}s "
                  f"{first.bytes:>7,}  {cut}")


if __name__ == "__main__":
    main()
