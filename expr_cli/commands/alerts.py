"""`expr alerts RUN`: what the rules (and `et.alert`) raised, by rank, delivered or
suppressed; and the health pages the watchers sent (an incident's, its recovery's)."""

from __future__ import annotations

import re
from typing import Any

import typer

from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG, RunRef, resolve_run, root_dir
from expr_tracker.store import records

_ALERTS_RE = re.compile(r"alerts(?:\.rank(\d+))?\.jsonl\Z")


def read_alerts(ref: RunRef) -> tuple[list[dict[str, Any]], int]:
    """Every alert of the run (all `alerts[.rankN].jsonl` files) in time order, and bad lines."""
    out: list[dict[str, Any]] = []
    bad = 0
    for path in sorted(ref.path.iterdir()):
        m = _ALERTS_RE.match(path.name)
        if not m or not path.is_file():
            continue
        file_rank = int(m.group(1) or 0)
        for _, line in records.iter_lines(path.read_bytes()):
            if not line.strip():
                continue
            try:
                alert = records.loads(line)
            except ValueError:
                bad += 1
                continue
            if type(alert.get("rank")) is not int:
                alert["rank"] = file_rank
            out.append(alert)
    out.sort(key=lambda a: (a["time"] if isinstance(a.get("time"), (int, float)) else 0.0, a["rank"]))
    return out, bad


def counts_by_rank(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: fired, delivered and suppressed (not the alerting rank) counts."""
    by: dict[int, dict[str, Any]] = {}
    for a in alerts:
        c = by.setdefault(a["rank"], {"rank": a["rank"], "fired": 0, "delivered": 0, "suppressed": 0})
        c["fired"] += 1
        c["delivered" if a.get("delivered") else "suppressed"] += 1
    return [by[r] for r in sorted(by)]


def group_alerts(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerts of one rule at one step, one entry whatever the number of ranks that
    raised it (a loss that goes NaN on 16,384 ranks is one line, not 16,384), in the
    order of their first: `alert` (the delivered one if any, else the first), `ranks`,
    `delivered` and `suppressed` counts. Alerts without a rule (`et.alert`) group only
    with the same text."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for a in alerts:
        rule = a.get("rule")
        key = (rule, a.get("title"), a.get("level"), a.get("kind"), a.get("step"),
               None if rule else a.get("text"))
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"alert": a, "ranks": [], "delivered": 0, "suppressed": 0}
        elif a.get("delivered") and not g["alert"].get("delivered"):
            g["alert"] = a
        g["ranks"].append(a["rank"])
        g["delivered" if a.get("delivered") else "suppressed"] += 1
    return list(groups.values())


def alerts_command(run: str, dir: str | None, rank: int | None, as_json: bool) -> None:
    """List the alerts of RUN."""
    from expr_cli import render
    from expr_cli.render import health as render_health
    from expr_tracker.health.story import pages

    ref = resolve_run(run, root_dir(dir))
    alerts, bad = read_alerts(ref)
    # the health watchers' pages (incidents.jsonl) beside the rules' alerts
    health = [p for p in pages(ref.path) if rank is None or rank in p["ranks"]]
    if bad:
        render.warning(f"skipped {bad} alert line{'s' if bad != 1 else ''} that did not parse")
    if rank is not None:
        alerts = [a for a in alerts if a["rank"] == rank]
    counts = counts_by_rank(alerts)
    if as_json:
        render.print_json({"run": ref.label, "alerts": alerts, "by_rank": counts,
                           "health": health})
    elif not alerts and not health:
        render.note(f"no alerts in {ref.label}" + (f" from rank {rank}" if rank is not None else ""))
    else:
        if alerts:
            render.alerts(group_alerts(alerts), counts, ref.label)
        if health:
            render_health.health_pages(health, ref.label)


_RANK_OPT = typer.Option(None, "--rank", "-r", min=0, show_default=False, metavar="RANK",
                         help="Only the alerts raised by this rank.")


def register(app: typer.Typer) -> None:
    """Add `expr alerts`."""

    @app.command("alerts", epilog="Example: expr alerts sft-1 --rank 3")
    def alerts(
        run: str = RUN_ARG, rank: int | None = _RANK_OPT, json: bool = JSON_OPT, dir: str | None = DIR_OPT
    ) -> None:
        """What fired in RUN, by rank: time, level, rule, step, delivered or suppressed.

        Only the alerting rank delivers; the other ranks record their alerts as suppressed.
        """
        alerts_command(run, dir, rank, json)
