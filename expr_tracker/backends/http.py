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

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from expr_tracker.backends.base import MAX_BACKOFF, RETRY_STATUS, Counters, Identity, retry_after
from expr_tracker.backends.journal import idempotency_key
from expr_tracker.store.records import encode_value


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
                if resp.status_code < 500 and resp.status_code not in RETRY_STATUS:
                    self.counters.error(cause, "not retried", records=records)
                    return
                wait = retry_after(resp.headers.get("Retry-After"))
            if attempt == self.retries:
                break
            pause = wait if wait is not None else min(delay, MAX_BACKOFF)
            delay *= 2
            if self._stop.wait(pause):
                cause = f"http{what}: interrupted"
                break
        self.counters.error(cause, f"gave up after {attempt + 1} attempts", records=records)
