"""Builds a Pipeline per spool file from its init event and applies the file's events.

The pipeline is the SDK's own (`expr_tracker.pipeline.Pipeline`): shard, rules, alerts,
backends. Shard writers are shared by the spool files of one shard (a resumed run has
one file per session) and opened only when an event must really be written, so a
replay that has nothing new to apply leaves the run directory untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from expr_tracker.pipeline import Pipeline
from expr_tracker.store.records import DECODE_NONFINITE
from expr_tracker.store.shard import ShardWriter, read_sidecar
from expr_tracker.store.spoolfile import event_id, scan_shard

from .config import Config
from .forwarder import Forwarder
from .spec import RunSpec

log = logging.getLogger("exprd")
_NONFINITE_TOKENS = (b'"NaN"', b'Infinity"', b'"nan"', b'inf"')


class ShardSlot:
    """One shard file: its lazily opened writer, applied seqs and pending status."""

    def __init__(self, spec: RunSpec, warn: Callable[[str, str], None]) -> None:
        self.paths = spec.paths
        self.applied = scan_shard(spec.paths).applied  # read-only; the writer rescans at open
        self.writer = ShardWriter(
            spec.paths, spec.writer_identity(), shared=not spec.rank_aware,
            write_sidecar=spec.rank_aware or spec.rank == 0, warn=warn, dropped={},
        )
        self.opened = False
        self.pending: dict[str, int] = {}  # session -> last seq appended, not yet flushed
        self.refs = 0
        self.newest = self.first_time = spec.time
        self.sidecar_dirty = False
        self.last_sidecar = 0.0

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            cursor = self.writer.open()
            if not cursor.rows and self.first_time:
                self.writer.start_time = self.first_time  # the run's start, not exprd's
            self.writer.status = "running"
            self.writer.end_time = None

    def flush(self) -> bool:
        """Flush appended lines; on success record their seqs as applied."""
        if not self.opened:
            return True
        ok = self.writer.flush()
        if ok and self.pending:
            self.writer.cursor.applied.update(self.pending)
            self.pending.clear()
            self.sidecar_dirty = True
        return ok

    def set_status(self, status: str, when: float) -> None:
        """Mark the shard `finished` or `crashed` in its sidecar (only if that changes it)."""
        if not self.opened:
            side = read_sidecar(self.paths.sidecar) or {}
            if side.get("status") == status or not self.writer.sidecar_enabled:
                return
            if not self.paths.shard.exists():
                return
            self.open()
        self.writer.status = status
        self.writer.end_time = when
        self.sidecar_dirty = True

    def write_sidecar(self) -> None:
        if self.opened and self.sidecar_dirty:
            self.sidecar_dirty = False
            self.last_sidecar = time.monotonic()
            self.writer.write_sidecar()

    def close(self) -> None:
        """Flush, write the sidecar if it changed, close the descriptor."""
        if self.opened:
            self.flush()
            status, end = self.writer.status, self.writer.end_time
            self.writer.close(status)  # writes the sidecar
            self.writer.end_time = end
            self.opened = False
            self.sidecar_dirty = False


class ShardPool:
    """The shard slots in use, keyed by shard path."""

    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self.slots: dict[Path, ShardSlot] = {}
        self.warn = warn

    def acquire(self, spec: RunSpec) -> ShardSlot:
        slot = self.slots.get(spec.paths.shard)
        if slot is None:
            slot = self.slots[spec.paths.shard] = ShardSlot(spec, self.warn)
        if spec.time >= slot.newest:
            slot.newest = spec.time
            slot.writer.identity = spec.writer_identity()
        slot.refs += 1
        return slot

    def release(self, slot: ShardSlot) -> None:
        slot.refs -= 1
        if slot.refs <= 0:
            slot.close()
            self.slots.pop(slot.paths.shard, None)

    def flush(self) -> bool:
        """Flush every open shard; False if one still has unwritten data."""
        ok = True
        for slot in self.slots.values():
            ok = slot.flush() and ok
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
        self.skip_upto = self.slot.applied.get(spec.session, -1)
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
        self.needs_values = bool(self.rules is not None and self.rules.rules) or bool(
            self.forwarder.workers())
        self.closed = False

    def _warn(self, cause: str, message: str) -> None:
        log.warning("%s", message)

    @property
    def plain(self) -> bool:
        """No rules and no backends: applying a record is appending its line to the shard."""
        return not self.dry_run and not self.needs_values

    def prepare(self) -> Callable[[bytes], None]:
        """Open the shard for the plain path (once this session has an event to add)."""
        slot = self.slot
        if not slot.opened:
            slot.open()
        if slot.writer.status != "running":
            slot.writer.status, slot.writer.end_time = "running", None
        return slot.writer.append

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
            if self.forwarder.active:
                ev["_id"] = event_id(self.spec.session, seq)
        if seq <= self.skip_upto:
            self.skipped += 1
            if self.rules is not None and self.rules.rules:
                # rebuild window state from what was applied before; alerts already went out
                self.rules.observe(ev, ev.get("_step"), ev.get("_time") or time.time())
            self.forwarder.catch_up(ev, offset)
            return False
        self.applied += 1
        if self.dry_run:
            return True
        slot = self.slot
        if not slot.opened:
            slot.open()
        if slot.writer.status != "running":
            slot.writer.status, slot.writer.end_time = "running", None
        # the spool line verbatim, plus the session: no re-encoding on the hot path
        shard_line = line + b"\n" if "_sid" in ev else line.rstrip()[:-1] + self.suffix
        self.pipeline.apply(ev, line=shard_line)
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
        self.needs_values = bool(self.rules is not None and self.rules.rules) or self.forwarder.active

    def tick(self, now: float) -> None:
        """Time rules (no_data, age, elapsed) of a live run."""
        if not self.dry_run and self.rules is not None and self.rules.has_time_rules:
            self.pipeline.tick(now)

    def finish(self, status: str, when: float, seq: int | None = None) -> None:
        """The run finished (`seq` of its finish event) or was found crashed (None)."""
        if self.dry_run:
            return
        self.forwarder.close(status)
        if seq is not None and seq <= self.skip_upto:
            return
        if self.spec.time >= self.slot.newest:
            self.slot.set_status(status, when)
        if seq is not None and self.slot.opened:
            self._done(seq)

    def close(self) -> None:
        """Give back the shard slot (the last user flushes and closes it)."""
        if not self.closed:
            self.closed = True
            self.pool.release(self.slot)
