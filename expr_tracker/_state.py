"""The process's current run, the exit hook and fork handling."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Any

from expr_tracker.errors import UsageError

_lock = threading.Lock()
# the current Run; typed loosely because this module sits below run.py and never imports it
current: Any = None


def set_current(run: Any) -> None:
    global current
    with _lock:
        if current is not None and not current._finished:
            raise UsageError(
                f"expr_tracker.init() was already called for {current.project}/{current.name} "
                "in this process; call finish() first"
            )
        current = run
    _install_sigterm()


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


def get() -> Any:
    run = current
    if run is None:
        raise UsageError("no active run: call expr_tracker.init() first")
    return run


def _at_exit() -> None:
    run = current
    if run is not None and run._pid == os.getpid():
        try:
            run.finish()
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
