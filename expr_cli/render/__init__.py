"""Everything `expr` prints: tables, the summary view, the heatmap, tail lines, errors.

The only module that imports rich. Commands build plain, JSON-ready data and hand it
here; `--json` prints the same data with `print_json`. rich honours `NO_COLOR`,
`FORCE_COLOR` and `COLUMNS` on its own; `EXPR_NOW` freezes the clock for "age" columns.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from expr_cli.data import jsonable, now
from expr_cli.resolve import stream_label

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

# viridis at nine stops: perceptually uniform and readable by colour-blind people
SCALE = (
    "#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c",
    "#28ae80", "#5ec962", "#addc30", "#fde725",
)
GLYPHS = "▁▂▃▄▅▆▇█"  # the same scale without colour (NO_COLOR, pipes)
MISSING = "·"
NONFINITE = "\N{MULTIPLICATION SIGN}"
STATUS_STYLE = {"running": "green", "finished": "blue", "crashed": "bold red", "stale": "yellow",
                "corrupt": "bold red", "lost": "bold red", "silent": "red"}


def console(stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A fresh console, so environment changes (COLUMNS, NO_COLOR) are always seen.

    Markup is off: metric names, string values and alert texts are data, and `[x]` in
    them must print as written. `soft_wrap` (a long line stays one line, for grep) holds
    for a pipe or a file; a terminal wraps a long line at its words instead.
    """
    from .safe import safe_console_class

    # (control and bidi characters in the data print as escapes: `safe`)
    out = safe_console_class()(stderr=stderr, highlight=False, emoji=False, markup=False)
    out.soft_wrap = soft_wrap and not out.is_terminal
    return out


# -- plain formatting --------------------------------------------------------


def fmt_num(x: Any, digits: int = 4) -> str:
    """Compact number: `digits` significant digits, scientific when needed; `-` for none."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if not isinstance(x, float):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    text = f"{x:.{digits}g}"
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    return "0" if text == "-0" else text


def fmt_signed(x: float | None, digits: int = 4) -> str:
    """Like fmt_num with an explicit `+` on positive values (deltas, scores)."""
    text = fmt_num(x, digits)
    return "+" + text if x is not None and x > 0 and math.isfinite(x) else text


def fmt_time(t: Any) -> str:
    """Local wall-clock time of an epoch timestamp."""
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_age(t: Any) -> str:
    """`42s ago`, `5m ago`, `3h ago`, `2d ago` relative to `now()`."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "-"
    s = max(0.0, now() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit} ago"
    return f"{int(s)}s ago"


def fmt_span(seconds: float) -> str:
    """A length of time: `42s`, `5m`, `1.5h`, `2d` (as the page's `age`)."""
    if seconds < 60:
        return f"{round(seconds)}s"
    if seconds < 3600:
        return f"{round(seconds / 60)}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{round(seconds / 86400)}d"


