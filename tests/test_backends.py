"""Backends: remote ids, spec parsing, wandb/trackio/http against the real things, the worker."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from werkzeug import Request, Response

from expr_tracker.backends import BackendWorker, Identity, make_backend, reportable
from expr_tracker.backends.http import HttpBackend
from expr_tracker.backends.journal import BatchJournal

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]


def run_py(
    code: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter with the repo on the path."""
    full = dict(os.environ)
    full["PYTHONPATH"] = str(ROOT)
    full.update(env or {})
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        cwd=ROOT,
    )


# --- identities and specs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "rank", "rid"),
    [
        (None, 0, "sft-1"),
        (None, 2, "sft-1-rank2"),
        ("data", 0, "sft-1-data"),
        ("data", 2, "sft-1-data-rank2"),
    ],
)
def test_remote_id_and_group_follow_design_9(stream: str | None, rank: int, rid: str) -> None:
    ident = Identity(project="p", name="sft-1", stream=stream, rank=rank, world_size=4)
    assert ident.remote_id() == rid
    assert ident.group() == "sft-1"
    assert ident.to_dict()["id"] == rid


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "a/b"}, "name"),
        ({"project": ".x"}, "project"),
        ({"stream": "rank3"}, "stream"),
        ({"rank": -1}, "rank"),
    ],
)
def test_identity_rejects_bad_fields(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = {"project": "p", "name": "n"}
    with pytest.raises(ValueError, match=field):
        Identity(**{**base, **kwargs})


def test_reportable_passes_steps_and_converts_rank_records_only_when_asked() -> None:
    step = {"_step": 3, "_time": 1.0, "_id": "s:1", "loss": 0.5}
    rank = {
        "_kind": "rank",
        "_step": 3,
        "_time": 1.0,
        "_rank": 5,
        "_world_size": 8,
        "_id": "s:2",
        "loss": 0.7,
    }
    assert reportable(step, False) == step
    assert reportable(rank, False) is None
    assert reportable(rank, True) == {"_step": 3, "_time": 1.0, "_id": "s:2", "rank/5/loss": 0.7}
    assert reportable({"_kind": "other", "_step": 1}, True) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "type 'nope' is unknown"),
        ({"type": "mlflow"}, "type 'mlflow' is unknown"),
        ({"url": "http://x"}, "type is required"),
        ("http", "url is required"),
        ({"type": "http", "url": "ftp://x"}, "url must start with"),
        ({"type": "http", "url": "http://x", "batch": 0}, "batch must be"),
        ({"type": "http", "url": "http://x", "token": "secret"}, "unknown key 'token'"),
        ({"type": "http", "url": "http://x", "token_env": "A B"}, "token_env"),
        ({"type": "wandb", "mode": "fast"}, "mode must be"),
        ({"type": "trackio", "entity": "e"}, "unknown key 'entity'"),
    ],
)
def test_make_backend_rejects_bad_specs_naming_the_field(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_backend(spec)


def test_make_backend_builds_without_importing_optional_packages() -> None:
    proc = run_py(
        """
        import json, sys
        from expr_tracker.backends import make_backend
        made = [make_backend(s).name for s in
                ("wandb", "trackio", {"type": "http", "url": "http://127.0.0.1:1/x", "batch": 5})]
        print(json.dumps([made, [m for m in ("wandb", "trackio", "httpx") if m in sys.modules]]))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["wandb", "trackio", "http"], []]


def test_missing_package_warns_once_with_install_command_and_run_goes_on() -> None:
    proc = run_py(
        """
        import json, sys, warnings
        sys.modules["wandb"] = None
        sys.modules["trackio"] = None
        from expr_tracker.backends import BackendWorker, Identity, make_backend
        out = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for kind in ("wandb", "trackio"):
                for rank in (0, 1):
                    w = BackendWorker(make_backend(kind), Identity("p", "n", rank=rank))
                    for step in range(5):
                        w.submit({"_step": step, "_time": 0.0, "loss": 1.0})
                    out[f"{kind}{rank}"] = w.close(timeout=1)
        out["warnings"] = [[c.category.__name__, str(c.message)] for c in caught]
        print(json.dumps(out))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [w[0] for w in out["warnings"]] == ["RuntimeWarning", "RuntimeWarning"]
    assert "pip install 'expr-tracker[wandb]'" in out["warnings"][0][1]
    assert "pip install 'expr-tracker[trackio]'" in out["warnings"][1][1]
    for key in ("wandb0", "wandb1", "trackio0", "trackio1"):
        assert out[key]["dropped"] == 5
        assert out[key]["sent"] == 0


# --- wandb ---------------------------------------------------------------------------------


def _wandb_records(run_dirs: Sequence[Path]) -> list[list[dict[str, Any]]]:
    """Read .wandb transaction logs with wandb's own reader (`wandb leet inspect --json`).

    One reader per file, started together: each costs about a second of startup.
    """
    wandb_cli = Path(PY).parent / "wandb"
    procs = []
    for run_dir in run_dirs:
        [log_file] = run_dir.glob("run-*.wandb")
        cmd = [str(wandb_cli), "leet", "inspect", "--json", str(log_file)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        out.append([json.loads(line) for line in stdout.splitlines() if line.strip()])
    return out


def _wandb_children() -> list[str]:
    """Command names of live child processes of this process that belong to wandb."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            comm = fields[0].split("(", 1)[1]
            ppid = int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and "wandb" in comm:
            names.append(comm)
    return names


def test_wandb_offline_runs_land_under_remote_ids_with_group_job_type_and_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(var, str(tmp_path / sub))
    import wandb

    cases = [
        (None, 0, "sft-1", "metrics"),
        (None, 2, "sft-1-rank2", "metrics"),
        ("data", 0, "sft-1-data", "data"),
        ("data", 2, "sft-1-data-rank2", "data"),
    ]
    workers = []
    try:
        for stream, rank, _, _ in cases:
            ident = Identity(
                "proj", "sft-1", stream=stream, rank=rank, world_size=4, config={"lr": 0.1}
            )
            workers.append(BackendWorker(make_backend("wandb"), ident, rank_metrics=True))
        for i, w in enumerate(workers):
            w.submit({"_step": 1, "_time": 1.0, "_id": "s:0", "loss": 1.0 + i, "gn": math.nan})
            w.submit({"_kind": "rank", "_step": 1, "_time": 1.0, "_rank": 3, "loss": 9.0})
            w.submit({"_step": 2, "_time": 2.0, "loss": 0.5, "note": "ok"})
            w.submit({"_step": 1, "_time": 3.0, "loss": 7.0})  # behind: wandb would drop it
            w.submit({"_step": 3, "_time": 4.0, "loss": 0.25})
            w.alert({"title": "loss spike", "text": "loss > 5", "level": "error"})
        stats = [w.close(timeout=30) for w in workers]
    finally:
        wandb.teardown()
    assert _wandb_children() == []
    for st in stats:
        assert (st["sent"], st["dropped"], st["failed"], st["pending"]) == (4, 1, 0, 0), st
        assert st["errors"] == {"wandb: step went backwards": 1}
        assert st["alerts"]["sent"] == 1

    run_dirs = []
    for _, _, rid, _ in cases:
        [run_dir] = (tmp_path / "wandb").glob(f"offline-run-*-{rid}")
        run_dirs.append(run_dir)
    for i, ((_, _, rid, job), records) in enumerate(
        zip(cases, _wandb_records(run_dirs), strict=True)
    ):
        [run] = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == rid
        assert run["display_name"] == rid
        assert run["run_group"] == "sft-1"
        assert run["job_type"] == job
        assert run["project"] == "proj"
        assert run["config"]["update"]["lr"] == 0.1
        rows = {
            r["history"]["step"]["num"]: r["history"]["item"]
            for r in records
            if r["type"] == "history"
        }
        assert sorted(rows) == [1, 2, 3]
        assert rows[1]["loss"] == 1.0 + i
        assert rows[1]["gn"] == "NaN"
        assert rows[1]["rank/3/loss"] == 9.0
        assert (rows[2]["loss"], rows[2]["note"]) == (0.5, "ok")
        assert rows[3]["loss"] == 0.25
        assert all(row["loss"] != 7.0 for row in rows.values())
        [alert] = [r["alert"] for r in records if r["type"] == "alert"]
        assert (alert["title"], alert["text"], alert["level"]) == (
            "loss spike",
            "loss > 5",
            "ERROR",
        )
        [exit_rec] = [r["exit"] for r in records if r["type"] == "exit"]
        assert exit_rec.get("exit_code", 0) == 0


# --- trackio -------------------------------------------------------------------------------


def test_trackio_rows_land_in_sqlite_under_remote_ids_and_group(tmp_path: Path) -> None:
    proc = run_py(
        """
        import json, math
        from expr_tracker.backends import BackendWorker, Identity, make_backend
        workers = [
            BackendWorker(
                make_backend("trackio"),
                Identity("proj", "sft-1", stream=s, rank=r, config={"lr": 0.1}),
            )
            for s, r in ((None, 0), ("data", 2))
        ]
        for i, w in enumerate(workers):
            w.submit({"_step": 1, "_time": 1.0, "loss": 1.0 + i, "gn": math.nan})
            w.submit({"_kind": "rank", "_step": 1, "_time": 1.0, "_rank": 3, "loss": 9.0})
            w.submit({"_step": 2, "_time": 2.0, "loss": 0.5})
            w.alert({"title": "spike", "text": "loss > 5", "level": "warning", "step": 2})
        print(json.dumps([w.close(timeout=30) for w in workers]))
        """,
        env={"TRACKIO_DIR": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    for st in stats:
        assert (st["sent"], st["skipped"], st["failed"], st["dropped"], st["errors"]) == (
            2,
            1,
            0,
            0,
            {},
        )
    [db] = tmp_path.glob("*.db")
    con = sqlite3.connect(db)
    try:
        rows = con.execute(
            "SELECT run_name, step, metrics FROM metrics ORDER BY run_name, step"
        ).fetchall()
        configs = dict(con.execute("SELECT run_name, config FROM configs").fetchall())
        alerts = con.execute(
            "SELECT run_name, title, text, level, step FROM alerts ORDER BY run_name"
        ).fetchall()
    finally:
        con.close()
    assert [(r[0], r[1], json.loads(r[2])) for r in rows] == [
        ("sft-1", 1, {"loss": 1.0, "gn": "NaN"}),
        ("sft-1", 2, {"loss": 0.5}),
        ("sft-1-data-rank2", 1, {"loss": 2.0, "gn": "NaN"}),
        ("sft-1-data-rank2", 2, {"loss": 0.5}),
    ]
    for rid in ("sft-1", "sft-1-data-rank2"):
        config = json.loads(configs[rid])
        assert (config["_Group"], config["lr"]) == ("sft-1", 0.1)
    assert alerts == [
        ("sft-1", "spike", "loss > 5", "warn", 2),
        ("sft-1-data-rank2", "spike", "loss > 5", "warn", 2),
    ]


# --- http ----------------------------------------------------------------------------------


class Recorder:
    """A request handler for pytest-httpserver that records requests and replays a status script."""

    def __init__(self, statuses: Sequence[int | tuple[int, dict[str, str]]] = ()) -> None:
        self.statuses = list(statuses)
        self.seen: list[tuple[float, dict[str, str], bytes]] = []

    def __call__(self, request: Request) -> Response:
        self.seen.append((time.monotonic(), dict(request.headers), request.get_data()))
        item = self.statuses.pop(0) if self.statuses else 200
        status, headers = item if isinstance(item, tuple) else (item, {})
        return Response("{}", status=status, headers=headers)

    def keys(self) -> list[str]:
        return [h["Idempotency-Key"] for _, h, _ in self.seen]


def _http_worker(url: str, **options: Any) -> BackendWorker:
    spec = {"type": "http", "url": url, "backoff": 0.01, **options}
    return BackendWorker(make_backend(spec), Identity("proj", "sft-1", rank=2, world_size=4))


def _events(n: int, session: str = "abc") -> list[dict[str, Any]]:
    return [
        {"_step": i, "_time": float(i), "_id": f"{session}:{i}", "loss": 1.0 / (i + 1)}
        for i in range(n)
    ]


def test_http_retry_keeps_key_and_body_and_token_stays_out_of_logs(
    httpserver: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("EXPR_HTTP_TOKEN", "s3cret-token")
    rec = Recorder([500])
    httpserver.expect_request("/ingest", method="POST").respond_with_handler(rec)
    worker = _http_worker(httpserver.url_for("/ingest"))
    events = _events(3)
    events[1]["gn"] = math.nan
    for e in events:
        worker.submit(e)
    stats = worker.close(timeout=10)

    assert rec.keys() == ["abc:0..abc:2", "abc:0..abc:2"]
    assert rec.seen[0][2] == rec.seen[1][2]
    assert all(h["Authorization"] == "Bearer s3cret-token" for _, h, _ in rec.seen)
    body = json.loads(rec.seen[1][2])
    assert body["identity"]["id"] == "sft-1-rank2"
    assert body["identity"]["group"] == "sft-1"
    assert [e["_id"] for e in body["events"]] == ["abc:0", "abc:1", "abc:2"]
    assert body["events"][1]["gn"] == "NaN"
    assert "s3cret-token" not in rec.seen[1][2].decode()
    assert (stats["sent"], stats["failed"], stats["pending"]) == (3, 0, 0)
    assert caplog.records, "the 500 should have been logged by httpx"
    assert "s3cret-token" not in caplog.text


def test_http_honours_retry_after(httpserver: Any) -> None:
    rec = Recorder([(503, {"Retry-After": "1"})])
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    worker = _http_worker(httpserver.url_for("/ingest"))
    worker.submit(_events(1)[0])
    stats = worker.close(timeout=10)
    assert len(rec.seen) == 2
    assert rec.seen[1][0] - rec.seen[0][0] >= 0.9
    assert stats["sent"] == 1


def test_http_client_error_is_not_retried_and_counts_failed(
    httpserver: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder([400, 400])
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    worker = _http_worker(httpserver.url_for("/ingest"), batch=2)
    for e in _events(3):
        worker.submit(e)
    stats = worker.close(timeout=10)
    assert rec.keys() == ["abc:0..abc:1", "abc:2..abc:2"]
    assert (stats["sent"], stats["failed"], stats["pending"]) == (0, 3, 0)
    assert stats["errors"] == {"http/events: status 400": 2}
    assert len([r for r in caplog.records if "status 400" in r.getMessage()]) == 1


def test_http_key_without_event_ids_is_a_hash_of_the_body(httpserver: Any) -> None:
    rec = Recorder()
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    backend = HttpBackend(url=httpserver.url_for("/ingest"))
    backend.open(Identity("proj", "sft-1"))
    backend.log([{"_step": 0, "_time": 0.0, "loss": 1.0}])
    backend.log([{"_step": 1, "_time": 0.0, "loss": 1.0}])
    backend.finish("finished")
    keys = rec.keys()
    assert keys == ["sha256:" + hashlib.sha256(body).hexdigest() for _, _, body in rec.seen]
    assert keys[0] != keys[1]


def test_http_dead_server_gives_up_after_retries(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = _http_worker(f"http://127.0.0.1:{port}/ingest", retries=2)
    for e in _events(4):
        worker.submit(e)
    stats = worker.close(timeout=10)
    assert (stats["sent"], stats["failed"]) == (0, 4)
    assert stats["errors"] == {"http/events: ConnectError": 1}
    assert any("gave up after 3 attempts" in r.getMessage() for r in caplog.records)


# --- the worker ----------------------------------------------------------------------------


class Exploding:
    """A backend that raises from `fail_at` on."""

    name = "boom"

    def __init__(self, fail_open: bool) -> None:
        self.fail_open = fail_open
        self.finished: list[str] = []

    def open(self, identity: Identity) -> None:
        if self.fail_open:
            raise ConnectionError("cannot reach server")

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        raise RuntimeError("boom")

    def alert(self, alert: Mapping[str, Any]) -> None:
        raise RuntimeError("boom")

    def finish(self, status: str) -> None:
        self.finished.append(status)
        raise RuntimeError("boom at finish")


@pytest.mark.parametrize("fail_open", [False, True])
def test_worker_contains_a_backend_that_always_raises(
    fail_open: bool, caplog: pytest.LogCaptureFixture
) -> None:
    backend = Exploding(fail_open)
    worker = BackendWorker(backend, Identity("p", "n"), batch=7)
    for step in range(50):
        worker.submit({"_step": step, "_time": 0.0, "loss": 1.0})
        if step % 10 == 0:
            worker.alert({"title": "t", "text": "x", "level": "info"})
    worker.submit({"_kind": "rank", "_step": 1, "_rank": 1, "loss": 1.0})
    stats = worker.close(timeout=5, status="crashed")
    assert (
        stats["sent"],
        stats["failed"],
        stats["dropped"],
        stats["pending"],
        stats["skipped"],
    ) == (0, 50, 0, 0, 1)
    assert stats["alerts"]["failed"] == 5
    if fail_open:
        assert stats["errors"]["boom: open: ConnectionError"] == 1
        assert backend.finished == []
    else:
        assert stats["errors"]["boom: log: RuntimeError"] >= 50 // 7
        assert stats["errors"]["boom: finish: RuntimeError"] == 1
        assert backend.finished == ["crashed"]
    messages = [r.getMessage() for r in caplog.records if r.name == "expr_tracker.backends"]
    assert len(messages) == len(stats["errors"])  # once per cause, however many times it happened


class Slow:
    """A backend that takes `delay` seconds per batch and records what it got."""

    name = "slow"

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.got: list[int] = []
        self.thread: str | None = None

    def open(self, identity: Identity) -> None:
        self.thread = threading.current_thread().name

    def log(self, events: Sequence[Mapping[str, Any]]) -> None:
        time.sleep(self.delay)
        self.got.extend(e["_step"] for e in events)

    def alert(self, alert: Mapping[str, Any]) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


def test_worker_never_blocks_on_a_slow_backend_and_counts_what_it_drops() -> None:
    backend = Slow(0.1)
    worker = BackendWorker(backend, Identity("p", "n"), max_queue=20, batch=5)
    start = time.perf_counter()
    for step in range(2000):
        worker.submit({"_step": step, "_time": 0.0, "loss": 1.0})
    worker.alert({"title": "late", "text": "queued behind a full queue", "level": "error"})
    submit_time = time.perf_counter() - start
    start = time.perf_counter()
    stats = worker.close(timeout=0.25)
    close_time = time.perf_counter() - start
    assert submit_time < 1.0
    assert close_time < 1.0
    assert stats["dropped"] >= 2000 - 20
    assert stats["errors"]["slow: close timeout"] == 1  # the queue left at the deadline
    assert stats["alerts"]["dropped"] == 1
    assert stats["sent"] + stats["dropped"] + stats["failed"] + stats["pending"] == 2000
    assert stats["sent"] == len(backend.got) > 0
    assert backend.got == sorted(backend.got)  # order kept
    assert backend.thread is not None and backend.thread != threading.current_thread().name
    worker.submit({"_step": 9999, "_time": 0.0, "loss": 1.0})  # after close: counted, not raised
    assert worker.stats()["dropped"] == stats["dropped"] + 1


# --- the batch journal (exprd's http batches keep their boundaries across restarts) --------


def _until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _journaled_worker(url: str, journal: BatchJournal) -> BackendWorker:
    backend = make_backend({"type": "http", "url": url, "batch": 10, "backoff": 0.01})
    return BackendWorker(backend, Identity("proj", "sft-1"), batch=10, journal=journal)


def _bodies(rec: Recorder) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for _, headers, body in rec.seen:
        key = headers["Idempotency-Key"]
        assert out.setdefault(key, body) == body, f"{key} sent with two bodies"
    return out


def test_journal_cuts_events_sent_again_into_the_same_batches(
    tmp_path: Path, httpserver: Any
) -> None:
    rec = Recorder()
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    url, path = httpserver.url_for("/ingest"), tmp_path / "batches" / "f.http.jsonl"
    events = _events(40)
    first = _journaled_worker(url, BatchJournal(path))
    for lo, hi in ((0, 7), (7, 18), (18, 23), (23, 30)):  # batches as the events trickle in
        for e in events[lo:hi]:
            first.submit(e)
        _until(lambda: first.stats()["pending"] == 0)
    first.close()
    before = _bodies(rec)
    # a restart: the same events again, arriving in other chunks, then new ones
    again = _journaled_worker(url, BatchJournal(path))
    for lo in range(0, 40, 3):
        for e in events[lo : lo + 3]:
            again.submit(e)
        time.sleep(0.005)
    stats = again.close()
    after = _bodies(rec)  # asserts no key ever came with another body
    resent = {h["Idempotency-Key"] for _, h, _ in rec.seen[len(before) :]}
    assert resent >= set(before)  # every old batch again, whole, with its old body
    new = [e["_id"] for k in resent - set(before) for e in json.loads(after[k])["events"]]
    assert sorted(new) == sorted(e["_id"] for e in events[30:])
    ids = [e["_id"] for body in after.values() for e in json.loads(body)["events"]]
    assert sorted(ids, key=lambda i: int(i.split(":")[1])) == [e["_id"] for e in events]
    assert all(len(json.loads(after[k])["events"]) <= 10 for k in after)
    assert (stats["sent"], stats["failed"], stats["pending"]) == (40, 0, 0)
    journal = BatchJournal(path)
    assert len(journal) == len(after)
    assert journal.find("abc", 39) is not None and journal.find("abc", 40) is None
    assert journal.find("other", 1) is None


def test_journal_skips_the_rest_of_a_batch_that_went_out_before_the_checkpoint(
    tmp_path: Path, httpserver: Any
) -> None:
    rec = Recorder()
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    journal = BatchJournal(tmp_path / "j.jsonl")
    journal.add("abc", 0, 9, 10)
    worker = _journaled_worker(httpserver.url_for("/ingest"), journal)
    for e in _events(15)[5:]:  # resumed mid-batch: 0..9 were delivered as one batch
        worker.submit(e)
    stats = worker.close()
    assert rec.keys() == ["abc:10..abc:14"]
    assert (stats["sent"], stats["skipped"], stats["pending"]) == (5, 5, 0)
    assert worker.progress() == (10, 10)


def test_journal_holds_part_of_a_batch_until_its_last_event(
    tmp_path: Path, httpserver: Any
) -> None:
    rec = Recorder()
    httpserver.expect_request("/ingest").respond_with_handler(rec)
    url, path = httpserver.url_for("/ingest"), tmp_path / "j.jsonl"
    BatchJournal(path).add("abc", 0, 9, 10)
    events = _events(10)
    worker = _journaled_worker(url, BatchJournal(path))
    for e in events[:6]:
        worker.submit(e)
    worker.alert({"title": "t", "text": "x", "level": "info", "id": "alert-1"})
    time.sleep(0.2)
    assert rec.seen == [] and worker.stats()["pending"] == 6
    # closing a running stream leaves the part for a later start, not done with
    stats = worker.close(timeout=5, status="running")
    assert rec.seen == [] and stats["dropped"] == 6
    assert worker.progress() == (6, 0)
    worker = _journaled_worker(url, BatchJournal(path))
    for e in events[:6]:
        worker.submit(e)
    worker.alert({"title": "t", "text": "x", "level": "info", "id": "alert-2"})
    time.sleep(0.1)
    for e in events[6:]:
        worker.submit(e)
    stats = worker.close()
    assert rec.keys() == ["abc:0..abc:9", "alert-2"]  # the batch whole, the alert behind it
    assert [e["_id"] for e in json.loads(rec.seen[0][2])["events"]] == [e["_id"] for e in events]
    assert (stats["sent"], stats["alerts"]["sent"]) == (10, 1)


def test_journal_compacts_and_survives_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    journal = BatchJournal(path)
    for lo in range(0, 50, 10):
        journal.add("s1", lo, lo + 9, 10)
    assert json.loads(path.read_bytes().splitlines()[0]) == {"first": "s1:0", "last": "s1:9", "n": 10}
    with open(path, "ab") as fh:
        fh.write(b'{"first":"s1:50","la')  # a write cut short
    journal = BatchJournal(path)
    assert len(journal) == 5 and path.read_bytes().endswith(b"\n")
    assert journal.find("s1", 45) == (40, 49, 10) and journal.next_first("s1", 12) == 20
    assert journal.compact(25) == 2  # batches ending at 9 and 19; 20..29 straddles and stays
    assert [json.loads(x)["first"] for x in path.read_bytes().splitlines()] == [
        "s1:20", "s1:30", "s1:40"]
    assert len(BatchJournal(path)) == 3
    assert journal.compact(49) == 3 and path.read_bytes() == b""
    assert journal.compact(49) == 0 and len(BatchJournal(path)) == 0
