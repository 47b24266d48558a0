"""Direct mode's writer thread under what users do (issue 52 item 5, attacked): rows
faster than a healthy root takes them."""

from __future__ import annotations

import json

import pytest

import expr_tracker as et


def test_a_healthy_root_slower_than_the_rows_drops_buffer_full_not_root_hung(tmp_path):
    """Rows of 0.9 MB logged back to back outrun the writer on a local disk: the oldest
    are dropped, counted as `buffer_full`. `root_hung` ("the run root does not answer")
    is for a file operation that has not returned for HUNG_AFTER s, not for one that is
    merely running when the queue overflows."""
    run = et.init("p", "r", dir=tmp_path / "runs", spool_dir=tmp_path / "spool")
    run._sink.writer.queue_bytes = 8 * 1024 * 1024
    row = {"blob": "x" * 900_000, "i": 0}
    with pytest.warns(RuntimeWarning, match="rows come faster than the run root takes them"):
        for i in range(300):
            row["i"] = i
            et.log(row)
    dropped = dict(run.info()["dropped"])
    et.finish()
    assert dropped.get("buffer_full", 0) > 0, dropped  # the queue did overflow
    assert "root_hung" not in dropped, dropped
    shard = tmp_path / "runs" / "p" / "r" / "metrics.jsonl"
    written = [json.loads(line) for line in shard.read_bytes().splitlines()]
    rows = [r["i"] for r in written if "_kind" not in r]
    assert rows == sorted(rows) and len(rows) + dropped["buffer_full"] == 300