def fmt_bytes(n: int) -> str:
    """`512 B`, `1.5 KiB`, `3.2 MiB`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_cell(v: Any) -> str:
    """One value of a history row."""
    if v is None:
        return ""
    return fmt_num(v, 6) if isinstance(v, (int, float)) else str(v)


def print_json(obj: Any) -> None:
    """Strict JSON on stdout, indented, for jq and scripts.

    Written by orjson: `json.dumps` with an indent runs its pure-Python encoder (a
    16,384-rank `expr top --json` spent 0.2 s there); the same text but for the
    spelling of a few floats (`1e-05` is `0.00001`). Text that is not ASCII, or an int
    past 64 bits, goes through `json` as before (non-ASCII escaped as \\uXXXX).
    """
    import orjson

    data = jsonable(obj)
    try:
        text = orjson.dumps(data, option=orjson.OPT_INDENT_2).decode()
    except TypeError:  # an int beyond 64 bits, a type orjson does not write
        text = ""
    if not text or not text.isascii():
        text = json.dumps(data, indent=2, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """The one error line: red, on stderr."""
    from rich.text import Text

    console(stderr=True, soft_wrap=True).print(Text(f"error: {message}", style="red"))


def warning(message: str) -> None:
    """A warning line on stderr."""
    from rich.text import Text

    console(stderr=True, soft_wrap=True).print(Text(f"warning: {message}", style="yellow"))


def status(message: str) -> None:
    """A dim progress line on stderr (what `expr tail` is following)."""
    from rich.text import Text

    console(stderr=True, soft_wrap=True).print(Text(message, style="dim"))


def note(message: str) -> None:
    """A quiet line on stdout (empty results, hints)."""
    from rich.text import Text

    console(soft_wrap=True).print(Text(message, style="dim"))


@contextmanager
def replay_progress(description: str, disable: bool) -> Iterator[Callable[[Mapping[str, Any]], None]]:
    """A transient progress bar on stderr for `expr replay`: files done of the total,
    events and their rate, the time so far. Yields the call that takes exprd's progress
    lines (`files_done`, `files_total`, `events`, `events_per_s`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total} files"),
        TextColumn("{task.fields[events]} events ({task.fields[rate]}/s)"),
        TimeElapsedColumn(), console=console(stderr=True), transient=True, disable=disable,
    ) as bar:
        task = bar.add_task(description, total=None, events=0, rate=0)

        def update(p: Mapping[str, Any]) -> None:
            bar.update(task, completed=p.get("files_done", 0), total=p.get("files_total"),
                       events=p.get("events", 0), rate=int(p.get("events_per_s", 0)))

        yield update


def _table(headers: Sequence[str], right: Iterable[str] = (), keep: Iterable[str] = ()) -> Table:
    """A borderless table; `right` columns are right-aligned numbers, `keep` columns never wrap."""
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, header_style="bold",
        collapse_padding=True,
    )
    align = set(right)
    whole = set(keep) | align
    for h in headers:
        table.add_column(h, justify="right" if h in align else "left", no_wrap=h in whole)
    return table


def prose(out: Console, text: str | Text, style: str = "") -> None:
    """One line of prose: to a pipe whole (a line for grep); on a terminal wrapped at its
    words, each wrapped part indented as the line itself is (its leading spaces), so that
    a long line under an indented block stays in it."""
    from rich.cells import cell_len
    from rich.padding import Padding
    from rich.text import Text

    text = text if isinstance(text, Text) else Text(text, style=style)
    if not out.is_terminal:
        out.print(text, soft_wrap=True)
        return
    indent = len(text.plain) - len(text.plain.lstrip(" "))
    if not indent or cell_len(text.plain) <= out.width:
        out.print(text)
        return
    out.print(Padding(text[indent:], (0, 0, 0, indent), expand=False))


def _show(out: Console, title: str | Text | None, table: Table, style: str = "bold") -> None:
    """A title line (never squeezed to the table's width), then the table."""
    from rich.text import Text

    if title is not None:
        prose(out, title if isinstance(title, Text) else Text(title, style=style))
    out.print(table)


NO_STEP_SHOWN = 10.0  # s without a step row after which a running shard or run says so


def _status(status: str | None, step_at: float | None = None, written: float | None = None) -> Text:
    """A status; a running one whose files were written (`written`, epoch s) at least
    NO_STEP_SHOWN seconds after its last step row (`step_at`) says how long it has taken
    no step (a probe or a system sample keeps its files fresh, but is not progress)."""
    from rich.text import Text

    out = Text(status or "-", style=STATUS_STYLE.get(status or "", ""))
    if status in ("running", "lost") and step_at is not None and written is not None \
            and written - step_at >= NO_STEP_SHOWN:
        out.append(f", no step for {fmt_span(max(0.0, now() - step_at))}", style="yellow")
    return out


# -- commands ----------------------------------------------------------------


RUN_MIN = 12  # characters the run column keeps, however narrow the terminal


