"""Each run's live state, kept between requests (DESIGN 18).

A `LiveRun` holds the health watcher's incremental reader (`health.state.RunReader`, by
way of `data.top.TopView`) with a kernel watch on the run directory (`watch_changes`): a
pass reads the shards and sidecars inotify named since the last one, and over an idle run
of thousands of ranks costs next to nothing (a `stat` pass of every shard runs every
`state.VERIFY_EVERY` seconds anyway, and on every pass where no watch can be set up). A pass that saw nothing change (no shard or sidecar changed, the same
frontier and statuses) keeps the version, and every answer built for that version is
served again from memory: a refresh with nothing new costs the pass, not the reduction.
Passes are shared: one per `MIN_PASS` seconds whatever the number of pages and requests.

A run of `QUICK_MIN` shards or more is first read with a window of 2 steps (the state
`expr summary` reads: statuses, frontier, hosts), which is what the summary and the heatmap
need; the watcher's window (`DEFAULT_WINDOW` steps of every tail, for top's detectors) is
read afterwards on a thread, once the first answers are out, and until it is there top
answers `reading` (a page says so; it never shows a made-up "no incidents"). When it is
read and no shard or sidecar changed since the quick pass, the version and its answers
are kept: they are the same (`tests/test_serve_quick.py`).
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from expr_cli.data.top import TopView
from expr_cli.errors import CLIError
from expr_cli.resolve import RunRef, list_shards

from .paths import NotFound, no_links

MIN_PASS = 0.5  # seconds: requests and event streams closer than this share a pass
TOP_TTL = 10.0  # top runs the time-based detectors (hang, stall: minutes): rebuilt this often anyway
MAX_RUNS = 32  # live states kept (least recently used dropped)
# ranks of all kept states together (a state of 4,096 ranks holds about 50 MB): past it
# the least recently used go, the newest always stays
MAX_KEPT_RANKS = 32_768
MAX_ANSWERS = 64  # answers kept per run and version
INCIDENT_TAIL = 256 << 10  # bytes of incidents.jsonl read for the resolved incidents
QUICK_MIN = 1024  # shards from which the first pass is the quick one (window 2)
QUIET = 0.25  # seconds without an answer being built before the full read starts ...
QUIET_MAX = 10.0  # ... waiting at most this long for such a pause
AUTO_FULL = 2.0  # seconds after the quick pass the full read starts, top asked or not
SWITCH = 0.0005  # seconds: the interpreter's thread switch interval during the full read
SCAN_PIECE = 1024  # tails the quick pass reads and scans between two counts of `progress`


class LiveRun:
    """One stream of one run: the reader, the version, and the answers of that version."""

    def __init__(self, ref: RunRef, stream: str | None, cfg: Any, record: bool = False) -> None:
        self.ref = ref
        self.stream = stream
        self.top = TopView(ref, stream, None, cfg, record=record)
        # the kernel names what changed: a pass over an idle run stats nothing (DESIGN 18)
        self.top.reader.watch_changes()
        self.quick: Any = None  # the window-2 reader while the full state is being read
        self.full = False  # the passes are the watcher's reader's (top can be answered)
        self._full_job: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._quick_at = 0.0
        self._building = 0  # answers being built now (the full read waits for a pause)
        self._built_at = 0.0
        self._counts: Any = None
        self.lock = threading.RLock()
        self.version = 0
        self.state: Any = None
        self.pass_at = -1e9
        self.pass_s = 0.0  # server time of the last pass (the bench reports it)
        self._mark: Any = None
        self._answers: OrderedDict[Any, tuple[float, Any]] = OrderedDict()
        self.memo: dict[Any, Any] = {}  # what answers of this version share (tables read)
        self._scan: Any = None  # the first summary's scan of every tail (`progress` counts it)
        self._scanned = 0  # ... tails the quick pass scanned so far, when it does
        self._shards_total: int | None = None
        self.listing: list[Any] | None = None  # the shards `LiveRuns.get` listed, for the first pass

    def refresh(self, max_age: float = MIN_PASS, scan: bool = True, quick: bool = True) -> Any:
        """The live state, from a pass at most `max_age` seconds old. `scan=False` (the
        first tiles, `first_answer`): a first pass reads the state alone, and the scan
        of every tail for the summary's window starts after it, not beside it (on two
        cores its workers took the core the first pass needed). `quick=False`: a first
        pass reads the watcher's window at once, never the quick window of 2."""
        with self.lock:
            t = time.monotonic()
            if self.state is not None and t - self.pass_at < max_age:
                return self.state
            job = self._prefetch(scan) if self.state is None else None
            if self.state is None and not self.full:
                shards = job.get(("shards", self.stream)) if job else None
                if shards is not None and len(shards) >= QUICK_MIN and quick:
                    from expr_tracker.health.state import RunReader

                    self.quick = RunReader(self.ref.path, self.stream, window=2)
                    self.quick.watch_changes()  # (its passes meanwhile: what the kernel names)
                    # the listing taken already, not a second one (a fifth of a second)
                    self.quick.listed = {s.rank: s.path for s in shards if s.stream == self.stream}
                    self._quick_at = t
                    if scan and job is not None and not job[("scan", self.stream)].parallel:
                        # no workers to scan the tails meanwhile (a busy machine): the quick
                        # pass scans them with its one read of each shard, as `expr summary`
                        self._scan_in_pass(job, shards)
                    elif not scan:
                        self._read_here()
                else:
                    self.full = True
            if self.quick is not None and t - self._quick_at >= AUTO_FULL:
                self.start_full()
            state = (self.quick if self.quick is not None else self.top.reader).read()
            if self.state is None or state.ranks is not self.state.ranks:  # (else: the same)
                self._counts = tuple(sorted(Counter(rs.status for rs in state.ranks.values()).items()))
            mark = (state.frontier, state.lead, state.world_size, self._counts,
                    _incidents_key(self.ref))
            if state.changed or mark != self._mark or self.state is None:
                no_links(self.ref)  # files appeared: none may be a symlink
                self.version += 1
                self._answers.clear()
                self._drop_memo()
            if job is not None:
                self.memo.update(job)
            self._mark = mark
            self.state = state
            self.pass_at = time.monotonic()
            self.pass_s = self.pass_at - t
            return state

    def full_state(self) -> Any:
        """The state of the watcher's window (what top's detectors need), read now and
        waited for if it is not read yet (`expr mcp`: a tool cannot answer `reading`).
        A first pass reads that window at once, alone: the quick pass and the summary's
        scan beside it were two more reads of 16,384 tails before the answer (MCP
        run_incidents of a killed 16,384-rank job: 22 s)."""
        first = self.state is None
        state = self.refresh(scan=not first, quick=not first)
        if self.full:
            return state
        self.start_full()
        job = self._full_job
        if job is not None:
            job.join()
        return self.refresh()

    def _read_here(self) -> None:
        """Make the quick reader's first read of the tails run in this process, in pieces
        counted for `progress`: for the first tiles, a window of 2 is a few lines of each
        shard, and a forked worker's share came back (marshalled tails, each merged here)
        no sooner than this process read it, and later where the other core was busy
        (16,384 ranks: 2.2-3.2 s against 1.4-2.1 s, one core busy elsewhere)."""
        from expr_tracker.health.tail import refresh_all

        def first_reads(fresh: list[Any]) -> Any:
            for i in range(0, len(fresh), SCAN_PIECE):
                piece = refresh_all(fresh[i:i + SCAN_PIECE])
                self._scanned += len(piece)
                yield piece

        self.quick.first_reads = first_reads

    def _scan_in_pass(self, job: dict[Any, Any], shards: list[Any]) -> None:
        """Make the quick reader's first read of each tail scan it too (`tail.read_scanned`),
        and the memo's scan job its scans: one read of each shard, not two."""
        from functools import partial

        from expr_cli.summary_load import RECENT
        from expr_tracker.health.tail import read_scanned

        scanned: dict[int, Any] = {}
        read = partial(read_scanned, recent=RECENT)

        def first_reads(fresh: list[Any]) -> Any:
            # in this process (no workers: why we are here), in pieces counted for `progress`
            for i in range(0, len(fresh), SCAN_PIECE):
                pairs = read(fresh[i:i + SCAN_PIECE])
                scanned.update((tl.rank, sc) for tl, sc in pairs)
                self._scanned = len(scanned)
                yield [tl for tl, _ in pairs]

        self.quick.first_reads = first_reads
        key = ("scan", self.stream)
        job[key].close()
        job[key] = self._scan = _Scanned(shards, scanned)

    def start_full(self) -> None:
        """Read the watcher's window of every tail on a thread (once), if not read yet."""
        with self._start_lock:  # (not `lock`: an answer being built holds it for seconds)
            if self.full or self._full_job is not None:
                return
            self._full_job = threading.Thread(target=self._read_full, daemon=True,
                                              name=f"expr-serve-full-{self.ref.label}")
            self._full_job.start()

    def _read_full(self) -> None:
        """The full read, then the switch to its reader. Not under the lock: passes and
        answers go on from the quick reader meanwhile. It waits for a pause in the
        answers (`QUIET`): a thread of this process competes with them for the
        interpreter, and the page's first answers come first."""
        start = time.monotonic()
        while time.monotonic() - start < QUIET_MAX and (
                self._building or time.monotonic() - self._built_at < QUIET):
            time.sleep(QUIET / 5)
        # requests go on meanwhile: each time one gives up the interpreter (a system call)
        # it waits for this thread's turn to end, 5 ms by default, and a page of a few
        # hundred such calls took a second; shorter turns while this read runs
        _short_switches(+1)
        try:
            state = self.top.reader.read()
        except Exception:  # (a run removed meanwhile: the next top asks again)
            with self._start_lock:
                self._full_job = None
            return
        finally:
            _short_switches(-1)
        with self.lock:
            quick, self.quick, self.full = self.quick, None, True
            counts = tuple(sorted(Counter(rs.status for rs in state.ranks.values()).items()))
            mark = (state.frontier, state.lead, state.world_size, counts, _incidents_key(self.ref))
            if quick is not None:
                quick.close()
            if quick is None or quick.files() != self.top.reader.files() or mark != self._mark:
                self.version += 1  # something moved since the quick pass: answer again
                self._answers.clear()
                self._drop_memo()
            self._counts, self._mark = counts, mark
            self.state = state
            self.pass_at = time.monotonic()

    def _prefetch(self, scan: bool = True) -> dict[Any, Any] | None:
        """Before the first pass: the shard listing, and the summary's scan of every tail
        started in worker processes, which run while this process reads the live state
        (the page's first request is its summary): at 16,384 ranks the two reads overlap
        instead of one waiting for the other."""
        from expr_cli.resolve import shards_of

        shards, self.listing = self.listing, None
        try:
            if not shards:  # (not listed by `LiveRuns.get` a moment ago)
                shards = shards_of(self.ref, self.stream)
        except CLIError:
            return None  # an empty run, an unknown stream: the answers say so
        self._shards_total = len(shards)
        if not scan:
            return {("shards", self.stream): shards}
        return {("shards", self.stream): shards, ("scan", self.stream): self._start_scan(shards)}

    def _start_scan(self, shards: list[Any]) -> Any:
        from expr_cli.summary_load import start_scan

        self._scan = start_scan(shards)
        return self._scan

    def scan_now(self) -> None:
        """Start the summary's scan of every tail (in worker processes where a core is
        idle) if no pass started it and the window is not read yet: after the first tiles
        (`refresh(scan=False)`), whose answer it would have slowed down, the whole
        summary's build starts it here, where `progress` counts it. Under `lock`."""
        shards = self.memo.get(("shards", self.stream))
        if shards is not None and ("scan", self.stream) not in self.memo \
                and ("table", None, None) not in self.memo:
            self.memo[("scan", self.stream)] = self._start_scan(shards)

    def progress(self) -> dict[str, Any]:
        """How far the first read is (a page shows it until its first answers come): the
        shards listed, those whose tails are scanned, the ranks' world size. Without the
        lock, which the read in progress holds."""
        state, job = self.state, self._scan
        read = max(job.progress()[0], self._scanned) if job is not None else 0
        return {"shards_total": self._shards_total, "shards_read": read,
                "world_size": state.world_size if state is not None else None,
                "answers": len(self._answers)}

    def _drop_memo(self) -> None:
        """A new memo for a new version; a scan started and never used is stopped."""
        old, self.memo = self.memo, {}
        for key, value in old.items():
            if key[0] == "scan" and hasattr(value, "close"):
                value.close()

    def own_records(self) -> bool:
        """Each shard the state was read from holds its own rank's records alone."""
        return bool((self.quick if self.quick is not None else self.top.reader).own_records())

    def answer(self, key: Any, build: Callable[[Any], Any], ttl: float | None = None,
               scan: bool = True) -> Any:
        """`build(state)` for this version, from memory when it was built already (and, with
        `ttl`, at most that many seconds ago). `scan`: as `refresh`'s."""
        with self.lock:
            state = self.refresh(scan=scan)
            hit = self._answers.get(key)
            if hit is not None and (ttl is None or time.monotonic() - hit[0] < ttl):
                self._answers.move_to_end(key)
                return hit[1]
            self._building += 1
            try:
                value = build(state)
            finally:
                self._building -= 1
                self._built_at = time.monotonic()
            self._answers[key] = (time.monotonic(), value)
            while len(self._answers) > MAX_ANSWERS:
                self._answers.popitem(last=False)
            return value


