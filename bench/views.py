"""`expr export --format parquet` and `expr query` on a synthetic 4,096-rank run.

The run: RANKS shards of STEPS step rows each (`loss`, `lr`, `grad_norm`, `tokens`; one
`loss` in 997 is the string "NaN"), written as the SDK writes them. Each command runs in its
own process; wall time is measured around it and peak RSS is that child's own
(`os.wait4` rusage). Prints a markdown table, then the ratios of issue 24, each measured
side by side in this run (best of ROUNDS, interleaved; the machine may be shared):

- `expr query` count per rank against its floor: DuckDB in a fresh process running the
  same GROUP BY over the same files with the schema given (`read_json(..., columns=...)`),
  and against the previous path (column detection over every shard, `EXACT_SHARDS` raised).
- `expr export --format parquet` against DuckDB's own `COPY (SELECT * FROM metrics) TO
  'x.parquet'` over the same views, in a fresh process.

With `--16k`: `expr query` count per rank over the 16,384-rank run of `bench/scale.py`
(cached in $EXPR_SCALE_CACHE, generated there when absent: step rows and rank records,
16,384 shards, 690 MB), against DuckDB in a fresh process running the same GROUP BY
with the schema given, and the EXPR_BENCH_BEFORE tree, in the same rounds.

    python bench/views.py [ranks] [steps] [--ratios-only]
    python bench/views.py --16k
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

EXPR = [sys.executable, "-c", "from expr_cli.main import entry; entry()"]
# the path before issue 24: DuckDB detects the columns over every shard
EXPR_EXACT = [sys.executable, "-c", "import expr_tracker.views.sql as s; s.EXACT_SHARDS = 1 << 40\n"
              "from expr_cli.main import entry; entry()"]
ROUNDS = int(os.environ.get("EXPR_BENCH_ROUNDS", "3"))
FLOOR_QUERY = """
import duckdb, sys, glob
files = sorted(glob.glob(sys.argv[1] + '/metrics*.jsonl'))
cols = {'_step': 'BIGINT', '_time': 'DOUBLE', 'loss': 'DOUBLE', 'lr': 'DOUBLE',
        'grad_norm': 'DOUBLE', 'tokens': 'BIGINT'}
rows = duckdb.connect().execute(
    "SELECT _file, count(*) FROM read_json(?, format='newline_delimited', columns=?, "
    "filename='_file', ignore_errors=true) GROUP BY 1", [files, cols]).fetchall()
assert len(rows) == len(files)
"""
# the same GROUP BY over the same bytes in one file (each row's rank from its own key):
# DuckDB's scan without its cost per file (DuckDB 2.0 binds read_json again for each file)
FLOOR_ONE_FILE = """
import duckdb, sys
cols = {'_r': 'BIGINT', '_step': 'BIGINT', '_time': 'DOUBLE', 'loss': 'DOUBLE', 'lr': 'DOUBLE',
        'grad_norm': 'DOUBLE', 'tokens': 'BIGINT'}
rows = duckdb.connect().execute(
    "SELECT _r, count(*) FROM read_json(?, format='newline_delimited', columns=?, "
    "ignore_errors=true) GROUP BY 1", [sys.argv[1], cols]).fetchall()
assert len(rows) == int(sys.argv[2])
"""
FLOOR_COPY = """
import duckdb, sys
from expr_tracker.store.runread import ALL_STREAMS, run_shards
from expr_tracker.views.sql import _shard_views
con = duckdb.connect()
for stmt in _shard_views(con, run_shards(sys.argv[1], ALL_STREAMS)):
    con.execute(stmt)
