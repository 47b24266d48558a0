"""What `expr summary` reads: the live state and the shards' tails (DESIGN 13, 14).

By default the window ends at the frontier (`health.state`); only each shard's tail for
that window is read (`store.window`), as columns (`stats.scan`) in worker processes
(`stats.parallel`), falling back to `reduce.collect` for irregular shards. Keys logged
with `et.log` come from the shards' step rows the same way (`load_row_table`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from expr_tracker.store.records import is_sample

from .resolve import ShardRef

if TYPE_CHECKING:
    from expr_tracker.health.state import RunState
    from expr_tracker.stats.reduce import RankTable
    from expr_tracker.stats.scan import ColumnTable

    Table = RankTable | ColumnTable

COVERAGE_STEPS = 50  # how far back the coverage block looks (and the default window read)
RECENT = COVERAGE_STEPS + 16  # steps of each shard's tail read before the frontier is known
_BLOCK = 4 << 20
_TAIL_GUESS = 256  # bytes a step of one rank takes in a shard, to size the parallel read


def _window_bytes(shards: list[ShardRef], lo: int | None) -> int | None:
    """About the bytes the shards' default window holds from step `lo` on, whether worth
    reading in worker processes (None for whole shards: their sizes tell)."""
    return None if lo is None else len(shards) * COVERAGE_STEPS * _TAIL_GUESS


def iter_rank_records(shards: list[ShardRef], garbage: dict[str, int],
                      lo: int | None = None) -> Iterator[dict[str, Any]]:
    """Rank records of `shards` in file order (from about step `lo` on); lines that do not
    parse are counted in `garbage`.

    The same line parser as the columnar scan (`scan.parse_rank_lines`); what it returns
    beside rank records, `collect` drops by `_kind`.
    """
    from expr_tracker.stats.scan import parse_rank_lines
    from expr_tracker.store import records
    from expr_tracker.store.safedir import open_read
    from expr_tracker.store.window import window_start

    for shard in shards:
        bad = 0
        with open_read(shard.path) as fh:
            start = window_start(fh, lo) if lo is not None else 0
            for _, data in records.complete_blocks(fh, _BLOCK, start):
                recs, n_bad = parse_rank_lines(data)
                bad += n_bad
                yield from recs
        if bad:
            garbage[shard.path.name] = bad


def load_table(
    shards: list[ShardRef], lo: int | None = None, scans: list[Any] | None = None
) -> tuple[Table, dict[str, int], dict[int, int]]:
    """The rank records of `shards` (from about step `lo` on) as a table, the unparseable
    lines per file name, and each rank's `_world_size` (the largest its records name).

    Regular shards (see `expr_tracker.stats.scan`) are read as columns: a `ColumnTable` when
    every rank sits in one shard, else a `RankTable` built from the columns. Otherwise
    every record goes through `reduce.collect`. `scans` are the shards' scans when the
    caller has them already.
    """
    from expr_tracker.stats import parallel, scan
    from expr_tracker.stats.reduce import collect

    if scans is None:
        scans = parallel.scan_shards([s.path for s in shards], lo, _window_bytes(shards, lo))
    garbage = {s.path.name: sc.garbage for s, sc in zip(shards, scans, strict=True) if sc.garbage}
    blocks = [b for sc in scans for b in sc.blocks or ()]
    if all(sc.blocks is not None for sc in scans):
        worlds: dict[int, int] = {}
        for b in blocks:
            if b.world:
                worlds[b.rank] = max(worlds.get(b.rank, 0), b.world)
        if len({b.rank for b in blocks}) == len(blocks):
            return scan.ColumnTable(blocks), garbage, worlds
        return scan.rank_table(blocks), garbage, worlds
    del blocks, scans
    garbage = {}
    worlds = {}

    def noting(recs: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for rec in recs:
            r, ws = rec.get("_rank"), rec.get("_world_size")
            # not the SDK's system samples: they carry the launcher's world size (the
            # sidecars'), which would hide a world size the user's records deny
            if type(r) is int and type(ws) is int and ws > worlds.get(r, 0) and not is_sample(rec):
                worlds[r] = ws
            yield rec

    return collect(noting(iter_rank_records(shards, garbage, lo))), garbage, worlds


def load_row_table(
    shards: list[ShardRef], keys: set[str], lo: int | None, world: int
) -> tuple[Table, dict[str, int]]:
    """The numeric `keys` of each shard's step rows (ordinary `et.log` metrics) from about
    step `lo` on, as a table of that shard's rank (issue 11: `--metric loss`): columns
    where the rows are regular (`steprows.row_columns`)."""
    from expr_tracker.stats.steprows import row_columns

    return row_columns([(s.path, s.rank) for s in shards], keys, lo, world,
                       _window_bytes(shards, lo))


def load_span_table(
    shards: list[ShardRef], lo: int | None, world: int, prefix: str
) -> tuple[RankTable, dict[str, int]]:
    """`load_row_table` of every key starting with `prefix` (`--spans`: `time_ms/`)."""
    from expr_tracker.stats.steprows import row_table

    return row_table([(s.path, s.rank) for s in shards], set(), lo, world, prefix,
                     _window_bytes(shards, lo))


def last_rows(shards: list[ShardRef], garbage: dict[str, int]) -> list[dict[str, Any]]:
    """Each shard's last step row (the fallback view of a run without rank records)."""
    from expr_tracker.store.reader import ShardReader

    out = []
    for shard in shards:
        reader = ShardReader(shard.path)
        row = next((r for r in reader.iter_reverse() if r.get("_kind") is None), None)
        if reader.garbage:
            garbage[shard.path.name] = reader.garbage
        if row is not None:
            values = {k: v for k, v in row.items() if not k.startswith("_")}
            out.append({"file": shard.path.name, "rank": shard.rank, "step": row.get("_step"),
                        "time": row.get("_time"), "values": values})
    return out


