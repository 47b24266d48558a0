"""`expr serve` in a real browser: Debian's chromium driven by playwright (never a browser
download), against a real `expr serve` on 127.0.0.1 and runs written by real rank
processes of examples/train.py. What a person would see: the runs list, 4/4 ranks, the
straggler named, a heatmap and a chart that are not blank, a live run's step advancing
without a reload, two runs compared, a missing run said to be missing.

`UPDATE_SCREENSHOT=1` writes the run page's screenshot to docs/serve.png (the README's).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM} (.ci/run installs Debian's chromium)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (extra test)")
pytest.importorskip("starlette", reason="expr serve needs the serve extra (starlette, uvicorn)")

from .servers import Server, kill_all, train, wait_all  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_UPDATE = bool(os.environ.get("UPDATE_SCREENSHOT"))  # read before the env is cleaned
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """demo/sft-1 (4 ranks, rank 2 a straggler, finished), demo/sft-2 (2 ranks, finished),
    demo/live-2 (2 ranks still training), served by `expr serve --port 0`."""
    root = tmp_path_factory.mktemp("serve-site") / "runs"
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


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.errors_seen = errors
    yield pg
    ctx.close()
    assert not errors, errors  # no script error, no resource the CSP or the server refused


def colours(png: bytes) -> int:
    """How many distinct colours a screenshot holds (a blank canvas has one or two)."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    found = img.getcolors(maxcolors=1 << 20)
    return len(found) if found is not None else 1 << 20


def test_the_runs_list_shows_the_four_rank_run(site: Server, page: Any) -> None:
    page.goto(site.base + "/")
    row = page.wait_for_selector("tr[data-run='demo/sft-1']")
    cells = [c.inner_text() for c in row.query_selector_all("td")]
    assert cells[1] == "demo/sft-1" and cells[2] == "finished" and cells[4] == "4", cells
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
    shot = page.screenshot(full_page=True)
    (tmp_path / "serve.png").write_bytes(shot)
    if _UPDATE:
        (ROOT / "docs" / "serve.png").write_bytes(shot)


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