con.execute("COPY (SELECT * FROM metrics) TO '" + sys.argv[2] + "' (FORMAT parquet)")
"""
# the same over the views as the previous pass had them: a plain unnest of the transform,
# below which DuckDB pushed the filter (each line transformed up to three times)
FLOOR_COPY_UNFENCED = ("from expr_tracker.views import duckcopy\n"
                       "duckcopy.transformed = lambda keep, st, obj, where=None: "
                       "f'(SELECT {keep}, unnest(json_transform(json, {st})) FROM {obj})'\n"
                       + FLOOR_COPY)


def make_run(run: Path, ranks: int, steps: int) -> int:
    """Write the shards; the bytes written."""
    run.mkdir(parents=True)
    rnd = random.Random(7)
    total = 0
    for r in range(ranks):
        lines = []
        for s in range(steps):
            loss = 2.0 / (1 + s / 50) + rnd.gauss(0, 0.02)
            row = {"_step": s, "_time": 1.7e9 + s * 0.5 + r * 1e-4,
                   "loss": "NaN" if (r * steps + s) % 997 == 0 else loss,
                   "lr": 3e-4, "grad_norm": abs(rnd.gauss(1.0, 0.1)), "tokens": 4096 * (s + 1)}
            lines.append(orjson.dumps(row))
        body = b"\n".join(lines) + b"\n"
        name = "metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"
        (run / name).write_bytes(body)
        total += len(body)
    return total


def measure(args: list[str], cwd: Path, argv0: list[str] = EXPR,
            env: dict[str, str] | None = None) -> tuple[float, float, str, float]:
    """(seconds, peak RSS MiB, stdout, CPU seconds: user + system, every thread) of one
    child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*argv0, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env)
    out = proc.stdout.read()  # type: ignore[union-attr]
    err = proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{args}: exit {proc.returncode}: {err.decode()}")
    return dt, usage.ru_maxrss / 1024, out.decode(), usage.ru_utime + usage.ru_stime


def main() -> None:
    if "--16k" in sys.argv:
        query_16k()
        return
    args = [a for a in sys.argv[1:] if a != "--ratios-only"]  # --ratios-only: no table
    ranks = int(args[0]) if args else 4096
    steps = int(args[1]) if len(args) > 1 else 200
    with tempfile.TemporaryDirectory(prefix="expr-bench-views-") as tmp:
        root = Path(tmp)
        run = root / "proj" / "big"
        t0 = time.perf_counter()
        size = make_run(run, ranks, steps)
        made = time.perf_counter() - t0
        rows = ranks * steps
        print(f"run: {ranks} ranks x {steps} steps = {rows:,} rows, {size / 2**20:.0f} MiB in "
              f"{ranks} shards (written in {made:.1f} s)\n")
        if "--ratios-only" in sys.argv:
            ratios(root, run, ranks)
            return
        cases = [
            ("`expr export --format parquet`", ["export", str(run), "--format", "parquet",
                                                "--out", str(root / "big.parquet")]),
            ("`expr export --format csv`", ["export", str(run), "--format", "csv",
                                            "--out", str(root / "big.csv")]),
            ("`expr query` count per rank", ["query", str(run), "--csv",
                                             "SELECT _rank, count(*) AS n FROM metrics GROUP BY 1"]),
            ("`expr query` NaN count, mean loss over steps 100:200",
             ["query", str(run), "--csv",
              "SELECT count(*) FILTER (WHERE isnan(loss)) AS nans, "
              "avg(loss) FILTER (WHERE NOT isnan(loss) AND _step >= 100) AS mean FROM metrics"]),
            ("`expr query` DESCRIBE metrics (views only)", ["query", str(run), "--csv",
                                                           "DESCRIBE metrics"]),
        ]
        print("| command | wall time | peak RSS |")
        print("|---|---|---|")
        for label, args in cases:
            dt, rss, out, _ = measure(args, root)
            if "count per rank" in label:
                assert out.count("\n") == ranks + 1, out[:200]
            print(f"| {label} | {dt:.1f} s | {rss:.0f} MiB |")
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(root / "big.parquet").metadata
        assert meta.num_rows == rows, meta.num_rows
        print(f"\nparquet: {meta.num_rows:,} rows, {meta.num_row_groups} row groups, "
              f"{(root / 'big.parquet').stat().st_size / 2**20:.1f} MiB")
        ratios(root, run, ranks)


