"""Scale benchmark (issue 12): synthetic runs of 1,024, 4,096 and 16,384 ranks.

    python bench/scale.py [WORLDS] [STEPS]        e.g. python bench/scale.py 1024,4096,16384 200

For each world size: `expr summary --json` of the last 50 steps (wall time and peak RSS of
the process) side by side with DuckDB computing the same statistics over the same files,
`expr shards`, and one `expr watch --once` pass when that command exists (a first pass:
the run's incidents.jsonl is removed before it, and the pass must find the planted
straggler and the crashed rank). Then exprd with
2,048 live spool files: ingest rate, RSS and open descriptors. Prints markdown tables and
the cost per rank (the curve: flat means linear).

Runs are generated once into $EXPR_SCALE_CACHE (default /tmp/expr-scale-cache) and reused:
16,384 shards of 200 steps take about 1.3 GB. Targets: the 16,384-rank summary in at most
5 s and no slower than DuckDB, peak RSS at most 500 MB, cost growing no faster than
linearly with ranks.

Issue 24: each read command's ratio to its floor, measured in the same run: FLOOR, a fresh
Python process that reads and parses (orjson) every sidecar and the last 100 lines of every
shard, the bytes any of these commands needs at least; `expr summary` of a job that logs
with `et.log` only (step rows, no rank records) against the same floor of its own run.
Best of ROUNDS, interleaved (the
machine may be shared). Target: every ratio at most 1.5x at 16,384 ranks. With
EXPR_BENCH_BEFORE=<another checkout of the project> each command also runs from that tree
(PYTHONPATH), in the same rounds: before and after side by side. `--ratios-only` skips the
tables above.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.synthetic import write_run  # noqa: E402

EXPR = [sys.executable, "-m", "expr_cli.main"]
CACHE = Path(os.environ.get("EXPR_SCALE_CACHE", "/tmp/expr-scale-cache"))
WINDOW = 50
ROUNDS = 3
FLOOR = """
import os, sys, orjson
run = sys.argv[1]
rows = 0
for name in os.listdir(run):
    if not (name.startswith("metrics") and name.endswith(".jsonl")):
        continue
    with open(os.path.join(run, name[:-6] + ".meta.json"), "rb") as fh:
        orjson.loads(fh.read())
    with open(os.path.join(run, name), "rb") as fh:
        end = fh.seek(0, 2)
        block = 16384
        while True:  # enough of the tail for 100 whole lines
            start = max(0, end - block)
            fh.seek(start)
            data = fh.read(end - start)
            if data.count(b"\\n") > 100 or start == 0:
                break
            block *= 2
    for line in data.split(b"\\n")[-101:]:
        if line:
            try:
                orjson.loads(line)
                rows += 1
            except orjson.JSONDecodeError:
                pass
print(rows)
"""


def cached_run(world: int, steps: int) -> Path:
    """The synthetic run of `world` ranks (straggler rank world/2+1, rank 17 crashed)."""
    root = CACHE / f"w{world}-s{steps}"
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.monotonic()
        write_run(root / "bench" / "big", world, steps, straggler=world // 2 + 1, crashed=17)
        done.write_text(f"{time.monotonic() - t0:.1f}\n")
    return root


ROWS_FLOOR = "floor of the run of step rows only"


def cached_rows_run(world: int, steps: int) -> Path:
    """`cached_run` as a job that logs with `et.log` only: step rows, no rank records."""
    root = CACHE / f"rows-w{world}-s{steps}"
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        write_run(root / "bench" / "rows", world, steps, straggler=world // 2 + 1, crashed=17,
                  rank_records=False)
        done.write_text("\n")
    return root


def rss_of(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run `argv` in a fresh Python wrapper that reports its child's peak RSS via wait4."""
    code = (
        "import os, sys, json, time, subprocess\n"
        "t0 = time.monotonic()\n"
        "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "out = p.stdout.read()\n"
        "_, status, ru = os.wait4(p.pid, 0)\n"
        "wall = time.monotonic() - t0\n"
        "p.returncode = os.waitstatus_to_exitcode(status)\n"
        "sys.stdout.write(json.dumps({'wall': wall, 'rss': ru.ru_maxrss / 1024, "
        "'code': p.returncode, 'out': out.decode()}))\n"
    )
    # from the run cache, not the checkout: `python -m` puts the working directory ahead
    # of PYTHONPATH, and EXPR_BENCH_BEFORE's tree would import this one
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, env=env,
                         check=True, cwd=CACHE)
    data = json.loads(res.stdout)
    if data["code"] not in (0, 1):
        raise RuntimeError(f"{argv} exited {data['code']}")
    return data["wall"], data["rss"], data["out"]


