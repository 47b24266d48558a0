"""How `expr shards` prints a run of many shards: counts by status, nodes worst first, the
shards that need attention. A render module (rich lazily, as in `render`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from expr_cli.resolve import compact_ranks

from . import _show, _status, _table, console, fmt_age, fmt_bytes, fmt_num, prose

NODE_ROWS = 10  # nodes listed, worst first
ATTENTION_ROWS = 20  # shards needing attention listed; the rest are counted
_ORDER = {"crashed": 0, "stale": 1, "corrupt": 1, "running": 2, "finished": 3}


def _node_badness(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, int]:
    attention = sum(bool(r["attention"]) for r in rows)
    crashed = sum(r["status"] in ("crashed", "stale") for r in rows)
    return (-crashed, -attention, rows[0]["rank"])


def overview(rows: Sequence[Mapping[str, Any]], label: str) -> None:
    """Counts by status; a table of the worst nodes; the shards that need attention."""
    from rich.text import Text

    out = console()
    by_status: dict[str, int] = {}
    for r in rows:
        key = r["status"] or "no sidecar"
        by_status[key] = by_status.get(key, 0) + 1
    nodes: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        nodes.setdefault(r["node"], []).append(r)
    head = Text(f"shards of {label}", style="bold")
    head.append(f": {len(rows):,} shards on {len(nodes):,} nodes · ")
    head.append(", ".join(f"{n:,} {s}" for s, n in sorted(by_status.items(),
                                                          key=lambda kv: _ORDER.get(kv[0], 9))))
    steps = [r["last_step"] for r in rows if r["last_step"] is not None]
    if steps:
        head.append(f" · last steps {min(steps)}..{max(steps)}")
    prose(out, head)

    # the nodes with a crashed, stale or otherwise notable shard; the healthy ones in a line
    troubled = [n for n in nodes if any(r["attention"] for r in nodes[n])]
    worst = sorted(troubled, key=lambda n: _node_badness(nodes[n]))[:NODE_ROWS]
    table = _table(["node", "ranks", "run", "fin", "crash", "last step", "last write"],
                   right=["run", "fin", "crash", "last step"], keep=["node", "last write"])
    for name in worst:
        mine = nodes[name]
        count = {s: sum(r["status"] == s for r in mine) for s in ("running", "finished")}
        bad = sum(r["status"] in ("crashed", "stale") for r in mine)
        last = [r["last_step"] for r in mine if r["last_step"] is not None]
        span = "-" if not last else (str(min(last)) if min(last) == max(last)
                                     else f"{min(last)}..{max(last)}")
        oldest = min((r["last_write"] for r in mine), default=None)
        table.add_row(name, compact_ranks([r["rank"] for r in mine]), str(count["running"]),
                      str(count["finished"]), Text(str(bad), style="bold red" if bad else ""),
                      span, fmt_age(oldest))
    out.print()
    if worst:
        more = len(troubled) - len(worst)
        title = "nodes with trouble, worst first" + (f" ({more:,} more)" if more else "")
        _show(out, title, table)
    healthy = [n for n in nodes if n not in set(troubled)]
    if healthy:
        mine = [r for n in healthy for r in nodes[n]]
        per = {len(nodes[n]) for n in healthy}
        last = [r["last_step"] for r in mine if r["last_step"] is not None]
        span = "" if not last else (f", last step {min(last)}" if min(last) == max(last)
                                    else f", last steps {min(last)}..{max(last)}")
        size = f"{per.pop()} shards each" if len(per) == 1 else "shards"
        prose(out, Text(f"{len(healthy):,} node{'s' if len(healthy) != 1 else ''} without trouble "
                        f"({size}{span})", style="green"))

    need = sorted((r for r in rows if r["attention"]),
                  key=lambda r: (_ORDER.get(r["status"] or "", 9), -(r["behind"] or 0), r["rank"]))
    out.print()
    if not need:
        out.print(Text("no shard needs attention", style="green"))
        return
    att = _table(["rank", "node", "status", "step", "why"], right=["rank", "step"],
                 keep=["node", "status"])
    for r in need[:ATTENTION_ROWS]:
        att.add_row(str(r["rank"]), r["node"], _status(r["status"]), fmt_num(r["last_step"]),
                    "; ".join(r["attention"]))
    _show(out, f"{len(need):,} shard{'s' if len(need) != 1 else ''} need attention", att,
          style="bold yellow")
    if len(need) > ATTENTION_ROWS:
        more = compact_ranks(sorted(r["rank"] for r in need[ATTENTION_ROWS:]))
        prose(out, Text(f"  ... and {len(need) - ATTENTION_ROWS:,} more: ranks {more} (--all)",
                        style="dim"))


def table(rows: Sequence[Mapping[str, Any]], label: str) -> None:
    """`expr shards`: a row per shard file."""
    from rich.text import Text

    out = console()
    cells = [[str(r["rank"]), r["stream_text"], r["file"], str(r["rows"]), fmt_num(r["last_step"]),
              fmt_bytes(r["size"]), r["status"] or "-", fmt_age(r["last_write"]), r["sidecar"]]
             for r in rows]
    headers = ["rank", "stream", "file", "rows", "step", "size", "status", "written", "sidecar"]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]
    # every column stays whole but the sidecar's note, which folds; the stream column only
    # for a run with a stream besides the default (as `expr runs`), and on a narrow
    # terminal it goes first (the file name says the stream too)
    narrow = sum(widths[:-1]) + 2 * len(widths) + 8 > out.width
    one = all(r["stream"] is None for r in rows)
    drop = {"stream"} if narrow or one else set()
    shown = [h for h in headers if h not in drop]
    table = _table(shown, right=["rank", "rows", "step", "size"], keep=shown[:-1])
    table.columns[-1].overflow = "fold"
    for r, c in zip(rows, cells, strict=True):
        c[6] = _status(r["status"], r.get("last_step_at"), r["last_write"])
        c[8] = Text(r["sidecar"], style="green" if r["sidecar"] == "ok" else "yellow")
        table.add_row(*(v for h, v in zip(headers, c, strict=True) if h not in drop))
    _show(out, f"shards of {label}", table)
    for r in rows:
        if r.get("dropped"):  # rows that never reached the shard (a full spool disk)
            prose(out, Text(f"rank {r['rank']}: {r['dropped']}", style="bold yellow"))
