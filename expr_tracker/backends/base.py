"""The backend protocol, remote identities (DESIGN 9), counters and record helpers.

A backend receives decoded shard records and forwards them somewhere remote.
Nothing here imports wandb, trackio or httpx: they are imported by the
implementation modules when a backend is opened.
"""

from __future__ import annotations

import email.utils
import logging
import math
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from expr_tracker.optional import importable
from expr_tracker.store.layout import validate_name, validate_stream

log = logging.getLogger("expr_tracker.backends")

RETRY_STATUS = frozenset({408, 429})  # client errors worth retrying
_MAX_RETRY_AFTER = 300.0  # seconds; a server asking for longer is treated as this
MAX_BACKOFF = 60.0  # seconds; the longest pause between two retries of one send
_WARNED_MISSING: set[str] = set()
_WARNED_LOCK = threading.Lock()


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


@dataclass(frozen=True)
class Identity:
    """Who a stream of records belongs to: the key of one remote run."""

    project: str
    name: str
    stream: str | None = None
    rank: int = 0
    world_size: int | None = 1  # None: unknown (WORLD_SIZE was not set)
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    dir: str = ""
    # the shard session (spool session id, or the SDK's per-init id) and when it started;
    # a backend that keeps one row per session (the team store's `runs`) keys on them
    session: str = field(default="", compare=False)
    start: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        validate_name(self.project, "project")
        validate_name(self.name, "name")
        validate_stream(self.stream)
        for fname in ("rank", "world_size"):
            value = getattr(self, fname)
            if value is None and fname == "world_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{fname} must be an int, got {type(value).__name__}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    def remote_id(self) -> str:
        """`sft-1`, `sft-1-rank2`, `sft-1-data`, `sft-1-data-rank2`: from (name, stream, rank)."""
        rid = self.name
        if self.stream:
            rid += f"-{self.stream}"
        if self.rank:
            rid += f"-rank{self.rank}"
        return rid

    def group(self) -> str:
        """The remote group: always the run name, so every rank and stream sits together."""
        return self.name

    def to_dict(self) -> dict[str, Any]:
        """The identity as sent to remote endpoints (no local paths)."""
        return {
            "project": self.project,
            "name": self.name,
            "stream": self.stream,
            "rank": self.rank,
            "world_size": self.world_size,
            "id": self.remote_id(),
            "group": self.group(),
            "config": dict(self.config),
        }


@runtime_checkable
class Backend(Protocol):
    """A remote sink of records. Methods may raise; `BackendWorker` contains the damage."""

    name: str

    def open(self, identity: Identity) -> None:
        """Start (or resume) the remote run of `identity`."""

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Forward a batch of records (each with `_step`, `_time`, maybe `_id`)."""

    def alert(self, alert: Mapping[str, Any]) -> None:
        """Forward one alert (title, text, level, ...)."""

    def finish(self, status: str) -> None:
        """Close the remote run; `status` is `finished` or `crashed`."""


class Counters:
    """Thread-safe counters of a backend or worker; logs the first error of each cause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = {"sent": 0, "failed": 0, "dropped": 0}
        self.errors: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        """Add `n` to counter `key`."""
        with self._lock:
            self.values[key] = self.values.get(key, 0) + n

    def error(
        self, cause: str, detail: str = "", *, records: int = 0, kind: str = "failed"
    ) -> None:
        """Count one occurrence of `cause` (and `records` under `kind`); log only the first."""
        with self._lock:
            first = cause not in self.errors
            self.errors[cause] = self.errors.get(cause, 0) + 1
            self.values[kind] = self.values.get(kind, 0) + records
        if first:
            # logging, not warnings.warn: this runs on background threads, and a
            # warning turned into an error there would be lost or kill the thread.
            log.warning(
                "%s%s; further occurrences are counted, not logged",
                cause,
                f" ({detail})" if detail else "",
            )

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """A consistent copy of (values, errors)."""
        with self._lock:
            return dict(self.values), dict(self.errors)


def require(module: str, extra: str) -> bool:
    """True if `module` is importable; else warn once per process (RuntimeWarning), False.

    Uses `find_spec`, so nothing heavy is imported. Call it on the caller's
    thread: the warning names the install command.
    """
    if importable(module):
        return True
    with _WARNED_LOCK:
        first = module not in _WARNED_MISSING
        _WARNED_MISSING.add(module)
    if first:
        warnings.warn(
            f"the {extra} backend is disabled: {module} is not installed; "
            f"install it with: pip install 'expr-tracker[{extra}]'",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def reportable(record: Mapping[str, Any], rank_metrics: bool) -> dict[str, Any] | None:
    """What a backend should see of `record`, or None to skip it.

    A step row passes as is. A rank record is skipped unless `rank_metrics`,
    when its values become `rank/<r>/<key>` at its `_step` (so remote runs never
    mix another rank's value into the main series).
    """
    kind = record.get("_kind")
    if kind is None:
        return dict(record)
    if kind != "rank" or not rank_metrics:
        return None
    rank = record.get("_rank")
    out: dict[str, Any] = {}
    for key in ("_step", "_time", "_id"):
        if key in record:
            out[key] = record[key]
    for key, value in record.items():
        if key[:1] != "_":
            out[f"rank/{rank}/{key}"] = value
    return out


def user_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """The metric items of a record (reserved `_` keys removed)."""
    return {k: v for k, v in record.items() if k[:1] != "_"}


AUTO_RANK = "auto"  # backend_on_rank default: each backend's own choice of reporting ranks


def reports_on_rank(on_rank: int | str | None, rank: int, every_rank: bool) -> bool:
    """Whether `rank` feeds a backend, from the run's `backend_on_rank`.

    A rank: only that one; None: every rank; "auto": the backend's own default, which is
    every rank for backends whose rows carry their rank (`every_rank`, the team store)
    and rank 0 for the others (a remote run of wandb or trackio has one step axis).
    """
    if on_rank == AUTO_RANK:
        return every_rank or rank == 0
    return on_rank is None or on_rank == rank
