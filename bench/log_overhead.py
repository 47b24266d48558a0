"""Per-call cost of `et.log` against its floor, measured side by side in one process.

Floor: `orjson.dumps` of the same row with `_step` and `_time`, appended to a buffered
file; the write floor, the same with one `os.write` per row to an `O_APPEND` file (what
spool mode must do for `kill -9` to lose no row, docs/spool.md). Measured in interleaved rounds against it: `et.log({"loss", "lr"})` in direct
mode, the same in spool mode, and with five alert rules; each round measures all of them
one after the other, so a busy machine slows them alike, and the medians over rounds are
reported as ratios. Also the import time of `expr_tracker` (`python -X importtime`, with
the bytecode compiled first: this environment may set PYTHONDONTWRITEBYTECODE=1, and an
import that compiles the modules measures the compiler).

    python bench/log_overhead.py [calls per round] [rounds]

With `EXPR_BENCH_BEFORE=<a checkout of another tree>` each measure runs in child
processes of both trees in turn (this tree, then the other, `PAIRS` times), and the
table puts them side by side. `EXPR_BENCH_BEFORE=<a git revision>` (e.g. `HEAD~3`, a
commit hash) measures that revision of this repository, exported to a temporary tree.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import orjson

RULES = [
    "isnan(loss) or isinf(loss)",
    "loss > 100",
    "zscore(loss[50]) > 4",
    "lr < 0",
    "stalled(loss[100])",
]
PAIRS = 5  # child processes per tree with EXPR_BENCH_BEFORE
HERE = Path(__file__).resolve().parent.parent


def per_call(fn: Any, calls: int) -> float:
    """Mean CPU time per call of `fn(i)` over `calls` calls in a tight loop (ns).

    CPU time of the process (its background threads included), not wall time: on a
    machine shared with other work a wall clock also counts the time this process
    waited for a core, which has nothing to do with what a call costs."""
    t0 = time.process_time_ns()
    for i in range(calls):
        fn(i)
    return (time.process_time_ns() - t0) / calls


def measure(tmp: str, calls: int, rounds: int) -> dict[str, float]:
    """Median per-call ns of the floor and of `et.log` direct, spool and with RULES.

    Each round runs a fresh direct and a fresh spool run (`et.init` resumes the same
    shard, so the step goes on) and the floor next to them.
    """
    import expr_tracker as et

    fh = open(os.path.join(tmp, "floor.jsonl"), "ab")  # noqa: SIM115
    fd = os.open(os.path.join(tmp, "write_floor.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    dumps, opt, now, write = orjson.dumps, orjson.OPT_APPEND_NEWLINE, time.time, os.write

    def floor_one(i: int) -> None:
        fh.write(dumps({"_step": i, "_time": now(), "loss": 1.0 / (i + 1), "lr": 3e-4}, option=opt))

    def write_floor_one(i: int) -> None:
        write(fd, dumps({"_step": i, "_time": now(), "loss": 1.0 / (i + 1), "lr": 3e-4}, option=opt))

    log = et.log  # held before init, as `from expr_tracker import log` would be

    def log_one(i: int) -> None:
        log({"loss": 1.0 / (i + 1), "lr": 3e-4})

    out: dict[str, list[float]] = {"floor": [], "write_floor": [], "direct": [], "spool": [],
                                   "rules": []}
    spool = os.path.join(tmp, "spool")
    try:
        for _ in range(rounds):
            out["floor"].append(per_call(floor_one, calls))
            out["write_floor"].append(per_call(write_floor_one, calls))
            et.init("bench", "direct", dir=tmp)
            out["direct"].append(per_call(log_one, calls))
            names = [et.add_alert_rule(rule) for rule in RULES]
            out["rules"].append(per_call(log_one, calls))
            for name in names:
                et.remove_alert_rule(name)
            et.finish()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no exprd runs here: the spool only grows
                et.init("bench", "spool", dir=tmp, upload_mode="spool", spool_dir=spool)
            out["spool"].append(per_call(log_one, calls))
            et.finish()
    finally:
        et.finish()
        fh.close()
        os.close(fd)
    return {k: statistics.median(v) for k, v in out.items()}


def import_ms(env: dict[str, str] | None = None, runs: int = 7) -> list[float]:
    """Self+children time of `import expr_tracker` in `runs` fresh processes (ms; wall
    time, so on a busy machine the fastest says more than the median)."""
    best = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import expr_tracker"],
            capture_output=True, text=True, check=True, env=env,
        ).stderr
        line = [x for x in out.splitlines() if re.search(r"\|\s+expr_tracker$", x)][-1]
        best.append(int(line.split("|")[1]) / 1000)
    return best


def compile_tree(root: Path) -> None:
    """Write the bytecode of `root/expr_tracker` (compileall writes it whatever
    PYTHONDONTWRITEBYTECODE says), so imports load it instead of compiling."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "expr_tracker")],
                   check=True, stdout=subprocess.DEVNULL)


