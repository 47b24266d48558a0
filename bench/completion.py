"""One TAB of `expr` completion through the installed console script, side by side.

Each case runs the real `.venv/bin/expr` with the environment bash's completion function
sets (`_EXPR_COMPLETE=complete_bash`, COMP_WORDS, COMP_CWORD), over a run root of 50 runs:
the fast path (the generated table, run names computed) against typer's own completion
(the same request answered by the typer app), with a bare interpreter start as the floor.
Best and median of N runs each, warm caches.

    python bench/completion.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXPR = str(Path(sys.executable).with_name("expr"))


def timed(cmd: list[str], env: dict[str, str], n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        for i in range(50):
            run = root / "proj" / f"run-{i:02d}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text('{"_step":0,"_time":1,"loss":1}\n')
        env = {**os.environ, "EXPR_DIR": str(root), "_EXPR_COMPLETE": "complete_bash"}
        cases = {"command name (`expr su<TAB>`)": ("expr su", "1"),
                 "run name (`expr summary run-1<TAB>`)": ("expr summary run-1", "2"),
                 "option (`expr summary run-01 --st<TAB>`)": ("expr summary run-01 --st", "3")}
        typer_app = [sys.executable, "-c", "from expr_cli.main import get_app; get_app()(prog_name='expr')"]
        floor = timed([sys.executable, "-c", "pass"], env, n)
        print(f"machine: {os.cpu_count()} cores; {n} runs each; best / median in ms\n")
        print("| TAB | fast path (expr) | typer's completion | bare `python -c pass` |")
        print("| --- | --- | --- | --- |")
        for label, (words, cword) in cases.items():
            e = {**env, "COMP_WORDS": words, "COMP_CWORD": cword}
            fast, slow = timed([EXPR], e, n), timed(typer_app, e, n)
            print(f"| {label} | {fast[0] * 1e3:.0f} / {fast[1] * 1e3:.0f} | "
                  f"{slow[0] * 1e3:.0f} / {slow[1] * 1e3:.0f} | "
                  f"{floor[0] * 1e3:.0f} / {floor[1] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
