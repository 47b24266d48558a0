"""The write-ahead batch journal: a batch keeps its boundaries and key across restarts.

Used by the backend worker to cut batches and by backends that send a batch key
(the HTTP `Idempotency-Key`, ClickHouse's `insert_deduplication_token`).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.backends.base import log
from expr_tracker.store.safedir import write_all

Batch = tuple[int, int, int]  # (first seq, last seq, number of events) of one journaled batch


def idempotency_key(events: Sequence[Mapping[str, Any]], body: bytes) -> str:
    """`{first_id}..{last_id}` when both ends carry `_id`, else a hash of the body."""
    first, last = events[0].get("_id"), events[-1].get("_id")
    if isinstance(first, str) and isinstance(last, str) and first and last:
        return f"{first}..{last}"
    return "sha256:" + hashlib.sha256(body).hexdigest()


def position(event: Mapping[str, Any]) -> tuple[str, int] | None:
    """(session, seq) from an event's `_id` `{session}:{seq}`, or None without one."""
    rid = event.get("_id")
    if rid.__class__ is not str:
        return None
    session, sep, seq = rid.rpartition(":")
    if not sep or not session or not (seq.isascii() and seq.isdigit()):
        return None
    return session, int(seq)


class BatchJournal:
    """The batches sent for one event stream, as `{"first": id, "last": id, "n": count}` lines.

    Append-only and written ahead of each send: one `os.write` on an O_APPEND descriptor,
    not fsynced (kill -9 does not lose the page cache; a lost machine loses the spool's
    own unsynced tail too). `compact()` keeps it bounded. Thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.session: str | None = None
        self._lock = threading.Lock()
        self._firsts: list[int] = []
        self._batches: list[Batch] = []
        self._load()

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("batch journal %s unreadable (%s); new batches start here", self.path, exc)
            return
        found: dict[int, Batch] = {}
        for line in data.splitlines():
            try:
                entry = orjson.loads(line)
                first = position({"_id": entry["first"]})
                last = position({"_id": entry["last"]})
                n = entry["n"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line (a write cut short by a full disk): that batch is new
            if (first is None or last is None or first[0] != last[0] or type(n) is not int
                    or not 0 < n <= last[1] - first[1] + 1):
                continue
            if self.session is None:
                self.session = first[0]
            if first[0] == self.session:
                found[first[1]] = (first[1], last[1], n)
        for batch in sorted(found.values()):
            if not self._batches or batch[0] > self._batches[-1][1]:
                self._firsts.append(batch[0])
                self._batches.append(batch)
        if data and not data.endswith(b"\n"):
            with self._lock:
                self._rewrite()  # appends must not continue a torn line

    def __len__(self) -> int:
        with self._lock:
            return len(self._batches)

    def find(self, session: str, seq: int) -> Batch | None:
        """The journaled batch holding event `seq` of `session`, if any."""
        with self._lock:
            if session != self.session:
                return None
            i = bisect.bisect_right(self._firsts, seq) - 1
            if i >= 0 and self._batches[i][1] >= seq:
                return self._batches[i]
            return None

    def next_first(self, session: str, seq: int) -> int | None:
        """The first seq of the next journaled batch after `seq` (a new batch stops before it)."""
        with self._lock:
            if session != self.session:
                return None
            i = bisect.bisect_right(self._firsts, seq)
            return self._firsts[i] if i < len(self._firsts) else None

    def add(self, session: str, first: int, last: int, n: int) -> None:
        """Journal one batch before it is sent (raises OSError if it cannot be written)."""
        line = orjson.dumps({"first": f"{session}:{first}", "last": f"{session}:{last}", "n": n},
                            option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            if self.session is None:
                self.session = session
            elif session != self.session:
                raise ValueError(f"batch journal {self.path} is for session {self.session}")
            self._append(line)
            self._firsts.append(first)
            self._batches.append((first, last, n))

    def compact(self, upto: int) -> int:
        """Forget the batches whose events all have seq <= `upto`; returns how many went.

        Call it only once a checkpoint past those events is on disk: they are never
        submitted again. The file stays, maybe empty, until its spool file goes.
        """
        with self._lock:
            keep = bisect.bisect_right([b[1] for b in self._batches], upto)
            if keep == 0:
                return 0
            del self._batches[:keep], self._firsts[:keep]
            self._rewrite()
            return keep

    def _append(self, line: bytes) -> None:
        # no symlink followed: exprd's state directory is its own, and so is what it writes
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:  # the first batch: make the directory (not once per batch)
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, flags, 0o600)
        try:
            os.write(fd, line)  # one small write on O_APPEND: whole or (disk full) torn, never mixed
        finally:
            os.close(fd)

    def _rewrite(self) -> None:
        """Replace the file by the batches kept (atomically: temp file, rename)."""
        s = self.session
        body = b"".join(
            orjson.dumps({"first": f"{s}:{a}", "last": f"{s}:{b}", "n": n},
                         option=orjson.OPT_APPEND_NEWLINE)
            for a, b, n in self._batches
        )
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            write_all(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
