"""The page's tests in a real browser: Debian's chromium driven by playwright (never a
browser download; .ci/run installs chromium). `require()` skips a module where either is
missing; the `browser` (one per module) and `page` fixtures are conftest's, from here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def require() -> None:
    """Skip the calling test module (at its import) without chromium, playwright or the
    `serve` extra."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (.ci/run installs Debian's chromium)",
                    allow_module_level=True)
    pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (extra test)")
    pytest.importorskip("starlette", reason="expr serve needs the serve extra (starlette, uvicorn)")


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
    """A fresh 1280x1200 page; `page.errors_seen` collects its script errors and the
    console's, and the test fails with any left at its end (a script error, a resource the
    CSP or the server refused)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.errors_seen = errors
    yield pg
    ctx.close()
    assert not errors, errors
