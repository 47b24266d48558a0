"""Remote backends: protocol, remote ids, wandb/trackio/http and a background worker.

Importing this package imports none of wandb, trackio or httpx.
"""

from __future__ import annotations

from expr_tracker.backends.base import Backend, Identity, reportable
from expr_tracker.backends.registry import make_backend
from expr_tracker.backends.worker import BackendWorker

__all__ = ["Backend", "BackendWorker", "Identity", "make_backend", "reportable"]