def one_file(root: Path, run: Path) -> Path:
    """The run's shards in one file, each line with its rank (`_r`) as its first key."""
    out = root / "one-file.jsonl"
    with open(out, "wb") as fh:
        for path in sorted(run.glob("metrics*.jsonl")):
            name = path.name
            rank = 0 if name == "metrics.jsonl" else int(name[len("metrics.rank"):-len(".jsonl")])
            tag = b'{"_r":%d,' % rank
            fh.write(tag + path.read_bytes()[1:].replace(b"\n{", b"\n" + tag))
    return out


def ratios(root: Path, run: Path, ranks: int) -> None:
    """The issue 24 ratios, each side by side with its floor, best of ROUNDS."""
    count = ["query", str(run), "--csv", "SELECT _rank, count(*) AS n FROM metrics GROUP BY 1"]
    py = [sys.executable, "-c"]
    cases = {
        "query": (EXPR, count),
        "query, detection over every shard (before)": (EXPR_EXACT, count),
        "query floor: DuckDB, schema given": (py, [FLOOR_QUERY, str(run)]),
        "query floor: DuckDB, the same bytes in one file": (py, [FLOOR_ONE_FILE,
                                                                 str(one_file(root, run)),
                                                                 str(ranks)]),
        "export parquet": (EXPR, ["export", str(run), "--format", "parquet", "--force",
                                  "--out", str(root / "r.parquet")]),
        "export floor: DuckDB COPY over the views": (py, [FLOOR_COPY, str(run),
                                                          str(root / "d.parquet")]),
        "export floor: the same, the views as the previous pass had them": (
            py, [FLOOR_COPY_UNFENCED, str(run), str(root / "u.parquet")]),
    }
    envs: dict[str, dict[str, str] | None] = dict.fromkeys(cases)
    before = os.environ.get("EXPR_BENCH_BEFORE")  # another checkout: its export, same rounds
    if before:
        for label in ("query", "export parquet"):
            cases[f"{label} (before)"] = cases[label]
            envs[f"{label} (before)"] = {**os.environ, "PYTHONPATH": before}
    best = dict.fromkeys(cases, float("inf"))
    cpu = dict.fromkeys(cases, float("inf"))  # less bent by other jobs than wall time
    for _ in range(ROUNDS):
        for label, (argv0, args) in cases.items():
            dt, _, out, used = measure(args, root, argv0, envs[label])
            if argv0 is not py and args is count:
                assert out.count("\n") == ranks + 1, out[:200]
            best[label] = min(best[label], dt)
            cpu[label] = min(cpu[label], used)
    q, qf, e, ef = (best["query"], best["query floor: DuckDB, schema given"],
                    best["export parquet"], best["export floor: DuckDB COPY over the views"])
    print(f"\nissue 24, best of {ROUNDS} interleaved rounds ({os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f} at the end):\n")
    print("| measure | time | floor | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| `expr query` count per rank, {ranks:,} ranks | {q:.2f} s | {qf:.2f} s | "
          f"{q / qf:.2f}x | <= 1 s: {'yes' if q <= 1 else 'NO'} |")
    if before:
        qb = best["query (before)"]
        print(f"| same, from {before} (before) | {qb:.2f} s | {qf:.2f} s | {qb / qf:.2f}x | |")
    old = best["query, detection over every shard (before)"]
    print(f"| same, detection over every shard (issue 24's start) | {old:.2f} s | {qf:.2f} s | "
          f"{old / qf:.2f}x | |")
    one = best["query floor: DuckDB, the same bytes in one file"]
    print(f"| DuckDB, the same bytes in one file (no cost per file) | {one:.2f} s | {qf:.2f} s | "
          f"{one / qf:.2f}x | |")
    print(f"| `expr export --format parquet` | {e:.2f} s | {ef:.2f} s (DuckDB COPY) | "
          f"{e / ef:.2f}x | <= 2x: {'yes' if e <= 2 * ef else 'NO'} |")
    if before:
        eb = best["export parquet (before)"]
        print(f"| same, from {before} (before) | {eb:.2f} s | {ef:.2f} s | {eb / ef:.2f}x | |")
    eu = best["export floor: the same, the views as the previous pass had them"]
    print(f"| `expr export --format parquet`, against COPY over the previous pass's views | "
          f"{e:.2f} s | {eu:.2f} s | {e / eu:.2f}x | |")
    print(f"\nCPU time (user + system of every thread of the child, best of {ROUNDS}):\n")
    print("| measure | CPU | ratio to its floor's CPU |")
    print("|---|---|---|")
    for label in cases:
        floor = cpu["query floor: DuckDB, schema given"] if label.startswith("query") else \
            cpu["export floor: DuckDB COPY over the views"]
        print(f"| {label} | {cpu[label]:.2f} s | {cpu[label] / floor:.2f}x |")


