"""exprd configuration: a TOML file, overridden by command-line flags.

    spool = "/var/spool/expr"            # the spool root to tail
    state = "/var/lib/exprd"             # checkpoints, quarantine, status.json
    allowed_roots = ["/shared/runs"]     # run directories exprd may write under
    rescan_interval = 5                  # seconds between full rescans of the spool
    retention = "3d"                     # finished, fully applied spool files are deleted after it
    crash_silence = "1h"                 # a file silent this long without `finish` is crashed
    trust_run_backends = false           # use a run's own (secret-free) backend specs
    max_open_files = 256                 # shard descriptors held at once (default: half
                                         # the descriptor limit, at most 1024)
    allowed_uids = [1001]                # apply only spool files these users own (default:
                                         # any, a file of another user than the spool
                                         # root's owner logged once)

    watch_roots = ["/shared/runs"]       # also watch live runs there whose rank-0 sidecar names this host

    [health]                             # detector thresholds (expr_tracker.health.config)
    hang_after = "10m"

    [alert.channels.ops]                 # same shape as expr_tracker.alerts (channels, policy)
    type = "webhook"
    url_env = "OPS_WEBHOOK_URL"

    [backends.main]                      # name -> backend spec (expr_tracker.backends)
    type = "http"
    url = "https://metrics.example/ingest"
    token_env = "METRICS_TOKEN"

    [backends.clickhouse]                # the team store (docs/backends.md, "Team store")
    type = "clickhouse"
    url = "http://ch.internal:8123"
    database = "expr"
    user_env = "CLICKHOUSE_USER"
    password_env = "CLICKHOUSE_PASSWORD"
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expr_tracker.durations import parse_duration
from expr_tracker.errors import unknown_key

KEYS = ("spool", "state", "allowed_roots", "rescan_interval", "retention", "crash_silence",
        "alert", "backends", "trust_run_backends", "checkpoint_interval", "status_interval",
        "health", "watch_roots", "max_open_files", "allowed_uids")


class ConfigError(ValueError):
    """The exprd configuration is invalid; the message names the key."""


@dataclass
class Config:
    """The daemon's settings (see the module docstring for the file format)."""

    spool: Path | None = None
    state: Path | None = None
    allowed_roots: list[Path] | None = None  # None: anywhere (expr replay without a config)
    rescan_interval: float = 5.0
    retention: float = 3 * 86400.0
    crash_silence: float = 3600.0
    alert: dict[str, Any] | None = None
    backends: dict[str, Any] = field(default_factory=dict)
    trust_run_backends: bool = False
    checkpoint_interval: float = 1.0
    status_interval: float = 5.0
    health: Any = None  # expr_tracker.health.config.HealthConfig (None: the defaults)
    watch_roots: list[Path] = field(default_factory=list)
    max_open_files: int | None = None
    allowed_uids: frozenset[int] | None = None  # None: any owner (another one is logged)
    source: str | None = None

    def allows(self, path: Path) -> bool:
        """True if the resolved `path` lies under one of the allowed roots."""
        if self.allowed_roots is None:
            return True
        return any(_under(path, root) for root in self.allowed_roots)

    def open_files_bound(self) -> int:
        """Shard descriptors held at once: `max_open_files`, never over half the process's
        descriptor limit (spool reads, the watcher, state files and backends need the rest)."""
        import resource

        try:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ValueError, OSError):
            soft = 1024
        if soft == resource.RLIM_INFINITY:
            soft = 65536
        return min(self.max_open_files or 1024, max(4, soft // 2 - 16))

    def root_of(self, path: Path) -> Path | None:
        """The allowed root `path` lies under (the outermost), None if none or unrestricted."""
        if self.allowed_roots is None:
            return None
        under = [r for r in self.allowed_roots if _under(path, r)]
        return min(under, key=lambda r: len(r.parts)) if under else None


def _under(path: Path, root: Path) -> bool:
    """`path == root or root in path.parents`, told by their text (`parents` builds a Path
    per level): a Path's text is its parts joined by "/", none of which holds one."""
    text, top = str(path), str(root)
    if text.startswith("//") or top.startswith("//"):  # POSIX's other root, kept apart
        return path == root or root in path.parents
    return text == top or text.startswith(top if top.endswith("/") else top + "/")


def duration(value: Any, key: str) -> float:
    """Seconds from a number or a text like '500ms', '5s', '10m', '1h', '3d' (the one
    parser, `expr_tracker.durations`); 0 allowed."""
    try:
        return parse_duration(value, key, zero=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _path(value: Any, key: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a path, got {value!r}")
    return Path(value).expanduser().absolute()


def from_mapping(raw: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed config table; unknown keys are errors."""
    for key in raw:
        if key not in KEYS:
            raise ConfigError(unknown_key("", key, KEYS))
    cfg = Config(source=source)
    if "spool" in raw:
        cfg.spool = _path(raw["spool"], "spool")
    if "state" in raw:
        cfg.state = _path(raw["state"], "state")
    if "allowed_roots" in raw:
        roots = raw["allowed_roots"]
        if not isinstance(roots, list):
            raise ConfigError("allowed_roots must be a list of paths")
        cfg.allowed_roots = [_path(r, "allowed_roots").resolve() for r in roots]
    for key in ("rescan_interval", "retention", "crash_silence", "checkpoint_interval",
                "status_interval"):
        if key in raw:
            setattr(cfg, key, duration(raw[key], key))
    if cfg.rescan_interval <= 0:
        raise ConfigError("rescan_interval must be > 0")
    if "alert" in raw:
        if not isinstance(raw["alert"], Mapping):
            raise ConfigError("alert must be a table (channels, policy)")
        from expr_tracker.alerts import load_config

        cfg.alert = dict(raw["alert"])
        try:
            load_config(cfg.alert)  # fail at startup, naming the channel and key
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"alert: {exc}") from None
    if "backends" in raw:
        backends = raw["backends"]
        if not isinstance(backends, Mapping):
            raise ConfigError("backends must be a table of name -> backend spec")
        from expr_tracker.backends.registry import check_environment, make_backend, named_spec

        # [backends.clickhouse] without `type`: the name is the type
        backends = {str(k): named_spec(str(k), v) for k, v in backends.items()}
        for name, spec in backends.items():
            try:
                check_environment(make_backend(spec))  # exprd connects: its variables
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"backends.{name}: {exc}") from None
        cfg.backends = backends
    if "health" in raw:
        from expr_tracker.health.config import parse_health

        try:
            cfg.health = parse_health(raw["health"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if "watch_roots" in raw:
        roots = raw["watch_roots"]
        if not isinstance(roots, list):
            raise ConfigError("watch_roots must be a list of paths")
        cfg.watch_roots = [_path(r, "watch_roots") for r in roots]
    if "max_open_files" in raw:
        value = raw["max_open_files"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"max_open_files must be an integer >= 1, got {value!r}")
        cfg.max_open_files = value
    if "allowed_uids" in raw:
        uids = raw["allowed_uids"]
        if not isinstance(uids, list) or not all(
                type(u) is int and 0 <= u < 2**32 for u in uids):
            raise ConfigError(f"allowed_uids must be a list of numeric user ids, got {uids!r}")
        cfg.allowed_uids = frozenset(uids) or None  # []: any owner, as without the key
    if "trust_run_backends" in raw:
        if not isinstance(raw["trust_run_backends"], bool):
            raise ConfigError("trust_run_backends must be true or false")
        cfg.trust_run_backends = raw["trust_run_backends"]
    return cfg


def load(path: str | Path | None) -> Config:
    """Read and validate the TOML file at `path` (None: the defaults)."""
    if path is None:
        return Config()
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    return from_mapping(raw, str(path))
