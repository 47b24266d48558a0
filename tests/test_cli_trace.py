"""`expr trace` and `expr summary --spans` over a real 2-rank job with trace_spans=True."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.procs import run_all, spawn

RANK_CODE = """
    import os, time, expr_tracker as et
    rank = int(os.environ["RANK"])
    et.init("proj", "traced", dir={root!r}, trace_spans=True)
    for i in range(12):
        with et.span("data"):
            time.sleep(0.002 + 0.006 * rank)   # rank 1 is the straggler, in data
        with et.span("step"):
            with et.span("forward"):
                time.sleep(0.002)
        et.log({{"loss": 1.0 / (i + 1)}})
    et.finish()
"""


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trace-root")
    procs = [spawn(RANK_CODE.format(root=str(root)), {"RANK": str(r), "WORLD_SIZE": "2",
                                                      "LOCAL_RANK": str(r)}) for r in range(2)]
    run_all(procs)
    return root


def cli(*args: str, columns: int = 100):  # type: ignore[no-untyped-def]
    from expr_cli.main import build_app

    return CliRunner().invoke(build_app(), list(args), env={"COLUMNS": str(columns)})


def test_trace_writes_one_chrome_trace_with_a_process_per_rank(traced: Path, tmp_path: Path) -> None:
    spans = [json.loads(line) for line in (traced / "proj" / "traced" / "spans.rank1.jsonl")
             .read_text().splitlines()]
    assert len(spans) == 36 and {s["path"] for s in spans} == {"data", "step", "step/forward"}
    assert set(spans[0]) == {"path", "start", "dur_ms", "step", "thread"}
    assert spans[0]["thread"] == "MainThread" and spans[-1]["step"] == 11

    out = tmp_path / "trace.json"
    result = cli("trace", "traced", "--dir", str(traced), "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["spans"] == 72
    trace = json.load(out.open())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 72 and {e["pid"] for e in complete} == {0, 1}
    assert all(e["ts"] >= 0 and e["dur"] > 0 for e in complete)
    fwd = next(e for e in complete if e["args"]["path"] == "step/forward")
    assert fwd["name"] == "forward" and fwd["dur"] >= 2000  # microseconds

    again = cli("trace", "traced", "--dir", str(traced), "-o", str(out))
    assert again.exit_code == 1 and "exists; pass --force" in again.output
    missing = cli("trace", "nope", "--dir", str(traced), "-o", str(tmp_path / "x.json"))
    assert missing.exit_code == 1 and "no run 'nope'" in missing.output
    inside = cli("trace", "traced", "--dir", str(traced), "-o",
                 str(traced / "proj" / "traced" / "t.json"))
    assert inside.exit_code == 1 and "inside the run directory" in inside.output


def test_summary_spans_names_the_phase_that_makes_the_straggler_slow(traced: Path) -> None:
    result = cli("summary", "traced", "--dir", str(traced), "--spans", "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    assert view["straggler"] == 1 and view["steps"] == [0, 12]
    first = view["spans"][0]
    assert first["path"] == "data" and first["max_rank"] == 1 and first["ranks"] == 2
    assert first["excess_ms"] > 2.0 and first["ratio"] > 1.3
    assert {s["path"] for s in view["spans"]} == {"data", "step", "step/forward"}
    text = cli("summary", "traced", "--dir", str(traced), "--spans")
    assert text.exit_code == 0, text.output
    assert "straggler: rank 1" in text.stdout and text.stdout.index("data") < text.stdout.index("forward")
    # at 80 columns every row on one line, the span names whole (the title, a pipe's one line)
    narrow = cli("summary", "traced", "--dir", str(traced), "--spans", columns=80).stdout
    rows = narrow.splitlines()[4:]
    assert len(rows) == 3 and all(len(r) <= 80 for r in rows), narrow
    assert sorted(r.split()[0] for r in rows) == ["data", "step", "step/forward"]
    assert "2 ranks report each span" in narrow
    assert rows[0].split()[0] == "data" and rows[0].split()[-3:-1] == ["rank", "1"], narrow


def test_trace_and_spans_of_a_run_without_spans_are_one_line_errors(tmp_path: Path) -> None:
    import expr_tracker as et

    et.init("proj", "plain", dir=tmp_path)
    et.log({"loss": 1.0})
    et.finish()
    result = cli("trace", "plain", "--dir", str(tmp_path), "-o", str(tmp_path / "t.json"))
    assert result.exit_code == 1 and "no span trace" in result.output
    assert not (tmp_path / "t.json").exists()
    spans = cli("summary", "plain", "--dir", str(tmp_path), "--spans")
    assert spans.exit_code == 1 and "no span times" in spans.output
