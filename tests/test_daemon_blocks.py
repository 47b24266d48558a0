"""exprd takes runs of plain step rows a block at a time (untrusted.plain_rows): what lands
is what the record-by-record check lets through, row for row, whatever is mixed in.

A real spool file of 30,000 rows (several read blocks) written by the SDK, edited by hand
with records of every kind the block path must leave to the full check, and a real
`exprd --once`. The oracle is `check_record` itself, applied to each line here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from expr_tracker.store import diskroom, untrusted
from tests.test_daemon import _rewrite, exprd_once, lines_of, make_spool, write_config

# lines a clean block can hold (no list, no nested object, a colon per key), each put in
# place of the record of one `_seq`: the block is still screened clean around them
ODD = [
    '{{"_step":"7","_time":1.0,"_seq":{seq},"k":-1}}',  # a text step
    '{{"_step":-1,"_time":1.0,"_seq":{seq},"k":-1}}',
    '{{"_step":9007199254740993,"_time":1.0,"_seq":{seq},"k":-1}}',  # 2**53 + 1
    '{{"_step":{step},"_seq":{seq},"k":-1}}',  # no _time
    '{{"_step":{step},"_time":"now","_seq":{seq},"k":-1}}',
    '{{"_step":{step},"_time":1.0,"_seq":{seq},"k":-1,"":2}}',
    '{{"_step":{step},"_time":1.0,"_seq":{seq},"k":-1,"_loss":2}}',
    '{{"_step":{step},"_time":1.0,"_seq":{seq},"k":-1,"_event":"x"}}',
    '{{"_step":{step},"_time":true,"_seq":{seq},"k":-1}}',
    '{{"_step":true,"_time":1.0,"_seq":{seq},"k":-1}}',
    # good ones the block path must not take as they are, or not at all
    '{{"_step":{step},"_time":1,"_seq":{seq},"k":{step},"loss":0.5}}',  # an int _time
    '{{"_step":{step},"_time":1.5,"_seq":{seq},"k":{step},"loss":0.5,"_sid":"forged"}}',
    '{{"_step":{step},"_time":1.5,"_seq":{seq},"k":{step},"eval":0.25}}',  # a new key
    '{{"_step":{step},"_time":1.5,"_seq":{seq},"k":{step},"loss":0.5,"_rank":0}}',
    '{{"_kind":"rank","_step":{step},"_time":1.5,"_rank":0,"_world_size":1,"_seq":{seq},"gpu":0.5}}',
    '{{"_step":{step},"_time":1.5,"_seq":{seq},"k":{step},"loss":0.5,"note":"a b"}}',
    '{{"_step":{step},"_time":1.5,"_seq":{seq}.0,"k":{step},"loss":0.5}}',  # a float _seq
    '{{"_step":{step},"_time":1.5,"_seq":{seq},"k":{step},"loss":0.5}} ',  # space at the end
]


def _good(rec: Any) -> bool:
    """What exprd must apply: an event's `_seq` (an int), and a record `check_record` passes."""
    if type(rec.get("_seq")) is not int or "_event" in rec:
        return False
    try:
        untrusted.check_record({k: v for k, v in rec.items() if k != "_sid"})
    except (TypeError, ValueError):
        return False
    return True


def test_runs_of_rows_land_as_the_full_check_says_row_for_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    n = 30_000
    # one segment holds the session (the blocks of one file are what is read here;
    # segments start at 64 KiB and grow otherwise)
    monkeypatch.setattr(diskroom, "START_BYTES", 64 << 20)
    path = make_spool(spool, root, "blocks", n)
    sid = path.name.split(".")[-2]
    odd_at: dict[int, int] = {}  # line index -> kind of odd line

    def edit(lines: list[bytes]) -> list[bytes]:
        out = list(lines)
        # the first ones early in the first block, then spread over every block
        places = [5, 6, 7, *range(40, n, 997)]
        for i, at in enumerate(places):
            kind = i % len(ODD)
            rec = orjson.loads(out[at])
            out[at] = ODD[kind].format(seq=rec["_seq"], step=rec["_step"]).encode() + b"\n"
            odd_at[at] = kind
        # a run of rank records, with odd ones in it
        rank = ('{{"_kind":"rank","_step":{step},"_time":{time},"_rank":1,"_world_size":4,'
                '"_local_rank":1,"_weight":1.0,"_seq":{seq},"loss":0.5,"gpu":{gpu}}}')
        odd_ranks = {8050: ('"_rank":1,', '"_rank":7,'), 8100: ('"rank"', '"span"'),
                     8150: ('"gpu":0.25', '"gpu":"x"'), 8200: ('"_weight":1.0', '"_weight":-1.0'),
                     8250: ('"_world_size":4', '"_world_size":8'), 8260: ('"gpu":0.25', '"gpu":true'),
                     8270: ('"_local_rank":1', '"_local_rank":null')}
        for at in range(8000, 8300):
            rec = orjson.loads(out[at])
            text = rank.format(step=rec["_step"], time=rec["_time"], seq=rec["_seq"], gpu=0.25)
            if at in odd_ranks:
                text = text.replace(*odd_ranks[at])
                odd_at[at] = -1
            out[at] = text.encode() + b"\n"
        # a repeated _seq (dropped) and a run of rows of a second shape
        out[2000] = out[1999]
        for at in range(5000, 5100):
            rec = orjson.loads(out[at])
            rec["acc"] = 0.5
            out[at] = orjson.dumps(rec) + b"\n"
        return out

    _rewrite(path, edit)
    spooled = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    exprd_once(write_config(tmp_path / "exprd.toml", spool, state, [root]))
    landed = lines_of(root / "proj" / "blocks" / "metrics.jsonl")
    seen: set[int] = set()
    want = []
    for rec in spooled:
        if "_event" in rec and rec.get("_event") in ("init", "finish"):
            continue
        if type(rec.get("_seq")) is int and rec["_seq"] in seen:
            continue  # a repeat
        seen.add(rec["_seq"] if type(rec.get("_seq")) is int else -1)
        if _good(rec):
            want.append({**{k: v for k, v in rec.items() if k != "_sid"}, "_sid": sid})
    assert len(odd_at) > 30
    assert landed == want
    # nothing landed with a key twice (the verbatim lines hold what was checked)
    shard = (root / "proj" / "blocks" / "metrics.jsonl").read_bytes()
    assert shard.count(b'"_sid"') == len(want)
    reasons = [q["reason"] for q in lines_of(state / "quarantine" / "index.jsonl")]
    assert sum(r.startswith(("bad record:", "unknown _kind")) for r in reasons) == sum(
        not _good(spooled[at]) for at in odd_at
        if type(spooled[at]["_seq"]) is int and "_event" not in spooled[at])
    assert any(r.startswith("_seq repeat") for r in reasons)
