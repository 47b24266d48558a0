"""Answers under a size cap, and larger pulls as files under the output directory.

An agent reads every byte of an answer, so each one stays under `Caps.answer_bytes`. When
the whole answer is bigger, `fit` writes it whole to a file under the output directory
(when the server was given one) and returns a copy whose longest lists are cut, halving
the longest one at a time until the copy fits; the answer then names each list it cut
(its path, what was kept, of how many) and the file's path.

The output directory is opened once, at start, and every file is created from its
descriptor with O_CREAT | O_EXCL | O_NOFOLLOW under a fresh name: a symlink put in its
place later, or a name that exists, is refused, and nothing is written anywhere else.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from expr_cli.data import jsonable

MAX_DEPTH = 12  # nesting searched for lists to cut


@dataclass(frozen=True)
class Caps:
    """The bounds of every answer (the command's options)."""

    answer_bytes: int = 48_000  # one answer, as JSON
    points: int = 200  # points of a series per line
    rows: int = 100  # SQL rows in an answer
    file_rows: int = 1_000_000  # SQL rows written to a file (with an output directory)
    file_bytes: int = 256 << 20  # bytes of one file
    out_bytes: int = 1 << 30  # bytes the output directory may hold in all (earlier files too)
    sql_seconds: float = 20.0  # a query's time (DuckDB's interrupt, ClickHouse's max_execution_time)
    sql_memory: str = "1GB"  # DuckDB's memory_limit (ClickHouse: max_memory_usage, the same)


def encode(obj: Any) -> bytes:
    """Strict JSON of an answer (non-finite floats spelled as in shards)."""
    return orjson.dumps(jsonable(obj), option=orjson.OPT_NON_STR_KEYS)


class OutDir:
    """The directory larger pulls are written under (None: the server writes nothing)."""

    def __init__(self, path: Path | None, limit: int = Caps.out_bytes) -> None:
        self.path = path
        self.fd: int | None = None
        self.limit = limit
        self.held = 0  # bytes of the files in it (at start, and written since)
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
            # held open for the server's life: what the name points at later does not matter
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            with os.scandir(self.fd) as it:
                self.held = sum(e.stat(follow_symlinks=False).st_size for e in it
                                if e.is_file(follow_symlinks=False))

    def room(self) -> int:
        """Bytes a new file may still take (the directory's total cap, `Caps.out_bytes`)."""
        return max(0, self.limit - self.held)

    def create(self, tool: str, suffix: str) -> tuple[Path, Any]:
        """A new file `{tool}-{time}-{random}{suffix}` and its binary writer."""
        assert self.fd is not None and self.path is not None
        name = f"{tool}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}{suffix}"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.fd)
        return self.path / name, os.fdopen(fd, "wb")

    def write(self, tool: str, data: bytes) -> Path | None:
        """`data` as a new JSON file; its path (None: over what the directory may hold)."""
        if len(data) > self.room():
            return None
        path, fh = self.create(tool, ".json")
        with fh:
            fh.write(data)
        self.held += len(data)
        return path


def _lists(obj: Any, path: str, depth: int, out: list[tuple[int, str, list[Any]]]) -> None:
    if depth > MAX_DEPTH:
        return
    if isinstance(obj, list):
        if len(obj) > 1:
            out.append((len(obj), path, obj))
        for i, v in enumerate(obj[:64]):  # (the head of a list holds what is kept)
            _lists(v, f"{path}[{i}]", depth + 1, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _lists(v, f"{path}.{k}" if path else str(k), depth + 1, out)


def shrink(answer: dict[str, Any], cap: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A copy of `answer` whose longest lists are halved, one at a time, until its JSON is
    under `cap` bytes; and what was cut (path, kept, of)."""
    import copy

    small = copy.deepcopy(jsonable(answer))
    cuts: dict[str, dict[str, Any]] = {}
    while len(encode(small)) > cap:
        found: list[tuple[int, str, list[Any]]] = []
        _lists(small, "", 0, found)
        if not found:
            break
        n, path, longest = max(found, key=lambda t: t[0])
        keep = n // 2
        del longest[keep:]
        entry = cuts.setdefault(path, {"path": path, "of": n})
        entry["kept"] = keep
    return small, list(cuts.values())


def fit(tool: str, answer: dict[str, Any], cap: int, out: OutDir) -> dict[str, Any]:
    """`answer` with `cut` (and `file`) set: as it is when it fits `cap`, else cut to fit,
    the whole of it written under `out` when there is one."""
    answer.setdefault("cut", False)
    whole = encode(answer)
    if len(whole) <= cap:
        return answer
    answer["cut"] = True
    file = None
    if out.fd is not None and (written := out.write(tool, whole)) is not None:
        file = str(written)
    room = cap - 1024  # (the notes below)
    small, cuts = shrink(answer, room)
    small["cut"] = True
    small["cuts"] = cuts
    small["file"] = file
    small["note"] = (f"the whole answer ({len(whole):,} bytes) is in {file}" if file else
                     f"the whole answer is {len(whole):,} bytes, over the cap of {cap:,}; "
                     + ("the output directory holds what it may (--out-max)" if out.fd is not None
                        else "start expr mcp with --out DIR to get it as a file"))
    if len(encode(small)) > cap:  # lists alone could not make it fit: the coverage only
        small = {k: small[k] for k in ("tool", "covers", "cut", "cuts", "file", "note")
                 if k in small}
    return small
