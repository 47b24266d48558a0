"""`expr serve` against `trackio show` on the same 4-rank run (issue 19's comparison).

    python bench/serve_peer.py [STEPS] [ROUNDS]        e.g. python bench/serve_peer.py 200 3

One synthetic 4-rank run (tests/synthetic.py: rank 2 a 1.6x straggler, finished), opened
side by side in one run in headless Debian chromium (playwright, no browser download):

- `expr serve --port 0` over its run root, the run page `/runs/bench/peer4`;
- `trackio show --project bench` over a trackio project holding the same rows: one trackio
  run per rank, named as this project's trackio backend names them (`peer4`,
  `peer4-rank1`, ...; group `peer4`), written with `trackio.init` + `run.log(row, step=)`
  per rank-run. trackio's own `import_csv` refuses a project that already exists, so it
  can import one rank of a run, not four into one project.

Per page: seconds from navigation to the first chart drawn (a chart canvas that holds at
least `COLOURS` distinct colours: uPlot's `#chart canvas` here, vega's `canvas.marks`
there), bytes transferred to that point (bodies and headers of finished requests), and,
`SETTLE` seconds later (the rest of the page loaded), the bytes the open page fetches in
`IDLE` seconds with nothing new in the run
(expr's event stream is one long response, not counted; it sends nothing but a comment
every 15 s). Each round starts both servers afresh and sends each a first visitor (a
server that has read nothing yet) and a second one; who goes first alternates.

Network: the browser aborts (and counts) every request not to 127.0.0.1; both servers
get GRADIO_ANALYTICS_ENABLED=False, HF_HUB_OFFLINE=1, HF_HUB_DISABLE_TELEMETRY=1,
DO_NOT_TRACK=1, a private HF_HOME and TRACKIO_DIR, BROWSER=/bin/true (trackio opens a
browser tab otherwise), GRADIO_SERVER_PORT (how `trackio show` picks its port). Every
process started here is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.synthetic import write_run  # noqa: E402

EXPR = Path(sys.executable).parent / "expr"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PROJECT, NAME, WORLD = "bench", "peer4", 4
COLOURS = 8
SETTLE = 3.0
STOP_WAIT = 30.0
IDLE = 10.0
QUIET_ENV = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
             "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "BROWSER": "/bin/true",
             "TRANSFORMERS_OFFLINE": "1"}
# distinct colours of the first canvas matching the selector (every 4th pixel, stops at 64)
DRAWN = """(sel) => {
  const c = document.querySelector(sel);
  if (!c || !c.width || !c.height) return 0;
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length && seen.size < 64; i += 16) seen.add(`${d[i]},${d[i+1]},${d[i+2]},${d[i+3]}`);
  return seen.size;
}"""


def trackio_import(tdir: str, run_dir: str) -> None:
    """In a child process (trackio reads TRACKIO_DIR at import): every rank's step rows
    and rank records of `run_dir`, merged per step, logged to one trackio run per rank."""
    os.environ["TRACKIO_DIR"] = tdir
    import contextvars

    import trackio

    for r in range(WORLD):
        stem = "metrics" if r == 0 else f"metrics.rank{r}"
        rows: dict[int, dict[str, float]] = {}
        with open(Path(run_dir) / f"{stem}.jsonl", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                row = rows.setdefault(rec["_step"], {})
                row.update({k: v for k, v in rec.items() if not k.startswith("_")})
        name = NAME if r == 0 else f"{NAME}-rank{r}"
        run = contextvars.Context().run(trackio.init, project=PROJECT, name=name, group=NAME,
                                        embed=False, auto_log_gpu=False, auto_log_cpu=False)
        for step in sorted(rows):
            run.log(rows[step], step=step)
        run.finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], env: dict[str, str], pattern: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server, its output into the file `log` (a pipe nobody reads would fill up
    and block it); its process and the first URL matching `pattern` it prints."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(pattern, re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")),
                      re.MULTILINE)
        if m:
            return proc, m.group(1)
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} printed no URL: {log.read_text(errors='replace')[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C by pid, then SIGKILL if it lingers; its exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=STOP_WAIT)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


def visit(browser: Any, url: str, canvas: str, blocked: list[str]) -> dict[str, float]:
    """One fresh visitor: seconds to the first chart drawn, bytes and requests to then,
    bytes and requests in the IDLE seconds after."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})

    def only_local(route: Any) -> None:
        if route.request.url.startswith("http://127.0.0.1:"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    ctx.route("**/*", only_local)
    page = ctx.new_page()
    sizes: list[int] = []

    def done(req: Any) -> None:
        s = req.sizes()
        sizes.append(s["responseBodySize"] + s["responseHeadersSize"])

    page.on("requestfinished", done)
    t0 = time.monotonic()
    page.goto(url, wait_until="commit")
    while page.evaluate(DRAWN, canvas) < COLOURS:
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"no chart drawn at {url} in 300 s")
        page.wait_for_timeout(20)
    took = time.monotonic() - t0
    at_chart, n_chart = sum(sizes), len(sizes)
    page.wait_for_timeout(SETTLE * 1000)  # the rest of the page (other panels) loads
    settled, n_settled = sum(sizes), len(sizes)
    page.wait_for_timeout(IDLE * 1000)
    idle, n_idle = sum(sizes) - settled, len(sizes) - n_settled
    ctx.close()
    return {"s": took, "bytes": at_chart, "requests": n_chart, "idle_bytes": idle,
            "idle_requests": n_idle}


