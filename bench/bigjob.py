"""The end of a big job (issue 53, first row): 16,384 ranks on 2,048 hosts, rank 17 crashed
at step 14, then the scheduler killed the rest (no finish; every file 20 minutes old).

    python bench/bigjob.py [WORLD] [ROUNDS]        e.g. python bench/bigjob.py 16384 3

Side by side, interleaved in each round (the machine may be shared: the load average is
printed), each command a fresh process: `expr summary --json` (the reference),
`expr watch --once --json` (a first pass: incidents.jsonl removed before it) and
`expr top --once --json` (its size too); then a fresh `expr mcp` and its first
`run_incidents`, and a fresh `expr serve` and the time to the answers the run page's
panels draw (summary, the heatmap of step_time, top?limit=64 past `reading`), cold (its
first request) and warm (a second visitor). Best and median of ROUNDS.

Targets (issue 53, "Done when"): watch within 2x of summary, top under 300 KB, the page's
panels within 10 s cold, MCP run_incidents within 5 s, on a quiet machine.

The run is written once into $EXPR_SCALE_CACHE (default /tmp/expr-scale-cache) and aged
again before each round.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# not bench/ first on the path: bench/mcp.py would stand for the `mcp` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

from tests.synthetic import write_run  # noqa: E402

CACHE = Path(os.environ.get("EXPR_SCALE_CACHE", "/tmp/expr-scale-cache"))
STEPS = 30  # rank 17 stops half-way, at step 14
AGE = 1200.0
SERVE = "import sys; from expr_cli.main import entry; sys.argv[0] = 'expr'; sys.exit(entry())"


def killed_run(world: int) -> Path:
    """The killed job's run root (written once), every file aged AGE seconds."""
    root = CACHE / f"killed-w{world}"
    run = root / "bench" / "killed"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        write_run(run, world, STEPS, crashed=17)
        (root / ".complete").write_text("\n")
    old = time.time() - AGE
    for entry in os.scandir(run):
        os.utime(entry.path, (old, old))
    return root


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def timed(args: list[str], root: Path) -> tuple[float, bytes]:
    """Wall seconds and stdout of `expr ARGS` in a fresh process (exit 0 or 1)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SERVE, *args, "--dir", str(root)],
                       capture_output=True, env=env(), cwd=root, check=False)
    took = time.monotonic() - t0
    if p.returncode not in (0, 1):
        raise RuntimeError(f"{args} exited {p.returncode}: {p.stderr.decode()[-500:]}")
    return took, p.stdout


def mcp_incidents(root: Path) -> tuple[float, int, dict[str, Any]]:
    """A fresh `expr mcp` (started before the clock), its first run_incidents."""
    from tests.mcpclient import McpClient

    c = McpClient(["--dir", str(root)], env())
    try:
        a = c.call("run_incidents", timeout=600, run="bench/killed")
    finally:
        c.close()
    if a.error:
        raise RuntimeError(a.text)
    return a.seconds, a.bytes, a.json


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def page_panels(root: Path) -> tuple[float, float, int]:
    """A fresh `expr serve`: seconds until the page's three answers are there (summary,
    heatmap, top past `reading`, asked at once as the page asks them, top polled every
    0.5 s while it reads), for the first visitor and a second one; top's bytes."""
    srv = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--dir", str(root), "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=env(), cwd=root)
    try:
        assert srv.stdout is not None
        base = srv.stdout.readline().strip().rstrip("/") + "/api/runs/bench/killed"
        took = []
        size = 0
        for _ in range(2):
            t0 = time.monotonic()
            asks = [f"{base}/summary", f"{base}/heatmap?metric=step_time&buckets=60"]
            threads = [threading.Thread(target=_get, args=(u,)) for u in asks]
            for t in threads:
                t.start()
            while True:
                with urllib.request.urlopen(f"{base}/top?limit=64", timeout=600) as r:
                    body = r.read()
                if not json.loads(body).get("reading"):
                    break
                time.sleep(0.5)
            for t in threads:
                t.join()
            took.append(time.monotonic() - t0)
            size = len(body)
        return took[0], took[1], size
    finally:
        srv.terminate()
        srv.wait()


def _fmt(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f}"


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    root = killed_run(world)
    run = root / "bench" / "killed"
    t: dict[str, list[float]] = {k: [] for k in ("summary", "watch", "top", "mcp", "cold", "warm")}
    top_kb = mcp_kb = 0.0
    kinds: list[str] = []
    loads = []
    for _ in range(rounds):
        killed_run(world)
        loads.append(os.getloadavg()[0])
        took, _ = timed(["summary", "bench/killed", "--json"], root)
        t["summary"].append(took)
        (run / "incidents.jsonl").unlink(missing_ok=True)
        took, out = timed(["watch", "bench/killed", "--once", "--json"], root)
        t["watch"].append(took)
        kinds = [json.loads(x)["kind"] for x in out.splitlines()]
        took, out = timed(["top", "bench/killed", "--once", "--json"], root)
        t["top"].append(took)
        top_kb = len(out) / 1024
        (run / "incidents.jsonl").unlink(missing_ok=True)
        took, size, _ = mcp_incidents(root)
        t["mcp"].append(took)
        mcp_kb = size / 1024
        (run / "incidents.jsonl").unlink(missing_ok=True)
        cold, warm, _ = page_panels(root)
        t["cold"].append(cold)
        t["warm"].append(warm)
        loads.append(os.getloadavg()[0])
    s = statistics.median(t["summary"])
    print(f"## the killed job: {world:,} ranks, {rounds} rounds (best / median s); "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs\n")
    print("| what | s | vs summary | size |\n| --- | --- | --- | --- |")
    print(f"| expr summary --json | {_fmt(t['summary'])} | 1.00x | |")
    print(f"| expr watch --once --json | {_fmt(t['watch'])} | "
          f"{statistics.median(t['watch']) / s:.2f}x | {len(kinds)} incidents: {', '.join(kinds)} |")
    print(f"| expr top --once --json | {_fmt(t['top'])} | {statistics.median(t['top']) / s:.2f}x "
          f"| {top_kb:.0f} KB |")
    print(f"| MCP run_incidents (fresh server) | {_fmt(t['mcp'])} | "
          f"{statistics.median(t['mcp']) / s:.2f}x | {mcp_kb:.0f} KB |")
    print(f"| page panels, cold (fresh serve) | {_fmt(t['cold'])} | "
          f"{statistics.median(t['cold']) / s:.2f}x | |")
    print(f"| page panels, second visitor | {_fmt(t['warm'])} | "
          f"{statistics.median(t['warm']) / s:.2f}x | |")


if __name__ == "__main__":
    main()
