"""Everything `expr` prints: tables, the summary view, the heatmap, tail lines, errors.

The only module that imports rich. Commands build plain, JSON-ready data and hand it
here; `--json` prints the same data with `print_json`. rich honours `NO_COLOR`,
`FORCE_COLOR` and `COLUMNS` on its own; `EXPR_NOW` freezes the clock for "age" columns.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .resolve import compact_ranks

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
STATUS_STYLE = {"running": "green", "finished": "blue", "crashed": "bold red", "stale": "yellow"}


def now() -> float:
    """The current time, or `$EXPR_NOW` (seconds since the epoch) to make ages reproducible."""
    frozen = os.environ.get("EXPR_NOW")
    return float(frozen) if frozen else time.time()


def console(stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A fresh console, so environment changes (COLUMNS, NO_COLOR) are always seen.

    Markup is off: metric names, string values and alert texts are data, and `[x]` in
    them must print as written.
    """
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=soft_wrap, emoji=False, markup=False)


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


def jsonable(obj: Any) -> Any:
    """Non-finite floats become "NaN"/"Infinity"/"-Infinity", as in shards (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Strict JSON on stdout, indented, for jq and scripts."""
    sys.stdout.write(json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n")
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


def _show(out: Console, title: str | Text | None, table: Table, style: str = "bold") -> None:
    """A title line (never squeezed to the table's width), then the table."""
    from rich.text import Text

    if title is not None:
        out.print(title if isinstance(title, Text) else Text(title, style=style), soft_wrap=True)
    out.print(table)


def _status(status: str | None) -> Text:
    from rich.text import Text

    return Text(status or "-", style=STATUS_STYLE.get(status or "", ""))


# -- commands ----------------------------------------------------------------


def runs(rows: Sequence[Mapping[str, Any]], root: str) -> None:
    """`expr runs`: a row per run."""
    from rich.text import Text

    table = _table(
        ["project", "run", "ranks", "streams", "last step", "status", "last write"],
        right=["last step"], keep=["run", "status"],
    )
    for r in rows:
        table.add_row(
            r["project"], Text(r["name"], style="bold"), r["ranks_text"], ", ".join(r["streams_text"]),
            fmt_num(r["last_step"]), _status(r["status"]), fmt_age(r["last_write"]),
        )
    _show(console(), f"runs under {root}", table)


def shards(rows: Sequence[Mapping[str, Any]], label: str) -> None:
    """`expr shards`: a row per shard file."""
    from rich.text import Text

    headers = ["rank", "stream", "file", "rows", "last step", "size", "status", "last write", "sidecar"]
    table = _table(headers, right=["rank", "rows", "last step", "size"], keep=["file", "status"])
    for r in rows:
        sidecar = Text(r["sidecar"], style="green" if r["sidecar"] == "ok" else "yellow")
        table.add_row(
            str(r["rank"]), r["stream_text"], r["file"], str(r["rows"]), fmt_num(r["last_step"]),
            fmt_bytes(r["size"]), _status(r["status"]), fmt_age(r["last_write"]), sidecar,
        )
    _show(console(), f"shards of {label}", table)


def history(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str) -> None:
    """`expr history`: rows as a table, `_step` and `_time` first."""
    table = _table(["step", "time", *columns], right=["step", *columns], keep=["time"])
    for r in rows:
        table.add_row(fmt_cell(r.get("_step")), fmt_time(r.get("_time")),
                      *(fmt_cell(r.get(c)) for c in columns))
    _show(console(), title, table)


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


def alerts(rows: Sequence[Mapping[str, Any]], counts: Sequence[Mapping[str, Any]], label: str) -> None:
    """`expr alerts`: every alert in time order, then counts by rank."""
    from rich.text import Text

    table = _table(["time", "rank", "level", "rule", "kind", "step", "", "text"],
                   right=["rank", "step"], keep=["time", "level"])
    level_style = {"critical": "bold red", "error": "red", "warning": "yellow", "info": "blue",
                   "debug": "dim"}
    for a in rows:
        table.add_row(
            fmt_time(a.get("time")), fmt_cell(a.get("rank")),
            Text(str(a.get("level") or "-"), style=level_style.get(str(a.get("level")), "")),
            str(a.get("rule") or a.get("title") or "-"), str(a.get("kind") or "-"),
            fmt_cell(a.get("step")),
            Text("delivered", style="green") if a.get("delivered") else Text("suppressed", style="dim"),
            str(a.get("text") or ""),
        )
    out = console()
    _show(out, f"alerts of {label}", table)
    by_rank = _table(["rank", "fired", "delivered", "suppressed"],
                     right=["rank", "fired", "delivered", "suppressed"])
    for c in counts:
        by_rank.add_row(str(c["rank"]), str(c["fired"]), str(c["delivered"]), str(c["suppressed"]))
    out.print()
    _show(out, "by rank", by_rank)


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


# -- summary -----------------------------------------------------------------

STAT_COLUMNS = ("mean", "wmean", "min", "max", "range", "std", "p05", "p50", "p95")
STAT_WIDTH = 7  # characters of a statistic in a narrow terminal (`fmt_fit`)


def fmt_fit(x: Any, width: int) -> str:
    """`fmt_num` with as many significant digits (4 at most) as fit in `width` characters."""
    for digits in (4, 3, 2, 1):
        text = fmt_num(x, digits)
        if len(text) <= width:
            break
    return text


def summary(view: Mapping[str, Any]) -> None:
    """`expr summary`: header, a stats table per key, outliers, coverage, heatmap."""
    from rich.text import Text

    out = console()
    where = f"step {view['step']}" if view.get("step") is not None else (
        f"steps {view['steps'][0]}:{view['steps'][1]} ({view['n_steps']} steps, per-rank means)"
    )
    head = Text()
    head.append(view["run"], style="bold")
    head.append(f" · {where} · world size {view['world_size']} · stream {view['stream_text']}")
    out.print(head, soft_wrap=True)  # one line, however narrow the terminal
    narrow = _narrow_width(out.width, view["world_size"], [i["stats"] for i in view["keys"]])
    for item in view["keys"]:
        out.print()
        _key_stats(out, item, view.get("outliers_all", False), view.get("threshold", 3.5), narrow)
    out.print()
    _coverage(out, view["coverage"], view["coverage_checked"])
    if view.get("heatmap"):
        out.print()
        heatmap(out, view["heatmap"])


def _narrow_width(width: int, world: int, stats: Sequence[Mapping[str, Any]]) -> int | None:
    """None when the stats tables fit `width` with two spaces between columns; else how many
    characters a number may take with one space between them (fewer than STAT_WIDTH only
    for a world of 1000 ranks or a terminal under 80 columns). One answer for every key, so
    that their tables line up."""
    first = max(STAT_WIDTH, len(f"{world}/{world}"))
    for st in stats:
        if first + sum(max(STAT_WIDTH, len(fmt_num(st[c]))) + 2 for c in STAT_COLUMNS) > width:
            return max(4, min(STAT_WIDTH, (width - first - len(STAT_COLUMNS)) // len(STAT_COLUMNS)))
    return None


def _key_stats(
    out: Console, item: Mapping[str, Any], show_all: bool, threshold: float, narrow: int | None
) -> None:
    from rich.text import Text

    st = item["stats"]
    headers = ["n/world", *STAT_COLUMNS]
    table = _table(headers, right=headers)
    if narrow is None:
        cells = [fmt_num(st[c]) for c in STAT_COLUMNS]
    else:
        table.padding = (0, 0)  # the box still puts one space between columns
        cells = [fmt_fit(st[c], narrow) for c in STAT_COLUMNS]
    for col in table.columns:
        col.min_width = narrow or STAT_WIDTH
    cells.insert(0, f"{st['n']}/{st['world']}")
    table.add_row(*cells)
    notes = []
    if st["missing"]:
        notes.append(f"missing ranks {_compact(st['missing'])}")
    if st["nonfinite"]:
        bad = st["nonfinite_ranks"]
        notes.append(f"non-finite {st['nonfinite']} (rank{'s' if len(bad) != 1 else ''} {_compact(bad)})")
    _show(out, item["key"], table, style="bold cyan")
    if item.get("note"):
        notes.insert(0, item["note"])
    if notes:
        out.print(Text("  " + "  ".join(notes), style="yellow"), soft_wrap=True)
    shown = [o for o in item["outliers"] if show_all or o["flagged"]]
    if not shown:
        out.print(Text(f"  no outliers (|robust z| <= {fmt_num(threshold)})", style="dim"))
        return
    flagged = sum(o["flagged"] for o in item["outliers"])
    title = f"  outliers: {flagged} rank{'s' if flagged != 1 else ''} with |robust z| > {fmt_num(threshold)}"
    ot = _table(["rank", "value", "delta", "z", "robust z", ""],
                right=["rank", "value", "delta", "z", "robust z"])
    for o in shown:
        style = "bold red" if o["flagged"] else ""
        ot.add_row(str(o["rank"]), fmt_num(o["value"]), fmt_signed(o["delta"]), fmt_signed(o["z"], 3),
                   fmt_signed(o["robust"], 3), Text("◀ outlier" if o["flagged"] else "", style=style),
                   style=style or None)
    out.print(Text(title, style="bold red" if flagged else "dim"))
    out.print(ot)


def _compact(ranks: Sequence[int]) -> str:
    return compact_ranks(list(ranks))


def _coverage(out: Console, rows: Sequence[Mapping[str, Any]], checked: Mapping[str, Any]) -> None:
    from rich.text import Text

    span = f"steps {checked['first']}..{checked['last']}" if checked["steps"] else "no steps"
    if not rows:
        out.print(Text(f"coverage: every rank reported at each of the last {checked['steps']} "
                       f"steps ({span})", style="green"))
        return
    out.print(Text(f"coverage: {len(rows)} of the last {checked['steps']} steps ({span}) miss ranks",
                   style="bold yellow"))
    table = _table(["step", "reported", "missing ranks"], right=["step", "reported"])
    for r in rows[-10:]:
        table.add_row(str(r["step"]), f"{r['reported']}/{r['world']}", _compact(r["missing"]))
    out.print(table)
    if len(rows) > 10:
        out.print(Text(f"  ... and {len(rows) - 10} earlier steps", style="dim"))


def heatmap_buckets(width: int, world: int) -> int:
    """How many step buckets fit the terminal beside the rank labels."""
    return max(1, width - len(f"r{max(world - 1, 0)}") - 3)


def heatmap(out: Console, hm: Mapping[str, Any]) -> None:
    """Rank x step-bucket cells on a sequential scale, with axis and legend."""
    from rich.text import Text

    buckets = hm["buckets"]
    cells: Mapping[int, Sequence[float | None]] = hm["cells"]
    finite = [v for row in cells.values() for v in row if v is not None and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    plain = out.no_color or out.color_system is None
    label_w = max(len(f"r{r}") for r in cells) if cells else 2
    title = Text(f"heatmap of {hm['key']}", style="bold cyan")
    if buckets:
        title.append(f"  steps {buckets[0][0]}..{buckets[-1][1]}, {len(buckets)} columns", style="dim")
    out.print(title)
    if not buckets:
        out.print(Text("  no values", style="dim"))
        return
    # few buckets: wider cells, up to 4 characters, so a short window is still legible
    cw = max(1, min(4, (out.width - label_w - 1) // len(buckets)))
    axis_first, axis_last = str(buckets[0][0]), str(buckets[-1][1])
    pad = max(1, cw * len(buckets) - len(axis_first) - len(axis_last))
    out.print(Text(" " * (label_w + 1) + axis_first + " " * pad + axis_last, style="dim"), soft_wrap=True)
    for rank in sorted(cells):
        line = Text()
        line.append(f"r{rank}".rjust(label_w) + " ", style="dim")
        for v in cells[rank]:
            line.append_text(_cell(v, lo, hi, plain, cw))
        out.print(line, soft_wrap=True)
    legend = Text(" " * (label_w + 1))
    legend.append(fmt_num(lo) + " ")
    steps = GLYPHS if plain else SCALE
    for i in range(len(steps)):
        legend.append_text(_cell(lo + (hi - lo) * (i + 0.5) / len(steps), lo, hi, plain))
    legend.append(" " + fmt_num(hi))
    legend.append(f"   {MISSING} no data   {NONFINITE} non-finite", style="dim")
    out.print(legend, soft_wrap=True)


def _cell(v: float | None, lo: float, hi: float, plain: bool, width: int = 1) -> Text:
    """One heatmap cell: a background colour (or a block glyph without colour)."""
    from rich.style import Style
    from rich.text import Text

    if v is None:
        return Text(MISSING * width, style="dim")
    if not math.isfinite(v):
        return Text(NONFINITE * width, style="bold red")
    n = len(GLYPHS) if plain else len(SCALE)
    idx = n // 2 if hi <= lo else min(n - 1, int((v - lo) / (hi - lo) * n))
    if plain:
        return Text(GLYPHS[idx] * width)
    return Text(" " * width, style=Style(bgcolor=SCALE[idx]))


def last_values(rows: Sequence[Mapping[str, Any]], label: str) -> None:
    """A run without rank records: each shard's last scalar values."""
    from rich.text import Text

    out = console()
    out.print(Text(f"{label} has no rank records (log_rank_metrics); last values per shard:", style="yellow"))
    for r in rows:
        table = _table(["metric", "value"], right=["value"], keep=["metric"])
        for k, v in r["values"].items():
            table.add_row(k, fmt_cell(v))
        out.print()
        _show(out, f"{r['file']}  (rank {r['rank']}, step {fmt_cell(r['step'])})", table,
              style="bold cyan")