class _Scanned:
    """A `parallel.ScanJob` whose scans the quick pass made (`LiveRun._scan_in_pass`): a
    shard it did not scan (it could not be read then) is scanned at `result`."""

    parallel = False

    def __init__(self, shards: list[Any], scanned: dict[int, Any]) -> None:
        self.shards = shards
        self.scanned = scanned

    def result(self) -> list[Any]:
        from expr_cli.summary_load import RECENT
        from expr_tracker.stats import scan

        return [sc if (sc := self.scanned.get(s.rank)) is not None else
                scan.scan_shard(s.path, recent=RECENT) for s in self.shards]

    def progress(self) -> tuple[int, int]:
        return len(self.scanned), len(self.shards)

    def close(self) -> None:
        """(nothing runs)"""

    def abandon(self) -> None:
        """(nothing runs)"""


_switching = threading.Lock()
_switch_users = [0, 0.0]  # full reads running, and the switch interval before the first


def _short_switches(step: int) -> None:
    """+1: a full read starts (the interval is `SWITCH` while any runs); -1: one ended
    (the interval before the first comes back after the last)."""
    with _switching:
        if step > 0 and _switch_users[0] == 0:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH)
        _switch_users[0] += step
        if _switch_users[0] == 0:
            sys.setswitchinterval(_switch_users[1])


