"""`expr serve`'s quick first pass in a real browser (Debian's chromium, playwright): a run
of `QUICK_MIN` ranks is drawn while top still reads the detectors' window, the page says
so (no "no open incidents" before the detectors ran), then shows the real panels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM} (.ci/run installs Debian's chromium)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (extra test)")
pytest.importorskip("starlette", reason="expr serve needs the serve extra (starlette, uvicorn)")

from expr_cli.web.live import QUICK_MIN  # noqa: E402

from .servers import Server  # noqa: E402
from .synthetic import write_run  # noqa: E402

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
CRASHED = 9


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """demo/big: QUICK_MIN synthetic ranks of 80 steps, rank CRASHED crashed half-way."""
    root = tmp_path_factory.mktemp("serve-quick") / "runs"
    write_run(root / "demo" / "big", QUICK_MIN, 80, straggler=5, crashed=CRASHED, status="finished")
    srv = Server(root)
    try:
        yield srv
    finally:
        assert srv.stop() == 130


@pytest.fixture
def page(site: Server) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        ctx = browser.new_context(viewport={"width": 1280, "height": 1200})
        pg = ctx.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tops: list[Any] = []
        pg.on("response", lambda r: tops.append(r.json()) if "/top" in r.url else None)
        pg.tops_seen = tops
        yield pg
        ctx.close()
        browser.close()
        assert not errors, errors


def test_top_says_it_is_reading_then_shows_the_ranks(site: Server, page: Any) -> None:
    page.goto(site.base + "/runs/demo/big?metric=step_time")
    page.wait_for_selector("body[data-loaded='1']")
    # the first render: tiles, chart and heatmap drawn; top's panels say they are reading
    # (for TOP_POLL_MS at least: the page asks again after that)
    assert page.get_attribute("body", "data-top") == "reading"
    assert page.inner_text("#ranks-reading").startswith("reading the last 64 steps of every rank")
    assert page.inner_text("#incidents-reading").startswith("reading the last 64 steps")
    assert page.query_selector("#open-incidents") is None  # not "no open incidents"
    assert page.query_selector("#rank-table") is None
    assert page.query_selector("#chart canvas") is not None
    assert page.query_selector("#heatmap") is not None
    # then the real panels, without a reload
    page.wait_for_selector("body[data-top='1']", timeout=60_000)
    assert page.query_selector("#ranks-reading") is None
    first = page.query_selector("#rank-table tbody tr")
    assert first is not None and first.query_selector("td").inner_text() == f"rank {CRASHED} failed first"
    assert "crashed" in page.inner_text("#open-incidents")
    answers = page.tops_seen
    assert answers[0].get("reading") is True and not answers[-1].get("reading"), answers
    assert answers[-1]["ranks"][0]["rank"] == CRASHED
