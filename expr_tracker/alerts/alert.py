"""The Alert value: a rule firing or recovering, or a manual `et.alert(...)` (DESIGN 7).

Alerts never carry secrets: `as_dict()` holds what the record and the rule say, and URLs
are shown as `scheme://host/…` by `redact_url`.
"""

from __future__ import annotations

import math
import time as _clock
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from expr_tracker.alerts.config import _RANK, LEVELS

KINDS = ("fire", "recover", "manual")


@dataclass(frozen=True)
class Alert:
    """One alert to deliver: a rule firing or recovering, or a manual `et.alert`."""

    title: str
    text: str
    level: str
    rule: str | None
    kind: str
    step: int | None
    time: float
    project: str
    run: str
    stream: str | None
    rank: int
    event_id: str | None

    def as_dict(self) -> dict[str, Any]:
        """Return the alert as a JSON-safe dict; non-finite floats are left out."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if not (isinstance(v, float) and not math.isfinite(v))}


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def make_alert(
    title: object,
    text: object = "",
    level: object = "info",
    *,
    rule: str | None = None,
    kind: str = "manual",
    step: int | None = None,
    time: float | None = None,
    project: str = "",
    run: str = "",
    stream: str | None = None,
    rank: int = 0,
    event_id: str | None = None,
) -> Alert:
    """Build a validated Alert; a bad argument is a TypeError/ValueError naming it."""
    if not _text(title, "title").strip():
        raise ValueError("title must not be empty")
    lvl = _text(level, "level").lower()
    if lvl not in _RANK:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    when = _clock.time() if time is None else time
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise ValueError(f"time must be a finite number, got {time!r}")
    for name, value in (("rule", rule), ("stream", stream), ("event_id", event_id)):
        if value is not None:
            _text(value, name)
    return Alert(
        title=str(title), text=_text(text, "text"), level=lvl, rule=rule, kind=kind,
        step=step, time=float(when), project=_text(project, "project"), run=_text(run, "run"),
        stream=stream, rank=rank, event_id=event_id,
    )


def redact_url(url: str) -> str:
    """Show a URL as `scheme://host[:port]/…`: paths and queries of webhooks carry tokens."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme or '?'}://{host}{port}/…"


def one_line(s: str) -> str:
    return " ".join(part.strip() for part in s.splitlines() if part.strip())


def format_line(alert: Alert) -> str:
    """The one-line text form of an alert (the `log` channel writes it)."""
    where = f"{alert.project}/{alert.run}" + (f"/{alert.stream}" if alert.stream else "")
    where += f" rank {alert.rank}" + (f" step {alert.step}" if alert.step is not None else "")
    if alert.rule is not None:
        where += f" rule {alert.rule} {alert.kind}"
    body = one_line(alert.title) + (f": {one_line(alert.text)}" if alert.text.strip() else "")
    return f"expr alert [{alert.level}] {body} ({where})"
