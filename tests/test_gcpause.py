"""`paused_gc`: no automatic collection inside, the collector as it was after."""

from __future__ import annotations

import gc

import pytest

from expr_tracker.gcpause import paused_gc


def test_paused_inside_and_restored_after_even_on_error() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: still paused, and the outer one restores
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("a read failed")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_scan_runs_without_collections(tmp_path) -> None:
    """What the pause is for: a scan of many shards sets off no collection."""
    import json

    from expr_tracker.stats.scan import scan_all

    paths = []
    for r in range(40):
        p = tmp_path / f"metrics.rank{r}.jsonl"
        p.write_text("".join(json.dumps({"_kind": "rank", "_step": s, "_rank": r, "x": s})
                             + "\n" for s in range(300)))
        paths.append(str(p))
    counts = []
    real, real_enable = gc.disable, gc.enable

    def disabled() -> None:  # the moment the pause starts: count from there ...
        real()
        counts.append(gc.get_stats()[0]["collections"])

    def enabled() -> None:  # ... to the moment it ends
        counts.append(gc.get_stats()[0]["collections"])
        real_enable()

    thresholds = gc.get_threshold()
    gc.set_threshold(100)  # (a collection every 100 allocations, were it on)
    gc.disable, gc.enable = disabled, enabled
    try:
        scans = scan_all(paths)
    finally:
        gc.disable, gc.enable = real, real_enable
        gc.set_threshold(*thresholds)
    assert all(sc.blocks for sc in scans)
    assert len(counts) == 2 and counts[0] == counts[1]
