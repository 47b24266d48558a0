"""What a sink needs to know about its run, handed down by `Run` (DESIGN 2).

The sinks (`direct`, `spool`) sit below `run.py` and never import it: `Run` builds a
`RunContext` once its arguments are checked and passes it down. The context holds the
run's fixed facts, the parsed alert and backend options, and the two things sinks report
into: `warn_once` and the `dropped` counters shared with `Run.info()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expr_tracker.store.layout import ShardPaths


@dataclass
class RunContext:
    """One run's facts for its sink; `ruleset` follows `Run.add_alert_rule`/`remove_alert_rule`."""

    project: str
    name: str
    stream: str | None
    rank: int
    world_size: int | None  # None: unknown (WORLD_SIZE not set), stored as null
    local_rank: int
    session: str
    rank_aware: bool
    config: dict[str, Any]
    root: Path
    spool_root: Path
    paths: ShardPaths
    alert_on_rank: int | None
    backend_on_rank: int | str | None  # a rank, None (every rank) or "auto" (per backend)
    backend_rank_metrics: bool
    time_rule_interval: float
    warn_once: Callable[[str, str], None]
    dropped: dict[str, int]
    ruleset: Any = None
    alert_config: Any = None
    backend_specs: list[Any] = field(default_factory=list)
    backend_objs: list[Any] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # tags, notes, entity (those given)
    lock: Any = None  # the run's lock (log()'s hot path holds it while it writes)

    def identity(self) -> dict[str, Any]:
        """Who writes this shard (stored in the sidecar and the spool's init event)."""
        return {
            "project": self.project,
            "name": self.name,
            "stream": self.stream,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "session": self.session,
            "rank_aware": self.rank_aware,
            "config": self.config,
            **self.meta,
        }

    @property
    def alerting(self) -> bool:
        """Does this rank deliver alerts (`alert_on_rank` is it, or None for every rank)?"""
        return self.alert_on_rank is None or self.alert_on_rank == self.rank
