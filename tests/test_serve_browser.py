"""`expr serve` in a real browser: Debian's chromium driven by playwright (never a browser
download), against a real `expr serve` on 127.0.0.1 and runs written by real rank
processes of examples/train.py. What a person would see: the runs list, 4/4 ranks, the
straggler named, a heatmap and a chart that are not blank, a live run's step advancing
without a reload, two runs compared, a missing run said to be missing.

The README's screenshot, docs/serve.png, is test_serve_browser_scale.py's.
"""

from __future__ import annotations

import io
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import require

require()

from .servers import Server, kill_all, train, wait_all  # noqa: E402
from .synthetic import PER_NODE, host_of, write_run  # noqa: E402

# one worker runs every Chromium test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("browser")

ROOT = Path(__file__).resolve().parent.parent
WIDE, WIDE_SLOW = 320, 163  # past the page's 256 rows: one row per node


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """demo/sft-1 (4 ranks, rank 2 a straggler, finished), demo/sft-2 (2 ranks, finished),
    demo/live-2 (2 ranks still training), demo/wide (WIDE synthetic ranks on WIDE/8 nodes,
    rank WIDE_SLOW a straggler), demo/mixed (4 synthetic ranks: rank 1 noisier, rank 2
    slower and 20x heavier), demo/rows (4 synthetic ranks logging step rows only), served
    by `expr serve --port 0`."""
    root = tmp_path_factory.mktemp("serve-site") / "runs"
    write_run(root / "demo" / "wide", WIDE, 30, straggler=WIDE_SLOW, status="finished")
    write_run(root / "demo" / "mixed", 4, 40, straggler=2, noisy=1, weights={2: 20.0},
              status="finished")
    write_run(root / "demo" / "rows", 4, 40, straggler=2, status="finished", rank_records=False)
    done = [*train(root, "sft-1", range(4), 4, "--steps", "60", "--slow-rank", "2", "--sleep", "0.005"),
            *train(root, "sft-2", range(2), 2, "--steps", "40", "--sleep", "0.005")]
    live = train(root, "live-2", range(2), 2, "--steps", "100000", "--sleep", "0.2")
    try:
        wait_all(done)
        srv = Server(root)
        try:
            yield srv
        finally:
            assert srv.stop() == 130
    finally:
        kill_all(live)


def colours(png: bytes) -> int:
    """How many distinct colours a screenshot holds (a blank canvas has one or two)."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    found = img.getcolors(maxcolors=1 << 20)
    return len(found) if found is not None else 1 << 20


def test_the_runs_list_shows_the_four_rank_run(site: Server, page: Any) -> None:
    page.goto(site.base + "/")
    row = page.wait_for_selector("body[data-loaded='1'] tr[data-run='demo/sft-1']")  # (not the quick list's)
    cells = [c.inner_text() for c in row.query_selector_all("td")]
    assert cells[1] == "demo/sft-1" and cells[2] == "finished" and cells[4] == "4", cells
    assert cells[3] == "not watched", cells  # no expr watch / exprd keeps its incidents
    assert page.query_selector("tr[data-run='demo/live-2']") is not None


def test_the_run_page_shows_the_ranks_the_straggler_the_heatmap_and_the_chart(
        site: Server, page: Any, tmp_path: Path) -> None:
    page.goto(site.base + "/runs/demo/sft-1")
    page.wait_for_selector("body[data-loaded='1']")
    assert page.inner_text("#tile-ranks").split("\n")[1] == "4/4"
    outliers = page.inner_text("#outliers")
    assert re.search(r"\brank 2\b", outliers), outliers
    assert "rank 0" not in outliers and "rank 1" not in outliers and "rank 3" not in outliers
    assert page.inner_text("#frontier") == "step 59"
    page.wait_for_selector("#chart canvas")
    assert colours(page.locator("#heatmap").screenshot()) >= 8
    assert colours(page.locator("#chart").screenshot()) >= 8
    assert "rank 2" in page.inner_text("#rank-table")
    page.wait_for_selector("body[data-noisier='1']")  # the last panel to arrive
    ticks = page.evaluate("document.querySelector('#chart').__plot.axes[0]._splits")
    assert len(ticks) >= 3 and all(t == int(t) for t in ticks), ticks  # whole steps
    (tmp_path / "serve.png").write_bytes(page.screenshot(full_page=True))


def test_a_run_of_step_rows_only_gets_the_reducers_of_its_metrics(site: Server, page: Any) -> None:
    """Ranks that log with et.log only: the tiles, the chart and the picker are those of
    their step rows, from the run's first summary (`expr summary --json` reduces them)."""
    page.goto(site.base + "/runs/demo/rows")
    page.wait_for_selector("body[data-loaded='1']")
    assert page.inner_text("#tile-ranks").split("\n")[1] == "4/4"
    assert page.inner_text("#frontier") == "step 39"
    assert [o.inner_text() for o in page.query_selector_all("#metric option")] == ["loss", "tokens"]
    page.wait_for_selector("#chart canvas")
    assert page.inner_text("#chart-note").startswith("loss, last 40 steps")
    assert colours(page.locator("#chart").screenshot()) >= 8


