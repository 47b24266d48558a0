"""Builds a Pipeline per spool file from its init event and applies the file's events.

The pipeline is the SDK's own (`expr_tracker.pipeline.Pipeline`): shard, rules, alerts,
backends. Shard writers are shared by the spool files of one shard (a resumed run has
one file per session) and opened only when an event must really be written, so a
replay that has nothing new to apply leaves the run directory untouched.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.pipeline import Pipeline
from expr_tracker.store.cursor import Cursor
from expr_tracker.store.layout import spans_name
from expr_tracker.store.records import DECODE_NONFINITE
from expr_tracker.store.safedir import UnsafePath
from expr_tracker.store.shard import ShardWriter
from expr_tracker.store.spoolfile import session_of, spool_files_of

from .config import Config
from .durable import Durable
from .forwarder import Forwarder, drop_journals
from .spec import RunSpec

log = logging.getLogger("exprd")
_NONFINITE_TOKENS = (b'"NaN"', b'Infinity"', b'"nan"', b'inf"')


class ShardSlot:
    """One shard file: its lazily opened writer, applied seqs and pending status.

    A shard that cannot be written (full disk, no descriptor left) keeps its rows buffered
    and says why in `blocked`; its spool files stop reading until a flush succeeds, and
    their checkpoints never pass the rows it holds. A path that would follow a symlink
    sets `writer.unsafe`, and the run is refused.
    """

    def __init__(self, spec: RunSpec, warn: Callable[[str, str], None],
                 durable: Durable | None = None) -> None:
        self.paths = spec.paths
        self.durable = durable  # the writer thread the sidecar is stored on (None: here)
        self.sidecar_key = str(spec.paths.sidecar)
        self.writer = ShardWriter(
            spec.paths, spec.writer_identity(), shared=not spec.rank_aware,
            write_sidecar=spec.rank_aware or spec.rank == 0, warn=warn, dropped={},
            anchor=spec.anchor,
        )
        self.opened = False  # the writer's cursor is computed and its file was opened once
        self.blocked = ""  # why buffered rows cannot be written right now
        # the spool seqs the shard holds: nothing is applied before they are known
        self.applied: dict[str, int] | None = None
        self.last_step: int | None = None  # the shard's last step when `scan` read it
        # the sidecar as the slot found it (None: none); a run directory that was missing
        # at the init's check a moment ago holds no shard and no sidecar yet
        self.hint = self.scan(walk=not spec.new_dir)
        self.pending: dict[str, int] = {}  # session -> last seq appended, not yet flushed
        self.refs = 0
        self.newest = self.first_time = spec.time
        self.sidecar_dirty = False
        self.last_sidecar = 0.0
        # (status, end_time, exit) of a newer session's sidecar, which older ones leave alone
        self.kept: tuple[str, Any, Any] | None = None
        if spec.rank_aware:
            self._newer_sidecar(spec, self.hint)
        dropped = (self.hint or {}).get("dropped")
        if isinstance(dropped, list):
            # notes of sessions before this exprd looked: they stay in the sidecar
            self.writer.spool_dropped = [d for d in dropped if isinstance(d, dict)][-64:]

    def _newer_sidecar(self, spec: RunSpec, side: Mapping[str, Any] | None) -> None:
        """The sidecar was written for a session newer than `spec` (a stale copy of an older
        spool file, read after its run went on in a new session): that session's identity
        and status stay; the older session's rows are still applied."""
        side = side or {}
        when = side.get("session_time")
        if when.__class__ not in (int, float) or when <= spec.time:
            return
        self.newest = float(when)
        keys = (*spec.writer_identity(), "summary")
        self.writer.identity = {k: side[k] for k in keys if k in side}
        self.kept = (str(side.get("status") or "running"), side.get("end_time"), side.get("exit"))

    def scan(self, walk: bool = True) -> dict[str, Any] | None:
        """Read which spool seqs the shard holds (read-only, nothing created) and its
        sidecar (returned; None if there is none, or it cannot be read). If the shard
        cannot be read now (EMFILE...), the slot is blocked and tries again: `applied`
        stays None. The run directory is walked to once, and a missing one ends it
        (`walk` False: known missing, not walked to)."""
        try:
            if not walk:
                raise FileNotFoundError
            with self.writer.walked():
                hint = self.writer.read_hint()
                cursor = self.writer.scan(hint, hinted=True)
        except FileNotFoundError:
            hint, cursor = None, Cursor()  # no run directory: nothing applied yet
        except UnsafePath:
            self.applied = {}  # writer.unsafe says why; the run is refused
            return None
        except OSError as exc:
            # never guess "nothing applied": rows the shard holds would be written twice
            self.blocked = f"cannot read the shard: {exc.strerror or exc}"
            return None
        self.applied, self.last_step = cursor.applied, cursor.last_step
        self.blocked = ""
        return hint

    def open(self) -> bool:
        """Open the writer (repair, cursor); False if that failed (retried at the next flush)."""
        if self.opened:
            return True
        cursor = self.writer.open()
        if not self.writer.is_open:
            self.blocked = self.writer.last_error or "cannot open the shard"
            return False
        self.opened = True
        if not cursor.rows and self.first_time:
            self.writer.start_time = self.first_time  # the run's start, not exprd's
        self.writer.status, self.writer.end_time, self.writer.exit = \
            self.kept if self.kept is not None else ("running", None, None)
        return True

    def flush(self) -> bool:
        """Flush appended lines; on success record their seqs as applied."""
        if self.applied is None:
            self.scan()
            if self.applied is None:
                return False
        if not self.opened and (not self.writer.buffered() or not self.open()):
            return not self.writer.buffered()
        ok = self.writer.flush()
        if not ok:
            self.blocked = self.writer.last_error or "cannot write the shard"
            return False
        self.blocked = ""
        if self.pending:
            self.writer.cursor.applied.update(self.pending)
            if self.applied is not None:
                for session, seq in self.pending.items():
                    self.applied[session] = max(seq, self.applied.get(session, -1))
            self.pending.clear()
            self.sidecar_dirty = True
        return True

    def set_status(self, status: str, when: float, exit: dict[str, Any] | None = None) -> None:
        """Mark the shard `finished` or `crashed` in its sidecar (only if that changes it);
        `exit` is a crash's {type, message, time}, kept in the sidecar as direct mode does."""
        if not self.opened:
            side = self.writer.read_hint() or {}
            if not self.writer.sidecar_enabled or (
                    side.get("status") == status and side.get("exit") == exit):
                return
            if not self.paths.shard.exists():
                return
            self.open()
        self.writer.status = status
        self.writer.exit = exit if status == "crashed" else None
        self.writer.end_time = when
        self.sidecar_dirty = True

    def set_config(self, config: dict[str, Any]) -> None:
        """The run's config changed (`Run.update_config`): the sidecar says so, written at
        the next commit, before the checkpoint that covers the event (see `adopt_config`)."""
        if self.writer.identity.get("config") == config:
            return
        self.writer.identity["config"] = config
        if self.writer.sidecar_enabled:
            self.sidecar_dirty = True
            self.last_sidecar = 0.0

    def adopt_config(self, session: str, side: Mapping[str, Any] | None = None) -> None:
        """A session read again from a checkpoint: the config its `config` events set before
        the checkpoint is in the sidecar (written before the checkpoint that covers them).
        `side`: the sidecar just read (else it is read here)."""
        if side is None:
            try:
                side = self.writer.read_hint() or {}
            except OSError:
                return  # an unsafe or unreadable path: the init's config stands
        config = side.get("config")
        if side.get("session") == session and isinstance(config, dict):
            self.writer.identity["config"] = config

    def running(self, when: float) -> None:
        """A record of the session that started at `when` arrived: the shard is running again
        (a resumed session), unless a newer session's status stands (a stale copy)."""
        if self.writer.status != "running" and when >= self.newest:
            self.writer.status, self.writer.end_time, self.writer.exit = "running", None, None

    def write_sidecar(self) -> bool:
        """Rewrite the sidecar if it changed, and never while rows wait to be written: it
        would call the shard finished (or count rows) ahead of the file. True once the
        sidecar on disk is up to date (a failed write is retried). With a writer thread
        the bytes are built here and stored there: True only once that is done."""
        durable = self.durable
        if not self.sidecar_dirty:
            return durable is None or not durable.pending(self.sidecar_key)
        if self.writer.buffered() or not self.open():
            return False
        self.last_sidecar = time.monotonic()
        if durable is None or not self.writer.sidecar_enabled:
            if self.writer.write_sidecar():
                self.sidecar_dirty = False
            return not self.sidecar_dirty
        self.sidecar_dirty = False
        data, store = self.writer.sidecar_bytes(), self.writer.store_sidecar
        durable.submit(self.sidecar_key, lambda: store(data), self._sidecar_stored)
        return False

    def _sidecar_stored(self, exc: BaseException | None) -> None:
        if exc is not None:
            self.sidecar_dirty = True  # retried at the next commit
            self.writer.sidecar_failed(exc if isinstance(exc, OSError) else OSError(str(exc)))

    def close(self) -> None:
        """Flush, write the sidecar if it changed, close the descriptor.

        Rows that still cannot be written are let go: their spool file keeps them and its
        checkpoint is behind them, so the next exprd applies them.
        """
        if self.durable is not None and self.durable.pending(self.sidecar_key):
            self.durable.wait(self.sidecar_key)  # the writer thread's copy must not land last
        if self.writer.unsafe or not self.flush():
            lost = self.writer.discard()
            if lost and not self.writer.unsafe:
                log.warning("%s: %d rows left in the spool for a later retry (%s)",
                            self.paths.shard, lost, self.blocked)
            self.writer.release_fd()
            self.opened = False
            return
        if self.opened:
            status, end = self.writer.status, self.writer.end_time
            self.writer.close(status)  # writes the sidecar
            self.writer.end_time = end
            self.opened = False
            self.sidecar_dirty = False


