"""The team store in direct mode: what a burst drops and how long finish() waits (issue 20).

    python bench/store_burst.py [ROWS ...]

default 200000 400000. Starts Debian's clickhouse-server on a free 127.0.0.1 port in a
temporary directory (as the tests do). Each measure is one fresh training process that logs
ROWS rows of 3 metrics as fast as it can into a run with the clickhouse backend, then
calls finish(); side by side in one run:

- `now`: the backend's own worker bounds (a queue of `queue_mb` = 64 MB, batches of
  `batch` = 5000 records, the exit bounded by `exit_timeout`);
- `before`: the worker as it was before issue 20 (a 10,000-record queue, batches of 100,
  the shared 30 s finish bound), by turning off the backend's own bounds in that process.

Then finish() against a store that is down (nothing listens), both ways. Prints markdown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chserver import ClickHouse
from tests.procs import env_for

CHILD = """
    import json, sys, tempfile, time
    import expr_tracker as et
    import expr_tracker.direct as direct
    if {before!r}:
        direct._queue = lambda backend: {{}}  # the worker's defaults, as before issue 20
    d = tempfile.mkdtemp()
    et.init("bench", "burst", dir=d, backends=[{{"type": "clickhouse", "url": {url!r},
                                                 "database": {db!r}}}])
    t0 = time.perf_counter()
    for k in range({rows}):
        et.log({{"loss": 1.0 / (k + 1), "lr": 1e-4, "k": k}})
    logged = time.perf_counter() - t0
    et.flush()
    stats = et.info()["backends"]["clickhouse"]
    t1 = time.perf_counter()
    et.finish()
    print(json.dumps({{"logged": logged, "finish": time.perf_counter() - t1,
                       "dropped": stats["dropped"]}}))
"""


def measure(url: str, db: str, rows: int, before: bool) -> dict[str, float]:
    code = textwrap.dedent(CHILD.format(before=before, url=url, db=db, rows=rows))
    out = subprocess.run([sys.executable, "-c", code], env=env_for(), capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [200_000, 400_000]
    with tempfile.TemporaryDirectory() as tmp:
        ch = ClickHouse(Path(tmp) / "clickhouse")
        ch.start()
        try:
            print("| rows logged | way | dropped at log() | landed | log() s | finish() s |")
            print("|---|---|---|---|---|---|")
            for i, rows in enumerate(sizes):
                for before in (True, False):
                    db = f"b{i}{'b' if before else 'n'}"
                    m = measure(ch.url, db, rows, before)
                    landed = ch.count(f"SELECT count() FROM {db}.metrics") // 3
                    print(f"| {rows:,} | {'before' if before else 'now'} | "
                          f"{m['dropped']:,.0f} ({m['dropped'] / rows:.0%}) | {landed:,} | "
                          f"{m['logged']:.1f} | {m['finish']:.1f} |")
        finally:
            ch.stop()
    print()
    print("| store down, 1,000 rows | finish() s |")
    print("|---|---|")
    for before in (True, False):
        m = measure("http://127.0.0.1:9", "down", 1000, before)
        print(f"| {'before' if before else 'now'} | {m['finish']:.1f} |")


if __name__ == "__main__":
    main()
