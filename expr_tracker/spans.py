"""Spans (DESIGN 17): where the time of a step goes.

    with et.span("forward"):        # a context manager, sync or `async with`
        ...
    @et.span("data")                # a decorator, on sync and async functions
    def load(): ...
    epoch = et.start_span("epoch")  # started here, ended anywhere
    epoch.end()

A closed span adds its duration in milliseconds to the open row as `time_ms/<path>`
(nested names join with `/`, repeated spans in one step sum; `span_count=True` adds
`count/<path>`). A span never commits a step.

The cost budget is about 1 us per span in the training process, so the hot path takes
no lock: closing a span appends one `(path, ns)` tuple to a list (a single operation
under the GIL, like the shard writer's buffer), and `Run` drains that list into the
row it commits (`drain`). Each thread keeps the path of its innermost open span in a
small object that a registry (thread id -> object) lets the probe thread read for the
main thread (section 13). Nesting is per thread: asyncio tasks that interleave in one
thread share that thread's nesting (a span's parent is whatever span that thread has
open when it starts).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from time import perf_counter_ns as _ns
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

MAX_NAME = 100
_get_ident = threading.get_ident


class _Thread:
    """One thread's innermost open span, as its key `time_ms/<path>` ("" when none is
    open): the key is what both the next nested span and the row need. `open`: the
    thread's open spans, outermost first, so that a span closed out of order (around a
    generator's `yield`, or interleaved asyncio tasks) is taken out wherever it is and
    later spans nest under what is still open, not under it for good."""

    __slots__ = ("__weakref__", "open", "top")

    def __init__(self) -> None:
        self.top = ""
        self.open: list[Span] = []


_local = threading.local()
# thread id -> that thread's _Thread; an entry goes when its thread ends (threading.local
# drops the thread's objects then, and the registry only holds weak references)
_threads: weakref.WeakValueDictionary[int, _Thread] = weakref.WeakValueDictionary()


def _thread_state() -> _Thread:
    state = _Thread()
    _local.state = state
    _threads[_get_ident()] = state
    return state


class Sink:
    """Where closed spans go while a run is active (set by `Run`, see `activate`).

    `pending`: (time_ms key, ns) of spans closed since the last committed row, drained by
    `drain`. `trace` (with `trace_spans=True`): (path, start ns, ns, step, thread id) of
    every closed span, written by the run's background thread. `run`: the open step is
    `run._step`. `folded`: key -> [ns, count] of spans `fold` took out of a long
    `pending` (a program that closes spans for minutes without logging a row).
    """

    __slots__ = ("count", "folded", "pending", "run", "trace")

    def __init__(self, run: Any, count: bool, trace: bool) -> None:
        self.run = run
        self.count = count
        self.pending: list[tuple[str, int]] = []
        self.folded: dict[str, list[int]] = {}
        self.trace: list[tuple[str, int, int, int, int]] | None = [] if trace else None


_sink: Sink | None = None
_names: set[str] = set()  # names already checked


def activate(sink: Sink | None) -> None:
    """Make `sink` receive closed spans (None: spans are no-ops again)."""
    global _sink
    _sink = sink


def deactivate(sink: Sink) -> None:
    """Stop sending spans to `sink` if it is still the active one."""
    global _sink
    if _sink is sink:
        _sink = None


def check_name(name: object) -> str:
    """A span name: a non-empty str without '/' (nesting makes the paths), not '_'-led."""
    if not isinstance(name, str):
        raise TypeError(f"span name must be a str, got {type(name).__name__}")
    if not name or len(name) > MAX_NAME:
        raise ValueError(f"span name must be 1 to {MAX_NAME} characters, got {name!r}")
    if "/" in name:
        raise ValueError(f"span name {name!r} must not contain '/': nested spans join their names")
    if name[0] == "_" or not name.isprintable():
        raise ValueError(f"span name {name!r} must not start with '_' or hold control characters")
    _names.add(name)
    return name


PREFIX = "time_ms/"
_CUT = len(PREFIX)
# parent key -> name -> key (`time_ms/<parent path>/<name>`): a span's key is looked up,
# not built, on the hot path (bounded: a program has few distinct span paths)
_joined: dict[str, dict[str, str]] = {}
MAX_PATHS = 100_000


def _join(parent: str, name: str) -> str:
    key = f"{parent}/{name}" if parent else PREFIX + name
    if len(_joined) < MAX_PATHS:
        _joined.setdefault(parent, {})[name] = key
    return key


def _closed(key: str, start: int, dur: int) -> None:
    sink = _sink
    if sink is not None:
        sink.pending.append((key, dur))
        trace = sink.trace
        if trace is not None:
            trace.append((key, start, dur, sink.run._step, _get_ident()))


class Span:
    """A span as a context manager (sync or async) or a decorator; see the module docs.

    One object is one use as a context manager (`with et.span("x")` makes a new one
    each time; entering one object twice before it exits mixes up its timing); as a
    decorator it opens a fresh span per call, so recursion and threads are fine.
    """

    __slots__ = ("_key", "_start", "_state", "name")

    def __init__(self, name: str) -> None:
        if name.__class__ is not str or name not in _names:
            check_name(name)
        self.name = name

    def __enter__(self) -> Span:
        try:
            state = _local.state
        except AttributeError:
            state = _thread_state()
        parent = state.top
        try:
            self._key = state.top = _joined[parent][self.name]
        except KeyError:
            self._key = state.top = _join(parent, self.name)
        self._state = state
        state.open.append(self)
        self._start = _ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        end = _ns()
        state = self._state
        spans = state.open
        if spans and spans[-1] is self:
            spans.pop()
            state.top = spans[-1]._key if spans else ""
        else:
            _close_out_of_order(state, self)
        sink = _sink
        if sink is not None:  # inline _closed: this is the hot path
            start = self._start
            sink.pending.append((self._key, end - start))
            trace = sink.trace
            if trace is not None:
                trace.append((self._key, start, end - start, sink.run._step, _get_ident()))

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        """Decorate `fn` (sync or async): each call runs inside a span of this name."""
        import inspect  # here: importing it costs `import expr_tracker` milliseconds

        name = self.name
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async with Span(name):
                    return await fn(*args, **kwargs)

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with Span(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]


span = Span


def _close_out_of_order(state: _Thread, done: Span) -> None:
    """`done` exits while a span it encloses is still open (or it was never on the stack):
    it leaves the stack wherever it is; the innermost span still open stays the parent."""
    spans = state.open
    for i in range(len(spans) - 1, -1, -1):
        if spans[i] is done:
            del spans[i]
            break
    state.top = spans[-1]._key if spans else ""


class StartedSpan:
    """A span from `start_span`: open until `.end()` (once; later calls do nothing).

    Its path nests under the span open where it started; it is not itself the parent
    of spans opened after it (it may end in any order, on any thread).
    """

    __slots__ = ("_start", "key")

    def __init__(self, name: str) -> None:
        if name.__class__ is not str or name not in _names:
            check_name(name)
        try:
            parent = _local.state.top
        except AttributeError:
            parent = ""
        try:
            self.key = _joined[parent][name]
        except KeyError:
            self.key = _join(parent, name)
        self._start = _ns()

    @property
    def path(self) -> str:
        """`epoch`, `eval/batch`: the span's path."""
        return self.key[_CUT:]

    def end(self) -> None:
        """Close the span: its duration goes to the open row (and the trace)."""
        start = self._start
        if start:
            self._start = 0
            _closed(self.key, start, _ns() - start)


