"""Where a shard first held a non-finite value of each key (DESIGN 13's default detector).

A writer notes, as it writes, the first (step, rank) at which each key was NaN or
infinite, and keeps the notes in the shard's sidecar (`nonfinite`), so every reader of a
run (a watcher, `expr top --once` long after the step) knows of it from the sidecars it
reads anyway, without scanning a shard. Non-finite floats are written as the strings
"NaN", "Infinity", "-Infinity" (DESIGN 4): a flush whose bytes hold neither `"NaN"` nor
`Infinity"` (nearly all of them: a `memchr` for a capital letter, else one search in C)
costs next to nothing more; only the lines that do are parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from expr_tracker.store.records import NONFINITE_TEXT

_NEEDLES = (b'"NaN"', b'Infinity"')
MAX_KEYS = 32  # keys noted per shard: a run whose every key went NaN needs no more
MAX_RANKS = 16  # ranks named per key (a rank 0 that logs every rank's records)


def _lines_with(data: bytes) -> list[bytes]:
    """The complete lines of `data` that hold a needle, in file order, each once."""
    starts: dict[int, int] = {}
    for needle in _NEEDLES:
        pos = data.find(needle)
        while pos >= 0:
            start = data.rfind(b"\n", 0, pos) + 1
            end = data.find(b"\n", pos)
            if end < 0:
                break  # an unterminated tail: not a row yet
            starts[start] = end
            pos = data.find(needle, end)
    return [data[s:starts[s]] for s in sorted(starts)]


def note(data: bytes, notes: dict[str, dict[str, Any]], own_rank: int | None) -> bool:
    """Add to `notes` (key -> {step, rank, rows, ranks}) the non-finite values in the
    whole lines `data`; True when a key or a rank was added (news for the readers: the
    writer then rewrites the sidecar soon, not at its usual few seconds). A record's rank
    is its `_rank`, else `own_rank` (the shard's)."""
    # a capital N or I first (memchr: about 1 us a flush where the needles take 50): the
    # keys of most jobs hold neither, and "NaN" and "Infinity" each hold one
    if not ((b"N" in data and _NEEDLES[0] in data) or (b"I" in data and _NEEDLES[1] in data)):
        return False
    changed = False
    for line in _lines_with(data):
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        step = rec.get("_step")
        if type(step) is not int:
            continue
        rank = rec.get("_rank")
        rank = rank if type(rank) is int and rank >= 0 else own_rank
        for key, value in rec.items():
            if value.__class__ is not str or key[:1] == "_" or value not in NONFINITE_TEXT:
                continue
            got = notes.get(key)
            if got is None:
                if len(notes) >= MAX_KEYS:
                    continue
                notes[key] = {"step": step, "rank": rank, "value": value, "rows": 1,
                              "ranks": [] if rank is None else [rank]}
                changed = True
            else:
                got["rows"] = int(got.get("rows") or 0) + 1
                ranks = got.setdefault("ranks", [])
                if rank is not None and rank not in ranks and len(ranks) < MAX_RANKS:
                    ranks.append(rank)
                    changed = True
    return changed


def kept(old: Any) -> dict[str, dict[str, Any]]:
    """The notes of a sidecar (an earlier session's, on resume), those that read as notes."""
    if not isinstance(old, Mapping):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for key, n in old.items():
        if isinstance(key, str) and isinstance(n, Mapping) and type(n.get("step")) is int:
            out[key] = dict(n)
        if len(out) >= MAX_KEYS:
            break
    return out
