"""The backend protocol, remote identities (DESIGN 9) and the spec parser `make_backend`.

A backend receives decoded shard records and forwards them somewhere remote.
Nothing here imports wandb, trackio or httpx: they are imported by the
implementation modules when a backend is opened.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from expr_tracker.layout import validate_name, validate_stream

log = logging.getLogger("expr_tracker.backends")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Which keys each backend type accepts in a mapping spec; "type" is always allowed.
_SPEC_KEYS: dict[str, frozenset[str]] = {
    "wandb": frozenset({"entity", "project", "mode"}),
    "trackio": frozenset({"project"}),
    "http": frozenset({"url", "token_env", "batch", "timeout", "retries", "backoff"}),
}
_WARNED_MISSING: set[str] = set()
_WARNED_LOCK = threading.Lock()


@dataclass(frozen=True)
class Identity:
    """Who a stream of records belongs to: the key of one remote run."""

    project: str
    name: str
    stream: str | None = None
    rank: int = 0
    world_size: int = 1
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    dir: str = ""

    def __post_init__(self) -> None:
        validate_name(self.project, "project")
        validate_name(self.name, "name")
        validate_stream(self.stream)
        for fname in ("rank", "world_size"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{fname} must be an int, got {type(value).__name__}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.world_size < 1:
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
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
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


def _check_spec(kind: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the keys and values of a mapping spec; return the keyword arguments."""
    allowed = _SPEC_KEYS[kind]
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "type":
            continue
        if key not in allowed:
            raise ValueError(
                f"backend {kind!r}: unknown key {key!r}; allowed: {', '.join(sorted(allowed))}"
            )
        kwargs[key] = value
    for key in ("entity", "project", "mode", "url", "token_env"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise ValueError(f"backend {kind!r}: {key} must be a string")
    if kind == "wandb" and kwargs.get("mode") not in (None, "online", "offline", "disabled"):
        raise ValueError(
            f"backend 'wandb': mode must be online, offline or disabled, not {kwargs['mode']!r}"
        )
    if kind == "http":
        url = kwargs.get("url")
        if not url:
            raise ValueError("backend 'http': url is required")
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"backend 'http': url must start with http:// or https://, not {url!r}"
            )
        if "token_env" in kwargs and not _ENV_NAME.match(kwargs["token_env"]):
            raise ValueError(
                f"backend 'http': token_env {kwargs['token_env']!r} is not a variable name"
            )
        for key, lo in (("batch", 1), ("retries", 0)):
            value = kwargs.get(key, lo)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"backend 'http': {key} must be an integer >= {lo}")
        for key in ("timeout", "backoff"):
            value = kwargs.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"backend 'http': {key} must be a positive number")
    return kwargs


def make_backend(spec: str | Mapping[str, Any] | Backend) -> Backend:
    """Build a backend from `"wandb"`, `"trackio"` or a mapping with a `type` key.

    For example `{"type": "http", "url": ..., "token_env": "EXPR_HTTP_TOKEN", "batch": 100}`.

    Raises ValueError naming the field for an unknown type or key. Imports no
    optional package: a missing one is reported when the backend is opened.
    """
    options: Mapping[str, Any]
    if isinstance(spec, str):
        kind, options = spec, {}
    elif isinstance(spec, Mapping):
        spec_type = spec.get("type")
        if not isinstance(spec_type, str):
            raise ValueError("backend spec: type is required (wandb, trackio or http)")
        kind, options = spec_type, spec
    elif all(callable(getattr(spec, m, None)) for m in ("open", "log", "alert", "finish")):
        return spec  # a user's own backend object (direct mode only)
    else:
        raise TypeError(
            "backend spec must be 'wandb', 'trackio', a mapping with a type, or an object with "
            f"open/log/alert/finish methods; got {type(spec).__name__}"
        )
    if kind not in _SPEC_KEYS:
        raise ValueError(
            f"backend type {kind!r} is unknown; expected one of: {', '.join(sorted(_SPEC_KEYS))}"
        )
    kwargs = _check_spec(kind, options)
    if kind == "wandb":
        from expr_tracker.backends.wandb import WandbBackend

        return WandbBackend(**kwargs)
    if kind == "trackio":
        from expr_tracker.backends.trackio import TrackioBackend

        return TrackioBackend(**kwargs)
    from expr_tracker.backends.http import HttpBackend

    return HttpBackend(**kwargs)
