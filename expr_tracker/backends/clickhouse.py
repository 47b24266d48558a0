"""The team store: records forwarded to ClickHouse over its HTTP interface (DESIGN 16).

Every batch becomes `INSERT INTO <db>.<table> (<columns>) FORMAT TabSeparated` requests
(built by `chrows`): one row per value of a step row into `metrics`, one row per value of
a `log_rank_metrics` record into `rank_metrics` (alerts, incidents and `runs` rows go as
JSONEachRow). The tables are `ReplacingMergeTree`s whose sorting key ends in the event
id, so an event sent twice (a retry, exprd restarted, `expr replay`) collapses to one row
under `FINAL` (and after merges). Where the server knows `insert_deduplication_token`,
the batch key (`first..last` event id, kept across restarts by exprd's batch journal) is
sent as that token too.

Nothing touches the network before the first send: the schema (`create = true`) is made
then, inside the same retry loop, so a server that is down when a run starts costs
retries, not the run's data. Credentials come from the environment variables named by
`user_env` / `password_env` and only ever travel in the Authorization header.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from expr_tracker.backends.base import MAX_BACKOFF, Counters, Identity, retry_after
from expr_tracker.backends.chrows import METRICS_COLUMNS, RANK_COLUMNS, Encoder
from expr_tracker.backends.journal import idempotency_key

DATABASE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
TABLES = ("metrics", "rank_metrics", "runs", "alerts", "incidents")
_CODE = re.compile(rb"Code: (\d+)")
# ClickHouse error codes of data the server cannot parse or convert: the same body sent
# again cannot succeed. Everything else (down, overloaded, a missing grant an operator
# fixes) is retried: within `retries` in direct mode, until it works in exprd, whose spool
# holds the data meanwhile.
_DATA_ERRORS = frozenset({6, 26, 27, 38, 41, 53, 62, 69, 70, 72, 117})
# The server refused the credentials (UNKNOWN_USER, WRONG_PASSWORD, REQUIRED_PASSWORD,
# IP_ADDRESS_NOT_ALLOWED, AUTHENTICATION_FAILED; newer servers also answer 401/403).
# Credentials are read once, at open(): in direct mode the same request cannot succeed
# later in this process, so it is not retried and every later send fails at once under
# the same cause; exprd retries (its spool keeps the data until it restarts with working
# credentials).
_AUTH_ERRORS = frozenset({192, 193, 194, 195, 516})
_AUTH_STATUS = frozenset({401, 403})
_MISSING = frozenset({60, 81})  # UNKNOWN_TABLE, UNKNOWN_DATABASE: the schema is made again
# (url, database, user) -> (schema made, the server knows insert_deduplication_token):
# what `_prepare` learnt, for this process's other backends of the same store
_PREPARED: dict[tuple[str, str, str | None], tuple[bool, bool]] = {}

_VALUE_COLUMNS = "step Int64, time Float64, key String, value Float64, text String, event_id String"
_ORDER = "ORDER BY (project, name, stream, rank, key, step, event_id)"


def schema(db: str) -> list[str]:
    """The statements that create database `db` and its five tables (idempotent)."""
    q = f"`{db}`"
    ident = "project String, name String, stream String, rank UInt32"
    return [
        f"CREATE DATABASE IF NOT EXISTS {q}",
        f"CREATE TABLE IF NOT EXISTS {q}.metrics ({ident}, {_VALUE_COLUMNS}) "
        f"ENGINE = ReplacingMergeTree {_ORDER}",
        f"CREATE TABLE IF NOT EXISTS {q}.rank_metrics ({ident}, world_size UInt32, "
        f"local_rank Nullable(UInt32), weight Float64, {_VALUE_COLUMNS}) "
        f"ENGINE = ReplacingMergeTree {_ORDER}",
        # one row per shard session; the newest version (status change) wins under FINAL
        f"CREATE TABLE IF NOT EXISTS {q}.runs ({ident}, session String, world_size UInt32, "
        "config String, status String, start_time Float64, end_time Float64, version UInt64) "
        "ENGINE = ReplacingMergeTree(version) ORDER BY (project, name, stream, rank, session)",
        f"CREATE TABLE IF NOT EXISTS {q}.alerts ({ident}, time Float64, step Nullable(Int64), "
        "kind String, level String, rule String, title String, text String, event_id String) "
        "ENGINE = ReplacingMergeTree ORDER BY (project, name, stream, rank, time, kind, rule, title)",
        # DESIGN 13 incident lines; one row per (kind, ranks, first_seen), the last change wins
        f"CREATE TABLE IF NOT EXISTS {q}.incidents (project String, name String, stream String, "
        "kind String, ranks Array(UInt32), hosts Array(String), step Nullable(Int64), "
        "first_seen Float64, last_seen Float64, detail String, state String, delivered UInt8, "
        "version UInt64) ENGINE = ReplacingMergeTree(version) "
        "ORDER BY (project, name, stream, kind, ranks, first_seen)",
    ]


_TLS: Any = None
_TLS_LOCK = threading.Lock()


def _tls() -> Any:
    """httpx's default TLS context, made once per process: each client would load the CA
    bundle again (tens of ms of CPU, once per spool file in exprd)."""
    global _TLS
    with _TLS_LOCK:
        if _TLS is None:
            import httpx

            _TLS = httpx.create_ssl_context()
        return _TLS


def _line(row: Mapping[str, Any]) -> bytes:
    """One JSONEachRow line."""
    return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


class _Failure(Exception):
    """One failed request: `retry` says whether the same request may succeed later."""

    def __init__(self, cause: str, detail: str = "", *, retry: bool, wait: float | None = None,
                 auth: bool = False):
        super().__init__(cause)
        self.cause, self.detail, self.retry, self.wait = cause, detail, retry, wait
        self.auth = auth  # the credentials were refused


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


class ClickHouseBackend:
    """Inserts records, alerts, incidents and run rows into a ClickHouse database."""

    name = "clickhouse"
    every_rank = True  # rows carry their rank: every rank reports unless backend_on_rank says
    raw_records = True  # rank records go to `rank_metrics` as they are, not as rank/<r>/<key>

    def __init__(
        self,
        *,
        url: str,
        database: str = "expr",
        user_env: str | None = None,
        password_env: str | None = None,
        create: bool = True,
        batch: int = 5000,
        timeout: float = 10.0,
        retries: int = 8,
        backoff: float = 0.5,
        exit_timeout: float = 5.0,
        queue_mb: float = 64.0,
    ) -> None:
        self.url = url.rstrip("/") + "/"
        self.database = database
        # named in the spec: must be set (checked by check_environment); not named: the
        # default variables, each used only if set (else the server's `default` user)
        self._named = [(k, v) for k, v in (("user_env", user_env),
                                           ("password_env", password_env)) if v is not None]
        self.user_env = user_env or "CLICKHOUSE_USER"
        self.password_env = password_env or "CLICKHOUSE_PASSWORD"
        self.create = create
        self.batch = batch
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        # direct mode (BackendWorker): finish() waits for this backend while it acknowledges
        # batches, giving up after exit_timeout s without one; at most queue_mb of records
        # wait for it (a burst past that is dropped, counted)
        self.exit_timeout = float(exit_timeout)
        self.queue_mb = float(queue_mb)
        self.counters = Counters()
        self.identity: Identity | None = None
        self._client: Any = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # interrupt() or close_by(): look at the clock again
        self._deadline = math.inf  # time.monotonic() by which every send gives up
        self._last_ok = 0.0  # when the server last acknowledged a request (monotonic)
        self._closing = False  # close_by() was called
        self._refused: _Failure | None = None  # the server refused the credentials
        self._ready = False  # schema made (or create = false) and the server's settings known
        self._token = False  # the server knows insert_deduplication_token
        self._run_row = False  # this session's `runs` row says running
        self._last_time = 0.0
        self._encoder: Encoder | None = None  # made at the first rows(), from the identity

    def missing_environment(self) -> list[tuple[str, str]]:
        """(key, variable) of the credentials variables the spec names that are not set."""
        return [(k, v) for k, v in self._named if v not in os.environ]

    # -- the Backend protocol ------------------------------------------------------------
    def open(self, identity: Identity) -> None:
        """Create the HTTP client (credentials read from the environment now); no request."""
        import httpx

        self.identity = identity
        user = os.environ.get(self.user_env)
        password = os.environ.get(self.password_env, "")
        auth = httpx.BasicAuth(user, password) if user else None
        self._client = httpx.Client(auth=auth, timeout=self.timeout, verify=_tls(),
                                    headers={"User-Agent": "expr-tracker"})

    def interrupt(self) -> None:
        """Cut retry waits short: pending retries give up (thread-safe)."""
        self._stop.set()
        self._wake.set()

    def close_by(self, deadline: float) -> None:
        """The run is finishing: give up, from `deadline` (time.monotonic()) on, or once
        `exit_timeout` s pass without an acknowledgement, whatever is not delivered; no
        request and no retry wait lasts past that (thread-safe; the exit bound)."""
        self._last_ok = time.monotonic()
        self._deadline = deadline
        self._closing = True
        self._wake.set()

    def give_up_at(self) -> float:
        """The monotonic time sends give up at (inf while the run goes on): the worker
        waits for this backend's thread until then, not for a request already in flight."""
        if not self._closing:
            return math.inf
        return min(self._deadline, self._last_ok + self.exit_timeout)

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Insert `events` in batches of `batch`, each retried at most `retries` times."""
        for start in range(0, len(events), self.batch):
            self._send(events[start : start + self.batch], keep=False)

    def log_batch(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Insert one journaled batch (exprd): retried until the server acknowledges it.

        exprd's checkpoint passes a batch only once this returns, so a server that is down
        for a long time holds the batch (and, past exprd's high-water mark, that backend's
        reader of the spool file; never the shard) instead of losing it. `interrupt()` (exprd stopping) cuts it short: the batch
        is sent again after the restart, under the same key.
        """
        self._send(events, keep=True)

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Insert one alert (from the run's alerting rank) into `alerts`."""
        ident = self._ident()
        row = {
            **self._key(ident, alert.get("rank", ident.rank)),
            "time": float(alert.get("time") or 0.0),
            "step": alert.get("step") if isinstance(alert.get("step"), int) else None,
            **{k: _text(alert.get(k)) for k in ("kind", "level", "rule", "title", "text")},
            "event_id": _text(alert.get("event_id")),
        }
        if not self._insert("alerts", _line(row), None, keep=False):
            raise RuntimeError("the alert was not stored (see the clickhouse/alerts error)")

    def incident(self, incident: Mapping[str, Any]) -> None:
        """Insert one incident line (DESIGN 13: kind, ranks, hosts, step, first_seen,
        last_seen, detail, state, delivered); the newest line of an incident wins."""
        ident = self._ident()
        last = float(incident.get("last_seen") or 0.0)
        resolved = incident.get("state") == "resolved"
        step = incident.get("step")
        row = {
            "project": ident.project, "name": ident.name, "stream": ident.stream or "",
            "kind": _text(incident.get("kind")),
            "ranks": sorted(int(r) for r in incident.get("ranks") or ()),
            "hosts": [str(h) for h in incident.get("hosts") or ()],
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "first_seen": float(incident.get("first_seen") or 0.0),
            "last_seen": last,
            "detail": _text(incident.get("detail")),
            "state": _text(incident.get("state")),
            "delivered": 1 if incident.get("delivered") else 0,
            # later lines win; of two lines at one instant, the resolution
            "version": int(last * 1000) * 2 + resolved,
        }
        if not self._insert("incidents", _line(row), None, keep=False):
            raise RuntimeError("the incident was not stored (see the clickhouse/incidents error)")

    def finish(self, status: str) -> None:
        """Record the session's final status in `runs`, then close the client.

        exprd stopping closes a live run's backend with status `running`: nothing is
        written then (the run goes on, and a later exprd finishes it).
        """
        try:
            if self._client is not None and status in ("finished", "crashed"):
                self._runs_row(status, keep=False)
        finally:
            client, self._client = self._client, None
            if client is not None:
                client.close()

    # -- rows ------------------------------------------------------------------------------
    def _ident(self) -> Identity:
        if self.identity is None or self._client is None:
            raise RuntimeError("clickhouse backend used before open()")
        return self.identity

    @staticmethod
    def _key(ident: Identity, rank: Any) -> dict[str, Any]:
        return {"project": ident.project, "name": ident.name, "stream": ident.stream or "",
                "rank": rank if type(rank) is int and rank >= 0 else ident.rank}

    def rows(self, events: Sequence[Mapping[str, Any]]) -> tuple[list[bytes], list[bytes]]:
        """The TabSeparated rows of `events`: (metrics, rank_metrics), each a list of
        pieces of whole lines, in the column order of `chrows` (the hot loop of exprd's
        forwarding: see there)."""
        ident = self._ident()
        if self._encoder is None:
            self._encoder = Encoder(ident.project, ident.name, ident.stream or "", ident.rank,
                                    ident.world_size or 0)
        metrics, ranks, latest = self._encoder.rows(events)
        if latest > self._last_time:
            self._last_time = latest
        return metrics, ranks

    # -- sending ---------------------------------------------------------------------------
    def _send(self, events: Sequence[Mapping[str, Any]], *, keep: bool) -> None:
        """Insert one batch; its failure is counted once, in events, under `failed`."""
        self._ident()
        if not events:
            return
        metrics, ranks = (b"".join(rows) for rows in self.rows(events))
        key = idempotency_key(events, b"")  # the body is hashed only without event ids
        if key.startswith("sha256:"):
            key = idempotency_key(events, metrics + ranks)
        ok = True
        if not self._run_row:
            self._run_row = self._runs_row("running", keep=keep)
            ok = self._run_row or not keep
        for table, body, columns in (("metrics", metrics, METRICS_COLUMNS),
                                     ("rank_metrics", ranks, RANK_COLUMNS)):
            if ok and body:
                ok = self._insert(table, body, f"{key}/{table}", keep=keep,
                                  form=f"({columns}) FORMAT TabSeparated")
        if not ok:
            self.counters.add("failed", len(events))

    def _runs_row(self, status: str, *, keep: bool) -> bool:
        ident = self._ident()
        running = status == "running"
        row = {
            **self._key(ident, ident.rank),
            "session": ident.session,
            "world_size": ident.world_size,
            "config": orjson.dumps(ident.config).decode(),
            "status": status,
            "start_time": ident.start,
            "end_time": 0.0 if running else (self._last_time or time.time()),
            "version": time.time_ns() // 1000,
        }
        return self._insert("runs", _line(row), None, keep=keep)

    def _insert(self, table: str, body: bytes, token: str | None, *, keep: bool,
                form: str = "FORMAT JSONEachRow") -> bool:
        """INSERT `body` (lines) into `table` (`form`: the columns and format, JSONEachRow
        by default); True once the server acknowledged them."""
        sql = f"INSERT INTO `{self.database}`.{table} {form}"

        def attempt() -> None:
            self._prepare()
            params = {"query": sql}
            if token is not None and self._token:
                params["insert_deduplication_token"] = token
            self._request(params, body)

        return self._retry(f"clickhouse/{table}", attempt, keep=keep)

    def _prepare(self) -> None:
        """Create the schema (once, if `create`) and learn the server's settings.

        Once per process and (url, database): exprd has a backend per spool file, and
        eight files would otherwise make the same five tables eight times (`_forget`
        makes them again if the server lost them)."""
        if self._ready:
            return
        known = _PREPARED.get(self._where())
        if known is None or (self.create and not known[0]):
            if self.create:
                for statement in schema(self.database):
                    self._request({"query": statement}, b"")
            found = self._request({"query": "SELECT count() FROM system.settings "
                                   "WHERE name = 'insert_deduplication_token'"}, b"")
            known = (self.create, found.strip() not in (b"", b"0"))
            _PREPARED[self._where()] = known
        self._token = known[1]
        self._ready = True

    def _where(self) -> tuple[str, str, str | None]:
        return self.url, self.database, os.environ.get(self.user_env)

    def _forget(self) -> None:
        """The server does not know the database or a table: make the schema again."""
        self._ready = False
        _PREPARED.pop(self._where(), None)

    def _request(self, params: dict[str, str], body: bytes) -> bytes:
        """POST one statement; raises `_Failure` unless the server answers 200."""
        import httpx

        if self._client is None:
            raise _Failure("closed", retry=False)
        left = self.give_up_at() - time.monotonic()
        try:
            # never past the exit deadline: a hanging server costs the bound, not `timeout`
            resp = self._client.post(self.url, params=params, content=body,
                                     timeout=min(self.timeout, max(left, 0.05)))
        except httpx.TransportError as exc:
            raise _Failure(type(exc).__name__, str(exc), retry=True) from None
        if resp.status_code == 200:
            self._last_ok = time.monotonic()
            return bytes(resp.content)
        text = bytes(resp.content[:300])
        m = _CODE.search(text)
        code = int(m.group(1)) if m else None
        detail = text.decode("utf-8", "replace").strip().splitlines()[0] if text else ""
        cause = f"status {resp.status_code}" + (f", code {code}" if code is not None else "")
        if code in _MISSING:
            self._forget()
        if code in _AUTH_ERRORS or resp.status_code in _AUTH_STATUS:
            raise _Failure(f"authentication refused ({cause})", detail, retry=False, auth=True)
        raise _Failure(cause, detail, retry=code not in _DATA_ERRORS,
                       wait=retry_after(resp.headers.get("Retry-After")))

    def _retry(self, what: str, attempt: Callable[[], None], *, keep: bool) -> bool:
        """Run `attempt` until it succeeds, is refused, is interrupted, reaches the exit
        deadline or (unless `keep`) runs out of retries; every failure is counted under its
        cause, the first logged."""
        delay = self.backoff
        tries = 0
        last = ""
        while True:
            if self._stop.is_set():
                self.counters.error(f"{what}: interrupted")
                return False
            now = time.monotonic()
            if now >= self.give_up_at():
                why = ("the close deadline passed" if now >= self._deadline else
                       f"no acknowledgement for exit_timeout = {self.exit_timeout:g} s")
                self.counters.error(f"{what}: not delivered at exit",
                                    f"{why}; last: {last or 'no attempt'}")
                return False
            refused = self._refused
            if refused is not None and not keep:
                self.counters.error(f"{what}: {refused.cause}",
                                    f"{refused.detail}; not retried (check user_env/password_env)")
                return False
            try:
                attempt()
                return True
            except _Failure as exc:
                tries += 1
                last = exc.cause
                if exc.auth and not keep:
                    self._refused = exc
                    continue  # counted once above, as every later send of this process
                if not exc.retry and not exc.auth:
                    self.counters.error(f"{what}: {exc.cause}", f"{exc.detail}; not retried")
                    return False
                if not keep and tries > self.retries:
                    self.counters.error(f"{what}: not delivered",
                                        f"{exc.cause}; gave up after {tries} attempts")
                    return False
                self.counters.error(f"{what}: {exc.cause}", f"{exc.detail}; retrying")
                pause = exc.wait if exc.wait is not None else min(delay, MAX_BACKOFF)
                delay *= 2
            self._pause(pause)

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` between retries, less if the exit deadline comes first; woken by
        interrupt() and close_by() (which may have moved the deadline)."""
        end = time.monotonic() + seconds
        while True:
            left = min(end, self.give_up_at()) - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return
            if self._wake.wait(left):
                self._wake.clear()
