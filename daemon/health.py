"""exprd watches job health too (DESIGN 8, 13).

Watched runs: every run whose rank-0 shard this exprd writes (spool mode), and, with
`watch_roots = [...]`, every live run under those roots whose rank-0 sidecar names this
host (direct mode on a shared filesystem: one watcher per run, no coordination needed
beyond `incidents.jsonl`'s lock). `tick()` runs one `Watcher.check()` per run when it is
due; the daemon loop calls it and wakes for `next_due`. A run's next pass is due
max(`HEALTH_INTERVAL`, `PACE` x its last pass's duration) after that pass ended, so
watching takes at most about 1/(1 + PACE) of a core whatever the run's size: a 16,384-rank
run whose passes take 0.15 s is still checked every 1.5 s, and a first pass of several
seconds is followed by a pause ten times as long instead of a busy core. Passes due within
SLACK of each other run in one wake-up (an idle exprd watching 64 runs wakes about once a
second, not 64 times), and a run's directory is looked at only when its pass is due. A
run in which nothing changed on its last pass waits twice as long each time, up to IDLE_MAX
intervals (exprd at rest: hang and crash detection on an idle run are a few seconds later,
against `hang_after`'s minutes); a pass that sees a change returns to the interval.
A run stops being watched `LINGER` seconds after its rank-0 writer is done.
Each recorded incident is one line of exprd's log: the `log` channel's when it was
delivered there, else a `health` line of its own.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.watch import Watcher
from expr_tracker.store.cursor import read_sidecar

log = logging.getLogger("exprd")
HEALTH_INTERVAL = 1.0  # seconds between passes over one run, at least
PACE = 10.0  # ... and at least this many times the last pass's duration
LINGER = 60.0  # keep watching a run this long after its rank-0 writer finished or crashed
ROOT_SCAN = 10.0  # seconds between scans of watch_roots for new runs
SLACK = 0.25  # a pass due this soon (as a share of the interval) runs in this wake-up
IDLE_MAX = 4  # a run that did not change is checked at least every this many intervals
BEAT_EVERY = 5.0  # seconds between touches of this host's heartbeat in each run directory


def touch_heartbeat(anchor: Path, run_dir: Path, host: str) -> None:
    """Create (once) and touch `{run_dir}/.exprd.<host>.json`, opened from the allowed
    root `anchor` down without following a symlink; ValueError when `run_dir` is not
    below `anchor`."""
    from expr_tracker.health.clock import heartbeat_name
    from expr_tracker.store.safedir import open_dir, open_file, write_all

    parts = run_dir.relative_to(anchor).parts
    dfd = open_dir(anchor, parts, create=False)
    try:
        fd = open_file(dfd, heartbeat_name(host), os.O_WRONLY | os.O_CREAT, where=run_dir)
    finally:
        os.close(dfd)
    try:
        if os.fstat(fd).st_size == 0:
            import orjson

            write_all(fd, orjson.dumps({"host": host, "pid": os.getpid()}))
        os.utime(fd)
    finally:
        os.close(fd)


class DaemonHealth:
    """The watchers of the runs this exprd is responsible for."""

    def __init__(self, cfg: HealthConfig, dispatcher: Any, watch_roots: list[Path] | None = None,
                 *, interval: float = HEALTH_INTERVAL) -> None:
        self.cfg = cfg
        self.dispatcher = dispatcher
        self.watch_roots = list(watch_roots or [])
        self.interval = interval
        self.watchers: dict[tuple[Path, str | None], Watcher] = {}
        self._until: dict[tuple[Path, str | None], float] = {}  # key -> stop watching after
        self._due: dict[tuple[Path, str | None], float] = {}  # key -> its next pass (monotonic)
        self.last_pass: dict[tuple[Path, str | None], float] = {}  # key -> seconds it took
        self._wait: dict[tuple[Path, str | None], float] = {}  # key -> the idle run's backoff
        self._next = 0.0  # the next look for new runs (spool tails, watch_roots)
        self._next_scan = 0.0
        self._here = socket.gethostname()
        self._warned: set[str] = set()
        self._beating = False  # live spool files write run directories: heartbeats due
        self._next_beat = 0.0
        # an incident delivered to a `log` channel is in exprd's log already: not twice
        from expr_tracker.alerts import LogChannel

        chans = getattr(dispatcher, "channels", ())
        self._logged = any(isinstance(ch, LogChannel) for ch in chans)

    @property
    def next_due(self) -> float:
        """When (monotonic) `tick` has work; inf when nothing is watched (nor beaten)."""
        if not self.watchers and not self.watch_roots and not self._beating:
            return float("inf")
        return self._soonest()

    def _beat(self, tails: Iterable[Any], now: float) -> None:
        """Touch this host's heartbeat in each run directory a live spool file of this
        exprd writes (DESIGN 8: a reader on another node tells a dead node's daemon from
        a quiet one). Every `BEAT_EVERY` seconds; a failure is logged once per run."""
        runs: dict[Path, Any] = {}
        for tail in tails:
            spec = getattr(getattr(tail, "run", None), "spec", None)
            if spec is not None and tail.state in ("new", "live"):
                runs.setdefault(spec.paths.run_dir, spec)
        self._beating = bool(runs)
        if now < self._next_beat or not runs:
            return
        self._next_beat = now + BEAT_EVERY
        for run_dir, spec in runs.items():
            try:
                touch_heartbeat(spec.anchor, run_dir, self._here)
            except FileNotFoundError:
                self._next_beat = now + self.interval  # its first rows are not applied yet
            except (OSError, ValueError) as exc:
                cause = f"{run_dir}:beat"
                if cause not in self._warned:
                    self._warned.add(cause)
                    log.warning("cannot write the heartbeat in %s: %s", run_dir,
                                getattr(exc, "strerror", None) or exc)

    def _soonest(self) -> float:
        return min(self._next, *self._due.values()) if self._due else self._next

    def _watch(self, run_dir: Path, stream: str | None, until: float) -> None:
        key = (run_dir, stream)
        if key not in self.watchers:
            if not os.path.isdir(run_dir):
                # a job's start: no row applied yet. Watched once it is there (a watcher
                # made now was dropped at its pass and made again, logged each time:
                # "watching health of" 5 times at a job's start, issue 54)
                return
            watcher = self.watchers[key] = Watcher(run_dir, self.cfg, self.dispatcher, stream=stream)
            log.info("watching health of %s%s%s", run_dir, f" (stream {stream})" if stream else "",
                     f"; {watcher.cache_note}" if watcher.cache_note else "")
        self._until[key] = max(self._until.get(key, 0.0), until)

    def _from_tails(self, tails: Iterable[Any], now: float) -> None:
        for tail in tails:
            run = getattr(tail, "run", None)
            spec = getattr(run, "spec", None)
            if spec is None or spec.rank != 0:
                continue
            live = tail.state in ("new", "live")
            self._watch(spec.paths.run_dir, spec.identity.get("stream"), now + (1e12 if live else LINGER))

    def _from_roots(self, now: float) -> None:
        for root in self.watch_roots:
            for side in _sidecars(root):
                meta = read_sidecar(side)
                if not meta or meta.get("status") != "running":
                    continue
                spool = meta.get("source") == "spool"
                if meta.get("origin_host" if spool else "host") != self._here or spool:
                    continue  # another node's run; a spool run's exprd watches it already
                self._watch(side.parent, None, now + LINGER)

    def _scan_roots(self, now: float) -> None:
        try:
            self._from_roots(now)
        except OSError as exc:  # a root gone or unreadable must not stop the daemon
            cause = f"watch_roots:{type(exc).__name__}"
            if cause not in self._warned:
                self._warned.add(cause)
                log.warning("looking for direct-mode runs under the watch roots failed: %s", exc)

    def final(self, now: float) -> int:
        """One more pass over every run watched (exprd stopping, its shards flushed): a
        run that ended since its last pass has its incidents resolved ("run ended") now,
        not left open for the next watcher to resolve as "open 42m" (issue 54: `make
        demo`'s straggler). No new run is looked for."""
        for key in self.watchers:
            self._due[key] = -math.inf
        self._next = math.inf
        return self.tick(now)

    def tick(self, now: float, tails: Iterable[Any] = ()) -> int:
        """A pass over each watched run that is due; returns the incidents recorded."""
        if now < self._soonest():  # (not `next_due`: new spool runs are looked for too)
            return 0
        if now >= self._next:
            self._next = now + self.interval
            tails = list(tails)
            self._beat(tails, now)
            self._from_tails(tails, now)
            if self.watch_roots and now >= self._next_scan:
                self._next_scan = now + ROOT_SCAN
                self._scan_roots(now)
        recorded = 0
        soon = now + SLACK * self.interval
        for key, watcher in list(self.watchers.items()):
            if now <= self._until.get(key, 0.0) and soon < self._due.get(key, 0.0):
                continue
            if now > self._until.get(key, 0.0) or not os.path.isdir(key[0]):
                del self.watchers[key]
                self._until.pop(key, None)
                self._due.pop(key, None)
                self.last_pass.pop(key, None)
                self._wait.pop(key, None)
                continue
            start = time.monotonic()
            found = 0
            note = watcher.cache_note
            try:
                for inc in watcher.check():  # on the watcher's own clock (DESIGN 13)
                    found += 1
                    if (inc.delivered or inc.paging is not None) and self._logged:
                        continue
                    log.log(logging.WARNING if inc.state == "open" else logging.INFO,
                            "health %s: %s %s ranks %s: %s", key[0], inc.state, inc.kind,
                            ",".join(map(str, inc.ranks)), inc.detail)
                if watcher.cache_note != note and watcher.cache_note:  # learned (`CacheLearner`)
                    log.info("health of %s: %s", key[0], watcher.cache_note)
                if watcher.write_error is not None and watcher.write_error not in self._warned:
                    self._warned.add(watcher.write_error)  # once per cause, the rest goes on
                    log.warning("health of %s: %s", key[0], watcher.write_error)
            except Exception as exc:  # a broken run directory must not stop the daemon
                cause = f"{key[0]}:{type(exc).__name__}"
                if cause not in self._warned:
                    self._warned.add(cause)
                    log.error("health check of %s failed: %r", key[0], exc)
            recorded += found
            end = time.monotonic()
            took = self.last_pass[key] = end - start
            state = watcher.state
            if found or state is None or state.changed:
                wait = self.interval
            else:
                wait = min(IDLE_MAX * self.interval, 2 * self._wait.get(key, self.interval / 2))
            self._wait[key] = wait
            self._due[key] = end + max(wait, PACE * took)
        return recorded


def _sidecars(root: Path) -> list[Path]:
    """`root/*/*/metrics.meta.json`, each directory listed on its own: a name the listing
    gives and a lookup then says is not there (a shared filesystem's cached failed lookup,
    NFS's or a FUSE mount's negative entry, or a run deleted meanwhile) is skipped, not
    raised (pathlib's glob raised FileNotFoundError for it, and exprd stopped)."""
    return [run / "metrics.meta.json" for project in _subdirs(root) for run in _subdirs(project)]


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            names = [e.name for e in it if _is_dir(e)]
    except OSError:
        return []
    return [path / n for n in sorted(names)]


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
