"""A backend object written for expr-tracker 0.4: `init(run_info)`, `log(row)`, `finish()`.

0.4's plugins take one row at a time and a plain dict describing the run; this adapter
gives them that, over this project's batching worker (which contains their failures as
it does every backend's). An `alert(alert)` method, if the object has one, gets alerts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from expr_tracker.backends.base import Identity

METHODS = ("init", "log", "finish")


def is_legacy(obj: object) -> bool:
    """True for an object with 0.4's backend methods (and not this project's `open`)."""
    return all(callable(getattr(obj, m, None)) for m in METHODS) and not callable(getattr(obj, "open", None))


class LegacyBackend:
    """This project's backend protocol over a 0.4 backend object."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.name = str(getattr(obj, "name", None) or type(obj).__name__)

    def open(self, identity: Identity) -> None:
        # 0.4's run_info: who the run is, as this project sends it to remote endpoints
        self.obj.init(identity.to_dict())

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        for event in events:
            self.obj.log({k: v for k, v in event.items() if k != "_id"})

    def alert(self, alert: Mapping[str, Any]) -> None:
        method = getattr(self.obj, "alert", None)
        if callable(method):
            method(dict(alert))

    def finish(self, status: str) -> None:
        self.obj.finish()
