"""The live state of one run, read cheaply from sidecars and shard tails (DESIGN 13, 14).

`read_run(run_dir)` answers, for every shard of one stream: who writes it (rank, host,
pid, world sizes), its status (`running`, `finished`, `crashed`; a `running` shard whose
writer process on this host is gone counts as `crashed`), its last step and last write
time, and its recent rows within a bounded tail window; and the run's **frontier**: the
latest step every live rank has reported.

A `RunReader` kept between calls (a watcher, `expr top`) reads each shard's tail once and
then only the complete lines appended since, so a pass over thousands of idle shards is a
`stat` per shard and per sidecar. What it derives per rank (the `RankState`, the rank
records merged by `_rank`) is kept too and rebuilt only for the shards whose size, mtime
or inode, or whose sidecar's, changed: a repeat pass costs the stats plus work in
proportion to what changed (`RunState.changed` names those ranks). Only the check that a
local writer's process is still alive runs for every local rank on every pass (once per
pid). Memory per shard is bounded by the window whatever the shard's size: at most
`window` step rows and `window` rank records per rank are kept, and a shard that grew by
more than `MAX_CATCHUP` bytes since the last pass is read from its tail again rather than
from the old offset.

Nothing here writes.
"""

from __future__ import annotations

import math
import os
import socket
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from expr_tracker.gcpause import paused_gc
from expr_tracker.health.clock import PassClock, Seen, heartbeat_host, mtime_on_our_clock
from expr_tracker.health.tail import MAX_CATCHUP as MAX_CATCHUP  # (re-exported)
from expr_tracker.health.tail import ShardTail, decoded, refresh_all
from expr_tracker.procs import pid_alive
from expr_tracker.store.cursor import dropped_text
from expr_tracker.store.layout import parse_shard_name

DEFAULT_WINDOW = 64  # step rows (and rank records per rank) kept per shard
# First reads of at least this many shards are shared among forked processes: parsing
# is CPU work under the GIL (threads made a warm-cache pass slower, not faster), and a
# tail read costs several times what sending its compact result back does
_FORK_MIN = 256
STATUSES = ("running", "finished", "crashed")


@dataclass
class RankState:
    """One shard (one rank of one stream) as read now. Rows are oldest first."""

    rank: int
    stream: str | None
    path: Path
    host: str | None = None
    pid: int | None = None  # the writing (training) process; in spool mode the SDK's, not exprd's
    status: str = "running"  # running | finished | crashed | corrupt (its sidecar)
    status_reason: str | None = None  # why: "exception", "process gone", ...
    spooled: bool = False  # written by exprd from a spool (its pid is the training process's)
    exit: dict[str, Any] | None = None  # the sidecar's {type, message, time} after a crash
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    session: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    last_step: int | None = None  # largest step of its step rows or of its own rank records
    # on the reader's clock (`health.clock`): when it saw the shard grow, its last step
    # rise, its sidecar change (a first pass dates them by mtimes on the filesystem's clock)
    last_write: float | None = None
    advanced: float | None = None
    sidecar_write: float | None = None
    probe: dict[str, Any] | None = None  # where its main thread is, while silent (DESIGN 13)
    dropped: str | None = None  # rows the SDK could not spool: "311 rows dropped, spool ..."
    # key -> where its shard first held a non-finite value of it (`store.nonfinite`)
    nonfinite: dict[str, Any] | None = None
    size: int = 0
    steps: Sequence[int] = ()  # the recent step rows' steps, oldest first ...
    times: Sequence[float] = ()  # ... and their `_time`s
    last_row: dict[str, Any] | None = None  # the latest step row (for `expr top -m KEY`)

    def __post_init__(self) -> None:
        if self.advanced is None:  # a state built by hand: it advanced when it last wrote
            self.advanced = self.last_write

    @property
    def wrote_at(self) -> float | None:
        """When its shard or sidecar was last written (the reader's clock), if known."""
        when = [t for t in (self.last_write, self.sidecar_write) if t is not None]
        return max(when) if when else None

    @property
    def step_times(self) -> list[tuple[int, float]]:
        """The recent step rows' (step, _time), oldest first (built on each call: the
        reader keeps them as arrays)."""
        return list(zip(self.steps, self.times, strict=True))

    @property
    def live(self) -> bool:
        """Still training: status running (a dead writer on this host is already `crashed`)."""
        return self.status == "running"

    def local_to(self, here: str) -> bool:
        """Running, by its sidecar, in a process of host `here` (whose pid can be checked)."""
        return self.status == "running" and self.host == here and self.pid is not None

    def gone(self) -> RankState:
        """A copy marked crashed because its writer process is gone."""
        return replace(self, status="crashed", status_reason="process gone")


