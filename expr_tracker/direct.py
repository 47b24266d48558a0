"""The direct-mode sink: the training process applies its own records through the pipeline."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Any

import orjson

from expr_tracker.context import RunContext
from expr_tracker.errors import UsageError
from expr_tracker.pipeline import Pipeline
from expr_tracker.store.cursor import read_sidecar
from expr_tracker.store.layout import spans_name
from expr_tracker.store.lock import ShardBusyError
from expr_tracker.store.logmark import LogMark, local_path, mark_name, read_local, read_mark
from expr_tracker.store.queued import QueuedWriter
from expr_tracker.store.reader import last_values

# finish() waits at most this long for the shard (its rows, then the sidecar), then for
# alert delivery and backends within what is left of it (docs/getting-started.md)
FINISH_TIMEOUT = 30.0
MAX_SPAN_BUFFER = 16 * 1024 * 1024  # trace lines kept while their file cannot be written


def _queue(backend: Any) -> dict[str, Any]:
    """A backend's own bounds for its direct-mode worker (the team store: a queue bounded
    in MB, records sent in its own batch size, told its close deadline), else the defaults."""
    out: dict[str, Any] = {}
    mb = getattr(backend, "queue_mb", None)
    if isinstance(mb, (int, float)) and mb > 0:
        out["max_bytes"] = max(int(mb * 2**20), 1)
        out["max_queue"] = 2**62  # the bytes bound it, not a record count
    batch = getattr(backend, "batch", None)
    if type(batch) is int and batch >= 1:
        out["batch"] = batch
    if callable(getattr(backend, "close_by", None)):
        out["bounded_exit"] = True
    return out


class DirectSink:
    """Writes the process's shard, evaluates its rules, delivers alerts and feeds backends."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.seq = None  # direct mode does not number records (spool events do)
        self.alerting = run.alerting
        # every file operation after init runs on the writer's thread, never log()'s: a hung
        # run root costs counted rows, not step time (DESIGN 6)
        self.writer = QueuedWriter(
            run.paths,
            run.identity(),
            shared=not run.rank_aware,
            # with rank_aware=False every rank appends to one file; rank 0 keeps its sidecar
            write_sidecar=run.rank_aware or run.rank == 0,
            warn=run.warn_once,
            dropped=run.dropped,
            exclusive=True,  # one writer per shard (DESIGN 5); per rank in a shared file
            own_rank=run.rank,  # a shared file resumes after this rank's own rows
            session=run.session,
        )
        try:
            cursor = self.writer.open()
        except ShardBusyError as exc:
            raise UsageError(str(exc)) from None
        self.rows = cursor.rows
        self.last_step = cursor.last_step
        self.next_step = 0 if cursor.last_step is None else cursor.last_step + 1
        self.mark: Any = None  # log()'s hot path stores each step it commits (`logmark`)
        self._mark: LogMark | None = None
        self._mark_fd: int | None = None  # the mark beside the shard, copied by the writer
        if run.rank_aware:
            self._open_mark(cursor.last_step)
        self.writer.write_sidecar()
        backends = self._backends()
        self.reporting = bool(backends)
        self.pipeline = Pipeline(
            self.writer,
            run.identity(),
            rules=run.ruleset,
            dispatcher=None,
            backends=backends,
            alerting=self.alerting,
            reporting=self.reporting,
            warn=run.warn_once,
        )
        self.pipeline.append_alert = self.writer.append_file  # on the writer thread too
        if self.alerting and (run.alert_config is not None or run.ruleset is not None):
            self.pipeline.dispatcher = self._dispatcher()
        self._span_buf = bytearray()  # trace lines waiting for the next flush
        self.fast_append: Any = None
        self.after_write: Any = None
        self._update_fast_path()
        self._summary_read = True  # last_values() read the shard (not: the root hung)
        self.writer.start()

    def _open_mark(self, last: int | None) -> None:
        """The step mark (`logmark`): node-local, mapped for the hot path; the one beside the
        shard is opened for the writer thread to copy it into at each flush."""
        run = self.run
        try:
            inode = os.stat(run.paths.shard).st_ino
        except OSError:
            inode = 0
        local = local_path(run.spool_root, run.paths.shard)
        marks = [m for m in (read_mark(self.writer.open_file, run.paths.shard.name),
                             read_local(local, inode)) if m is not None]
        self._gap(max(marks) if marks else None, last)
        self._mark = LogMark(local, inode)
        self.mark = self._mark.mark
        try:
            self._mark_fd = self.writer.open_file(mark_name(run.paths.shard.name),
                                                  os.O_RDWR | os.O_CREAT)
        except OSError:
            return  # copied nowhere: a session on another node does not see the step
        self.writer.on_drain = self._copy_mark

    def _copy_mark(self) -> None:
        """(The writer thread, after each write of rows.)"""
        if self._mark is not None and self._mark_fd is not None:
            try:
                self._mark.copy_to(self._mark_fd)
            except OSError:
                self.writer.errors["mark"] = self.writer.errors.get("mark", 0) + 1

    def _close_mark(self) -> None:
        """(The writer thread, at finish.) The last copy; the node-local mark goes once
        every row is written (else the next session here says which were not)."""
        mark = self._mark
        if mark is None:
            return
        self._copy_mark()
        if self._mark_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._mark_fd)
            self._mark_fd = None
        self._mark = None
        mark.close(remove=self.writer.unwritten() == 0)

    def _gap(self, logged: int | None, last: int | None) -> None:
        """The previous session logged steps its shard does not hold: it was killed between
        two flushes. Said on stderr and kept in the sidecar (DESIGN 6)."""
        if logged is None or (last is not None and logged <= last):
            return
        first = 0 if last is None else last + 1
        self.writer.spool_dropped = [*self.writer.spool_dropped, {
            "cause": "killed", "session": str((read_sidecar(self.run.paths.sidecar) or {})
                                               .get("session")),
            "from": first, "to": logged, "rows": logged - first + 1, "since": time.time(),
            "host": socket.gethostname()}][-64:]
        print(f"expr_tracker: steps {first}-{logged} of {self.run.paths.shard} were not "
              "written: the process that logged them was killed before its flush",
              file=sys.stderr, flush=True)

    def _update_fast_path(self) -> None:
        """Run.log may append lines straight to the writer when nothing else must see them."""
        rules = self.pipeline.rules
        idle = (rules is None or not rules.rules) and not self.pipeline.backends
        # rank_aware=False rows carry `_rank`, which the hot path does not add
        self.fast_append = self.writer.queue if self.run.rank_aware else None
        # what must see a record after it is queued (rules, backends), or None
        self.after_write = None if idle else self.pipeline.after_write

    def _dispatcher(self) -> Any:
        from expr_tracker.alerts import Dispatcher, load_config

        cfg = self.run.alert_config if self.run.alert_config is not None else load_config(None)
        return Dispatcher.from_config(cfg)

    def _backends(self) -> list[Any]:
        if not self.run.backend_objs:
            return []
        from expr_tracker.backends.base import Identity, reports_on_rank
        from expr_tracker.backends.worker import BackendWorker

        run = self.run
        mine = [b for b in run.backend_objs
                if reports_on_rank(run.backend_on_rank, run.rank, getattr(b, "every_rank", False))]
        if not mine:
            return []
        ident = Identity(
            project=run.project, name=run.name, stream=run.stream, rank=run.rank,
            world_size=run.world_size, config=run.config, dir="",  # backends use their own dirs (WANDB_DIR)
            session=run.session, start=time.time(),
        )
        return [BackendWorker(b, ident, rank_metrics=run.backend_rank_metrics, **_queue(b))
                for b in mine]

    # -- the sink interface used by Run ---------------------------------------
    def apply(self, record: dict[str, Any], nonfinite: bool | None) -> None:
        self.pipeline.apply(record, nonfinite)
        if self.mark is not None and "_kind" not in record:
            self.mark[0] = max(self.mark[0], record["_step"])

    def alert(self, title: str, text: str, level: str) -> None:
        if self.alerting and self.pipeline.dispatcher is None:
            self.pipeline.dispatcher = self._dispatcher()
        self.pipeline.manual_alert(title, text, level)

    def rules_changed(self, ruleset: Any) -> None:
        self.run.ruleset = ruleset
        self.pipeline.rules = ruleset
        self._update_fast_path()
        if self.alerting and self.pipeline.dispatcher is None:
            self.pipeline.dispatcher = self._dispatcher()

    def config_changed(self, config: dict[str, Any]) -> None:
        """`Run.update_config`: the next sidecar write carries `config` (backends keep the
        config they were opened with)."""
        self.run.config = config
        self.writer.identity["config"] = config

    def set_probe(self, probe: dict[str, Any] | None) -> None:
        """Where the silent process is (None: it logs again); in the next sidecar write."""
        self.writer.probe = probe

    def spans(self, lines: list[dict[str, Any]]) -> None:
        """Traced spans (`trace_spans=True`), written to `spans[.rankN].jsonl` at the flush."""
        self._span_buf += b"".join(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
                                   for line in lines)

    def flush(self) -> None:
        """Write what is buffered: waits until it is written, or until the root is seen hung."""
        self._flush_spans()
        self.writer.flush()

    def _flush_spans(self) -> None:
        if self._span_buf:
            data = bytes(self._span_buf)
            if self.writer.append_file(spans_name(self.run.rank), data):
                del self._span_buf[: len(data)]
            elif len(self._span_buf) > MAX_SPAN_BUFFER:
                self.run.dropped["spans"] = self.run.dropped.get("spans", 0) + data.count(b"\n")
                del self._span_buf[: len(data)]

    def tick(self) -> None:
        self.pipeline.tick()

    def checkpoint(self) -> None:
        self.writer.write_sidecar()

    def last_values(self) -> dict[str, Any]:
        """The last value of each key, read from the shard's tail on the writer thread after
        the rows queued now; {} if the root hangs (`set_summary` reads them later)."""
        found = self.writer.call(self._read_last_values, None)
        self._summary_read = found is not None
        return found or {}

    def _read_last_values(self) -> dict[str, Any]:
        try:
            return last_values(self.run.paths.shard)
        except OSError:
            return {}

    def set_summary(self, summary: dict[str, Any]) -> None:
        """`Run.finish`: the final sidecar carries the run's summary."""
        self.writer.identity["summary"] = summary
        if not self._summary_read:  # the root hung: the writer reads them when it answers
            identity = self.writer.identity
            self.writer.call(lambda: identity.__setitem__(
                "summary", {**self._read_last_values(), **summary}), None, wait=False)

    def close(self, status: str, exit: dict[str, Any] | None = None) -> None:
        """Finish the shard with `status`; `exit` is the crash's {type, message, time}."""
        self.writer.exit = exit
        self.writer.probe = None
        self._flush_spans()
        self.mark = None
        if self._mark is not None:
            self.writer.call(self._close_mark, None, wait=False)
        # at most FINISH_TIMEOUT for the shard (the rows left then are counted and warned
        # about: `finish_timeout`), the rest of it for alert delivery and backends: such as
        # wandb need seconds to start and sync, and the end of a run must not lose its rows
        start = time.monotonic()
        self.writer.close(status, flush_timeout=FINISH_TIMEOUT)
        self.writer.say()
        self.pipeline.drain(max(0.1, FINISH_TIMEOUT - (time.monotonic() - start)), status)

    def detach(self) -> None:
        # a forked child shares the parent's descriptor: forget the buffer, never flush it
        self.writer.detach()
        self._span_buf.clear()
        self.mark = None  # the parent's mark, never this child's

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "buffered_bytes": self.writer.buffered(),
            "errors": dict(self.writer.errors),
            "alerting": self.alerting,
            "reporting": self.reporting,
            "alerts_fired": dict(self.pipeline.alert_counts),
        }
        disp = self.pipeline.dispatcher
        out["alerts"] = disp.stats() if disp is not None else {}
        out["backends"] = {
            getattr(w.backend, "name", str(i)): w.stats() for i, w in enumerate(self.pipeline.backends)
        }
        return out