class ShardPool:
    """The shard slots in use, keyed by shard path, with at most `max_open` descriptors.

    The least recently used shard gives its descriptor back first (after a flush); it is
    reopened at its next write. EMFILE and ENFILE are temporary: the rows wait in memory.
    """

    def __init__(self, warn: Callable[[str, str], None], max_open: int = 256,
                 durable: Durable | None = None) -> None:
        self.slots: dict[Path, ShardSlot] = {}
        self.warn = warn
        self.durable = durable
        self.max_open = max(1, max_open)
        self._lru: OrderedDict[Path, ShardSlot] = OrderedDict()  # slots with an open fd

    def acquire(self, spec: RunSpec) -> ShardSlot:
        slot = self.slots.get(spec.paths.shard)
        side = None
        if slot is None:
            slot = self.slots[spec.paths.shard] = ShardSlot(spec, self.warn, self.durable)
            side, slot.hint = slot.hint or {}, None  # just read: not read again
        if spec.time >= slot.newest:
            slot.newest, slot.kept = spec.time, None
            slot.writer.identity = spec.writer_identity()
            slot.adopt_config(spec.session, side)
        slot.refs += 1
        return slot

    def release(self, slot: ShardSlot) -> None:
        slot.refs -= 1
        if slot.refs <= 0:
            slot.close()
            self.slots.pop(slot.paths.shard, None)
            self._lru.pop(slot.paths.shard, None)

    def touch(self, slot: ShardSlot) -> None:
        """`slot` was just used: keep its descriptor, give back the oldest over the bound."""
        key = slot.paths.shard
        if not slot.writer.is_open:
            self._lru.pop(key, None)
            return
        self._lru[key] = slot
        self._lru.move_to_end(key)
        if len(self._lru) <= self.max_open:
            return
        while len(self._lru) > self.max_open:
            # the oldest first (`slot` is the newest: never given back here); a walk over
            # a copy of the whole dict at each touch was O(open shards) per touch
            old_key, old = next(iter(self._lru.items()))
            if old is slot:
                break
            # flushed first when it can be; a shard that cannot be written keeps its rows
            # in memory and gives its descriptor back all the same (reopened to retry)
            old.flush()
            old.writer.release_fd()
            del self._lru[old_key]

    def open_files(self) -> int:
        return len(self._lru)

    def flush(self) -> dict[int, bool]:
        """Flush every shard; per slot id, True if it holds no unwritten data."""
        ok: dict[int, bool] = {}
        for slot in list(self.slots.values()):
            ok[id(slot)] = slot.flush()
            self.touch(slot)
        return ok

    def sidecars(self, min_interval: float) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            if slot.sidecar_dirty and now - slot.last_sidecar >= min_interval:
                slot.write_sidecar()


