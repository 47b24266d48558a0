"""Is this text one read-only ClickHouse statement? (`expr query --store`)

The server's `readonly=1` refuses writes and `SET`, but not everything that changes the
server: `KILL QUERY` cancels other clients' queries (exprd's inserts among them) and
`SYSTEM ...` reloads or drops caches. So the CLI sends only text that is exactly one
SELECT (or WITH / SHOW / DESCRIBE / DESC / EXPLAIN) statement, optionally followed by one
`;`, checked by a small lexer that knows ClickHouse's comments, string literals and
quoted identifiers: a `;` or keyword inside a string or a comment is not a statement.

Where ClickHouse versions read the same text differently, the text is refused rather than
guessed: nested `/* /* */ */` comments (newer servers nest them, older ones do not) and
`#` comments (newer servers only).
"""

from __future__ import annotations

READ_ONLY_KEYWORDS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN")
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


class StoreSQLError(ValueError):
    """Text that is not exactly one read-only statement."""


def _quoted_end(sql: str, i: int) -> int:
    """The index after the literal or identifier opened by the quote at `i`
    (ClickHouse: a backslash escapes the next character; a doubled quote is one quote)."""
    quote = sql[i]
    j = i + 1
    while j < len(sql):
        c = sql[j]
        if c == "\\":
            j += 2
            continue
        if c == quote:
            if sql.startswith(quote, j + 1):
                j += 2
                continue
            return j + 1
        j += 1
    what = "string literal" if quote == "'" else "quoted identifier"
    raise StoreSQLError(f"unterminated {what} starting at character {i + 1}")


def _heredoc_end(sql: str, i: int) -> int | None:
    """The index after a `$tag$ ... $tag$` literal starting at `i`, or None when `$` does
    not open one."""
    j = i + 1
    while j < len(sql) and sql[j] in _WORD:
        j += 1
    if j >= len(sql) or sql[j] != "$":
        return None
    tag = sql[i : j + 1]
    end = sql.find(tag, j + 1)
    if end < 0:
        raise StoreSQLError(f"unterminated {tag} literal starting at character {i + 1}")
    return end + len(tag)


def _comment_end(sql: str, i: int) -> int:
    """The index after the `/* ... */` comment starting at `i`."""
    end = sql.find("*/", i + 2)
    if end < 0:
        raise StoreSQLError(f"unterminated /* comment starting at character {i + 1}")
    if "/*" in sql[i + 2 : end]:
        raise StoreSQLError("nested /* comments are not accepted (servers disagree on them)")
    return end + 2


def tokens(sql: str) -> list[tuple[int, str]]:
    """(offset, token) of the code of `sql`: words, quoted things and single characters,
    without whitespace and comments."""
    out: list[tuple[int, str]] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _comment_end(sql, i)
        elif c == "#":
            raise StoreSQLError("# comments are not accepted (servers disagree on them); use --")
        elif c in "'\"`":
            j = _quoted_end(sql, i)
            out.append((i, sql[i:j]))
            i = j
        elif c == "$" and (j := _heredoc_end(sql, i)) is not None:
            out.append((i, sql[i:j]))
            i = j
        elif c in _WORD:
            j = i
            while j < n and sql[j] in _WORD:
                j += 1
            out.append((i, sql[i:j]))
            i = j
        else:
            out.append((i, c))
            i += 1
    return out


def check_read_only(sql: str) -> None:
    """Raise StoreSQLError unless `sql` is exactly one read-only statement."""
    toks = tokens(sql)
    if toks and toks[-1][1] == ";":
        toks.pop()  # one trailing `;` is the usual end of a statement
    if not toks:
        raise StoreSQLError("SQL is empty")
    for offset, tok in toks:
        if tok == ";":
            raise StoreSQLError(f"one statement only: a second one starts after the ';' at "
                                f"character {offset + 1}")
    first = next((tok for _, tok in toks if tok != "("), "")
    if first.upper() not in READ_ONLY_KEYWORDS or (first != toks[0][1]
                                                    and first.upper() not in ("SELECT", "WITH")):
        shown = first if first[:1] in _WORD else toks[0][1]
        raise StoreSQLError(f"only read-only statements run here ({', '.join(READ_ONLY_KEYWORDS)}"
                            f"), not {shown[:40]!r}")
