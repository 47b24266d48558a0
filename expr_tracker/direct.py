"""The direct-mode sink: the training process applies its own records through the pipeline."""

from __future__ import annotations

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
from expr_tracker.store.logmark import LogMark, read_mark
from expr_tracker.store.shard import ShardWriter

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
        self.writer = ShardWriter(
            run.paths,
            run.identity(),
            shared=not run.rank_aware,
            # with rank_aware=False every rank appends to one file; rank 0 keeps its sidecar
            write_sidecar=run.rank_aware or run.rank == 0,
            warn=run.warn_once,
            dropped=run.dropped,
            exclusive=True,  # one writer per shard (DESIGN 5); per rank in a shared file
            own_rank=run.rank,  # a shared file resumes after this rank's own rows
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
        if run.rank_aware:
            self._gap(read_mark(self.writer.open_file, run.paths.shard.name), cursor.last_step)
            self._mark = LogMark(self.writer.open_file, run.paths.shard.name)
            self.mark = self._mark.mark
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
        if self.alerting and (run.alert_config is not None or run.ruleset is not None):
            self.pipeline.dispatcher = self._dispatcher()
        self._span_buf = bytearray()  # trace lines waiting for the next flush
        self.fast_append: Any = None
        self.after_write: Any = None
        self._update_fast_path()

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
        self.writer.flush()
        if self.writer.notes_new:  # a key went non-finite: the watchers learn it now
            self.writer.write_sidecar()
        self._flush_spans()

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

    def set_summary(self, summary: dict[str, Any]) -> None:
        """`Run.finish`: the final sidecar carries the run's summary."""
        self.writer.identity["summary"] = summary

    def close(self, status: str, exit: dict[str, Any] | None = None) -> None:
        """Finish the shard with `status`; `exit` is the crash's {type, message, time}."""
        self.writer.exit = exit
        self.writer.probe = None
        self._flush_spans()
        # backends such as wandb need seconds to start and sync; finish waits for them,
        # within a bound, so the end of a run does not lose its last rows
        self.pipeline.close(status, timeout=FINISH_TIMEOUT)
        self.mark = None
        if self._mark is not None:
            self._mark.close()

    def detach(self) -> None:
        # a forked child shares the parent's descriptor: forget the buffer, never flush it
        self.writer._buf.clear()
        self.writer._pending = b""
        self._span_buf.clear()
        self.mark = None  # the parent's mark, never this child's
        self.writer.forget_lock()

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
