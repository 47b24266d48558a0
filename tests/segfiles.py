"""Spool segments written directly in the SDK's format (`store.segment`), fast: a
backlog of thousands of segments of one session without a training process."""

from __future__ import annotations

import os
from pathlib import Path

import orjson


def init_line(root: Path, name: str, session: str, index: int, first_seq: int,
              *, pid: int = 1) -> bytes:
    """A segment's head: the init event, with `segment`/`first_seq` past the first."""
    ev = {"_event": "init", "_seq": 0, "_time": 1.0e9, "version": 1,
          "identity": {"project": "p", "name": name, "stream": None, "rank": 0,
                       "world_size": None, "local_rank": 0, "session": session,
                       "rank_aware": True, "config": {}},
          "dir": str(root), "stem": "metrics", "host": "elsewhere", "pid": pid,
          "rules": [], "backends": []}
    if index:
        ev["segment"], ev["first_seq"] = index, first_seq
    return orjson.dumps(ev) + b"\n"


def row_line(seq: int) -> bytes:
    """A step row whose step and `i` are `seq - 1` (seq 1 is step 0)."""
    return b'{"_step":%d,"_time":1.0e9,"i":%d,"_seq":%d}\n' % (seq - 1, seq - 1, seq)


def segment_path(spool: Path, name: str, session: str, index: int) -> Path:
    part = f"{session}~{index}" if index else session
    return spool / "p" / name / f"metrics.{part}.jsonl"


def write_segments(spool: Path, root: Path, name: str, count: int, rows: int = 1, *,
                   session: str = "s0000000001", finish: bool = True) -> list[Path]:
    """`count` segments of one session, `rows` step rows each, every one but the last
    ended by a `segment` marker, the last by a finish (unless `finish` is False: then
    it ends after its rows, as a live segment does). Returns the paths in order."""
    d = spool / "p" / name
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = []
    seq = 1
    for index in range(count):
        path = segment_path(spool, name, session, index)
        body = [init_line(root, name, session, index, seq)]
        for _ in range(rows):
            body.append(row_line(seq))
            seq += 1
        if index < count - 1:
            nxt = segment_path(spool, name, session, index + 1).name
            body.append(b'{"_event":"segment","_seq":0,"_time":1.0e9,"next":"%s"}\n'
                        % nxt.encode())
        elif finish:
            body.append(b'{"_event":"finish","_time":1.0e9,"status":"finished","_seq":%d}\n'
                        % seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"".join(body))
        finally:
            os.close(fd)
        out.append(path)
    return out