def tree_env(root: Path) -> dict[str, str]:
    """The environment of a child that imports `root`'s expr_tracker (PYTHONPATH comes
    before the editable install's finder)."""
    return {**os.environ, "PYTHONPATH": str(root)}


def child(root: Path, calls: int, rounds: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(calls), str(rounds)],
        capture_output=True, check=True, env=tree_env(root),
    ).stdout
    return orjson.loads(out.splitlines()[-1])


def ratios(m: dict[str, float]) -> dict[str, float]:
    return {"direct": m["direct"] / m["floor"], "spool": m["spool"] / m["floor"],
            "spool_write": m["spool"] / m["write_floor"],
            "rules": m["rules"] / m["direct"], "rules_floor": m["rules"] / m["floor"]}


def import_cell(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} ms (fastest {min(times):.1f})"


def table_one(m: dict[str, float], imp: list[float]) -> None:
    r = ratios(m)
    print("| measure | value | target |\n|---|---|---|")
    print(f"| floor: orjson.dumps + buffered append | {m['floor']:.0f} ns/call | |")
    print(f"| et.log, direct, no rules | {m['direct']:.0f} ns/call ({r['direct']:.2f}x floor) | <= 2x |")
    print(f"| et.log, spool mode | {m['spool']:.0f} ns/call ({r['spool']:.2f}x floor) | <= 2.5x |")
    print(f"| et.log, spool mode / write floor ({m['write_floor']:.0f} ns) | "
          f"{r['spool_write']:.2f}x | |")
    print(f"| et.log, direct, 5 rules | {m['rules']:.0f} ns/call ({r['rules']:.2f}x no rules, "
          f"{r['rules_floor']:.2f}x floor) | <= 3x no rules |")
    print(f"| import expr_tracker, with bytecode | {import_cell(imp)} | <= 60 ms |")


def side_by_side(before: Path, calls: int, rounds: int) -> None:
    trees = {"after": HERE, "before": before}
    for root in trees.values():
        compile_tree(root)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    imports: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(PAIRS):
        for name, root in trees.items():
            runs[name].append(child(root, calls, rounds))
            imports[name].extend(import_ms(tree_env(root), runs=3))
    print(f"{PAIRS} child processes per tree, taken in turn; each {rounds} rounds of "
          f"{calls:,} calls; medians; load average {os.getloadavg()[0]:.1f}\n")
    print("| measure | after | before | target |\n|---|---|---|---|")

    def med(name: str, key: str) -> float:
        return statistics.median(m[key] for m in runs[name])

    def rat(name: str, key: str) -> float:
        return statistics.median(ratios(m)[key] for m in runs[name])

    print(f"| floor: orjson.dumps + buffered append | {med('after', 'floor'):.0f} ns | "
          f"{med('before', 'floor'):.0f} ns | |")
    print(f"| write floor: the same + os.write per row | {med('after', 'write_floor'):.0f} ns | "
          f"{med('before', 'write_floor'):.0f} ns | |")
    for key, label, target in (("direct", "et.log, direct, no rules / floor", "<= 2x"),
                               ("spool", "et.log, spool mode / floor", "<= 2.5x"),
                               ("spool_write", "et.log, spool mode / write floor", ""),
                               ("rules", "et.log, 5 rules / no rules", "<= 3x"),
                               ("rules_floor", "et.log, 5 rules / floor", "")):
        ns = {"rules_floor": "rules", "spool_write": "spool"}.get(key, key)
        print(f"| {label} | {rat('after', key):.2f}x ({med('after', ns):.0f} ns) | "
              f"{rat('before', key):.2f}x ({med('before', ns):.0f} ns) | {target} |")
    print(f"| import expr_tracker, with bytecode | {import_cell(imports['after'])} | "
          f"{import_cell(imports['before'])} | <= 60 ms |")


def export(rev: str, tree: Path) -> None:
    """This repository's `rev`, written out to `tree` (`git archive`, nothing checked out)."""
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    print(f"before: {rev} ({subprocess.run(['git', '-C', str(HERE), 'rev-parse', '--short', rev], capture_output=True, text=True, check=True).stdout.strip()})")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--child"]
    calls = int(args[0]) if args else 20_000
    rounds = int(args[1]) if len(args) > 1 else 15
    if "--child" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            print(orjson.dumps(measure(tmp, calls, rounds)).decode())
        return
    before = os.environ.get("EXPR_BENCH_BEFORE")
    if before and not Path(before).is_dir():
        with tempfile.TemporaryDirectory() as tree:
            export(before, Path(tree))
            side_by_side(Path(tree), calls, max(rounds // PAIRS, 3))
        return
    if before:
        side_by_side(Path(before).resolve(), calls, max(rounds // PAIRS, 3))
        return
    compile_tree(HERE)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(tmp, calls, rounds)
    print(f"{rounds} rounds of {calls:,} calls each, medians; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    table_one(m, import_ms(tree_env(HERE)))


if __name__ == "__main__":
    main()
