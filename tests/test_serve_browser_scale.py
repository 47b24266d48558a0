"""The Distributed tab past a screenful of ranks and after the fact (issue 44), in a real
browser (Debian's chromium driven by playwright) against a real `expr serve`:

- the heatmap built as the CLI's (the crashed rank, the outlier rank, the worst nodes,
  bins), every row labelled and 16 px tall, one colour scale in its drill-downs, a
  crashed rank hatched (no colour of the scale);
- the step window in the URL (whole run, brushed on the chart), every panel following it;
  the picker's step-row keys first and `?metric=loss` honoured;
- the state: crashed, not behind nor stepping, its root first; coverage runs grouped; a
  stall and ranks that never wrote a shard in the header and on the chart;
- a finished run's stall found after the fact in its ranks' `_time`;
- what the first visit is reading, and the runs list at once;
- the range tile, the delta from the mean; compare's log scale and smoothing.

`UPDATE_SCREENSHOT=1` writes the 4-rank page's screenshot to docs/serve.png (the 16,384-rank
one is bench/serve.py's: `python bench/serve.py 16384 --shot docs/serve-16k.png`).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import require

require()

from .servers import Server  # noqa: E402
from .synthetic import write_run  # noqa: E402

# one worker runs every Chromium test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("browser")

ROOT = Path(__file__).resolve().parent.parent
_UPDATE = bool(os.environ.get("UPDATE_SCREENSHOT"))  # read before the env is cleaned
WIDE, SLOW, DEAD = 320, 163, 17  # past the page's 256 ranks: nodes; the straggler; the crash
ROW_H = 16


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """demo/four: 4 ranks, rank 2 a straggler, rank 3 crashed at step 29, every rank paused
    40 s before step 20, finished, no watcher; demo/wide: WIDE ranks, rank SLOW a
    straggler, rank DEAD crashed; demo/gone: 16 ranks of which 12-15 never wrote a shard."""
    root = tmp_path_factory.mktemp("serve-scale") / "runs"
    write_run(root / "demo" / "four", 4, 60, straggler=2, crashed=3, stall=(20, 40.0),
              status="finished")
    write_run(root / "demo" / "wide", WIDE, 20, straggler=SLOW, crashed=DEAD, status="finished")
    gone = write_run(root / "demo" / "gone", 16, 20, status="running")
    for r in range(12, 16):
        for suffix in (".jsonl", ".meta.json"):
            (gone / f"metrics.rank{r}{suffix}").unlink()
    srv = Server(root)
    try:
        yield srv
    finally:
        assert srv.stop() == 130


def _open(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-loaded='1']", timeout=60_000)
    page.wait_for_selector("body[data-top='1']", timeout=60_000)


def _rows(page: Any, sel: str = "#heatmap") -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = page.evaluate(
        "(sel) => document.querySelector(sel).__rows.map((r) => ({label: r.label, kind: r.kind, "
        "ranks: r.ranks, bad: r.bad}))", sel)
    return got


def _pixels(png: bytes) -> set[tuple[int, int, int]]:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    return {c for _, c in img.getcolors(maxcolors=1 << 20) or []}


def test_past_a_screenful_the_heatmap_is_the_clis_rows_labelled_with_one_scale(
        site: Server, page: Any) -> None:
    _open(page, site.base + "/runs/demo/wide?metric=step_time")
    rows = _rows(page)
    # the crashed rank first (a row of its own, marked), then the CLI's rows: the outlier
    # rank named, the worst nodes (the crashed rank's among them), then bins of the rest
    assert rows[0] == {"label": f"r{DEAD} gpu-0002", "kind": "rank", "ranks": str(DEAD), "bad": "crashed"}
    assert rows[1]["label"] == f"r{SLOW} gpu-0020" and rows[1]["kind"] == "rank"
    kinds = [r["kind"] for r in rows]
    assert "node" in kinds and kinds[-1] == "bin" and len(rows) <= 20, rows
    assert next(r for r in rows if r["label"] == "gpu-0002")["bad"] == "crashed"
    listed = page.locator("#heatmap-rows li").all_text_contents()  # (in a closed <details>)
    assert listed[0].startswith(f"r{DEAD} gpu-0002") and "crashed, failed first" in listed[0]
    box = page.locator("#heatmap").bounding_box()
    assert box["height"] >= len(rows) * ROW_H  # every row 16 px: labelled, clickable
    # the crashed rank's cells after its crash: the red hatch, no colour of the scale
    shot = page.locator("#heatmap").screenshot()
    assert (197, 48, 48) in _pixels(shot) and (255, 245, 245) in _pixels(shot)
    scale = page.evaluate("document.querySelector('#heatmap').__scale")
    # a bin drills into its nodes, a node into its ranks: in the page's colours
    bin_at = kinds.index("bin")
    page.locator("#heatmap").click(position={"x": 400, "y": bin_at * ROW_H + ROW_H / 2})
    page.wait_for_selector("body[data-drill]")
    nodes = _rows(page, "#drill-canvas")
    assert nodes and all(r["kind"] == "node" for r in nodes)
    page.locator("#drill-canvas").click(position={"x": 400, "y": ROW_H / 2})
    page.wait_for_selector(f"body[data-drill='{nodes[0]['label']}']")
    ranks = _rows(page, "#drill-canvas")
    assert len(ranks) == 8 and all(r["kind"] == "rank" for r in ranks)
    assert page.evaluate("document.querySelector('#drill-canvas').__scale") == scale


def test_the_window_is_in_the_url_and_every_panel_follows_it(site: Server, page: Any) -> None:
    _open(page, site.base + "/runs/demo/four?metric=loss&steps=all")
    assert page.input_value("#window") == "all"
    steps = page.evaluate("document.querySelector('#chart').__plot.data[0]")
    assert steps == list(range(60))
    assert page.inner_text("#chart-note").startswith("loss, the whole run (60 steps)")
    assert "mean over steps 0-59" in page.inner_text("#tile-ranks")
    buckets = page.evaluate("document.querySelector('#heatmap').__rows.length")
    assert buckets == 4
    # a drag across the chart picks steps: the URL keeps them, the panels follow
    over = page.locator("#chart .u-over").bounding_box()
    page.mouse.move(over["x"] + over["width"] * 0.30, over["y"] + 40)
    page.mouse.down()
    page.mouse.move(over["x"] + over["width"] * 0.60, over["y"] + 40, steps=5)
    page.mouse.up()
    for _ in range(50):
        if "steps=" in page.url and "steps=all" not in page.url:
            break
        page.wait_for_timeout(100)
    m = re.search(r"steps=(\d+)%3A(\d+)|steps=(\d+):(\d+)", page.url)
    assert m, page.url
    lo, hi = (int(x) for x in [g for g in m.groups() if g is not None])
    assert 10 <= lo < hi <= 45, (lo, hi)
    page.wait_for_selector("body[data-loaded='1']")
    for _ in range(50):
        drawn = page.evaluate("document.querySelector('#chart').__plot.data[0]")
        if drawn == list(range(lo, hi)):
            break
        page.wait_for_timeout(100)
    assert drawn == list(range(lo, hi))
    assert f"mean over steps {lo}-{hi - 1}" in page.inner_text("#tile-ranks")
    assert page.inner_text("#window option:checked") == f"steps {lo}-{hi - 1}"
    # and the URL opens it again
    _open(page, page.url)
    assert page.evaluate("document.querySelector('#chart').__plot.data[0]") == list(range(lo, hi))


def test_the_picker_lists_step_rows_first_and_honours_the_metric(site: Server, page: Any) -> None:
    _open(page, site.base + "/runs/demo/four?metric=loss")
    groups = page.locator("#metric optgroup").evaluate_all("(gs) => gs.map((g) => g.label)")
    assert groups == ["step rows", "rank records"]
    options = page.locator("#metric option").all_inner_texts()
    assert options[:2] == ["loss", "tokens"] and set(options[2:]) == {"step_time", "grad_norm"}
    assert page.input_value("#metric") == "loss"
    assert page.inner_text("#chart-note").startswith("loss,")
    assert page.inner_text("#heatmap-note").startswith("loss ")


def test_the_page_tells_the_state_crash_root_first_and_coverage_grouped(
        site: Server, page: Any, tmp_path: Path) -> None:
    _open(page, site.base + "/runs/demo/four?metric=step_time")
    assert page.inner_text("#run-status") == "crashed"
    tile = page.inner_text("#tile-ranks")
    assert "3/4" in tile and "1 crashed" in tile and "behind" not in tile
    first = page.locator("#rank-table tbody tr").first.inner_text().split("\t")
    assert first[0] == "rank 3 failed first" and first[4] == first[5] == "\u2013", first
    runs = page.locator("#coverage-runs li").all_inner_texts()
    assert runs == ["steps 30-59: missing rank 3 (crashed) · 3/4 reported"], runs
    # the stall no watcher saw, found in the ranks' `_time`: the header, the chart, the panel
    assert page.inner_text("#found-badge") == "stalled 41s before step 20, found after the fact"
    found = page.inner_text("#found-list")
    assert "every rank paused 41s between steps 19 and 20" in found and "found after the fact" in found
    marks = page.evaluate("document.querySelector('#chart').__plot.__marks.map((m) => [m.step, m.label])")
    assert [20, "stalled 41s (found after the fact)"] in marks and [29, "rank 3 crashed"] in marks
    assert page.get_attribute("#heatmap", "data-marks") == str(len(marks))  # and on the heatmap
    # the seed's tab in full: the range tile, the delta from the mean
    assert page.inner_text("#tile-range").split("\n")[1] == "0.3038"
    assert re.search(r"rank 2 .* \+0\.20\d from the mean", page.inner_text("#outlier-list"))
    page.wait_for_selector("body[data-noisier='1']")
    shot = page.screenshot(full_page=True)
    (tmp_path / "serve.png").write_bytes(shot)
    if _UPDATE:
        (ROOT / "docs" / "serve.png").write_bytes(shot)


def test_ranks_that_never_wrote_show_as_lost_in_the_header_and_the_heatmap(
        site: Server, page: Any) -> None:
    _open(page, site.base + "/runs/demo/gone")
    assert page.inner_text("#lost-missing") == "lost: ranks 12-15 never wrote a shard"
    # the detectors find the old synthetic ranks silent: stalled, in the header and on the chart
    assert page.inner_text("#run-status") == "stalled"
    marks = page.evaluate("document.querySelector('#chart').__plot.__marks.map((m) => m.label)")
    assert "stalled at step 19" in marks
    assert [r["ranks"] for r in _rows(page) if r["bad"] == "no shard"] == ["12", "13", "14", "15"]


def test_a_first_visit_says_what_it_reads_and_lists_the_runs_at_once(site: Server, page: Any) -> None:
    held: list[Any] = []
    page.route(re.compile(r".*/api/runs/demo/wide/summary.*"), lambda route: held.append(route))
    page.goto(site.base + "/runs/demo/wide")
    for _ in range(100):
        if "of 320 shards read" in page.inner_text("#loading"):
            break
        page.wait_for_timeout(100)
    text = page.inner_text("#loading")
    assert re.fullmatch(r"reading demo/wide: \d+ of 320 shards read(; reducing| \(and their sidecars\))?, "
                        r"the last 50 steps \.\.\. [\d.]+ s", text), text
    for route in held:
        route.continue_()
    page.unroute(re.compile(r".*/api/runs/demo/wide/summary.*"))
    page.wait_for_selector("body[data-loaded='1']", timeout=60_000)
    assert not page.is_visible("#loading")
    # the runs list: the run directories at once, before every sidecar is read
    slow: list[Any] = []
    page.route(re.compile(r".*/api/runs$"), lambda route: slow.append(route))
    page.goto(site.base + "/")
    row = page.wait_for_selector("tr.quick[data-run='demo/wide']")
    assert [c.inner_text() for c in row.query_selector_all("td")][2:5] == ["reading...", "", "320"]
    for route in slow:
        route.continue_()
    page.unroute(re.compile(r".*/api/runs$"))
    page.wait_for_selector("body[data-loaded='1'] tr[data-run='demo/wide']:not(.quick)")


def test_compare_has_a_log_scale_and_smoothing_kept_in_the_url(site: Server, page: Any) -> None:
    page.goto(site.base + "/compare?run=demo/four&run=demo/wide&metric=loss&log=1&smooth=5")
    page.wait_for_selector("body[data-loaded='1']")
    assert page.is_checked("#compare-log") and page.input_value("#compare-smooth") == "5"
    plot = "document.querySelector('#chart').__plot"
    assert page.evaluate(f"{plot}.scales.y.distr") == 3
    # step 2's loss (0.97) as the mean of steps 0-2 (2.3, 1.3, 0.97)
    assert page.evaluate(f"{plot}.data[1][2]") == pytest.approx((2.3 + 1.3 + 2 / 3 + 0.3) / 3, abs=0.01)
    page.uncheck("#compare-log")
    page.select_option("#compare-smooth", "1")
    assert page.evaluate(f"{plot}.scales.y.distr") == 1
    assert "log=" not in page.url and "smooth=" not in page.url
    assert page.evaluate(f"{plot}.data[1][2]") == pytest.approx(2 / 3 + 0.3, abs=0.01)  # raw again



def test_a_lost_node_shows_in_the_header_and_on_the_chart(tmp_path: Path, page: Any) -> None:
    """Issue 48 item 4 on the page: a lost node that exprd recorded (a line of
    incidents.jsonl, as the cluster harness's node-kill case writes it) is in the header
    and marked on the chart at the step its ranks stopped."""
    import json
    import time

    root = tmp_path / "runs"
    run = write_run(root / "demo" / "node", 4, 20, status="running")
    lost = {"id": "l1", "kind": "lost", "state": "open", "delivered": True, "ranks": [2, 3],
            "level": "error", "hosts": ["node1"], "step": 19, "first_seen": time.time(),
            "last_seen": time.time(), "by": "node0:4242:1",
            "detail": "node1 lost: ranks 2-3 and exprd silent 61s; ranks 0-1 wait in all_reduce"}
    (run / "incidents.jsonl").write_text(json.dumps(lost) + "\n")
    srv = Server(root)
    try:
        _open(page, srv.base + "/runs/demo/node")
        assert page.inner_text("#lost-node-node1") == "lost: node1 (ranks 2-3)"
        marks = page.evaluate("document.querySelector('#chart').__plot.__marks.map((m) => [m.step, m.label])")
        assert [19, "lost: node1, ranks 2-3"] in marks, marks
    finally:
        page.goto("about:blank")  # (its event stream closed before the server stops)
        assert srv.stop() == 130
