"""A watcher of one run: read its live state, detect, record and deliver incidents (DESIGN 13).

`Watcher(run_dir, cfg, dispatcher).check()` runs one pass. Read offsets live in memory;
open incidents live in `{run}/incidents.jsonl` (`incidentlog.IncidentLog`), so a
restarted watcher (or a second one, exprd and `expr watch` on the same run) reads them
back and does not repeat them.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expr_tracker.gcpause import paused_gc
from expr_tracker.health.clock import CacheLearner, attr_cache
from expr_tracker.health.config import HealthConfig
from expr_tracker.health.detect import Memory, detect, ended
from expr_tracker.health.incidentlog import INCIDENTS as INCIDENTS  # (re-exported)
from expr_tracker.health.incidentlog import IncidentLog as IncidentLog
from expr_tracker.health.incidentlog import _LineTail, owner_alive, refusal
from expr_tracker.health.incidentlog import open_incidents as open_incidents
from expr_tracker.health.incidents import Incident, plan
from expr_tracker.health.state import DEFAULT_WINDOW, RunReader, RunState
from expr_tracker.ranks import compact

if TYPE_CHECKING:
    from expr_tracker.alerts import Dispatcher

# kinds paged as soon as they open: raised on evidence, not on a threshold a blip can
# cross (a crash, a lost node, a non-finite value; a stall too when its probes are
# evidence, `Incident.evidence`)
PAGE_AT_ONCE = ("crashed", "lost", "nonfinite")
_ALERTS_RE = re.compile(r"alerts(?:\.rank(\d+))?\.jsonl\Z")


def root_words(root: dict[str, Any]) -> str:
    """A crash's root in a page's words: "rank 2 on node1: its process 4244 is gone"."""
    where = f" on {root['host']}" if root.get("host") else ""
    why = ": ".join(str(x) for x in (root.get("type"), root.get("message")) if x)
    return f"rank {root.get('rank')}{where}" + (f": {why}" if why else "")


def learned_note(cache: float) -> str:
    """What a watcher says when it learned the filesystem's attribute cache."""
    return (f"other hosts' heartbeats in the run directory show up about {cache:g}s late "
            "(the filesystem's attribute cache, learned: set fs_cache to say it): silence "
            "and 'behind' are believed only beyond it")


def with_cache(cfg: HealthConfig, run_dir: Path) -> tuple[HealthConfig, str | None]:
    """`cfg` with `fs_cache` resolved (configured, else the mount's, else 0), and the
    sentence a watcher says at start when it is not 0."""
    if cfg.fs_cache is not None:
        why = "configured"
        cache = cfg.fs_cache
    else:
        found = attr_cache(run_dir)
        cache, why = found if found is not None else (0.0, "")
        cfg = replace(cfg, fs_cache=cache)
    if not cache:
        return cfg, None
    return cfg, (f"the run directory's filesystem may show a file's size up to {cache:g}s old "
                 f"({why}): silence and 'behind' are believed only beyond it")


