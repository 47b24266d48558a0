"""Tailing spool files: per-file offsets, checkpoints, quarantine and crash detection.

The second stage of exprd's one-way flow, watcher -> tailer -> applier -> forwarder.
Each spool file is read from its checkpoint (the byte offset after the last complete
line applied, per consumer: the shard and each backend). Every line is parsed once,
here. A record its run takes as it is (a run without rules or backends: the common case)
is appended to its shard in the read loop itself; every other event goes to the run's
pipeline (`applier.RunPipeline`). Checkpoints are written atomically to
`{state}/checkpoints.json` only after the shard data they cover has been flushed: a
shard that cannot be written (full disk, no descriptor) blocks its files, which wait.
The shard's own `_sid`/`_seq` fields make a re-read after a crash harmless.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from itertools import islice, repeat
from operator import eq
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.store import untrusted
from expr_tracker.store.layout import spool_segment
from expr_tracker.store.shard import ShardWriter
from expr_tracker.store.spoolfile import SpoolReader, line_mark

from .applier import RunPipeline, ShardPool, forget_file
from .config import Config
from .durable import Durable
from .filetail import FileTail
from .spec import InitError, Roots, check_init
from .state import Checkpoints, Quarantine, StateDir

log = logging.getLogger("exprd")
MAX_LOGGED = 10  # quarantine log lines per file; the rest are counted in status.json
LOG_AGAIN = 3600.0  # a cause already logged is logged again (with its count) after this
TOO_LONG = object()  # the parse of a line over the spool's line limit (never read)
# the spool read a block at a time of this size: its records (about 5x its bytes as
# Python objects) stay in a core's cache across the block screen's passes over them; a
# 1 MiB block's did not (1.25x the CPU per row, bench/HISTORY.md 3f)
READ_BLOCK = 128 << 10


def _cause(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def _index(flags: list[bool], value: bool, start: int) -> int:
    """The first index from `start` where `flags` holds `value` (its length if none)."""
    try:
        return flags.index(value, start)
    except ValueError:
        return len(flags)


def _masks(tail: FileTail, evs: list[Any] | None, start: int = 0
           ) -> tuple[list[bool], list[bool], frozenset[str] | None]:
    """Of a clean block's records from `start` on (those before it are False): which have
    only keys of checked step rows (without `_rank`), and which have the key set of the
    last checked rank record (returned too). The usual block is step rows only: one union
    of their keys says it (a set's update from a dict takes each key's hash as it is
    stored), not a look-up of each record's keys."""
    if not evs:
        return [], [], None
    keys, ranks = tail.row_keys, tail.shapes[1]
    rest = evs[start:] if start else evs
    head = [False] * start
    if keys and keys.issuperset(set().union(*rest)):
        return head + [True] * len(rest), [], ranks  # the usual block: step rows only
    mask = head + list(map(keys.issuperset, rest)) if keys else []
    rmask = head + list(map(eq, repeat(ranks), map(dict.keys, rest))) \
        if ranks is not None and not all(mask[start:] or [False]) else []
    return mask, rmask, ranks