@dataclass
class RunState:
    """Every shard of one stream of a run, and the rank records of the tail windows."""

    run_dir: Path
    stream: str | None
    ranks: dict[int, RankState]  # by rank, ascending
    rank_records: dict[int, list[dict[str, Any]]]  # by the records' own `_rank`, oldest first
    read_time: float  # wall clock when the pass started
    # read with `RunReader(series=KEY)`: rank_records holds one record per rank (the latest
    # value of each key) and `series` the KEY values of the window, oldest first
    series_key: str | None = None
    series: dict[int, Sequence[float]] = field(default_factory=dict)
    # the ranks whose shard or sidecar changed since the reader's previous pass (every
    # rank on a first pass); the RankStates of the others are the previous pass's objects
    changed: frozenset[int] = frozenset()
    # by `_rank`: its latest system-metrics sample (DESIGN 19), `system/*` keys and `_step`
    system: dict[int, dict[str, Any]] = field(default_factory=dict)
    # exprd heartbeats in the run directory: safe host name (`clock.safe_host`) -> when the
    # reader saw it touched last (the reader's clock)
    heartbeats: dict[str, float] = field(default_factory=dict)
    # the filesystem's clock minus the reader's: a time printed for a person is the files'
    # (what `ls -l` shows), not that of a login node whose clock is off
    fs_offset: float = 0.0

    # computed once per pass: the detectors ask for them per rank
    @cached_property
    def world_size(self) -> int | None:
        """The largest world size any sidecar or rank record names (None if none does)."""
        # sets first: 16,384 ranks name a handful of distinct sizes
        sizes = [ws for ws in {r.world_size for r in self.ranks.values()} if ws]
        logged = {recs[-1].get("_world_size") for recs in self.rank_records.values() if recs}
        sizes += [ws for ws in logged if type(ws) is int and ws > 0]
        return max(sizes) if sizes else None

    @cached_property
    def live(self) -> list[RankState]:
        """The live ranks (status running), ascending."""
        return [r for r in self.ranks.values() if r.status == "running"]  # (`RankState.live`)

    @cached_property
    def frontier(self) -> int | None:
        """The latest step every live rank has reported (DESIGN 13).

        Finished and crashed ranks are not live and do not hold it back; nor does a live
        rank that has reported no step yet (it is behind, not a bound on the others). With
        no live rank left, the run is over and the frontier is the latest step of any rank.
        None when no rank has reported a step.
        """
        live = [r.last_step for r in self.live if r.last_step is not None]
        if live:
            return min(live)
        steps = [r.last_step for r in self.ranks.values() if r.last_step is not None]
        return max(steps) if steps else None

    @cached_property
    def lead(self) -> int | None:
        """The latest step any live rank has reported (any rank once none is live)."""
        steps = [r.last_step for r in self.live if r.last_step is not None]
        if not steps:
            steps = [r.last_step for r in self.ranks.values() if r.last_step is not None]
        return max(steps) if steps else None

    def behind(self, rank: int) -> int | None:
        """How many steps `rank` is short of the lead (0 for the leaders; None if unknown).

        The frontier is the slowest live rank, so nobody is behind *it*: a rank is behind
        the ranks ahead of it (DESIGN 13's `behind` detector counts from the lead).
        """
        lead = self.lead
        state = self.ranks.get(rank)
        if lead is None or state is None or state.last_step is None:
            return None
        return max(0, lead - state.last_step)


def quiet_since(rs: RankState) -> float | None:
    """When, on the reader's clock, a rank whose sidecar holds a probe went quiet; None
    when it has no probe, or when a step row was logged after the probe's `since`.

    A silent rank's shard still grows: its tracker thread writes system-metrics samples
    and commits an open row after `idle_timeout` (dated when it was logged). Neither is
    the training loop's activity, and counted as writes they would hide every hang and
    resolve a stall at each sample. The probe says how long the loop has been quiet on
    the rank's own clock (`time - since`, a difference of two of its own times), counted
    back from when the reader saw the sidecar that holds it.
    """
    probe, seen = rs.probe, rs.sidecar_write
    if probe is None or seen is None:
        return None
    since, at = probe.get("since"), probe.get("time")
    if not (since.__class__ in (int, float) and at.__class__ in (int, float)):
        return None
    if rs.times and rs.times[-1] > since:
        return None  # logged after it went quiet: the probe is about to be taken away
    return seen - max(0.0, at - since)


