"""The query views' setup reads each sampled shard's head once (for the bare-value check
and the key sample, issue 24), parses it a block at a time, and the `metrics` view
leaves out lines that are rank records by their text before typing them: the same
answers as before, on the same synthetic runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expr_tracker.store import records
from expr_tracker.views import duckcopy, sql
from tests.conftest import T0
from tests.test_views_schema import _answers
from tests.views_runs import shard_name

RANKS = 12

HEADS = [
    b'{"_step":0,"loss":1.5,"tag":"a"}\n{"_kind":"rank","_step":0,"step_time":0.5}\n',
    b'{"_step":0,"loss":"NaN","n":null}\n{"_step":1,"loss":"-Infinity","ok":true}\n',
    b'{"_step":0,"loss":"\\u004eaN"}\n{"_step":1,"loss":2}\n',  # an escaped "NaN"
    b'{"_step":0,"loss":NaN}\n{"_step":1,"loss":1.0}\n',  # a bare NaN token
    b'{"_step":0,"loss":1}\n\n{"_step":1,"lo\n[1, 2]\n5\n{"_step":2,"x":"y"}\n',
    b'{"_step":0,"loss":1}\n{"_step":1,"loss":2',  # an unterminated last line
    b'{"_step":0,"a":{"b":1}}\r\n {"_step":1,"a":[1]}\n',
    b"",
]


def _old_sample_keys(paths):
    """`sample_keys` as it was: every line of each head parsed on its own."""
    out = {}
    for path in sql._spread(paths):
        data = Path(path).read_bytes()[:sql.SAMPLE_BYTES]
        for _, line in records.iter_lines(data):
            try:
                rec = records.loads(line)
            except ValueError:
                continue
            where = "rank" if rec.get("_kind") == "rank" else "step"
            for k, v in rec.items():
                if k[:1] == "_":
                    continue
                info = out.setdefault(k, {"step": False, "rank": False, "numeric": True, "seen": False})
                info[where] = True
                if v is not None:
                    info["seen"] = True
                    if type(v) not in (int, float):
                        info["numeric"] = False
    return out


@pytest.mark.parametrize("i", range(len(HEADS)))
def test_the_key_sample_by_blocks_is_the_line_by_line_one(tmp_path, i):
    paths = []
    for j, data in enumerate([HEADS[i], HEADS[0]]):
        p = tmp_path / f"metrics.rank{j}.jsonl"
        p.write_bytes(data)
        paths.append(p)
    heads = {str(p): sql.head(p) for p in paths}
    assert sql.sample_keys(paths, heads) == sql.sample_keys(paths) == _old_sample_keys(paths)


def _run(run):
    """RANKS shards: step rows and rank records, a rank record with `_kind` not first,
    one naming `_kind` twice, a step row holding {"_kind": "rank"} in a value, and
    `_kind` values that only start like "rank"."""
    for r in range(RANKS):
        lines = []
        for s in range(15):
            lines.append(json.dumps({"_step": s, "_time": T0 + s, "loss": "NaN" if s == 3 else s / 7,
                                     "note": {"_kind": "rank"} if s == 4 else None},
                                    separators=(",", ":")).encode())
            lines.append(json.dumps({"_kind": "rank", "_step": s, "_time": T0 + s, "_rank": r,
                                     "step_time": 0.5 + r}, separators=(",", ":")).encode())
        lines += [b'{"_step":20,"_kind":"rank","step_time":9.0}',
                  b'{"_kind":"rank","_kind":null,"_step":21,"loss":1.0}',
                  b'{"_kind":"ranked","_step":22,"loss":1.0}',
                  b'{"_kind":null,"_step":23,"loss":2.0}',
                  b' {"_kind":"rank","_step":24,"step_time":1.0}']
        path = run / shard_name(r)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\n".join(lines) + b"\n")
    return run


def test_leaving_rank_lines_out_by_their_text_changes_no_answer(tmp_path, monkeypatch):
    run = _run(tmp_path / "run")
    monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
    monkeypatch.setattr(sql, "SAMPLE_SHARDS", 4)
    with sql.connect(run) as con:
        view = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'metrics'").fetchone()[0]
    import duckdb

    if int(duckdb.__version__.split(".")[0]) >= 2:
        assert "starts_with" in view
    left_out = _answers(run)
    monkeypatch.setattr(duckcopy, "NOT_RANK_LINE", "true")
    kept = _answers(run)
    assert left_out == kept
    steps = {row[2] for row in left_out["metrics"]}
    assert steps == set(range(15)) | {23}  # a null `_kind` is a step row, "ranked" none
    # `_kind` not first, named twice (DuckDB takes the first), an indented line
    assert {row[2] for row in left_out["ranks"]} == set(range(15)) | {20, 21, 24}
    assert len(left_out["ranks"]) == RANKS * (15 + 3)


def test_each_sampled_head_is_read_once(tmp_path, monkeypatch):
    run = _run(tmp_path / "run")
    monkeypatch.setattr(sql, "EXACT_SHARDS", 0)
    monkeypatch.setattr(sql, "SAMPLE_SHARDS", 4)
    reads: list[str] = []
    real = sql.head
    monkeypatch.setattr(sql, "head", lambda p: reads.append(str(p)) or real(p))
    with sql.connect(run):
        pass
    assert reads and len(reads) == len(set(reads))


def _old_records_only(data: bytes) -> bool:
    """`records_only` as it was: the regex for a line that does not start an object."""
    if not sql._NOT_AN_OBJECT.search(data):
        return True
    for _, line in records.iter_lines(data):
        if line.strip() and not line.lstrip().startswith(b"{"):
            try:
                json.loads(line)
            except ValueError:
                continue
            return False
    return True


@pytest.mark.parametrize("data", [*HEADS, b"{}", b"{", b"\n", b"\n\n{}\n", b" {}\n\t{}\r\n",
                                  b'{}\n"x"\n', b"{}\n  5", b"{}\n[", b"{}\n{}\nnull\n",
                                  b"{}\n{}"])
def test_the_bare_value_check_counts_first_and_answers_as_the_regex(tmp_path, data):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(data)
    assert sql.records_only(str(path)) == sql.records_only(str(path), data) == _old_records_only(data)
