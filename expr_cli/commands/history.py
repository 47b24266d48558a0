"""`expr history RUN`: the committed step rows of one shard, as a table, JSON or CSV."""

from __future__ import annotations

import sys
from enum import Enum
from typing import TYPE_CHECKING, Any

from expr_cli.errors import CLIError
from expr_cli.resolve import (
    DIR_FLAGS,
    JSON_FLAGS,
    METRICS_FLAGS,
    RANK_FLAGS,
    STREAM_FLAGS,
    FastOption,
    ShardRef,
    int_arg,
    parse_metrics,
    parse_rank,
    parse_step_range,
    pick_shard,
    resolve_run,
    root_dir,
    unknown_metrics,
)
from expr_tracker.store.reader import ShardReader, select_rows

if TYPE_CHECKING:
    import typer


class Format(str, Enum):
    """Output formats of `expr history`."""

    table = "table"
    json = "json"
    csv = "csv"


def metric_keys(rows: list[dict[str, Any]]) -> list[str]:
    """User keys in order of first appearance."""
    seen: dict[str, None] = {}
    for row in rows:
        for k in row:
            if not k.startswith("_"):
                seen.setdefault(k, None)
    return list(seen)


def shard_keys(shard: ShardRef) -> tuple[set[str], list[int], set[str]]:
    """Every metric key of the shard's step rows and their steps (sorted), and every
    metric key of its rank records, in one read."""
    keys: set[str] = set()
    steps: set[int] = set()
    rank_keys: set[str] = set()
    for _, rec in ShardReader(shard.path).iter_records():
        kind = rec.get("_kind")
        if kind == "rank":
            rank_keys.update(k for k in rec if not k.startswith("_"))
        elif kind is None:
            keys.update(k for k in rec if not k.startswith("_"))
            if type(rec.get("_step")) is int:
                steps.add(rec["_step"])
    return keys, sorted(steps), rank_keys


def warn_garbage(reader: ShardReader) -> None:
    """The one warning line for lines that did not parse."""
    if reader.garbage:
        from expr_cli import render

        n = reader.garbage
        render.warning(f"skipped {n} line{'s' if n != 1 else ''} of {reader.path} that did not parse")


def read_history(
    shard: ShardRef,
    n: int,
    metrics: list[str] | None,
    step_range: tuple[int | None, int | None] | None,
) -> list[dict[str, Any]]:
    """The rows to show; CLIError for an empty shard, unknown metrics or an empty step range."""
    if shard.path.stat().st_size == 0:
        raise CLIError(f"shard {shard.path} is empty")
    reader = ShardReader(shard.path)
    rows = select_rows(reader, None if n < 0 else n, metrics=metrics, step_range=step_range)
    warn_garbage(reader)
    missing = [m for m in metrics or () if all(m not in r for r in rows)]
    if rows and not missing:
        return rows
    keys, steps, rank_keys = shard_keys(shard)
    if metrics and any(m not in keys for m in metrics):
        ranked = [m for m in metrics if m not in keys and m in rank_keys]
        if ranked:
            m = ranked[0]
            what = f"{m} is a rank metric" if len(ranked) == 1 else f"{', '.join(ranked)} are rank metrics"
            raise CLIError(f"{what} (log_rank_metrics), not a key of the step rows history shows: "
                           f"expr summary RUN -m {m} (across ranks), expr plot RUN -m {m} (each "
                           "rank over the steps), expr export RUN --rank-records (every record)")
        raise unknown_metrics(metrics, keys)
    if rows:
        return rows
    if not steps:
        raise CLIError(f"shard {shard.path} has no step rows (rank records only? try expr summary)")
    if step_range is not None:
        lo, hi = step_range
        text = f"{'' if lo is None else lo}:{'' if hi is None else hi}"
        raise CLIError(
            f"no rows in steps {text}; {shard.path.name} has steps {steps[0]}..{steps[-1]}"
        )
    return rows


def history_command(
    run: str,
    dir: str | None,
    rank: str | None,
    stream: str | None,
    n: int,
    metrics: list[str] | None,
    step_range: str | None,
    fmt: Format,
    as_json: bool,
) -> None:
    """Print the last `n` step rows of one shard of RUN."""
    from expr_cli import render

    rng = parse_step_range(step_range)
    wanted = parse_metrics(metrics)
    r = parse_rank(rank)
    assert not isinstance(r, str)
    ref = resolve_run(run, root_dir(dir))
    shard = pick_shard(ref, stream, r)
    rows = read_history(shard, n, wanted, rng)
    columns = wanted or metric_keys(rows)
    if as_json or fmt is Format.json:
        render.print_json(rows)
    elif fmt is Format.csv:
        import csv

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(["_step", "_time", *columns])
        for row in rows:
            writer.writerow([render.jsonable(row.get(c, "")) for c in ("_step", "_time", *columns)])
        sys.stdout.flush()
    else:
        count = "all rows" if n < 0 else f"last {len(rows)} row{'s' if len(rows) != 1 else ''}"
        render.history(rows, columns, f"{ref.label}  {shard.path.name}  (rank {shard.rank}, {count})")


# `main` runs `expr history` without typer when it can parse the arguments with these
# (the root group checks that they match the typer options below)
FAST_ARGS = ("run",)
FAST_OPTIONS = (
    FastOption("rank", RANK_FLAGS),
    FastOption("stream", STREAM_FLAGS),
    FastOption("n", ("-n", "--rows"), int_arg, default=20),
    FastOption("metrics", METRICS_FLAGS, multiple=True),
    FastOption("step_range", ("--step-range",)),
    FastOption("fmt", ("--format", "-f"), Format, default=Format.table),
    FastOption("json", JSON_FLAGS, None, default=False),
    FastOption("dir", DIR_FLAGS),
)


def fast_run(v: dict[str, Any]) -> None:
    """`expr history` with arguments parsed by `resolve.parse_fast`."""
    history_command(v["run"], v["dir"], v["rank"], v["stream"], v["n"], v["metrics"],
                    v["step_range"], v["fmt"], v["json"])


def register(app: typer.Typer) -> None:
    """Add `expr history`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT, METRICS_OPT, RANK_OPT, RUN_ARG, STREAM_OPT

    rows_opt = typer.Option(20, "-n", "--rows", help="How many of the last rows; -1 for all.")
    range_opt = typer.Option(None, "--step-range", show_default=False, metavar="START:STOP",
                             help="Half-open step range START:STOP (either side optional).")
    format_opt = typer.Option(Format.table, "--format", "-f", help="table, json or csv.")

    @app.command(
        "history",
        epilog="Example: expr history sft-1 --rank 2 -n 50 --metrics train/loss,lr --step-range 100:200",
    )
    def history(
        run: str = RUN_ARG,
        rank: str | None = RANK_OPT,
        stream: str | None = STREAM_OPT,
        n: int = rows_opt,
        metrics: list[str] | None = METRICS_OPT,
        step_range: str | None = range_opt,
        fmt: Format = format_opt,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """The last rows of one shard of RUN: step, time and metric values.

        JSON and CSV keep full precision; the table shows 6 significant digits.
        """
        history_command(run, dir, rank, stream, n, metrics, step_range, fmt, json)
