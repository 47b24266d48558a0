"""`expr tail RUN`: the last rows of a shard, then new rows as they are written.

A watchdog observer on the run directory is only a wake-up hint; every 0.5 s the
shards are polled anyway (inotify can overflow, network filesystems send nothing).
Each shard is read from the offset after the last complete line already shown, so a
half-written line is never printed and nothing is printed twice. Read-only.

Like `tail -F`, a run (or rank) that does not exist yet is waited for. Ctrl-C ends a
follow with status 130, as coreutils tail does, and prints nothing more.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from expr_cli.errors import CLIError
from expr_cli.resolve import (
    DIR_OPT,
    JSON_OPT,
    METRICS_OPT,
    RUN_ARG,
    STREAM_OPT,
    RunRef,
    ShardRef,
    parse_metrics,
    parse_rank,
    pick_shard,
    resolve_run,
    root_dir,
    shards_of,
)
from expr_tracker.store import records

POLL = 0.5  # seconds between polls when no file event arrives
# --rank all: a new row is held until every rank's rows reached its step (ranks flush at
# their own times: printed as read, rows came up to 8 steps out of order, issue 54), or
# this long, so a rank that stopped or lags holds the others back no more
HOLD = 1.0
_BLOCK = 256 * 1024

Keep = Callable[[dict[str, Any]], "dict[str, Any] | None"]
T = TypeVar("T")


def make_filter(metrics: list[str] | None, rank_records: bool) -> Keep:
    """Which records tail shows, projected to `metrics` when given (like `select_rows`):
    step rows, and rank records with `rank_records` or when they hold a named metric (a
    key logged with `log_rank_metrics` is in no step row: `-m step_time` shows it)."""
    want = set(metrics) if metrics else None

    def keep(rec: dict[str, Any]) -> dict[str, Any] | None:
        kind = rec.get("_kind")
        if kind is not None and not (kind == "rank" and (rank_records or want is not None)):
            return None
        if want is None:
            return rec
        picked = {k: v for k, v in rec.items() if k in want}
        if not picked:
            return None
        return {**{k: v for k, v in rec.items() if k.startswith("_")}, **picked}

    return keep


class Follower:
    """One shard read forward from a byte offset, complete lines only."""

    def __init__(self, shard: ShardRef, keep: Keep) -> None:
        self.shard = shard
        self.keep = keep
        self.offset = 0
        self.garbage = 0

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            return self.keep(records.loads(line))
        except ValueError:
            self.garbage += 1
            return None

    def last(self, n: int) -> list[dict[str, Any]]:
        """The last `n` kept records; the offset moves to the end of the last complete line."""
        with open(self.shard.path, "rb") as fh:
            end = records.complete_end(fh, _BLOCK)  # only complete lines count
            self.offset = end
            out: list[dict[str, Any]] = []
            pos, carry = end, b""
            while pos > 0 and len(out) < n:
                start = max(0, pos - _BLOCK)
                fh.seek(start)
                lines = (fh.read(pos - start) + carry).split(b"\n")
                carry = lines[0] if start > 0 else b""
                for line in reversed(lines[1:] if start > 0 else lines):
                    rec = self._parse(line)
                    if rec is not None:
                        out.append(rec)
                        if len(out) >= n:
                            break
                pos = start
        out.reverse()
        return out

    def new(self) -> list[dict[str, Any]]:
        """Kept records of the complete lines written since the last call."""
        try:
            with open(self.shard.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:
                    self.offset = 0  # truncated or replaced: start over
                if size == self.offset:
                    return []
                fh.seek(self.offset)
                data = fh.read(size - self.offset)
        except FileNotFoundError:
            return []
        out = []
        for _, line in records.iter_lines(data):
            rec = self._parse(line)
            if rec is not None:
                out.append(rec)
        self.offset += data.rfind(b"\n") + 1
        return out


def _order(item: tuple[int, dict[str, Any]]) -> tuple[int, int]:
    rank, rec = item
    step = rec.get("_step")
    return (step if type(step) is int else -1, rank)


def _row_rank(follower: Follower, rec: dict[str, Any]) -> int:
    r = rec.get("_rank")
    return r if rec.get("_kind") == "rank" and type(r) is int else follower.shard.rank


class Tail:
    """The followers of one `expr tail` and how their rows are printed."""

    def __init__(self, ref: RunRef, shards: list[ShardRef], all_ranks: bool, stream: str | None,
                 metrics: list[str] | None, keep: Keep, json: bool = False) -> None:
        self.ref = ref
        self.json = json
        self.all_ranks = all_ranks
        self.stream = stream
        self.metrics = metrics
        self.keep = keep
        self.followers = {s.path.name: Follower(s, keep) for s in shards}
        self.warned = False
        self.held: list[tuple[float, int, dict[str, Any]]] = []  # (read at, rank, row)
        self.reached: dict[str, int] = {}  # follower -> the largest step of its rows read

    def emit(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        from expr_cli import render

        if self.all_ranks:
            batch.sort(key=_order)  # interleave ranks by step
        for rank, rec in batch:
            if self.json:
                # JSON lines for jq and scripts: the record as stored, plus its rank
                out = {k: v for k, v in rec.items() if k not in ("_sid", "_seq")}
                if self.all_ranks:
                    out["_rank"] = rank
                line = records.dumps(out)
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            else:
                render.tail_line(rec, rank if self.all_ranks else None, self.metrics)
        garbage = sum(f.garbage for f in self.followers.values())
        if garbage and not self.warned:
            self.warned = True
            render.warning(f"skipped {garbage} line{'s' if garbage != 1 else ''} that did not parse")

    def start(self, n: int) -> None:
        """Print the last `n` rows of each shard (of each rank with --rank all)."""
        batch = []
        for name, f in self.followers.items():
            rows = f.last(max(n, 1))
            self._reach(name, rows)
            batch += [(_row_rank(f, rec), rec) for rec in rows[-n:]] if n > 0 else []
        batch.sort(key=_order)
        self.emit(batch)

    def _reach(self, name: str, rows: list[dict[str, Any]]) -> None:
        steps = [s for rec in rows if type(s := rec.get("_step")) is int]
        if steps:
            self.reached[name] = max(self.reached.get(name, -1), *steps)

    def poll(self) -> None:
        """Print what was appended since the last poll; pick up shards of new ranks."""
        if self.all_ranks:
            try:
                for s in shards_of(self.ref, self.stream):
                    if s.path.name not in self.followers:
                        self.followers[s.path.name] = Follower(s, self.keep)
            except (CLIError, OSError):  # a run directory that vanished: keep what we have
                pass
        if not self.all_ranks:
            batch = [(_row_rank(f, rec), rec) for f in self.followers.values() for rec in f.new()]
            if batch:
                self.emit(batch)
            return
        now = time.monotonic()
        for name, f in list(self.followers.items()):
            rows = f.new()
            self._reach(name, rows)
            self.held += [(now, _row_rank(f, rec), rec) for rec in rows]
        if not self.held:
            return
        # the step every rank's rows reached (a rank with no row yet holds nothing back)
        upto = min(self.reached.values(), default=-1)
        out, keep = [], []
        for item in self.held:
            step = item[2].get("_step")
            if type(step) is not int or step <= upto or now - item[0] >= HOLD:
                out.append(item[1:])
            else:
                keep.append(item)
        self.held = keep
        if out:
            self.emit(out)

    def follow(self) -> None:
        """Poll until Ctrl-C, woken early by file events on the run directory."""
        wake = threading.Event()
        observer = _observe(str(self.ref.path), wake)
        try:
            while True:
                wake.wait(POLL)
                wake.clear()
                self.poll()
        finally:
            if observer is not None:
                observer.stop()
                observer.join(timeout=2)


def _observe(path: str, wake: threading.Event) -> Any:
    """A watchdog observer setting `wake` on any change in `path`; None if it cannot start."""
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    class Wake(FileSystemEventHandler):
        def on_any_event(self, event: Any) -> None:
            wake.set()

    observer = Observer()
    try:
        observer.schedule(Wake(), path, recursive=False)
        observer.start()
    except OSError:
        return None  # inotify limits and the like: polling alone still works
    return observer


def _exit_130(signum: int, frame: object) -> None:
    """Ctrl-C while following: what was printed stays whole, nothing else is printed."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(130)  # no interpreter shutdown: observer threads cannot print on their way out


