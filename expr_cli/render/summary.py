"""How `expr summary` prints: the header, a stats table per key, outliers, coverage, heatmap.

A render module (rich is imported here and in `render` only, lazily). The view is the
JSON-ready dict `summary.build_view` makes; rows of thousands of ranks arrive grouped by
node already (`layout`), so everything printed here is bounded whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from expr_cli.layout import coverage_runs
from expr_cli.resolve import compact_ranks, ranks_phrase

from . import (
    GLYPHS,
    MISSING,
    NONFINITE,
    SCALE,
    _show,
    _table,
    console,
    fmt_cell,
    fmt_num,
    fmt_signed,
    prose,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

STAT_COLUMNS = ("mean", "wmean", "min", "max", "range", "std", "p05", "p50", "p95")
STAT_WIDTH = 7  # characters of a statistic in a narrow terminal (`fmt_fit`)
OUTLIER_ROWS = 12  # flagged ranks listed one per line; the others are named in one line
LIST_RANKS = 24  # behind ranks listed with their step; more are compacted


MAX_KEYS = 10  # key tables `expr summary` prints (each some lines); the rest counted
MAX_SPANS = 40  # rows of `--spans` (and values of a shard's last row) printed


def fmt_fit(x: Any, width: int) -> str:
    """`fmt_num` with as many significant digits (4 at most) as fit in `width` characters."""
    for digits in (4, 3, 2, 1):
        text = fmt_num(x, digits)
        if len(text) <= width:
            break
    return text


def fmt_ratio(ratio: float | None) -> str:
    """`1.52x` (of the median); `-` when the median is 0."""
    if ratio is None:
        return "-"
    return f"{ratio:.3g}x" if abs(ratio) < 1000 else f"{ratio:.2e}x"


def summary(view: Mapping[str, Any]) -> None:
    """`expr summary`: header, a stats table per key, outliers, coverage, heatmap."""
    from rich.text import Text

    out = console()
    if view.get("step") is not None:
        where = f"step {view['step']}"
    else:
        where = f"steps {view['steps'][0]}:{view['steps'][1]} ({view['n_steps']} steps, per-rank means)"
    head = Text()
    head.append(view["run"], style="bold")
    head.append(f" · {where} · world size {view['world_size']:,} · stream {view['stream_text']}")
    prose(out, head)  # a pipe: one line; a terminal wraps at words
    why = view.get("why")
    if why and why != "as asked":
        prose(out, Text(f"  {where}: {why}", style="dim"))
    _ranks_line(out, view.get("ranks") or {})
    from .health import story_lines

    for line in story_lines(view.get("story") or {}):
        prose(out, line)
    keys = view["keys"][:MAX_KEYS]  # a screenful: a row of 50,000 keys was 300k lines
    narrow = _narrow_width(out.width, view["world_size"], [i["stats"] for i in keys])
    for item in keys:
        out.print()
        _key_stats(out, item, view, narrow)
    out.print()
    _more(out, len(view["keys"]) - len(keys), "key", "-m KEY to show one")
    _coverage(out, view["coverage"], view["coverage_checked"])
    _system_hint(out, view.get("system_keys") or [])
    spans = view.get("span_keys") or []
    if spans:
        shown = ", ".join(spans[:3]) + (", ..." if len(spans) > 3 else "")
        prose(out, Text(f"span times: {len(spans)} key{'s' if len(spans) != 1 else ''} ({shown}); "
                        "--spans to compare the ranks",
                        style="dim"))
    if view.get("heatmap"):
        out.print()
        heatmap(out, view["heatmap"])


def _ranks_line(out: Console, ranks: Mapping[str, Any]) -> None:
    """`4,096 shards: 4,093 live, 2 finished, 1 crashed (rank 17)`."""
    from rich.text import Text

    for rank, why in (ranks or {}).get("dropped", {}).items():
        prose(out, Text(f"  rank {rank}: {why}", style="bold yellow"))
    for bad in (ranks or {}).get("nonfinite", [])[:4]:
        prose(out, Text(f"  non-finite: {bad['detail']}", style="bold red"))
    if not ranks or ranks.get("shards", 0) <= 1:
        return
    text = Text(f"  {ranks['shards']:,} shards: {ranks['live']:,} live, ")
    if ranks.get("silent"):
        text.append(f"{ranks['silent']:,} silent", style="red")
        text.append(", ")
    text.append(f"{ranks['finished']:,} finished")
    crashed = ranks.get("crashed") or []
    if crashed:
        text.append(f", {len(crashed):,} crashed (rank{'s' if len(crashed) != 1 else ''} "
                    f"{compact_ranks(list(crashed))})", style="bold red")
        first = ranks.get("first_crash")
        if first and len(crashed) > 1:
            why = ": ".join(str(x) for x in (first.get("type"), first.get("message")) if x)
            text.append(f"; rank {first['rank']} failed first" + (f" ({why})" if why else ""),
                        style="red")
    else:
        text.append(", 0 crashed")
    if ranks.get("no_shard"):
        text.append(f"; no shard: {ranks_phrase(list(ranks['no_shard']))}", style="yellow")
    prose(out, text)
    incidents = ranks.get("incidents") or []
    if incidents:
        from .health import incident_text

        for inc in incidents[:8]:  # (`expr watch RUN --once --json` has them all)
            line = Text("  open: ")
            line.append_text(incident_text(inc))
            prose(out, line)
        if len(incidents) > 8:
            prose(out, Text(f"  ... and {len(incidents) - 8} more open incidents", style="dim"))


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


def _behind_text(behind: Sequence[Mapping[str, Any]]) -> str:
    if len(behind) <= LIST_RANKS:
        parts = [(f"{b['rank']} (step {fmt_cell(b['step'])}" if b["step"] is not None
                  else f"{b['rank']} (no step yet")
                 + (f", {b['status']})" if b["status"] != "running" else ")") for b in behind]
        return f"behind: rank{'s' if len(parts) != 1 else ''} " + ", ".join(parts)
    return f"behind: {len(behind):,} ranks {compact_ranks([b['rank'] for b in behind])}"


def _key_stats(
    out: Console, item: Mapping[str, Any], view: Mapping[str, Any], narrow: int | None
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
    behind = item.get("behind") or []
    missing = item.get("missing", st["missing"])
    if behind:
        notes.append(_behind_text(behind))
    if missing:
        notes.append(f"missing {ranks_phrase(list(missing))}")
    if st["nonfinite"]:
        bad = st["nonfinite_ranks"]
        notes.append(f"non-finite {st['nonfinite']} (rank{'s' if len(bad) != 1 else ''} "
                     f"{compact_ranks(list(bad))})")
    title = item["key"] + (" (step rows)" if item.get("source") == "step rows" else "")
    _show(out, title, table, style="bold cyan")
    if item.get("note"):
        notes.insert(0, item["note"])
    for note in notes:
        prose(out, Text("  " + note, style="yellow"))
    _weighted(out, item)
    _outliers(out, item, view)
    if item.get("variability") is not None:
        _noisier(out, item["variability"])


def _weighted(out: Console, item: Mapping[str, Any]) -> None:
    """A line when the weighted mean differs from the mean by more than the spread explains."""
    from rich.text import Text

    w = item.get("weighted")
    if not w or not w["differs"]:
        return
    st = item["stats"]
    prose(out, Text(f"  weighted: wmean {fmt_num(st['wmean'])} differs from mean "
                    f"{fmt_num(st['mean'])} by {fmt_signed(w['gap'])}, more than the spread "
                    f"explains (> {fmt_num(w['z'])} x std/sqrt(n) = {fmt_num(w['z'] * w['se'])}):"
                    " the weights go with the values", style="yellow"))


def fmt_variability(by: str, value: float | None) -> str:
    """`CV 0.31` or `std 0.012`."""
    return f"{'CV' if by == 'cv' else 'std'} {fmt_num(value, 2 if by == 'cv' else 3)}"


def _noisier(out: Console, var: Mapping[str, Any]) -> None:
    """`rank 1 noisier: CV 0.31 vs 0.04 median` per flagged rank, or one dim line."""
    from rich.text import Text

    by, med = var["by"], var["median"]
    what = "CV" if by == "cv" else "std"
    if not var["n_ranks"]:
        return
    if not var["noisier"]:
        prose(out, Text(f"  no rank noisier ({what} of each rank across the steps; median "
                        f"{fmt_num(med, 2 if by == 'cv' else 3)})", style="dim"))
        return
    for o in var["noisier"][:OUTLIER_ROWS]:
        node = f" ({o['node']})" if o.get("node") else ""
        prose(out, Text(f"  rank {o['rank']}{node} noisier: {fmt_variability(by, o[by])} vs "
                        f"{fmt_num(med, 2 if by == 'cv' else 3)} median", style="bold red"))
    rest = var["noisier"][OUTLIER_ROWS:]
    if rest:
        prose(out, Text(f"  ... and {len(rest):,} more noisier: ranks "
                        f"{compact_ranks(sorted(o['rank'] for o in rest))}", style="red"))


def _outliers(out: Console, item: Mapping[str, Any], view: Mapping[str, Any]) -> None:
    from rich.text import Text

    threshold = fmt_num(view.get("threshold", 3.5))
    rel = fmt_num(100 * view.get("min_rel", 0.05), 3)
    rule = f"|robust z| > {threshold} and >= {rel}% from the median"
    shown = item["outliers"]
    flagged = item.get("n_flagged", sum(o["flagged"] for o in shown))
    if not shown:
        out.print(Text(f"  no outliers (none with {rule})", style="dim"))
        return
    title = f"  outliers: {flagged:,} rank{'s' if flagged != 1 else ''} ({rule}), worst first"
    ot = _table(["rank", "node", "value", "x median", "robust z", ""],
                right=["rank", "value", "x median", "robust z"], keep=["node"])
    for o in shown[:OUTLIER_ROWS]:
        style = "bold red" if o["flagged"] else ""
        ot.add_row(str(o["rank"]), str(o.get("node") or "-"), fmt_num(o["value"]),
                   fmt_ratio(o.get("ratio")), _fmt_robust(o["robust"]),
                   Text("◀ outlier" if o["flagged"] else "", style=style), style=style or None)
    prose(out, Text(title, style="bold red" if flagged else "dim"))
    out.print(ot)
    rest = shown[OUTLIER_ROWS:]
    if rest:
        more = [o["rank"] for o in rest if o["flagged"]]
        text = f"  ... and {len(rest):,} more"
        if more:
            text += f"; flagged: {ranks_phrase(sorted(more))}"
        prose(out, Text(text + " (--json lists them)", style="dim"))


def _fmt_robust(x: float | None) -> str:
    """The robust score; `MAD 0` when there is no spread to score against."""
    if x is None:
        return "MAD 0"
    # a whole number past 100 (`+1970`, not `+1.97e3`): a score people read, not a float
    return fmt_signed(round(x) if math.isfinite(x) and abs(x) >= 100 else x, 3)


def _coverage(out: Console, rows: Sequence[Mapping[str, Any]], checked: Mapping[str, Any]) -> None:
    from rich.text import Text

    span = f"steps {checked['first']}..{checked['last']}" if checked["steps"] else "no steps"
    if not rows:
        out.print(Text(f"coverage: every rank reported at each of the last {checked['steps']} "
                       f"steps ({span})", style="green"))
        return
    out.print(Text(f"coverage: {len(rows)} of the last {checked['steps']} steps ({span}) miss ranks",
                   style="bold yellow"))
    runs = coverage_runs(rows)
    table = _table(["steps", "reported", "missing ranks"], right=["reported"], keep=["steps"])
    for r in runs[-10:]:
        missing = compact_ranks(list(r["missing"]))
        if len(missing) > 48:
            missing = missing[:45] + "..."
        steps = str(r["first"]) if r["steps"] == 1 else f"{r['first']}..{r['last']}"
        table.add_row(steps, f"{r['reported']}/{r['world']}", missing)
    out.print(table)
    if len(runs) > 10:
        out.print(Text(f"  ... and {len(runs) - 10} earlier", style="dim"))


def _system_hint(out: Console, keys: Sequence[str]) -> None:
    """One dim line naming the system metrics the summary left out (DESIGN 19)."""
    from rich.text import Text

    if keys:
        shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
        prose(out, Text(f"system metrics: {len(keys)} keys ({shown}); -m KEY to show them",
                        style="dim"))


def heatmap_buckets(width: int, world: int) -> int:
    """How many step buckets fit the terminal beside the row labels."""
    label = len(f"r{max(world - 1, 0)}") if world <= 32 else 18
    return max(1, width - label - 3)


def heatmap(out: Console, hm: Mapping[str, Any]) -> None:
    """Rows (ranks, nodes, bins of nodes) x step buckets on a sequential scale, with axis and
    legend."""
    from rich.text import Text

    buckets = hm["buckets"]
    rows: Sequence[Mapping[str, Any]] = hm["rows"]
    finite = [v for row in rows for v in row["cells"] if v is not None and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    plain = out.no_color or out.color_system is None
    label_w = min(18, max((len(r["label"]) for r in rows), default=2))
    title = Text(f"heatmap of {hm['key']}", style="bold cyan")
    if buckets:
        title.append(f"  steps {buckets[0][0]}..{buckets[-1][1]}, {len(buckets)} columns", style="dim")
    grouped = any(r["kind"] != "rank" for r in rows)
    if grouped:
        title.append(f"; by node, {hm.get('agg', 'max')} per row", style="dim")
    prose(out, title)
    if not buckets:
        out.print(Text("  no values", style="dim"))
        return
    # few buckets: wider cells, up to 4 characters, so a short window is still legible
    cw = max(1, min(4, (out.width - label_w - 1) // len(buckets)))
    axis_first, axis_last = str(buckets[0][0]), str(buckets[-1][1])
    pad = max(1, cw * len(buckets) - len(axis_first) - len(axis_last))
    out.print(Text(" " * (label_w + 1) + axis_first + " " * pad + axis_last, style="dim"), soft_wrap=True)
    for row in rows:
        line = Text()
        style = "bold red" if row["kind"] == "rank" and grouped else "dim"
        line.append(row["label"][:label_w].rjust(label_w) + " ", style=style)
        for v in row["cells"]:
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


def last_values(rows: Sequence[Mapping[str, Any]], label: str,
                system_keys: Sequence[str] = ()) -> None:
    """A run without rank records: each shard's last scalar values."""
    from rich.text import Text

    out = console()
    out.print(Text(f"{label} has no rank records (log_rank_metrics); last values per shard:", style="yellow"))
    _system_hint(out, system_keys)
    for r in rows[:MAX_KEYS]:
        table = _table(["metric", "value"], right=["value"], keep=["metric"])
        values = list(r["values"].items())
        for k, v in values[:MAX_SPANS]:
            table.add_row(k, fmt_cell(v))
        out.print()
        _show(out, f"{r['file']}  (rank {r['rank']}, step {fmt_cell(r['step'])})", table,
              style="bold cyan")
        _more(out, len(values) - MAX_SPANS, "key", "-m KEY to show one")
    _more(out, len(rows) - MAX_KEYS, "shard", "")