def _rank_state(tail: ShardTail) -> RankState:
    """One shard as a RankState from its files alone (no check of the writer's pid)."""
    meta = tail.sidecar or {}
    out = RankState(
        rank=tail.rank,
        stream=tail.stream,
        path=tail.path,
        last_step=tail.last_step,
        size=tail.size,
        steps=tail.steps,
        times=tail.times,
        last_row=decoded(tail.last_row),
    )
    # spool mode: exprd writes the shard, the sidecar names the training process as origin
    spool = meta.get("source") == "spool"
    host = meta.get("origin_host" if spool else "host")
    pid = meta.get("origin_pid" if spool else "pid")
    out.host = host if isinstance(host, str) else None
    out.pid = pid if type(pid) is int and pid > 0 else None
    out.spooled = spool
    out.world_size = _int(meta.get("world_size"))
    out.local_rank = _int(meta.get("local_rank"), zero=True)
    out.local_world_size = _int(meta.get("local_world_size"))
    session = meta.get("session")
    out.session = session if isinstance(session, str) else None
    out.start_time = _num(meta.get("start_time"))
    out.end_time = _num(meta.get("end_time"))
    ex = meta.get("exit")
    out.exit = dict(ex) if isinstance(ex, Mapping) else None
    probe = meta.get("probe")
    out.probe = dict(probe) if isinstance(probe, Mapping) else None
    out.dropped = dropped_text(meta.get("dropped"))
    notes = meta.get("nonfinite")
    out.nonfinite = dict(notes) if isinstance(notes, Mapping) and notes else None
    status = meta.get("status")
    out.status = status if status in STATUSES else "running"
    if out.status == "crashed":
        out.status_reason = "exception" if out.exit else "crashed"
    if tail.sidecar_corrupt:
        # not "running" on no evidence: whether it still trains is unknown (and a live
        # writer rewrites its sidecar within seconds)
        out.status, out.status_reason = "corrupt", "corrupt sidecar"
    return out


def _within(t: float | None, lo: float | None, hi: float) -> float:
    """`t` brought into [lo, hi] (`hi` when it is unknown)."""
    if t is None:
        return hi
    return min(hi, t if lo is None else max(lo, t))


def _int(value: Any, zero: bool = False) -> int | None:
    ok = type(value) is int and (value >= 0 if zero else value > 0)
    return value if ok else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def list_shards(run_dir: str | os.PathLike[str], stream: str | None = None) -> dict[int, Path]:
    """The shard files of one stream of a run, by rank (no sidecar is read)."""
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return out
    for entry in entries:
        parsed = parse_shard_name(entry.name)
        if parsed is not None and parsed.stream == stream:
            out[parsed.rank] = Path(entry.path)
    return out


_UNPARSED = object()
# Creating, removing or renaming a file in a directory sets its mtime, and sidecars are
# rewritten by a rename (`write_atomic`): while the run directory's mtime and inode stay
# as they were, its listing and every sidecar are too, and a pass `stat`s only the shards.
# Trusted only when the listing was taken DIR_SETTLE seconds after that mtime (a change
# in the same timestamp tick would not move it), and a full pass (listing, every sidecar)
# runs every FULL_EVERY seconds anyway, for a writer that rewrites a sidecar in place.
DIR_SETTLE = 2.0
FULL_EVERY = 30.0
# With a kernel watch on the directory (`watch_changes`), a pass refreshes only the shards
# it named; every VERIFY_EVERY seconds a pass `stat`s every shard anyway, and drops the
# watch if that finds a change the kernel did not report (a network filesystem)
VERIFY_EVERY = 10.0
# s a spooled rank's process may be gone before it counts as crashed: its finish may be in
# the spool still, not yet applied by exprd (a training process ends right after writing it)
SPOOL_GRACE = 5.0


