"""The small exception tree of expr-tracker: misuse raises one of these at the call."""

from __future__ import annotations


class TrackerError(Exception):
    """Base class of every error expr-tracker raises on purpose."""


class UsageError(TrackerError, RuntimeError):
    """The API was called in the wrong order (for example `init` twice without `finish`)."""


class RuleError(TrackerError, ValueError):
    """An alert rule does not parse or does not type-check; the message points at the spot."""


class RunNotFoundError(TrackerError, FileNotFoundError):
    """A run, shard or stream named by the caller does not exist."""
