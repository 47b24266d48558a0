"""A background thread between a caller and a backend, so a slow or dead backend never stalls it.

`submit()` only appends to a bounded in-memory queue; a daemon thread opens the
backend, hands it batches in order and finishes it at `close()`. Every failure
is caught, logged once per cause, and counted (DESIGN 7): nothing raises into
the caller and nothing disappears uncounted.

With a `BatchJournal` (exprd's http backend), batch boundaries survive a restart:
each new batch is journaled before it is sent, and events submitted again later are
cut into exactly the journaled batches, so one Idempotency-Key always names the
same events and the same body.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from itertools import islice, repeat
from operator import itemgetter
from typing import Any

from expr_tracker.backends.base import Backend, Counters, Identity, reportable
from expr_tracker.backends.journal import Batch, BatchJournal, position

FINISH_GRACE = 5.0  # seconds close() waits for finish() after the drain deadline
# a backend told its close deadline (`close_by`, the team store in direct mode) keeps this
# much of the close time for finish() (its final status row), and is left behind this long
# past the deadline at most
FINISH_SHARE, FINISH_MAX, LEAVE_AFTER = 0.2, 1.0, 0.25
MAX_ALERTS = 1000  # alerts queue beside records (they are rare and matter more)
_LOG, _ALERT = 0, 1
_AGAIN = object()  # _take_journaled skipped records: look at the queue again
_KIND, _ROW = itemgetter(0), itemgetter(1)  # of a queue item (kind, record)
# what a queued record costs in memory, roughly (measured with tracemalloc on CPython 3.11,
# float values: ~330 B for 3 keys with _step and _time, ~820 B for 12, ~2,900 B for 52):
# the byte bound counts this estimate, not an encoding (nothing is encoded on log()'s path)
_RECORD_BYTES, _KEY_BYTES = 180, 56


def record_bytes(row: Mapping[str, Any]) -> int:
    """The estimated memory of one queued record (cheap: no encoding on log()'s path)."""
    return _RECORD_BYTES + _KEY_BYTES * len(row)


class BackendWorker:
    """Feeds one backend from a bounded queue on a daemon thread."""

    def __init__(
        self,
        backend: Backend,
        identity: Identity,
        *,
        max_queue: int = 10000,
        batch: int = 100,
        rank_metrics: bool = False,
        journal: BatchJournal | None = None,
        pulled: bool = False,
        max_bytes: int | None = None,
        bounded_exit: bool = False,
    ) -> None:
        if max_queue < 1 or batch < 1 or (max_bytes is not None and max_bytes < 1):
            raise ValueError("max_queue, max_bytes and batch must be >= 1")
        self.backend = backend
        self.identity = identity
        self.max_queue = max_queue
        # direct mode's team store: the queue is bounded by memory (a burst of small rows
        # fits), not by a record count, and close() tells the backend its deadline
        self.max_bytes = max_bytes
        self.bounded_exit = bounded_exit
        self.batch = batch
        self.rank_metrics = rank_metrics
        self.journal = journal
        # exprd reads the spool for this backend itself (`submit_many`): a pipeline's
        # `submit()` is ignored, its alerts still go through
        self.pulled = pulled
        # a backend that stores rank records as they are (the team store) gets every record
        self._raw = getattr(backend, "raw_records", False) is True
        self._counters = Counters()
        self._cond = threading.Condition()
        self._items: deque[tuple[int, dict[str, Any]]] = deque()
        self._queued_logs = 0
        self._queued_bytes = 0  # estimated (record_bytes), kept only with max_bytes
        self._queued_alerts = 0
        self._inflight = 0
        self._accepted = 0  # records ever queued
        self._completed = 0  # of those, the ones handed to the backend (or known sent before)
        self._waiting = False  # the thread waits for the rest of a journaled batch
        self._interrupted = False  # close() cut the backend short: the batch in flight may be lost
        self._closing = False
        self._deadline = math.inf
        self._status = "finished"
        self._thread: threading.Thread | None = None
        self.enabled = self._probe()
        if self.enabled:
            self._thread = threading.Thread(
                target=self._main,
                name=f"expr-{getattr(backend, 'name', 'backend')}-{identity.remote_id()}",
                daemon=True,
            )
            self._thread.start()

    def _probe(self) -> bool:
        """Ask the backend whether its package is installed, on the caller's thread.

        This is where a missing optional package warns (warnings.warn must not
        run on the worker thread).
        """
        available = getattr(self.backend, "available", None)
        if available is None:
            return True
        try:
            return bool(available())
        except Exception as exc:
            self._counters.error(
                f"{self._name}: availability check: {type(exc).__name__}", str(exc)
            )
            return False

    @property
    def _name(self) -> str:
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    def submit(self, record: Mapping[str, Any]) -> None:
        """Queue one record. Never blocks, never raises; a full queue counts it `dropped`."""
        if self.pulled:
            return
        try:
            row = dict(record) if self._raw else reportable(record, self.rank_metrics)
        except Exception as exc:
            self._counters.error(
                f"{self._name}: unreadable record: {type(exc).__name__}", str(exc), records=1
            )
            return
        if row is None:
            self._counters.add("skipped")
            return
        cause = ""
        with self._cond:
            if not self.enabled:
                cause = f"{self._name}: backend disabled"
            elif self._closing:
                cause = f"{self._name}: record submitted after close"
            elif self._queued_logs >= self.max_queue:
                cause = f"{self._name}: queue full ({self.max_queue} records)"
            elif self.max_bytes is not None and self._queued_bytes >= self.max_bytes:
                cause = f"{self._name}: queue full ({self.max_bytes / 2**20:g} MB)"
            else:
                self._items.append((_LOG, row))
                self._queued_logs += 1
                if self.max_bytes is not None:
                    self._queued_bytes += record_bytes(row)
                self._accepted += 1
                if len(self._items) == 1 or self._waiting:
                    # the thread waits on an empty queue, or for a journaled batch's end
                    self._cond.notify()
                return
        self._counters.error(cause, records=1, kind="dropped")

    def submit_many(self, records: list[dict[str, Any]]) -> None:
        """Queue records in order under one lock (exprd's spool reader, which gives up the
        dicts: a backend that takes records as they are gets them without a copy). Never
        blocks, never raises; what a full queue cannot take is counted `dropped`."""
        if not self._raw:
            rows = []
            for record in records:
                try:
                    row = reportable(record, self.rank_metrics)
                except Exception as exc:
                    self._counters.error(f"{self._name}: unreadable record: "
                                         f"{type(exc).__name__}", str(exc), records=1)
                    continue
                if row is None:
                    self._counters.add("skipped")
                else:
                    rows.append(row)
            records = rows
        if not records:
            return
        cause, lost = "", 0
        with self._cond:
            if not self.enabled:
                cause = f"{self._name}: backend disabled"
            elif self._closing:
                cause = f"{self._name}: record submitted after close"
            else:
                room = self.max_queue - self._queued_logs
                if self.max_bytes is not None:
                    room = min(room, self._room_in_bytes(records))
                if room < len(records):
                    cause = f"{self._name}: queue full ({self.max_queue} records)"
                    lost = len(records) - max(room, 0)
                    records = records[: max(room, 0)]
                wake = not self._items or self._waiting
                self._items.extend(zip(repeat(_LOG), records))
                self._queued_logs += len(records)
                if self.max_bytes is not None:
                    self._queued_bytes += sum(record_bytes(r) for r in records)
                self._accepted += len(records)
                if wake and records:
                    self._cond.notify()
            if cause and not lost:
                lost = len(records)
        if cause:
            self._counters.error(cause, records=lost, kind="dropped")

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Queue one alert, in order with the records. Never blocks, never raises."""
        cause = ""
        with self._cond:
            if not self.enabled or self._closing:
                cause = f"{self._name}: alert after close or while disabled"
            elif self._queued_alerts >= MAX_ALERTS:
                cause = f"{self._name}: alert queue full"
            else:
                self._items.append((_ALERT, dict(alert)))
                self._queued_alerts += 1
                if len(self._items) == 1 or self._waiting:
                    self._cond.notify()
                return
        self._counters.error(cause, records=1, kind="alerts_dropped")

    def close(self, timeout: float = 10.0, status: str = "finished") -> dict[str, Any]:
        """Drain for at most `timeout` s, then finish the backend with `status`; return `stats()`.

        Records still queued at the deadline are counted `dropped`. A backend
        stuck in a call is interrupted if it can be (`interrupt()`), and left
        behind on its daemon thread if not.

        With `bounded_exit` and a backend that can be told its deadline (`close_by`, the
        team store, which also gives up sooner on its own: `exit_timeout`), the whole close
        takes at most `timeout` + LEAVE_AFTER: the drain stops early enough to leave
        finish() its share, the backend gives up its requests and retries by the deadline,
        and a thread still busy then is left behind.
        """
        close_by = getattr(self.backend, "close_by", None)
        bounded = self.bounded_exit and callable(close_by)
        timeout = max(timeout, 0.0)
        end = time.monotonic() + timeout
        with self._cond:
            if not self._closing:
                self._closing = True
                self._status = status
                reserve = min(FINISH_MAX, timeout * FINISH_SHARE) if bounded else 0.0
                self._deadline = end - reserve
                self._cond.notify_all()
        if bounded:
            assert callable(close_by)
            try:
                close_by(end)
            except Exception as exc:
                self._counters.error(f"{self._name}: close_by: {type(exc).__name__}", str(exc))
        thread = self._thread
        if thread is not None:
            if bounded:
                self._join_bounded(thread, end)
            else:
                thread.join(timeout)
            if thread.is_alive():
                self._interrupted = True
                interrupt = getattr(self.backend, "interrupt", None)
                if callable(interrupt):
                    try:
                        interrupt()
                    except Exception as exc:
                        self._counters.error(
                            f"{self._name}: interrupt: {type(exc).__name__}", str(exc)
                        )
                if not bounded:
                    thread.join(FINISH_GRACE)
                elif thread.is_alive():
                    with self._cond:
                        n = self._inflight
                    self._counters.error(f"{self._name}: left behind at exit",
                                         f"a request was still in flight; {n} records "
                                         "pending, not known to be delivered")
        return self.stats()

    def _join_bounded(self, thread: threading.Thread, end: float) -> None:
        """Wait for the thread until `end`, or until the backend gives up (`give_up_at`,
        which may come sooner), + LEAVE_AFTER: a request in flight is not waited for."""
        give_up_at = getattr(self.backend, "give_up_at", None)
        while thread.is_alive():
            limit = end
            if callable(give_up_at):
                try:
                    limit = min(limit, float(give_up_at()))
                except Exception:
                    pass  # a broken hint: the close deadline alone bounds the wait
            left = limit + LEAVE_AFTER - time.monotonic()
            if left <= 0:
                return
            thread.join(min(left, 0.05))

    def progress(self) -> tuple[int, int]:
        """(records queued so far, of those the ones done with), both only ever growing.

        Records are done with in the order they were queued, so once the second number
        reaches the first as it was at some moment, everything queued before is done.
        Records dropped at the close deadline, or in flight when close() interrupted the
        backend, are not done with: exprd sends them again after a restart.
        """
        with self._cond:
            return self._accepted, self._completed

    def backlog(self) -> int:
        """Records queued or in flight (cheap, no lock: a hint for flow control).

        0 while the thread waits for the rest of a journaled batch: the caller must
        go on submitting then, however long the queue.
        """
        return 0 if self._waiting else self._queued_logs + self._inflight

    def stats(self) -> dict[str, Any]:
        """Counts in records (`sent`, `failed`, `dropped`, `pending`, `skipped`).

        Also `errors` (cause -> occurrences) and `alerts` (`sent`, `failed`, `dropped`).
        """
        values, errors = self._counters.snapshot()
        counters = getattr(self.backend, "counters", None)
        if isinstance(counters, Counters):
            # records the backend accepted but could not deliver are not "sent"
            bvalues, berrors = counters.snapshot()
            lost = bvalues.get("failed", 0) + bvalues.get("dropped", 0)
            values["sent"] = max(values["sent"] - lost, 0)
            values["failed"] += bvalues.get("failed", 0)
            values["dropped"] += bvalues.get("dropped", 0)
            for cause, n in berrors.items():
                errors[cause] = errors.get(cause, 0) + n
        with self._cond:
            pending = self._queued_logs + self._inflight
        return {
            "sent": values["sent"],
            "failed": values["failed"],
            "dropped": values["dropped"],
            "pending": pending,
            "skipped": values.get("skipped", 0),
            "errors": errors,
            "alerts": {
                "sent": values.get("alerts_sent", 0),
                "failed": values.get("alerts_failed", 0),
                "dropped": values.get("alerts_dropped", 0),
            },
        }

    def _take(self) -> tuple[int, list[dict[str, Any]], Batch | None] | None:
        """Wait for work; return (kind, items, batch to journal first), or None when done.

        None once closed and drained, or out of time, or (closing a running stream) when
        only part of a journaled batch is queued: that part is left for a later start.
        """
        with self._cond:
            while True:
                while not self._items and not self._closing:
                    self._cond.wait()
                if not self._items or time.monotonic() >= self._deadline:
                    break
                kind, first = self._items[0]
                if kind == _ALERT:
                    self._items.popleft()
                    self._queued_alerts -= 1
                    return _ALERT, [first], None
                if self.journal is None:
                    return _LOG, self._pop(self.batch), None
                work = self._take_journaled(self.journal)
                if work is _AGAIN:
                    continue
                if work is not None:
                    return work
                if self._closing and self._status == "running":
                    break
                self._waiting = True
                self._cond.wait(None if math.isinf(self._deadline)
                                else max(self._deadline - time.monotonic(), 0.0))
                self._waiting = False
            left, alerts = self._queued_logs, self._queued_alerts
            self._items.clear()
            self._queued_logs = self._queued_alerts = self._queued_bytes = 0
        # past the close deadline: what is still queued is dropped, and counted
        if left:
            self._counters.error(
                f"{self._name}: close timeout",
                f"{left} records not delivered",
                records=left,
                kind="dropped",
            )
        if alerts:
            self._counters.add("alerts_dropped", alerts)
        return None

    def _pop(self, limit: int, stop: int | None = None, session: str | None = None
             ) -> list[dict[str, Any]]:
        """Pop the records at the head, up to `limit`, an alert, or seq `stop` of `session`."""
        if session is not None and self.pulled:
            taken = self._pop_run(limit, stop, session)
            if taken is not None:
                return taken
        taken = [self._items.popleft()[1]]
        while self._items and len(taken) < limit and self._items[0][0] == _LOG:
            if session is not None:
                pos = position(self._items[0][1])
                if pos is None or pos[0] != session or (stop is not None and pos[1] >= stop):
                    break
            taken.append(self._items.popleft()[1])
        self._dequeued(taken)
        self._inflight = len(taken)
        return taken

    def _pop_run(self, limit: int, stop: int | None, session: str) -> list[dict[str, Any]] | None:
        """`_pop` for exprd's spool reader, whose records of one file come in seq order, all
        of one session: if the last record of the head's run (up to `limit`, before any
        alert) is of `session` and before `stop`, so is every one before it; None (the
        caller looks record by record) if not."""
        items = self._items
        head = list(islice(items, limit))
        if self._queued_alerts:
            kinds = list(map(_KIND, head))
            if _ALERT in kinds:
                head = head[: kinds.index(_ALERT)]
        if not head:
            return None
        end = position(head[-1][1])
        if end is None or end[0] != session or (stop is not None and end[1] >= stop):
            return None
        taken = list(map(_ROW, head))
        if len(taken) == len(items):
            items.clear()
        else:
            for _ in taken:
                items.popleft()
        self._dequeued(taken)
        self._inflight = len(taken)
        return taken

    def _take_journaled(self, journal: BatchJournal) -> Any:
        """The next batch when the head is a record: journaled or new; None to wait for
        the rest of a journaled batch, `_AGAIN` after skipping records sent before."""
        pos = position(self._items[0][1])
        if pos is None:  # no event id: a batch as without a journal (its key hashes the body)
            return _LOG, self._pop(1), None
        session, seq = pos
        batch = journal.find(session, seq)
        if batch is None:
            taken = self._pop(self.batch, journal.next_first(session, seq), session)
            end = position(taken[-1])
            assert end is not None
            return _LOG, taken, (seq, end[1], len(taken))
        first, last, n = batch
        picked: list[int] = []
        done = False
        for i, (kind, row) in enumerate(self._items):
            if kind == _ALERT:
                continue  # alerts wait behind the batch: its records go out together
            p = position(row)
            if p is None or p[0] != session or p[1] > last:
                done = True  # past the batch: the missing records are not coming
                break
            picked.append(i)
            if p[1] == last:
                done = True
                break
        if seq != first:
            # the batch's head lies before the backend's checkpoint, so the whole batch
            # was sent before that checkpoint was written: these records are delivered
            skipped = self._dequeued(self._remove(picked))
            self._completed += skipped
            self._counters.add("skipped", skipped)
            return _AGAIN
        if not done and not (self._closing and self._status != "running"):
            return None  # the rest of the batch is still to come
        rows = self._remove(picked)
        self._dequeued(rows)
        self._inflight = len(rows)
        if len(rows) != n or position(rows[-1]) != (session, last):
            self._counters.error(f"{self._name}: batch journal: a batch came back incomplete",
                                 f"{session}:{first}..{session}:{last} has {len(rows)} of {n}")
        return _LOG, rows, None

    def _room_in_bytes(self, records: list[dict[str, Any]]) -> int:
        """How many of `records`, in order, fit under `max_bytes`."""
        assert self.max_bytes is not None
        left, n = self.max_bytes - self._queued_bytes, 0
        for row in records:
            if left <= 0:
                break
            left -= record_bytes(row)
            n += 1
        return n

    def _dequeued(self, rows: list[dict[str, Any]]) -> int:
        """Count `rows` out of the queue (under the lock); their number."""
        self._queued_logs -= len(rows)
        if self.max_bytes is not None:
            self._queued_bytes -= sum(record_bytes(r) for r in rows)
        return len(rows)

    def _remove(self, picked: list[int]) -> list[dict[str, Any]]:
        """Take the records at queue positions `picked` (ascending) out of the queue."""
        if picked and picked[-1] == len(picked) - 1:
            return [self._items.popleft()[1] for _ in picked]  # the usual case: a plain prefix
        chosen = set(picked)
        rows = [row for i, (_k, row) in enumerate(self._items) if i in chosen]
        self._items = deque(item for i, item in enumerate(self._items) if i not in chosen)
        return rows

    def _journal(self, items: list[dict[str, Any]], batch: Batch) -> None:
        """Write a new batch ahead of its send; if that fails it goes out all the same."""
        assert self.journal is not None
        pos = position(items[0])
        assert pos is not None
        try:
            self.journal.add(pos[0], *batch)
        except (OSError, ValueError) as exc:
            self._counters.error(f"{self._name}: batch journal: {type(exc).__name__}", str(exc))

    def _main(self) -> None:
        """The worker thread: open, deliver in order until closed, finish."""
        name = self._name
        try:
            self.backend.open(self.identity)
            opened = True
        except Exception as exc:
            opened = False
            self._counters.error(f"{name}: open: {type(exc).__name__}", str(exc))
        # a journaled batch is posted whole whatever the backend's own batch size
        send = getattr(self.backend, "log_batch", None) if self.journal is not None else None
        while True:
            work = self._take()
            if work is None:
                break
            kind, items, new = work
            try:
                if new is not None and opened:
                    self._journal(items, new)
                if kind == _ALERT:
                    if opened:
                        self.backend.alert(items[0])
                        self._counters.add("alerts_sent")
                    else:
                        self._counters.error(f"{name}: not open", records=1, kind="alerts_failed")
                elif opened:
                    (send or self.backend.log)(items)
                    self._counters.add("sent", len(items))
                else:
                    self._counters.error(f"{name}: not open", records=len(items))
            except Exception as exc:
                cause = f"{name}: {'alert' if kind == _ALERT else 'log'}: {type(exc).__name__}"
                if kind == _ALERT:
                    self._counters.error(cause, str(exc), records=1, kind="alerts_failed")
                else:
                    self._counters.error(cause, str(exc), records=len(items))
            finally:
                with self._cond:
                    self._inflight = 0
                    if kind == _LOG and not self._interrupted:
                        self._completed += len(items)
        if opened:
            try:
                self.backend.finish(self._status)
            except Exception as exc:
                self._counters.error(f"{name}: finish: {type(exc).__name__}", str(exc))
