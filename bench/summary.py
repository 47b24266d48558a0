"""`expr summary` on a big synthetic run against DuckDB doing the same reductions.

A run of 64 ranks x 5,000 steps with 4 keys per rank record (320,000 rank records,
1.28 million values) is written as 64 shards. Then, each in its own process so
peak memory is its own:

- `expr summary RUN --steps 0:5000 --json`
- DuckDB: `read_json` of the same shards plus SQL computing the same reducers
  (per-rank mean over the window, then mean, weighted mean, min, max, std, p05,
  p50, p95 across ranks, per key)

and `expr history RUN -n 50` on a 1-million-row shard (it reads from the end).
Prints a markdown table. duckdb is installed by `make bench` only.

    python bench/summary.py [ranks] [steps]
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

KEYS = ("step_time", "tokens_per_s", "grad_norm", "loss")

DUCK = r"""
import sys, duckdb
glob = sys.argv[1]
con = duckdb.connect()
con.execute("SET threads TO 2")
rows = con.execute(f'''
WITH raw AS (
  SELECT * FROM read_json('{glob}', format='newline_delimited',
      columns={{'_kind':'VARCHAR','_step':'BIGINT','_rank':'BIGINT','_weight':'DOUBLE',
               'step_time':'DOUBLE','tokens_per_s':'DOUBLE','grad_norm':'DOUBLE','loss':'DOUBLE'}})
  WHERE _kind = 'rank' AND _step >= 0 AND _step < 5000
),
long AS (
  UNPIVOT raw ON step_time, tokens_per_s, grad_norm, loss INTO NAME key VALUE x
),
per_rank AS (
  SELECT key, _rank, avg(x) AS x, avg(_weight) AS w FROM long
  WHERE isfinite(x) GROUP BY key, _rank
)
SELECT key, count(*), avg(x), sum(w * x) / sum(w), min(x), max(x), max(x) - min(x),
       stddev_pop(x), quantile_cont(x, 0.05), quantile_cont(x, 0.5), quantile_cont(x, 0.95)
FROM per_rank GROUP BY key ORDER BY key
''').fetchall()
print(len(rows))
"""


def make_run(root: Path, ranks: int, steps: int) -> Path:
    run = root / "bench" / "big"
    run.mkdir(parents=True)
    rng = random.Random(0)
    for r in range(ranks):
        name = "metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"
        with open(run / name, "wb") as fh:
            buf = []
            for s in range(steps):
                rec = {"_kind": "rank", "_step": s, "_time": 1.7e9 + s, "_rank": r, "_world_size": ranks,
                       "_local_rank": r % 8, "_weight": 4096.0, "step_time": 0.1 + rng.random() * 0.01,
                       "tokens_per_s": 40000 + rng.random() * 100, "grad_norm": 1 + rng.random(),
                       "loss": 2.0 / (1 + s / 100) + rng.random() * 0.01}
                buf.append(orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE))
            fh.write(b"".join(buf))
    return run


_WRAP = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(p.returncode)"
)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Wall seconds and peak RSS (MiB) of one child process (measured by its own wrapper)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{cmd[0]} failed: {out.stderr[-2000:]}")
    peak_kib = int(out.stderr.strip().splitlines()[-1])
    return wall, peak_kib / 1024, out.stdout


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    expr = str(Path(sys.executable).parent / "expr")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        run = make_run(root, ranks, steps)
        gen = time.perf_counter() - t0
        env = {**os.environ, "EXPR_DIR": str(root)}
        duck_wall, duck_rss, _ = timed([sys.executable, "-c", DUCK, str(run / "metrics*.jsonl")])
        ours_wall, ours_rss, out = timed([expr, "summary", str(run), "--steps", f"0:{steps}", "--json"], env)
        data = orjson.loads(out)
        assert data, "empty summary"
        # history -n 50 on a 1-million-row shard
        big = root / "bench" / "hist"
        big.mkdir(parents=True)
        with open(big / "metrics.jsonl", "wb") as fh:
            for chunk in range(100):
                fh.write(b"".join(orjson.dumps({"_step": chunk * 10000 + i, "_time": 1.7e9 + i, "loss": 0.5},
                                               option=orjson.OPT_APPEND_NEWLINE) for i in range(10000)))
        # an installed package has its bytecode cached; this sandbox sets
        # PYTHONDONTWRITEBYTECODE, so let the first (untimed) run write it
        warm = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        cmd = [expr, "history", str(big), "-n", "50", "--format", "json"]
        subprocess.run(cmd, capture_output=True, env=warm, check=True)
        hist = []
        for _ in range(7):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=warm, check=True)
            hist.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([expr, "--version"], capture_output=True, check=True)
        startup = time.perf_counter() - t0
        from expr_tracker.query import history

        t0 = time.perf_counter()
        rows = history(50, run=big)
        in_proc = (time.perf_counter() - t0) * 1000
        assert len(rows) == 50 and rows[-1]["_step"] == 999_999
    print(f"synthetic run: {ranks} ranks x {steps} steps x {len(KEYS)} keys "
          f"({ranks * steps:,} rank records, {ranks * steps * len(KEYS):,} values), written in {gen:.1f} s\n")
    print("| measure | expr | DuckDB | ratio | target |\n|---|---|---|---|---|")
    print(f"| summary --steps 0:{steps} --json, wall | {ours_wall:.2f} s | {duck_wall:.2f} s | "
          f"{ours_wall / duck_wall:.2f}x | <= 2x |")
    print(f"| summary, peak RSS | {ours_rss:.0f} MiB | {duck_rss:.0f} MiB | {ours_rss / duck_rss:.2f}x | |")
    print(f"| history -n 50, 1M-row shard, whole command (median of 7) | "
          f"{statistics.median(hist) * 1000:.0f} ms | | | < 100 ms |")
    print(f"| history(50) in process, 1M-row shard | {in_proc:.1f} ms | | | |")
    print(f"| expr --version (interpreter + CLI start-up) | {startup * 1000:.0f} ms | | | |")


if __name__ == "__main__":
    main()
