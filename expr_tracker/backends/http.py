"""The HTTP backend: POST batches of records as JSON to a URL, idempotently.

Each batch is `{"identity": {...}, "events": [...]}`, serialised once; every
retry sends the same bytes with the same `Idempotency-Key` (the first and last
event ids of the batch, DESIGN 6), so a receiver can de-duplicate. A
`BatchJournal` keeps the batch boundaries across restarts of exprd too (the
worker cuts batches by it and sends each with `log_batch`), so a key never
names two different bodies. The bearer
token is read from the environment variable named by `token_env` and only ever
placed in the Authorization header.
"""

from __future__ import annotations

import bisect
import email.utils
import hashlib
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from expr_tracker.backends.base import Counters, Identity, log
from expr_tracker.records import encode_value

_RETRY_STATUS = frozenset({408, 429})
_MAX_RETRY_AFTER = 300.0  # seconds; a server asking for longer is treated as this
_MAX_BACKOFF = 60.0
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
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
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
        tmp.write_bytes(body)
        os.replace(tmp, self.path)


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), _MAX_RETRY_AFTER)


def _wire(event: Mapping[str, Any]) -> dict[str, Any]:
    """A record in strict JSON form: non-finite floats become "NaN"/"Infinity" strings."""
    out: dict[str, Any] = {}
    for key, value in event.items():
        out[key] = encode_value(key, value) if value.__class__ is float else value
    return out


class HttpBackend:
    """POSTs record batches to `url`, retrying transient failures with backoff."""

    name = "http"

    def __init__(
        self,
        *,
        url: str,
        token_env: str = "EXPR_HTTP_TOKEN",
        batch: int = 100,
        timeout: float = 10.0,
        retries: int = 8,
        backoff: float = 0.5,
    ) -> None:
        self.url = url
        self.token_env = token_env
        self.batch = batch
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.counters = Counters()
        self._identity: dict[str, Any] = {}
        self._client: Any = None
        self._stop = threading.Event()

    def open(self, identity: Identity) -> None:
        """Create the HTTP client; the token is read from the environment now."""
        import httpx

        self._identity = identity.to_dict()
        headers = {"Content-Type": "application/json", "User-Agent": "expr-tracker"}
        token = os.environ.get(self.token_env)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=self.timeout)

    def interrupt(self) -> None:
        """Cut retry waits short: pending retries give up (thread-safe)."""
        self._stop.set()

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Send `events` in batches of `batch`; an undeliverable batch is counted `failed`."""
        for start in range(0, len(events), self.batch):
            if self._stop.is_set():
                left = len(events) - start
                self.counters.error("http/events: interrupted", records=left)
                return
            self.log_batch(events[start : start + self.batch])

    def log_batch(self, events: Sequence[Mapping[str, Any]]) -> None:
        """POST `events` as one batch, whatever `batch` says (a batch replayed from a journal).

        The body is a function of the identity and the events' own fields only, so the
        same batch sent again, by this process or after a restart, is the same bytes.
        """
        if self._client is None:
            raise RuntimeError("http backend used before open()")
        if self._stop.is_set():
            self.counters.error("http/events: interrupted", records=len(events))
            return
        chunk = [_wire(e) for e in events]
        body = orjson.dumps({"identity": self._identity, "events": chunk})
        self._post(body, idempotency_key(chunk, body), len(chunk), "/events")

    def alert(self, alert: Mapping[str, Any]) -> None:
        """POST one alert as `{"identity": ..., "alert": {...}}` to the same URL."""
        if self._client is None:
            raise RuntimeError("http backend used before open()")
        body = orjson.dumps({"identity": self._identity, "alert": _wire(alert)})
        key = alert.get("id") or alert.get("_id")
        self._post(body, str(key) if key else idempotency_key([{}], body), 0, "/alerts")

    def finish(self, status: str) -> None:
        """Close the client (nothing is sent for the status)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _post(self, body: bytes, key: str, records: int, what: str) -> None:
        """POST one body until it is accepted, refused, or the retries run out."""
        import httpx

        headers = {"Idempotency-Key": key}
        delay = self.backoff
        for attempt in range(self.retries + 1):
            wait: float | None = None
            try:
                resp = self._client.post(self.url, content=body, headers=headers)
            except httpx.TransportError as exc:
                cause = f"http{what}: {type(exc).__name__}"
            else:
                if resp.status_code < 300:
                    return
                cause = f"http{what}: status {resp.status_code}"
                if resp.status_code < 500 and resp.status_code not in _RETRY_STATUS:
                    self.counters.error(cause, "not retried", records=records)
                    return
                wait = retry_after(resp.headers.get("Retry-After"))
            if attempt == self.retries:
                break
            pause = wait if wait is not None else min(delay, _MAX_BACKOFF)
            delay *= 2
            if self._stop.wait(pause):
                cause = f"http{what}: interrupted"
                break
        self.counters.error(cause, f"gave up after {attempt + 1} attempts", records=records)
