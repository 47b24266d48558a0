"""What exprd knows about one spool file, and the entry it keeps for it in checkpoints.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expr_tracker.store.spoolfile import SpoolReader

if TYPE_CHECKING:
    from .applier import RunPipeline


@dataclass
class FileTail:
    """What exprd knows about one spool file."""

    path: Path
    ino: int = 0
    offset: int = 0  # next byte to read: every line before it is consumed
    committed: int = 0  # offset covered by flushed shard data (what the checkpoint says)
    seq: int = -1  # last `_seq` consumed
    committed_seq: int = -1  # last `_seq` before `committed`
    # `spoolfile.line_mark` of the line ending at `offset` (and at `committed`): a file cut
    # and written again past the offset between two reads no longer holds it (None: not
    # known, unchecked)
    mark: tuple[int, int] | None = None
    nul_seen: int = 0  # the reader's NUL runs of this read already taken as a `_seq` gap's
    committed_mark: tuple[int, int] | None = None
    state: str = "new"  # new | live | rolled (its session goes on in its next segment) |
    # finished | crashed | refused
    reason: str = ""
    # how its session ended, when it ended in this file: "finished" or "crashed" (a finish
    # event's status, or its writer found gone). `state` says what exprd does with the
    # file ("finished": read to its finish event, whatever its status); `expr status`
    # counts by this, as `expr shards` tells the shards (issue 54: a job whose 4 shards
    # crashed read "11 finished, 1 crashed")
    ended: str = ""
    host: str = ""
    pid: int | None = None
    pid_start: int | None = None
    size: int = 0
    mtime: float = 0.0
    behind_since: float | None = None
    backends: dict[str, int] = field(default_factory=dict)
    run: RunPipeline | None = None
    reader: SpoolReader | None = None  # made once (`SpoolReader` builds a Path)
    logged: int = 0
    quarantined: int = 0
    applied: int = 0  # record events written to the shard by this process
    skipped: int = 0  # record events the shard already held
    # ("rotated" | "new", applied, skipped) when the file is read from its start (a new file
    # took the name, or a file without checkpoint): what it brought is reported once, when
    # it is read to its end
    replaced: tuple[str, int, int] | None = None
    replaced_told: bool = False
    drained: bool = False  # the last pump read every complete line there was
    read_error: str = ""  # why the last read failed (EMFILE...): retried, never "torn"
    # the keys of the last step row and of the last rank record that passed the full check
    shapes: tuple[frozenset[str] | None, frozenset[str] | None] = (None, None)
    # every key of the step rows (without `_rank`) that passed the full check
    row_keys: set[str] = field(default_factory=set)

    @property
    def key(self) -> str:
        return str(self.path)

    def checkpoint(self) -> dict[str, Any]:
        """What `checkpoints.json` keeps: the committed offset and the seq and state there
        (a file read further than its shard could be written is not finished yet)."""
        state, seq = self.state, self.seq
        if self.committed < self.offset:
            seq = self.committed_seq
            state = "live" if state in ("finished", "crashed", "rolled") else state
        out: dict[str, Any] = {"ino": self.ino, "shard": self.committed, "seq": seq,
                               "state": state, "host": self.host, "pid": self.pid,
                               "pid_start": self.pid_start}
        if self.committed_mark is not None:
            out["mark"] = list(self.committed_mark)
        if self.reason:
            out["reason"] = self.reason
        if self.ended and state == self.state:
            out["ended"] = self.ended
        if self.backends:
            out["backends"] = dict(self.backends)
        return out
