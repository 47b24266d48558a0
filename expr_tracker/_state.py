"""The process's current run, the exit and exception hooks and fork handling."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any

from expr_tracker.errors import UsageError

_lock = threading.Lock()
# the current Run; typed loosely because this module sits below run.py and never imports it
current: Any = None
NO_RUN = "no active run: call expr_tracker.init() first"


class Current:
    """What `expr_tracker.log` logs to: it is `Run.log` bound to CURRENT (one call, no
    wrapper), and `Run.log` logs to `self._target`, which here is the current run, or
    CURRENT itself without one. Then the class attributes below keep `Run.log`'s hot
    path closed and its full path raises the usage error, as every other call does."""

    _keys_ok: frozenset[str] = frozenset()
    _lock = threading.Lock()
    _append = None

    def __init__(self) -> None:
        self._target: Any = self

    def _log(self, data: Any, step: Any, commit: Any) -> None:
        raise UsageError(NO_RUN)


CURRENT = Current()


def set_current(run: Any) -> None:
    global current
    with _lock:
        if current is not None and not current._finished:
            raise UsageError(
                f"expr_tracker.init() was already called for {current.project}/{current.name} "
                "in this process; call finish() first"
            )
        current = CURRENT._target = run
    _install_sigterm()
    _install_excepthooks()


_hooks_installed = False


def _install_excepthooks() -> None:
    """Record an uncaught exception (main thread or any other) for the exit path, which then
    marks the shard `crashed` with `exit: {type, message, time}` (DESIGN 5). The previous
    hooks still run: they print the traceback as before."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook
    previous_thread = threading.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _record_exception(exc_type, exc, None)
        previous(exc_type, exc, tb)

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not SystemExit:  # a thread's sys.exit() only ends that thread
            name = args.thread.name if args.thread is not None else None
            _record_exception(args.exc_type, args.exc_value, name)
        previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def _record_exception(exc_type: type[BaseException], exc: BaseException | None,
                      thread: str | None) -> None:
    run = current
    if run is None or run._pid != os.getpid() or issubclass(exc_type, KeyboardInterrupt):
        return  # Ctrl-C is a stop, as in Run.__exit__, not a crash
    try:
        run._crashed_by(exc_type, exc, thread)
    except Exception:  # never let tracking hide the real exception
        pass


def _install_sigterm() -> None:
    """Flush on SIGTERM (torchrun and Slurm stop ranks with it), then die as before.

    Only when nobody else handles SIGTERM: a handler the training code installed wins.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    run = current
    if run is not None and run._pid == os.getpid():
        try:
            run._terminate()
        except Exception:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def forget(run: Any) -> None:
    global current
    with _lock:
        if current is run:
            current = None
            CURRENT._target = CURRENT


def get() -> Any:
    run = current
    if run is None:
        raise UsageError(NO_RUN)
    return run


def _at_exit() -> None:
    run = current
    if run is not None and run._pid == os.getpid():
        status = "crashed" if run._exit is not None else "finished"
        try:
            run.finish(status)
        except KeyboardInterrupt:  # Ctrl-C again: finish closed the shard all the same
            run._interrupted(status)  # (unless it landed before finish's own guard)
        except Exception:  # exit must never fail because of tracking
            pass


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    run = current
    if run is not None:
        run._after_fork_in_child()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
