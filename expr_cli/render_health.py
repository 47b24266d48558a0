"""Rendering of `expr watch` and `expr top` (rich lives here and in render.py only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .render import _status, _table, console, fmt_num, jsonable, now

if TYPE_CHECKING:
    from rich.console import RenderableType

    from expr_tracker.health.incidents import Incident

KIND_STYLE = {"crashed": "bold red", "hang": "red", "missing": "red", "alert": "red",
              "straggler": "yellow", "slowdown": "yellow", "behind": "yellow"}


def _ranks_text(ranks: Sequence[int]) -> str:
    from .resolve import compact_ranks

    return compact_ranks(list(ranks))


def incident_text(inc: Mapping[str, Any]) -> Any:
    """One incident as a line of text: state, kind, ranks (and hosts), detail."""
    from rich.text import Text

    state = str(inc.get("state") or "open")
    kind = str(inc.get("kind"))
    line = Text()
    line.append("resolved " if state == "resolved" else "", style="green")
    line.append(kind, style="dim" if state == "resolved" else KIND_STYLE.get(kind, "bold"))
    ranks = inc.get("ranks") or []
    line.append(f" rank{'s' if len(ranks) != 1 else ''} {_ranks_text(ranks)}")
    hosts = inc.get("hosts") or []
    if hosts:
        line.append(f" on {', '.join(hosts[:3])}{' ...' if len(hosts) > 3 else ''}", style="dim")
    if inc.get("step") is not None:
        line.append(f" step {inc['step']}", style="dim")
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


def no_incidents(label: str) -> None:
    """`expr watch --once` found nothing open."""
    from rich.text import Text

    console(soft_wrap=True).print(Text(f"no open incidents in {label}", style="green"))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:.0f}s"


def top_frame(view: Mapping[str, Any], height: int) -> RenderableType:
    """`expr top`: a header, open incidents, the worst ranks, and a per-node summary."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = []
    ranks: list[Mapping[str, Any]] = view["ranks"]
    incidents: list[Mapping[str, Any]] = view["incidents"]
    head = Text(f"{view['run']}  ", style="bold")
    head.append(f"{len(ranks)} ranks, {view['live']} live  frontier {fmt_num(view['frontier'])}"
                f"  lead {fmt_num(view['lead'])}", style="")
    parts.append(head)
    shown_inc = incidents[: max(1, height // 4)]
    for inc in shown_inc:
        parts.append(incident_text(inc))
    if len(incidents) > len(shown_inc):
        parts.append(Text(f"... {len(incidents) - len(shown_inc)} more incidents", style="dim"))
    if not incidents:
        parts.append(Text("no open incidents", style="green"))
    nodes: list[Mapping[str, Any]] = view["nodes"]
    # lines left for ranks: the frame must fit the terminal (DESIGN 14)
    node_lines = min(len(nodes), 6) + 3 if len(nodes) > 1 else 0
    room = max(3, height - len(parts) - node_lines - 4)
    metric = view.get("metric")
    cols = ["rank", "host", "status", "step", "behind", "steps/s", "write", *([metric] if metric else [])]
    table = _table(cols, right=["rank", "step", "behind", "steps/s", "write", *([metric] if metric else [])])
    for r in ranks[:room]:
        row = [str(r["rank"]), str(r.get("host") or "-")[:16], _status(r["status"]),
               fmt_num(r["step"]), fmt_num(r["behind"]), fmt_num(r["steps_per_s"], 3),
               _age(r["last_write_age"])]
        if metric:
            row.append(fmt_num(r.get("metric")))
        table.add_row(*row)
    parts.append(table)
    if len(ranks) > room:
        parts.append(Text(f"... {len(ranks) - room} more ranks (healthiest last)", style="dim"))
    if len(nodes) > 1:
        nt = _table(["node", "ranks", "live", "min step", "max behind", "slowest/s", "worst"],
                    right=["ranks", "live", "min step", "max behind", "slowest/s"])
        for n in nodes[:6]:
            nt.add_row(str(n["node"])[:16], str(n["ranks"]), str(n["live"]), fmt_num(n["min_step"]),
                       fmt_num(n["max_behind"]), fmt_num(n["slowest"], 3), _status(n["worst"]))
        parts.append(nt)
        if len(nodes) > 6:
            parts.append(Text(f"... {len(nodes) - 6} more nodes", style="dim"))
    return Group(*parts)


def top_print(view: Mapping[str, Any]) -> None:
    """One frame on stdout (`expr top --once`)."""
    out = console()
    out.print(top_frame(view, out.size.height if out.is_terminal else 40))


def top_live(frames: Any, refresh: float) -> None:
    """Redraw `frames()` (a view) every `refresh` seconds until Ctrl-C."""
    import time

    from rich.live import Live

    out = console()
    with Live(console=out, auto_refresh=False, screen=False, transient=False) as live:
        while True:
            live.update(top_frame(frames(), out.size.height - 1), refresh=True)
            time.sleep(refresh)


def age_now(t: float | None) -> float | None:
    """Seconds since `t` (relative to `$EXPR_NOW` in tests)."""
    return None if t is None else max(0.0, now() - t)
