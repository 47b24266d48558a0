"""`expr serve`'s JSON API (DESIGN 18): every answer against the CLI's `--json` of the same
run; bad input and paths out of the run root; the token; a real server's Ctrl-C."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="expr serve needs the serve extra (starlette, uvicorn)")
pytest.importorskip("uvicorn", reason="expr serve needs the serve extra (starlette, uvicorn)")

from starlette.testclient import TestClient

from expr_cli.web.app import make_app

from .servers import Server
from .synthetic import write_run

SECRET = "top-secret-4417"


@pytest.fixture
def root(cli_root: Path) -> Path:
    """The CLI test runs plus proj/four: 4 ranks, rank 2 a 1.6x straggler, finished; and
    proj/rows, the same logging step rows only."""
    write_run(cli_root / "proj" / "four", 4, 60, straggler=2, status="finished")
    write_run(cli_root / "proj" / "rows", 4, 60, straggler=2, status="finished",
              rank_records=False)
    return cli_root.resolve()


@pytest.fixture
def client(root: Path) -> TestClient:
    return TestClient(make_app(root), base_url="http://127.0.0.1", raise_server_exceptions=False)


def cli_json(cli: Any, *args: str) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def api(client: TestClient, path: str, **params: Any) -> Any:
    resp = client.get(path, params=params)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-security-policy"] == "default-src 'self'"
    return resp.json()


def test_runs_are_the_cli_runs_with_their_open_incidents(cli: Any, client: TestClient,
                                                       tmp_path: Path) -> None:
    want = cli_json(cli, "runs", "--spool", str(tmp_path / "no-spool"))
    got = api(client, "/api/runs")
    assert [r["open_incidents"] for r in got] == [None] * len(want)  # no watcher
    assert [r.pop("open_incidents") for r in want] == [None] * len(want)  # (the CLI says so too)
    assert [{k: v for k, v in r.items() if k != "open_incidents"} for r in got] == want
    assert "proj/four" in {f"{r['project']}/{r['name']}" for r in got}


def _page_only(got: dict[str, Any]) -> None:
    """Drop what the page's answers add to the CLI's (DESIGN 18: a superset)."""
    for k in ("chart", "version", "step_keys", "found", "heatmap_page"):
        got.pop(k, None)


@pytest.mark.parametrize("run", ["four", "run-1", "rows"])
def test_summary_is_expr_summary_json(cli: Any, client: TestClient, run: str) -> None:
    want = cli_json(cli, "summary", f"proj/{run}")
    got = api(client, f"/api/runs/proj/{run}/summary")
    chart = got.pop("chart")
    assert re.fullmatch(r"[0-9a-f]{8}\.[1-9][0-9]*", got.pop("version"))
    assert "loss" in got.pop("step_keys")  # the picker's step-row keys
    got.pop("found", None)
    assert got == want
    first = want["keys"][0]
    assert chart["key"] == first["key"] and chart["step"][-1] == want["step"]
    assert chart["mean"][-1] == first["stats"]["mean"]
    assert chart["p95"][-1] == first["stats"]["p95"]
    if run == "rows":  # et.log alone: its step rows, reduced across the ranks
        assert [(k["key"], k["source"]) for k in want["keys"]] == [("loss", "step rows"),
                                                                   ("tokens", "step rows")]


def test_summary_of_one_metric_at_a_step_and_over_a_window(cli: Any, client: TestClient) -> None:
    want = cli_json(cli, "summary", "proj/four", "-m", "step_time", "--step", "30")
    got = api(client, "/api/runs/proj/four/summary", metric="step_time", step=30)
    _page_only(got)
    assert got == want
    assert [o["rank"] for o in got["keys"][0]["outliers"]] == [2]
    want = cli_json(cli, "summary", "proj/four", "-m", "step_time,grad_norm", "--steps", "10:20")
    got = api(client, "/api/runs/proj/four/summary", metric=["step_time", "grad_norm"], steps="10:20")
    _page_only(got)
    assert got == want


def test_heatmap_is_expr_summary_heatmap_json(cli: Any, client: TestClient) -> None:
    from expr_cli.render.summary import heatmap_buckets

    want = cli_json(cli, "summary", "proj/four", "-m", "step_time", "--heatmap", "step_time")
    width = heatmap_buckets(100, 4)  # the CLI's under COLUMNS=100
    got = api(client, "/api/runs/proj/four/heatmap", metric="step_time", buckets=width)
    _page_only(got)
    assert got == want
    assert len(got["heatmap"]["cells"]) == 4


def test_top_is_expr_top_once_json(cli: Any, client: TestClient) -> None:
    want = cli_json(cli, "top", "proj/four", "--once")
    got = api(client, "/api/runs/proj/four/top")
    assert got.pop("history") == []
    got.pop("version")
    assert got == want
    assert [r["rank"] for r in got["ranks"]] == sorted(r["rank"] for r in got["ranks"])


def test_series_is_expr_plot_json_and_compare_aligns_the_runs(cli: Any, client: TestClient) -> None:
    want = cli_json(cli, "plot", "proj/four", "-m", "loss")
    assert api(client, "/api/runs/proj/four/series", metric="loss") == want
    want = cli_json(cli, "plot", "proj/run-1", "-m", "loss", "--rank", "0-2", "--steps", "5:30")
    assert api(client, "/api/runs/proj/run-1/series", metric="loss", ranks="0-2", steps="5:30") == want
    got = api(client, "/api/compare", run=["proj/four", "proj/run-1"], metric="loss")
    assert [r["run"] for r in got["runs"]] == ["proj/four", "proj/run-1"]
    assert got["steps"] == list(range(60))
    four, one = got["runs"]
    assert four["ranks"] == 4 and one["ranks"] == 8
    assert one["values"][40:] == [None] * 20  # run-1 has 40 steps: aligned by step
    lines = cli_json(cli, "plot", "proj/four", "-m", "loss")["panels"][0]["lines"]
    import statistics

    assert four["values"][7] == statistics.median(line["values"][7] for line in lines)


def test_a_watcher_incident_shows_in_runs_and_top(root: Path, client: TestClient) -> None:
    line = {"id": "i-1", "kind": "stall", "level": "critical", "ranks": [3], "hosts": ["gpu-0000"],
            "step": 41, "first_seen": 1.0, "last_seen": 2.0, "detail": "job stalled at step 41",
            "state": "open", "delivered": True, "suspects": [3]}
    (root / "proj" / "four" / "incidents.jsonl").write_text(json.dumps(line) + "\n")
    runs = {f"{r['project']}/{r['name']}": r for r in api(client, "/api/runs")}
    assert runs["proj/four"]["open_incidents"] == 1
    assert runs["proj/run-1"]["open_incidents"] is None  # not watched
    # an incident kind and fields this version does not know pass through untouched
    assert api(client, "/api/runs/proj/four/top")["history"] == [line]


@pytest.mark.parametrize(("path", "params", "status", "says"), [
    ("/api/runs/proj/nope/summary", {}, 404, "no run proj/nope"),
    ("/api/runs/proj/four/summary", {"metric": "nope"}, 404, "unknown metric nope"),
    ("/api/runs/proj/four/summary", {"step": "x"}, 400, "step must be an integer"),
    ("/api/runs/proj/four/summary", {"steps": "9:3"}, 400, "is empty"),
    ("/api/runs/proj/four/summary", {"step": "1", "steps": "1:3"}, 400, "either step or steps"),
    ("/api/runs/proj/four/heatmap", {}, 400, "metric is required"),
    ("/api/runs/proj/four/heatmap", {"metric": "step_time", "agg": "sum"}, 400, "agg must be"),
    ("/api/runs/proj/four/heatmap", {"metric": "step_time", "buckets": "0"}, 400, "buckets must be"),
    ("/api/runs/proj/four/series", {"metric": "loss", "ranks": "x"}, 400, "--rank must be"),
    ("/api/runs/proj/four/series", {"metric": "nope"}, 404, "unknown metric"),
    ("/api/runs/proj/four/summary", {"stream": "../x"}, 400, "stream"),
    ("/api/runs/proj/four/summary", {"stream": "data"}, 404, "no shards of stream data"),
    ("/api/runs/proj/four/nothing", {}, 404, "no API"),
    ("/api/runs/proj/hollow/summary", {}, 404, "is empty"),
    ("/api/runs/.hidden/four/summary", {}, 400, "must not start with '.'"),
    ("/api/compare", {"metric": "loss"}, 400, "run is required"),
    ("/api/compare", {"run": "four", "metric": "loss"}, 400, "project/name"),
    ("/api/compare", {"run": "proj/../x", "metric": "loss"}, 400, "must not contain '/'"),
    ("/api/compare", {"run": "proj/..", "metric": "loss"}, 400, "must not contain '..'"),
    ("/api/nothing", {}, 404, "no page"),
])
def test_bad_input_is_one_line_of_json(client: TestClient, path: str, params: dict[str, str],
                                       status: int, says: str) -> None:
    resp = client.get(path, params=params)
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert list(body) == ["error"] and says in body["error"], body
    assert "\n" not in body["error"] and "Traceback" not in resp.text
    assert "/tmp" not in body["error"]  # the root's path stays on the server


def _link_out(root: Path, outside: Path) -> None:
    """Symlinks out of the root: a project, a run, and a shard inside a real run."""
    write_run(outside / "p" / "r", 2, 5, status="finished")
    secret = outside / "secret.jsonl"
    secret.write_text(json.dumps({"_step": 0, "_time": 1.0, "loss": 1.0, "note": SECRET}) + "\n")
    (outside / "p" / "r" / "metrics.rank1.jsonl").write_text(secret.read_text())
    (root / "evil").symlink_to(outside / "p")
    (root / "proj" / "linked").symlink_to(outside / "p" / "r")
    run = root / "proj" / "sneaky"
    write_run(run, 2, 5, status="finished")
    (run / "metrics.rank1.jsonl").unlink()
    (run / "metrics.rank1.jsonl").symlink_to(secret)


def _raw(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """GET `path` exactly as written (no client-side normalisation of `..` or `%2e`)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode(errors="replace")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real `expr serve` for the module, over the CLI runs, proj/four and the links."""
    from .conftest import build_cli_root

    base = tmp_path_factory.mktemp("serve")
    root = build_cli_root(base / "runs").resolve()
    write_run(root / "proj" / "four", 4, 60, straggler=2, status="finished")
    _link_out(root, base / "outside")
    srv = Server(root)
    srv.root = root  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.mark.parametrize("path", [
    "/api/runs/../../etc/summary",
    "/api/runs/%2e%2e/%2e%2e/summary",
    "/api/runs/proj/%2e%2e/summary",
    "/api/runs/proj/..%2f..%2foutside/summary",
    "/api/runs/proj/four%2f..%2f..%2fsecret/top",
    "/api/runs/evil/r/summary",
    "/api/runs/evil/r/series?metric=loss",
    "/api/runs/proj/linked/summary",
    "/api/runs/proj/linked/events",
    "/api/runs/proj/sneaky/series?metric=loss",
    "/api/runs/proj/sneaky/top",
    "/api/compare?run=proj/linked&metric=loss",
    "/api/compare?run=proj%2f..%2f..%2foutside&metric=loss",
    "/static/../app.py",
    "/static/%2e%2e/app.py",
    "/static/..%2fapi.py",
    "/runs/../../etc/passwd",
])
def test_no_path_leaves_the_run_root(server: Server, path: str) -> None:
    status, headers, body = _raw(server.port, path)
    assert status in (400, 404), (status, body[:300])
    assert SECRET not in body and "world_size" not in body  # no file's content, no run's
    assert list(json.loads(body)) == ["error"] and "\n" not in body.strip()
    assert headers["content-security-policy"] == "default-src 'self'"


def test_symlinked_runs_are_not_listed(server: Server) -> None:
    status, _, body = _raw(server.port, "/api/runs")
    assert status == 200
    labels = {f"{r['project']}/{r['name']}" for r in json.loads(body)}
    assert "proj/four" in labels
    assert not labels & {"evil/r", "proj/linked"}
    assert SECRET not in body


def test_pages_and_static_files_carry_the_csp(server: Server) -> None:
    for path in ("/", "/runs/proj/four", "/compare?run=proj/four", "/static/run.js",
                 "/static/vendor/uplot/uPlot.esm.js", "/api/runs/proj/four/summary"):
        status, headers, body = _raw(server.port, path)
        assert status == 200, (path, body[:200])
        assert headers["content-security-policy"] == "default-src 'self'"
        assert "<script>" not in body  # no inline script


def test_the_event_stream_says_the_run_changed(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/api/runs/proj/four/events")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        lines = [resp.readline().decode().strip() for _ in range(2)]
    finally:
        conn.close()
    assert lines[0] == "event: change"
    data = json.loads(lines[1].removeprefix("data: "))
    assert data["frontier"] == 59 and data["world_size"] == 4
    # a page that drew this version: the stream stays quiet while the run does not move
    drawn = json.loads(urllib.request.urlopen(
        f"{server.base}/api/runs/proj/four/summary", timeout=10).read())["version"]
    assert drawn == data["version"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3)
    try:
        conn.request("GET", f"/api/runs/proj/four/events?version={drawn}")
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(TimeoutError):
            resp.readline()  # no change event: the first pass found the version drawn
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/api/runs/proj/four/events?version=0badf00d.1")
        resp = conn.getresponse()
        assert resp.readline().decode().strip() == "event: change"  # another server's
    finally:
        conn.close()


def test_a_kept_top_answer_ages_the_ranks_silence_to_each_request(server: Server) -> None:
    """Nothing written (a finished run, or a stalled job): top is served from the answer
    kept for this version, with each rank's last-write age as of the request, not as of
    the moment the answer was built."""
    def top() -> Any:
        url = f"{server.base}/api/runs/proj/four/top"
        return json.loads(urllib.request.urlopen(url, timeout=10).read())

    first = top()
    time.sleep(1.5)
    second = top()
    assert second["version"] == first["version"]  # the same kept answer
    before = {r["rank"]: r["last_write_age"] for r in first["ranks"]}
    after = {r["rank"]: r["last_write_age"] for r in second["ranks"]}
    assert before.keys() == after.keys() == {0, 1, 2, 3}
    assert all(1.4 <= after[k] - before[k] <= 10 for k in before), (before, after)


def test_another_host_needs_the_token(root: Path) -> None:
    srv = Server(root, "--host", "0.0.0.0")
    try:
        assert srv.url.startswith("http://0.0.0.0:") and "/?token=" in srv.url
        token = srv.url.split("token=", 1)[1]
        import socket
        there = srv.url.replace("//0.0.0.0:", f"//{socket.gethostname()}:")
        assert srv.status_line(f"from another machine: {there}")
        assert len(token) >= 16
        for path in ("/", "/api/runs", "/api/runs/proj/four/summary", "/static/run.js"):
            status, headers, body = _raw(srv.port, path)
            assert status == 401, (path, status)
            assert "token" in json.loads(body)["error"]
            assert headers["content-security-policy"] == "default-src 'self'"
        assert _raw(srv.port, "/api/runs?token=wrong-token-here")[0] == 401
        status, headers, _ = _raw(srv.port, f"/api/runs?token={token}")
        assert status == 200
        cookie = headers["set-cookie"]
        assert f"expr_token={token}" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        # a page drops the token from the address bar once the cookie is set
        status, headers, _ = _raw(srv.port, f"/runs/proj/four?token={token}&metric=loss")
        assert status == 303 and headers["location"] == "/runs/proj/four?metric=loss"
        status, _, body = _raw(srv.port, "/api/runs/proj/four/top", {"Cookie": f"expr_token={token}"})
        assert status == 200 and json.loads(body)["world_size"] == 4
        assert _raw(srv.port, "/api/runs", {"Cookie": "expr_token=nope"})[0] == 401
    finally:
        assert srv.stop() == 130  # Ctrl-C


def test_a_given_token_guards_loopback_too(root: Path) -> None:
    srv = Server(root, "--token", "s3cret-token")
    try:
        assert srv.url.endswith("/?token=s3cret-token")
        assert _raw(srv.port, "/api/runs")[0] == 401
        assert _raw(srv.port, "/api/runs?token=s3cret-token")[0] == 200
    finally:
        srv.stop(signal.SIGTERM)


def test_serve_without_the_extra_names_the_pip_command(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['starlette'] = None; sys.argv = ['expr', 'serve', '--dir', "
            f"{str(tmp_path)!r}]\nfrom expr_cli.main import entry\nentry()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("EXPR_")})
    assert done.returncode == 1, done.stderr
    assert "pip install 'expr-tracker[serve]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_serve_refuses_a_missing_root_and_a_busy_port(tmp_path: Path, server: Server) -> None:
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    runner = CliRunner()
    result = runner.invoke(build_app(), ["serve", "--dir", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no run root" in result.output
    result = runner.invoke(build_app(), ["serve", "--dir", str(tmp_path), "--port", str(server.port)])
    assert result.exit_code == 1 and "cannot listen" in result.output
    from expr_tracker.stats import parallel  # nothing started for a port it cannot have

    assert not parallel._fork_server
    result = runner.invoke(build_app(), ["serve", "--dir", str(tmp_path), "--token", "short"])
    assert result.exit_code == 2 and "--token must be" in result.output
    (tmp_path / "file").write_text("")
    result = runner.invoke(build_app(), ["serve", "--dir", str(tmp_path / "file")])
    assert result.exit_code == 1 and "is not a directory" in result.output
    for port in ("-1", "65536"):
        result = runner.invoke(build_app(), ["serve", "--dir", str(tmp_path), "--port", port])
        assert result.exit_code == 2 and f"--port must be in 0..65535, got {port}" in result.output


def test_past_256_ranks_the_heatmap_rows_are_nodes_and_a_node_drills_in(
        cli: Any, client: TestClient, root: Path) -> None:
    from expr_cli.layout import combine
    from expr_cli.render.summary import heatmap_buckets

    write_run(root / "proj" / "wide", 264, 4, straggler=9, status="finished")
    want = cli_json(cli, "summary", "proj/wide", "-m", "step_time", "--heatmap", "step_time")
    width = heatmap_buckets(100, 264)
    got = api(client, "/api/runs/proj/wide/heatmap", metric="step_time", buckets=width)
    hm, full = got["heatmap"], want["heatmap"]
    assert hm["cells"] == {} and hm["node"] is None
    assert [n["node"] for n in hm["nodes"]] == [f"gpu-{i:04d}" for i in range(33)]
    one = hm["nodes"][1]
    assert one["ranks"] == "8-15" and one["n"] == 8
    assert one["cells"] == combine([full["cells"][str(r)] for r in range(8, 16)], "max")
    assert hm["rows"] == full["rows"]  # the CLI's binned rows are there too
    got = api(client, "/api/runs/proj/wide/heatmap", metric="step_time", buckets=width,
              node="gpu-0001")
    assert got["heatmap"]["cells"] == {str(r): full["cells"][str(r)] for r in range(8, 16)}
    resp = client.get("/api/runs/proj/wide/heatmap",
                      params={"metric": "step_time", "node": "gpu-9999"})
    assert resp.status_code == 404 and "no node" in resp.json()["error"]
    top = api(client, "/api/runs/proj/wide/top", limit=5)
    assert len(top["ranks"]) == 5 and top["ranks_total"] == 264 and top["nodes_total"] == 33
    every = api(client, "/api/runs/proj/wide/top")
    assert top["ranks"] == every["ranks"][:5] and top["nodes"] == every["nodes"][:5]


def test_ctrl_c_ends_the_server_with_event_streams_open(root: Path) -> None:
    srv = Server(root)
    conns = []
    try:
        for _ in range(3):  # three pages following the run
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            conn.request("GET", "/api/runs/proj/four/events")
            resp = conn.getresponse()
            assert resp.readline().decode().strip() == "event: change"
            conns.append(conn)
    finally:
        assert srv.stop() == 130  # Ctrl-C, within stop()'s 10 s
        for conn in conns:
            conn.close()


def test_progress_and_the_quick_runs_list_answer_before_any_read(client: TestClient) -> None:
    """Issue 44: a first visit's reading notice and its runs list at once."""
    got = api(client, "/api/runs/proj/four/progress")
    assert got["run"] == "proj/four" and got["shards_total"] is None and got["shards_read"] == 0
    api(client, "/api/runs/proj/four/summary")
    got = api(client, "/api/runs/proj/four/progress")
    assert got["shards_total"] == 4 and got["world_size"] == 4
    quick = {f"{r['project']}/{r['name']}": r for r in api(client, "/api/runs", quick=1)}
    assert quick["proj/four"] == {"project": "proj", "name": "four", "status": None, "shards": 4,
                                  "quick": True, "path": quick["proj/four"]["path"]}
    full = api(client, "/api/runs")
    assert api(client, "/api/runs", quick=1) == full  # once the full list is kept: that one
