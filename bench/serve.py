"""`expr serve` at scale (issue 19): the run page of synthetic 4,096- and 16,384-rank runs.

    python bench/serve.py [WORLDS]        e.g. python bench/serve.py 4096,16384

For each world size, side by side in one run: a fresh `expr serve --port 0` and headless
Debian chromium (playwright, no browser download): time to first render of the run page
(navigation to every panel drawn; top's may say it is still reading) and to top's real
panel, bytes transferred (response bodies and headers, the event stream excluded, top's
polls included), then a second visitor on the same server (its live state kept), with
EXPR_BENCH_BEFORE=<another checkout> that tree's server too, in the same rounds;
and, in this process, the server time of a refresh with nothing new (the page's three
requests: summary, heatmap, top) against `expr summary --json` of the same run (which
reads it all again each time). Runs come from bench/scale.py's cache
($EXPR_SCALE_CACHE, default /tmp/expr-scale-cache; 200 steps per rank).

    python bench/serve.py 16384 --tiles [ROUNDS] [--shot docs/serve-16k.png]

Time to first tiles (issue 44) of a fresh server, best and median of ROUNDS after one
round that warms the page cache, this tree and EXPR_BENCH_BEFORE's; with --shot, the
page's screenshot, checked for the crashed rank 17 first, the straggler named, the
coverage run and the crash counted apart.

    python bench/serve.py 16384 --server-only

The scale part alone (issue 19 item 4, issue 24), without a browser: in a fresh process
per round, the server's first build of the run page's three answers (the watcher's first
pass, summary with its chart, heatmap, top) and then the no-change refresh, wall time and
CPU time (the process and its workers, a fork server's included: of the whole round), and
the refresh once 10 s have passed (top's detectors run again, and with a kernel watch the
pass stats every shard), each with the calls on the main thread of a one-thread process
and on a second thread (as the server's request threads run them: such a process may not
fork). With EXPR_BENCH_BEFORE=<another checkout> the same from that tree (PYTHONPATH), in
the same rounds: before and after side by side.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scale import cached_run  # noqa: E402

EXPR = Path(sys.executable).parent / "expr"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
STEPS = 200
REFRESHES = 10


TIMES: dict[str, float] = {}  # of the last page_load: "reading" (the notice), "tiles"


def page_load(browser: object, url: str, shot: Path | None = None) -> tuple[float, int, int, float]:
    """Seconds to every panel drawn (top's may still say it is reading), bytes
    transferred, requests, and seconds to top's real panel (its rank rows); in `TIMES`,
    the seconds to the reading notice and to the first tiles (issue 44). With `shot`,
    a screenshot of the whole page once top's panel is there."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})  # type: ignore[attr-defined]
    page = ctx.new_page()
    sizes: list[int] = []

    def done(req: object) -> None:
        s = req.sizes()  # type: ignore[attr-defined]
        sizes.append(s["responseBodySize"] + s["responseHeadersSize"])

    page.on("requestfinished", done)
    t0 = time.monotonic()
    page.goto(url)  # (returns once the page and its modules are loaded)
    TIMES["reading"] = time.monotonic() - t0 if page.query_selector("#loading") else float("nan")
    page.wait_for_selector("#tile-ranks", timeout=600_000)
    TIMES["tiles"] = time.monotonic() - t0
    page.wait_for_selector("body[data-loaded='1']", timeout=600_000)
    page.wait_for_selector("#chart canvas", timeout=60_000)
    took = time.monotonic() - t0
    page.wait_for_selector("#rank-table", timeout=600_000)  # top's panel (not "reading")
    top = time.monotonic() - t0
    page.wait_for_timeout(300)
    if shot is not None:
        page.wait_for_selector("body[data-noisier='1']", timeout=60_000)
        shot.write_bytes(page.screenshot(full_page=True))
        missing = check_shot(page, int(page.inner_text("#tile-ranks").split("/")[1].split()[0].replace(",", "")))
        print(f"screenshot {shot}: " + ("shows " if not missing else "MISSING: ")
              + ", ".join(missing or ["rank 17 crashed first, the straggler named, coverage grouped"]))
    ctx.close()
    return took, sum(sizes), len(sizes), top


SERVE = "import sys; from expr_cli.main import entry; sys.argv[0] = 'expr'; sys.exit(entry())"


def visits(browser: object, root: Path, env: dict[str, str]) -> tuple[Any, Any]:
    """A fresh `expr serve` of `root` (the tree of `env`), its first and second visitor."""
    # not run from a checkout: `-c` puts the working directory first on sys.path
    srv = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--dir", str(root), "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                           cwd=os.path.dirname(root))
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip().rstrip("/") + "/runs/bench/big?metric=step_time"
        return page_load(browser, url), page_load(browser, url)
    finally:
        srv.terminate()
        srv.wait()


