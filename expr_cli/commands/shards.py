"""`expr shards RUN`: the shards of a run, and the read-only shard inspection `runs` shares.

A run of a few shards prints a row per shard. A big one (DESIGN 14) prints a summary by
status and by node (worst nodes first) and the shards that need attention: crashed,
behind the frontier, slow (`step_time` an outlier), a sidecar that needs repair or a
torn tail; `--all` prints every row. Each shard is read once: its sidecar and a few KiB
of its tail, by the live state's pass, whose reads the rows reuse (`inspect_tail`).

Nothing here writes: a torn tail or a sidecar that disagrees with its shard is
reported, and left for the next writer to repair (DESIGN 5).
"""

from __future__ import annotations

from typing import Any

import typer

from expr_cli.data.runs import inspect_shard, inspect_tail
from expr_cli.resolve import (
    DIR_OPT,
    JSON_OPT,
    RUN_ARG,
    ShardRef,
    list_shards,
    resolve_run,
    root_dir,
)
from expr_tracker.store.records import is_sample

ALL_ROWS_UP_TO = 32  # shards listed one per row without --all
BEHIND_STEPS = 100  # DESIGN 13: `behind` from this many steps short of the frontier


_JSON_DROP = ("stream_text",)


def inspect_run(found: list[ShardRef], run_path: Any) -> list[dict[str, Any]]:
    """Every shard's row, with its node, behind count and what needs attention."""
    from expr_tracker.gcpause import paused_gc

    with paused_gc():  # (a record per line read, no cycles: `gcpause`)
        return _inspect_run(found, run_path)


def _inspect_run(found: list[ShardRef], run_path: Any) -> list[dict[str, Any]]:
    from expr_cli.layout import Nodes
    from expr_tracker.health.state import RunReader

    streams = sorted({s.stream for s in found}, key=lambda x: x or "")
    readers = {st: RunReader(run_path, st, window=4) for st in streams}
    states = {st: reader.read() for st, reader in readers.items()}
    names = {st: frozenset(reader.names) for st, reader in readers.items()}

    def row(s: ShardRef) -> dict[str, Any]:
        # what the state's pass read of the shard, else the shard read again
        reader, last = readers[s.stream], _known_last(states[s.stream], s.rank)
        tail = reader.tail(s.rank)
        if tail is not None and tail.path == s.path:
            return inspect_tail(s, tail, names[s.stream], last)
        return inspect_shard(s, last)

    rows = [row(s) for s in found]  # (threads cost more than the few reads left)
    from expr_tracker.health.watch import open_incidents

    incs = open_incidents(run_path)
    lost = {r for i in incs if i.kind == "lost" for r in i.ranks}
    silent = {r for i in incs if i.kind == "silent" for r in i.ranks}  # the job was killed
    for stream, state in states.items():
        mine = [r for r in rows if r["stream"] == stream]
        world = max([state.world_size or 0, *(r["rank"] + 1 for r in mine)])
        nodes = Nodes.of(state, world)
        front = state.frontier
        slow = _slow_ranks(state)
        for row in mine:
            rs = state.ranks.get(row["rank"])
            row["node"] = nodes.label(row["rank"])
            if rs is not None and rs.status == "crashed" and row["status"] in ("running", None):
                row["status"] = "stale"  # the writer is gone without a finish
            if row["status"] == "running" and stream is None and row["rank"] in lost:
                row["status"] = "lost"  # its node is (incidents.jsonl)
            elif row["status"] == "running" and stream is None and row["rank"] in silent:
                row["status"] = "silent"  # as `expr top` says

            row["exit"] = rs.exit if rs is not None else None
            recs = state.rank_records.get(row["rank"])
            # the world size this rank's latest rank record names (vs the sidecar's), not
            # counting the SDK's system samples (they carry the sidecar's own)
            row["records_world_size"] = next(
                (r.get("_world_size") for r in reversed(recs or ()) if not is_sample(r)), None)
            last = row["last_step"]
            row["behind"] = front - last if front is not None and last is not None else None
            row["attention"] = _attention(row, slow.get(row["rank"]))
    return rows


