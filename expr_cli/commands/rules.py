"""`expr rules explain` and `expr rules test`: what a rule means, and where it fires in a run."""

from __future__ import annotations

import dataclasses
from typing import Any

import typer

from expr_cli.resolve import (
    DIR_OPT,
    JSON_OPT,
    RANK_OPT,
    RUN_ARG,
    STREAM_OPT,
    parse_rank,
    pick_shard,
    resolve_run,
    root_dir,
)
from expr_tracker.store.reader import ShardReader

TICK = 10.0  # seconds between time-rule evaluations, as a live run does by default
MAX_TICKS_PER_GAP = 100  # a day-long pause in a run must not cost millions of ticks


def explain_command(rule: str, as_json: bool) -> None:
    """Print the parsed rule."""
    from expr_cli import render
    from expr_tracker.alerts.rules import explain

    info = explain(rule)
    if as_json:
        render.print_json(info)
    else:
        render.rule_explain(info)


def replay(rule_text: str, records: list[dict[str, Any]], context: dict[str, Any]) -> list[dict[str, Any]]:
    """Feed `records` (in file order) through a RuleSet holding the rule; the firings as dicts.

    Time rules are evaluated between records every TICK seconds of recorded time, the
    way a live run evaluates them.
    """
    from expr_tracker.alerts.rules import RuleSet, parse_rule

    rules = RuleSet([parse_rule(rule_text)], context=context)
    firings = []
    prev: float | None = None
    for rec in records:
        t = rec.get("_time")
        t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else (prev or 0.0)
        if rules.has_time_rules and prev is not None:
            tick = prev + TICK
            for _ in range(MAX_TICKS_PER_GAP):
                if tick >= t:
                    break
                firings.extend(rules.tick(tick))
                tick += TICK
        step = rec.get("_step")
        firings.extend(rules.observe(rec, step if type(step) is int else None, t))
        prev = t
    return [dataclasses.asdict(f) for f in firings]


def test_command(rule: str, run: str, dir: str | None, rank: str | None, stream: str | None,
                 as_json: bool) -> None:
    """Replay `rule` over one shard of RUN and list its firings."""
    from expr_cli import render
    from expr_tracker.alerts.rules import parse_rule

    from .history import warn_garbage

    parse_rule(rule)  # a bad rule is reported before any file is read
    r = parse_rank(rank)
    assert not isinstance(r, str)
    ref = resolve_run(run, root_dir(dir))
    shard = pick_shard(ref, stream, r)
    reader = ShardReader(shard.path)
    records = reader.records()
    warn_garbage(reader)
    project, name = ref.label.split("/", 1)
    context = {"project": project, "name": name, "run": name, "stream": shard.stream,
               "rank": shard.rank, "world_size": None}
    fired = replay(rule, records, context)
    if as_json:
        render.print_json(fired)
        return
    steps = [s for s in (rec.get("_step") for rec in records) if type(s) is int]
    span = f"steps {min(steps)}..{max(steps)}" if steps else "no steps"
    where = f"{ref.label} {shard.path.name} ({len(records)} records, {span})"
    if not fired:
        render.note(f"the rule never fired over {where}")
        return
    n = sum(f["kind"] == "fire" for f in fired)
    render.rule_firings(fired, f"fired {n} time{'s' if n != 1 else ''} over {where}")


_RULE_ARG = typer.Argument(..., show_default=False, metavar="RULE", help="The rule text: CONDITION => LEVEL: MESSAGE.")


def register(app: typer.Typer) -> None:
    """Add the `expr rules` group."""
    rules = typer.Typer(
        name="rules",
        help="Check alert rules: explain how one parses, or replay it over a recorded run.",
        epilog="Example: expr rules explain 'loss > 2 and mean(loss[50]) > 1.5 => error'",
        no_args_is_help=True,
    )

    @rules.command(
        "explain",
        epilog="Example: expr rules explain 'isnan(loss) or loss > 10 => error: loss is {loss}'",
    )
    def explain(rule: str = _RULE_ARG, json: bool = JSON_OPT) -> None:
        """Print the rule's fully parenthesised condition, level, message, metrics and functions."""
        explain_command(rule, json)

    @rules.command(
        "test",
        epilog="Example: expr rules test 'grad_norm > 5 => warning' sft-1 --rank 3",
    )
    def test(
        rule: str = _RULE_ARG,
        run: str = RUN_ARG,
        rank: str | None = RANK_OPT,
        stream: str | None = STREAM_OPT,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Replay a rule over the recorded rows of one shard and list the steps where it fires.

        Step rows and rank records are fed in file order, with their recorded times, so
        windows, cooldowns and for_steps behave as they did live.
        """
        test_command(rule, run, dir, rank, stream, json)

    app.add_typer(rules)
