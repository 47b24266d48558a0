"""Names on disk and their validation (DESIGN 3)."""

from __future__ import annotations

import pytest

from expr_tracker.store import layout


@pytest.mark.parametrize(
    ("stream", "rank", "stem"),
    [(None, 0, "metrics"), (None, 2, "metrics.rank2"), ("data", 0, "metrics.data"), ("data", 2, "metrics.data.rank2")],
)
def test_shard_names_roundtrip(stream, rank, stem):
    assert layout.shard_stem(stream, rank) == stem
    parsed = layout.parse_shard_name(f"{stem}.jsonl")
    assert parsed == layout.ShardName(stream, rank)


def test_non_shard_files_are_not_shards():
    for name in ("alerts.jsonl", "metrics.rank2.meta.json", "metrics.jsonl.torn", "notes.txt"):
        assert layout.parse_shard_name(name) is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("", "must not be empty"),
        ("x" * 129, "at most 128"),
        ("a/b", "'/'"),
        ("a..b", r"'\.\.'"),
        ("..", r"'\.\.'"),
        (".hidden", "start with '.'"),
        ("a\x00b", "NUL"),
        ("a b", "may hold only"),
    ],
)
@pytest.mark.parametrize("field", ["project", "name"])
def test_bad_names_raise_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match) as info:
        layout.validate_name(value, field)
    assert str(info.value).startswith(field)


def test_stream_like_rank_rejected():
    with pytest.raises(ValueError, match="stream 'rank3'"):
        layout.validate_stream("rank3")
    assert layout.validate_stream("data") == "data"
    assert layout.validate_stream(None) is None


def test_paths_stay_under_root(tmp_path):
    paths = layout.shard_paths(tmp_path, "proj", "run", "data", 3)
    assert paths.shard == tmp_path / "proj" / "run" / "metrics.data.rank3.jsonl"
    assert paths.sidecar == tmp_path / "proj" / "run" / "metrics.data.rank3.meta.json"
    assert paths.shard.resolve().is_relative_to(tmp_path.resolve())