FLOOR_16K = """
import duckdb, sys
from expr_tracker.store.runread import ALL_STREAMS, run_shards
files = [str(s.path) for s in run_shards(sys.argv[1], ALL_STREAMS)]
cols = {'_kind': 'VARCHAR', '_step': 'BIGINT', '_time': 'DOUBLE', '_rank': 'BIGINT',
        'loss': 'DOUBLE', 'tokens': 'BIGINT'}
rows = duckdb.connect().execute(
    "SELECT file_index, count(*) FROM read_json(?, format='newline_delimited', columns=?, "
    "ignore_errors=true) WHERE _kind IS NULL AND _step IS NOT NULL GROUP BY 1",
    [files, cols]).fetchall()
assert len(rows) == len(files)
"""


def query_16k() -> None:
    """`expr query` count per rank over 16,384 ranks, side by side with its floor."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.scale import cached_run

    run = cached_run(16384, 200) / "bench" / "big"
    for path in run.iterdir():  # the page cache warm for every case alike
        with open(path, "rb") as fh:
            while fh.read(1 << 20):
                pass
    count = ["query", str(run), "--csv", "SELECT _rank, count(*) AS n FROM metrics GROUP BY 1"]
    py = [sys.executable, "-c"]
    cases: dict[str, tuple[list[str], list[str], dict[str, str] | None]] = {
        "query": (EXPR, count, None),
        "floor: DuckDB, schema given": (py, [FLOOR_16K, str(run)], None),
    }
    before = os.environ.get("EXPR_BENCH_BEFORE")
    if before:
        cases["query (before)"] = (EXPR, count, {**os.environ, "PYTHONPATH": before})
    best = dict.fromkeys(cases, float("inf"))
    cpu = dict.fromkeys(cases, float("inf"))
    with tempfile.TemporaryDirectory(prefix="expr-bench-16k-") as tmp:
        for _ in range(ROUNDS):
            for label, (argv0, args, env) in cases.items():
                dt, _, out, used = measure(args, Path(tmp), argv0, env)
                if args is count:
                    assert out.count("\n") == 16384 + 1, out[:200]
                best[label] = min(best[label], dt)
                cpu[label] = min(cpu[label], used)
    floor = "floor: DuckDB, schema given"
    print(f"`expr query` count per rank, 16,384 ranks x 200 steps (step rows and rank records), "
          f"best of {ROUNDS} interleaved rounds ({os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f} at the end):\n")
    print("| measure | wall | ratio | CPU | CPU ratio |")
    print("|---|---|---|---|---|")
    for label in cases:
        print(f"| {label} | {best[label]:.2f} s | {best[label] / best[floor]:.2f}x | "
              f"{cpu[label]:.2f} s | {cpu[label] / cpu[floor]:.2f}x |")


if __name__ == "__main__":
    main()
