"""Rendering of `expr watch` and `expr top` (rich lives here and in render.py only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _status, _table, console, fmt_num, fmt_span, jsonable, now

if TYPE_CHECKING:
    from rich.console import RenderableType

    from expr_tracker.health.incidents import Incident

KIND_STYLE = {"crashed": "bold red", "stall": "bold red", "lost": "bold red", "silent": "bold red",
              "hang": "red", "missing": "red", "alert": "red",
              "straggler": "yellow", "slowdown": "yellow", "behind": "yellow"}


def _ranks_text(ranks: Sequence[int]) -> str:
    from expr_cli.resolve import compact_ranks

    return compact_ranks(list(ranks))


INCIDENT_RANKS = 48  # characters of an incident's list of ranks before it is counted and cut


def incident_text(inc: Mapping[str, Any]) -> Any:
    """One incident as a line of text: state, kind, ranks (and hosts), detail."""
    from rich.text import Text

    from expr_cli.resolve import ranks_phrase

    state = str(inc.get("state") or "open")
    kind = str(inc.get("kind"))
    line = Text()
    line.append("resolved " if state == "resolved" else "", style="green")
    line.append(kind, style="dim" if state == "resolved" else KIND_STYLE.get(kind, "bold"))
    ranks = inc.get("ranks") or []
    # (missing ranks of 500 nodes that never started: one range each, thousands of
    # characters; `--json` has them all)
    line.append(f" {ranks_phrase(list(ranks), INCIDENT_RANKS)}")
    hosts = inc.get("hosts") or []
    if hosts:
        line.append(f" on {', '.join(hosts[:3])}{' ...' if len(hosts) > 3 else ''}", style="dim")
    if inc.get("step") is not None:
        line.append(f" step {inc['step']}", style="dim")
    if state == "resolved":
        # why, when not its own detector ("run ended"), and how long it was open (a stall's
        # detail tells its length when it opened: "for 12s")
        why = [str(inc["reason"])] if inc.get("reason") else []
        first, last = inc.get("first_seen"), inc.get("last_seen")
        if isinstance(first, (int, float)) and isinstance(last, (int, float)) and last >= first:
            why.append(f"open {fmt_span(last - first)}")
        if why:
            line.append(f" ({', '.join(why)})", style="green")
    line.append(f": {inc.get('detail') or ''}")
    return line


def incident_lines(incidents: Sequence[Incident], label: str, as_json: bool) -> None:
    """`expr watch`: each incident as a JSON line (--json) or a line of text."""
    if as_json:
        for inc in incidents:
            sys.stdout.write(json.dumps(jsonable(inc.as_line()), allow_nan=False) + "\n")
        sys.stdout.flush()
        return
    out = console(soft_wrap=True)
    for inc in incidents:
        out.print(incident_text(inc.as_line()))


def watching(label: str, state: Any, delivering: bool, note: str | None = None) -> None:
    """`expr watch` found its run: what it watches, and whether it pages (on stderr); and
    `note`, what it says of the filesystem's attribute cache."""
    from . import status

    if note:
        status(note)

    ranks = len(state.ranks) if state is not None else 0
    world = state.world_size if state is not None else None
    seen = f"{ranks}/{world} ranks" if world else f"{ranks} rank{'s' if ranks != 1 else ''}"
    how = "paging through the alert channels" if delivering else "printing only: no alert channels"
    status(f"watching {label} ({seen}, {how}); Ctrl-C stops")


def no_incidents(label: str) -> None:
    """`expr watch --once` found nothing open."""
    from rich.text import Text

    console(soft_wrap=True).print(Text(f"no open incidents in {label}", style="green"))


def story_print(story: Mapping[str, Any]) -> None:
    """`expr watch --once` on a run that is over: the incidents it had, the pages sent."""
    out = console(soft_wrap=True)
    for line in story_lines(story, ""):
        out.print(line)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:.0f}s"


