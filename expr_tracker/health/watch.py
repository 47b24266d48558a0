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
import stat
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from expr_tracker.gcpause import paused_gc
from expr_tracker.health.clock import fs_offset
from expr_tracker.health.config import HealthConfig
from expr_tracker.health.detect import Memory, detect, ended
from expr_tracker.health.incidents import Incident, plan
from expr_tracker.health.state import DEFAULT_WINDOW, RunReader, RunState
from expr_tracker.ranks import compact
from expr_tracker.store import records
from expr_tracker.store.safedir import open_file

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
        self.refused: str | None = None  # why the file is not read (a symlink, a FIFO)

    def _open(self) -> int | None:
        """The file for reading, or None: missing, or refused (`refused` says why). A
        symlink is not followed and a FIFO or device not read (O_NONBLOCK: opening a FIFO
        nobody writes would block the watcher, and every run it watches, for good)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            self.refused = None
            return None
        except OSError as exc:
            self.refused = refusal(self.path, exc)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self.refused = f"{self.path} is not a regular file"
            return None
        self.refused = None
        return fd

    def new_lines(self, fd: int | None = None) -> Iterator[dict[str, Any]]:
        if fd is None:
            fd = self._open()
            if fd is None:
                return
            fh = open(fd, "rb")  # noqa: SIM115
        else:
            fh = open(fd, "rb", closefd=False)  # noqa: SIM115
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


def refusal(path: Path, exc: OSError) -> str:
    """Why `path` could not be opened, in words: a symlink is named as one."""
    if os.path.islink(path):
        return f"{path} is a symlink (not followed)"
    return f"{path}: {exc.strerror or exc}"


_TORN = {  # what a torn line most likely still holds (see `incidents.LINE_KEYS`)
    "id": re.compile(rb'"id"\s*:\s*"([^"\\]{1,64})"'),
    "kind": re.compile(rb'"kind"\s*:\s*"([a-z]{1,32})"'),
    "state": re.compile(rb'"state"\s*:\s*"(open|resolved)"'),
    "ranks": re.compile(rb'"ranks"\s*:\s*\[([\d,\s]{0,100000})\]'),
}


def salvage(fragment: bytes) -> Incident | None:
    """The incident a torn line was recording, as far as it can be read (it was delivered:
    a watcher delivers before it writes the line)."""
    found = {k: m.group(1).decode() for k, rx in _TORN.items() if (m := rx.search(fragment))}
    if "kind" not in found or "ranks" not in found:
        return None
    ranks = tuple(sorted(int(r) for r in found["ranks"].replace(" ", "").split(",") if r))
    inc = Incident(kind=found["kind"], ranks=ranks, hosts=(), step=None, first_seen=0.0,
                   last_seen=0.0, detail="(recovered from a torn line of incidents.jsonl)",
                   state=found.get("state", "open"), delivered=True)
    if "id" in found:
        inc.id = found["id"]
    return inc


class IncidentLog:
    """`{run}/incidents.jsonl`: the open incidents (by id), read back and appended to."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / INCIDENTS
        self._tail = _LineTail(self.path)
        self.open: dict[str, Incident] = {}
        self.torn = 0  # torn tails set aside by this watcher
        self.offered: set[str] = set()  # ids this watcher tried to deliver (at most once each)

    def sync(self, fd: int | None = None) -> None:
        """Apply the lines appended since the last call (by us or another watcher)."""
        for line in self._tail.new_lines(fd):
            inc = Incident.from_line(line)
            if inc is None:
                continue
            if inc.state == "open":
                self.open[inc.id] = inc
            else:
                self.open.pop(inc.id, None)

    @property
    def refused(self) -> str | None:
        """Why the file is not read or written (a symlink, a FIFO), if it is not."""
        return self._tail.refused

    def _open_fd(self) -> int:
        dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return open_file(dfd, INCIDENTS, os.O_RDWR | os.O_APPEND | os.O_CREAT,
                             where=self.run_dir)
        finally:
            os.close(dfd)

    def fs_offset(self) -> float | None:
        """The run directory's filesystem's clock minus ours (`health.clock.fs_offset`)."""
        try:
            fd = self._open_fd()
        except OSError:
            return None
        try:
            return fs_offset(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        fd = self._open_fd()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    def _set_aside_torn(self, fd: int) -> Incident | None:
        """A last line without its newline (a watcher killed mid-write) goes to
        `incidents.jsonl.torn` and is cut off, so the next line is not glued onto it.
        Returns the incident it held, if it can be read (to be written again whole)."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return None
        start = max(0, size - _MAX_READ)
        data = os.pread(fd, size - start, start)
        cut = data.rfind(b"\n") + 1
        if cut == 0 and start > 0:
            return None  # a "line" of more than _MAX_READ bytes: not ours, leave it
        fragment = data[cut:]
        dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            side = open_file(dfd, INCIDENTS + ".torn", os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                             where=self.run_dir)  # (a FIFO there would block the open)
        finally:
            os.close(dfd)
        try:
            os.write(side, fragment + b"\n")
        finally:
            os.close(side)
        os.ftruncate(fd, start + cut)
        self.torn += 1
        return salvage(fragment)

    def undelivered(self) -> list[Incident]:
        """The open incidents that nobody delivered and this watcher has not offered yet."""
        return [inc for inc in self.open.values() if not inc.delivered and inc.id not in self.offered]

    def record(self, changes: list[Incident], deliver: Callable[[Incident], bool] | None,
               updates: list[Incident] | None = None) -> list[Incident]:
        """Append `changes` (openings, resolutions) that nobody recorded yet, delivering
        each first, and `updates` (lines of an open incident's id: not delivered again);
        returns those written.

        Under the file lock: set a torn tail aside, re-read what other watchers appended,
        skip an opening that is already open (or a resolution of what is not), deliver,
        append one line each. With `deliver` None (a watcher without channels: `expr
        watch` with no alert config) nothing is delivered and the openings are recorded
        undelivered; a watcher with channels then delivers each open incident that nobody
        delivered, once, and appends its line again with `delivered` true, so a terminal
        that saw the stall first does not take its page away (those lines are returned too).
        """
        done: list[Incident] = []
        with self._locked() as fd:
            recovered = self._set_aside_torn(fd)
            self.sync(fd)
            if recovered is not None and self._fresh(recovered):
                os.write(fd, orjson.dumps(recovered.as_line(), option=orjson.OPT_APPEND_NEWLINE))
                self.sync(fd)
            for inc in changes:
                if inc.state == "resolved":
                    if inc.id not in self.open:
                        continue
                elif not self._fresh(inc):
                    continue
                self.offered.add(inc.id)
                inc.delivered = deliver(inc) if deliver is not None else False
                line = orjson.dumps(inc.as_line(), option=orjson.OPT_APPEND_NEWLINE)
                os.write(fd, line)  # one write of one whole line, O_APPEND
                done.append(inc)
            for inc in updates or ():
                cur = self.open.get(inc.id)
                if cur is None or (cur.ranks == inc.ranks and cur.detail == inc.detail):
                    continue
                inc.delivered = cur.delivered
                os.write(fd, orjson.dumps(inc.as_line(), option=orjson.OPT_APPEND_NEWLINE))
                done.append(inc)
            if deliver is not None:
                self.sync(fd)
                for inc in self.undelivered():
                    self.offered.add(inc.id)  # a channel's policy that held it back is not asked again
                    if deliver(inc):
                        late = replace(inc, delivered=True)
                        os.write(fd, orjson.dumps(late.as_line(), option=orjson.OPT_APPEND_NEWLINE))
                        done.append(late)  # (exprd logs what it paged, whoever saw it first)
            self.sync(fd)
        return done

    def unrecorded(self, changes: list[Incident], deliver: Callable[[Incident], bool] | None,
                   updates: list[Incident] | None = None) -> list[Incident]:
        """What `record` does when the file cannot be written (a read-only run directory,
        a symlink or FIFO in its place): the changes kept in memory and delivered all the
        same, so a crash is still shown and paged; the caller names the write error."""
        done: list[Incident] = []
        for inc in changes:
            if inc.state == "resolved":
                if self.open.pop(inc.id, None) is None:
                    continue
            elif not self._fresh(inc):
                continue
            else:
                self.open[inc.id] = inc
            self.offered.add(inc.id)
            inc.delivered = deliver(inc) if deliver is not None else False
            done.append(inc)
        for inc in updates or ():
            cur = self.open.get(inc.id)
            if cur is not None and (cur.ranks != inc.ranks or cur.detail != inc.detail):
                inc.delivered = cur.delivered
                self.open[inc.id] = inc
                done.append(inc)
        if deliver is not None:
            for inc in self.undelivered():
                self.offered.add(inc.id)
                if deliver(inc):
                    inc.delivered = True
                    done.append(inc)
        return done

    def _fresh(self, inc: Incident) -> bool:
        """An opening nobody recorded: no open incident of its kind covers it (the same
        ranks; for a stall any, one per run; for a crash any of its ranks)."""
        for o in self.open.values():
            if o.kind != inc.kind:
                continue
            if o.ranks == inc.ranks or inc.kind == "stall" or (
                    inc.kind == "crashed" and set(o.ranks) & set(inc.ranks)):
                return False
        return True


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
        self.write_error: str | None = None  # why the last pass could not record its incidents
        self._clocked = False  # the filesystem's clock measured (on the first pass)

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
        self._read_alerts()
        self.log.sync()
        findings = detect(self.state, list(self._suppressed.values()), self.cfg, self.memory, now)
        p = plan(self.log.open.values(), findings, now, self.state,
                 crash_window=self.cfg.crash_window, ended=ended(self.state))
        for inc in p.still_open:  # last_seen and step in memory; the file keeps the first line
            self.log.open[inc.id] = inc
        # a symlink or FIFO in the file's place is neither read nor appended to
        refused = self.log.refused
        self.write_error = None if refused is None else f"cannot record incidents: {refused}"
        late = self.dispatcher is not None and bool(self.log.undelivered())
        if not (p.opened or p.resolved or p.updated or late) or not self.run_dir.is_dir():
            return []
        deliver = self._deliver if self.dispatcher is not None else None
        if refused is not None:
            self.errors += 1
            return self.log.unrecorded(p.resolved + p.opened, deliver, p.updated)
        try:
            done = self.log.record(p.resolved + p.opened, deliver, p.updated)
        except OSError as exc:
            # a read-only run directory (a teammate's run, a ro mount): the incidents are
            # shown and delivered from memory, and the error is named, not swallowed
            self.errors += 1
            self.write_error = f"cannot record incidents: {refusal(self.log.path, exc)}"
            return self.log.unrecorded(p.resolved + p.opened, deliver, p.updated)
        return done

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
