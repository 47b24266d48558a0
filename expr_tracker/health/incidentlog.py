"""`{run}/incidents.jsonl`, read back and appended to by every watcher of a run (DESIGN 13).

The file is opened relative to a descriptor of the run directory, with O_NOFOLLOW and
O_APPEND, and each line is one `os.write`: nothing is written outside the run directory
and a reader never sees half a line. Every line is appended under an `flock` of the file
after re-reading what others appended (the file's size asked of the filesystem, not an
attribute cache: `mounts.revalidate`), so two watchers (exprd and `expr watch`, on any
hosts whose locks the filesystem shares, as NFS's) record one incident once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.health.clock import fs_offset
from expr_tracker.health.incidents import Incident
from expr_tracker.health.mounts import revalidate
from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.safedir import open_file

INCIDENTS = "incidents.jsonl"
# s a watcher's claim on a page holds: its channels retry for less (a dead watcher's claim
# is then taken over)
CLAIM_TTL = 120.0
_OTHERS_KEPT = 10_000  # others' lines kept between two `take_others`
_MAX_READ = 4 << 20  # bytes of an alerts or incidents file read at once (a pass reads them all)


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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self.refused = f"{self.path} is not a regular file"
            return None
        self.refused = None
        return fd

    def new_lines(self, fd: int | None = None) -> Iterator[dict[str, Any]]:
        for _, rec in self.new_raw(fd):
            yield rec

    def new_raw(self, fd: int | None = None) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """(the line's bytes, its parsed record) of each complete line appended."""
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
            # to the size seen now, _MAX_READ at a time: a reader of one pass (`watch
            # --once`, `summary`, MCP) sees the whole file, in bounded memory
            while self.offset < st.st_size:
                fh.seek(self.offset)
                data = fh.read(min(st.st_size - self.offset, _MAX_READ))
                end = data.rfind(b"\n") + 1
                if not end:
                    return  # a line mid-append (or longer than _MAX_READ: not ours)
                self.offset += end
                for _, line in records.iter_lines(data[:end]):
                    try:
                        rec = records.loads(line)
                    except ValueError:
                        continue
                    yield bytes(line), rec


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
        # the lines others appended since `take_others` (every reader shows every line)
        self.others: deque[Incident] = deque(maxlen=_OTHERS_KEPT)
        self._mine: Counter[bytes] = Counter()  # lines this watcher wrote, not yet read back
        self.token = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        # (incident id, state) -> the line whose page is on the way, and the channels' word
        self.pending: dict[tuple[str, str], Incident] = {}
        self.outcomes: dict[tuple[str, str], bool] = {}
        self.paged: set[str] = set()  # ids whose opening this watcher delivered
        self.failed = 0  # pages every channel gave up on
        self.owner: str | None = None  # `token` when this watcher owns what it opens (`Watcher`)

    def sync(self, fd: int | None = None) -> None:
        """Apply the lines appended since the last call (by us or another watcher)."""
        for raw, line in self._tail.new_raw(fd):
            inc = Incident.from_line(line)
            if inc is None:
                continue
            if self._mine.get(raw):
                self._mine[raw] -= 1
                if not self._mine[raw]:
                    del self._mine[raw]
            else:
                self.others.append(inc)
            if inc.state == "open":
                self.open[inc.id] = inc
            else:
                self.open.pop(inc.id, None)

    def take_others(self) -> list[Incident]:
        """The lines other watchers appended since the last call, oldest first."""
        out = list(self.others)
        self.others.clear()
        return out

    def _write(self, fd: int, inc: Incident) -> None:
        line = orjson.dumps(inc.as_line(), option=orjson.OPT_APPEND_NEWLINE)
        self._mine[line[:-1]] += 1
        os.write(fd, line)  # one write of one whole line, O_APPEND

    def claimed(self, inc: Incident, now: float) -> bool:
        """Another watcher's page of `inc` is on the way (claimed less than CLAIM_TTL ago)."""
        p = inc.paging
        return p is not None and p.get("by") != self.token and now - float(p["at"]) < CLAIM_TTL

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
            # what other hosts appended before we took the lock: through an attribute
            # cache (bindfs; NFS revalidates on the lock itself) the size may be old
            revalidate(fd)
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
        """The open incidents that nobody delivered, whose page nobody has on the way, and
        that this watcher has not offered yet."""
        now = time.time()
        return [inc for inc in self.open.values() if not inc.delivered
                and inc.id not in self.offered and not self.claimed(inc, now)]

    def _offer(self, inc: Incident, deliver: Callable[[Incident], bool]) -> bool:
        """Queue `inc`'s page; True when a channel took it (the line then claims it)."""
        self.offered.add(inc.id)
        key = (inc.id, inc.state)
        self.pending[key] = inc
        if not deliver(inc):
            self.pending.pop(key, None)
            return False
        inc.paging = {"by": self.token, "at": round(time.time(), 3)}
        return True

    def done(self, key: tuple[str, str], ok: bool) -> None:
        """A channel's word on a page (from a dispatcher's worker thread)."""
        self.outcomes[key] = ok

    def _settle(self, fd: int) -> list[Incident]:
        """Write what the channels said of the pages on their way: `delivered` true once
        one sent it, else the claim dropped (another watcher, with a channel that works,
        then delivers it). Under the file lock."""
        out = []
        for key in list(self.outcomes):
            ok = self.outcomes.pop(key)
            sent = self.pending.pop(key, None)
            if sent is None:
                continue
            if sent.state == "open":
                if ok:
                    self.paged.add(sent.id)
                cur = self.open.get(sent.id)
                if cur is None:
                    continue  # resolved meanwhile: its resolution line says the rest
                line = replace(cur, delivered=ok, paging=None)
            else:
                if not ok:
                    self.failed += 1
                    continue  # a recovery nobody got: nothing to take over
                line = replace(sent, delivered=True, recovery_delivered=True, paging=None)
            if not ok:
                self.failed += 1
            self._write(fd, line)
            out.append(line)
        return out

    def _correct(self, cur: Incident, inc: Incident, deliver: Callable[[Incident], bool]) -> None:
        """A crash whose root moved after its page went out (a rank killed by a signal,
        seen after the peers that blamed it) is paged again, once, saying so: under the
        file lock against the line as read back, so the watcher that writes the new root
        is the one that pages it, and a second watcher sees nothing to correct."""
        old, new = (cur.root or {}).get("rank"), (inc.root or {}).get("rank")
        paged = cur.delivered or cur.paging is not None or cur.id in self.paged
        if inc.kind != "crashed" or old == new or new is None or not paged or cur.cause:
            return
        fix = replace(inc)
        fix.extra = {**inc.extra, "corrected": old}
        deliver(fix)  # (its outcome has no line to settle: the update line says the root)

    def record(self, changes: list[Incident], deliver: Callable[[Incident], bool] | None,
               updates: list[Incident] | None = None,
               due: Callable[[Incident], bool] | None = None) -> list[Incident]:
        """Append `changes` (openings, resolutions) that nobody recorded yet, delivering
        each first, and `updates` (lines of an open incident's id: not delivered again);
        returns those written.

        Under the file lock: set a torn tail aside, re-read what other watchers appended,
        skip an opening that is already open (or a resolution of what is not), deliver,
        append one line each. With `deliver` None (a watcher without channels: `expr
        watch` with no alert config) nothing is delivered and the openings are recorded
        undelivered; a watcher with channels then delivers each open incident that nobody
        delivered, once, and appends its line again with a claim, so a terminal that saw
        the stall first does not take its page away (those lines are returned too).

        A page is queued, not yet sent: the line records `delivered` false and a claim
        (`paging`); when a channel has sent it, a line of the same id says `delivered`
        true; when every channel gave up, a line drops the claim and the next watcher with
        a channel that works delivers it (`_settle`, at the next call). `due(inc)`: an
        opening may be paged now (it has held `page_after`); one not yet due is recorded
        undelivered and paged by a later call once it is. A resolution is paged only when
        its opening was.
        """
        done: list[Incident] = []
        with self._locked() as fd:
            recovered = self._set_aside_torn(fd)
            self.sync(fd)
            if recovered is not None and self._fresh(recovered):
                self._write(fd, recovered)
                self.sync(fd)
            self._settle(fd)  # (not returned: what was paged was said when it was queued)
            for inc in changes:
                inc.delivered = False
                if inc.state == "resolved":
                    opened = self.open.get(inc.id)
                    if opened is None:
                        continue
                    inc.paging = None
                    was_paged = opened.delivered or inc.id in self.paged
                    # the incident's page went out: every later line of it says so (its
                    # recovery's page is `recovery_delivered`, true once a channel sent it)
                    inc.delivered, inc.recovery_delivered = was_paged, False
                    if deliver is not None and was_paged:
                        self._offer(inc, deliver)
                elif not self._fresh(inc):
                    continue
                else:
                    inc.by = self.owner
                    if deliver is not None and (due is None or due(inc)):
                        self._offer(inc, deliver)
                self._write(fd, inc)
                done.append(inc)
            for inc in updates or ():
                cur = self.open.get(inc.id)
                if cur is None or (cur.ranks == inc.ranks and cur.detail == inc.detail
                                   and cur.cause == inc.cause and cur.collateral == inc.collateral
                                   and cur.root == inc.root):
                    continue
                inc.delivered, inc.paging, inc.by = cur.delivered, cur.paging, cur.by
                self._write(fd, inc)
                done.append(inc)
                if deliver is not None:
                    self._correct(cur, inc, deliver)
            if deliver is not None:
                self.sync(fd)
                for inc in self.undelivered():
                    if due is not None and not due(inc):
                        continue
                    late = replace(inc)
                    if self._offer(late, deliver):  # (a channel's policy that held it back
                        self._write(fd, late)       # is not asked again)
                        done.append(late)  # (exprd logs what it paged, whoever saw it first)
            self.sync(fd)
        return done

    def unrecorded(self, changes: list[Incident], deliver: Callable[[Incident], bool] | None,
                   updates: list[Incident] | None = None,
                   due: Callable[[Incident], bool] | None = None) -> list[Incident]:
        """What `record` does when the file cannot be written (a read-only run directory,
        a symlink or FIFO in its place): the changes kept in memory and delivered all the
        same, so a crash is still shown and paged; the caller names the write error. A
        page queued here is taken as delivered: there is no line to settle it on."""
        done: list[Incident] = []
        for inc in changes:
            if inc.state == "resolved":
                opened = self.open.pop(inc.id, None)
                if opened is None:
                    continue
                paged = opened.delivered or inc.id in self.paged
                inc.recovery_delivered = paged and deliver is not None and deliver(inc)
                inc.delivered = paged
            elif not self._fresh(inc):
                continue
            else:
                self.open[inc.id] = inc
                self.offered.add(inc.id)
                inc.delivered = deliver is not None and (due is None or due(inc)) and deliver(inc)
                if inc.delivered:
                    self.paged.add(inc.id)
            done.append(inc)
        for inc in updates or ():
            cur = self.open.get(inc.id)
            if cur is not None and (cur.ranks != inc.ranks or cur.detail != inc.detail):
                inc.delivered = cur.delivered
                self.open[inc.id] = inc
                done.append(inc)
                if deliver is not None:
                    self._correct(cur, inc, deliver)
        if deliver is not None:
            for inc in [i for i in self.open.values() if not i.delivered]:
                if (due is None or due(inc)) and deliver(inc):
                    inc.delivered = True
                    self.paged.add(inc.id)
                    done.append(inc)
        self.pending.clear()  # (the channels' word has no line to go on)
        self.outcomes.clear()
        return done

    def _fresh(self, inc: Incident) -> bool:
        """An opening nobody recorded: no open incident of its kind covers it (the same
        ranks; for a stall any, one per run; for a crash any of its ranks; for a non-finite
        value the same key)."""
        for o in self.open.values():
            if o.kind != inc.kind:
                continue
            if inc.kind == "nonfinite":  # one per key, whatever its ranks
                if o.metric == inc.metric:
                    return False
                continue
            if o.ranks == inc.ranks or inc.kind == "stall" or (
                    inc.kind == "crashed" and set(o.ranks) & set(inc.ranks)):
                return False
        return True


def owner_alive(by: str) -> bool:
    """The watcher `by` ("host:pid:n") may still run: its pid lives, on this host; on
    another host, not known (True)."""
    host, _, rest = by.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return True
    return pid_alive(int(pid))


def open_incidents(run_dir: str | os.PathLike[str]) -> list[Incident]:
    """The open incidents of `{run}/incidents.jsonl`, whoever recorded them (read only;
    empty when there is none), oldest first."""
    log = IncidentLog(Path(run_dir))
    log.sync()
    return sorted(log.open.values(), key=lambda i: (i.first_seen, i.kind, i.ranks))