def _more(out: Console, n: int, what: str, hint: str) -> None:
    """One dim line for what a screenful left out: how many, and how to see them."""
    from rich.text import Text

    if n <= 0:
        return
    how = f"{hint}; --json for all" if hint else "--json for all"
    prose(out, Text(f"... and {n:,} more {what}{'s' if n != 1 else ''} ({how})", style="dim"))


def spans(view: Mapping[str, Any]) -> None:
    """`expr summary --spans`: per span key, the ranks' median, the straggler's excess over
    it and the slowest rank, worst phase first; milliseconds, in 80 columns (the span
    names whole: the unit in the title, the count of ranks there too when every span has
    the same)."""
    from rich.text import Text

    out = console()
    lo, hi = view["steps"]
    straggler = view.get("straggler")
    counts = {row["ranks"] for row in view["spans"]}
    head = Text()
    head.append(view["run"], style="bold")
    head.append(f" · span times in ms, per-rank means over steps {lo}:{hi} · world size "
                f"{view['world_size']:,}")
    if len(counts) == 1:
        (n,) = counts
        head.append(f" · {n:,} rank{'s' if n != 1 else ''} report each span")
    prose(out, head)
    if straggler is not None:
        prose(out, Text(f"  straggler: rank {straggler} (the most time over the median in "
                        "top-level spans)", style="dim"))
    headers = ["span", "median", f"rank {straggler}", "excess", "x median", "slowest", "its ms"]
    if len(counts) > 1:
        headers.append("ranks")
    table = _table(headers, right=headers[1:], keep=["span"])
    rows = view["spans"][:MAX_SPANS]  # worst first: the slowest phases, the rest counted
    for row in rows:
        excess = row["excess_ms"]
        cells: list[Any] = [
            row["path"], fmt_num(row["median_ms"]), fmt_num(row["straggler_ms"]),
            Text(fmt_signed(excess) if excess is not None else "-",
                 style="bold red" if excess is not None and excess > 0.1 * row["median_ms"] else ""),
            fmt_ratio(row["ratio"]), f"rank {row['max_rank']}", fmt_num(row["max_ms"]),
        ]
        if len(counts) > 1:
            cells.append(str(row["ranks"]))
        table.add_row(*cells)
    out.print(table)
    _more(out, len(view["spans"]) - len(rows), "span key", "faster than those shown")