def _step(page: Any, ok: Any, within: float) -> int:
    """The header's `step N` once `ok(N)` (polled from here: the page's CSP forbids the
    string evaluation `wait_for_function` uses)."""
    import time

    deadline = time.monotonic() + within
    while True:
        m = re.fullmatch(r"step (\d+)", page.inner_text("#frontier"))
        step = int(m.group(1)) if m else None
        if ok(step):
            return step  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"the header still says {page.inner_text('#frontier')!r}"
        page.wait_for_timeout(200)


def test_a_live_run_advances_without_a_reload(site: Server, page: Any) -> None:
    page.goto(site.base + "/runs/demo/live-2")
    page.wait_for_selector("body[data-loaded='1']")
    first = _step(page, lambda s: s is not None, 5.0)
    page.evaluate("window.__same_page = true")
    later = _step(page, lambda s: s is not None and s > first, 10.0)
    assert later > first
    assert page.evaluate("window.__same_page") is True  # updated in place, not reloaded
    assert page.inner_text("#tile-ranks").split("\n")[1] == "2/2"


def test_a_quiet_runs_last_writes_keep_ageing_without_a_reload(site: Server, page: Any) -> None:
    """A run that writes nothing more (finished here; a stalled job alike) sends no change
    event, and its page still tells the time since each rank's last write (it said "0s
    ago" for ever)."""
    wait_all(train(site.root, "quiet", range(2), 2, "--steps", "5"))
    page.goto(site.base + "/runs/demo/quiet")
    page.wait_for_selector("body[data-loaded='1'] #rank-table")

    def ages() -> list[str]:
        # (each row's 7th cell: its text as the page wrote it, whatever the layout)
        assert page.locator("#missing").is_hidden(), page.inner_text("#missing")
        return page.locator("#rank-table tbody tr td:nth-child(7)").all_text_contents()

    first = ages()
    assert len(first) == 2 and all(a.endswith("s ago") for a in first), first
    page.evaluate("window.__same_page = true")
    deadline = time.monotonic() + 15
    while ages() == first and time.monotonic() < deadline:
        time.sleep(0.25)
    later = ages()
    assert later != first, f"the ages stayed at {first}"
    assert [int(a.split("s")[0]) for a in later] > [int(a.split("s")[0]) for a in first]
    assert page.evaluate("window.__same_page") is True


def test_compare_overlays_two_runs(site: Server, page: Any) -> None:
    page.goto(site.base + "/compare?run=demo/sft-1&run=demo/sft-2&metric=loss")
    page.wait_for_selector("body[data-loaded='1']")
    items = page.locator("#compare-list li").all_inner_texts()
    assert [i.split()[1] for i in items] == ["demo/sft-1", "demo/sft-2"], items
    assert "4 ranks, 60 steps" in items[0] and "2 ranks, 40 steps" in items[1]
    assert colours(page.locator("#chart").screenshot()) >= 8


def test_a_run_that_does_not_exist_says_so(site: Server, page: Any) -> None:
    page.goto(site.base + "/runs/demo/nope")
    page.wait_for_selector("#missing:not([hidden])")
    assert "no run demo/nope" in page.inner_text("#missing")
    assert page.locator("#content").is_hidden()
    # the API's 404 is what the page reports; the browser logs it as a failed load
    page.errors_seen[:] = [e for e in page.errors_seen if "status of 404" not in e]



def _rows(page: Any, canvas: str) -> list[str]:
    """The labels of a heatmap canvas's rows (what it drew, kept on the element)."""
    return page.evaluate(f"document.querySelector({canvas!r}).__rows.map((r) => r.label)")  # type: ignore[no-any-return]


def test_past_256_ranks_the_heatmap_shows_nodes_and_a_click_drills_into_one(
        site: Server, page: Any) -> None:
    """The CLI's rows (issue 44: test_serve_browser_scale.py has the rest): the straggler's
    node among the worst nodes; a click on it, its 8 ranks, the straggler the brightest."""
    page.goto(site.base + "/runs/demo/wide?metric=step_time")
    page.wait_for_selector("body[data-loaded='1']")
    assert page.inner_text("#heatmap-note").startswith("step_time (max), ")
    labels = _rows(page, "#heatmap")
    assert labels[0] == f"r{WIDE_SLOW} {host_of(WIDE_SLOW)}" and host_of(WIDE_SLOW) in labels
    assert page.locator("#drill").is_hidden()
    assert colours(page.locator("#heatmap").screenshot()) >= 4
    # a click on the straggler's node row: that node's 8 ranks, one row each, named
    at = labels.index(host_of(WIDE_SLOW))
    box = page.locator("#heatmap").bounding_box()
    rh = 16
    page.mouse.click(box["x"] + 400, box["y"] + at * rh + rh / 2)
    page.wait_for_selector("#drill:not([hidden])")
    page.wait_for_selector(f"body[data-drill='{host_of(WIDE_SLOW)}']")
    assert page.inner_text("#drill-title") == f"node {host_of(WIDE_SLOW)}: {PER_NODE} ranks"
    first = WIDE_SLOW // PER_NODE * PER_NODE
    assert _rows(page, "#drill-canvas") == [f"r{r}" for r in range(first, first + PER_NODE)]
    assert colours(page.locator("#drill-canvas").screenshot()) >= 2
    # the straggler's row is the brightest (viridis: its step time is the highest)
    row = page.evaluate("""() => {
      const c = document.querySelector('#drill-canvas'), ctx = c.getContext('2d');
      const dpr = window.devicePixelRatio || 1, rh = 16;
      return c.__rows.map((_, i) => {
        const d = ctx.getImageData(c.width - 20 * dpr, (i * rh + rh / 2) * dpr, 1, 1).data;
        return d[0] + d[1] + d[2];
      });
    }""")
    assert row.index(max(row)) == WIDE_SLOW - first, row
    page.click("#drill-close")
    page.wait_for_selector("#drill", state="hidden")
    assert _rows(page, "#heatmap")[0] == f"r{WIDE_SLOW} {host_of(WIDE_SLOW)}"


