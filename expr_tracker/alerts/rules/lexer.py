"""Tokenizer of the alert rule language, and the caret-style RuleError every stage raises."""

from __future__ import annotations

import math
from typing import NoReturn

from expr_tracker.errors import RuleError

# Token kinds: NUM (number), DUR (duration literal, value in seconds), NAME (bare metric or
# function name), QNAME (quoted metric name), OP (operator or punctuation), END.
NUM, DUR, NAME, QNAME, OP, END = "NUM", "DUR", "NAME", "QNAME", "OP", "END"

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
KEYWORDS = {"and": "and", "or": "or", "not": "not"}
# Longest spellings first so that `<=` wins over `<` and `&&` over `&`.
_OPERATORS = (
    "<=", ">=", "==", "!=", "&&", "||",
    "<", ">", "+", "-", "*", "/", "%", "(", ")", "[", "]", ",", "!", "&", "|",
)
_ALIASES = {"&&": "and", "&": "and", "||": "or", "|": "or", "!": "not"}
_QUOTES = "\"'`"
_DIGITS = "0123456789"
NAME_EXTRA = "_.@/"


class Token:
    """One token: its kind, canonical text, 0-based offset, numeric value and source text."""

    __slots__ = ("kind", "pos", "raw", "text", "value")

    def __init__(self, kind: str, text: str, pos: int, value: float = 0.0, raw: str = "") -> None:
        self.kind = kind
        self.text = text
        self.pos = pos
        self.value = value  # NUM and DUR (in seconds)
        self.raw = raw  # as written


def fail(text: str, pos: int, message: str, label: str | None = None) -> NoReturn:
    """Raise RuleError for `message` at 0-based `pos` of `text`, with a caret line."""
    pos = max(0, min(pos, len(text)))
    shown = text.replace("\n", " ").replace("\t", " ").replace("\r", " ")
    head = f"rule {label if label is not None else text!r}: {message} at column {pos + 1}"
    raise RuleError(f"{head}\n  {shown}\n  {' ' * pos}^")


def _name_start(ch: str) -> bool:
    return ch.isalpha() or ch in "_@"


def _name_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_.@"


def _scan_name(text: str, i: int) -> int:
    """End of the bare name starting at `i`; a `/` belongs to it only when a name char follows."""
    n = len(text)
    while i < n:
        ch = text[i]
        if _name_char(ch) or (ch == "/" and i + 1 < n and _name_char(text[i + 1])):
            i += 1
        else:
            break
    return i


def _scan_number(text: str, i: int, end: int) -> tuple[Token, int]:
    start = i
    while i < end and text[i] in _DIGITS:
        i += 1
    if i < end and text[i] == ".":
        i += 1
        while i < end and text[i] in _DIGITS:
            i += 1
    if i < end and text[i] in "eE":
        j = i + 1
        if j < end and text[j] in "+-":
            j += 1
        if j < end and text[j] in _DIGITS:
            i = j
            while i < end and text[i] in _DIGITS:
                i += 1
    raw = text[start:i]
    value = float(raw)
    kind = NUM
    if i < end and text[i] in DURATION_UNITS and not (i + 1 < end and _name_char(text[i + 1])):
        value *= DURATION_UNITS[text[i]]
        kind = DUR
        i += 1
        raw = text[start:i]
    if i < end and (_name_char(text[i]) or text[i] in _QUOTES):
        j = i
        while j < end and _name_char(text[j]):
            j += 1
        fail(text, start, f"invalid number {text[start:max(j, i + 1)]!r}")
    if not math.isfinite(value):
        fail(text, start, f"number {raw!r} is too large")
    return Token(kind, raw, start, value, raw), i


def tokenize(text: str, start: int = 0, end: int | None = None) -> list[Token]:
    """Split `text[start:end]` into tokens; positions stay relative to the whole `text`."""
    end = len(text) if end is None else end
    out: list[Token] = []
    i = start
    while i < end:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in _DIGITS or (ch == "." and i + 1 < end and text[i + 1] in _DIGITS):
            tok, i = _scan_number(text, i, end)
            out.append(tok)
        elif _name_start(ch):
            j = min(_scan_name(text, i), end)
            word = text[i:j]
            kw = KEYWORDS.get(word)
            out.append(Token(OP, kw, i, raw=word) if kw else Token(NAME, word, i, raw=word))
            i = j
        elif ch in _QUOTES:
            j = text.find(ch, i + 1, end)
            if j < 0:
                fail(text, i, "unterminated quoted name")
            if j == i + 1:
                fail(text, i, "empty quoted name")
            out.append(Token(QNAME, text[i + 1 : j], i, raw=text[i : j + 1]))
            i = j + 1
        else:
            for op in _OPERATORS:
                if text.startswith(op, i, end):
                    out.append(Token(OP, _ALIASES.get(op, op), i, raw=op))
                    i += len(op)
                    break
            else:
                fail(text, i, f"unexpected {ch!r}")
    out.append(Token(END, "", end))
    return out