DUCK = """
import duckdb, json, sys, time
glob = sys.argv[1]
con = duckdb.connect()
con.execute("SET threads TO 2")
q = '''
WITH r AS (
  SELECT _step, _rank, step_time FROM read_json_auto(?, format='newline_delimited',
    union_by_name=true, ignore_errors=true) WHERE _kind = 'rank'
), top AS (SELECT max(_step) AS m FROM r)
SELECT _step, count(*), avg(step_time), stddev_pop(step_time), min(step_time), max(step_time),
  quantile_cont(step_time, [0.05, 0.5, 0.95])
FROM r, top WHERE _step > m - 50 GROUP BY _step ORDER BY _step
'''
rows = con.execute(q, [glob]).fetchall()
print(json.dumps({"steps": len(rows), "n_last": rows[-1][1]}))
"""


def duckdb_summary(root: Path, env: dict[str, str]) -> tuple[float, float, str]:
    glob = str(root / "bench" / "big" / "metrics*.jsonl")
    return rss_of([sys.executable, "-c", DUCK, glob], env)


def exprd_many(count: int = 2048, events: int = 100) -> dict[str, float]:
    """exprd over `count` live spool files of `events` events each: ingest rate, RSS, fds."""
    sys.path.insert(0, str(REPO / "bench"))
    from daemon import EXPRD, config, many_files, rss_mb, wait_ready  # type: ignore[import-not-found]

    with tempfile.TemporaryDirectory(prefix="exprd-scale-") as t:
        tmp = Path(t)
        spool, root, state = many_files(tmp, f"many{count}", count, events)
        total = count * (events + 1)  # each file: init + events (the finish was dropped)
        d = subprocess.Popen([*EXPRD, "--config", str(config(tmp, spool, state, root))],
                             stderr=subprocess.DEVNULL)
        try:
            t0 = time.monotonic()
            wait_ready(state, d)
            applied = 0
            while time.monotonic() - t0 < 600:
                try:
                    st = json.loads((state / "status.json").read_text())
                    applied = st["totals"]["applied"]
                    if applied >= count * events and st["totals"]["files"] >= count:
                        break
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.1)
            wall = time.monotonic() - t0
            time.sleep(1.0)
            rss = rss_mb(d.pid)
            fds = len(os.listdir(f"/proc/{d.pid}/fd"))
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(30)
    return {"files": count, "events": total, "applied": applied, "wall": wall,
            "rate": applied / wall if wall else 0.0, "rss": rss, "fds": fds}