def test_the_weighted_mean_flag_and_the_noisier_ranks_are_the_clis(site: Server, page: Any) -> None:
    import json
    import subprocess

    from .servers import EXPR

    page.goto(site.base + "/runs/demo/mixed?metric=step_time")
    page.wait_for_selector("body[data-noisier='1']")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}

    def cli(*args: str) -> Any:
        out = subprocess.run([str(EXPR), "summary", "demo/mixed", "-m", "step_time", "--json",
                              "--dir", str(site.root), *args], env=env, capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)["keys"][0]

    at = cli()
    assert at["weighted"]["differs"] is True
    means = page.locator("#tile-means")
    assert "differs: more than 2 x std/sqrt(n)" in means.inner_text()
    assert "warn" in (means.get_attribute("class") or "")
    # the window is the chart's: every step of this 40-step run
    window = cli("--steps", "0:40")["variability"]
    assert [o["rank"] for o in window["noisier"]] == [1]
    noisier = page.inner_text("#noisier-list")
    assert noisier == "rank 1 gpu-0000 noisier: CV 0.4 vs 0.0028 median", noisier
    assert page.inner_text("#noisier h3") == "Noisier step_time, steps 0:40"
    cells = {tr.query_selector("td").inner_text(): tr.query_selector("td.noisier").inner_text()
             for tr in page.query_selector_all("#rank-table tbody tr")}
    assert cells == {"rank 0": "", "rank 1": "CV 0.4 vs 0.0028 median", "rank 2": "", "rank 3": ""}


def test_equal_weights_are_within_the_spread_and_no_rank_is_noisier(site: Server, page: Any) -> None:
    page.goto(site.base + "/runs/demo/sft-1?metric=step_time")
    page.wait_for_selector("body[data-noisier='1']")
    assert "within the spread" in page.inner_text("#tile-means")
    assert page.inner_text("#noisier-none").startswith("no rank noisier (step_time, steps ")
    assert page.query_selector("#rank-table td.noisier") is None  # no column for no one


def test_a_page_opened_before_its_run_exists_shows_it_once_it_does(site: Server, page: Any) -> None:
    page.goto(site.base + "/runs/demo/later")
    page.wait_for_selector("#missing:not([hidden])")
    assert "no run demo/later" in page.inner_text("#missing")
    assert page.inner_text("#live") == "checking again every 2 s"
    page.evaluate("window.__same_page = true")
    write_run(site.root / "demo" / "later", 4, 10, straggler=2)  # the job starts
    page.wait_for_selector("body[data-loaded='1']", timeout=15_000)
    assert page.locator("#missing").is_hidden()
    assert page.inner_text("#tile-ranks").split("\n")[1] == "4/4"
    assert re.search(r"\brank 2\b", page.inner_text("#outliers"))
    assert page.evaluate("window.__same_page") is True
    page.errors_seen[:] = [e for e in page.errors_seen if "status of 404" not in e]


def test_a_live_run_whose_ranks_stopped_stepping_says_no_step_for_in_the_header(
        site: Server, page: Any) -> None:
    """Issue 48: a running job whose ranks took no step for half a minute while their
    sidecars are still written (the SDK's probes) says so in the header, before any
    incident opens, as `expr top` does: "no step for 33s"."""
    run = write_run(site.root / "demo" / "stuck", 4, 20)  # (status running, sidecars fresh)
    then = time.time() - 33
    for shard in run.glob("*.jsonl"):
        os.utime(shard, (then, then))  # the last rows written 33 s ago
    page.goto(site.base + "/runs/demo/stuck")
    page.wait_for_selector("body[data-loaded='1'] #rank-table")
    badge = page.wait_for_selector("#no-step-badge")
    assert re.fullmatch(r"no step for (3[3-9]|[4-5]\d)s", badge.inner_text()), badge.inner_text()
    assert page.inner_text("#run-status") == "running"
    assert "no step for" in (badge.get_attribute("title") or "")  # top's job line
    # a run that steps shows none
    page.goto(site.base + "/runs/demo/live-2")
    page.wait_for_selector("body[data-loaded='1'] #rank-table")
    assert page.query_selector("#no-step-badge") is None
