"""Control and bidi characters escaped in everything the CLI prints (issue 54).

Host names, run names, metric keys, alert texts and exception messages are data written by
others: a newline in one forges a line of `expr watch`, an ESC a terminal sequence, a
U+202E reverses what follows it on screen. Each such character is printed as its escape
(`\\n`, `\\x1b`, `\\u202e`), by the console every renderer gets (`render.console`): in
what it prints and in the strings it lays out (table cells), before they are measured.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

# C0 and C1 controls, DEL, and the characters that reorder or hide text (bidi embeddings,
# overrides and isolates, marks, zero-width joiners): what a terminal acts on or shows
# otherwise than as written. (Tabs too: a cell's width is measured without them.)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape(text: str) -> str:
    """`text` with its control and bidi characters written as escapes."""
    if text.isascii() and text.isprintable():  # (the usual case, in C)
        return text
    return _UNSAFE.sub(lambda m: _escape(m.group()), text)


def escape_text(text: Any) -> Any:
    """A rich `Text` with its unsafe characters escaped, each escape in the styles of the
    character it replaces."""
    plain = text.plain
    if escape(plain) == plain:
        return text
    found = {m.start() for m in _UNSAFE.finditer(plain)}
    cuts = sorted({i for at in found for i in (at, at + 1)})
    out = text.blank_copy()
    for piece, start in zip(text.divide(cuts), [0, *cuts], strict=True):
        if start in found:
            esc = piece.blank_copy(_escape(plain[start]))
            for span in piece.spans:
                esc.stylize(span.style, 0, len(esc))
            piece = esc
        out.append_text(piece)
    return out


@cache
def safe_console_class() -> type:
    """rich's Console, escaping what it prints and the strings it lays out."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def _escaped(cell: Any) -> Any:
        return escape(cell) if isinstance(cell, str) else (
            escape_text(cell) if isinstance(cell, Text) else cell)

    class SafeConsole(Console):
        def render_str(self, text: str, **kw: Any) -> Text:
            return super().render_str(escape(text), **kw)

        def render(self, renderable: Any, options: Any = None) -> Any:
            if isinstance(renderable, Text):
                renderable = escape_text(renderable)
            elif isinstance(renderable, Table):
                # its cells escaped before the table measures them (rich keeps them in
                # `Column._cells`, which it has no setter for)
                for column in renderable.columns:
                    column._cells = [_escaped(c) for c in column._cells]
            return super().render(renderable, options)

        def print(self, *objects: Any, **kw: Any) -> None:
            objects = tuple(_escaped(o) for o in objects)
            super().print(*objects, **kw)

    return SafeConsole