def servers(root: Path, env: dict[str, str], tmp: Path, n: int) -> dict[str, Any]:
    """Round `n`'s fresh `expr serve` and `trackio show`: label -> (process, URL, canvas)."""
    from importlib.metadata import version

    e, eu = start([str(EXPR), "serve", "--dir", str(root), "--port", "0"], env,
                  r"^(http://\S+)", tmp / f"expr{n}.log")
    try:
        t, tu = start([sys.executable, "-c", "import sys; from trackio.cli import main; "
                       "sys.argv[0] = 'trackio'; main()", "show", "--project", PROJECT],
                      {**env, "GRADIO_SERVER_PORT": str(free_port())}, r"launched at: (http://\S+)",
                      tmp / f"trackio{n}.log")
    except BaseException:
        stop(e)
        raise
    return {"expr serve": (e, eu.rstrip("/") + f"/runs/{PROJECT}/{NAME}", "#chart canvas"),
            f"trackio show ({version('trackio')})": (t, tu, ".vega-embed canvas.marks")}


def main() -> None:
    from playwright.sync_api import sync_playwright

    # a bench started in the background (`cmd &`) ignores SIGINT, and so would every child:
    # trackio show would then never see the Ctrl-C; handled here, children get the default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tmp = Path(tempfile.mkdtemp(prefix="expr-serve-peer-"))
    try:
        root = tmp / "runs"
        write_run(root / PROJECT / NAME, WORLD, steps, straggler=2, status="finished")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPR_", "TRACKIO_"))}
        env.update(QUIET_ENV, HF_HOME=str(tmp / "hf"), TRACKIO_DIR=str(tmp / "trackio"))
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from bench.serve_peer import trackio_import; trackio_import(*sys.argv[2:])",
                        str(REPO), str(tmp / "trackio"), str(root / PROJECT / NAME)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        imported = time.monotonic() - t0
        load = os.getloadavg()
        print(f"expr serve vs trackio show: one synthetic run of {WORLD} ranks x {steps} steps "
              f"(rank 2 a straggler), {os.cpu_count()} cores, load average "
              f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min) at the start; "
              f"trackio import of the rows {imported:.1f} s; {rounds} rounds, each with both "
              f"servers fresh, a first and a second visitor on each (who goes first alternates)\n")
        blocked: list[str] = []
        cold: dict[str, list[dict[str, float]]] = {}
        warm: dict[str, list[dict[str, float]]] = {}
        stops: dict[str, list[str]] = {}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            try:
                for n in range(rounds):
                    pages = servers(root, env, tmp, n)
                    try:
                        order = list(pages) if n % 2 == 0 else list(pages)[::-1]
                        for label in order:
                            _, url, canvas = pages[label]
                            cold.setdefault(label, []).append(visit(browser, url, canvas, blocked))
                            warm.setdefault(label, []).append(visit(browser, url, canvas, blocked))
                    finally:
                        for label, (proc, _, _) in pages.items():
                            t0 = time.monotonic()
                            code = stop(proc)
                            stops.setdefault(label, []).append(f"{code} ({time.monotonic() - t0:.1f} s)")
            finally:
                browser.close()
        med = statistics.median
        print(f"| page | first chart, first visitor (median; min-max) | first chart, second "
              f"visitor | bytes to first chart (requests) | bytes in {IDLE:.0f} s idle, from "
              f"{SETTLE:.0f} s after it (requests) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label in cold:
            c, w = cold[label], warm[label]
            everyone = c + w
            print(f"| {label} | {med(r['s'] for r in c):.2f} s ({min(r['s'] for r in c):.2f}-"
                  f"{max(r['s'] for r in c):.2f}) | {med(r['s'] for r in w):.2f} s | "
                  f"{med(r['bytes'] for r in everyone) / 1e3:,.0f} kB "
                  f"({med(r['requests'] for r in everyone):.0f}) | "
                  f"{med(r['idle_bytes'] for r in everyone) / 1e3:,.1f} kB "
                  f"({med(r['idle_requests'] for r in everyone):.0f}) |")
        (el, ec), (tl, tc) = list(cold.items())
        print(f"\nratio {tl.split()[0]}/expr (medians): first visitor "
              f"{med(r['s'] for r in tc) / med(r['s'] for r in ec):.1f}x, second visitor "
              f"{med(r['s'] for r in warm[tl]) / med(r['s'] for r in warm[el]):.1f}x, bytes to "
              f"first chart {med(r['bytes'] for r in tc) / med(r['bytes'] for r in ec):.1f}x")
        print(f"requests refused (not 127.0.0.1): {len(blocked)}"
              + (f" ({', '.join(sorted(set(blocked))[:5])})" if blocked else ""))
        print("exit codes after Ctrl-C (-9: still running "
              f"{STOP_WAIT:.0f} s later, killed): "
              + "; ".join(f"{k} {', '.join(v)}" for k, v in stops.items()))
        load = os.getloadavg()
        print(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
