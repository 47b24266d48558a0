"""exprd: tail the node's spool and apply it (shards, rules, alerts, backends).

    exprd --spool DIR --state DIR [--config FILE] [--poll] [--once] [--allow-root]
    exprd --replay --spool DIR --state DIR [--config FILE] [--dry-run] [--progress json]

One thread does the work: a watchdog observer only wakes it up, and a periodic rescan
finds whatever inotify missed. SIGTERM drains and checkpoints (exit 0 within 10 s);
SIGHUP reloads the config. Logs go to stderr.

`--replay` is one pass without live tails, then exit: the engine behind `expr replay`,
which runs it as a child process and reads `--progress json` lines from its stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import os
import resource
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from expr_tracker.errors import TrackerError
from expr_tracker.store.layout import spool_segment
from expr_tracker.store.safedir import make_private_dirs

from . import config as config_mod
from . import retire
from . import status as status_mod
from .config import Config, ConfigError
from .durable import Durable
from .filetail import FileTail
from .notify import Notifier
from .presence import Locked, Presence, hold
from .progress import JsonProgress, replay_summary
from .state import StateDir
from .tailer import Tailer
from .waker import Waker

log = logging.getLogger("exprd")
STATUS_HEARTBEAT = 30.0  # seconds between status.json rewrites when nothing changed
ONCE_BACKEND_WAIT = 60.0  # --once: seconds a backend may go without progress before exit
LAGGING_POLL = 0.05  # seconds between reads for a backend behind its shard
DRAIN_SECONDS = 6.0  # of the 10 s systemd (and the tests) allow after SIGTERM
# files pumped between two commits in a long round: the pipelines of the segments read
# meanwhile are closed (and applied rolled ones deleted), so a backlog of 100,000
# segments holds a few hundred open, not all of them
BATCH = 512
Progress = Callable[[int, int, int], None]


def build_dispatcher(cfg: Config) -> Any:
    """The alert dispatcher of the daemon's own channels (URLs and tokens live here).

    A `log` channel logs through exprd's log (stderr) only: one line per alert."""
    from expr_tracker.alerts import Dispatcher, LogChannel, load_config

    dispatcher = Dispatcher.from_config(load_config(cfg.alert))
    for ch in dispatcher.channels:
        if isinstance(ch, LogChannel):
            ch.echo = False
    return dispatcher


def _order(tail: FileTail) -> tuple[str, str, int]:
    """Files by directory, then session, then segment index (not by name: ~10 < ~9)."""
    path = tail.path
    return (str(path.parent), *spool_segment(path.name))