def not_there_yet(exc: CLIError) -> bool:
    """A run, stream or rank that may still appear (the job has not started writing)."""
    msg = exc.message
    return msg.startswith("no run ") or " is empty: " in msg or " has no shard" in msg


def _find(run: str, dir: str | None, r: int | str | None,
          stream: str | None) -> tuple[RunRef, list[ShardRef], str | None]:
    ref = resolve_run(run, root_dir(dir))
    if r == "all":
        if stream is None and ref.shard is not None:
            stream = pick_shard(ref, None, None).stream
        return ref, shards_of(ref, stream), stream
    assert not isinstance(r, str)
    shards = [pick_shard(ref, stream, r)]
    return ref, shards, shards[0].stream


def wait_until_there(find: Callable[[], T], run: str, interval: float = POLL) -> T:
    """`find()`, retried every `interval` seconds while RUN is not there yet (said once):
    `expr tail --follow` and `expr watch` on a job that has not started writing."""
    from expr_cli import render

    said = False
    while True:
        try:
            return find()
        except CLIError as exc:
            if not not_there_yet(exc):
                raise
            if not said:
                said = True
                render.status(f"waiting for {run} to appear ({exc.message}); Ctrl-C to stop")
        time.sleep(interval)


def tail_command(run: str, dir: str | None, rank: str | None, stream: str | None,
                 metrics: list[str] | None, n: int, follow: bool, rank_records: bool,
                 json: bool = False) -> None:
    """Print the last `n` rows of RUN, then follow it until Ctrl-C (exit 130)."""
    from expr_cli import render

    r = parse_rank(rank, allow_all=True)
    wanted = parse_metrics(metrics)
    if follow and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_130)
    ref, shards, stream = (wait_until_there(lambda: _find(run, dir, r, stream), run) if follow
                           else _find(run, dir, r, stream))
    tail = Tail(ref, shards, r == "all", stream, wanted, make_filter(wanted, rank_records), json)
    try:
        tail.start(max(n, 0))
        if follow:
            what = "all ranks" if r == "all" else shards[0].path.name
            render.status(f"following {ref.label} ({what}); Ctrl-C to stop")
            tail.follow()
    except KeyboardInterrupt:
        pass  # a Ctrl-C under a test runner, which keeps its own SIGINT handler
    except BrokenPipeError:
        # the reader went away (`expr tail ... | head`): leave quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


