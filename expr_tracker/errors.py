"""The small exception tree of expr-tracker: misuse raises one of these at the call."""

from __future__ import annotations

from collections.abc import Iterable


def unknown_key(where: str, key: object, allowed: Iterable[str]) -> str:
    """`{where}: unknown key 'hang_afer' (did you mean 'hang_after'? allowed: ...)`: the
    message of every config table's unknown key."""
    import difflib

    choices = list(allowed)
    close = difflib.get_close_matches(str(key), choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{where + ': ' if where else ''}unknown key {key!r} ({hint}allowed: {', '.join(choices)})"


class TrackerError(Exception):
    """Base class of every error expr-tracker raises on purpose."""


class UsageError(TrackerError, RuntimeError):
    """The API was called in the wrong order (for example `init` twice without `finish`)."""


class RuleError(TrackerError, ValueError):
    """An alert rule does not parse or does not type-check; the message points at the spot."""


class RunNotFoundError(TrackerError, FileNotFoundError):
    """A run, shard or stream named by the caller does not exist."""
