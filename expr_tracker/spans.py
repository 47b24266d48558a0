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
import inspect
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
    """One thread's innermost open span path ("" when none is open)."""

    __slots__ = ("__weakref__", "top")

    def __init__(self) -> None:
        self.top = ""


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

    `pending`: (path, ns) of spans closed since the last committed row, drained by
    `drain`. `trace` (with `trace_spans=True`): (path, start ns, ns, step, thread id) of
    every closed span, written by the run's background thread. `run`: the open step is
    `run._step`.
    """

    __slots__ = ("count", "pending", "run", "trace")

    def __init__(self, run: Any, count: bool, trace: bool) -> None:
        self.run = run
        self.count = count
        self.pending: list[tuple[str, int]] = []
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


def _closed(path: str, start: int, dur: int) -> None:
    sink = _sink
    if sink is not None:
        sink.pending.append((path, dur))
        trace = sink.trace
        if trace is not None:
            trace.append((path, start, dur, sink.run._step, _get_ident()))


class Span:
    """A span as a context manager (sync or async) or a decorator; see the module docs.

    One object is one use as a context manager (`with et.span("x")` makes a new one
    each time); as a decorator it opens a fresh span per call, so recursion and
    threads are fine.
    """

    __slots__ = ("_cache_parent", "_cache_path", "_parent", "_path", "_start", "_state", "name")

    def __init__(self, name: str) -> None:
        if name.__class__ is not str or name not in _names:
            check_name(name)
        self.name = name
        self._cache_parent: str | None = None
        self._cache_path = ""
        self._start = 0

    def __enter__(self) -> Span:
        if self._start:
            raise RuntimeError(f"span {self.name!r} is already open; use a new et.span() per with block")
        try:
            state = _local.state
        except AttributeError:
            state = _thread_state()
        parent = state.top
        if parent is self._cache_parent:
            path = self._cache_path
        else:
            path = f"{parent}/{self.name}" if parent else self.name
            self._cache_parent, self._cache_path = parent, path
        self._parent, self._path, self._state = parent, path, state
        state.top = path
        self._start = _ns()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _ns()
        start = self._start
        self._start = 0
        self._state.top = self._parent
        sink = _sink
        if sink is not None:  # inline _closed: this is the hot path
            dur = end - start
            sink.pending.append((self._path, dur))
            trace = sink.trace
            if trace is not None:
                trace.append((self._path, start, dur, sink.run._step, _get_ident()))

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()

    def __call__(self, fn: F) -> F:
        """Decorate `fn` (sync or async): each call runs inside a span of this name."""
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


class StartedSpan:
    """A span from `start_span`: open until `.end()` (once; later calls do nothing).

    Its path nests under the span open where it started; it is not itself the parent
    of spans opened after it (it may end in any order, on any thread).
    """

    __slots__ = ("_start", "path")

    def __init__(self, name: str) -> None:
        if name.__class__ is not str or name not in _names:
            check_name(name)
        try:
            parent = _local.state.top
        except AttributeError:
            parent = ""
        self.path = f"{parent}/{name}" if parent else name
        self._start = _ns()

    def end(self) -> None:
        """Close the span: its duration goes to the open row (and the trace)."""
        start = self._start
        if start:
            self._start = 0
            _closed(self.path, start, _ns() - start)


def start_span(name: str) -> StartedSpan:
    """Start a span that `.end()` closes (an epoch, a phase crossing functions)."""
    return StartedSpan(name)


def open_path(ident: int | None = None) -> str:
    """The innermost open span path of thread `ident` (default: the main thread)."""
    if ident is None:
        ident = threading.main_thread().ident or 0
    state = _threads.get(ident)
    return state.top if state is not None else ""


def open_spans(ident: int | None = None) -> list[str]:
    """The open span paths of a thread, outermost first: ["data", "data/load"]."""
    path = open_path(ident)
    if not path:
        return []
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


_keys: dict[str, tuple[str, str]] = {}


def drain(sink: Sink, record: dict[str, Any]) -> None:
    """Move the spans closed since the last row into `record` (summed per path).

    Called by `Run` under its lock when it commits a row; a span closing on another
    thread meanwhile lands in the next row (the list is taken and cut in two single
    operations, so nothing is lost or counted twice).
    """
    pending = sink.pending
    n = len(pending)
    items = pending[:n]
    del pending[:n]
    totals: dict[str, int] = {}
    counts: dict[str, int] = {}
    for path, dur in items:
        totals[path] = totals.get(path, 0) + dur
        counts[path] = counts.get(path, 0) + 1
    for path, ns in totals.items():
        keys = _keys.get(path)
        if keys is None:
            keys = _keys[path] = (f"time_ms/{path}", f"count/{path}")
        record[keys[0]] = ns / 1e6
        if sink.count:
            record[keys[1]] = counts[path]


def take_trace(sink: Sink) -> list[tuple[str, int, int, int, int]]:
    """The traced spans closed since the last call (for the background writer)."""
    trace = sink.trace
    if not trace:
        return []
    n = len(trace)
    items = trace[:n]
    del trace[:n]
    return items


# perf_counter_ns -> epoch seconds, for trace lines (taken once: both clocks tick alike
# over a run, and the trace only needs to line ranks up to within clock skew)
_EPOCH_NS = time.time_ns() - _ns()


def epoch_of(ns: int) -> float:
    """The epoch time (s) of a perf_counter_ns reading."""
    return (ns + _EPOCH_NS) / 1e9
