"""The watcher's clock (DESIGN 13): when a rank last wrote, advanced, or rewrote its sidecar.

Ranks run on many hosts whose clocks disagree, and a shared filesystem stamps mtimes with
the server's clock, so silence is never measured by subtracting another host's time from
ours. A reader kept between passes notes the pass at which it saw a shard grow, its last
step rise or its sidecar change, on its own monotonic clock (`PassClock`, as epoch seconds
so that incidents can print them). What it has not seen change it dates by the files'
mtimes, moved onto its clock by the filesystem's offset (`fs_offset`: the mtime of a file
it touched just now, minus its own time). So a single pass (`expr watch --once`) measures
against the filesystem's time, a long-running watcher against its own clock.

Nothing here writes but `fs_offset`, which touches one file it is handed (and
`dir_fs_offset`, an unnamed one).
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Mapping

from expr_tracker.health.mounts import mount_of


class PassClock:
    """Epoch seconds that move with `time.monotonic()`: a wall clock step (NTP) after the
    start does not make a rank look silent or fresh."""

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._mono0 = time.monotonic()

    def __call__(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0)


def fs_offset(fd: int) -> float | None:
    """The filesystem's time minus ours, from touching the open file `fd` (its mtime set to
    the server's time); None when it cannot be touched."""
    try:
        before = time.time()
        os.utime(fd)
        after = time.time()
        mtime = os.fstat(fd).st_mtime_ns / 1e9
    except OSError:
        return None
    return mtime - (before + after) / 2


def dir_fs_offset(directory: str | os.PathLike[str]) -> float | None:
    """`fs_offset` for a reader that records nothing (`expr top --once`, `expr runs`):
    measured on an unnamed file in `directory` (O_TMPFILE: no name is ever seen and the
    directory's listing does not change), else on its `incidents.jsonl` if one is there
    (a watcher touches it the same way; never created here); None when neither can be
    touched (a read-only root: then the reader's own clock). Under a second it is 0: the
    measure's own jitter (mtimes are stamped from a coarse clock, milliseconds behind),
    not a clock that is off, and two readers of one file then print the same times."""
    offset = _touch_offset(directory)
    return None if offset is None else (0.0 if abs(offset) < 1.0 else offset)