SAMPLED_SHARDS = 8  # shards whose last step row names a run's keys (ranks log the same keys)
_SPAN_PREFIXES = ("time_ms/", "count/")


def step_row_keys(shards: list[ShardRef]) -> tuple[list[str], list[str]]:
    """The numeric keys of the last step rows of the first few shards, in the order
    logged: the metrics a run that logs with `et.log` only reduces across its ranks; and,
    apart, the span keys among them (`expr summary --spans` reduces those)."""
    keys: dict[str, None] = {}
    spans: dict[str, None] = {}
    for row in last_rows(shards[:SAMPLED_SHARDS], {}):
        for k, v in row["values"].items():
            if type(v) is int or type(v) is float:
                (spans if k.startswith(_SPAN_PREFIXES) else keys)[k] = None
    return list(keys), list(spans)


def start_scan(shards: list[ShardRef]) -> Any:
    """The default window's scan of `shards` (`read_window` with neither step nor
    window), started now in worker processes: a caller about to read the live state
    (`expr serve`'s first pass) has the tails scanned meanwhile, as `expr summary` does."""
    from expr_tracker.stats import parallel

    return parallel.ScanJob([s.path for s in shards], recent=RECENT,
                            expected_bytes=len(shards) * RECENT * _TAIL_GUESS)


def read_window(
    run_dir: Any, stream: str | None, shards: list[ShardRef], step: int | None,
    window: tuple[int | None, int | None] | None, state: RunState | None = None,
    job: Any = None,
) -> tuple[RunState, int | None, list[Any]]:
    """The run's live state (sidecars and a few tail lines per shard: status, host, last
    step, the frontier) and the scans of the shards' tails from step `lo` on.

    By default the window ends at the frontier, known only once the state is read: the
    tails are scanned meanwhile, in worker processes, for each shard's own last
    `RECENT` steps, and the few shards whose tail does not reach back to the window
    (ranks far ahead of the frontier) are read again. `state`: the live state when the
    caller keeps one (a `RunReader` between calls); else it is read here. `job`: the
    default window's scan of these shards, started already (`start_scan`).
    """
    from expr_tracker.gcpause import paused_gc

    with paused_gc():  # (millions of records, no cycles: `gcpause`)
        return _read_window(run_dir, stream, shards, step, window, state, job)


def _read_window(
    run_dir: Any, stream: str | None, shards: list[ShardRef], step: int | None,
    window: tuple[int | None, int | None] | None, state: RunState | None, job: Any,
) -> tuple[RunState, int | None, list[Any]]:
    from expr_tracker.health.state import read_run
    from expr_tracker.stats import parallel

    paths = [s.path for s in shards]
    expected = len(shards) * RECENT * _TAIL_GUESS
    if step is not None or window is not None:
        if state is None:
            state = read_run(run_dir, stream, window=2)
        lo = window_lo(step, window, state.frontier)
        return state, lo, parallel.ScanJob(paths, lo, expected_bytes=expected if lo else 1 << 62).result()
    if job is None and state is None:
        state, scans = _read_scanned(run_dir, stream, shards)
        return state, *_reach_window(state, paths, scans)
    if job is None:
        job = start_scan(shards)
    try:
        if state is None:
            state = read_run(run_dir, stream, window=2)
        scans = job.result()
    except BaseException:  # Ctrl-C while the workers read: stop them, not wait for them
        job.abandon()
        raise
    return state, *_reach_window(state, paths, scans)


def _reach_window(state: RunState, paths: list[Any], scans: list[Any]) -> tuple[
        int | None, list[Any]]:
    """The window's first step, and `scans` (each shard's own last `RECENT` steps) with
    those that do not reach back to it read again from it."""
    from expr_tracker.stats import scan

    lo = window_lo(None, None, state.frontier)
    if lo is not None:
        for i, sc in enumerate(scans):
            firsts = [b.steps[0] for b in sc.blocks or () if len(b.steps)]
            if firsts and min(firsts) > lo:
                scans[i] = scan.scan_shard(paths[i], lo)
    return lo, scans


def _read_scanned(run_dir: Any, stream: str | None, shards: list[ShardRef]) -> tuple[
        RunState, list[Any]]:
    """The live state (window 2) and each shard's last `RECENT` steps scanned, from one
    read of each shard's tail (`tail.read_scanned`; many shards in worker processes)."""
    from functools import partial

    from expr_tracker.health.state import RunReader, share_reads
    from expr_tracker.health.tail import ShardTail, read_scanned
    from expr_tracker.stats import scan

    scanned: dict[int, Any] = {}

    def first_reads(fresh: list[ShardTail]) -> Iterator[list[ShardTail]]:
        for pairs in share_reads(partial(read_scanned, recent=RECENT), fresh):
            scanned.update((t.rank, sc) for t, sc in pairs)
            yield [t for t, _ in pairs]

    reader = RunReader(run_dir, stream, window=2)
    reader.first_reads = first_reads
    reader.listed = {s.rank: s.path for s in shards if s.stream == stream}
    state = reader.read()
    # (by rank: a shard's name says its rank, and the reader lists the same directory)
    scans = [sc if (sc := scanned.get(s.rank)) is not None else
             scan.scan_shard(s.path, recent=RECENT) for s in shards]
    return state, scans


def window_lo(step: int | None, window: tuple[int | None, int | None] | None,
               frontier: int | None) -> int | None:
    """From which step on the shards' tails are read (None: whole shards)."""
    if window is not None:
        return window[0]
    at = step if step is not None else frontier
    return None if at is None else max(0, at - COVERAGE_STEPS + 1)
