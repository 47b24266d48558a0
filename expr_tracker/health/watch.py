"""A watcher of one run: read its live state, detect, record and deliver incidents (DESIGN 13).

`Watcher(run_dir, cfg, dispatcher).check()` runs one pass. Read offsets live in memory;
open incidents live in `{run}/incidents.jsonl`, so a restarted watcher (or a second one,
exprd and `expr watch` on the same run) reads them back and does not repeat them: every
line is appended under an `flock` of the file after re-reading what others appended.

The file is opened relative to a descriptor of the run directory, with O_NOFOLLOW and
O_APPEND, and each line is one `os.write`: nothing is written outside the run directory
and a reader never sees half a line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.detect import Memory, detect
from expr_tracker.health.incidents import Incident, plan
from expr_tracker.health.state import DEFAULT_WINDOW, RunReader, RunState
from expr_tracker.ranks import compact
from expr_tracker.store import records

if TYPE_CHECKING:
    from expr_tracker.alerts import Dispatcher

INCIDENTS = "incidents.jsonl"
_ALERTS_RE = re.compile(r"alerts(?:\.rank(\d+))?\.jsonl\Z")
_MAX_READ = 4 << 20  # bytes of an alerts or incidents file read per pass (the rest next pass)


class _LineTail:
    """Complete lines appended to one file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.ino: int | None = None

    def new_lines(self, fd: int | None = None) -> Iterator[dict[str, Any]]:
        try:
            fh = open(fd, "rb", closefd=False) if fd is not None else open(self.path, "rb")  # noqa: SIM115
        except OSError:
            return
        with fh:
            st = os.fstat(fh.fileno())
            if st.st_ino != self.ino or st.st_size < self.offset:
                self.ino, self.offset = st.st_ino, 0  # new or truncated: from the start
            if st.st_size == self.offset:
                return
            fh.seek(self.offset)
            data = fh.read(min(st.st_size - self.offset, _MAX_READ))
        end = data.rfind(b"\n") + 1
        self.offset += end
        for _, line in records.iter_lines(data[:end]):
            try:
                rec = records.loads(line)
            except ValueError:
                continue
            yield rec


class IncidentLog:
    """`{run}/incidents.jsonl`: the open incidents, read back and appended to."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / INCIDENTS
        self._tail = _LineTail(self.path)
        self.open: dict[tuple[str, tuple[int, ...]], Incident] = {}

    def sync(self, fd: int | None = None) -> None:
        """Apply the lines appended since the last call (by us or another watcher)."""
        for line in self._tail.new_lines(fd):
            inc = Incident.from_line(line)
            if inc is None:
                continue
            if inc.state == "open":
                self.open[inc.key] = inc
            else:
                self.open.pop(inc.key, None)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd = os.open(INCIDENTS, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    def record(self, changes: list[Incident], deliver: Callable[[Incident], bool]) -> list[Incident]:
        """Append `changes` that nobody recorded yet, delivering each first; returns those.

        Under the file lock: re-read what other watchers appended, skip an opening that is
        already open (or a resolution of what is not), deliver, append one line each.
        """
        done: list[Incident] = []
        with self._locked() as fd:
            self.sync(fd)
            for inc in changes:
                is_open = inc.key in self.open
                if (inc.state == "open") == is_open:
                    continue
                inc.delivered = deliver(inc)
                line = orjson.dumps(inc.as_line(), option=orjson.OPT_APPEND_NEWLINE)
                os.write(fd, line)  # one write of one whole line, O_APPEND
                done.append(inc)
            self.sync(fd)
        return done


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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg or HealthConfig()
        self.dispatcher = dispatcher
        need = 2 * max(self.cfg.straggler_steps, self.cfg.slowdown_steps) + 1
        self.reader = RunReader(self.run_dir, stream, window=window or max(DEFAULT_WINDOW, need),
                                series=self.cfg.step_time_key)
        self.memory = Memory()
        self.log = IncidentLog(self.run_dir)
        self._alerts: dict[str, _LineTail] = {}
        self._suppressed: dict[tuple[int, str], dict[str, Any]] = {}
        self.state: RunState | None = None
        self.errors = 0

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

    def check(self, now: float | None = None) -> list[Incident]:
        """One pass: read, detect, record and deliver what changed. Returns the changes."""
        now = time.time() if now is None else now
        self.state = self.reader.read()
        self._read_alerts()
        self.log.sync()
        findings = detect(self.state, list(self._suppressed.values()), self.cfg, self.memory, now)
        p = plan(self.log.open.values(), findings, now, self.state)
        for inc in p.still_open:  # last_seen and step in memory; the file keeps the first line
            self.log.open[inc.key] = inc
        if not (p.opened or p.resolved) or not self.run_dir.is_dir():
            return []
        try:
            return self.log.record(p.resolved + p.opened, self._deliver)
        except OSError:
            self.errors += 1
            return []

    def _deliver(self, inc: Incident) -> bool:
        if self.dispatcher is None or (inc.state == "resolved" and not self.cfg.notify_recovery):
            return False
        from expr_tracker.alerts import make_alert

        run = self.run_dir
        what = "resolved" if inc.state == "resolved" else inc.kind
        where = f" on {', '.join(inc.hosts)}" if inc.hosts and len(inc.hosts) <= 3 else ""
        title = f"{what}: rank{'s' if len(inc.ranks) != 1 else ''} {compact(inc.ranks)}{where}"
        try:
            alert = make_alert(
                title=title if inc.state == "open" else f"recovered: {inc.kind} {title}",
                text=inc.detail,
                level=inc.level if inc.state == "open" else "info",
                rule=f"health:{inc.kind}:{compact(inc.ranks)}",  # one dedup key per incident
                kind="fire" if inc.state == "open" else "recover",
                step=inc.step, time=inc.last_seen, project=run.parent.name, run=run.name,
                stream=self.reader.stream, rank=inc.ranks[0] if inc.ranks else 0,
            )
        except (TypeError, ValueError):
            return False
        outcome = self.dispatcher.submit(alert)
        return any(v == "queued" for v in outcome.values())