def _line(text: Any) -> Any:
    """One screen line: cut with an ellipsis, never wrapped (the frame counts lines)."""
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def top_frame(view: Mapping[str, Any], height: int, agg: str = "worst",
              width: int | None = None) -> RenderableType:
    """`expr top` in `height` lines (DESIGN 14): a header, the job's line (stalled and its
    suspects, crashed and the rank that failed first, ...), the open incidents, the worst
    ranks that fit, then the nodes (those that need a look, the others folded into bins
    combined with `agg`). Ranks with an incident that do not fit are named underneath.
    The header and the table's first row fit in 5 lines; below 60 columns the rank table
    keeps rank, status, step and steps/s, and rank numbers are never cut."""
    from rich.console import Group
    from rich.text import Text

    from expr_cli.layout import fold_nodes

    height = max(height, 5)
    parts: list[Any] = []
    ranks: list[Mapping[str, Any]] = view["ranks"]
    incidents: list[Mapping[str, Any]] = view["incidents"]
    stats = (f"{len(ranks)} ranks, {view['live']} live  frontier {fmt_num(view['frontier'])}"
             f"  lead {fmt_num(view['lead'])}")
    # a run name too long for the line gives way, not the numbers after it
    label, room = str(view["run"]), (width or console().width) - len(stats) - 2
    if len(label) > room >= 8:
        label = label[: room - 1] + "…"
    head = Text(f"{label}  ", style="bold")
    head.append(stats, style="")
    parts.append(_line(head))
    job = view.get("job") or {}
    if job.get("text"):
        style = {"stalled": "bold red", "crashed": "bold red", "lost": "bold red", "silent": "bold red",
                 "finished": "green"}.get(job.get("state"), "")
        text = str(job["text"])
        # too wide (80 columns): its clauses on two lines, so the second (a silence's crash
        # root: "rank 17 crashed first (...)") is not the part cut
        head_, sep, tail = text.partition("; ")
        if sep and len(text) > (width or console().width) and height >= 12:
            parts.extend(_line(Text(t, style=style)) for t in (head_, tail))
        else:
            parts.append(_line(Text(text, style=style)))
    # rows that never reached a shard (a full spool disk): a line per rank, a few at most
    lost = [r for r in view.get("ranks") or () if r.get("dropped")]
    for r in sorted(lost, key=lambda r: r["rank"])[:3]:
        parts.append(_line(Text(f"rank {r['rank']}: {r['dropped']}", style="bold yellow")))
    if len(lost) > 3:
        parts.append(_line(Text(f"... {len(lost) - 3} more ranks dropped rows", style="yellow")))
    left = height - len(parts)
    cap = 0 if left < 6 else max(1, height // 5)
    shown_inc = incidents if len(incidents) <= cap else incidents[: max(0, cap - 1)]
    parts.extend(_line(incident_text(inc)) for inc in shown_inc)
    if len(incidents) > len(shown_inc) and cap:
        rest = incidents[len(shown_inc):]
        kinds = sorted({str(i.get("kind")) for i in rest})
        parts.append(_line(Text(f"... {len(rest)} more incidents ({', '.join(kinds)})", style="dim")))
    story = view.get("story") or {}
    if story and left >= 6:  # a run that is over: the incidents it had, the pages sent
        parts.extend(_line(x) for x in story_lines(story, "")[: max(2, cap + 1)])
    elif not incidents and not job.get("text") and left >= 6:
        parts.append(_line(Text("no open incidents", style="green")))
    nodes: list[Mapping[str, Any]] = view["nodes"]
    left = height - len(parts)
    node_rows: list[dict[str, Any]] = []
    if len(nodes) > 1 and left >= 10:
        node_rows = fold_nodes(nodes, min(len(nodes), max(3, (left - 6) // 3)), agg)
    node_lines = 2 + len(node_rows) if node_rows else 0
    room = max(1, left - node_lines - 2)  # the rank table's head and rule
    if len(ranks) > room and room > 1:
        room -= 1  # a "more" line
    more = len(ranks) > room and left - node_lines - 2 - room >= 1
    narrow = (width or console().size.width) < 60
    metric = view.get("metric")
    cols = (["rank", "status", "step", "steps/s"] if narrow else
            ["rank", "host", "status", "step", "behind", "steps/s", "write"]) + ([metric] if metric else [])
    table = _table(cols, right=["rank", "step", "behind", "steps/s", "write", *([metric] if metric else [])],
                   keep=["host", "status"])
    table.columns[0].min_width = max([4, *(len(str(r["rank"])) for r in ranks[:room])])
    for r in ranks[:room]:
        row = {"rank": str(r["rank"]), "host": str(r.get("host") or "-")[:16], "status": _status(r["status"]),
               "step": fmt_num(r["step"]), "behind": fmt_num(r["behind"]),
               "steps/s": fmt_num(r["steps_per_s"], 3), "write": _age(r["last_write_age"])}
        if metric:
            row[metric] = fmt_num(r.get("metric"))[:12]
        table.add_row(*(row[c] for c in cols))
    parts.append(table)
    if more:
        hidden = [r["rank"] for r in ranks[room:] if r.get("incident") or r["status"] == "crashed"]
        line = Text(f"... {len(ranks) - room} more ranks", style="dim")
        line.append(f"; also with incidents: {_ranks_text(hidden)}" if hidden else " (healthiest last)")
        parts.append(_line(line))
    if node_rows:
        nt = _table(["node", "ranks", "live", "min step", "max behind", "slowest/s", "worst"],
                    right=["ranks", "live", "min step", "max behind", "slowest/s"], keep=["node", "worst"])
        for n in node_rows:
            nt.add_row(str(n["node"])[:16], str(n["ranks"]), str(n["live"]), fmt_num(n["min_step"]),
                       fmt_num(n["max_behind"]), fmt_num(n["slowest"], 3), _worst(n))
        parts.append(nt)
    return Group(*parts)


def _worst(node: Mapping[str, Any]) -> Any:
    """A node's worst: its worst incident's kind, else its worst status."""
    from rich.text import Text

    kind = node.get("incident")
    return Text(kind, style=KIND_STYLE.get(kind, "")) if kind else _status(node["worst"])


def frame_height() -> int:
    """Lines a frame may take: $LINES when set (also when piped), else the terminal's, else 40."""
    import os

    lines = os.environ.get("LINES", "")
    if lines.isdigit() and int(lines) > 0:
        return int(lines)
    out = console()
    return out.size.height if out.is_terminal else 40


def top_print(view: Mapping[str, Any], agg: str = "worst") -> None:
    """One frame on stdout (`expr top --once`), in the terminal's height."""
    console().print(top_frame(view, frame_height(), agg))


def top_live(frames: Any, refresh: float, agg: str = "worst") -> None:
    """Redraw `frames()` (a view) every `refresh` seconds until Ctrl-C."""
    import time

    from rich.live import Live

    out = console()
    with Live(console=out, auto_refresh=False, screen=False, transient=False) as live:
        try:
            while True:
                live.update(top_frame(frames(), out.size.height - 1, agg, out.size.width),
                            refresh=True)
                time.sleep(refresh)
        except KeyboardInterrupt:
            # the last frame stays as drawn: `Live.stop` would draw it again, from where
            # the terminal's "^C" echo left the cursor (a line lower when it wrapped: the
            # header twice, issue 54)
            live.refresh = lambda: None  # type: ignore[method-assign]
            raise


def age_now(t: float | None) -> float | None:
    """Seconds since `t` (relative to `$EXPR_NOW` in tests)."""
    return None if t is None else max(0.0, now() - t)


STORY_LINES = 8  # incidents a story tells in text (`--json` has `limit` of them, and counts)


def story_lines(story: Mapping[str, Any], indent: str = "  ") -> list[Any]:
    """A run's story (`expr_tracker.health.story`) as lines of text: a count of its
    incidents by kind and of the pages sent, then the incidents, worst first."""
    from rich.text import Text

    from expr_tracker.health.story import told

    if not story:
        return []
    n, pages = story["count"], story["pages"]
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(story["by_kind"].items(), key=lambda kv: -kv[1]))
    head = (f"{indent}incidents: {n:,} ({kinds}), {story['open']:,} open; "
            f"{pages['sent']:,} page{'s' if pages['sent'] != 1 else ''} sent, "
            f"{pages['recoveries']:,} recover{'ies' if pages['recoveries'] != 1 else 'y'}")
    out = [Text(head, style="bold")]
    for e in story["incidents"][:STORY_LINES]:
        style = "dim" if e["state"] == "resolved" else KIND_STYLE.get(e["kind"], "bold")
        line = Text(f"{indent}  ")
        line.append(told(e), style=style)
        out.append(line)
    if n > STORY_LINES:
        out.append(Text(f"{indent}  ... and {n - STORY_LINES:,} more (--json)", style="dim"))
    return out


def health_pages(pages: Sequence[Mapping[str, Any]], label: str) -> None:
    """`expr alerts`: the health pages the watchers sent (an incident's, its recovery's)."""
    from rich.text import Text

    from . import fmt_time, prose

    out = console()
    prose(out, Text(f"health pages of {label}", style="bold"))
    for p in pages:
        line = Text(f"{fmt_time(p.get('time'))[5:]}  ", style="dim")
        what = "recovered" if p["state"] == "resolved" else "paged"
        line.append(f"{p['kind']} {what}", style="green" if what == "recovered"
                    else KIND_STYLE.get(str(p["kind"]), "bold"))
        line.append(f" rank{'s' if p['ranks_count'] != 1 else ''} {_ranks_text(p['ranks'])}")
        if p.get("step") is not None:
            line.append(f" step {p['step']}", style="dim")
        line.append(f": {p.get('detail') or ''}")
        prose(out, line)