def start_span(name: str) -> StartedSpan:
    """Start a span that `.end()` closes (an epoch, a phase crossing functions)."""
    return StartedSpan(name)


def open_path(ident: int | None = None) -> str:
    """The innermost open span path of thread `ident` (default: the main thread)."""
    if ident is None:
        ident = threading.main_thread().ident or 0
    state = _threads.get(ident)
    return state.top[_CUT:] if state is not None else ""


def open_spans(ident: int | None = None) -> list[str]:
    """The open span paths of a thread, outermost first: ["data", "data/load"]."""
    path = open_path(ident)
    if not path:
        return []
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


_count_keys: dict[str, str] = {}  # time_ms/<path> -> count/<path>


def _drain_more(sink: Sink, record: dict[str, Any], items: list[tuple[str, int]]) -> None:
    """`drain` for span_count=True and for spans `fold` took out of `pending`."""
    counts: dict[str, int] = {}
    for key, _ in items:
        counts[key] = counts.get(key, 0) + 1
    if sink.folded:  # `fold` left its marker ("", 0) in `pending`
        for key, (ns, n) in sink.folded.items():
            record[key] = record.get(key, 0.0) + ns / 1e6
            counts[key] = counts.get(key, 0) + n
        sink.folded = {}
    record.pop("", None)
    counts.pop("", None)
    if sink.count:
        for key, n in counts.items():
            ckey = _count_keys.get(key)
            if ckey is None:
                ckey = _count_keys[key] = "count/" + key[_CUT:]
            record[ckey] = n


