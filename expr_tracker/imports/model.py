"""What every reader of another tracker's files hands to the writer: runs found, and a
run's rows, config, tags and notes (DESIGN 22). No I/O here."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from expr_tracker.errors import TrackerError
from expr_tracker.options import MAX_NOTES, MAX_TAG, MAX_TAGS
from expr_tracker.store import records

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


class ImportFailed(TrackerError, ValueError):
    """A source could not be imported (missing, corrupt, truncated, or already imported);
    the message names the file and why, and nothing was written."""


class MissingExtra(TrackerError, ImportError):
    """The library that reads a source is not installed; the message has the pip command."""


def need(module: str, extra: str, what: str) -> Any:
    """Import `module` (the reader's library), or MissingExtra naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"importing {what} needs {module.split('.')[0]} ({exc}): "
                           f"pip install 'expr-tracker[{extra}]'") from None


def safe_part(text: str) -> str:
    """A sub-run's name (a TensorBoard sub-directory, an MLflow run name) as a name part:
    every run of characters a run name may not hold becomes `_`, `/` becomes `-`."""
    out = _UNSAFE.sub("_", text.strip("/").replace("/", "-")).strip("-") or "_"
    out = out.replace("..", "_.")
    return "_" + out[1:] if out.startswith(".") else out


@dataclass
class Found:
    """One run of a source, found but not read yet: `suffix` None is the run `--name`
    itself, else the run is `{name}-{suffix}`; `load()` reads it."""

    suffix: str | None
    origin: str  # the file or directory it is read from (errors, the sidecar)
    load: Callable[[], Imported]


@dataclass
class Imported:
    """One run read from another tracker: rows sorted by step, and what goes to the sidecar."""

    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # what did not come over, by kind
    start_time: float | None = None
    end_time: float | None = None

    def skip(self, what: str, n: int = 1) -> None:
        self.skipped[what] = self.skipped.get(what, 0) + n

    def meta(self) -> dict[str, Any]:
        """Tags and notes as the SDK stores them (DESIGN 5), cut to its bounds."""
        out: dict[str, Any] = {}
        tags = [t[:MAX_TAG] for t in dict.fromkeys(self.tags) if t and "\x00" not in t]
        if tags:
            out["tags"] = tags[:MAX_TAGS]
        if self.notes:
            out["notes"] = self.notes[:MAX_NOTES]
        return out


class Steps:
    """Values gathered into one row per step: `_step`, `_time` (the earliest wall time of
    the step's values) and each metric's value. A metric written twice at one step keeps
    its last value (TensorBoard after a restart, MLflow's repeated logs), counted."""

    def __init__(self, into: Imported) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.into = into

    def add(self, step: int, wall: float | None, key: str, value: Any) -> None:
        """One value of `key` at `step`, logged at wall time `wall` (None: not known)."""
        self.put(self.at(step, wall), key, value)

    def at(self, step: int, wall: float | None) -> dict[str, Any]:
        """The row of `step` (made on first use), its `_time` the earliest `wall` seen."""
        row = self.rows.get(step)
        if row is None:
            row = self.rows[step] = {"_step": step, "_time": wall}
        elif wall is not None and (row["_time"] is None or wall < row["_time"]):
            row["_time"] = wall
        return row

    def put(self, row: dict[str, Any], key: str, value: Any) -> None:
        """`row[key] = value` as a row holds it; a key or value a row cannot hold is counted
        in `skipped` instead (a million-value import calls this a million times)."""
        if not key or key[0] == "_":
            self.into.skip("reserved or empty keys")
            return
        if value.__class__ is not float or value - value != 0.0:  # not a finite float
            try:
                value = records.encode_value(key, value)
            except (TypeError, ValueError):
                self.into.skip("values that are not numbers, booleans or short strings")
                return
        if key in row:
            self.into.skip("values replaced by a later one at the same step")
        row[key] = value

    def done(self) -> list[dict[str, Any]]:
        """The rows in step order; a step whose values carried no time gets none."""
        out = []
        for step in sorted(self.rows):
            row = self.rows[step]
            if row["_time"] is None or not math.isfinite(row["_time"]):
                del row["_time"]
            out.append(row)
        return out


def check_step(step: Any, origin: str, what: str) -> int:
    """A source's step as the int a row needs; ImportFailed naming `origin` otherwise."""
    if isinstance(step, bool) or not isinstance(step, int):
        if isinstance(step, float) and step.is_integer():
            step = int(step)
        else:
            raise ImportFailed(f"{origin}: {what} has step {step!r}, not a whole number; "
                               "expr steps are integers >= 0")
    if step < 0:
        raise ImportFailed(f"{origin}: {what} has a negative step ({step}); expr steps are >= 0")
    return step


def unreadable(exc: OSError) -> None:
    """`os.walk`'s onerror for a source: a directory it cannot read fails the import, naming
    it (a walk skips one quietly, and an import reads all of SOURCE or nothing)."""
    raise ImportFailed(f"{exc.filename}: {exc.strerror} (an import reads all of SOURCE or "
                       "nothing)")
