"""The SDK under faults (issue 10): real processes, real files, real full filesystems."""

from __future__ import annotations

import json

import pytest

import expr_tracker as et

from .procs import run_all, spawn


@pytest.fixture(autouse=True)
def _finish():
    yield
    et.finish()


# -- case 10: a stream that spells another rank's shard ------------------------------


def test_stream_with_a_rank_segment_is_refused_at_init(tmp_path):
    """Rank 0 of stream `data.rank2` would write rank 2 of stream `data`'s shard."""
    code = f"""
    import json, expr_tracker as et
    try:
        et.init("p", "r", dir={str(tmp_path)!r}, stream="data.rank2")
    except ValueError as exc:
        print(json.dumps({{"error": str(exc)}}))
    else:
        et.log({{"x": 1}})
        et.finish()
        print(json.dumps({{"error": None}}))
    """
    (out,) = run_all([spawn(code, {"RANK": "0", "WORLD_SIZE": "4"})])
    assert json.loads(out)["error"] is not None and "data.rank2" in json.loads(out)["error"]
    run_all([spawn(code.replace('stream="data.rank2"', 'stream="data"'), {"RANK": "2", "WORLD_SIZE": "4"})])
    shard = tmp_path / "p" / "r" / "metrics.data.rank2.jsonl"
    assert [json.loads(x)["x"] for x in shard.read_text().splitlines()] == [1]


@pytest.mark.parametrize("stream", ["rank2.data", "a.rank10.b", "x.rank0"])
def test_rank_segments_anywhere_are_refused(stream):
    with pytest.raises(ValueError, match="^stream"):
        et.init("p", "r", stream=stream)


@pytest.mark.parametrize("stream", ["ranks", "rank", "data.ranking2", "prerank2"])
def test_rank_like_words_are_fine(stream, tmp_path):
    run = et.init("p", "r", dir=tmp_path, stream=stream)
    et.finish()
    assert run.stream == stream
