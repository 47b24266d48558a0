"""The health detectors as pure functions over a RunState (no files, no processes)."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from expr_tracker.health.config import HealthConfig
from expr_tracker.health.detect import Memory, detect
from expr_tracker.health.state import RankState, RunState

CFG = HealthConfig(straggler_steps=5, slowdown_steps=5, hang_after=60.0)


def _state(durations: dict[int, list[float]], now: float) -> RunState:
    """Ranks whose step rows are `durations` apart, the last one written at `now`."""
    ranks = {}
    for rank, gaps in durations.items():
        times = [now - sum(gaps)]
        for g in gaps:
            times.append(times[-1] + g)
        steps = list(range(len(times)))
        ranks[rank] = RankState(rank=rank, stream=None, path=Path(f"metrics.rank{rank}.jsonl"),
                                host="node0", last_step=steps[-1], last_write=now,
                                steps=steps, times=times, world_size=len(durations))
    return RunState(run_dir=Path("."), stream=None, ranks=ranks, rank_records={}, read_time=now)


def _kinds(findings: list) -> set[tuple[str, tuple[int, ...]]]:
    return {(f.kind, f.ranks) for f in findings}


def test_a_steady_job_has_no_finding() -> None:
    now = time.time()
    assert detect(_state({r: [0.1] * 30 for r in range(4)}, now), [], CFG, Memory(), now) == []


def test_a_slow_rank_is_a_straggler() -> None:
    now = time.time()
    gaps = {r: [0.1] * 30 for r in range(4)}
    gaps[2] = [0.2] * 30
    assert ("straggler", (2,)) in _kinds(detect(_state(gaps, now), [], CFG, Memory(), now))


def test_the_whole_job_slowing_down_is_one_slowdown() -> None:
    now = time.time()
    # every rank went from 100 ms to 200 ms a step: no rank stands out, the job slowed
    gaps = {r: [0.1] * 20 + [0.2] * 10 for r in range(4)}
    found = _kinds(detect(_state(gaps, now), [], CFG, Memory(), now))
    assert ("slowdown", (0, 1, 2, 3)) in found
    assert not any(kind == "straggler" for kind, _ in found)


def test_sub_millisecond_noise_is_not_a_slowdown() -> None:
    now = time.time()
    # 0.3 ms steps with jitter: 1.5x above the best window, but 0.15 ms a step is timer noise
    gaps = {r: [0.0003] * 20 + [0.00045] * 10 for r in range(4)}
    assert detect(_state(gaps, now), [], CFG, Memory(), now) == []


def test_a_silent_live_rank_is_a_hang_once_another_advanced() -> None:
    now = time.time()
    state = _state({r: [0.1] * 30 for r in range(3)}, now)
    silent = state.ranks[1]
    silent.last_write = now - 120.0
    silent.last_step = 5
    assert ("hang", (1,)) in _kinds(detect(state, [], CFG, Memory(), now))


def test_a_hang_resolves_only_when_the_rank_writes_again() -> None:
    """A watcher with other thresholds (no hang finding) must not resolve another's hang."""
    from expr_tracker.health.incidents import Incident, plan

    now = time.time()
    state = _state({r: [0.1] * 30 for r in range(3)}, now)
    state.ranks[1].last_write = now - 120.0
    hang = Incident(kind="hang", ranks=(1,), hosts=("node0",), step=5, first_seen=now - 60.0,
                    last_seen=now - 60.0, detail="rank 1 has written nothing")
    kept = plan([hang], [], now, state)
    assert kept.resolved == [] and [i.kind for i in kept.still_open] == ["hang"]
    state.ranks[1].last_write = now  # it wrote again
    assert [i.kind for i in plan([hang], [], now, state).resolved] == ["hang"]
    # a straggler is a matter of thresholds: no finding, no incident
    slow = Incident(kind="straggler", ranks=(2,), hosts=("node0",), step=5, first_seen=now,
                    last_seen=now, detail="rank 2 is slow")
    assert [i.kind for i in plan([slow], [], now, state).resolved] == ["straggler"]


def test_ranks_leaving_do_not_make_the_rest_a_slowdown() -> None:
    """Two fast ranks finish; the slow one left is no slower than it always was."""
    now = time.time()
    memory = Memory()
    gaps = {0: [0.05] * 30, 1: [0.05] * 30, 2: [0.15] * 30, 3: [0.05] * 30}
    detect(_state(gaps, now), [], CFG, memory, now)
    state = _state(gaps, now)
    state.ranks[0].status = state.ranks[1].status = "finished"
    found = _kinds(detect(state, [], CFG, memory, now))
    assert not any(kind == "slowdown" for kind, _ in found), found


def _old_window_means(vals: list[float], n: int) -> list[float]:
    """The slowdown detector's window means before issue 24 (a Python loop), the reference."""
    if len(vals) < n:
        return []
    total = sum(vals[:n])
    out = [total / n]
    for i in range(n, len(vals)):
        total += vals[i] - vals[i - n]
        out.append(total / n)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 1e6) | st.sampled_from([0.1, 0.2, 0.3, 1e-9, 7.0]),
                max_size=80), st.integers(1, 30))
def test_slow_windows_are_the_running_means_of_before(vals: list[float], n: int) -> None:
    from expr_tracker.health.detect import _slow_windows

    means = _old_window_means(vals, n)
    assert _slow_windows(vals, n) == ((min(means), means[-1]) if means else None)