def _next_run(mask: list[bool], rmask: list[bool], start: int) -> int:
    """Where the next run of either kind starts (-1 if none)."""
    if not mask and not rmask:
        return -1
    return min(_index(mask, True, start) if mask else len(rmask),
               _index(rmask, True, start) if rmask else len(mask))


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value that is not an object (`null`, array...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {list: "array", str: "string"}.get(type(value), "number")


class Tailer:
    """Reads spool files and hands their events to per-file pipelines."""

    def __init__(self, cfg: Config, spool_root: Path, state: Path, *, dispatcher: Any = None,
                 dry_run: bool = False, live: bool = True, state_dir: StateDir | None = None,
                 max_open: int = 256, durable: Durable | None = None) -> None:
        self.cfg = cfg
        self.spool_root = spool_root
        self.state = state
        self.dispatcher = dispatcher
        self.dry_run = dry_run
        self.live = live  # a daemon (time rules, retention) rather than a one-shot replay
        # checkpoints and sidecars are stored on `durable`'s thread when there is one
        self.durable = durable
        self.pool = ShardPool(self.warn, max_open, durable)
        sdir = state_dir or StateDir(state, readonly=dry_run)
        self.tails: dict[str, FileTail] = {}
        self.errors: dict[str, int] = {}
        self._logged: dict[str, float] = {}
        self.checkpoints = Checkpoints(sdir, self.warn, durable)
        self.quarantine = Quarantine(sdir, self.warn)
        self.roots = Roots()  # the run roots of init events, resolved once a few seconds
        self.rolled_seen = False  # a segment was rolled: the loop deletes it once applied
        # the rule state a rolled segment leaves to its session's next one
        self.handover: dict[tuple[str, str], Any] = {}
        # what the files deleted once applied (`retire.expire`) did: status totals and a
        # replay's summary go on counting them
        self.deleted = {"files": 0, "applied": 0, "skipped": 0, "quarantined": 0}
        # events lost to what was done to spool files, by cause (`spool_moved`)
        self.dropped: dict[str, int] = {}
        # (shard, session) -> events of a moved segment, for the next segment's sidecar
        self._moved: dict[tuple[str, str], int] = {}
        # live files found gone (path -> last seq read, shard, session): a moved segment
        # is told from one deleted once read when its session's next segment is read
        self._gone: dict[str, tuple[int, str, str]] = {}
        # files deleted once applied (path -> last seq read): the events of a segment's
        # end that are not records (rules...) are not in the shard's seqs, yet not moved
        self._retired: dict[str, int] = {}

    def warn(self, cause: str, message: str) -> None:
        """Count every failure; log a cause once (and again, with its count, hourly)."""
        n = self.errors[cause] = self.errors.get(cause, 0) + 1
        now = time.monotonic()
        last = self._logged.get(cause)
        if last is None or now - last >= LOG_AGAIN:
            self._logged[cause] = now
            log.warning("%s%s", message, f" ({n} times so far)" if n > 1 else "")

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
            # not clamped to the size: a file truncated meanwhile is reported by the pump
            tail.offset = tail.committed = cp["shard"]
            tail.seq = tail.committed_seq = int(cp.get("seq", -1))
            mark = cp.get("mark")
            if isinstance(mark, list) and len(mark) == 2 and all(type(x) is int for x in mark):
                tail.mark = tail.committed_mark = (mark[0], mark[1])
            tail.state = str(cp.get("state", "new"))
            tail.reason = str(cp.get("reason", ""))
            ended = cp.get("ended")
            tail.ended = ended if ended in ("finished", "crashed") else ""
            tail.host, tail.pid = str(cp.get("host", "")), cp.get("pid")
            tail.pid_start = cp.get("pid_start")
            tail.backends = {str(k): int(v) for k, v in (cp.get("backends") or {}).items()}
            back = min(tail.backends.values(), default=tail.offset)
            if back < tail.offset:
                self._rewind(tail, back)
        elif cp and tail.ino and cp.get("shard"):
            self._lost(tail, "rotated", f"replaced by a new file while exprd was stopped (the "
                       f"old one was applied up to _seq {cp.get('seq')}, offset {cp.get('shard')}); "
                       "reading the new one from its start")
            tail.replaced = ("rotated", 0, 0)
        elif not cp:
            tail.replaced = ("new", 0, 0)  # read from its start: is some of it applied?
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
        tail.mark = None  # (not the line read last)
        if tail.state == "finished":
            tail.state = "live"

    def _same_file(self, tail: FileTail) -> bool:
        """Before reading: a new inode (rotated) or a size below the offset (truncated) is
        reported with what was lost, and the new content is read from its start."""
        try:
            st = os.stat(tail.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        other = bool(tail.ino and st.st_ino != tail.ino)
        if other:
            unread = max(tail.size - tail.offset, 0)
            self._lost(tail, "rotated", f"replaced by a new file; {unread} bytes of the old one "
                       f"after offset {tail.offset} (_seq {tail.seq}) were not read; reading the "
                       "new one from its start")
            if tail.run is not None:
                tail.run.close()
                tail.run = None
            tail.offset = tail.committed = 0
            tail.mark = tail.committed_mark = None
            tail.seq, tail.state, tail.reason, tail.backends = -1, "new", "", {}
            tail.replaced, tail.replaced_told = ("rotated", tail.applied, tail.skipped), False
        elif st.st_size < tail.offset:
            unread = max(tail.size - tail.offset, 0)
            self._lost(tail, "truncated", f"truncated to {st.st_size} bytes, below offset "
                       f"{tail.offset} (_seq {tail.seq}); {unread} bytes not yet read were lost; "
                       "reading it again from its start")
            tail.offset = tail.committed = 0
            tail.mark = tail.committed_mark = None
        tail.ino = st.st_ino
        if other or tail.reader is None or not tail.reader.zeros or st.st_size < tail.size:
            # (an earlier SDK's memory-mapped segment's size is its allocation: its data ends
            # where the last read found zeros, which the read below moves on)
            tail.size = st.st_size
        return True

    def _lost(self, tail: FileTail, kind: str, reason: str) -> None:
        self.quarantine.put(tail.path, tail.offset, tail.offset, f"{kind}: {reason}", copy=False)
        self.warn(f"{kind}:{tail.path}", f"{tail.path}: {reason}")

    def applied_total(self) -> int:
        """Record events applied by this process, deleted files' included."""
        return self.deleted["applied"] + sum(t.applied for t in self.tails.values())

    def deleted_file(self, tail: FileTail) -> None:
        """`tail`'s file was deleted once applied: its counts stay in the totals."""
        for key, n in (("files", 1), ("applied", tail.applied), ("skipped", tail.skipped),
                       ("quarantined", tail.quarantined)):
            self.deleted[key] += n
        if len(self._retired) >= 4096:  # sessions that never went on: the oldest go
            self._retired.pop(next(iter(self._retired)))
        self._retired[tail.key] = tail.seq
        self.forget(tail)

    def forget(self, tail: FileTail) -> None:
        if tail.run is not None:
            tail.run.close()
            tail.run = None
        self.tails.pop(tail.key, None)
        self.checkpoints.drop(tail.key)
        if not self.dry_run and not tail.path.exists():
            try:
                forget_file(self.state, tail.path.relative_to(self.spool_root).as_posix())
            except ValueError:
                pass  # not under the spool root: nothing was kept for it

    def log_bad(self, tail: FileTail, start: int, end: int, reason: str, copy: bool = True) -> None:
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

    def _refuse_unsafe(self, run: RunPipeline) -> None:
        """A symlink (or the like) below the allowed root: every file of that shard stops."""
        reason = f"unsafe path: {run.unsafe}"
        for tail in list(self.tails.values()):
            if tail.run is not None and tail.run.slot is run.slot:
                self.refuse(tail, reason)

    def recheck(self, cfg: Config) -> None:
        """A reload changed allowed_roots: refuse open runs that are no longer under one."""
        self.roots.clear()
        for tail in list(self.tails.values()):
            if tail.run is None:
                continue
            rdir = tail.run.spec.paths.run_dir
            if not cfg.allows(rdir.parent.parent) or not cfg.allows(rdir):
                self.refuse(tail, f"run dir {rdir} is outside allowed_roots (after a reload)")

    def _open_run(self, tail: FileTail, ev: dict[str, Any], fresh: bool = False) -> bool:
        """Open the pipeline of `tail`'s session from its init event `ev`; `fresh`: read
        from the file's start (not resumed from a checkpoint)."""
        try:
            spec = check_init(ev, tail.path, self.spool_root, self.cfg, self.roots)
        except InitError as exc:
            self.refuse(tail, str(exc))
            return False
        tail.host, tail.pid, tail.pid_start = spec.host, spec.pid, spec.pid_start
        tail.run = RunPipeline(spec, self.pool, self.cfg, self.dispatcher, tail.backends,
                               dry_run=self.dry_run)
        if spec.segment:
            # the rules go on with the state the segment before left them in (windows,
            # what fired), not from nothing at each segment
            rules = self.handover.pop((str(spec.paths.shard), spec.session), None)
            if rules is not None:
                tail.run.adopt_rules(rules)
            moved = self._moved.pop((str(spec.paths.shard), spec.session), 0)
            if not moved and fresh:
                moved = self._moved_unread(tail, tail.run)
            if moved:
                tail.run.add_dropped("spool_moved", moved)
        if tail.run.unsafe:
            self._refuse_unsafe(tail.run)
            return False
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
                tail.offset, tail.seq = end, tail.run.spec.first_seq - 1
                tail.mark = line_mark(line) if line else None
            return True
        tail.drained = True  # the init line is not complete yet
        return False

    # -- reading -------------------------------------------------------------------------
    def pump(self, tail: FileTail, budget: int = 4 << 20, *, ordered: bool = False) -> bool:
        """Apply up to `budget` bytes of new complete lines; True if more are waiting.
        `ordered`: the segments before this one are read already (`_previous_read`)."""
        tail.drained = False
        if tail.state == "refused":
            return False
        run = tail.run
        if run is not None and run.blocked:
            return False  # the shard cannot take rows: wait
        try:
            if not self._same_file(tail):
                return False
            if tail.run is None and tail.state in ("finished", "crashed", "rolled") \
                    and tail.size <= tail.offset:
                return False
            if not ordered and not self._previous_read(tail):
                return True  # the segment before it first (come back)
            if not self._ensure_run(tail) or (tail.run is not None and tail.run.blocked):
                return False
            reader = tail.reader or SpoolReader(tail.path, block=READ_BLOCK)
            tail.reader = reader
            tail.nul_seen = 0
            paused = self._read(tail, reader, budget)
            if reader.cut:
                self._regrown(tail)
                return True  # read again, from its start
            for at, n in reader.nul_runs:
                self.warn(f"nul:{tail.path}", f"{tail.path}: skipped {n} NUL bytes at offset "
                          f"{at} (a page of zeros, as a node crash before writeback leaves "
                          "them); the lines after them are applied, a line they cut is "
                          "quarantined")
            # each backend reads the same file on its own, behind the shard, never holding it
            run = tail.run
            forwarding = run is not None and run.feeds_backends and \
                run.forwarder.pump(tail.path, tail.offset)
        except FileNotFoundError:
            return False
        except OSError as exc:
            # EMFILE, ENFILE, EIO: temporary; the lines are read again, never called torn
            tail.read_error = exc.strerror or str(exc)
            self.warn(f"read:{_cause(exc)}", f"cannot read {tail.path}: {tail.read_error}")
            return False
        finally:
            if tail.run is not None:
                tail.run.used()
        tail.read_error = ""
        if tail.run is not None and tail.run.unsafe:
            self._refuse_unsafe(tail.run)
        if tail.state == "refused":
            return False
        tail.size = reader.size
        tail.drained = not reader.more and not paused
        return reader.more or paused or forwarding

    def _regrown(self, tail: FileTail) -> None:
        """The file no longer holds the line read last where it ended: it was cut (`: >`,
        copytruncate) and written again past the offset between two reads, so neither its
        inode nor its size told. Read again from its start: the events whose `_seq` was
        applied already are skipped (quarantined as repeats), the others applied."""
        self._lost(tail, "truncated", f"cut and written again past offset {tail.offset} "
                   f"(_seq {tail.seq}) since it was read; reading it again from its start")
        tail.offset = tail.committed = 0
        tail.mark = tail.committed_mark = None
        tail.size = 0  # (its data end is found again)

    def _previous_read(self, tail: FileTail) -> bool:
        """A session's segments are applied in their order: the events of segment N are
        applied only once segment N-1 (if it is still there) is read to its end, as far
        as it is written (a record applied from N would make the shard skip N-1's rest).

        Iterative, whatever the backlog: the segments before N not read yet are found
        walking back to the first one done (or gone), then pumped oldest first, each
        without looking back again (its predecessor was just read)."""
        behind: list[FileTail] = []
        here = tail
        while (prev := self._before(here)) is not None:
            before = self.tails.get(str(prev)) or self.track(prev)
            if before.state in ("rolled", "finished", "crashed", "refused"):
                break  # read to its marker (or its end)
            behind.append(before)
            here = before
        for before in reversed(behind):
            self.pump(before, 64 << 20, ordered=True)
            if not before.drained:
                return False
        return True

    def _before(self, tail: FileTail) -> Path | None:
        """The segment before `tail`'s in its session, if it is still there (if it was
        being read and is gone, it was moved away: counted, see `_moved_away`)."""
        prefix, index = spool_segment(tail.path.name)
        if index == 0:
            return None
        prev = tail.path.with_name(f"{prefix}~{index - 1}.jsonl" if index > 1 else
                                   f"{prefix}.jsonl")
        if prev.exists():
            return prev
        gone = self.tails.get(str(prev))
        if gone is not None and gone.state in ("new", "live"):
            self.vanished(gone)
        if str(prev) in self._gone:
            self._moved_away(prev, tail)
        return None

    def vanished(self, tail: FileTail) -> None:
        """`tail`'s file is gone (found by a stat): forgotten, and if it was live, what was
        read of it is kept a while (see `_moved_away`)."""
        if tail.state in ("new", "live") and tail.seq >= 0 and tail.run is not None:
            if len(self._gone) >= 4096:  # sessions that never went on: the oldest go
                self._gone.pop(next(iter(self._gone)))
            self._gone[tail.key] = (tail.seq, str(tail.run.spec.paths.shard),
                                    tail.run.spec.session)
        self.forget(tail)

    def _moved_unread(self, tail: FileTail, run: RunPipeline) -> int:
        """The segment before `tail`'s is gone and exprd never read it (moved away while
        exprd was down, or before it got there): the events between the shard's last of
        the session and the first of `tail` are counted (`spool_moved`). A segment deleted
        once applied leaves no gap; if the shard cannot be read now, nothing is said."""
        prefix, index = spool_segment(tail.path.name)
        if index == 0 or run.slot.applied is None:
            return 0
        prev = tail.path.with_name(f"{prefix}~{index - 1}.jsonl" if index > 1 else
                                   f"{prefix}.jsonl")
        if prev.exists() or str(prev) in self.tails:
            return 0
        seq = max(run.skip_upto, self._retired.pop(str(prev), 0), 0)
        lost = run.spec.first_seq - 1 - seq
        if lost <= 0:
            return 0
        self.dropped["spool_moved"] = self.dropped.get("spool_moved", 0) + lost
        self.warn(f"spool_moved:{prev}", f"{prev} is gone and was never read: {lost} events "
                  f"of session {run.spec.session} after _seq {seq} are missing (counted as "
                  f"spool_moved, in status.json and the shard's sidecar); going on with "
                  f"{tail.path.name}")
        return lost

    def _moved_away(self, prev: Path, tail: FileTail) -> None:
        """A segment exprd was reading is gone before its marker (`mv`, no copy back) and
        its session went on in `tail`: the events between the last one read from it and
        the first of `tail` are counted (`spool_moved`: events by `_seq`, rows or others;
        a segment deleted once read and applied counts none)."""
        first = None
        for _start, _end, line in SpoolReader(tail.path).lines(0, 1):
            try:
                ev = orjson.loads(line) if line is not None else None
            except orjson.JSONDecodeError:
                ev = None
            if isinstance(ev, dict) and type(ev.get("first_seq")) is int:
                first = ev["first_seq"]
            break
        if first is None:
            return  # the next segment's init is not there yet: asked again at its next read
        seq, shard, session = self._gone.pop(str(prev))
        lost = max(first - 1 - seq, 0)
        if not lost:
            return
        self.dropped["spool_moved"] = self.dropped.get("spool_moved", 0) + lost
        key = (shard, session)
        self._moved[key] = self._moved.get(key, 0) + lost
        self.warn(f"spool_moved:{prev}", f"{prev} was moved away while in use: "
                  f"{lost} events after _seq {seq} in it were not read (counted as "
                  f"spool_moved, in status.json and the shard's sidecar); going on with "
                  f"{tail.path.name}")

    @staticmethod
    def _tell_repeat(tail: FileTail, run: RunPipeline) -> None:
        """A file read from its start (a new file, or one that took a rotated file's name)
        holds a record its shard has: said once per file, with the mark below which its
        records are skipped (the counts are in status.json)."""
        tail.replaced_told = True
        # a copy that took a rotated file's name is news; a file without a checkpoint read
        # again after a kill is not
        how = tail.replaced[0] if tail.replaced is not None else "new"
        log.log(logging.WARNING if how == "rotated" else logging.INFO,
                "%s: its records of session %s up to _seq %d are in the shard already (a copy "
                "of a rotated spool file, or read again after a restart): skipped, each record "
                "is applied once", tail.path, run.spec.session, run.skip_upto)

    def _read(self, tail: FileTail, reader: SpoolReader, budget: int) -> bool:
        """Apply the complete lines from `tail.offset` (about `budget` bytes); True if it
        stopped early because the shard or a backend cannot take more now."""
        loads, decode_error = orjson.loads, orjson.JSONDecodeError
        screen, block, max_step = untrusted.screen, untrusted.screen_block, untrusted.MAX_STEP
        plain, plain_ranks = untrusted.plain_rows, untrusted.plain_ranks
        max_line = reader.max_line
        run = tail.run
        shapes, row = tail.shapes, self._row_shape(tail)
        fast, skip, suffix = self._fast_case(tail)
        writer: ShardWriter | None = None  # the shard's, once the plain case appends
        seq = last = tail.seq
        applied = 0
        done = tail.offset  # every line before it is consumed, the last of them `seq`
        ended: bytes | None = None  # the line that ends at `done` (None: not known)
        try:
            for pos, parts, big_end in reader.chunks(tail.offset, budget, tail.mark):
                if big_end is not None:
                    tail.seq = seq
                    self._line(tail, pos, big_end, b"", TOO_LONG)
                    done, ended = big_end, None
                    continue
                # the block parsed and screened at once (for the fast case: the first
                # block of a file holds its init, after which the run only appends)
                evs, clean = block(parts, max_line, reader.span)
                # runs of step rows made of keys the full check passed, and of rank
                # records of a checked shape, are taken at once (untrusted.plain_rows,
                # plain_ranks: no Python loop per record); `at` is the next run's start
                mask, rmask, rshape = _masks(tail, evs) if clean else ([], [], None)
                at, remask = _next_run(mask, rmask, 0), 2
                rows = iter(range(len(parts)))
                for i in rows:
                    line = parts[i]
                    if i == at:
                        data, step = None, None  # the last step row's `_step`
                        if mask and mask[i]:
                            j = _index(mask, False, i)
                            if fast and seq >= skip and evs is not None:
                                data = plain(parts[i:j], evs[i:j], seq + 1, suffix)
                                if data is not None:
                                    step = evs[j - 1]["_step"]  # plain_rows checked it
                        else:
                            j = _index(rmask, False, i)
                            if fast and seq >= skip and evs is not None and rshape:
                                data = plain_ranks(parts[i:j], evs[i:j], seq + 1, suffix,
                                                   rshape)  # the shape `rmask` compared
                        at = _next_run(mask, rmask, j)
                        if data is not None:
                            if writer is None:
                                assert run is not None and evs is not None
                                if not run.started and self._overlaps(tail, run, evs[i]):
                                    done, ended = reader.size, None
                                    return False
                                writer = run.prepare()
                            # the spool lines verbatim, each plus `_sid`
                            writer.append_many(data, j - i, step)
                            seq = last = seq + j - i
                            applied += j - i
                            # each line gave its "}" and newline for the suffix
                            pos = done = pos + len(data) - (j - i) * (len(suffix) - 2)
                            ended = parts[j - 1]
                            next(islice(rows, j - i - 1, j - i - 1), None)  # on at j
                            continue
                    end = pos + len(line) + 1
                    ev: Any = TOO_LONG
                    if evs is not None:
                        ev = evs[i]
                    elif len(line) <= max_line:
                        try:
                            ev = loads(line)
                        except decode_error as exc:
                            ev = exc
                    # the fast case: the next record of a run that only appends it, that
                    # passes the screen (untrusted.screen, or its cheap half when the
                    # block is clean): the keys of a record that passed the full check
                    # (so no `_event`, `_sid` or a `_kind` other than "rank")
                    if (fast and ev.__class__ is dict and ev.get("_seq") == seq + 1
                            and ev["_seq"].__class__ is int  # not 5.0, which _line refuses
                            and seq >= skip and line[-1:] == b"}"
                            and ((clean and ev.keys() == row and ev["_time"].__class__ is float
                                  and (step := ev["_step"]).__class__ is int
                                  and 0 <= step <= max_step)
                                 or screen(ev, line, shapes))):
                        if writer is None:
                            assert run is not None
                            if not run.started and self._overlaps(tail, run, ev):
                                done, ended = reader.size, None
                                return False
                            writer = run.prepare()
                        seq = last = seq + 1
                        writer.append(line[:-1] + suffix)  # the spool line verbatim, plus `_sid`
                        applied += 1
                        pos = done = end
                        ended = line
                        continue
                    tail.seq = seq
                    self._line(tail, pos, end, line, ev)
                    seq, shapes, row = tail.seq, tail.shapes, self._row_shape(tail)
                    if clean and remask and ((not mask and tail.row_keys)
                                             or (not rmask and tail.shapes[1])):
                        # the first record of its kind in the file passed the full check
                        remask -= 1
                        mask, rmask, rshape = _masks(tail, evs, i + 1)
                        at = _next_run(mask, rmask, i + 1)
                    pos = done = end
                    ended = line
                    if tail.state == "refused":
                        done, ended = reader.size, None
                        return False
                    if tail.run is not run or fast != (tail.state == "live" and run is not None
                                                       and run.plain):
                        if applied and run is not None:
                            run.appended(applied, last)
                            tail.applied += applied
                            applied = 0
                        run, writer = tail.run, None
                        fast, skip, suffix = self._fast_case(tail)
                        if run is not None and run.blocked:
                            return True  # a new run whose shard cannot be read yet
                if run is not None and run.blocked:
                    return True
        finally:
            # offset and seq move together, whatever ends the loop (an exception too)
            if done != tail.offset:
                tail.mark = line_mark(ended) if ended else None
            tail.offset, tail.seq = done, seq
            if applied and run is not None:
                run.appended(applied, last)
                tail.applied += applied
        return False

    def _overlaps(self, tail: FileTail, run: RunPipeline, ev: dict[str, Any]) -> bool:
        """Refuse the file if its session would write steps its shard holds (see
        `RunPipeline.overlap`)."""
        reason = run.overlap(ev, tail.path.parent)
        if reason is not None:
            self.refuse(tail, reason)
        return reason is not None

    @staticmethod
    def _row_shape(tail: FileTail) -> frozenset[str] | None:
        """The keys of the file's checked step rows, if the block screen covers them
        (not with `_rank`, whose value it does not look at)."""
        row = tail.shapes[0]
        return row if row is not None and "_rank" not in row else None

    @staticmethod
    def _fast_case(tail: FileTail) -> tuple[bool, int, bytes]:
        run = tail.run
        if run is None or tail.state != "live" or not run.plain:
            return False, 0, b""
        return True, run.skip_upto, run.suffix

    def _line(self, tail: FileTail, start: int, end: int, line: bytes, ev: Any) -> None:
        """One line the fast case did not take: `ev` is its parse (TOO_LONG: over 16 MiB)."""
        if ev is TOO_LONG:
            self.log_bad(tail, start, end, "line over 16 MiB")
            return
        if isinstance(ev, Exception):
            why = "not UTF-8" if "utf-8" in str(ev).lower() else "not JSON"
            self.log_bad(tail, start, end, why)
            return
        if type(ev) is not dict:
            self.log_bad(tail, start, end, f"not an event: a JSON {_json_type(ev)}, not an object")
            return
        seq = ev.get("_seq")
        if type(seq) is not int or seq < 0:
            self.log_bad(tail, start, end, "not an event: no _seq (an int >= 0)"
                         if seq is None else f"not an event: _seq must be an int >= 0, got {seq!r}")
            return
        kind = ev.get("_event")
        run = tail.run
        if run is None:
            if kind != "init" or seq != 0:
                self.log_bad(tail, start, end, "event before its init")
            elif self._open_run(tail, ev, fresh=start == 0) and tail.run is not None:
                # a truncated file's init is read again; a later segment's events start
                # where its init says
                tail.seq = max(tail.seq, tail.run.spec.first_seq - 1)
            return
        if kind == "segment" or kind == "dropped":
            self._note(tail, run, kind, ev, start, end)
            return
        if seq <= tail.seq:
            self.log_bad(tail, start, end, f"_seq repeat: {seq} after {tail.seq}")
            return
        if seq != tail.seq + 1:
            # events went missing (the writer dropped them): say so, keep this one
            self.log_bad(tail, start, start, f"_seq gap: {tail.seq + 1}..{seq - 1} missing",
                          copy=False)
            self._zeroed(tail, run, start, seq - tail.seq - 1)
        if tail.state in ("finished", "rolled"):
            self.log_bad(tail, start, end, f"event after {'finish' if tail.state == 'finished' else 'the segment marker'}")
            return
        tail.seq = seq
        if kind is None:
            rkind = ev.get("_kind")
            if rkind is not None and rkind != "rank":
                self.log_bad(tail, start, end, f"unknown _kind {rkind!r}")
                return
            if "_sid" in ev:
                # exprd's bookkeeping field: set from the file's session, never from the line
                del ev["_sid"]
                line = orjson.dumps(ev)
                self.warn(f"spool_sid:{tail.path}", f"{tail.path}: a record carries its own "
                           "_sid; exprd replaced it with the file's session")
            if not untrusted.screen(ev, line, tail.shapes):
                # a spool line is untrusted: checked as log() checks its arguments
                try:
                    untrusted.check_record(ev)
                except (TypeError, ValueError) as exc:
                    self.log_bad(tail, start, end, f"bad record: {exc}")
                    return
                shapes = list(tail.shapes)
                shapes[rkind is not None] = frozenset(ev)
                tail.shapes = (shapes[0], shapes[1])
                if rkind is None:
                    tail.row_keys.update(ev)
                    tail.row_keys.discard("_rank")  # its value is for the full check
                # what was checked is what lands (not a repeated key readers would trip on)
                line = orjson.dumps(ev)
            if not run.started and self._overlaps(tail, run, ev):
                return
            if run.record(ev, line, seq, start):
                tail.applied += 1
            else:
                tail.skipped += 1
                if tail.replaced is not None and not tail.replaced_told:
                    self._tell_repeat(tail, run)
        elif kind == "alert":
            run.alert(ev, seq)
        elif kind == "rules":
            run.set_rules(ev)
        elif kind == "config":
            run.set_config(ev, seq)
        elif kind == "probe":
            run.set_probe(ev, seq)
        elif kind == "spans":
            run.spans(ev, seq)
        elif kind == "finish":
            when = ev.get("_time")
            status = str(ev.get("status") or "finished")
            run.finish(status, float(when) if isinstance(when, (int, float)) else time.time(),
                       seq, ev.get("exit"), ev.get("summary"))
            tail.state = "finished"
            tail.ended = "crashed" if status == "crashed" else "finished"
        else:
            # an event of a newer SDK: skipped (and kept in quarantine), the file goes on
            self.log_bad(tail, start, end, f"unknown event {kind!r}")

    def _zeroed(self, tail: FileTail, run: RunPipeline, start: int, lost: int) -> None:
        """A `_seq` gap right after a NUL run this read skipped: the events the zeros took
        (those under them and the lines they cut) are counted (`spool_zeroed`). Only
        there: the writer counts what it drops itself."""
        runs = tail.reader.nul_runs if tail.reader is not None else []
        if not any(at < start for at, _n in runs[tail.nul_seen:]):
            return
        tail.nul_seen = len(runs)
        self.dropped["spool_zeroed"] = self.dropped.get("spool_zeroed", 0) + lost
        run.add_dropped("spool_zeroed", lost)

    def _note(self, tail: FileTail, run: RunPipeline, kind: str, ev: dict[str, Any],
              start: int, end: int) -> None:
        """A line of the SDK's segment writer that is not an event of the session: the
        segment is over (the session goes on in the next one), or rows were dropped."""
        if kind == "segment":
            if tail.state == "live":
                tail.state = "rolled"
                self.rolled_seen = True
                run.rolled()
                if run.rules is not None:
                    if len(self.handover) >= 4096:  # sessions that never went on: the oldest go
                        self.handover.pop(next(iter(self.handover)))
                    self.handover[(str(run.spec.paths.shard), run.spec.session)] = run.rules
            return
        if not run.set_dropped(ev):
            self.log_bad(tail, start, end, "bad dropped note")

    # -- committing ----------------------------------------------------------------------
    def commit(self, *, force: bool = False, sidecar_interval: float = 2.0,
               wait: bool | None = None, only: list[FileTail] | None = None) -> None:
        """Flush shards, then record the offsets they cover; retire finished files.

        With a writer thread, sidecars and the checkpoint are stored there (what the last
        ones did is collected first); `force` writes them all now and waits until they
        are on disk (unless `wait` is False). `only`: the files read since the last
        commit, in the middle of a long round (the others' offsets did not move; the
        round's own commit covers every file)."""
        if self.durable is not None:
            self.durable.collect()
        slots_ok = self.pool.flush()
        now = time.monotonic()
        # the runs whose checkpoint is put now: only their journals may forget batches
        # once it is on disk (a file not put keeps the older checkpoint)
        put: list[RunPipeline] = []
        for tail in list(self.tails.values()) if only is None else only:
            run = tail.run
            if run is not None and run.unsafe:
                self._refuse_unsafe(run)
                run = None
            ok = run is None or slots_ok.get(id(run.slot), not run.blocked)
            if ok:
                tail.committed, tail.committed_seq = tail.offset, tail.seq
                tail.committed_mark = tail.mark
            lag = tail.size - tail.committed
            tail.behind_since = (tail.behind_since or now) if lag > 0 else None
            if run is not None:
                self._settle(tail, run)
                if tail.state in ("finished", "crashed", "refused", "rolled"):
                    # the status first, whatever the backends: a sidecar left "running"
                    # by a process that is gone reads as a crash (health pages it); a
                    # rolled segment changes no status (its session goes on): its rows
                    # on disk are enough, and a backlog's segments close as they are read
                    written = run.rows_written() if tail.state == "rolled" \
                        else run.status_written()
                    if not ok or not written or run.closing():
                        # a finished file is checkpointed as such only once the shard's
                        # status is on disk and its backends are done: until then a
                        # restart reads its end again
                        continue
                    run.close()
                    tail.run = None
            self.checkpoints.put(tail.key, tail.checkpoint())
            if tail.run is not None:
                put.append(tail.run)
        self.pool.sidecars(0.0 if force else sidecar_interval)
        if force or now - self.checkpoints.saved_at >= self.cfg.checkpoint_interval:
            # what those checkpoints hold of the backends (nothing settled since the puts)
            held = [(run, run.checkpoint_marks()) for run in put]

            def on_disk() -> None:
                for run, marks in held:
                    if not run.closed:
                        run.checkpointed(marks)

            self._save(on_disk, wait=force if wait is None else wait)

    def save_checkpoints(self) -> None:
        """Store the checkpoints now and wait until they are on disk."""
        self._save(wait=True)

    def _save(self, on_disk: Any = None, *, wait: bool = False) -> None:
        """Save the checkpoints; `wait`: until they are on disk (a snapshot still on its
        way is waited for first, as it would keep this one from being taken)."""
        if wait and self.durable is not None:
            self.durable.wait()
        self.checkpoints.save(on_disk)
        if wait and self.durable is not None:
            self.durable.wait()

    @staticmethod
    def _settle(tail: FileTail, run: RunPipeline) -> None:
        """Advance the backends' checkpoints to what they have done with."""
        upto = min(tail.committed, tail.offset)
        tail.backends = run.settle(upto, tail.seq if upto == tail.offset else None)

    def forwarding(self) -> bool:
        """True if some run feeds backends (their progress moves checkpoints on its own)."""
        return any(t.run is not None and t.run.feeds_backends for t in self.tails.values())

    def lagging(self) -> list[FileTail]:
        """Files some backend's reader has not caught up with (read again without a change
        to the file, as its backend drains)."""
        return [t for t in self.tails.values() if t.run is not None and t.run.feeds_backends
                and t.run.forwarder.behind(t.offset)]

    def blocked(self) -> bool:
        """True if some shard holds rows (or a status) it could not write yet: retried at
        each commit."""
        return any(t.run is not None and (t.run.blocked or t.state != "live")
                   for t in self.tails.values())

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

    def close(self, timeout: float = 5.0) -> None:
        """Final commit; close every pipeline and shard."""
        self.commit(force=True)
        deadline = time.monotonic() + timeout
        for tail in self.tails.values():
            if tail.run is not None:
                tail.run.drain(max(0.1, deadline - time.monotonic()))
        for tail in self.tails.values():
            if tail.run is not None:
                tail.run.join(max(0.1, deadline - time.monotonic()))
                self._settle(tail, tail.run)
                tail.run.close()
                tail.run = None
            self.checkpoints.put(tail.key, tail.checkpoint())
        self._save(wait=True)
