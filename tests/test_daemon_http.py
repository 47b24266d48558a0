"""exprd forwarding to an http receiver that de-duplicates by Idempotency-Key, through kill -9.

The issue's test: `kill -9` of exprd during forwarding and a restart leave the receiver
with every event exactly once by key, and a repeated key always carries the same body.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from werkzeug import Request, Response

from tests.procs import run_all, spawn
from tests.test_daemon import start_exprd, stop, wait_for, wait_ready, write_config, writer_code

RUN_BACKENDS = (', backend_on_rank=None, '
                'backends=[{"type": "http", "url": "http://127.0.0.1:9/not-used"}]')


class Receiver:
    """Stores one body per Idempotency-Key, as an idempotent ingest endpoint would."""

    def __init__(self, seed: int, delay: tuple[float, float] = (0.002, 0.01)) -> None:
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.delay = delay
        self.bodies: dict[str, bytes] = {}
        self.ids: set[str] = set()
        self.posts = 0
        self.violations: list[str] = []  # checked after the run: never raise in the server

    def __call__(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        body = request.get_data()
        with self.lock:
            delay = self.rng.uniform(*self.delay)
        time.sleep(delay)  # a slow receiver: exprd gets killed with POSTs in flight
        with self.lock:
            self.posts += 1
            old = self.bodies.get(key)
            if old is None:
                self.bodies[key] = body
                self.ids.update(e["_id"] for e in json.loads(body)["events"])
            elif old != body:
                self.violations.append(key)
        return Response("ok")

    def stored(self) -> list[str]:
        """The event ids of every distinct key, with repeats (what the receiver holds)."""
        with self.lock:
            return [e["_id"] for b in self.bodies.values() for e in json.loads(b)["events"]]


def _overlaps(recv: Receiver) -> str:
    """The first keys whose events another key holds too (what a failure needs to show:
    which batches were cut again, and where)."""
    seen: dict[str, str] = {}
    pairs = []
    with recv.lock:
        for key, body in recv.bodies.items():
            for e in json.loads(body)["events"]:
                other = seen.setdefault(e["_id"], key)
                if other != key:
                    pairs.append(f"{e['_id']} in {other} and {key}")
                    break
    return "; ".join(pairs[:5])


def test_kill9_during_forwarding_leaves_every_event_once_by_key(
    tmp_path: Path, httpserver: Any
) -> None:
    writers, n, kills = 3, 37 * 100, 8
    recv = Receiver(seed=7)
    httpserver.expect_request("/ingest", method="POST").respond_with_handler(recv)
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    backend = (f'[backends.http]\ntype = "http"\nurl = {json.dumps(httpserver.url_for("/ingest"))}\n'
               "batch = 50\nbackoff = 0.05\n")
    tuning = "checkpoint_interval = 0.2\n"
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root], extra=tuning + backend)
    total = writers * n
    rng = random.Random(20251130)
    progress, journaled, procs = [], [], []
    for _ in range(kills):
        d = start_exprd(cfg)
        wait_ready(state, d)
        if not procs:
            # writers start once exprd runs, so it forwards live, in the batches it finds
            procs = [spawn(writer_code(spool, root, "fwd", n, chunk=37, pause=0.05,
                                       init=RUN_BACKENDS),
                           {"RANK": str(r), "WORLD_SIZE": str(writers)}) for r in range(writers)]
        time.sleep(rng.uniform(0.1, 0.6))
        journaled.append(any((state / "batches").glob("*.jsonl")))
        d.kill()  # SIGKILL: POSTs in flight, queues lost, checkpoints maybe stale
        d.wait()
        progress.append(len(recv.ids))
    run_all(procs)
    # the last run deletes finished spool files, and their batch journals with them
    write_config(cfg, spool, state, [root], extra="retention = 0\n" + tuning + backend)
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        wait_for(lambda: len(recv.ids) >= total, 30, "the receiver to hold every event")
        wait_for(lambda: not list(spool.rglob("*.jsonl")), 15, "retention of the spool files")
    finally:
        assert stop(d) == 0
    # some kills must have landed while events were being forwarded
    assert any(0 < p < total for p in progress), progress
    assert recv.violations == [], f"keys repeated with another body: {recv.violations[:5]}"
    stored = recv.stored()
    sessions = {i.split(":")[0] for i in stored}
    assert len(sessions) == writers
    expected = sorted(f"{s}:{q}" for s in sessions for q in range(1, n + 1))
    dupes = len(stored) - len(set(stored))
    assert dupes == 0, (f"{dupes} events stored twice under different keys; "
                        f"{_overlaps(recv)}; received after each kill: {progress}")
    assert sorted(stored) == expected
    assert recv.posts > len(recv.bodies)  # restarts did re-send batches
    assert any(journaled)
    assert not list((state / "batches").glob("*")), "journals outlived their spool files"
    # one log line per batch would bury what matters: httpx's request lines stay out
    log_text = (tmp_path / "exprd.log").read_text()
    assert "exprd INFO ready" in log_text and "HTTP Request" not in log_text


def test_kill9_while_a_finished_runs_backend_catches_up_cuts_no_batch_again(
    tmp_path: Path, httpserver: Any
) -> None:
    """A run that finished while its backend lags: its shard is done and its status written
    long before the last POST, and the checkpoint is not advanced meanwhile (a finished file
    is checkpointed as such once the backend is done). A kill -9 in that window restarts
    the backend from the checkpoint on disk, so its journal must still hold every batch
    sent since: the events go out again under their old keys, never cut into new ones (the
    journal had been compacted to the backend's progress in memory, and 2,331 events
    reached a receiver twice under different keys). Nor is the run taken for crashed
    meanwhile (its sidecar said "running" until the backend was done)."""
    n = 37 * 54
    recv = Receiver(seed=3, delay=(0.04, 0.06))  # 50 events a POST: about 1,000 a second
    httpserver.expect_request("/ingest", method="POST").respond_with_handler(recv)
    spool, state, root = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    backend = (f'[backends.http]\ntype = "http"\nurl = {json.dumps(httpserver.url_for("/ingest"))}\n'
               "batch = 50\nbackoff = 0.05\n")
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [root],
                       extra="checkpoint_interval = 0.1\n" + backend)
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        # written live, in chunks (each read of the spool file a settle point of the
        # backend), faster than the receiver takes them
        run_all([spawn(writer_code(spool, root, "late", n, chunk=37, pause=0.015,
                                   init=RUN_BACKENDS), {"RANK": "0"})])
        time.sleep(0.3)  # checkpoint rounds after the finish, while the backend catches up
    finally:
        d.kill()
        d.wait()
    sent = len(recv.ids)
    assert sent < n, "the backend was done before the kill: nothing tested"
    recv.delay = (0.0, 0.001)
    d = start_exprd(cfg)
    try:
        wait_ready(state, d)
        wait_for(lambda: len(recv.ids) >= n, 30, "the receiver to hold every event")
    finally:
        assert stop(d) == 0
    stored = recv.stored()
    assert len(stored) - len(set(stored)) == 0, (
        f"events stored twice under different keys, {sent} sent before the kill: "
        f"{_overlaps(recv)}")
    assert len(set(stored)) == n
    assert recv.violations == []
    # the run finished: its status was on disk while the backend caught up, so the
    # process gone was never taken for a crash
    incidents = root / "proj" / "late" / "incidents.jsonl"
    kinds = [json.loads(line)["kind"] for line in incidents.read_text().splitlines()] \
        if incidents.exists() else []
    assert "crashed" not in kinds, incidents.read_text()
