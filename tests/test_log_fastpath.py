"""`Run.log`'s hot path against its full path (`Run._log`): the same calls must write the
same lines, raise the same errors and leave the same counters, in direct and spool mode.

The hot path screens a row (a plain dict, finite floats and ints, keys accepted before)
and falls back to the full path for everything else; these tests drive one run through
`expr_tracker.log` (the hot path where it applies) and another through `Run._log` only,
with the clock fixed, and compare the files byte for byte.
"""

from __future__ import annotations

import math
import tempfile
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expr_tracker as et
from expr_tracker import run as run_module
from expr_tracker.run import Run

T = 1_764_410_000.125


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `_time` of a record is T (the hot path reads `run._time`, the full path
    `time.time`)."""
    import time

    monkeypatch.setattr(run_module, "_time", lambda: T)
    monkeypatch.setattr(run_module, "time",
                        types.SimpleNamespace(time=lambda: T, monotonic=time.monotonic))


def _start(root: Path, spool: bool, current: bool) -> Run:
    kwargs: dict[str, Any] = {"dir": root / "runs", "system_metrics": False}
    if spool:
        kwargs.update(upload_mode="spool", spool_dir=root / "spool")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no exprd here: the spool file only grows
        return et.init("p", "r", **kwargs) if current else Run("p", "r", **kwargs)


def _lines(run: Run) -> list[bytes]:
    """The record lines this run wrote (spool mode: its spool segments, in order,
    without the init, marker and finish events, which name the session)."""
    if run.mode == "spool":
        from expr_tracker.store.layout import spool_segment

        last = Path(run._sink.path)
        prefix = spool_segment(last.name)[0]
        paths = sorted((p for p in last.parent.glob("*.jsonl")
                        if spool_segment(p.name)[0] == prefix),
                       key=lambda p: spool_segment(p.name)[1])
    else:
        paths = [run.shard_path]
    lines = [x for p in paths for x in p.read_bytes().splitlines()]
    return [x for x in lines if not x.startswith(b'{"_event"')]


def _outcome(call: Any) -> tuple[str, str] | None:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _compare(calls: list[tuple[Any, Any, Any]], spool: bool) -> tuple[list[bytes], list[bytes]]:
    """Run `calls` through `et.log` (taken before init, as a user's `from expr_tracker
    import log` would be) and through `Run._log`; assert the same outcomes, counters and
    lines, and return both runs' lines."""
    log = et.log
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backward steps warn once, on both
        hot = _start(Path(a), spool, current=True)
        full = _start(Path(b), spool, current=False)
        try:
            for data, step, commit in calls:
                got = _outcome(lambda: log(data, step, commit))  # noqa: B023
                want = _outcome(lambda: full._log(data, step, commit))  # noqa: B023
                assert got == want, (data, step, commit)
            for key in ("rows", "step", "last_step", "dropped"):
                assert hot.info()[key] == full.info()[key], key
            assert hot._rows_committed == full._rows_committed
        finally:
            hot.finish()
            full.finish()
        mine, theirs = _lines(hot), _lines(full)
    assert mine == theirs
    return mine, theirs


# -- hypothesis: any mix of calls ------------------------------------------------------

COMMON = ["loss", "lr", "acc", "gn"]
ODD_KEYS = ["", "_r", "\ud800", "x/y", "é", 'a"b', "null", 1, ("t",)]
# values at the edge of the hot path's screen, then values no row may hold
EDGE_VALUES = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308,
               2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64,
               True, False, None, "", "NaN"]
BAD_VALUES = [[1], {"a": 1}, b"x", 1j, object()]

finite = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**62), 2**62))
# rows the hot path takes, rows that differ from one in a single key or value (the edge
# of its screen), and anything else
key = st.one_of(st.sampled_from(COMMON), st.sampled_from(ODD_KEYS))
edge_value = st.one_of(st.sampled_from(EDGE_VALUES), st.sampled_from(EDGE_VALUES), st.floats(),
                       st.integers(-(2**66), 2**66))
value = st.one_of(finite, edge_value, st.sampled_from(BAD_VALUES), st.text(max_size=3))
plain_row = st.dictionaries(st.sampled_from(COMMON), finite, min_size=1, max_size=4)
edge_row = st.one_of(
    st.tuples(plain_row, st.sampled_from(COMMON), edge_value),  # a value at the edge
    st.tuples(plain_row, st.sampled_from(ODD_KEYS), finite),  # a key the screen must stop
).map(lambda t: {**t[0], t[1]: t[2]})
odd_row = st.dictionaries(key, value, max_size=4)
row = st.one_of(plain_row, edge_row, edge_row, edge_row, odd_row, odd_row.map(types.MappingProxyType),
                st.sampled_from([[("a", 1.0)], None, 3]))
# mostly neither a step nor commit (the hot path's calls)
step = st.one_of(*[st.none()] * 6, st.integers(0, 60), st.sampled_from([-1, 2**53, 2**53 + 1, 1.5, True]))
commit = st.sampled_from([None] * 8 + [True, False, "yes"])
# the first row makes every COMMON key known, so the hot path is open from the second
WARM = (dict.fromkeys(COMMON, 0.5), None, None)
calls = st.lists(st.tuples(row, step, commit), min_size=10, max_size=50).map(lambda c: [WARM, *c])


@pytest.mark.parametrize("spool", [False, True], ids=["direct", "spool"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=calls)
def test_hot_and_full_paths_write_the_same_lines(fixed_clock: None, spool: bool,
                                                 calls: list[tuple[Any, Any, Any]]) -> None:
    _compare(calls, spool)


# -- many rows, as a training loop logs them --------------------------------------------

def _training_calls(n: int) -> Iterator[tuple[Any, Any, Any]]:
    """Mostly the same keys, floats and ints; now and then a NaN, a new key, a string,
    an int past 2**53, an open row (commit=False) or an explicit step."""
    for i in range(n):
        data: dict[str, Any] = {"loss": 1.0 / (i + 1), "lr": 3e-4 * (i % 7), "tokens": i * 4096}
        if i % 97 == 5:
            data["loss"] = math.nan
        if i % 131 == 7:
            data["grad_norm"] = -math.inf
        if i > 1000:
            data["eval/acc"] = i / 3.0
        if i % 211 == 3:
            data["phase"] = "eval"
        if i % 307 == 11:
            data["tokens"] = 2**53 + i
        if i % 401 == 13:
            yield {"extra": 1.0}, None, False
        yield data, (i + 1000 if i == 2500 else None), None


@pytest.mark.parametrize("spool", [False, True], ids=["direct", "spool"])
def test_many_training_rows_write_the_same_lines(fixed_clock: None, spool: bool) -> None:
    mine, _ = _compare(list(_training_calls(4000)), spool)
    # each open row (commit=False) merges into the next, and so does the explicit step
    assert len(mine) == 4000 - 1
    records = [orjson.loads(x) for x in mine]
    assert records[5]["loss"] == "NaN" and records[7]["grad_norm"] == "-Infinity"
    assert [r["_step"] for r in records[2499:2502]] == [2499, 3500, 3501]


# -- threads, and the binding of expr_tracker.log -------------------------------------

def test_rows_from_several_threads_all_land_in_step_order(tmp_path: Path) -> None:
    run = et.init("p", "threads", dir=tmp_path, system_metrics=False)
    log = et.log

    def work(k: int) -> None:
        for i in range(2000):
            log({"loss": float(i), "worker": k})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert run.info()["rows"] == 8000 and run.info()["last_step"] == 7999
    et.finish()
    records = [orjson.loads(x) for x in run.shard_path.read_bytes().splitlines()]
    assert [r["_step"] for r in records] == list(range(8000))
    for k in range(4):
        assert [r["loss"] for r in records if r["worker"] == k] == [float(i) for i in range(2000)]


def test_log_taken_before_init_follows_the_current_run(tmp_path: Path) -> None:
    from expr_tracker import log

    with pytest.raises(et.UsageError, match="no active run"):
        log({"loss": 1.0})
    first = et.init("p", "one", dir=tmp_path)
    log({"loss": 1.0})
    log({"loss": 2.0})
    et.finish()
    with pytest.raises(et.UsageError, match="no active run"):
        log({"loss": 3.0})
    with pytest.raises(et.UsageError, match="no active run"):
        log({})
    with pytest.raises(et.UsageError, match="this run is finished"):
        first.log({"loss": 3.0})
    second = et.init("p", "two", dir=tmp_path)
    log({"loss": 4.0})
    et.finish()
    assert [orjson.loads(x)["loss"] for x in first.shard_path.read_bytes().splitlines()] == [1.0, 2.0]
    assert [orjson.loads(x)["loss"] for x in second.shard_path.read_bytes().splitlines()] == [4.0]
    assert log.__self__ is et.log.__self__  # one binding, whatever run is current


def test_bad_values_after_many_good_rows_still_raise_naming_the_key(tmp_path: Path) -> None:
    run = et.init("p", "bad", dir=tmp_path, system_metrics=False)
    for i in range(300):
        et.log({"loss": float(i), "n": i})
    for value, error in ((2**63, ValueError), ([1.0], TypeError), ("x" * (2**20 + 1), ValueError)):
        with pytest.raises(error, match="'loss'"):
            et.log({"n": 1, "loss": value})
    with pytest.raises(ValueError, match="reserved"):
        et.log({"loss": 1.0, "_n": 1})
    assert run.info()["rows"] == 300  # nothing half-written
    et.finish()
    assert len(run.shard_path.read_bytes().splitlines()) == 300