def runs(rows: Sequence[Mapping[str, Any]], root: str) -> None:
    """`expr runs`: a row per run, named `project/name` as the commands take it. Every
    column stays whole but the run's, which folds a name too long for the terminal (the
    others were cut to "p…" and "r…" beside a 43-character name at 80 columns); the
    streams only when a run has one besides the default."""
    from rich.text import Text

    streams = any(r["streams_text"] != [stream_label(None)] for r in rows)
    headers = ["run", "ranks", *(["streams"] * streams), "last step", "status", "last write"]
    table = _table(headers, right=["last step"], keep=headers[1:])
    widest = max((len(r["project"]) + 1 + len(r["name"]) for r in rows), default=3)
    table.columns[0].overflow = "fold"
    table.columns[0].min_width = min(widest, RUN_MIN)
    for r in rows:
        label = Text(f"{r['project']}/", style="dim")
        label.append(r["name"], style="bold")
        table.add_row(
            label, r["ranks_text"], *([", ".join(r["streams_text"])] * streams),
            fmt_num(r["last_step"]), _status(r["status"], r.get("last_step_at"), r["last_write"]),
            fmt_age(r["last_write"]),
        )
    _show(console(), f"runs under {root}", table)


def history(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str) -> None:
    """`expr history`: rows as a table, `_step` and `_time` first, then the keys that fit the
    terminal whole (values are never cut); a line names the keys left out and how to see them."""
    out = console()
    cells = [[fmt_cell(r.get("_step")), fmt_time(r.get("_time")), *(fmt_cell(r.get(c)) for c in columns)]
             for r in rows]
    headers = ["step", "time", *columns]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    used, shown = widths[0] + 2 + widths[1], 2
    while shown < len(headers) and used + 2 + widths[shown] <= out.width:
        used += 2 + widths[shown]
        shown += 1
    table = _table(headers[:shown], right=["step", *columns], keep=headers[:shown])
    for row in cells:
        table.add_row(*row[:shown])
    _show(out, title, table)
    left = list(columns[shown - 2:])
    if left:
        from rich.text import Text

        names = ", ".join(left[:2]) + (", ..." if len(left) > 2 else "")
        out.print(Text(f"{len(left)} more key(s) not shown ({names}): -m KEY,KEY picks them, "
                       f"-f json or -f csv shows all", style="dim"))


def tail_line(row: Mapping[str, Any], rank: int | None, metrics: Sequence[str] | None) -> None:
    """One followed row as a single line, flushed at once (readers sit on a pipe)."""
    from rich.text import Text

    text = Text()
    if rank is not None:
        text.append(f"r{rank:<3} ", style="cyan")
    step = row.get("_step")
    text.append(f"step {fmt_cell(step):>6}  ", style="bold")
    text.append(fmt_time(row.get("_time"))[11:] + "  ", style="dim")
    if row.get("_kind") == "rank":
        # a rank record (log_rank_metrics), not a step row: marked apart
        text.append(f"[rank {row.get('_rank')}] ", style="magenta")
    keys = metrics if metrics else [k for k in row if not k.startswith("_")]
    parts = [f"{k}={fmt_cell(row[k])}" for k in keys if k in row]
    text.append("  ".join(parts))
    console(soft_wrap=True).print(text)
    sys.stdout.flush()


ALERT_RANKS = 20  # ranks in the "by rank" table (the most alerts first)
RANKS_SHOWN = 24  # characters of an alert's list of ranks (`ranks 0-3,7`) before it is cut
_LEVEL_STYLE = {"critical": "bold red", "error": "red", "warning": "yellow", "info": "blue",
                "debug": "dim"}