class RunPipeline:
    """The pipeline of one spool file (one session of one shard)."""

    def __init__(self, spec: RunSpec, pool: ShardPool, cfg: Config, dispatcher: Any,
                 backend_offsets: Mapping[str, int], *, dry_run: bool = False) -> None:
        self.spec = spec
        self.pool = pool
        self.slot = pool.acquire(spec)
        self.dry_run = dry_run
        self.applied = 0
        self.skipped = 0
        self.alerting = spec.alert_on_rank is None or spec.alert_on_rank == spec.rank
        # which backends this rank feeds is decided per backend (backend_on_rank "auto")
        self.forwarder = Forwarder(spec, cfg, backend_offsets, enabled=not dry_run)
        self.rules = self._ruleset(spec.rules)
        self.pipeline = Pipeline(
            self.slot.writer, spec.identity, rules=self.rules,
            dispatcher=dispatcher if self.alerting else None,
            backends=self.forwarder.workers(), alerting=self.alerting,
            reporting=bool(self.forwarder.workers()), warn=self._warn,
        )
        self.suffix = b',"_sid":"%b"}\n' % spec.session.encode()
        # backends read the spool themselves (forwarder.Forwarder.pump): only rules need values
        self.needs_values = bool(self.rules is not None and self.rules.rules)
        self.closed = False
        # a shared rank_aware=False shard interleaves ranks' steps: nothing to compare
        self.started = not spec.rank_aware

    def _warn(self, cause: str, message: str) -> None:
        self.pool.warn(cause, message)

    @property
    def skip_upto(self) -> int:
        """The last seq of this session the shard holds: what it held when exprd first
        looked, plus what exprd applied since (flushed or not). Its events up to there are
        skipped, whatever file they come in (a spool file copied back after a rotation
        repeats them). Read only while the slot is not blocked."""
        slot = self.slot
        if slot.applied is None:
            return -1
        session = self.spec.session
        return max(slot.applied.get(session, -1), slot.pending.get(session, -1))

    @property
    def newest(self) -> bool:
        """This session is the shard's newest (its finish or crash sets the status)."""
        return self.spec.time >= self.slot.newest

    # -- what the tailer asks ---------------------------------------------------------
    @property
    def plain(self) -> bool:
        """No rules and no backends: applying a record is appending its line to the shard."""
        return not self.dry_run and not self.needs_values

    @property
    def blocked(self) -> str:
        """Why the shard cannot take rows now ("" if it can): read on once it can."""
        return self.slot.blocked

    @property
    def unsafe(self) -> str | None:
        """Why the run's path is refused (a symlink below the allowed root), if it is."""
        return self.slot.writer.unsafe

    @property
    def feeds_backends(self) -> bool:
        return self.forwarder.active

    def backend_stats(self) -> dict[str, Any]:
        return self.forwarder.stats()

    def overlap(self, ev: Mapping[str, Any], spool_dir: Path) -> str | None:
        """Why this session must not write its shard, checked at its first step row: the
        shard already holds that step or a later one, and a session whose spool file is
        not in `spool_dir` wrote there. The SDK's resume starts after the shard's and the
        spool's last step, and its writer lock refuses a second process of one rank on
        one spool root (the sessions of one spool directory may be applied in any order);
        the same rank through two spool roots (two EXPR_SPOOL, two exprds) would
        interleave in the shard."""
        if self.started or "_kind" in ev:
            return None
        self.started = True
        slot = self.slot
        if self.skip_upto >= 0 or self.dry_run:
            return None  # a session the shard already has rows of
        if slot.opened or slot.writer.buffered():
            if not slot.open() or not slot.flush():
                return None  # read it later
            last, sessions = slot.writer.cursor.last_step, slot.writer.cursor.applied
        else:
            # nothing written since `scan` read the shard (a new run: no shard at all):
            # what it found stands, without opening (creating) anything yet
            last, sessions = slot.last_step, slot.applied or {}
        step = ev.get("_step")
        if last is None or type(step) is not int or step > last:
            return None
        stem = slot.paths.stem
        here = {session_of(p, stem) for p in spool_files_of(spool_dir, stem)}
        foreign = sorted(set(sessions) - here - {self.spec.session})
        if not foreign:
            return None
        return (f"rank {self.spec.rank}: the shard {slot.paths.shard} already holds steps up to "
                f"{last}, some of session {foreign[0]} (not in this spool root), and session "
                f"{self.spec.session} starts again at step {step}: one rank written through "
                "two spool roots? check RANK and EXPR_SPOOL")

    def prepare(self) -> ShardWriter:
        """Open the shard for the plain case (once this session has an event to add): its
        writer's `append` takes a line, `append_many` a block of them."""
        slot = self.slot
        slot.open()  # on failure the lines wait in the writer's buffer (slot.blocked)
        slot.running(self.spec.time)
        return slot.writer

    def appended(self, count: int, last_seq: int) -> None:
        """The plain case appended `count` records, the last of them `last_seq`."""
        self.applied += count
        pending = self.slot.pending
        pending[self.spec.session] = max(last_seq, pending.get(self.spec.session, -1))

    def used(self) -> None:
        """A round of reading is over: the pool may give back an older shard's descriptor."""
        self.pool.touch(self.slot)

    def settle(self, offset: int, seq: int | None) -> dict[str, int]:
        """Everything before `offset` is applied: the backends' checkpoints that follows."""
        self.forwarder.settle(offset, seq)
        return dict(self.forwarder.committed)

    def closing(self) -> bool:
        """True while a backend is still finishing (the run stays open until it is done)."""
        return self.forwarder.closing()

    def rows_written(self) -> bool:
        """The shard's rows are on disk (flushed)."""
        return self.slot.flush()

    def status_written(self) -> bool:
        """The shard's rows and status are on disk (flushed, sidecar written): a finished
        file may be checkpointed as finished and its run closed."""
        return self.slot.flush() and self.slot.write_sidecar()

    def checkpoint_marks(self) -> dict[str, int]:
        """What the checkpoint being taken now holds of the backends (see `checkpointed`)."""
        return self.forwarder.marks()

    def checkpointed(self, marks: dict[str, int] | None = None) -> None:
        """The checkpoint is on disk: the backends' journals may forget what it covers
        (`marks`, from `checkpoint_marks` when it was taken; by default what is settled now)."""
        self.forwarder.checkpointed(marks)

    def drain(self, timeout: float) -> None:
        """Shutdown: let the backends send what they hold (on their own threads)."""
        self.forwarder.close("running", timeout)

    def join(self, timeout: float) -> None:
        self.forwarder.join(timeout)

    def _ruleset(self, specs: list[Any]) -> Any:
        if not specs:
            return None
        from expr_tracker.alerts.rules import RuleSet, parse_rule

        rules = []
        for i, spec in enumerate(specs):
            try:
                rules.append(parse_rule(spec, index=i))
            except (TypeError, ValueError) as exc:
                log.warning("%s: rule %d skipped: %s", self.spec.paths.shard, i, exc)
        ctx = {"project": self.spec.identity.get("project"), "name": self.spec.identity.get("name"),
               "run": self.spec.identity.get("name"), "stream": self.spec.identity.get("stream"),
               "rank": self.spec.rank, "world_size": self.spec.identity.get("world_size")}
        return RuleSet(rules, context=ctx, start_time=self.spec.time or time.time())

    # -- events -------------------------------------------------------------------------
    def _values(self, ev: dict[str, Any], line: bytes) -> None:
        """Non-finite values come as strings on disk; rules and backends want floats."""
        if any(tok in line for tok in _NONFINITE_TOKENS):
            for key, value in ev.items():
                if value.__class__ is str and key[:1] != "_" and value in DECODE_NONFINITE:
                    ev[key] = DECODE_NONFINITE[value]

    def record(self, ev: dict[str, Any], line: bytes, seq: int, offset: int) -> bool:
        """Apply one record event; False if the shard already holds it."""
        if self.needs_values:
            self._values(ev, line)
        if seq <= self.skip_upto:
            self.skipped += 1
            if self.rules is not None and self.rules.rules:
                # rebuild window state from what was applied before; alerts already went out
                self.rules.observe(ev, ev.get("_step"), ev.get("_time") or time.time())
            return False
        self.applied += 1
        if self.dry_run:
            return True
        slot = self.slot
        if not slot.opened:
            slot.open()
        slot.running(self.spec.time)
        # the spool line verbatim, plus the session (the tailer took out any `_sid` the
        # line had): no re-encoding on the hot path
        self.pipeline.apply(ev, line=line.rstrip()[:-1] + self.suffix)
        slot.pending[self.spec.session] = seq
        return True

    def alert(self, ev: Mapping[str, Any], seq: int) -> None:
        """A manual alert from the training code (`et.alert`)."""
        if seq <= self.skip_upto or self.dry_run:
            return
        title, text, level = ev.get("title"), ev.get("text", ""), ev.get("level", "info")
        try:
            self.pipeline.manual_alert(str(title), str(text), str(level))
        except (TypeError, ValueError) as exc:
            log.warning("%s: alert event %d ignored: %s", self.spec.paths.shard, seq, exc)
        self._done(seq)

    def _done(self, seq: int) -> None:
        """Record a non-record event as applied (in the sidecar), so a replay skips it."""
        if self.slot.writer.sidecar_enabled:
            self.slot.open()
            self.slot.pending[self.spec.session] = seq

    def set_rules(self, ev: Mapping[str, Any]) -> None:
        """The run added or removed rules: keep the state of the rules that stay."""
        specs = ev.get("rules") or []
        new = self._ruleset(list(specs))
        if self.rules is None or new is None:
            self.rules = new
        else:
            keep = {r.name for r in new.rules}
            for rule in list(self.rules.rules):
                if rule.name not in keep:
                    self.rules.remove(rule.name)
            have = {r.name for r in self.rules.rules}
            for rule in new.rules:
                if rule.name not in have:
                    self.rules.add(rule)
        self.pipeline.rules = self.rules
        self.needs_values = bool(self.rules is not None and self.rules.rules)

    def set_config(self, ev: Mapping[str, Any], seq: int) -> None:
        """`Run.update_config`: the event holds the whole merged config (a replay of an
        older one is overtaken by the newer ones after it). Only a session that is the
        shard's newest sets it; backends keep the config they were opened with."""
        config = ev.get("config")
        if not isinstance(config, dict):
            log.warning("%s: config event %d ignored: config is not an object",
                        self.spec.paths.shard, seq)
            return
        if self.dry_run or self.spec.time < self.slot.newest:
            return
        if self.slot.writer.sidecar_enabled:
            self.slot.open()
        self.slot.set_config(config)
        if seq > self.skip_upto:
            self._done(seq)

    def set_probe(self, ev: Mapping[str, Any], seq: int) -> None:
        """Where the silent rank is (DESIGN 13): into the sidecar at the next commit, or out
        of it (a null probe: the rank logs again). A replayed probe is skipped."""
        if self.dry_run or seq <= self.skip_upto or self.spec.time < self.slot.newest:
            return
        from expr_tracker.probe import clean_probe  # only runs that go silent need it

        probe = clean_probe(ev.get("probe"))
        writer = self.slot.writer
        if writer.probe == probe:
            return
        writer.probe = probe
        if writer.sidecar_enabled:
            self.slot.open()
            self.slot.sidecar_dirty = True
            self.slot.last_sidecar = 0.0  # a probe is news: write it at the next commit
        self._done(seq)

    def spans(self, ev: Mapping[str, Any], seq: int) -> None:
        """Traced spans (`trace_spans=True`): appended to `spans[.rankN].jsonl` of the run
        (at least once: a restart between the write and the checkpoint repeats them)."""
        if self.dry_run or seq <= self.skip_upto:
            return
        from expr_tracker.probe import clean_spans

        lines = clean_spans(ev.get("spans"))
        if lines:
            self.slot.writer.append_file(spans_name(self.spec.rank), lines)
        self._done(seq)

    def adopt_rules(self, rules: Any) -> None:
        """The rule set of the session's previous segment, with its state."""
        self.rules = rules
        self.pipeline.rules = rules
        self.needs_values = bool(rules.rules)

    def rolled(self) -> None:
        """The segment is over, its session goes on in the next one: each backend closes
        once it has read it (the run stays "running")."""
        self.forwarder.finish("running")

    def add_dropped(self, cause: str, rows: int) -> None:
        """`rows` more lost to `cause` in this session (exprd's own count: a spool file
        moved away), into the sidecar as the SDK's notes are."""
        old = next((d for d in self.slot.writer.spool_dropped
                    if (d.get("cause"), d.get("session")) == (cause, self.spec.session)), {})
        self.set_dropped({"cause": cause, "rows": int(old.get("rows", 0)) + rows,
                          "since": old.get("since", time.time()), "host": self.spec.host})

    def set_dropped(self, ev: Mapping[str, Any]) -> bool:
        """A `dropped` note of the SDK (rows it could not put in a full spool): the count
        so far of this session, into the sidecar. False if the note is malformed."""
        rows, since, host = ev.get("rows"), ev.get("since"), ev.get("host")
        cause = ev.get("cause")
        if type(rows) is not int or rows < 0 or not isinstance(cause, str) or \
                not isinstance(since, (int, float)) or isinstance(since, bool):
            return False
        if self.dry_run:
            return True
        note = {"cause": cause[:64], "session": self.spec.session, "rows": rows,
                "since": float(since), "host": str(host or self.spec.host)[:256]}
        writer = self.slot.writer
        kept = [d for d in writer.spool_dropped
                if (d.get("cause"), d.get("session")) != (note["cause"], note["session"])]
        old = [d for d in writer.spool_dropped if d not in kept]
        if old and old[0].get("rows", 0) >= rows:
            return True  # a replay of an older note
        writer.spool_dropped = [*kept, note][-64:]
        if writer.sidecar_enabled:
            self.slot.open()
            self.slot.sidecar_dirty = True
            self.slot.last_sidecar = 0.0  # news: at the next commit
        return True

    def tick(self, now: float) -> None:
        """Time rules (no_data, age, elapsed) of a live run."""
        if not self.dry_run and self.rules is not None and self.rules.has_time_rules:
            self.pipeline.tick(now)

    def finish(self, status: str, when: float, seq: int | None = None,
               exit: Any = None, summary: Any = None) -> None:
        """The run finished (`seq` of its finish event) or was found crashed (None); `exit`
        is the finish event's {type, message, time} of an uncaught exception, `summary` the
        run's final values (`Run.finish`)."""
        if self.dry_run:
            return
        self.forwarder.finish(status)
        if seq is not None and seq <= self.skip_upto:
            return
        if self.spec.time >= self.slot.newest:
            self.slot.set_status(status, when, exit_info(exit) if status == "crashed" else None)
            checked = summary_info(summary)
            if checked is not None:
                self.slot.writer.identity["summary"] = checked
        if seq is not None and self.slot.opened:
            self._done(seq)

    def close(self) -> None:
        """Give back the shard slot (the last user flushes and closes it)."""
        if not self.closed:
            self.closed = True
            self.pool.release(self.slot)


