"""exprd's backend reader takes runs of plain records a block at a time (issue 24 item 5):
what it hands a backend is what the record-by-record reader handed it, record for record,
whatever is mixed in, however the reads are cut (room in the queue, the shard's offset).

A real spool file written by the SDK (several read blocks), edited with the odd lines
of tests/test_daemon_blocks.py, rank records, non-finite text and a repeated `_seq`. The
oracle is `check_record` itself, applied to each line here, as the reader before did.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from daemon.forwarder import Forwarder
from expr_tracker.store import diskroom, untrusted
from expr_tracker.store.records import DECODE_NONFINITE
from tests.test_daemon import _rewrite, make_spool
from tests.test_daemon_blocks import ODD


class Collect:
    """A backend worker as the reader sees it: it only queues."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def submit_many(self, records: list[dict[str, Any]]) -> None:
        self.got.extend(records)


def _spool(tmp_path: Path, n: int) -> Path:
    # one segment holds the session: the blocks of one file are what is read here
    # (segments start at 64 KiB and grow otherwise)
    start = diskroom.START_BYTES
    diskroom.START_BYTES = 64 << 20
    try:
        path = make_spool(tmp_path / "spool", tmp_path / "runs", "fwd", n, system_metrics=False)
    finally:
        diskroom.START_BYTES = start

    def edit(lines: list[bytes]) -> list[bytes]:
        out = list(lines)
        for i, at in enumerate([5, 6, 7, *range(40, n, 997)]):
            rec = orjson.loads(out[at])
            out[at] = ODD[i % len(ODD)].format(seq=rec["_seq"], step=rec["_step"]).encode() + b"\n"
        rank = ('{{"_kind":"rank","_step":{step},"_time":1.5,"_rank":1,"_world_size":4,'
                '"_local_rank":1,"_weight":1.0,"_seq":{seq},"loss":0.5,"gpu":0.25}}\n')
        for at in range(8000, 8300):  # rank records between step rows, some odd
            rec = orjson.loads(out[at])
            text = rank.format(step=rec["_step"], seq=rec["_seq"])
            if at % 50 == 0:
                text = text.replace('"gpu":0.25', '"gpu":"x"')
            out[at] = text.encode()
        for at in range(3000, 3400, 3):  # non-finite values as the SDK writes them
            rec = orjson.loads(out[at])
            rec["loss"] = ("NaN", "Infinity", "-Infinity")[at % 3]
            out[at] = orjson.dumps(rec) + b"\n"
        out[2000] = out[1999]  # a repeat
        return out

    _rewrite(path, edit)
    return path


def _oracle(path: Path, session: str) -> list[dict[str, Any]]:
    """What the record-by-record reader submitted: every record after the last `_seq`
    seen, not an event, that `check_record` passes, non-finite text decoded, with `_id`."""
    out, last = [], -1
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        seq = rec.get("_seq")
        if type(seq) is not int or seq <= last:
            continue
        last = seq
        if "_event" in rec or rec.get("_kind", "rank") != "rank":
            continue
        rec.pop("_sid", None)
        try:
            untrusted.check_record(rec)
        except (TypeError, ValueError):
            continue
        for key, value in rec.items():
            if key[0] != "_" and isinstance(value, str) and value in DECODE_NONFINITE:
                rec[key] = DECODE_NONFINITE[value]
        rec["_id"] = f"{session}:{seq}"
        out.append(rec)
    return out


def _read(path: Path, session: str, room: int, step: int | None) -> list[dict[str, Any]]:
    """Feed the whole file through `Forwarder._feed`, `room` records at a time, the shard's
    offset moving `step` lines at a time (None: all there at once)."""
    fwd = Forwarder(SimpleNamespace(session=session), None, {}, enabled=False)  # type: ignore[arg-type]
    worker = Collect()
    ends = [0]
    for line in path.read_bytes().splitlines(keepends=True):
        ends.append(ends[-1] + len(line))
    off, seq, i = 0, None, 0
    while off < ends[-1]:
        i = len(ends) - 1 if step is None else min(i + step, len(ends) - 1)
        upto = ends[i]
        while off < upto:
            before = off
            off, seq = fwd._feed(worker, path, off, seq, upto, room)
            assert off > before
    assert off == ends[-1]
    return worker.got


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    # NaN != NaN: compare the encodings
    return [orjson.dumps(r) for r in got] == [orjson.dumps(r) for r in want]


def test_the_block_reader_hands_over_what_the_line_reader_did(tmp_path: Path) -> None:
    path = _spool(tmp_path, 30_000)
    session = path.name.split(".")[-2]
    want = _oracle(path, session)
    assert 29_000 < len(want) < 30_000
    assert sum(r["loss"] != r["loss"] for r in want if isinstance(r.get("loss"), float)) > 100
    assert 280 < sum("_kind" in r for r in want) < 300
    for room, step in ((10**9, None), (5000, None), (777, 1234), (10_000, 29_999)):
        got = _read(path, session, room, step)
        assert _same(got, want), (room, step)