def _world_mismatch(rows: list[dict[str, Any]]) -> str | None:
    """A warning when the shards' sidecars and their rank records disagree on the world
    size (see `layout.sidecar_world_warning`)."""
    from expr_cli.layout import sidecar_world_warning

    side = {r["rank"]: r["world_size"] for r in rows if type(r.get("world_size")) is int}
    recs = {r["rank"]: r["records_world_size"] for r in rows
            if type(r.get("records_world_size")) is int}
    world = max([*side.values(), *recs.values()], default=0)
    return sidecar_world_warning(side, recs, world)


def _known_last(state: Any, rank: int) -> Any:
    rs = state.ranks.get(rank)
    return rs.last_step if rs is not None else False


def _slow_ranks(state: Any) -> dict[int, float]:
    """rank -> its latest `step_time` as a multiple of the median, for outlier ranks."""
    from expr_tracker.stats.reduce import outliers

    values = {}
    for r, recs in state.rank_records.items():
        for rec in reversed(recs):
            v = rec.get("step_time")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values[r] = float(v)
                break
    return {o.rank: o.ratio for o in outliers(values, flagged_only=True) if o.ratio and o.ratio > 1}


def _attention(row: dict[str, Any], slow: float | None) -> list[str]:
    """Why a shard needs a look (empty: it does not)."""
    why = []
    if row["status"] == "crashed":
        ex = row.get("exit")
        why.append(f"crashed: {ex.get('type')}: {ex.get('message')}" if ex else "crashed")
    elif row["status"] == "stale":
        why.append("stale: its process is gone without a finish")
    if row.get("dropped"):
        why.append(row["dropped"])
    if row["behind"] is not None and row["behind"] >= BEHIND_STEPS:
        why.append(f"behind {row['behind']:,} steps")
    if slow is not None:
        why.append(f"slow: step_time {slow:.2f}x median")
    if row["sidecar"] == "corrupt sidecar":
        why.append("corrupt sidecar: not a JSON object (status unknown)")
    elif row["sidecar"] not in ("ok", "behind"):
        why.append(f"sidecar {row['sidecar']}")
    return why


def shards_command(
    run: str,
    dir: str | None,
    as_json: bool,
    show_all: bool = False,
) -> None:
    """List the shards of RUN."""
    from expr_cli import render
    from expr_cli.errors import CLIError

    ref = resolve_run(run, root_dir(dir))
    found = list_shards(ref)
    if not found:
        raise CLIError(f"run {ref.label} is empty: no metrics*.jsonl shards in {ref.path}")
    rows = inspect_run(found, ref.path)
    if mismatch := _world_mismatch(rows):
        render.warning(mismatch)
    if as_json:
        render.print_json([{k: v for k, v in r.items() if k not in _JSON_DROP} for r in rows])
        return
    from expr_cli.render import shards as render_shards

    if show_all or len(rows) <= ALL_ROWS_UP_TO:
        render_shards.table(rows, ref.label)
    else:
        render_shards.overview(rows, ref.label)


def register(app: typer.Typer) -> None:
    """Add `expr shards`."""
    all_opt = typer.Option(False, "--all", help="A row for every shard, however many.")

    @app.command(
        "shards",
        epilog="Example: expr shards sft-1 (or expr shards my-project/sft-1 --json)",
    )
    def shards(run: str = RUN_ARG, dir: str | None = DIR_OPT, json: bool = JSON_OPT,
               all: bool = all_opt) -> None:
        """The shards of RUN: a row each, or, for many, a summary by status and node and
        the shards that need attention (--all for every row).

        The sidecar column compares the sidecar's cursor with the file (ok, behind while
        running, needs repair, torn tail, missing, corrupt sidecar: the status is then
        `corrupt`). Attention: crashed or stale, 100+
        steps behind the frontier, slow (step_time an outlier), sidecar trouble. Nothing
        is modified.
        """
        shards_command(run, dir, json, all)