class RunReader:
    """Reads one stream of a run again and again, keeping offsets and windows in memory."""

    def __init__(
        self, run_dir: str | os.PathLike[str], stream: str | None = None, *,
        window: int = DEFAULT_WINDOW, series: str | None = None,
    ) -> None:
        """`series`: keep of the rank records only that key's values and the latest value
        of each key (`RunState.series`), not whole records: what a watcher of thousands
        of ranks needs, in bounded memory."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        if series is not None and (not isinstance(series, str) or not series):
            raise ValueError(f"series must be a metric name, got {series!r}")
        self.run_dir = Path(run_dir)
        self.stream = stream
        self.window = window
        self.series = series
        self._tails: dict[int, ShardTail] = {}
        self._here = socket.gethostname()
        self.names: list[str] = []  # the run directory's entries at the last pass
        # shards of this stream by rank that the caller has just listed itself: the next
        # pass takes them as its listing (`expr summary` lists 16,384 shards once, not
        # twice; `names` are then the shards' alone)
        self.listed: dict[int, Path] | None = None
        self._parsed: dict[str, Any] = {}  # entry name -> (rank, Path) | None
        # what the last pass derived, kept for the tails that did not change
        self._seen: dict[int, tuple[ShardTail, int]] = {}  # shard rank -> (tail, version)
        self._states: dict[int, RankState] = {}  # shard rank -> RankState (no pid check)
        self._local: dict[int, set[int]] = {}  # pid -> shard ranks it writes on this host
        self._dead_at: dict[int, float] = {}  # pid -> when a pass first found it gone
        self._pass_at: float | None = None  # the reader's clock at this pass ...
        self._since: float | None = None  # ... and at the one before
        self._gone: dict[int, tuple[RankState, RankState]] = {}  # shard rank -> (base, crashed)
        self._keys: dict[int, frozenset[int]] = {}  # shard rank -> the `_rank`s it holds
        self._owners: dict[int, dict[int, ShardTail]] = {}  # `_rank` -> shards holding it
        self._records: dict[int, list[dict[str, Any]]] = {}
        # how many shards (sidecars) and `_rank`s (latest record) name each world size:
        # `RunState.world_size` without a look at every rank
        self._sizes: Counter[int] = Counter()
        self._series: dict[int, Sequence[float]] = {}
        self._system: dict[int, dict[str, Any]] = {}
        # the last pass: shard files and sidecars read (not just `stat`ed)
        self.shards_read = 0
        self.sidecars_read = 0
        self._found: dict[int, Path] = {}
        self._dir_key: tuple[int, int] | None = None  # (mtime_ns, inode) of a trusted listing
        self._full_at = -math.inf  # wall clock of the last full pass
        self.clock = PassClock()  # the pass times of `health.clock`
        self.fs_offset = 0.0  # the filesystem's clock minus ours (a watcher measures it)
        # s the filesystem may show a file's old size and mtime (`HealthConfig.fs_cache`,
        # set by the watcher): a change seen now may have been made that long before the
        # last pass, and is dated by its mtime as far back
        self.cache = 0.0
        self._when: dict[int, Seen] = {}  # shard rank -> when it wrote, advanced, ...
        self.changes: Any = None  # a `changes.DirChanges` once `watch_changes` set one up
        self.blind = False  # the watch missed a change a stat pass found: dropped for good
        self.dirty_pass = False  # the last pass refreshed only what the kernel named
        self._reported: set[str] | None = set()  # names reported since the last stat pass
        self._pending: set[str] = set()  # names drained after a stat pass: read next pass
        self._verify_at = -math.inf  # wall clock of the last stat pass with a watch
        self._last: RunState | None = None
        self._hb: dict[str, tuple[int, float]] = {}  # heartbeat name -> (mtime_ns, when seen)
        # reads the tails of shards never read (first reads of many: in worker processes),
        # and gives them back in pieces, as they are read; a caller that reads more of each
        # shard from the same read sets its own (`expr summary`: `tail.read_scanned`)
        self.first_reads: Callable[[list[ShardTail]], Iterable[Sequence[ShardTail]]] | None = (
            None)

    def watch_changes(self) -> bool:
        """Learn from the kernel (inotify, `health.changes`) which shards and sidecars
        changed, instead of `stat`ing every one on every pass: for a reader kept for a
        long time (`expr serve`). False (and nothing changes) where no watch can be set
        up: not Linux, a network filesystem, the inotify limits."""
        from expr_tracker.health.changes import watch_dir

        if self.changes is None and not self.blind:
            self.changes = watch_dir(self.run_dir)
        return self.changes is not None

    def tail(self, rank: int) -> ShardTail | None:
        """What the last pass read of shard `rank` (its size, complete end, sidecar), for
        a caller that reports on the files themselves (`expr shards`) without a second
        read of each; None for a shard it did not read."""
        t = self._tails.get(rank)
        return t if t is not None and t.ok else None

    def own_records(self) -> bool:
        """Every shard read holds rank records of its own rank alone (or none): each
        rank's records come from one shard, its own (no rank 0 logging for the others)."""
        return all(k <= {r} for r, k in self._keys.items())

    def files(self) -> dict[int, tuple[Any, ...]]:
        """What the last pass saw of each shard and its sidecar (inode, size, mtime): two
        readers of a run that saw the same files read the same bytes."""
        return {r: (t.ino, t.size, t.mtime_ns, t.sidecar_stat) for r, t in self._tails.items()}

    def close(self) -> None:
        """Drop the kernel watch (its file descriptor); the reader still works, by `stat`."""
        if self.changes is not None:
            self.changes.close()
            self.changes = None

    def _list(self) -> dict[int, Path]:
        """`list_shards`, with each entry name parsed once for the reader's life."""
        if self.listed is not None:
            out, self.listed = self.listed, None
            self.names = [p.name for p in out.values()]
            return out
        out = {}
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            self.names = []
            return out
        parsed = self._parsed
        if len(parsed) > 2 * len(names) + 1024:  # bounded by what the directory holds
            parsed.clear()
        for name in names:
            hit = self._entry(name)
            if hit is not None:
                out[hit[0]] = hit[1]
        self.names = names
        return out

    def read(self, at: float | None = None) -> RunState:
        """One pass: list the shards, refresh each (a first read of many in processes),
        and rebuild what is derived from the shards that changed. `at`: the pass's time
        on the caller's clock (default `self.clock()`), the time of what it sees change.
        No cyclic collections meanwhile (`gcpause`: a first pass of 16,384 shards makes
        millions of records, and the collections they set off cost a third of its CPU)."""
        with paused_gc():
            return self._read(at)

    def _read(self, at: float | None) -> RunState:
        import time

        now = time.time()
        at = self.clock() if at is None else at
        self._since, self._pass_at = self._pass_at, at  # (the last pass's time: `_date`)
        feed = self.changes
        if feed is not None and self._tails and now - self._verify_at < VERIFY_EVERY:
            got = feed.drain()
            if got is not None:
                names, listing = got
                self._pending |= names
                if self._reported is not None:
                    self._reported |= names
                # a sidecar is replaced by a rename: only a shard's name is a listing change
                if not any(self._shard_of(n) is not None for n in listing
                           if not n.endswith(".meta.json")):
                    return self._dirty_pass(now, at)
            else:
                self._reported = None  # events were lost: nothing to check them against
        self.dirty_pass = False
        full = True
        try:
            st = os.stat(self.run_dir)
        except OSError:
            dir_key = None
        else:
            dir_key = (st.st_mtime_ns, st.st_ino)
            full = dir_key != self._dir_key or now - self._full_at >= FULL_EVERY
        if full:
            found = self._found = self._list()
            self._full_at = now
            settled = dir_key is not None and now - dir_key[0] / 1e9 >= DIR_SETTLE
            self._dir_key = dir_key if settled else None
        else:
            found = self._found
        tails = self._tails
        if full:
            for rank in [r for r, t in tails.items() if r not in found or
                         (t.path is not found[r] and t.path != found[r])]:
                del tails[rank]
            for rank, path in found.items():
                if rank not in tails:
                    tails[rank] = ShardTail(path, rank, self.stream, self.window, self.series)
        live: list[ShardTail] = []
        first: list[int] = []  # the ranks of the first reads, brought up to date already
        # never read: a whole tail each (none on a quiet pass: no shard appeared)
        fresh = [t for t in tails.values() if t.ino is None] if full else []
        if fresh and (len(fresh) >= _FORK_MIN or self.first_reads is not None):
            for piece in (self.first_reads or _forked_refresh)(fresh):
                # each piece as it comes from a worker: its state is built meanwhile
                mine = []
                for t in piece:
                    tails[t.rank] = t  # a copy, from a worker process
                    if t.ok:
                        mine.append(t)
                first += self._update(mine, at, gone_from=[])
                live += mine
            fresh_ranks = {t.rank for t in fresh}
            rest = [t for r, t in tails.items() if r not in fresh_ranks]
        else:
            rest = list(tails.values())
        live.extend(t for t in refresh_all(rest, full) if t.ok)
        changed = [*first, *self._update(live, at)]
        if feed is not None:
            self._verify(feed, changed, now)
        return self._state(now, changed)

    def _shard_of(self, name: str) -> int | None:
        """The shard rank of an entry name (a shard or its sidecar) of this stream."""
        if name.endswith(".meta.json"):
            name = name[: -len(".meta.json")] + ".jsonl"
        hit = self._entry(name)
        return hit[0] if hit is not None else None

    def _entry(self, name: str) -> tuple[int, Path] | None:
        """(shard rank, path) of an entry name that is a shard of this stream, else None;
        each name parsed once for the reader's life."""
        hit = self._parsed.get(name, _UNPARSED)
        if hit is _UNPARSED:
            shard = parse_shard_name(name)
            ok = shard is not None and shard.stream == self.stream
            hit = self._parsed[name] = (shard.rank, self.run_dir / name) if ok and shard else None
        return hit

    def _dirty_pass(self, now: float, at: float) -> RunState:
        """A pass over what the kernel said changed (and no listing: no shard appeared,
        went or was renamed): those shards and sidecars are read, the others not even
        `stat`ed."""
        self.dirty_pass = True
        names, self._pending = self._pending, set()
        ranks = {r for n in names if (r := self._shard_of(n)) is not None}
        tails = [t for r in sorted(ranks) if (t := self._tails.get(r)) is not None]
        refresh_all(tails, True)
        changed = self._update([t for t in tails if t.ok], at,
                               gone_from=[t.rank for t in tails if not t.ok])
        return self._state(now, changed)

    def _verify(self, feed: Any, changed: list[int], now: float) -> None:
        """After a stat pass with a watch: the names the kernel reported since the last
        one (and right now: a write during this pass is read next pass) must cover every
        shard this pass found changed; else the watch is blind to some writers (a
        network filesystem written from other hosts) and is dropped."""
        got = feed.drain()
        if got is None:
            self._reported = None
        else:
            self._pending |= got[0]
        reported = self._reported
        if reported is not None and got is not None and self._verify_at > -math.inf:
            known = {r for n in reported | got[0] if (r := self._shard_of(n)) is not None}
            if any(r not in known for r in changed):
                self.close()
                self.blind = True
        self._reported = set()
        self._verify_at = now

    def _state(self, now: float, changed: list[int]) -> RunState:
        """The RunState of this pass (the pid check of local writers included)."""
        tails = self._tails
        self.shards_read = sum(tails[r].read_now for r in changed if r in tails)
        self.sidecars_read = sum(tails[r].side_read_now for r in changed if r in tails)
        ranks = self._states.copy()
        dead_at = self._dead_at
        for pid, mine in self._local.items():  # one check per pid and pass
            if pid_alive(pid):
                dead_at.pop(pid, None)
            else:
                since = dead_at.setdefault(pid, now)
                for r in mine:
                    base = ranks[r]
                    wrote = base.wrote_at
                    if (base.spooled and now - since < SPOOL_GRACE and wrote is not None
                            and now - wrote < SPOOL_GRACE):
                        continue  # exprd wrote it a moment ago: its finish may be next
                    got = self._gone.get(r)
                    if got is None or got[0] is not base:  # the same copy while nothing changes
                        got = self._gone[r] = (base, base.gone())
                    ranks[r] = got[1]
        state = RunState(
            run_dir=self.run_dir,
            stream=self.stream,
            ranks=ranks,
            rank_records=self._records.copy(),
            read_time=now,
            series_key=self.series,
            series=self._series.copy() if self.series is not None else {},
            changed=frozenset(changed),
            system=self._system.copy(),
            heartbeats=self._heartbeats(),
            fs_offset=self.fs_offset,
        )
        sizes = [ws for ws, n in self._sizes.items() if n > 0]
        state.__dict__["world_size"] = max(sizes) if sizes else None  # (the cached property)
        last = self._last
        if not changed and last is not None and ranks == last.ranks:
            # nothing new (compared in C: the same RankState objects): the previous pass's
            # rank dict and what was derived from it, not 16,384 ranks gone over again
            state.ranks = last.ranks
            for name in ("live", "frontier", "lead"):
                if name in last.__dict__:
                    state.__dict__[name] = last.__dict__[name]
        self._last = state
        return state

    @property
    def heartbeat_mtimes(self) -> dict[str, int]:
        """The exprd heartbeats' mtimes (ns, the filesystem's clock) as the last pass saw
        them, by file name (`clock.CacheLearner` reads their gaps)."""
        return {name: v[0] for name, v in self._hb.items()}

    def _heartbeats(self) -> dict[str, float]:
        """The exprd heartbeats of the listing, dated like a sidecar (`health.clock`): a
        `stat` each (a handful per run, one per node)."""
        hb = self._hb
        out: dict[str, float] = {}
        for name in self.names:
            host = heartbeat_host(name)
            if host is None:
                continue
            try:
                mtime = os.stat(os.path.join(self.run_dir, name), follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            old = hb.get(name)
            if old is None:
                when = mtime_on_our_clock(mtime, self.fs_offset)
            elif old[0] != mtime:
                when = _within(mtime_on_our_clock(mtime, self.fs_offset), self._lo(),
                               self._pass_at if self._pass_at is not None else old[1])
            else:
                when = old[1]
            if when is None:
                continue
            hb[name] = (mtime, when)
            out[host] = when
        return out

    def _update(self, live: list[ShardTail], at: float,
                gone_from: list[int] | None = None) -> list[int]:
        """Bring the derived state up to date with this pass's tails; returns the shard
        ranks that changed (were read again, appeared, or went). `gone_from`: only these
        ranks can have gone (a pass over some shards); else every rank not in `live`."""
        seen, keys, owners = self._seen, self._keys, self._owners
        now_in = {t.rank: t for t in live}
        changed = [t.rank for t in live if (p := seen.get(t.rank)) is None or p[0] is not t
                   or p[1] != t.version]
        gone = (seen.keys() - now_in.keys() if gone_from is None
                else {r for r in gone_from if r in seen})
        dirty: set[int] = set()
        added = False
        for r in gone:
            del seen[r]
            old = self._states.pop(r, None)
            self._unlocal(old)
            self._count_size(old.world_size if old else None, -1)
            self._gone.pop(r, None)
            self._when.pop(r, None)
            for k in keys.pop(r, ()):
                owners[k].pop(r, None)
                dirty.add(k)
        for r in changed:
            t = now_in[r]
            seen[r] = (t, t.version)
            mine = frozenset(t.series if self.series is not None else t.rank_recs)
            for k in keys.get(r, frozenset()) - mine:
                owners[k].pop(r, None)
            for k in mine:
                owners.setdefault(k, {})[r] = t
            dirty |= keys.get(r, frozenset()) | mine
            keys[r] = mine
            rs = _rank_state(t)
            self._date(rs, t, at)
            old = self._states.get(r)
            added = added or old is None
            self._unlocal(old)
            self._count_size(old.world_size if old else None, -1)
            self._count_size(rs.world_size, 1)
            self._states[r] = rs
            if rs.local_to(self._here):
                assert rs.pid is not None  # (`local_to`)
                self._local.setdefault(rs.pid, set()).add(r)
        if added:
            self._states = dict(sorted(self._states.items()))
        self._merge(dirty)
        return [*changed, *gone]

    def _date(self, rs: RankState, t: ShardTail, at: float) -> None:
        """Set `rs`'s times of writing, advancing and sidecar (see `health.clock`)."""
        w = self._when.get(t.rank)
        side = t.sidecar_stat[0] if t.sidecar_stat is not None else None
        wrote = mtime_on_our_clock(t.mtime_ns, self.fs_offset)
        side_at = mtime_on_our_clock(side, self.fs_offset)
        if w is None:
            w = self._when[t.rank] = Seen(wrote, side_at, t.last_step)
        else:
            # a change seen now came after the last pass: dated by its mtime within that
            # span (passes can be far apart: `expr serve` passes only when asked, and a
            # crash seen by the first request after it read "0s ago")
            lo = self._lo()
            w.update(at, t.read_now, t.side_read_now, t.last_step,
                     _within(wrote, lo, at), _within(side_at, lo, at))
        rs.last_write, rs.advanced, rs.sidecar_write = w.write, w.advance, w.side
        quiet = quiet_since(rs)
        if quiet is not None:
            # what the shard grew by since is the tracker thread's, not the loop's (below)
            if rs.last_write is not None and rs.last_write > quiet:
                rs.last_write = quiet
            if rs.advanced is not None and rs.advanced > quiet:
                rs.advanced = quiet

    def _lo(self) -> float | None:
        """The earliest a change seen this pass can be dated: the last pass, less what an
        attribute cache may have hidden (another host's write, seen up to `cache` late,
        is dated when the server stamped it, not when the cache let us see it)."""
        return None if self._since is None else self._since - self.cache

    def _count_size(self, ws: int | None, n: int) -> None:
        if ws:
            self._sizes[ws] += n

    def _unlocal(self, rs: RankState | None) -> None:
        """Forget `rs` among the ranks whose writer's pid is checked."""
        if rs is not None and rs.pid is not None and (mine := self._local.get(rs.pid)):
            mine.discard(rs.rank)
            if not mine:
                del self._local[rs.pid]
                self._dead_at.pop(rs.pid, None)

    def _merge(self, dirty: set[int]) -> None:
        """Merge again the rank records (or series) of the `_rank`s in `dirty`."""
        records, series, owners = self._records, self._series, self._owners
        added = False
        for k in dirty:
            parts = [t for _, t in sorted(owners.get(k, {}).items())]
            self._count_size(_logged_size(records.get(k)), -1)
            samples = [t.system[k] for t in parts if k in t.system]
            if samples:  # the latest by step when several shards hold samples of `k`
                self._system[k] = max(samples, key=_step_of)
            else:
                self._system.pop(k, None)
            if not parts:
                owners.pop(k, None)
                records.pop(k, None)
                series.pop(k, None)
                continue
            added = added or k not in records
            if self.series is None:
                records[k] = _merge_records(k, parts, self.window)
            else:
                records[k], series[k] = _merge_series(k, parts, self.window)
            self._count_size(_logged_size(records[k]), 1)
        if added:
            self._records = dict(sorted(records.items()))
            if self.series is not None:
                self._series = dict(sorted(series.items()))


R = TypeVar("R")


def share_reads(read: Callable[[list[ShardTail]], list[R]], fresh: list[ShardTail]) -> Iterator[
        list[R]]:
    """`read` of pieces of `fresh` (one result per tail, in order), each piece given as it
    is read; shared among forked processes from `_FORK_MIN` tails on."""
    if len(fresh) < _FORK_MIN:
        yield read(fresh)
        return
    from expr_tracker.stats.parallel import iter_forked

    for _, results in iter_forked(read, fresh):
        yield results


def _forked_refresh(fresh: list[ShardTail]) -> Iterator[list[ShardTail]]:
    return share_reads(refresh_all, fresh)


def _logged_size(recs: list[dict[str, Any]] | None) -> int | None:
    """The world size a `_rank`'s latest record names (as `RunState.world_size` reads it)."""
    ws = recs[-1].get("_world_size") if recs else None
    return ws if type(ws) is int and ws > 0 else None


def _merge_records(rank: int, tails: list[ShardTail], window: int) -> list[dict[str, Any]]:
    """The rank records of `rank` in `tails` (in shard order); when several shards name
    it, its latest `window` records by step."""
    if len(tails) == 1:
        return list(tails[0].rank_recs[rank])
    mine = deque(tails[0].rank_recs[rank], maxlen=window)
    for t in tails[1:]:
        mine.extend(t.rank_recs[rank])
        mine = deque(sorted(mine, key=_step_of)[-window:], maxlen=window)
    return list(mine)


def _merge_series(rank: int, tails: list[ShardTail], window: int) -> tuple[
        list[dict[str, Any]], Sequence[float]]:
    """`_merge_records` for compact tails: one record (the latest value of each key; the
    shard with the latest step wins) and the series values. Shared with the tails, which
    replace rather than change them."""
    parts = [t.series[rank] for t in tails]
    rec: dict[str, Any]
    if len(parts) == 1:
        s = parts[0]
        rec, vals = s.latest, s.values
    else:
        parts.sort(key=lambda s: s.steps[-1] if s.steps else -1)
        rec = {}
        for s in parts:
            rec.update(s.latest)
        pairs = sorted((p for s in parts for p in zip(s.steps, s.values, strict=True)),
                       key=lambda p: p[0])
        vals = array("d", (v for _, v in pairs[-window:]))
    return [decoded(rec) or rec], vals


def _step_of(rec: Mapping[str, Any]) -> int:
    step = rec.get("_step")
    return step if type(step) is int else -1



def read_run(
    run_dir: str | os.PathLike[str], stream: str | None = None, *, window: int = DEFAULT_WINDOW
) -> RunState:
    """One-shot: the live state of one stream of the run in `run_dir` (see `RunReader`)."""
    return RunReader(run_dir, stream, window=window).read()
