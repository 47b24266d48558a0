"""`expr shards`: a row per shard, sidecar state, read-only."""

from __future__ import annotations

import json


def test_shards_table_matches_golden(cli, golden):
    result = cli("shards", "run-1")
    assert result.exit_code == 0, result.output
    golden("shards_run1.txt", result.stdout)


def test_shards_json_reports_sidecar_states(cli):
    result = cli("shards", "proj/run-1", "--json")
    assert result.exit_code == 0, result.output
    rows = {(r["stream"], r["rank"]): r for r in json.loads(result.stdout)}
    assert len(rows) == 9
    assert rows[(None, 0)]["sidecar"] == "ok" and rows[(None, 0)]["rows"] == 80
    assert rows[(None, 2)]["sidecar"] == "behind" and rows[(None, 2)]["status"] == "running"
    assert rows[(None, 5)]["sidecar"] == "torn tail 36 B" and rows[(None, 5)]["torn_bytes"] == 36
    assert rows[(None, 7)]["sidecar"] == "missing" and rows[(None, 7)]["status"] is None
    # rank 3 skipped two rank records: rows counted from the file, not the sidecar name
    assert rows[(None, 3)]["rows"] == 78
    assert rows[("data", 0)]["last_step"] == 2 and rows[("data", 0)]["rows"] == 3
    assert all(r["last_step"] == 39 for k, r in rows.items() if k[0] is None)


def test_shards_never_modifies_the_run(cli, cli_root):
    run = cli_root / "proj" / "run-1"
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert cli("shards", str(run)).exit_code == 0
    after = {p.name: p.read_bytes() for p in run.iterdir()}
    assert after == before  # the torn tail of rank 5 is still there, no .torn file appeared


def test_shards_stale_sidecar_needs_repair(cli, cli_root):
    side = cli_root / "proj" / "run-1" / "metrics.rank1.meta.json"
    meta = json.loads(side.read_text())
    meta["cursor"]["bytes"] -= 100  # finished, yet the sidecar is behind its file
    side.write_text(json.dumps(meta))
    rows = json.loads(cli("shards", "run-1", "--json").stdout)
    assert [r["sidecar"] for r in rows if r["rank"] == 1] == ["needs repair"]


def test_shards_accepts_a_shard_file(cli, cli_root):
    result = cli("shards", str(cli_root / "proj" / "run-1" / "metrics.rank4.jsonl"), "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 9  # the shard names its run


def test_shards_of_an_empty_run_is_one_error_line(cli):
    result = cli("shards", "hollow")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: run proj/hollow is empty")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_rows_from_the_state_pass_equal_rows_read_again(cli_root):
    """`expr shards` builds each row from what the live state's pass read of the shard
    (`inspect_tail`); it must equal the row of a fresh read (`inspect_shard`) for every
    sidecar state: ok, behind, torn, missing, corrupt, needs repair, a saved .torn file."""
    from expr_cli.data.runs import inspect_shard, inspect_tail
    from expr_cli.resolve import list_shards, resolve_run
    from expr_tracker.health.state import RunReader

    run = cli_root / "proj" / "run-1"
    (run / "metrics.rank6.meta.json").write_text("[1, 2]")  # corrupt: not an object
    side = run / "metrics.rank1.meta.json"
    meta = json.loads(side.read_text())
    meta["cursor"]["bytes"] -= 100  # needs repair
    side.write_text(json.dumps(meta))
    (run / "metrics.rank5.jsonl.torn").write_bytes(b'{"_step": 1')
    ref = resolve_run("run-1", cli_root)
    found = list_shards(ref)
    checked = set()
    for stream in {s.stream for s in found}:
        reader = RunReader(run, stream, window=4)
        state = reader.read()
        names = frozenset(reader.names)
        for s in (s for s in found if s.stream == stream):
            tail = reader.tail(s.rank)
            assert tail is not None and tail.path == s.path
            last = state.ranks[s.rank].last_step
            got, want = inspect_tail(s, tail, names, last), inspect_shard(s, last)
            assert got == want, s.path.name
            checked.add(want["sidecar"].split(" ")[0])
    assert checked >= {"ok", "behind", "torn", "missing", "corrupt", "needs"}


def test_no_stream_column_for_a_run_of_the_default_stream_only(cli, tmp_path):
    import expr_tracker as et

    et.init("p", "plain", dir=tmp_path, system_metrics=False)
    et.log({"loss": 1.0})
    et.finish()
    result = cli("shards", "p/plain", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    header = result.stdout.splitlines()[1].split()
    assert header == ["rank", "file", "rows", "step", "size", "status", "written", "sidecar"]
    assert "stream" in cli("shards", "run-1").stdout.splitlines()[1]  # run-1 has a data stream
