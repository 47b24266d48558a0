"""What a spool file's init event says, checked: the `RunSpec` applier and forwarder share.

Below both of them: the applier builds a run's pipeline from it, the forwarder its backend
consumers. Nothing here writes; `check_init` only reads the event and the configuration.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expr_tracker.store.layout import (
    ShardPaths,
    run_dir,
    shard_stem,
    spool_path,
    validate_name,
    validate_stream,
)
from expr_tracker.store.records import MAX_WORLD
from expr_tracker.store.spoolfile import SPOOL_VERSION

from .config import Config


class InitError(ValueError):
    """An init event that exprd refuses to apply (the message is the reason)."""


@dataclass
class RunSpec:
    """What an init event says, checked."""

    identity: dict[str, Any]
    session: str
    rank: int
    rank_aware: bool
    paths: ShardPaths
    anchor: Path  # the allowed root the run dir lies in: no symlink is followed below it
    time: float
    host: str
    pid: int | None
    pid_start: int | None
    rules: list[Any] = field(default_factory=list)
    alert_on_rank: int | None = 0
    backend_on_rank: int | str | None = 0  # a rank, None (every rank) or "auto" (per backend)
    backend_rank_metrics: bool = False
    backends: list[Any] = field(default_factory=list)
    # the run directory was missing when the init was checked: the shard's first look
    # need not walk to it (only exprd writes a spool file's rows, and it is doing this)
    new_dir: bool = False
    segment: int = 0  # which segment of its session the file is (DESIGN 6)
    first_seq: int = 1  # the `_seq` its events start at

    def writer_identity(self) -> dict[str, Any]:
        # session_time: which session is the shard's newest, for a stale copy read later
        return {**self.identity, "source": "spool", "origin_host": self.host,
                "origin_pid": self.pid, "session_time": self.time}


def _opt_rank(ev: Mapping[str, Any], key: str) -> int | None:
    value = ev.get(key, 0)
    if value is None or (type(value) is int and value >= 0):
        return value
    raise InitError(f"{key} must be a rank or null, got {value!r}")


class Roots:
    """Run roots (an init's `dir`) resolved, each remembered for `ttl` seconds.

    Resolving takes an lstat per component of the root, paid by every new spool file, and
    the 2,048 files of one job name the same root. Only the allowed_roots check reads the
    resolution: what exprd writes is opened from the allowed root down, each directory
    below it without following a symlink (`store.safedir`), so a resolution gone stale (a
    symlink above the run root repointed meanwhile) can never write outside an allowed
    root; for at most `ttl` seconds a new file lands under the root the link used to name.
    """

    def __init__(self, ttl: float = 5.0, clock: Any = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._known: dict[str, tuple[Path, float]] = {}

    def resolve(self, raw: str) -> Path:
        now = self.clock()
        known = self._known.get(raw)
        if known is not None and now - known[1] < self.ttl:
            return known[0]
        if len(self._known) >= 1024:
            self._known = {k: v for k, v in self._known.items() if now - v[1] < self.ttl}
        path = Path(raw).resolve()
        self._known[raw] = (path, now)
        return path

    def clear(self) -> None:
        """Forget every resolution (a reload may have changed allowed_roots)."""
        self._known.clear()


def _resolved_run_dir(rdir: Path, root: Path, project: str, name: str) -> Path:
    """`rdir.resolve()` for `rdir = run_dir(root, project, name)` of a resolved `root`:
    validated names hold no "/" and no "..", so it differs only where `project` or `name`
    is a symlink, which two lstats tell (the whole resolve is done then, and for anything
    unusual)."""
    return _look_at_run_dir(rdir, root, project, name)[0]


def _look_at_run_dir(rdir: Path, root: Path, project: str, name: str) -> tuple[Path, bool]:
    """`_resolved_run_dir`, and whether the run directory was missing (a new run: nothing
    of it can be in a shard yet)."""
    here = str(root)
    for part in (project, name):
        here = f"{here}/{part}"
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return rdir, True  # nothing below it either: resolve() keeps the rest as it is
        except OSError:
            return rdir.resolve(), False
        if not stat.S_ISDIR(mode):
            return rdir.resolve(), False  # a symlink (or a file in the way)
    return rdir, False


def check_init(ev: Mapping[str, Any], path: Path, spool_root: Path, cfg: Config,
               roots: Roots | None = None) -> RunSpec:
    """Validate an init event against its file name and the allowed run roots (`roots`:
    the run roots resolved lately, see `Roots`)."""
    version = ev.get("version")
    if type(version) is not int or version > SPOOL_VERSION:
        raise InitError(f"unsupported spool version {version!r}")
    ident = ev.get("identity")
    if not isinstance(ident, dict):
        raise InitError("init has no identity")
    try:
        project = validate_name(ident.get("project"), "project")
        name = validate_name(ident.get("name"), "name")
        stream = validate_stream(ident.get("stream"))
        session = validate_name(ident.get("session"), "session")
    except (TypeError, ValueError) as exc:
        raise InitError(f"bad name in init: {exc}") from None
    # the SDK's own checks at init, applied again: the spool is a file anyone with the
    # training user's rights could have written
    rank, world = ident.get("rank"), ident.get("world_size")
    # world_size null: the SDK did not know it (WORLD_SIZE unset, DESIGN 12)
    if type(rank) is not int or rank < 0 or (world is not None and (
            type(world) is not int or not rank < world)):
        raise InitError(f"bad rank/world_size in init: {rank!r}/{world!r}")
    if world is not None and world > MAX_WORLD:
        raise InitError(f"world_size {world} is over the supported {MAX_WORLD}")
    local = ident.get("local_rank", 0)
    if type(local) is not int or local < 0:
        raise InitError(f"bad local_rank in init: {local!r}")
    rank_aware = ident.get("rank_aware", True)
    if not isinstance(rank_aware, bool):
        raise InitError(f"rank_aware must be true or false, got {rank_aware!r}")
    for key in ("rules", "backends"):
        if not isinstance(ev.get(key) or [], list):
            raise InitError(f"{key} in init must be a list")
    if not isinstance(ident.get("config") or {}, dict):
        raise InitError("config in init must be an object")
    stem = shard_stem(stream, rank if rank_aware else 0)
    segment, first_seq = ev.get("segment", 0), ev.get("first_seq", 1)
    if type(segment) is not int or segment < 0 or type(first_seq) is not int or first_seq < 1:
        raise InitError(f"bad segment/first_seq in init: {segment!r}/{first_seq!r}")
    part = f"{session}~{segment}" if segment else session
    # the usual case told by one string comparison (the spool root has no trailing "/")
    if str(path) != f"{spool_root}/{project}/{name}/{stem}.{part}.jsonl" and \
            path != (expected := spool_path(spool_root, project, name, stem, session, segment)):
        raise InitError(f"init identity says {expected.relative_to(spool_root)}, "
                        f"not {path.relative_to(spool_root)}")
    raw_dir = ev.get("dir")
    if not isinstance(raw_dir, str) or not raw_dir.startswith("/") or "\x00" in raw_dir:
        raise InitError(f"run dir {raw_dir!r} is not an absolute path")
    root = roots.resolve(raw_dir) if roots is not None else Path(raw_dir).resolve()
    rdir = run_dir(root, project, name)
    resolved, missing = _look_at_run_dir(rdir, root, project, name)
    if not cfg.allows(root) or not cfg.allows(resolved):
        raise InitError(f"run dir {raw_dir} is outside allowed_roots")
    anchor = cfg.root_of(root) or root
    pid = ev.get("pid")
    pid_start = ev.get("pid_start")
    when = ev.get("_time")
    return RunSpec(
        identity=dict(ident),
        session=session,
        rank=rank,
        rank_aware=rank_aware,
        paths=ShardPaths(rdir, stem),
        anchor=anchor,
        time=float(when) if isinstance(when, (int, float)) else 0.0,
        host=str(ev.get("host") or ""),
        pid=pid if type(pid) is int and pid > 0 else None,
        pid_start=pid_start if type(pid_start) is int else None,
        rules=list(ev.get("rules") or []),
        alert_on_rank=_opt_rank(ev, "alert_on_rank"),
        backend_on_rank="auto" if ev.get("backend_on_rank") == "auto"
        else _opt_rank(ev, "backend_on_rank"),
        backend_rank_metrics=ev.get("backend_rank_metrics") is True,
        backends=list(ev.get("backends") or []),
        new_dir=missing,
        segment=segment,
        first_seq=first_seq,
    )
