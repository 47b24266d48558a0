"""Spans (DESIGN 17): time_ms/<path> in the open row, nesting, sums, decorators, threads."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import orjson
import pytest

import expr_tracker as et
from expr_tracker import spans as spans_mod


def rows(run: et.Run) -> list[dict]:
    return [orjson.loads(line) for line in run.shard_path.read_bytes().splitlines()]


def test_spans_add_time_ms_to_the_open_row_nested_and_summed(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path)
    for _ in range(2):
        with et.span("forward"):
            with et.span("attention"):
                time.sleep(0.01)
            with et.span("attention"):
                time.sleep(0.01)
        et.log({"loss": 1.0})
    et.finish()
    got = rows(run)
    assert [r["_step"] for r in got] == [0, 1]  # a span never commits a step
    for r in got:
        assert set(r) == {"_step", "_time", "loss", "time_ms/forward", "time_ms/forward/attention"}
        assert r["time_ms/forward/attention"] >= 20.0  # two spans of one step sum
        assert r["time_ms/forward"] >= r["time_ms/forward/attention"]
        assert "count/forward" not in r


def test_span_count_decorators_sync_async_and_start_span(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path, span_count=True)

    @et.span("data")
    def load(x: int) -> int:
        return x + 1

    @et.span("fetch")
    async def fetch() -> str:
        await asyncio.sleep(0.002)
        async with et.span("parse"):
            pass
        return "ok"

    assert load(1) == 2 and load(2) == 3
    assert asyncio.run(fetch()) == "ok"
    assert load.__name__ == "load"
    epoch = et.start_span("epoch")
    with et.span("eval"):
        inner = et.start_span("batch")  # nests under the span open where it starts
    inner.end()
    epoch.end()
    epoch.end()  # a second end does nothing
    et.log({"loss": 0.5}, step=7)
    et.log({"acc": 0.9}, step=7, commit=True)
    et.finish()
    (r,) = rows(run)
    assert r["_step"] == 7
    assert r["count/data"] == 2 and r["count/fetch"] == 1 and r["count/fetch/parse"] == 1
    assert r["time_ms/fetch"] >= 2.0
    assert r["count/epoch"] == 1 and r["count/eval/batch"] == 1 and "time_ms/epoch/eval" not in r
    assert r["loss"] == 0.5 and r["acc"] == 0.9


def test_spans_after_the_last_log_land_in_a_final_row(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path)
    et.log({"loss": 1.0})
    with et.span("save"):
        pass
    et.finish()
    got = rows(run)
    assert [sorted(r) for r in got] == [["_step", "_time", "loss"], ["_step", "_time", "time_ms/save"]]


def test_spans_without_a_run_are_no_ops(tmp_path: Path) -> None:
    with et.span("alone"):
        pass
    et.start_span("alone").end()

    @et.span("alone")
    def f() -> int:
        return 3

    assert f() == 3
    # nothing of that reaches a run started afterwards
    run = et.init("p", "r", dir=tmp_path)
    et.log({"x": 1})
    et.finish()
    assert set(rows(run)[0]) == {"_step", "_time", "x"}
    with et.span("after-finish"):
        pass


def test_threads_keep_their_own_nesting_and_reach_the_row(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path, span_count=True)
    seen: dict[str, list[str]] = {}
    go = threading.Event()

    def worker() -> None:
        with et.span("prefetch"):
            seen["worker"] = spans_mod.open_spans(threading.get_ident())
            go.wait(5)

    with et.span("train"):
        t = threading.Thread(target=worker)
        t.start()
        while "worker" not in seen:
            time.sleep(0.001)
        with et.span("step"):
            seen["main"] = spans_mod.open_spans()
        go.set()
        t.join()
    et.log({"loss": 1.0})
    et.finish()
    assert seen == {"worker": ["prefetch"], "main": ["train", "train/step"]}
    (r,) = rows(run)
    assert r["count/prefetch"] == 1 and r["count/train/step"] == 1 and r["count/train"] == 1


def test_bad_names_fail_at_the_call_naming_the_field(tmp_path: Path) -> None:
    for bad, exc in ((1, TypeError), ("", ValueError), ("a/b", ValueError), ("_x", ValueError)):
        with pytest.raises(exc, match="span name"):
            et.span(bad)  # type: ignore[arg-type]
        with pytest.raises(exc, match="span name"):
            et.start_span(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="span_count"):
        et.init("p", "r", dir=tmp_path, span_count="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_after"):
        et.init("p", "r", dir=tmp_path, probe_after=0)
    assert not (tmp_path / "p").exists()  # nothing half-written


def test_a_span_key_the_row_already_holds_is_added_to_or_replaced(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path)
    with et.span("io"):
        pass
    et.log({"time_ms/io": 1000.0})
    with et.span("io"):
        pass
    et.log({"time_ms/io": "by hand"})  # not a number: the span's time replaces it
    et.finish()
    first, second = rows(run)
    assert 1000.0 < first["time_ms/io"] < 1100.0
    assert isinstance(second["time_ms/io"], float) and second["time_ms/io"] < 100.0


def test_spans_without_a_log_for_long_are_folded_and_still_land_whole(tmp_path: Path) -> None:
    run = et.init("p", "r", dir=tmp_path, span_count=True)
    sink = run._spans
    for i in range(3 * spans_mod.FOLD_AT):
        with et.span("eval"):
            pass
        if i % spans_mod.FOLD_AT == 0:
            with run._lock:
                spans_mod.fold(sink)  # what the background thread does once a second
    assert len(sink.pending) <= spans_mod.FOLD_AT + 1
    et.log({"loss": 1.0})
    et.finish()
    (r,) = rows(run)
    assert r["count/eval"] == 3 * spans_mod.FOLD_AT and r["time_ms/eval"] > 0
    assert "" not in r and "count/" not in r