MAX_SUMMARY = 64 << 10  # bytes of a summary exprd puts in a sidecar


def summary_info(value: Any) -> dict[str, Any] | None:
    """A finish event's `summary`, checked: an object of string keys, bounded in size (the
    spool is untrusted input); None to leave the sidecar without one."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    try:
        size = len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        return None
    if size > MAX_SUMMARY:
        log.warning("a summary of %d bytes is over %d: not put in the sidecar", size, MAX_SUMMARY)
        return None
    return value


def exit_info(value: Any) -> dict[str, Any] | None:
    """A finish event's `exit`, checked: only the fields direct mode writes, bounded (the
    spool is a file anyone with the training user's rights could have written)."""
    if not isinstance(value, Mapping):
        return None
    out: dict[str, Any] = {"type": str(value.get("type") or "exception")[:200],
                           "message": str(value.get("message") or "")[:1000]}
    when = value.get("time")
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        out["time"] = float(when)
    thread = value.get("thread")
    if isinstance(thread, str):
        out["thread"] = thread[:200]
    code = value.get("code")  # finish(exit_code=N)
    if type(code) is int and -(1 << 31) <= code < (1 << 31):
        out["code"] = code
    return out


def forget_file(state: Path, rel: str) -> None:
    """A spool file is gone (retention, or by hand): what exprd kept for it goes too."""
    drop_journals(state, rel)