def ratios(rows: list[dict[str, object]], env: dict[str, str]) -> None:
    """Issue 24: each read command against FLOOR at the largest world, best of ROUNDS."""
    world = max(int(r["world"]) for r in rows)  # type: ignore[call-overload]
    root = cached_run(world, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    run = root / "bench" / "big"
    rows_root = cached_rows_run(world, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    env = {**env, "EXPR_DIR": str(root)}
    cases = {
        "floor: sidecars + last 100 lines of every shard, orjson": [sys.executable, "-c", FLOOR,
                                                                     str(run)],
        "`expr summary --json`": [*EXPR, "summary", "big", "--json"],
        "`expr summary -m loss --json` (step rows)": [*EXPR, "summary", "big", "-m", "loss",
                                                      "--json"],
        ROWS_FLOOR: [sys.executable, "-c", FLOOR, str(rows_root / "bench" / "rows")],
        "`expr summary --json` of a run of step rows only": [*EXPR, "--dir", str(rows_root),
                                                             "summary", "rows", "--json"],
        "`expr shards`": [*EXPR, "shards", "big"],
        "`expr runs --json` (the root of that one run)": [*EXPR, "runs", "--json"],
        "`expr watch --once --json`": [*EXPR, "watch", "big", "--once", "--json"],
        "`expr top --once --json`": [*EXPR, "top", "big", "--once", "--json"],
    }
    before = os.environ.get("EXPR_BENCH_BEFORE")
    envs = dict.fromkeys(cases, env)
    if before:
        for label in [c for c in cases if not c.startswith("floor")]:
            cases[f"{label} (before)"] = cases[label]
            envs[f"{label} (before)"] = {**env, "PYTHONPATH": before}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(ROUNDS):
        for label, argv in cases.items():
            (run / "incidents.jsonl").unlink(missing_ok=True)  # watch: a first pass each time
            wall, _, _ = rss_of(argv, envs[label])
            best[label] = min(best[label], wall)
    floor = best.pop("floor: sidecars + last 100 lines of every shard, orjson")
    rows_floor = best.pop(ROWS_FLOOR)
    print(f"\nIssue 24 at {world:,} ranks, best of {ROUNDS} interleaved rounds, "
          f"{os.cpu_count()} cores (load {os.getloadavg()[0]:.1f} at the end):\n")
    print("| command | wall | floor | ratio | <= 1.5x |")
    print("| --- | --- | --- | --- | --- |")
    for label, wall in best.items():
        low = rows_floor if "step rows only" in label else floor  # (its own run's)
        print(f"| {label} | {wall:.2f} s | {low:.2f} s | {wall / low:.2f}x | "
              f"{'yes' if wall <= 1.5 * low else 'NO'} |")


def main() -> None:
    worlds = [int(w) for w in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096,16384").split(",")]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    env.pop("EXPR_DIR", None)
    have_watch = subprocess.run([*EXPR, "watch", "--help"], capture_output=True,
                                env=env).returncode == 0
    rows: list[dict[str, object]] = []
    if "--ratios-only" in sys.argv:
        ratios([{"world": max(worlds)}], env)
        return
    for world in worlds:
        root = cached_run(world, steps)
        env["EXPR_DIR"] = str(root)
        size = sum(f.stat().st_size for f in (root / "bench" / "big").iterdir())
        # warm the page cache the same way for every tool: we measure the readers, not disk
        for f in (root / "bench" / "big").iterdir():
            f.read_bytes()
        s_wall, s_rss, out = rss_of([*EXPR, "summary", "big", "--json"], env)
        view = json.loads(out)
        st = next(i for i in view["keys"] if i["key"] == "step_time")
        ok = [o["rank"] for o in st["outliers"] if o["flagged"]] == [world // 2 + 1]
        d_wall, d_rss, _ = duckdb_summary(root, env)
        h_wall, h_rss, _ = rss_of([*EXPR, "shards", "big"], env)
        w_wall = w_rss = None
        w_ok = False
        if have_watch:
            # a first pass: no incidents recorded yet (they would be read back, not found)
            (root / "bench" / "big" / "incidents.jsonl").unlink(missing_ok=True)
            w_wall, w_rss, w_out = rss_of([*EXPR, "watch", "big", "--once", "--json"], env)
            found = {(i["kind"], tuple(i["ranks"])) for i in map(json.loads, w_out.splitlines())}
            w_ok = found == {("straggler", (world // 2 + 1,)), ("crashed", (17,))}
        rows.append({"world": world, "bytes": size, "summary_s": s_wall, "summary_mb": s_rss,
                     "straggler_found": ok, "n": st["stats"]["n"], "duckdb_s": d_wall,
                     "duckdb_mb": d_rss, "shards_s": h_wall, "shards_mb": h_rss,
                     "watch_s": w_wall, "watch_mb": w_rss, "watch_found": w_ok})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"Synthetic runs, {steps} steps per rank (a step row and a rank record each), "
          f"summary of the last {WINDOW} steps, warm page cache, {os.cpu_count()} cores.\n")
    print("| ranks | data | summary --json | peak RSS | DuckDB | DuckDB RSS | shards | "
          "shards RSS | watch --once | watch RSS | straggler flagged |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        watch = "n/a" if r["watch_s"] is None else f"{r['watch_s']:.2f} s"
        watch_mb = "n/a" if r["watch_mb"] is None else f"{r['watch_mb']:.0f} MB"
        print(f"| {r['world']:,} | {r['bytes'] / 2**20:,.0f} MB | {r['summary_s']:.2f} s | "
              f"{r['summary_mb']:.0f} MB | {r['duckdb_s']:.2f} s | {r['duckdb_mb']:.0f} MB | "
              f"{r['shards_s']:.2f} s | {r['shards_mb']:.0f} MB | {watch} | {watch_mb} | "
              f"{'yes' if r['straggler_found'] else 'NO'} ({r['n']:,} ranks)"
              f"{'' if r['watch_s'] is None else '; watch: ' + ('yes' if r['watch_found'] else 'NO')} |")
    print("\nCost per rank (flat = linear):\n")
    print("| ranks | summary ms/rank | shards ms/rank | watch --once ms/rank |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        watch = "n/a" if r["watch_s"] is None else f"{1000 * r['watch_s'] / r['world']:.3f}"
        print(f"| {r['world']:,} | {1000 * r['summary_s'] / r['world']:.3f} | "
              f"{1000 * r['shards_s'] / r['world']:.3f} | {watch} |")
    big = max(rows, key=lambda r: r["world"])
    print(f"\nTargets at {big['world']:,} ranks: summary <= 5 s: "
          f"{'yes' if big['summary_s'] <= 5 else 'NO'}; no slower than DuckDB: "
          f"{'yes' if big['summary_s'] <= big['duckdb_s'] else 'NO'}; peak RSS <= 500 MB: "
          f"{'yes' if big['summary_mb'] <= 500 else 'NO'}")
    if big["watch_s"] is not None:
        print(f"watch --once <= 5 s: {'yes' if big['watch_s'] <= 5 else 'NO'}; peak RSS <= 500 MB: "
              f"{'yes' if big['watch_mb'] <= 500 else 'NO'}")
    ratios(rows, env)
    if "--no-exprd" not in sys.argv:
        few = exprd_many(8, 2048 * 100 // 8)  # the same events in 8 files: the rate to match
        d = exprd_many()
        print(f"\nexprd with {d['files']:,} live spool files: {d['applied']:,} events applied in "
              f"{d['wall']:.1f} s ({d['rate']:,.0f} events/s), RSS {d['rss']:.0f} MB, "
              f"{d['fds']} open descriptors; with 8 files: {few['rate']:,.0f} events/s; "
              f"8 files / 2,048 files: {few['rate'] / d['rate']:.2f}x (target <= 2x: "
              f"{'yes' if few['rate'] <= 2 * d['rate'] else 'NO'})")


if __name__ == "__main__":
    main()
