"""Backend consumers of a spool file: at-least-once delivery with the event id as `_id`.

A run names the backends it wants (secret-free specs in its init event); exprd uses
its own configured spec of that type (URLs and tokens live in the daemon's config and
environment). Each backend consumer has its own checkpoint: the offset up to which
every event was handed over and the backend had done with it. After a restart the
events past that offset are sent again with the same `_id`, so a receiver can
de-duplicate.

Backends that send batches under one Idempotency-Key (http) also keep a batch journal,
`{state}/batches/<spool file>.<backend>.jsonl`: every batch is journaled before it is
sent, and events sent again after a restart are cut into the same batches, so a key
always carries the same body. A journal forgets the batches before the checkpoint
once that is on disk, and is deleted with its spool file.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import re
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config
    from .spec import RunSpec

log = logging.getLogger("exprd")
HIGH_WATER = 5000  # records queued in one backend before its spool file is paused
MAX_MARKS = 4096  # settle points remembered per backend; past it the newest is overwritten
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_warned: set[str] = set()


def journal_stem(rel: str) -> str:
    """The journal name part of spool file `rel` (relative to the spool root)."""
    base = rel.rsplit("/", 1)[-1].removesuffix(".jsonl")
    return f"{base}.{hashlib.sha256(rel.encode()).hexdigest()[:12]}"


def journal_path(state: Path, rel: str, backend: str) -> Path:
    """`{state}/batches/<stem>.<backend>.jsonl` (an odd backend name is hashed)."""
    part = backend if _SAFE_NAME.match(backend) else \
        "h" + hashlib.sha256(backend.encode()).hexdigest()[:12]
    return state / "batches" / f"{journal_stem(rel)}.{part}.jsonl"


def drop_journals(state: Path, rel: str) -> None:
    """Delete the batch journals of spool file `rel` (its file is gone)."""
    for path in (state / "batches").glob(glob.escape(journal_stem(rel)) + ".*"):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete batch journal %s: %s", path, exc.strerror or exc)


def _kind(spec: Any) -> str | None:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        kind = spec.get("type")
        return kind if isinstance(kind, str) else None
    return None


def spool_rel(spec: RunSpec) -> str:
    """The spool file of `spec` relative to the spool root (as check_init verified it)."""
    ident = spec.identity
    return f"{ident['project']}/{ident['name']}/{spec.paths.stem}.{spec.session}.jsonl"


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
        # per backend: (records queued, offset, seq at it) when settle() was asked; the
        # offset is committed once the backend has done with that many records
        self._marks: dict[str, deque[tuple[int, int, int | None]]] = {}
        self._settled: dict[str, int] = {}  # seq at the committed offset, when known
        self._closers: list[threading.Thread] = []
        if not enabled or not spec.backends:
            return
        specs = resolve(spec.backends, cfg)
        if not specs:
            return
        from expr_tracker.backends.base import Identity, reports_on_rank
        from expr_tracker.backends.journal import BatchJournal
        from expr_tracker.backends.registry import make_backend
        from expr_tracker.backends.worker import BackendWorker

        ident = spec.identity
        identity = Identity(
            project=ident["project"], name=ident["name"], stream=ident.get("stream"),
            rank=spec.rank, world_size=ident["world_size"],
            config=dict(ident.get("config") or {}), dir=str(spec.paths.run_dir),
            session=spec.session, start=spec.time,
        )
        for name, bspec in specs.items():
            try:
                backend = make_backend(bspec)
            except (TypeError, ValueError) as exc:
                log.warning("backend %s: %s", name, exc)
                continue
            if not reports_on_rank(spec.backend_on_rank, spec.rank,
                                   getattr(backend, "every_rank", False)):
                continue
            journal = None
            if cfg.state is not None and callable(getattr(backend, "log_batch", None)):
                journal = BatchJournal(journal_path(cfg.state, spool_rel(spec), name))
            self._workers[name] = BackendWorker(
                backend, identity, rank_metrics=spec.backend_rank_metrics, journal=journal,
                # a new batch is one POST, so its journal entry is its key
                batch=int(getattr(backend, "batch", 100)) if journal is not None else 100)
            self.committed[name] = int(offsets.get(name, 0))
            self._marks[name] = deque()

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
        return any(w.backlog() >= HIGH_WATER for w in self._workers.values())

    def settle(self, offset: int, seq: int | None = None) -> None:
        """Every event before `offset` (the last of them `seq`, if known) has been submitted:
        advance each backend's checkpoint to the latest such point it has done with."""
        for name, worker in self._workers.items():
            queued, done = worker.progress()
            marks = self._marks[name]
            mark = (queued, offset, seq)
            if marks and marks[-1][1] == offset:
                pass
            elif len(marks) >= MAX_MARKS:
                marks[-1] = mark  # coarser, never wrong: a later point needs more done
            else:
                marks.append(mark)
            while marks and marks[0][0] <= done:
                _, off, at = marks.popleft()
                if off >= self.committed[name]:
                    self.committed[name] = off
                    if at is not None:
                        self._settled[name] = at

    def checkpointed(self) -> None:
        """The checkpoint holding `committed` is on disk: journals forget the batches
        before it (they are never submitted again)."""
        for name, worker in self._workers.items():
            seq = self._settled.get(name)
            if worker.journal is None or seq is None:
                continue
            try:
                worker.journal.compact(seq)
            except OSError as exc:
                log.warning("cannot compact batch journal %s: %s", worker.journal.path,
                            exc.strerror or exc)

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