def _unsafe(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


class Daemon:
    """The spool applier; `run()` is the daemon loop, `run_once()` one full pass (replay)."""

    def __init__(self, cfg: Config, *, poll: bool = False, replay: bool = False,
                 dry_run: bool = False, notifier: Notifier | None = None,
                 config_path: str | None = None, overrides: dict[str, Any] | None = None,
                 once: bool = False) -> None:
        if cfg.spool is None or cfg.state is None:
            raise ConfigError("both spool and state are required (--spool/--state or the config)")
        self.cfg = cfg
        self.spool = cfg.spool.resolve()
        self.state = cfg.state
        self.poll = poll
        self.replay = replay
        self.dry_run = dry_run
        self.config_path = config_path
        self.overrides = overrides or {}
        self.notifier = notifier or Notifier(None)
        self.sdir = StateDir(self.state, readonly=dry_run)
        self.presence = Presence(self.spool, self.state)
        if not dry_run:
            # one exprd per state directory and per spool root: a second one exits 2
            self._lock_fd = hold(self.state, "the state directory")
            if not replay and not self.spool.exists():
                # a daemon waiting for the first run still leaves its heartbeat, so that
                # run's init does not warn that no exprd is running (0700, as the SDK does)
                make_private_dirs(self.spool)
                log.info("created the spool root %s", self.spool)
            self.presence.claim()
        self.dispatcher = None if dry_run else build_dispatcher(cfg)
        self.wake = Waker()  # set from signal handlers too: never a threading.Event
        # checkpoints, sidecars, status.json and the heartbeat are stored (fsync) on this
        # thread: the loop goes on reading meanwhile (see durable)
        self.durable = Durable(self.wake.set)
        self.presence.durable = self.durable
        self.tailer = Tailer(cfg, self.spool, self.state, dispatcher=self.dispatcher,
                             dry_run=dry_run, live=not replay, state_dir=self.sdir,
                             max_open=cfg.open_files_bound(), durable=self.durable)
        # the health watcher runs in the daemon loop only (`--once` applies and exits): its
        # modules (detectors, statistics) are imported for it alone
        self.health = None if replay or dry_run or once else _health(cfg, self.dispatcher)
        self.stopping = False
        self.reload_requested = False
        self.started = time.time()
        self.refused: dict[str, str] = {}
        self._other_owner = set()  # spool files of another user, logged once each
        self.watcher: Any = None
        if not replay and cfg.allowed_roots is None:
            log.warning("no allowed_roots configured: runs may write anywhere this user can")

    # -- discovery -----------------------------------------------------------------------
    def _refuse_path(self, path: str, reason: str) -> None:
        if self.refused.get(path) != reason:
            self.refused[path] = reason
            log.error("refusing %s: %s", path, reason)
            self.tailer.quarantine.put(Path(path), 0, 0, f"refused: {reason}", copy=False)
        tail = self.tailer.tails.get(path)
        if tail is not None:
            self.tailer.refuse(tail, reason)

    def _entries(self, path: str, depth: int) -> list[os.DirEntry[str]]:
        """Safe entries of a spool directory: no symlinks, nothing others can write."""
        out: list[os.DirEntry[str]] = []
        try:
            it = list(os.scandir(path))
        except OSError as exc:
            self.tailer.errors[f"scan:{path}"] = self.tailer.errors.get(f"scan:{path}", 0) + 1
            if self.tailer.errors[f"scan:{path}"] == 1:
                log.warning("cannot list %s: %s", path, exc.strerror or exc)
            return out
        for entry in it:
            if entry.name.startswith("."):
                continue
            if depth == 2 and not entry.name.endswith(".jsonl"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                self._refuse_path(entry.path, f"symlink to {os.readlink(entry.path)!r} in the spool")
                continue
            want = stat.S_ISREG if depth == 2 else stat.S_ISDIR
            if not want(st.st_mode):
                continue
            if _unsafe(st.st_mode):
                self._refuse_path(entry.path, "writable by other users")
                continue
            if depth == 2 and not self._owner_ok(entry.path, st.st_uid):
                continue
            out.append(entry)
        return out

    def _owner_ok(self, path: str, uid: int) -> bool:
        """A spool file of a user `allowed_uids` does not list is refused; without the key,
        one of another user than the spool root's owner is applied and logged once."""
        allowed = self.cfg.allowed_uids
        if allowed is not None:
            if uid in allowed:
                return True
            self._refuse_path(path, f"owned by uid {uid}, which allowed_uids does not list")
            return False
        if uid != self._spool_uid and path not in self._other_owner:
            self._other_owner.add(path)
            log.warning("%s is owned by uid %d, not by the spool root's owner (uid %d); "
                        "applied (allowed_uids in the config refuses such files)", path, uid,
                        self._spool_uid)
        return True

    _spool_uid = -1  # the spool root's owner, read at each scan
    _held: list[FileTail] = []  # read in a long round, not closed yet (see `_settle`)
    _other_owner: set[str]

    def scan(self) -> list[FileTail]:
        """Walk `{spool}/{project}/{name}/*.jsonl` and track every acceptable file."""
        try:
            st = os.stat(self.spool)
        except OSError:
            return []
        if _unsafe(st.st_mode):
            self._refuse_path(str(self.spool), "spool directory is writable by other users")
            return []
        self._spool_uid = st.st_uid
        seen = []
        for proj in self._entries(str(self.spool), 0):
            for run in self._entries(proj.path, 1):
                for f in self._entries(run.path, 2):
                    # a file tracked already is found by its name (a Path costs ~10 us)
                    known = self.tailer.tails.get(f.path)
                    seen.append(known if known is not None else self.tailer.track(Path(f.path)))
        return seen

    # -- one pass ------------------------------------------------------------------------
    def pump(self, tails: list[FileTail], progress: Progress | None = None) -> list[FileTail]:
        """One round over `tails`, each session's segments in their order; returns those
        with more complete lines waiting."""
        more = []
        tails = sorted(tails, key=_order)
        last = len(tails) - 1
        for i, tail in enumerate(tails):
            if self.stopping:
                break
            if self.tailer.pump(tail):
                more.append(tail)
            if i % BATCH == BATCH - 1 and i < last:
                self._settle(tails[i + 1 - BATCH : i + 1])
            if progress is not None and (i % BATCH == BATCH - 1 or i == last):
                progress(i + 1, len(tails), self.tailer.applied_total())
        return more

    def _settle(self, batch: list[FileTail]) -> None:
        """Commit `batch` in the middle of a long round: the pipelines of the segments
        read are closed, the rolled ones deleted once applied (those a backend still
        reads are looked at again with the next batch)."""
        batch = self._held + batch
        self.tailer.commit(only=batch)
        if self.tailer.rolled_seen and not self.dry_run:
            retire.expire_rolled(self.tailer, batch)
        self._held = [t for t in batch if t.run is not None and t.state != "live"
                      and self.tailer.tails.get(t.key) is t][-BATCH:]

    def check_crashes(self) -> None:
        now = time.time()
        alive: dict[tuple[int, int | None], bool] = {}  # a writer of many files, looked at once
        for tail in list(self.tailer.tails.values()):
            retire.check_crash(self.tailer, tail, now, alive)

    def run_once(self, progress: Progress | None = None) -> dict[str, Any]:
        """Apply everything complete in the spool once (replay and --once); returns status."""
        with fewer_collections():
            return self._run_once(progress)

    def _run_once(self, progress: Progress | None) -> dict[str, Any]:
        tails = self.scan()
        todo = tails
        seen, since = -1, time.monotonic()
        while not self.stopping:
            if todo:
                todo = self.pump(todo, progress)
                self.tailer.commit()
                continue
            # the shards are done; backends read on behind them while they make progress
            lagging = self.tailer.lagging()
            if not lagging:
                break
            done = sum(t.run.forwarder.progressed() for t in lagging if t.run is not None)
            if done != seen:
                seen, since = done, time.monotonic()
            elif time.monotonic() - since > ONCE_BACKEND_WAIT:
                log.warning("backends made no progress for %.0f s; what they lack stays in the "
                            "spool for the next exprd", ONCE_BACKEND_WAIT)
                break
            time.sleep(0.02)
            todo = lagging
        self.check_crashes()
        self.tailer.close()
        # as the daemon does: a rolled segment applied everywhere is deleted at once, a
        # finished file after `retention` (a replay leaves only what is still needed)
        if not self.dry_run and retire.expire(self.tailer, time.time()):
            self.tailer.save_checkpoints()
        doc = self.status(wait=True)
        self.durable.close()
        if self.dispatcher is not None:
            self.dispatcher.close(5.0)
        return doc

    def status(self, *, wait: bool = False) -> dict[str, Any]:
        """Build the status document and store it if it changed (on the writer thread;
        `wait`: until it is on disk)."""
        mode = "replay" if self.replay else ("poll" if self.poll else "inotify")
        doc = status_mod.build(self.tailer, started=self.started, mode=mode,
                               dispatcher=self.dispatcher,
                               extra={"refused_paths": dict(self.refused)})
        if not self.dry_run:
            # an idle daemon must stay idle: rewrite only what changed, plus a heartbeat
            same = {k: v for k, v in doc.items() if k != "updated"}
            now = time.monotonic()
            key = str(self.sdir.path / status_mod.STATUS_FILE)
            if same != self._last_status or now - self._status_written >= STATUS_HEARTBEAT:
                self._last_status, self._status_written = same, now
                data, sdir = status_mod.encode(doc), self.sdir
                if wait and not self.durable.pending(key):
                    # here, not behind the sidecars queued on the writer thread (nothing
                    # orders the two)
                    try:
                        sdir.write_atomic(status_mod.STATUS_FILE, data)
                    except OSError as exc:
                        self._status_stored(exc)
                else:
                    self.durable.submit(key, lambda: sdir.write_atomic(status_mod.STATUS_FILE,
                                                                       data), self._status_stored)
            if wait:
                self.durable.wait(key)
        return doc

    def _status_stored(self, exc: BaseException | None) -> None:
        if exc is None:
            return
        # a read-only or full state dir: retried each round, logged once per cause (and
        # hourly with its count), counted in `errors`
        self._last_status = None
        if isinstance(exc, OSError):
            cause, why = errno.errorcode.get(exc.errno or 0, type(exc).__name__), exc.strerror or exc
        else:
            cause, why = type(exc).__name__, exc
        self.tailer.warn(f"status:{cause}", f"cannot write status.json in {self.sdir.path}: {why}")

    _last_status: dict[str, Any] | None = None
    _status_written = float("-inf")

    # -- the daemon loop -------------------------------------------------------------------
    def _changed(self) -> list[FileTail]:
        """Tracked files whose size differs from what was consumed (found by stat)."""
        out = []
        for tail in list(self.tailer.tails.values()):
            try:
                st = tail.path.stat()
            except FileNotFoundError:
                if tail.state in ("finished", "refused") or tail.committed >= tail.size:
                    self.tailer.vanished(tail)  # (a moved segment is counted, see there)
                continue
            except OSError:
                continue
            tail.mtime = st.st_mtime
            if st.st_size != tail.offset or st.st_ino != tail.ino:
                out.append(tail)  # the pump tells a rotated or truncated file apart
        return out

    def run(self) -> int:
        """Serve until SIGTERM; returns the exit code."""
        from .watcher import Watcher

        rescan = self.cfg.rescan_interval
        self.watcher = Watcher(self.spool, self.wake, poll=self.poll,
                               poll_interval=min(1.0, rescan))
        self.watcher.start()
        with fewer_collections():
            todo = self.scan()
            while todo and not self.stopping:
                todo = self.pump(todo)
                self.tailer.commit()
                self._ping()
            self.check_crashes()
            # every sidecar and the checkpoint on their way, not waited for: a restart before
            # they land reads again what they cover (2,048 sidecars are seconds of fsyncs)
            self.tailer.commit(force=True, wait=False)
            self.presence.beat(force=True)  # before the first status: ready means both are there
            self.status(wait=True)
        self.notifier.ready(f"tailing {len(self.tailer.tails)} spool files")
        self._ping()
        log.info("ready: %s (%d files, %s)", self.spool, len(self.tailer.tails),
                 "poll" if self.poll else "inotify")
        # what start-up built lives as long as the daemon: keep the collector off it
        gc.collect()
        gc.freeze()
        now = time.monotonic()
        next_rescan = next_status = now + rescan
        next_tick = now + 1.0
        busy: list[FileTail] = []
        lagging: list[FileTail] = []
        while not self.stopping:
            now = time.monotonic()
            due = min(next_rescan, next_status, next_tick, self._next_ping,
                      self.health.next_due if self.health else float("inf"))
            if not busy:
                self.wake.wait(max(0.0, min(due - now, LAGGING_POLL if lagging else due - now)))
            self.wake.clear()
            self.durable.collect()  # what the writer thread stored (or failed to) meanwhile
            if self.reload_requested:
                self.reload()
            dirty, dir_changed = self.watcher.take()
            now = time.monotonic()
            due_now = {t.key: t for t in busy}
            if dir_changed or any(p not in self.tailer.tails for p in dirty):
                self.scan()
            for p in dirty:
                tail = self.tailer.tails.get(p)
                if tail is not None:
                    due_now[p] = tail
            if now >= next_rescan:
                next_rescan = now + self.cfg.rescan_interval
                if not self.watcher.running:
                    self.watcher.start()
                if not self._claim():
                    return self.shutdown(2)
                self.scan()
                due_now.update((t.key, t) for t in self._changed())
                self.check_crashes()
                retire.expire(self.tailer, time.time())
            lagging = self.tailer.lagging()
            due_now.update((t.key, t) for t in lagging)  # backends read on as they drain
            busy = self.pump(list(due_now.values()))
            if due_now or self.tailer.forwarding() or self.tailer.blocked():
                # an idle daemon has nothing to flush or checkpoint; a blocked shard retries
                self.tailer.commit()
            if self.tailer.rolled_seen and not self.dry_run:
                # a segment the writer went on from: deleted once applied (a bounded spool)
                self.tailer.rolled_seen = retire.expire_rolled(self.tailer)
            self.presence.beat()
            if now >= next_tick:
                # time rules (no_data, age, elapsed) need a clock; without them, no wake-ups
                next_tick = now + (1.0 if self.tailer.has_time_rules() else self.cfg.rescan_interval)
                self.tailer.tick(time.time())
            if self.health is not None:
                self.health.tick(now, self.tailer.tails.values())
            if now >= next_status:
                next_status = now + self.cfg.status_interval
                self.status()
            self._ping()
        return self.shutdown()

    _next_ping = float("inf")

    def _ping(self) -> None:
        interval = self.notifier.watchdog_interval()
        if interval is None:
            return
        now = time.monotonic()
        if now >= self._next_ping or self._next_ping == float("inf"):
            self.notifier.watchdog()
            self._next_ping = now + interval

    def _claim(self) -> bool:
        """Lock the spool root once it exists; False if another exprd has it."""
        try:
            self.presence.claim()
        except Locked as exc:
            log.error("%s; stopping", exc)
            return False
        return True

    def shutdown(self, code: int = 0) -> int:
        """Drain: flush shards, checkpoint, give backends and alerts a few seconds."""
        self.notifier.stopping()
        log.info("stopping: flushing shards and checkpoints")
        if self.watcher is not None:
            self.watcher.stop()
        self.tailer.close(timeout=DRAIN_SECONDS / 2)
        if self.health is not None:
            self.health.final(time.monotonic())
        if self.dispatcher is not None:
            self.dispatcher.close(DRAIN_SECONDS / 3)
        self.status(wait=True)
        self.durable.close()
        self.notifier.close()
        return code

    def reload(self) -> None:
        """SIGHUP: re-read the config; spool and state stay as they were.

        Whatever fails (a bad file, a channel whose secret is not in the environment)
        keeps the old config, with one line saying why.
        """
        self.reload_requested = False
        try:
            self._reload()
        except (TrackerError, OSError, ValueError, TypeError, KeyError) as exc:
            log.error("reload failed, keeping the old config: %s", _reason(exc))

    def _reload(self) -> None:
        cfg = config_mod.load(self.config_path)
        cfg = replace(cfg, **{k: v for k, v in self.overrides.items() if v is not None})
        if (cfg.spool is not None and cfg.spool.resolve() != self.spool) or cfg.state != self.state:
            log.warning("reload: spool and state cannot change without a restart; kept")
        cfg.spool, cfg.state = self.cfg.spool, self.cfg.state
        dispatcher = build_dispatcher(cfg) if cfg.alert != self.cfg.alert else None
        # from here on nothing fails: the new config takes effect as a whole
        if dispatcher is not None:
            old, self.dispatcher = self.dispatcher, dispatcher
            self.tailer.dispatcher = self.dispatcher
            for tail in self.tailer.tails.values():
                if tail.run is not None and tail.run.alerting:
                    tail.run.pipeline.dispatcher = self.dispatcher
            if old is not None:
                threading.Thread(target=old.close, args=(5.0,), daemon=True).start()
        self.cfg = cfg
        self.tailer.cfg = cfg
        if self.health is not None:
            self.health = _health(cfg, self.dispatcher)
        self.tailer.recheck(cfg)  # a narrower allowed_roots applies to open runs too
        log.info("reloaded %s", self.config_path or "the defaults")


def _health(cfg: Config, dispatcher: Any) -> Any:
    """The daemon's health watcher (exprd.health.DaemonHealth) for `cfg`."""
    from .health import DaemonHealth, HealthConfig

    return DaemonHealth(cfg.health or HealthConfig(), dispatcher, cfg.watch_roots)


@contextlib.contextmanager
def fewer_collections(gen0: int = 100_000) -> Iterator[None]:
    """The collector runs about 100 times less often within (cycles are still collected).

    A catch-up builds what lives as long as the daemon (a tail, a shard slot and a
    pipeline per spool file) and parses blocks of thousands of records at once: each
    collection went over all of it again, a quarter second of 2,048 files' start-up."""
    old = gc.get_threshold()
    gc.set_threshold(gen0, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _raise_nofile() -> None:
    """One descriptor per open shard: lift the soft limit to the hard one."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 65536
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exprd", description=__doc__.split("\n\n")[0])
    from expr_tracker import __version__

    p.add_argument("--version", action="version", version=f"exprd (expr-tracker) {__version__}")
    p.add_argument("--spool", help="spool root to tail (overrides the config)")
    p.add_argument("--state", help="state directory: checkpoints, quarantine, status.json")
    p.add_argument("--config", help="TOML config file (see exprd.config)")
    p.add_argument("--poll", action="store_true", help="use a polling observer (no inotify)")
    p.add_argument("--once", action="store_true", help="apply what is there, then exit")
    p.add_argument("--replay", action="store_true",
                   help="one pass as `expr replay` does (no live tails, no systemd), then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="with --once/--replay: read and check everything, write nothing")
    p.add_argument("--progress", choices=["json"],
                   help="with --once/--replay: JSON lines on stdout (progress, then a summary)")
    p.add_argument("--allow-root", action="store_true", help="allow running as root")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


class _Signals:
    """Signals that arrive before the daemon exists are remembered, not fatal."""

    daemon: Daemon | None = None
    stop = False
    reload = False

    waking = False

    @classmethod
    def _wake(cls) -> None:
        # A handler runs between two bytecodes, so a storm of signals nests handlers inside
        # the os.write of the one before, deep enough for a RecursionError that ended exprd.
        # A handler that finds another one waking the loop only sets its flag: that wake-up
        # is not even consumed yet, and the loop reads the flags after it.
        if cls.waking or cls.daemon is None:
            return
        cls.waking = True
        try:
            cls.daemon.wake.set()
        finally:
            cls.waking = False

    @classmethod
    def on_term(cls, signum: int, frame: Any) -> None:
        cls.stop = True
        if cls.daemon is not None:
            cls.daemon.stopping = True
            cls._wake()

    @classmethod
    def on_hup(cls, signum: int, frame: Any) -> None:
        if cls.daemon is not None:
            cls.daemon.reload_requested = True
            cls._wake()

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, cls.on_term)
        signal.signal(signal.SIGINT, cls.on_term)
        signal.signal(signal.SIGHUP, cls.on_hup)


def entry(argv: list[str] | None = None) -> int:
    """The `exprd` console script."""
    _Signals.install()
    p = parser()
    args = p.parse_args(argv)
    one_pass = args.once or args.replay
    if (args.dry_run or args.progress) and not one_pass:
        p.error("--dry-run and --progress need --once or --replay")
    fmt, level = "exprd %(levelname)s %(message)s", args.log_level.upper()
    report = JsonProgress() if args.progress == "json" else None
    if report is None:
        logging.basicConfig(stream=sys.stderr, level=level, format=fmt)
    else:
        # only exprd's own records get the prefix (the reader turns them into warnings);
        # a library's warnings reach stderr bare (logging's last resort), alert lines once
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt))
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    # httpx logs every request at INFO: one line per backend batch is noise, failures are
    # reported by the backends themselves, once per cause
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))

    def fail(message: str, code: int = 2) -> int:
        if report is not None:
            report.error(message)
        else:
            print(f"exprd: {message}", file=sys.stderr)
        return code

    if os.geteuid() == 0 and not args.allow_root:
        return fail("refusing to run as root (use a dedicated user, or pass --allow-root)")
    overrides: dict[str, Any] = {
        "spool": Path(args.spool).absolute() if args.spool else None,
        "state": Path(args.state).absolute() if args.state else None,
    }
    _raise_nofile()
    try:
        cfg = config_mod.load(args.config)
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
        # a replay is a command, not a service: it never talks to systemd
        daemon = Daemon(cfg, poll=args.poll, replay=args.replay, dry_run=args.dry_run,
                        notifier=Notifier(None) if args.replay else Notifier.from_env(),
                        config_path=args.config, overrides=overrides, once=args.once)
    except Locked as exc:
        return fail(str(exc))
    except (TrackerError, OSError, ValueError) as exc:  # ConfigError, a bad alert config
        return fail(str(exc) if report is None else _reason(exc))
    _Signals.daemon = daemon
    daemon.stopping = _Signals.stop
    if not one_pass:
        return daemon.run()
    if report is None:
        daemon.run_once()
        return 0
    try:
        doc = daemon.run_once(report)
    except (TrackerError, OSError, ValueError) as exc:
        return fail(_reason(exc), 1)
    report.summary(replay_summary(doc, args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(entry())
