"""The documentation site: it builds strictly, its examples run, and nothing of the old README
was lost on the way into it.

A fenced ```python or ```sh block right after a `<!-- run -->` line is runnable: the blocks
of one page run in order, in one fresh directory (with `examples/` of this checkout linked
in and the venv's `python` and `expr` first on PATH), as a user with the venv active
would type them, and each must exit 0. Every other Python and shell block must at least
parse. The README is held to the same rules.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUN_MARK = "<!-- run -->"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)


def pages() -> list[Path]:
    """Every Markdown page of the site, and the README."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[tuple[str, str, bool]]:
    """(language, code, runnable) of each fenced block of `page`, in order."""
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        found.append((m.group(1), m.group(2), before == RUN_MARK))
    return found


def test_a_run_mark_always_precedes_a_python_or_shell_block() -> None:
    """A `<!-- run -->` that marks nothing (a typo, a blank block) would run nothing."""
    for page in pages():
        text = page.read_text()
        marked = sum(1 for lang, _, run in blocks(page) if run and lang in ("python", "sh"))
        assert text.count(RUN_MARK) == marked, f"{page.name}: a {RUN_MARK} not before a python/sh block"


RUNNABLE = [p for p in pages() if any(run for _, _, run in blocks(p))]


def test_the_guides_have_runnable_examples() -> None:
    names = {p.name for p in RUNNABLE}
    assert {"README.md", "getting-started.md", "distributed.md", "cli.md"} <= names, names


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_runnable_examples_run(page: Path, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k != "EXPR_SYSTEM_METRICS"}
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), XDG_STATE_HOME=str(tmp_path / "state"),
               NO_COLOR="1", COLUMNS="100")
    for i, (lang, code, run) in enumerate(blocks(page)):
        if not run:
            continue
        if lang == "python":
            script = tmp_path / f"block{i}.py"
            script.write_text(code)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"{page.name} block {i} exited {proc.returncode}:\n{code}\n" \
                                     f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{page.name} block {i}:\n{proc.stderr[-3000:]}"


def test_every_python_and_shell_example_parses() -> None:
    for page in pages():
        for i, (lang, code, _) in enumerate(blocks(page)):
            where = f"{page.name} block {i}"
            if lang == "python":
                compile(code, where, "exec")
            elif lang == "sh":
                proc = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
                assert proc.returncode == 0, f"{where}: {proc.stderr}\n{code}"


def test_site_builds_strictly_with_the_generated_cli_reference(tmp_path: Path) -> None:
    """`make docs`: every link, anchor and nav entry resolves, and the CLI reference has
    every registered command's help."""
    from typer.main import get_command

    from expr_cli.main import build_app

    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if proc.returncode != 0 and "No module named mkdocs" in proc.stderr:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    html_text = (site / "cli-reference" / "index.html").read_text()
    reference = " ".join(html.unescape(re.sub(r"<[^>]+>", "", html_text)).split())

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield [*path, name], sub
            yield from walk(sub, [*path, name])

    for path, cmd in walk(get_command(build_app()), []):
        label = "expr " + " ".join(path)
        assert f"<code>{label}</code>" in html_text, f"no section for {label}"
        assert f"Usage: {label} " in reference, f"no help for {label}"
        first = " ".join((cmd.help or "").split("\n\n")[0].split()[:6])
        assert first in reference, f"{label}: its help ({first!r}...) is not in the reference"
    for page in ("getting-started", "distributed", "live-health", "browser", "formats", "troubleshooting"):
        assert (site / page / "index.html").is_file(), page
    # an air-gapped cluster's docs: no page loads anything from outside the site (each
    # loaded Google's fonts: issue 54)
    loads = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["']?(?:https?:)?//""", re.I)
    for page in site.rglob("*.html"):
        outside = loads.findall(page.read_text())
        assert not outside, (page, outside)


# Every heading of the README before it became the site (issue 46): each is a heading of a
# page now (or of the README), so no section was dropped on the way.
OLD_README_HEADINGS = [
    "Set-up: two commands", "Quick start", "log() and steps", "Distributed training",
    "System metrics", "API", "torchrun and DDP", "Spans (where the time of a step goes)",
    "Trainer integrations", "Alerts", "Remote backends", "Team store", "Spool mode and exprd",
    "The configuration", "Running exprd under systemd", "System service (one per node)",
    "User service", "Checking on it", "Coming from expr-tracker 0.4", "The expr command",
    "Live job health", "In the browser", "Running on a cluster", "Shell completions",
]


def _headings(text: str) -> set[str]:
    text = FENCE.sub("", text)
    return {m.group(1).replace("`", "").strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_every_section_of_the_old_readme_is_in_the_site() -> None:
    have: set[str] = set()
    for page in pages():
        have |= _headings(page.read_text())
    missing = [h for h in OLD_README_HEADINGS if h not in have]
    assert not missing, f"sections no page holds: {missing}"


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local), "the README links into the docs"
    assert "docs/serve.png" in local, "the README shows the page"
    for target in local:
        assert (ROOT / target).exists(), f"README links to {target}, which is not there"
