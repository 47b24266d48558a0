"""`expr serve`'s quick first pass in a real browser (Debian's chromium, playwright): a run
of `QUICK_MIN` ranks is drawn while top still reads the detectors' window, the page says
so (no "no open incidents" before the detectors ran), then shows the real panels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser import require

require()

from expr_cli.web.live import QUICK_MIN  # noqa: E402

from .servers import Server  # noqa: E402
from .synthetic import write_run  # noqa: E402

# one worker runs every Chromium test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("browser")

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
def page(page: Any) -> Any:
    """conftest's page, keeping every answer of top it receives (`page.tops_seen`)."""
    tops: list[Any] = []
    page.on("response", lambda r: tops.append(r.json()) if "/top" in r.url else None)
    page.tops_seen = tops
    return page


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