def drain(sink: Sink, record: dict[str, Any]) -> None:
    """Move the spans closed since the last row into `record` (summed per path, in ms).

    Called by `Run` under its lock when it commits a row; a span closing on another
    thread meanwhile lands in the next row (the list is taken and cut in two single
    operations, so nothing is lost or counted twice). A `time_ms/...` key the row
    already holds as a number is added to; one holding anything else is replaced.
    """
    pending = sink.pending
    items = pending[:]
    del pending[: len(items)]
    get = record.get
    try:
        for key, dur in items:
            record[key] = get(key, 0.0) + dur / 1e6
    except TypeError:  # the caller logged a non-number under a span's key
        for key, _ in items:
            record.pop(key, None)
        for key, dur in items:
            record[key] = get(key, 0.0) + dur / 1e6
    if sink.count or sink.folded:
        _drain_more(sink, record, items)


FOLD_AT = 4096  # pending spans the background thread folds into `Sink.folded`
MAX_TRACE = 1 << 20  # traced spans kept for the background thread; beyond, counted


def fold(sink: Sink) -> None:
    """Sum a long `pending` into `folded` (memory stays bounded however long no row is
    logged). The caller holds the run's lock, so `drain` cannot run meanwhile; a marker
    ("", 0) stays in `pending`, so the next commit drains what was folded."""
    pending = sink.pending
    items = pending[:]
    del pending[: len(items)]
    folded = sink.folded
    for key, dur in items:
        if key:
            entry = folded.get(key)
            if entry is None:
                folded[key] = [dur, 1]
            else:
                entry[0] += dur
                entry[1] += 1
    if folded:
        pending.append(("", 0))


def take_trace(sink: Sink) -> list[tuple[str, int, int, int, int]]:
    """The traced spans closed since the last call (for the background writer)."""
    trace = sink.trace
    if not trace:
        return []
    items = trace[:]
    del trace[: len(items)]
    if len(items) > MAX_TRACE:  # the thread could not keep up (a stuck disk): keep the newest
        sink.run._count("spans_trace", len(items) - MAX_TRACE)
        del items[: len(items) - MAX_TRACE]
    return items


# perf_counter_ns -> epoch seconds, for trace lines (taken once: both clocks tick alike
# over a run, and the trace only needs to line ranks up to within clock skew)
_EPOCH_NS = time.time_ns() - _ns()


def epoch_of(ns: int) -> float:
    """The epoch time (s) of a perf_counter_ns reading."""
    return (ns + _EPOCH_NS) / 1e9