_RANK_OPT = typer.Option(None, "--rank", "-r", show_default=False, metavar="RANK|all",
                         help="Rank to follow (default 0), or 'all' for every rank.")
_ROWS_OPT = typer.Option(10, "-n", "--rows",
                         help="How many of the last rows to print first (per rank with --rank all).")
_FOLLOW_OPT = typer.Option(True, "--follow/--no-follow", help="Keep printing new rows.")
_RANK_RECORDS_OPT = typer.Option(False, "--rank-records",
                                 help="Also show rank records (log_rank_metrics); with --metrics, "
                                      "those holding a named metric show anyway.")


def register(app: typer.Typer) -> None:
    """Add `expr tail`."""

    @app.command("tail", epilog="Example: expr tail sft-1 --rank all --metrics train/loss -n 20")
    def tail(
        run: str = RUN_ARG,
        rank: str | None = _RANK_OPT,
        stream: str | None = STREAM_OPT,
        metrics: list[str] | None = METRICS_OPT,
        n: int = _ROWS_OPT,
        follow: bool = _FOLLOW_OPT,
        rank_records: bool = _RANK_RECORDS_OPT,
        dir: str | None = DIR_OPT,
        json: bool = JSON_OPT,
    ) -> None:
        """The last rows of RUN, then new rows live as they are written; Ctrl-C stops (exit 130).

        Waits for a run that does not exist yet. With --rank all, the shards of every rank
        are interleaved by step, with a rank column, and -n counts per rank. Rank records
        (--rank-records) are marked [rank N]. --json prints each row as one JSON line (with
        `_rank` under --rank all).
        """
        tail_command(run, dir, rank, stream, metrics, n, follow, rank_records, json)