def refresh_cost(root: Path) -> tuple[float, float, float]:
    """Median server seconds of a no-change refresh (summary + heatmap + top), the first
    build's seconds, and `expr summary --json`'s seconds, in this process / a child."""
    from expr_cli.web.api import Api
    from expr_cli.web.live import MIN_PASS, LiveRuns
    from expr_tracker.health.config import HealthConfig

    api = Api(root, LiveRuns(HealthConfig()))
    run = ("bench", "big")

    def once() -> None:
        api.summary(*run, {"chart": ["step_time"]})
        api.heatmap(*run, {"metric": ["step_time"], "buckets": ["60"]})
        api.top(*run, {"limit": ["64"]})

    t0 = time.monotonic()
    once()
    while api.top(*run, {"limit": ["64"]}).get("reading"):  # until top's detectors ran
        time.sleep(0.05)
    first = time.monotonic() - t0
    times = []
    for _ in range(REFRESHES):
        time.sleep(MIN_PASS + 0.05)  # a new pass each time (requests closer share one)
        t0 = time.monotonic()
        once()
        times.append(time.monotonic() - t0)
    env = {**os.environ, "EXPR_DIR": str(root)}
    t0 = time.monotonic()
    subprocess.run([str(EXPR), "summary", "bench/big", "--json"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    cli = time.monotonic() - t0
    return statistics.median(times), first, cli


SERVER = """
import json, os, statistics, sys, threading, time
from pathlib import Path
from expr_cli.web.api import Api
from expr_cli.web.live import MIN_PASS, LiveRuns
from expr_tracker.health.config import HealthConfig

api = Api(Path(sys.argv[1]), LiveRuns(HealthConfig()))
run = ("bench", "big")
cpu = lambda: sum(os.times()[:4])  # this process and its reaped (forked) workers
threaded = sys.argv[3] == "threaded"
if threaded:  # as `expr serve` does at its start, in a tree that has it
    try:
        from expr_tracker.stats.parallel import use_fork_server
    except ImportError:
        pass
    else:
        use_fork_server()
        time.sleep(1.0)  # its start (a fresh interpreter) is `expr serve`'s, not the page's


def run_call(call):
    # threaded: on a thread of a process that has two, as uvicorn's thread pool runs it
    if not threaded:
        return call()
    t = threading.Thread(target=call)
    t.start()
    t.join()


out = {}
t0, c0 = time.monotonic(), cpu()
for name, call in [("summary", lambda: api.summary(*run, {"chart": ["step_time"]})),
                   ("heatmap", lambda: api.heatmap(*run, {"metric": ["step_time"], "buckets": ["60"]})),
                   ("top", lambda: api.top(*run, {"limit": ["64"]}))]:
    t, c = time.monotonic(), cpu()
    run_call(call)
    out[name] = time.monotonic() - t
out["early"] = time.monotonic() - t0  # the three answers, top's perhaps still "reading"
while api.top(*run, {"limit": ["64"]}).get("reading"):  # (a tree that has a quick first pass)
    time.sleep(0.05)
out["first"], out["first_cpu"] = time.monotonic() - t0, cpu() - c0
times = []
for _ in range(int(sys.argv[2])):
    time.sleep(MIN_PASS + 0.05)
    t = time.monotonic()
    run_call(lambda: (api.summary(*run, {"chart": ["step_time"]}),
                      api.heatmap(*run, {"metric": ["step_time"], "buckets": ["60"]}),
                      api.top(*run, {"limit": ["64"]})))
    times.append(time.monotonic() - t)
out["refresh"] = statistics.median(times)
if threaded:  # the fork server's workers count once it is stopped (and reaped) too
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        forkserver._forkserver._stop()
out["cpu_all"] = cpu() - c0  # first build and refreshes (a few ms each), workers included
# the refresh once 10 s have passed since the first build: top's detectors are run again
# (TOP_TTL: time alone brings a hang) and, with a kernel watch, the pass stats every shard
time.sleep(max(0.0, t0 + out["first"] + 10.2 - time.monotonic()))
t = time.monotonic()
run_call(lambda: (api.summary(*run, {"chart": ["step_time"]}),
                  api.heatmap(*run, {"metric": ["step_time"], "buckets": ["60"]}),
                  api.top(*run, {"limit": ["64"]})))
out["refresh10"] = time.monotonic() - t
print(json.dumps(out))
"""


def server_only(worlds: list[int], rounds: int = 2, modes: tuple[str, ...] = ("main", "threaded")
                ) -> None:
    """The server's first build and no-change refresh, before and after, interleaved; each
    on the main thread of a one-thread process (as bench/scale.py's CLI reads run) and on
    a second thread (as `expr serve` runs a request: a process with threads may not fork)."""
    import json

    before = os.environ.get("EXPR_BENCH_BEFORE")
    trees = {"after": {**os.environ}}
    if before:
        trees["before"] = {**os.environ, "PYTHONPATH": before}
    print(f"expr serve, server side, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the start; best of {rounds} rounds (first build)\n")
    print("| ranks | tree | calls on | three answers | first build (top real) | CPU (with workers) | "
          "summary (first pass in it) | heatmap | top | no-change refresh | the refresh every 10 s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for world in worlds:
        root = cached_run(world, STEPS)
        best: dict[tuple[str, str], dict[str, float]] = {}
        for _ in range(rounds):
            for mode in modes:
                for tree, env in trees.items():
                    # not run from a checkout: `-c` puts the working directory first on
                    # sys.path, ahead of PYTHONPATH, and "before" would import this tree
                    res = subprocess.run([sys.executable, "-c", SERVER, str(root), str(REFRESHES),
                                          mode], env=env, capture_output=True, text=True,
                                         check=True, cwd=os.path.dirname(root))
                    got = json.loads(res.stdout)
                    if (tree, mode) not in best or got["first"] < best[tree, mode]["first"]:
                        best[tree, mode] = got
        for (tree, mode), got in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            on = "a request thread" if mode == "threaded" else "the main thread"
            print(f"| {world:,} | {tree} | {on} | {got['early']:.1f} s | {got['first']:.1f} s | "
                  f"{got['cpu_all']:.1f} s | "
                  f"{got['summary']:.1f} s | {got['heatmap']:.1f} s | {got['top']:.1f} s | "
                  f"{got['refresh']:.3f} s | {got['refresh10']:.2f} s |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


def check_shot(page: Any, world: int) -> list[str]:
    """What the 16,384-rank screenshot must show (issue 44), as text the page drew: the
    crashed rank 17 first in the heatmap and the ranks, the straggler named, the coverage
    run, the crash counted apart. The failures, none when it shows all."""
    slow = world // 2 + 1
    rows = page.evaluate("() => document.querySelector('#heatmap').__rows.map((r) => r.label)")
    first = page.locator("#rank-table tbody tr").first.inner_text()
    want = {
        "heatmap: rank 17 first": rows[0].startswith("r17 "),
        f"heatmap: rank {slow} named": any(r.startswith(f"r{slow} ") for r in rows),
        "heatmap: at most 20 rows": len(rows) <= 20,
        "ranks: rank 17 failed first": first.startswith("rank 17 failed first"),
        "tile: 1 crashed, none behind": "1 crashed" in page.inner_text("#tile-ranks")
        and "behind" not in page.inner_text("#tile-ranks"),
        "coverage: missing rank 17": "missing rank 17 (crashed)" in page.inner_text("#coverage"),
        "header: crashed": page.inner_text("#run-status") == "crashed",
    }
    return [k for k, ok in want.items() if not ok]


def tiles(world: int, rounds: int, shot: Path | None) -> None:
    """Time to first tiles of a fresh `expr serve` (issue 44: 8.6 s before), best and
    median of `rounds` (the first round warms the page cache and is left out), this tree
    and EXPR_BENCH_BEFORE's; with `shot`, the last round's page (checked) saved there."""
    from playwright.sync_api import sync_playwright

    root = cached_run(world, STEPS)
    trees = {"after": {**os.environ}}
    if os.environ.get("EXPR_BENCH_BEFORE"):
        trees["before"] = {**os.environ, "PYTHONPATH": os.environ["EXPR_BENCH_BEFORE"]}
    got: dict[str, list[tuple[float, float, float, float]]] = {t: [] for t in trees}
    print(f"expr serve, time to first tiles at {world:,} ranks ({STEPS} steps), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; a fresh server each "
          f"round, {rounds} rounds after one to warm the page cache\n")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for i in range(rounds + 1):
            for tree, env in trees.items():
                last = i == rounds and tree == "after"
                srv = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--dir", str(root),
                                        "--port", "0"], stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True, env=env,
                                       cwd=os.path.dirname(root))
                try:
                    assert srv.stdout is not None
                    url = srv.stdout.readline().strip().rstrip("/") + "/runs/bench/big?metric=step_time"
                    every, _, _, top = page_load(browser, url, shot if last else None)
                finally:
                    srv.terminate()
                    srv.wait()
                if i:
                    got[tree].append((TIMES["reading"], TIMES["tiles"], every, top))
        browser.close()
    print("| tree | reading notice | first tiles (best) | first tiles (median) | every panel | top's panel |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for tree, rs in got.items():
        best = min(rs, key=lambda r: r[1])
        print(f"| {tree} | {best[0]:.1f} s | {best[1]:.1f} s | "
              f"{statistics.median(r[1] for r in rs):.1f} s | {best[2]:.1f} s | {best[3]:.1f} s |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


def main() -> None:
    if "--tiles" in sys.argv or "--shot" in sys.argv:
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        shot = None
        if "--shot" in sys.argv:
            shot = Path(sys.argv[sys.argv.index("--shot") + 1])
            args = [a for a in args if a != str(shot)]
        tiles(int(args[0]) if args else 16384, int(args[1]) if len(args) > 1 else 2, shot)
        return
    if "--server-only" in sys.argv:
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        server_only([int(w) for w in (args[0] if args else "4096,16384").split(",")])
        return
    from playwright.sync_api import sync_playwright

    worlds = [int(w) for w in (sys.argv[1] if len(sys.argv) > 1 else "4096,16384").split(",")]
    rounds = 2
    before = os.environ.get("EXPR_BENCH_BEFORE")
    trees = {"after": {**os.environ}}
    if before:
        trees["before"] = {**os.environ, "PYTHONPATH": before}
    load = os.getloadavg()[0]
    print(f"expr serve, synthetic runs of {STEPS} steps, {os.cpu_count()} cores, "
          f"load average {load:.1f} at the start; best of {rounds} rounds, trees interleaved\n")
    print("| ranks | tree | first render, fresh server | top's panel | bytes (requests) | "
          "second visitor | no-change refresh (server) | first build (server) | "
          "`expr summary --json` | refresh vs CLI |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for world in worlds:
            root = cached_run(world, STEPS)
            best: dict[str, tuple[Any, Any]] = {}
            for _ in range(rounds):
                for tree, env in trees.items():
                    cold, warm = visits(browser, root, env)
                    if tree not in best or cold[0] < best[tree][0][0]:
                        best[tree] = (cold, warm)
            refresh, first, cli = refresh_cost(root)  # (this tree, in this process)
            for tree, (cold, warm) in best.items():
                server = (f"{refresh:.3f} s | {first:.1f} s | {cli:.1f} s | {cli / refresh:.0f}x"
                          if tree == "after" else "| | |")
                print(f"| {world:,} | {tree} | {cold[0]:.1f} s | {cold[3]:.1f} s | "
                      f"{cold[1] / 1e6:.2f} MB ({cold[2]}) | {warm[0]:.2f} s | {server} |", flush=True)
        browser.close()
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