def alerts(groups: Sequence[Mapping[str, Any]], counts: Sequence[Mapping[str, Any]],
           label: str) -> None:
    """`expr alerts`: the alerts in time order, those of one rule at one step from many
    ranks as one (`group_alerts`), two lines each (what and when; the message), so it
    reads at 80 columns; then counts by rank."""
    from rich.cells import cell_len
    from rich.padding import Padding
    from rich.text import Text

    from expr_cli.resolve import ranks_phrase

    out = console()
    days = {fmt_time(g["alert"].get("time"))[:10] for g in groups}
    one_day = len(days) == 1
    title = f"alerts of {label}" + (f" on {days.pop()}" if one_day and "-" not in days else "")
    prose(out, Text(title, style="bold"))
    for g in groups:
        a = g["alert"]
        when = fmt_time(a.get("time"))
        head = Text(when[11:] if one_day else when[5:], style="dim")
        ranks = sorted(set(g["ranks"]))
        head.append(f"  {ranks_phrase(ranks, RANKS_SHOWN)}  ")
        level = str(a.get("level") or "-")
        head.append(f"{level:<8}", style=_LEVEL_STYLE.get(level, ""))
        if a.get("step") is not None:
            head.append(f" step {fmt_cell(a.get('step'))}")
        if len(g["ranks"]) == 1:
            head.append("  delivered" if a.get("delivered") else "  suppressed",
                        style="green" if a.get("delivered") else "dim")
        else:  # the alerting rank delivers, the others' are suppressed (DESIGN 7)
            if g["delivered"]:
                head.append(f"  {g['delivered']:,} delivered", style="green")
            if g["suppressed"]:
                head.append(f"{',' if g['delivered'] else ' '} {g['suppressed']:,} suppressed",
                            style="dim")
        what = Text(str(a.get("title") or "-"), style="bold")
        if a.get("kind") and a.get("kind") != "fire":
            what.append(f" ({a.get('kind')})", style="dim")
        if cell_len(head.plain) + 2 + cell_len(what.plain) <= out.width:
            out.print(head + Text("  ") + what)
        else:  # (the counts of thousands of ranks) the title under it, as the message is
            out.print(head)
            out.print(Padding(what, (0, 0, 0, 4), expand=False))
        # the message, then the rule, indented (wrapped lines too)
        body = Text(str(a.get("text") or "").strip())
        # the rule unless the title or the message says it already (a rule without a
        # message of its own alerts with its condition as the text)
        if a.get("rule") and a.get("rule") not in (a.get("title"), body.plain):
            body.append(("  " if body else "") + f"rule: {a.get('rule')}", style="dim")
        if body:
            out.print(Padding(body, (0, 0, 0, 4), expand=False))
    shown = sorted(counts, key=lambda c: (-c["fired"], c["rank"]))[:ALERT_RANKS]
    by_rank = _table(["rank", "fired", "delivered", "suppressed"],
                     right=["rank", "fired", "delivered", "suppressed"])
    for c in sorted(shown, key=lambda c: c["rank"]):
        by_rank.add_row(str(c["rank"]), str(c["fired"]), str(c["delivered"]), str(c["suppressed"]))
    out.print()
    more = len(counts) - len(shown)
    _show(out, "by rank" + (f" (the {len(shown)} with most alerts; {more:,} more)" if more else ""),
          by_rank)


def rule_explain(info: Mapping[str, Any]) -> None:
    """`expr rules explain`: the parsed rule, one field per line."""
    from rich.table import Table

    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value) or "-"
        elif isinstance(value, Mapping):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        table.add_row(key, "-" if value is None else str(value))
    console().print(table)


def rule_firings(rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """`expr rules test`: the steps where the rule fired or recovered."""
    from rich.text import Text

    table = _table(["step", "time", "kind", "level", "values", "message"], right=["step"],
                   keep=["time"])
    for f in rows:
        values = ", ".join(f"{k}={fmt_num(v)}" for k, v in (f.get("values") or {}).items())
        kind = str(f.get("kind"))
        table.add_row(fmt_cell(f.get("step")), fmt_time(f.get("time")),
                      Text(kind, style="red" if kind == "fire" else "green"),
                      str(f.get("level") or "-"), values, str(f.get("message") or ""))
    _show(console(), title, table)
