"""`expr_cli.render`'s shared helpers."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from expr_cli.render import prose


def _out(terminal: bool, width: int = 40) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=terminal, color_system=None), buf


def test_prose_keeps_a_wrapped_line_under_its_indent():
    """On a terminal a long line of an indented block wraps at words, each part indented
    as the line (a crash message under `expr summary`'s ranks line, at 80 columns); to a
    pipe it is one line."""
    words = "  4 shards: 0 live, 4 crashed; rank 1 failed first (RuntimeError: CUDA error)"
    text = Text(words, style="red")
    out, buf = _out(terminal=True)
    prose(out, text)
    lines = buf.getvalue().splitlines()
    assert len(lines) > 1
    assert all(ln.startswith("  ") and not ln.startswith("   ") for ln in lines), lines
    assert all(len(ln) <= 40 for ln in lines)
    assert " ".join(ln.strip() for ln in lines) == words.strip()
    out, buf = _out(terminal=False)
    prose(out, text)
    assert buf.getvalue() == words + "\n"


def test_prose_leaves_short_and_unindented_lines_as_rich_prints_them():
    for words in ("  short", "no indent, long enough to wrap at forty columns here"):
        out, buf = _out(terminal=True)
        prose(out, words)
        plain, pbuf = _out(terminal=True)
        plain.print(words)
        assert buf.getvalue() == pbuf.getvalue()
