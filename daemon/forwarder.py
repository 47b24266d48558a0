"""Backend consumers of a spool file: at-least-once delivery with the event id as `_id`.

A run names the backends it wants (secret-free specs in its init event); exprd uses
its own configured spec of that type (URLs and tokens live in the daemon's config and
environment). Each backend consumer reads the spool file itself, from its own
checkpoint (the offset up to which every event was handed over and the backend had
done with it), never past what the shard consumer has read, and never more than
HIGH_WATER records ahead of its backend: a backend that is slow or down for hours
holds only its own reader, never the shard, and costs bounded memory. After a restart
the events past its checkpoint are sent again with the same `_id`, so a receiver can
de-duplicate. The spool file is kept until every consumer is done with it.

Backends that send batches under one Idempotency-Key (http) also keep a batch journal,
`{state}/batches/<spool file>.<backend>.jsonl`: every batch is journaled before it is
sent, and events sent again after a restart are cut into the same batches, so a key
always carries the same body. A journal forgets the batches before the checkpoint
once that is on disk, and is deleted with its spool file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from itertools import accumulate, compress, repeat
from operator import eq, not_, setitem
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from expr_tracker.store.records import DECODE_NONFINITE
from expr_tracker.store.spoolfile import MAX_LINE, SpoolReader
from expr_tracker.store.untrusted import check_record, numbered, rank_run, screen, screen_block

if TYPE_CHECKING:
    from .config import Config
    from .spec import RunSpec

log = logging.getLogger("exprd")
HIGH_WATER = 5000  # records queued in one backend (at least 2 batches) before its reader waits
READ_BUDGET = 4 << 20  # bytes one backend reader takes from its spool file per round
# a string value that may spell a non-finite float (checked on the line: one C call)
_NONFINITE = re.compile(rb'"(?:NaN|-?Infinity|nan|-?inf)"')
MAX_MARKS = 4096  # settle points remembered per backend; past it the newest is overwritten
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_warned: set[str] = set()


_PLUS_ONE = (1).__add__  # a line's length with its newline


def _decode_nonfinite(ev: dict[str, Any]) -> None:
    """Metric values that spell a non-finite float ("NaN", "Infinity") as that float."""
    for key, value in ev.items():
        if value.__class__ is str and key[:1] != "_" and value in DECODE_NONFINITE:
            ev[key] = DECODE_NONFINITE[value]


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
    # the directory listed, not globbed: a glob compiles a pattern per file (thousands of
    # segments are deleted in a row)
    prefix = journal_stem(rel) + "."
    try:
        names = [n for n in os.listdir(state / "batches") if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = state / "batches" / name
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
    part = f"{spec.session}~{spec.segment}" if spec.segment else spec.session
    return f"{ident['project']}/{ident['name']}/{spec.paths.stem}.{part}.jsonl"


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
    """The backend consumers of one spool file: per backend a worker, the reader feeding
    it from the spool and its delivered offset."""

    def __init__(self, spec: RunSpec, cfg: Config, offsets: Mapping[str, int], *,
                 enabled: bool) -> None:
        self._workers: dict[str, Any] = {}
        self.committed: dict[str, int] = {}
        # per backend: the offset its reader got to and the seq of the last line before it
        self._read: dict[str, tuple[int, int | None]] = {}
        # per backend: (records queued, offset, seq at it) once its reader got there; the
        # offset is committed once the backend has done with that many records
        self._marks: dict[str, deque[tuple[int, int, int | None]]] = {}
        self._settled: dict[str, int] = {}  # seq at the committed offset, when known
        self._closers: list[threading.Thread] = []
        self._high: dict[str, int] = {}  # per backend: records queued before its reader waits
        self._finish: str | None = None  # the run's end: each worker closes once caught up
        self._closed: set[str] = set()  # backends whose close has started
        self._session = spec.session
        self._prefix = spec.session + ":"  # the event id is `{session}:{seq}` (event_id)
        # what the readers' screens know of this file: the key sets of the last checked step
        # row and rank record, and every key of checked step rows (see untrusted.screen)
        self._shapes: list[frozenset[str] | None] = [None, None]
        self._row_keys: set[str] = set()
        self._max_line = MAX_LINE
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
            size = int(getattr(backend, "batch", 100)) if journal is not None else 100
            # two batches: one in flight while the reader fills the next
            self._high[name] = max(HIGH_WATER, 2 * size)
            self._workers[name] = BackendWorker(
                backend, identity, rank_metrics=spec.backend_rank_metrics, journal=journal,
                # a new batch is one POST, so its journal entry is its key
                batch=size, max_queue=2 * self._high[name], pulled=True)
            self.committed[name] = int(offsets.get(name, 0))
            self._read[name] = (self.committed[name], None)
            self._marks[name] = deque()

    @property
    def active(self) -> bool:
        return bool(self._workers)

    def workers(self) -> list[Any]:
        """The workers, for the run's pipeline: its alerts reach them; its records do not
        (each worker's own reader sends them, see `pump`)."""
        return list(self._workers.values())

    def behind(self, upto: int) -> bool:
        """True while some backend's reader has not got to `upto` (the shard's offset)
        or a finished run's backend has not closed yet."""
        if any(off < upto for off, _ in self._read.values()):
            return True
        return self.closing()

    def progressed(self) -> int:
        """A number that grows while some backend makes progress (records done, closes)."""
        return sum(w.progress()[1] for w in self._workers.values()) + len(self._closed)

    def pump(self, path: Path, upto: int) -> bool:
        """Read spool lines before `upto` into each backend with room in its queue;
        True if a reader moved and is still behind (more now), False if it waits."""
        more = False
        for name, worker in self._workers.items():
            off, seq = self._read[name]
            room = self._high[name] - worker.backlog()
            if off < upto and room > 0:
                off, seq = self._feed(worker, path, off, seq, upto, room)
                if (off, seq) != self._read[name]:
                    self._read[name] = (off, seq)
                    self._mark(name, worker, off, seq)
                    more = more or off < upto
        if self._finish is not None:
            self._close_caught_up(upto)
        return more

    def _feed(self, worker: Any, path: Path, off: int, seq: int | None, upto: int,
              room: int) -> tuple[int, int | None]:
        """Submit up to `room` records of the lines in [off, upto); the new (off, seq)."""
        batch: list[dict[str, Any]] = []
        reader = SpoolReader(path)
        last = -1 if seq is None else seq
        try:
            for pos, parts, big_end in reader.chunks(off, min(READ_BUDGET, upto - off)):
                if big_end is not None:
                    off = big_end  # an oversize line: the shard consumer quarantines it
                    continue
                # the lines that end by `upto`, at most as many as there is room for
                ends = list(accumulate(map(_PLUS_ONE, map(len, parts)), initial=pos))
                k = min(bisect_right(ends, upto, 1) - 1, room - len(batch))
                if k <= 0:
                    return off, seq
                last = self._block(parts[:k], last, batch)
                off, seq = ends[k], (last if last >= 0 else seq)
                if k < len(parts) or len(batch) >= room:
                    return off, seq
        except OSError as exc:
            log.warning("backend reader: cannot read %s: %s", path, exc.strerror or exc)
        finally:
            if batch:
                worker.submit_many(batch)
        return off, seq

    def _block(self, parts: list[bytes], last: int, batch: list[dict[str, Any]]) -> int:
        """Add the records of complete lines `parts` that come after seq `last` to `batch`;
        the seq of the last line read (`last` if none).

        A clean run of records whose keys passed the full check before (step rows) or
        whose key set did (rank records) is taken at once, with no Python per record
        (untrusted.screen_block, numbered, rank_run: the shard consumer's own screens);
        anything else line by line (`_line`), which also learns the file's checked keys:
        a file's first block goes line by line for a few lines, then at once."""
        recs, clean = screen_block(parts, self._max_line)
        n, i, tries = len(parts), 0, 2
        while i < n:
            stop = n
            if clean and recs is not None and tries:
                tries -= 1
                lo, hi = i, n
                # the file's init and finish lines at the ends go line by line
                while lo < hi and parts[lo].startswith(b'{"_event"'):
                    lo += 1
                while hi > lo and parts[hi - 1].startswith(b'{"_event"'):
                    hi -= 1
                for j in range(i, lo):
                    last = self._line(parts[j], recs[j], last, batch)
                i = lo
                if hi > lo and self._plain(parts[lo:hi], recs[lo:hi], last):
                    last = self._run(parts[lo:hi], recs[lo:hi], batch)
                    i = hi
                    continue
                stop = min(n, i + 8)  # enough for the shapes to be learnt, then again
            for j in range(i, stop):
                last = self._line(parts[j], None if recs is None else recs[j], last, batch)
            i = stop
        return last

    def _run(self, lines: list[bytes], rows: list[dict[str, Any]],
             batch: list[dict[str, Any]]) -> int:
        """Take a run `_plain` passed: each record with its event id; its last seq."""
        search = _NONFINITE.search
        data = b"\n".join(lines)
        # two quotes per key (a clean run has a colon per key): no text value, no "NaN"
        if data.count(34) != 2 * sum(map(len, rows)) and search(data) is not None:
            for line, ev in zip(lines, rows, strict=True):
                if search(line) is not None:
                    _decode_nonfinite(ev)
        first = rows[0]["_seq"]  # numbered: first, first + 1, ...
        seqs = range(first, first + len(rows))
        list(map(setitem, rows, repeat("_id"), map(self._prefix.__add__, map(str, seqs))))
        batch += rows
        return int(seqs[-1])

    def _plain(self, parts: list[bytes], recs: list[Any], last: int) -> bool:
        """Every record of a clean block's run passes the screen: numbered on from after
        `last`, each a step row of checked keys or a rank record of the checked shape."""
        first = recs[0].get("_seq") if recs[0].__class__ is dict else None
        if first.__class__ is not int or first <= last or not numbered(parts, recs, first):
            return False
        keys, ranks = self._row_keys, self._shapes[1]
        if keys and keys.issuperset(set().union(*recs)):
            return True  # step rows only (see tailer._masks)
        mask = list(map(keys.issuperset, recs)) if keys else [False] * len(recs)
        if all(mask):
            return True
        if ranks is None:
            return False
        others = list(compress(recs, map(not_, mask)))
        return all(map(eq, repeat(ranks), map(dict.keys, others))) and rank_run(others, ranks)

    def _line(self, line: bytes, ev: Any, last: int, batch: list[dict[str, Any]]) -> int:
        """One line (`ev` its parse, None if not parsed yet): its record added to `batch`
        if it is one a backend gets; the seq of the last line read."""
        if ev is None:
            if len(line) > self._max_line:
                return last
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                return last  # the shard consumer quarantines it
        if ev.__class__ is not dict:
            return last
        at = ev.get("_seq")
        if at.__class__ is not int or at <= last:
            return last
        if "_event" in ev or ev.get("_kind", "rank") != "rank":
            return at  # init, finish, rules; alerts reach backends from the pipeline
        if "_sid" in ev:
            del ev["_sid"]
        shapes = self._shapes
        if not screen(ev, line, shapes):
            try:
                check_record(ev)  # a bad record: the shard consumer quarantines it
            except (TypeError, ValueError):
                return at
            rank = "_kind" in ev
            shapes[rank] = frozenset(ev)
            if not rank:
                self._row_keys.update(ev)
                self._row_keys.discard("_rank")  # its value is for the full check
        if _NONFINITE.search(line) is not None:
            _decode_nonfinite(ev)
        ev["_id"] = self._prefix + str(at)
        batch.append(ev)
        return at

    def _mark(self, name: str, worker: Any, offset: int, seq: int | None) -> None:
        """The reader of `name` submitted everything before `offset`: remember the point."""
        queued, _ = worker.progress()
        marks = self._marks[name]
        mark = (queued, offset, seq)
        if len(marks) >= MAX_MARKS:
            marks[-1] = mark  # coarser, never wrong: a later point needs more done
        else:
            marks.append(mark)

    def settle(self, offset: int, seq: int | None = None) -> None:
        """Advance each backend's checkpoint to the latest point its reader got to that
        the backend has done with (never past `offset`, the shard's checkpoint)."""
        for name, worker in self._workers.items():
            _, done = worker.progress()
            marks = self._marks[name]
            while marks and marks[0][0] <= done and marks[0][1] <= offset:
                _, off, at = marks.popleft()
                if off >= self.committed[name]:
                    self.committed[name] = off
                    if at is not None:
                        self._settled[name] = at

    def marks(self) -> dict[str, int]:
        """Per backend, the seq at its committed offset: what a checkpoint taken now holds."""
        return dict(self._settled)

    def checkpointed(self, settled: dict[str, int] | None = None) -> None:
        """The checkpoint holding `committed` (or `settled`, from `marks` when that
        checkpoint was taken) is on disk: journals forget the batches before it (they are
        never submitted again)."""
        if settled is None:
            settled = self._settled
        for name, worker in self._workers.items():
            seq = settled.get(name)
            if worker.journal is None or seq is None:
                continue
            try:
                worker.journal.compact(seq)
            except OSError as exc:
                log.warning("cannot compact batch journal %s: %s", worker.journal.path,
                            exc.strerror or exc)

    def stats(self) -> dict[str, Any]:
        return {name: w.stats() for name, w in self._workers.items()}

    def finish(self, status: str) -> None:
        """The run ended with `status`: each backend is finished once its reader has read
        the whole file and the backend has done with every record (see `pump`)."""
        if self._finish is None:
            self._finish = status

    def _close_caught_up(self, upto: int) -> None:
        for name in list(self._workers):
            worker = self._workers[name]
            queued, done = worker.progress()
            if self._read[name][0] >= upto and done >= queued:
                self._start_close(name, self._finish or "finished", 30.0)

    def _start_close(self, name: str, status: str, timeout: float) -> None:
        if name in self._closed:
            return
        self._closed.add(name)
        worker = self._workers[name]
        t = threading.Thread(target=worker.close, args=(timeout, status),
                             name="exprd-backend-close", daemon=True)
        t.start()
        self._closers.append(t)

    def closing(self) -> bool:
        """True while a finished run's backend is still catching up or finishing."""
        if self._finish is not None and len(self._closed) < len(self._workers):
            return True
        return any(t.is_alive() for t in self._closers)

    def close(self, status: str, timeout: float = 30.0) -> None:
        """Drain and finish every backend on background threads (never blocks the loop):
        exprd stopping. What a reader has not read yet stays behind its checkpoint."""
        for name in self._workers:
            self._start_close(name, status, timeout)

    def join(self, timeout: float) -> None:
        """Wait for the closing threads (at shutdown)."""
        for t in self._closers:
            t.join(timeout)