class Watcher:
    """Watches one stream of one run; `check()` is one pass."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        cfg: HealthConfig | None = None,
        dispatcher: Dispatcher | None = None,
        *,
        stream: str | None = None,
        window: int | None = None,
        owner: bool = True,
    ) -> None:
        """`owner`: this watcher keeps watching (not one pass, `--once`), so others leave
        what it opens to it (`_keep_others`)."""
        self.run_dir = Path(run_dir)
        self.cfg, self.cache_note = with_cache(cfg or HealthConfig(), self.run_dir)
        # neither configured nor told by the mount: learned from what this watcher sees
        self.learner = (CacheLearner(socket.gethostname())
                        if (cfg or HealthConfig()).fs_cache is None and not self.cfg.fs_cache
                        else None)
        self.dispatcher = dispatcher
        need = 2 * max(self.cfg.straggler_steps, self.cfg.slowdown_steps) + 1
        self.reader = RunReader(self.run_dir, stream, window=window or max(DEFAULT_WINDOW, need),
                                series=self.cfg.step_time_key)
        self.reader.cache = self.cfg.fs_cache or 0.0
        self.memory = Memory()
        self.log = IncidentLog(self.run_dir)
        self._alerts: dict[str, _LineTail] = {}
        self._suppressed: dict[tuple[int, str], dict[str, Any]] = {}
        self.state: RunState | None = None
        self.errors = 0
        self.write_error: str | None = None  # why the last pass could not record its incidents
        self._clocked = False  # the filesystem's clock measured (on the first pass)
        self._seen_at: dict[str, float] = {}  # incident id -> when this watcher first saw it open
        if owner:  # a long-running watcher (exprd, `expr watch`): it resolves what it opens
            self.log.owner = self.log.token
        self._now = 0.0  # the time of the current pass

    @property
    def open(self) -> list[Incident]:
        """The open incidents, oldest first."""
        return sorted(self.log.open.values(), key=lambda i: (i.first_seen, i.kind, i.ranks))

    def _read_alerts(self) -> None:
        # the reader listed the run directory this pass (or knows it did not change)
        names = [n for n in self.reader.names if n.startswith("alerts") and _ALERTS_RE.match(n)]
        for name in names:
            tail = self._alerts.get(name)
            if tail is None:
                tail = self._alerts[name] = _LineTail(self.run_dir / name)
            m = _ALERTS_RE.match(name)
            file_rank = int(m.group(1) or 0) if m else 0
            for a in tail.new_lines():
                if a.get("suppressed") != "rank" or a.get("delivered"):
                    continue  # delivered by its rank, or held back by a channel's own policy
                rank = a["rank"] if type(a.get("rank")) is int else file_rank
                a["rank"] = rank
                self._suppressed[(rank, str(a.get("rule") or a.get("title")))] = a

    @property
    def ended(self) -> bool:
        """The run is over (by the last pass): every rank finished or crashed."""
        return self.state is not None and ended(self.state)

    def check(self, now: float | None = None) -> list[Incident]:
        """One pass: read, detect, record and deliver what changed. Returns the changes.
        `now`: the pass's time on the watcher's clock (default `reader.clock()`). No cyclic
        collections meanwhile (`gcpause`: at 16,384 ranks the detectors' allocations set
        off collections that walk the state just read, a tenth of a first pass)."""
        with paused_gc():
            return self._check(now)

    def _check(self, now: float | None) -> list[Incident]:
        if not self._clocked and self.run_dir.is_dir():
            # files not seen change yet are dated by their mtimes, on the filesystem's clock
            self._clocked = True
            self.reader.fs_offset = self.log.fs_offset() or 0.0
        now = self.reader.clock() if now is None else now
        self.state = self.reader.read(now)
        self._learn()
        self._read_alerts()
        self.log.sync()
        findings = detect(self.state, list(self._suppressed.values()), self.cfg, self.memory, now)
        p = plan(self.log.open.values(), findings, now, self.state,
                 crash_window=self.cfg.crash_window, ended=ended(self.state),
                 cache=self.cfg.fs_cache or 0.0)
        self._keep_others(p)
        for inc in p.still_open:  # last_seen and step in memory; the file keeps the first line
            self.log.open[inc.id] = inc
        for inc in self.log.open.values():  # when this watcher first saw each open incident
            self._seen_at.setdefault(inc.id, min(now, inc.first_seen or now))
        self._now = now
        # a symlink or FIFO in the file's place is neither read nor appended to
        refused = self.log.refused
        self.write_error = None if refused is None else f"cannot record incidents: {refused}"
        late = self.dispatcher is not None and (
            bool(self.log.outcomes) or any(self._due(i) for i in self.log.undelivered()))
        if not (p.opened or p.resolved or p.updated or late) or not self.run_dir.is_dir():
            return []
        deliver = self._deliver if self.dispatcher is not None else None
        if refused is not None:
            self.errors += 1
            return self.log.unrecorded(p.resolved + p.opened, deliver, p.updated, self._due)
        try:
            return self.log.record(p.resolved + p.opened, deliver, p.updated, self._due)
        except OSError as exc:
            # a read-only run directory (a teammate's run, a ro mount): the incidents are
            # shown and delivered from memory, and the error is named, not swallowed
            self.errors += 1
            self.write_error = f"cannot record incidents: {refusal(self.log.path, exc)}"
            return self.log.unrecorded(p.resolved + p.opened, deliver, p.updated, self._due)

    def _learn(self) -> None:
        """The learned attribute cache (`clock.CacheLearner`) holds from this pass's
        detectors on, and is said (`cache_note`, which `expr watch` and exprd print)."""
        if self.learner is None or not self.learner.see(self.reader.heartbeat_mtimes):
            return
        cache = self.learner.value
        self.cfg = replace(self.cfg, fs_cache=cache)
        self.reader.cache = cache
        self.cache_note = learned_note(cache) if cache else None

    def _keep_others(self, p: Any) -> None:
        """What another live watcher opened, it resolves (its thresholds, its evidence: a
        watcher with a higher `behind_steps` must not resolve what exprd still sees);
        this one only when the run ended or the ranks stopped, or its owner is gone (on
        this host, its pid; on another, never known: it stays until the run ends)."""
        keep = [inc for inc in p.resolved if self._theirs(inc) and inc.reason is None]
        if keep:
            ids = {inc.id for inc in keep}
            p.resolved = [inc for inc in p.resolved if inc.id not in ids]
            p.still_open.extend(self.log.open[i] for i in ids if i in self.log.open)
        # nor does it rename another's stall: its suspects are that watcher's judgement
        # (two views of one stall, through a cache, would rewrite them back and forth);
        # evidence it only adds (a crash's ranks, a lost node's collateral) it writes
        theirs = [inc for inc in p.updated if inc.kind == "stall" and self._theirs(inc)]
        if theirs:
            ids = {inc.id for inc in theirs}
            p.updated = [inc for inc in p.updated if inc.id not in ids]
            p.still_open.extend(self.log.open[i] for i in ids if i in self.log.open)

    def _theirs(self, inc: Incident) -> bool:
        """`inc` was opened by another watcher that may still run."""
        return inc.by is not None and inc.by != self.log.owner and owner_alive(inc.by)

    def _due(self, inc: Incident) -> bool:
        """`inc` may be paged now: it has held `page_after` on this watcher's clock (from
        when it first saw it, or the line's `first_seen` if earlier), or it was raised on
        evidence (a crash, a lost node, a stall whose probes name a culprit)."""
        if inc.cause is not None:  # collateral of another incident (a lost node): it pages
            return False
        if inc.kind in PAGE_AT_ONCE or inc.evidence or self.cfg.page_after <= 0:
            return True
        since = self._seen_at.get(inc.id, inc.first_seen or self._now)
        return self._now - min(since, inc.first_seen or since) >= self.cfg.page_after

    def settle(self) -> list[Incident]:
        """Write what the channels said of the pages on their way (`IncidentLog._settle`);
        `expr watch` calls it after waiting for them, before it exits."""
        if not self.log.outcomes or not self.run_dir.is_dir():
            return []
        try:
            with self.log._locked() as fd:
                self.log.sync(fd)
                return self.log._settle(fd)
        except OSError:
            self.errors += 1
            return []

    def others(self) -> list[Incident]:
        """The incident lines other watchers appended since the last call (every reader
        shows every line of incidents.jsonl, whoever recorded it)."""
        return self.log.take_others()

    def _deliver(self, inc: Incident) -> bool:
        if self.dispatcher is None or (inc.state == "resolved" and not self.cfg.notify_recovery):
            return False
        from expr_tracker.alerts import make_alert

        run = self.run_dir
        what = "resolved" if inc.state == "resolved" else inc.kind
        where = f" on {', '.join(inc.hosts)}" if inc.hosts and len(inc.hosts) <= 3 else ""
        title = f"{what}: rank{'s' if len(inc.ranks) != 1 else ''} {compact(inc.ranks)}{where}"
        if inc.metric is not None:
            title = f"{what}: {inc.metric} on {title.split(': ', 1)[1]}"
        corrected = "corrected" in inc.extra and inc.root is not None and inc.state == "open"
        if corrected:  # (`IncidentLog._correct`: the root moved after the first page)
            title = f"root corrected: {root_words(inc.root or {})}"
        try:
            alert = make_alert(
                title=title if inc.state == "open" else f"recovered: {inc.kind} {title}",
                text=inc.detail,
                level=inc.level if inc.state == "open" else "info",
                # one dedup key per incident (and one per correction of its root)
                rule=f"health:{inc.kind}:{compact(inc.ranks)}" + (":root" if corrected else ""),
                kind="fire" if inc.state == "open" else "recover",
                step=inc.step, time=inc.last_seen, project=run.parent.name, run=run.name,
                stream=self.reader.stream, rank=inc.ranks[0] if inc.ranks else 0,
                # one page per incident of one run (DESIGN 13 Delivery; the idempotency key)
                event_id=f"health:{inc.id}:" + (
                    f"root:{(inc.root or {}).get('rank')}" if corrected else inc.state),
            )
        except (TypeError, ValueError):
            return False
        key = (inc.id, "root" if corrected else inc.state)
        outcome = self.dispatcher.submit(alert, on_done=lambda ok: self.log.done(key, ok))
        return any(v == "queued" for v in outcome.values())