def _incidents_key(ref: RunRef) -> tuple[int, int] | None:
    """The size and mtime of incidents.jsonl: a watcher's new line is a change too."""
    try:
        st = os.stat(ref.path / "incidents.jsonl", follow_symlinks=False)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class LiveRuns:
    """The live states of the runs pages look at, least recently used dropped first."""

    def __init__(self, cfg: Any, record: bool = False) -> None:
        """`record`: the runs' stalls are recorded (`TopView._record`: `expr serve` is a
        watcher; MCP only reads)."""
        self.cfg = cfg
        self.record = record
        self.lock = threading.Lock()
        self.runs: OrderedDict[tuple[str, str | None], LiveRun] = OrderedDict()
        self.ranks: dict[tuple[str, str | None], int] = {}  # shards of each kept state

    def get(self, ref: RunRef, stream: str | None) -> LiveRun:
        """The kept state of `ref` (made on first use). A stream the run has no shard of
        is NotFound before anything is kept: a request for what does not exist never
        evicts a state that does (seconds to read again at 16,384 ranks)."""
        key = (str(ref.path), stream)
        with self.lock:
            run = self.runs.get(key)
            if run is not None:
                self.runs.move_to_end(key)
                return run
        try:
            listing = [s for s in list_shards(ref) if s.stream == stream]
        except CLIError:
            listing = []
        ranks = len(listing)
        if not ranks:
            if stream is not None:
                raise NotFound(f"run {ref.label} has no shards of stream {stream}")
            return LiveRun(ref, stream, self.cfg, self.record)  # a run with no shard yet: not kept
        with self.lock:
            run = self.runs.get(key)
            if run is None:
                run = self.runs[key] = LiveRun(ref, stream, self.cfg, self.record)
                run.listing = listing  # (its first pass's: one listing of 16,384 shards)
                self.ranks[key] = ranks
                # bounded by memory (about its ranks' tails each), not only by count
                while len(self.runs) > 1 and (len(self.runs) > MAX_RUNS
                                              or sum(self.ranks.values()) > MAX_KEPT_RANKS):
                    # its inotify watch is closed with it (`DirChanges.__del__`), once a
                    # request still reading it is done: not here, under that request
                    old, _ = self.runs.popitem(last=False)
                    self.ranks.pop(old, None)
            self.runs.move_to_end(key)
            return run


def incident_lines(ref: RunRef, limit: int = 200) -> list[dict[str, Any]]:
    """The last `limit` lines of the run's incidents.jsonl (opened and resolved), newest
    first; fields the page does not know (a new kind, `root`, `id`) are passed through."""
    from expr_tracker.store import records

    try:
        # O_NONBLOCK: a FIFO in its place is refused below, not waited on
        fd = os.open(ref.path / "incidents.jsonl",
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return []
        size = st.st_size
        start = max(0, size - INCIDENT_TAIL)
        data = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    if start:
        data = data[data.find(b"\n") + 1:]
    out = []
    for _, line in records.iter_lines(data[: data.rfind(b"\n") + 1]):
        try:
            rec = records.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("kind"), str):
            out.append(rec)
    return out[-limit:][::-1]
