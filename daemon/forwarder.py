"""Backend consumers of a spool file: at-least-once delivery with the event id as `_id`.

A run names the backends it wants (secret-free specs in its init event); exprd uses
its own configured spec of that type (URLs and tokens live in the daemon's config and
environment). Each backend consumer has its own checkpoint: the offset up to which
every event was handed over and the backend's queue had drained. After a restart the
events past that offset are sent again with the same `_id`, so a receiver can
de-duplicate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .applier import RunSpec
    from .config import Config

log = logging.getLogger("exprd")
HIGH_WATER = 5000  # records queued in one backend before its spool file is paused
_warned: set[str] = set()


def _kind(spec: Any) -> str | None:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        kind = spec.get("type")
        return kind if isinstance(kind, str) else None
    return None


def resolve(requested: list[Any], cfg: Config) -> dict[str, Any]:
    """name -> spec of the daemon backends a run asked for (by type or by config name)."""
    out: dict[str, Any] = {}
    for req in requested:
        kind = _kind(req)
        if kind is None:
            continue
        found = {n: s for n, s in cfg.backends.items() if n == kind or _kind(s) == kind}
        if found:
            out.update(found)
        elif cfg.trust_run_backends:
            out[kind] = req
        elif kind not in _warned:
            _warned.add(kind)
            log.warning("a run asks for backend %r, which this exprd does not configure; "
                        "add [backends.%s] to its config (further runs not logged)", kind, kind)
    return out


class Forwarder:
    """The backend workers of one spool file and their delivered offsets."""

    def __init__(self, spec: RunSpec, cfg: Config, offsets: Mapping[str, int], *,
                 enabled: bool) -> None:
        self._workers: dict[str, Any] = {}
        self.committed: dict[str, int] = {}
        self._closers: list[threading.Thread] = []
        if not enabled or not spec.backends:
            return
        specs = resolve(spec.backends, cfg)
        if not specs:
            return
        from expr_tracker.backends.base import Identity, make_backend
        from expr_tracker.backends.worker import BackendWorker

        ident = spec.identity
        identity = Identity(
            project=ident["project"], name=ident["name"], stream=ident.get("stream"),
            rank=spec.rank, world_size=ident["world_size"],
            config=dict(ident.get("config") or {}), dir=str(spec.paths.run_dir),
        )
        for name, bspec in specs.items():
            try:
                backend = make_backend(bspec)
            except (TypeError, ValueError) as exc:
                log.warning("backend %s: %s", name, exc)
                continue
            self._workers[name] = BackendWorker(backend, identity,
                                                rank_metrics=spec.backend_rank_metrics)
            self.committed[name] = int(offsets.get(name, 0))

    @property
    def active(self) -> bool:
        return bool(self._workers)

    def workers(self) -> list[Any]:
        return list(self._workers.values())

    def catch_up(self, ev: dict[str, Any], offset: int) -> None:
        """An event the shard already holds: send it to the backends that may lack it."""
        for name, worker in self._workers.items():
            if self.committed[name] <= offset:
                worker.submit(ev)

    def busy(self) -> bool:
        """True while some backend has a long queue: the file waits instead of dropping."""
        return any(w.stats()["pending"] >= HIGH_WATER for w in self._workers.values())

    def settle(self, offset: int) -> None:
        """Advance the checkpoint of every backend whose queue has drained to `offset`."""
        for name, worker in self._workers.items():
            if worker.stats()["pending"] == 0:
                self.committed[name] = max(self.committed[name], offset)

    def stats(self) -> dict[str, Any]:
        return {name: w.stats() for name, w in self._workers.items()}

    def close(self, status: str, timeout: float = 30.0) -> None:
        """Drain and finish every backend on background threads (never blocks the loop)."""
        for worker in self._workers.values():
            t = threading.Thread(target=worker.close, args=(timeout, status),
                                 name="exprd-backend-close", daemon=True)
            t.start()
            self._closers.append(t)

    def join(self, timeout: float) -> None:
        """Wait for the closing threads (at shutdown)."""
        for t in self._closers:
            t.join(timeout)
