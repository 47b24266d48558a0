"""Tailing spool files: per-file offsets, checkpoints, quarantine and crash detection.

Each spool file is read from its checkpoint (the byte offset after the last complete
line applied, per consumer: the shard and each backend). Checkpoints are written
atomically to `{state}/checkpoints.json` only after the shard data they cover has been
flushed; the shard's own `_sid`/`_seq` fields make a re-read after a crash harmless.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.procs import pid_alive
from expr_tracker.store.spoolfile import SpoolReader

from .applier import RunPipeline, ShardPool
from .config import Config
from .forwarder import drop_journals
from .spec import InitError, check_init
from .state import Checkpoints, Quarantine

log = logging.getLogger("exprd")
MAX_LOGGED = 10  # quarantine log lines per file; the rest are counted in status.json
HOST = socket.gethostname()


@dataclass
class FileTail:
    """What exprd knows about one spool file."""

    path: Path
    ino: int = 0
    offset: int = 0  # next byte to read: every line before it is consumed
    committed: int = 0  # offset covered by flushed shard data (what the checkpoint says)
    seq: int = -1  # last `_seq` consumed
    state: str = "new"  # new | live | finished | crashed | refused
    reason: str = ""
    host: str = ""
    pid: int | None = None
    pid_start: int | None = None
    size: int = 0
    mtime: float = 0.0
    behind_since: float | None = None
    backends: dict[str, int] = field(default_factory=dict)
    run: RunPipeline | None = None
    logged: int = 0
    quarantined: int = 0
    applied: int = 0  # record events written to the shard by this process
    skipped: int = 0  # record events the shard already held

    @property
    def key(self) -> str:
        return str(self.path)

    def checkpoint(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ino": self.ino, "shard": self.committed, "seq": self.seq,
                               "state": self.state, "host": self.host, "pid": self.pid,
                               "pid_start": self.pid_start}
        if self.reason:
            out["reason"] = self.reason
        if self.backends:
            out["backends"] = dict(self.backends)
        return out


class Tailer:
    """Reads spool files and hands their events to per-file pipelines."""

    def __init__(self, cfg: Config, spool_root: Path, state: Path, *, dispatcher: Any = None,
                 dry_run: bool = False, live: bool = True) -> None:
        self.cfg = cfg
        self.spool_root = spool_root
        self.state = state
        self.dispatcher = dispatcher
        self.dry_run = dry_run
        self.live = live  # a daemon (time rules, retention) rather than a one-shot replay
        self.pool = ShardPool(self._warn)
        self.checkpoints = Checkpoints(state / "checkpoints.json", readonly=dry_run)
        self.quarantine = Quarantine(state / "quarantine", readonly=dry_run)
        self.tails: dict[str, FileTail] = {}
        self.errors: dict[str, int] = {}

    def _warn(self, cause: str, message: str) -> None:
        self.errors[cause] = self.errors.get(cause, 0) + 1
        log.warning("%s", message)

    # -- files ---------------------------------------------------------------------------
    def track(self, path: Path) -> FileTail:
        """The tail of `path`, resumed from its checkpoint when the file is the same inode."""
        key = str(path)
        tail = self.tails.get(key)
        if tail is not None:
            return tail
        tail = FileTail(path)
        try:
            st = path.stat()
            tail.ino, tail.size, tail.mtime = st.st_ino, st.st_size, st.st_mtime
        except OSError:
            pass
        cp = self.checkpoints.files.get(key)
        if cp and cp.get("ino") == tail.ino and isinstance(cp.get("shard"), int):
            tail.offset = tail.committed = min(cp["shard"], tail.size)
            tail.seq = int(cp.get("seq", -1))
            tail.state = str(cp.get("state", "new"))
            tail.reason = str(cp.get("reason", ""))
            tail.host, tail.pid = str(cp.get("host", "")), cp.get("pid")
            tail.pid_start = cp.get("pid_start")
            tail.backends = {str(k): int(v) for k, v in (cp.get("backends") or {}).items()}
            back = min(tail.backends.values(), default=tail.offset)
            if back < tail.offset:
                self._rewind(tail, back)
        self.tails[key] = tail
        return tail

    def _rewind(self, tail: FileTail, offset: int) -> None:
        """Backends are behind the shard: read again from the slowest one, as if first there.

        The tail's seq becomes the one before the line at `offset` (from the start if that
        line is unreadable), and a finished file is live until its finish is read again.
        """
        seq = None
        for _start, _end, line in SpoolReader(tail.path).lines(offset, 1):
            try:
                ev = orjson.loads(line) if line is not None else None
            except orjson.JSONDecodeError:
                ev = None
            seq = ev.get("_seq") if isinstance(ev, dict) else None
            break  # lines() goes on to the end of the block it read
        if type(seq) is int and seq > 0:
            tail.offset, tail.seq = offset, seq - 1
        else:
            tail.offset, tail.seq = 0, -1
        if tail.state == "finished":
            tail.state = "live"

    def forget(self, tail: FileTail) -> None:
        if tail.run is not None:
            tail.run.close()
            tail.run = None
        self.tails.pop(tail.key, None)
        self.checkpoints.drop(tail.key)
        if not self.dry_run and not tail.path.exists():
            # the file is gone (retention, or by hand): its batch journals go with it
            try:
                drop_journals(self.state, tail.path.relative_to(self.spool_root).as_posix())
            except ValueError:
                pass  # not under the spool root: it has none

    def _log_bad(self, tail: FileTail, start: int, end: int, reason: str, copy: bool = True) -> None:
        tail.quarantined += 1
        self.quarantine.put(tail.path, start, end, reason, copy=copy)
        tail.logged += 1
        if tail.logged <= MAX_LOGGED:
            more = "; further ones in this file are only counted" if tail.logged == MAX_LOGGED else ""
            log.warning("quarantined %s offset %d (%d bytes): %s%s", tail.path, start,
                        end - start, reason, more)

    def refuse(self, tail: FileTail, reason: str) -> None:
        """Stop applying a file for good (bad init, unsafe path), with one log line."""
        if tail.state != "refused":
            log.error("refusing %s: %s", tail.path, reason)
            self.quarantine.put(tail.path, 0, 0, f"refused: {reason}", copy=False)
        tail.state, tail.reason = "refused", reason
        if tail.run is not None:
            tail.run.close()
            tail.run = None

    def _open_run(self, tail: FileTail, ev: dict[str, Any]) -> bool:
        try:
            spec = check_init(ev, tail.path, self.spool_root, self.cfg)
        except InitError as exc:
            self.refuse(tail, str(exc))
            return False
        tail.host, tail.pid, tail.pid_start = spec.host, spec.pid, spec.pid_start
        tail.run = RunPipeline(spec, self.pool, self.cfg, self.dispatcher, tail.backends,
                               dry_run=self.dry_run)
        if tail.state in ("new", "crashed"):
            tail.state = "live"
        return True

    def _ensure_run(self, tail: FileTail) -> bool:
        """Rebuild the pipeline of a file resumed from a checkpoint by reading its init line."""
        if tail.run is not None or tail.offset == 0:
            return True
        for _start, end, line in SpoolReader(tail.path).lines(0, 1):
            try:
                ev = orjson.loads(line) if line is not None else None
            except orjson.JSONDecodeError:
                ev = None
            if not isinstance(ev, dict) or ev.get("_event") != "init" or ev.get("_seq") != 0:
                self.refuse(tail, "the first line is not an init event")
                return False
            if not self._open_run(tail, ev):
                return False
            assert tail.run is not None
            if tail.run.rules is not None and tail.run.rules.rules:
                # rebuild rule windows from the start; the shard's seqs skip what it holds
                tail.offset, tail.seq = end, 0
            return True
        return False  # the init line is not complete yet

    # -- reading -------------------------------------------------------------------------
    def pump(self, tail: FileTail, budget: int = 4 << 20) -> bool:
        """Apply up to `budget` bytes of new complete lines; True if more are waiting."""
        if tail.state == "refused":
            return False
        if tail.run is not None and tail.run.forwarder.busy():
            return False  # a backend is far behind: wait instead of dropping
        if tail.run is None and tail.state in ("finished", "crashed"):
            try:
                size = tail.path.stat().st_size
            except OSError:
                return False
            if size <= tail.offset:
                return False
        if not self._ensure_run(tail):
            return False
        reader = SpoolReader(tail.path)
        run = tail.run
        paused = False
        try:
            if run is None or not run.plain or tail.state != "live":
                for start, end, line in reader.lines(tail.offset, budget):
                    self._line(tail, start, end, line)
                    tail.offset = end
                    if tail.state == "refused":
                        tail.offset = reader.size
                        return False
                    run = tail.run
                    if run is not None and run.plain and tail.state == "live":
                        break  # the init is in: the rest takes the plain path
                    if run is not None and run.forwarder.active and run.forwarder.busy():
                        paused = True  # a backend queue is full: read on once it drains
                        break
                else:
                    run = None
            if run is not None and run.plain and tail.state == "live":
                self._pump_plain(tail, run, reader, budget)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._warn(f"read:{tail.path}", f"cannot read {tail.path}: {exc.strerror or exc}")
            return False
        tail.size = reader.size
        return reader.more or paused

    def _pump_plain(self, tail: FileTail, run: RunPipeline, reader: SpoolReader,
                    budget: int) -> None:
        """The hot path of a run without rules or backends: records go straight to the shard.

        It does what `_line` and `Pipeline.apply` do for such a run (the pipeline would
        only append the line); anything unusual takes the general path.
        """
        loads, decode_error = orjson.loads, orjson.JSONDecodeError
        suffix, skip, max_line = run.suffix, run.skip_upto, reader.max_line
        append: Callable[[bytes], None] | None = run.slot.writer.append if run.slot.opened else None
        seq = tail.seq
        last = applied = 0
        try:
            for pos, parts, big_end in reader.chunks(tail.offset, budget):
                if big_end is not None:
                    tail.seq = seq
                    self._line(tail, pos, big_end, None)
                    tail.offset = big_end
                    continue
                for line in parts:
                    end = pos + len(line) + 1
                    if line[-1:] == b"}" and seq >= skip and len(line) <= max_line:
                        try:
                            ev = loads(line)
                        except decode_error:
                            ev = None
                        if (ev.__class__ is dict and ev.get("_seq") == seq + 1
                                and "_event" not in ev and "_sid" not in ev):
                            if append is None:
                                append = run.prepare()
                            seq += 1
                            append(line[:-1] + suffix)  # the spool line verbatim, plus `_sid`
                            applied += 1
                            last = seq
                            pos = end
                            continue
                    tail.seq = seq
                    self._line(tail, pos, end, line if len(line) <= max_line else None)
                    seq = tail.seq
                    pos = tail.offset = end
                    if tail.state != "live":
                        return
                tail.offset = pos
        finally:
            tail.seq = seq
            if applied:
                tail.applied += applied
                run.applied += applied
                pending = run.slot.pending
                pending[run.spec.session] = max(last, pending.get(run.spec.session, -1))

    def _line(self, tail: FileTail, start: int, end: int, line: bytes | None) -> None:
        if line is None:
            self._log_bad(tail, start, end, "line over 16 MiB")
            return
        try:
            ev = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            why = "not UTF-8" if "utf-8" in str(exc).lower() else "not JSON"
            self._log_bad(tail, start, end, why)
            return
        seq = ev.get("_seq") if type(ev) is dict else None
        if type(seq) is not int or seq < 0:
            self._log_bad(tail, start, end, "not an event (a JSON object with _seq)")
            return
        kind = ev.get("_event")
        run = tail.run
        if run is None:
            if kind != "init" or seq != 0:
                self._log_bad(tail, start, end, "event before its init")
            else:
                self._open_run(tail, ev)
                tail.seq = 0
            return
        if seq <= tail.seq:
            self._log_bad(tail, start, end, f"_seq repeat: {seq} after {tail.seq}")
            return
        if seq != tail.seq + 1:
            # events went missing (the writer dropped them): say so, keep this one
            self._log_bad(tail, start, start, f"_seq gap: {tail.seq + 1}..{seq - 1} missing",
                          copy=False)
        if tail.state == "finished":
            self._log_bad(tail, start, end, "event after finish")
            return
        tail.seq = seq
        if kind is None:
            if run.record(ev, line, seq, start):
                tail.applied += 1
            else:
                tail.skipped += 1
        elif kind == "alert":
            run.alert(ev, seq)
        elif kind == "rules":
            run.set_rules(ev)
        elif kind == "finish":
            when = ev.get("_time")
            run.finish(str(ev.get("status") or "finished"),
                       float(when) if isinstance(when, (int, float)) else time.time(), seq)
            tail.state = "finished"
        else:
            tail.seq = seq
            self._log_bad(tail, start, end, f"unknown event {kind!r}")

    # -- crash detection -----------------------------------------------------------------
    def check_crash(self, tail: FileTail, now: float) -> None:
        """No finish and the writer is gone (or silent too long): the shard is `crashed`."""
        if tail.state != "live":
            return
        try:
            st = tail.path.stat()
        except OSError:
            return
        tail.size, tail.mtime = st.st_size, st.st_mtime
        if tail.host == HOST and tail.pid is not None:
            if pid_alive(tail.pid, tail.pid_start):
                return
            why = f"writer pid {tail.pid} is gone"
        elif now - st.st_mtime > self.cfg.crash_silence:
            why = f"silent for {now - st.st_mtime:.0f} s"
        else:
            return
        while self.pump(tail, 64 << 20):
            pass
        if tail.state != "live":
            return
        if tail.size > tail.offset:
            self._log_bad(tail, tail.offset, tail.size, "torn tail: its writer is gone")
            tail.offset = tail.size
        log.warning("%s: no finish and %s; marking %s crashed", tail.path, why,
                    tail.run.spec.paths.shard if tail.run else "its shard")
        if tail.run is not None:
            tail.run.finish("crashed", now)
        tail.state = "crashed"

    # -- committing ----------------------------------------------------------------------
    def commit(self, *, force: bool = False, sidecar_interval: float = 2.0) -> None:
        """Flush shards, then record the offsets they cover; retire finished files."""
        slots_ok: dict[int, bool] = {id(s): s.flush() for s in self.pool.slots.values()}
        now = time.monotonic()
        for tail in list(self.tails.values()):
            run = tail.run
            if run is None or slots_ok.get(id(run.slot), True):
                tail.committed = tail.offset
            if run is not None:
                self._settle(tail, run)
                if tail.state in ("finished", "crashed", "refused") and not any(
                    t.is_alive() for t in run.forwarder._closers
                ):
                    self._settle(tail, run)
                    run.close()
                    tail.run = None
            lag = tail.size - tail.offset
            tail.behind_since = (tail.behind_since or now) if lag > 0 else None
            self.checkpoints.put(tail.key, tail.checkpoint())
        self.pool.sidecars(0.0 if force else sidecar_interval)
        if force or now - self.checkpoints.saved_at >= self.cfg.checkpoint_interval:
            self.checkpoints.save()
            if not self.checkpoints.dirty and not self.checkpoints.readonly:
                for tail in self.tails.values():
                    if tail.run is not None:
                        tail.run.forwarder.checkpointed()

    @staticmethod
    def _settle(tail: FileTail, run: RunPipeline) -> None:
        """Advance the backends' checkpoints to what they have done with."""
        upto = min(tail.committed, tail.offset)
        run.forwarder.settle(upto, tail.seq if upto == tail.offset else None)
        tail.backends = dict(run.forwarder.committed)

    def forwarding(self) -> bool:
        """True if some run feeds backends (their progress moves checkpoints on its own)."""
        return any(t.run is not None and t.run.forwarder.active for t in self.tails.values())

    def has_time_rules(self) -> bool:
        """True if some live run has a rule that needs the clock (no_data, age, elapsed)."""
        for tail in self.tails.values():
            rules = tail.run.rules if tail.run is not None else None
            if rules is not None and rules.has_time_rules:
                return True
        return False

    def tick(self, now: float) -> None:
        """Time rules of live files."""
        for tail in self.tails.values():
            if tail.run is not None and tail.state == "live":
                tail.run.tick(now)

    def expire(self, now: float) -> int:
        """Delete finished, fully applied spool files older than the retention."""
        removed = 0
        for tail in list(self.tails.values()):
            if tail.state != "finished" or tail.run is not None or tail.committed < tail.size:
                continue
            if any(off < tail.size for off in tail.backends.values()):
                continue
            if now - tail.mtime < self.cfg.retention:
                continue
            try:
                tail.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._warn(f"unlink:{tail.path}", f"cannot delete {tail.path}: {exc.strerror}")
                continue
            log.info("deleted %s (finished and applied)", tail.path)
            self.forget(tail)
            removed += 1
        return removed

    def close(self, timeout: float = 5.0) -> None:
        """Final commit; close every pipeline and shard."""
        self.commit(force=True)
        deadline = time.monotonic() + timeout
        for tail in self.tails.values():
            if tail.run is not None:
                tail.run.forwarder.close("running", max(0.1, deadline - time.monotonic()))
        for tail in self.tails.values():
            if tail.run is not None:
                tail.run.forwarder.join(max(0.1, deadline - time.monotonic()))
                self._settle(tail, tail.run)
                tail.run.close()
                tail.run = None
            self.checkpoints.put(tail.key, tail.checkpoint())
        self.checkpoints.save()
