"""Names on disk: run directories, shards, sidecars, alert files and spool files.

Every path the package writes is built here, from validated names, so nothing
lands outside the configured directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

MAX_NAME = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")
# a `rank<N>` segment anywhere in a stream would let `metrics.<stream>.jsonl` of one rank
# spell the shard of another (stream `data.rank2` of rank 0 is rank 2 of stream `data`);
# in any case, as `Rank1` is `rank1` on a case-insensitive filesystem (macOS, Windows)
_RANK_SEGMENT = re.compile(r"(?:\A|\.)rank\d+(?:\.|\Z)", re.IGNORECASE)
_SHARD_RE = re.compile(
    r"metrics(?:\.(?P<stream>(?!rank\d+\.)[A-Za-z0-9_\-][A-Za-z0-9_.\-]*?))?(?:\.rank(?P<rank>\d+))?\.jsonl\Z"
)
DEFAULT_DIR = "./tracker/jsonl"


def validate_name(value: object, field: str) -> str:
    """Return `value` if it is a safe single path component, else raise ValueError naming `field`."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{field} must not be empty")
    if len(value) > MAX_NAME:
        raise ValueError(f"{field} is {len(value)} characters long; at most {MAX_NAME} allowed")
    if "\x00" in value:
        raise ValueError(f"{field} must not contain a NUL character")
    if "/" in value or "\\" in value:
        raise ValueError(f"{field} {value!r} must not contain '/'")
    if ".." in value:
        raise ValueError(f"{field} {value!r} must not contain '..'")
    if value.startswith("."):
        raise ValueError(f"{field} {value!r} must not start with '.'")
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{field} {value!r} may hold only letters, digits, '_', '-' and '.'"
        )
    return value


def validate_stream(value: object) -> str | None:
    """Validate a stream name; None means the default stream."""
    if value is None:
        return None
    name = validate_name(value, "stream")
    if _RANK_SEGMENT.search(name):
        raise ValueError(
            f"stream {name!r} has a 'rank<N>' segment (in any case), which could spell "
            "another rank's shard name; choose another stream name"
        )
    folded = name.lower()  # a case-insensitive filesystem folds them together
    if folded == "metrics" or folded.endswith(".meta") or folded in {"torn", "jsonl"}:
        raise ValueError(f"stream {name!r} is a reserved name")
    return name


def default_dir() -> Path:
    """The run root: `$EXPR_DIR` or `./tracker/jsonl`."""
    return Path(os.environ.get("EXPR_DIR") or DEFAULT_DIR)


def shard_stem(stream: str | None, rank: int) -> str:
    """`metrics`, `metrics.rank2`, `metrics.data`, `metrics.data.rank2`."""
    parts = ["metrics"]
    if stream:
        parts.append(stream)
    if rank:
        parts.append(f"rank{rank}")
    return ".".join(parts)


def alerts_name(rank: int) -> str:
    """`alerts.jsonl` for rank 0, `alerts.rank2.jsonl` otherwise."""
    return "alerts.jsonl" if rank == 0 else f"alerts.rank{rank}.jsonl"


def spans_name(rank: int) -> str:
    """`spans.jsonl` for rank 0, `spans.rank2.jsonl` otherwise (`trace_spans=True`)."""
    return "spans.jsonl" if rank == 0 else f"spans.rank{rank}.jsonl"


_SPANS_RE = re.compile(r"spans(?:\.rank(?P<rank>\d+))?\.jsonl\Z")


def parse_spans_name(filename: str) -> int | None:
    """The rank of a span trace file name (`spans.jsonl`: 0), None for anything else."""
    m = _SPANS_RE.match(filename)
    return None if m is None else int(m.group("rank") or 0)


@dataclass(frozen=True)
class ShardName:
    """What a shard file name says about its contents."""

    stream: str | None
    rank: int


def parse_shard_name(filename: str) -> ShardName | None:
    """Parse `metrics[.stream][.rankN].jsonl`; None for anything else."""
    m = _SHARD_RE.match(filename)
    if not m:
        return None
    return ShardName(m.group("stream"), int(m.group("rank") or 0))


@dataclass(frozen=True)
class ShardPaths:
    """All paths belonging to one shard of one run."""

    run_dir: Path
    stem: str

    # built once (exprd asks for them at every turn); a frozen dataclass's cached_property
    # fills the instance's __dict__, which equality and the hash never look at
    @cached_property
    def shard(self) -> Path:
        return self.run_dir / f"{self.stem}.jsonl"

    @cached_property
    def sidecar(self) -> Path:
        return self.run_dir / f"{self.stem}.meta.json"

    @property
    def torn(self) -> Path:
        return self.run_dir / f"{self.stem}.jsonl.torn"


def run_dir(root: str | os.PathLike[str], project: str, name: str) -> Path:
    """`{root}/{project}/{name}` from validated names."""
    return Path(root) / validate_name(project, "project") / validate_name(name, "name")


def shard_paths(
    root: str | os.PathLike[str], project: str, name: str, stream: str | None, rank: int
) -> ShardPaths:
    """Paths of the shard of (`stream`, `rank`) in run `project/name` under `root`."""
    return ShardPaths(run_dir(root, project, name), shard_stem(validate_stream(stream), rank))


def default_spool() -> Path:
    """`$EXPR_SPOOL`, else `${XDG_STATE_HOME:-~/.local/state}/expr/spool`."""
    env = os.environ.get("EXPR_SPOOL")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "expr" / "spool"


def spool_path(
    spool: str | os.PathLike[str], project: str, name: str, stem: str, session: str,
    segment: int = 0,
) -> Path:
    """`{spool}/{project}/{name}/{shard-stem}.{session}.jsonl`, and for the segments after
    the first `{shard-stem}.{session}~{segment}.jsonl` (`~` is in no valid name)."""
    validate_name(session, "session")
    part = f"{session}~{segment}" if segment else session
    return run_dir(spool, project, name) / f"{stem}.{part}.jsonl"


def spool_segment(filename: str) -> tuple[str, int]:
    """(`{stem}.{session}`, segment) of a spool file name (segment 0 without a `~N`)."""
    base = filename.removesuffix(".jsonl")
    head, sep, tail = base.rpartition("~")
    if sep and tail.isdigit() and tail[:1] != "0":
        return head, int(tail)
    return base, 0