def _touch_offset(directory: str | os.PathLike[str]) -> float | None:
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            fd = os.open(directory, flag | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError:
            pass
        else:
            try:
                return fs_offset(fd)
            finally:
                os.close(fd)
    try:
        fd = os.open(os.path.join(directory, "incidents.jsonl"),
                     os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return fs_offset(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


class Seen:
    """Per shard rank: when this reader saw it write, advance and rewrite its sidecar."""

    __slots__ = ("advance", "side", "step", "write")

    def __init__(self, write: float | None, side: float | None, step: int | None) -> None:
        self.write = write  # shard data appended (first pass: its mtime on our clock)
        self.advance = write  # its last step rose
        self.side = side  # its sidecar was rewritten (the SDK does every few seconds)
        self.step = step

    def update(self, now: float, wrote: bool, side_changed: bool, step: int | None,
               wrote_at: float | None = None, side_at: float | None = None) -> None:
        """A pass at `now` saw the shard grow (`wrote`) and/or its sidecar change (at
        `wrote_at`, `side_at` when the caller knows better, else `now`)."""
        if wrote:
            self.write = now if wrote_at is None else wrote_at
            if step is not None and (self.step is None or step > self.step):
                self.advance = self.write
        if side_changed:
            self.side = now if side_at is None else side_at
        if step is not None:
            self.step = step if self.step is None else max(self.step, step)


def mtime_on_our_clock(mtime_ns: int | None, offset: float) -> float | None:
    """A file's mtime (ns, the filesystem's clock) as a time of ours."""
    return None if mtime_ns is None or mtime_ns < 0 else mtime_ns / 1e9 - offset


# exprd's heartbeat in each run directory it writes (DESIGN 8: liveness seen from other
# hosts): `{run}/.exprd.<host>.json`, created once and touched every few seconds (a touch
# does not change the directory, so readers' listings stay trusted). Its mtime is what a
# reader on another node dates, like a sidecar's.
HEARTBEAT_PREFIX, HEARTBEAT_SUFFIX = ".exprd.", ".json"
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.")


def safe_host(host: str) -> str:
    """A host name as it can stand in a file name: escaped, not collapsed (issue 54: "gpu 1"
    and "gpu_1" shared one heartbeat, so a dead node hid behind a live one). Letters,
    digits, '-' and '.' stay; any other character is `_` and its UTF-8 bytes in hex (`_`
    itself `_5f`); a name longer than 160 characters so escaped keeps its start and a
    digest of the whole."""
    out = "".join(c if c in _PLAIN else "_" + c.encode("utf-8", "surrogatepass").hex()
                  for c in host) or "_"
    if len(out) > 160:
        import hashlib

        out = out[:128] + "_" + hashlib.sha256(host.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return out


def heartbeat_name(host: str) -> str:
    """The file name of `host`'s exprd heartbeat in a run directory."""
    return f"{HEARTBEAT_PREFIX}{safe_host(host)}{HEARTBEAT_SUFFIX}"


def heartbeat_host(name: str) -> str | None:
    """The (safe) host of a heartbeat file name; None for any other name."""
    if name.startswith(HEARTBEAT_PREFIX) and name.endswith(HEARTBEAT_SUFFIX):
        host = name[len(HEARTBEAT_PREFIX):-len(HEARTBEAT_SUFFIX)]
        return host or None
    return None


# NFS's attribute cache bounds when none is given (nfs(5): acregmax 60, acdirmax 60)
_NFS_DEFAULT = 60.0


def attr_cache(path: str | os.PathLike[str]) -> tuple[float, str] | None:
    """How long the filesystem holding `path` may show a file's old size and mtime (its
    attribute cache), and what says so: from the mount's options in /proc/self/mountinfo
    (NFS: actimeo, acregmax, acdirmax; `noac` is 0). None where nothing can be told: a
    local filesystem (0 s) and FUSE mounts (bindfs's `attr_timeout` is not shown there:
    configure `fs_cache`)."""
    found = mount_of(path)
    if found is None or not found[0].startswith("nfs"):
        return None
    kind, options = found
    opts = dict(o.partition("=")[::2] for o in options.split(","))
    if "noac" in opts:
        return 0.0, f"{kind} noac"
    for key in ("actimeo", "acregmax"):
        if opts.get(key, "").isdigit():
            return float(opts[key]), f"{kind} {key}={opts[key]}"
    return _NFS_DEFAULT, f"{kind} (acregmax default)"


# exprd touches its heartbeat in each run directory it writes this often (daemon/health
# `BEAT_EVERY`; health sits below the daemon)
HEARTBEAT_EVERY = 5.0
LEARN_GAPS = 2  # the last gaps between heartbeat mtimes a learned cache time is the least of


class CacheLearner:
    """The filesystem's attribute cache, learned from what a watcher sees when none is
    configured or told by the mount (a FUSE mount's `attr_timeout` is not shown in its
    options): another host's exprd touches its heartbeat every `HEARTBEAT_EVERY` seconds,
    so through no cache the mtimes a watcher sees follow each other by that much; through
    a cache of C seconds it sees one of them every C seconds or so. The least of the last
    `LEARN_GAPS` gaps, on the filesystem's own clock (no host's clock is compared), is the
    cache time, when it is well above the touch period: one exprd stopped a while (a gap
    of a minute once) does not teach it; a cache, which makes every gap long, does."""

    def __init__(self, here: str) -> None:
        self._own = heartbeat_name(here)  # this host's: its own writes are seen at once
        self._last: dict[str, int] = {}
        self._gaps: deque[float] = deque(maxlen=LEARN_GAPS)
        self.value = 0.0

    def see(self, mtimes: Mapping[str, int]) -> bool:
        """Take a pass's heartbeat mtimes (ns, by file name); True when `value` changed."""
        for name, mtime in mtimes.items():
            old = self._last.get(name)
            self._last[name] = mtime
            if name != self._own and old is not None and mtime > old:
                self._gaps.append((mtime - old) / 1e9)
        if len(self._gaps) < LEARN_GAPS:
            return False
        gap = min(self._gaps)
        # a gap of the touch period, and a pass or two of jitter, is no cache; past it, the
        # gap itself (a little more than the cache: silence is then believed a bit later)
        value = float(round(gap)) if gap > 2 * HEARTBEAT_EVERY else 0.0
        changed, self.value = value != self.value, value
        return changed
