"""Alert rules in direct mode with real rank processes and a real webhook receiver."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import orjson
import pytest
from werkzeug import Request, Response

import expr_tracker as et

from .procs import run_all, spawn

SEED = """
import expr_tracker as et
run = et.init("p", "seed", dir={root!r}, alert_rules=["isnan(loss) => critical: diverged"],
              alert_on_rank={on_rank!r},
              alert={{"channels": {{"ops": {{"type": "webhook", "url_env": "OPS_URL"}}}},
                      "policy": {{"backoff": 0.05}}}})
for step in range(20):
    loss = float("nan") if step >= 10 else 1.0 / (step + 1)
    et.log({{"loss": loss}})
et.finish()
print(run.info()["alerts"].get("ops", {{}}).get({counter!r}, 0))
"""


def _run_seed(tmp_path, url, on_rank):
    code = SEED.format(root=str(tmp_path), on_rank=on_rank, counter="sent")
    procs = [spawn(code, {"RANK": str(r), "WORLD_SIZE": "4", "OPS_URL": url}) for r in range(4)]
    return [int(out.strip() or 0) for out in run_all(procs, timeout=120)]


def _alerts(run_dir):
    out = {}
    for r in range(4):
        path = run_dir / ("alerts.jsonl" if r == 0 else f"alerts.rank{r}.jsonl")
        out[r] = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    return out


@pytest.mark.parametrize(("on_rank", "deliverers"), [(0, [0]), (3, [3]), (None, [0, 1, 2, 3])])
def test_seed_scenario_rank_filtered(tmp_path, httpserver, on_rank, deliverers):
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    sent = _run_seed(tmp_path, httpserver.url_for("/hook"), on_rank)
    posts = [json.loads(req.get_data()) for req, _ in httpserver.log]
    assert len(posts) == len(deliverers)
    assert sorted(p["rank"] for p in posts) == deliverers
    assert all(p["title"] == "diverged" and p["level"] == "critical" and p["step"] == 10 for p in posts)
    assert sent == [1 if r in deliverers else 0 for r in range(4)]
    for rank, entries in _alerts(tmp_path / "p" / "seed").items():
        (entry,) = entries  # edge mode: fires once, on the first NaN
        assert entry["step"] == 10 and entry["rule"] == "isnan(loss)"
        assert entry["delivered"] is (rank in deliverers)


def test_receiver_500_then_200_delivers_once(tmp_path, httpserver):
    calls = []

    def handler(request: Request) -> Response:
        calls.append(request.get_data())
        return Response("fail" if len(calls) == 1 else "ok", status=500 if len(calls) == 1 else 200)

    httpserver.expect_request("/hook", method="POST").respond_with_handler(handler)
    sent = _run_seed(tmp_path, httpserver.url_for("/hook"), 0)
    assert sent[0] == 1
    assert len(calls) == 2 and calls[0] == calls[1]


def test_receiver_down_run_completes_failure_counted(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code = SEED.format(root=str(tmp_path), on_rank=0, counter="failed")
    t0 = time.monotonic()
    (out,) = run_all([spawn(code, {"OPS_URL": f"http://127.0.0.1:{port}/hook"})], timeout=120)
    assert int(out) == 1
    assert time.monotonic() - t0 < 60
    rows = et.history(-1, run=tmp_path / "p" / "seed")
    assert len(rows) == 20


def test_manual_alert_and_rule_management(tmp_path, capfd):
    run = et.init("p", "m", dir=tmp_path)
    name = et.add_alert_rule({"name": "big", "condition": "loss > 10", "level": "error",
                              "message": "loss {loss:.1f} at {step}"})
    assert name == "big"
    et.log({"loss": 1.0})
    et.log({"loss": 11.0})
    et.alert("checkpoint saved", "step 1", level="info")
    assert et.remove_alert_rule("big") is True
    et.log({"loss": 12.0})
    info = et.info()
    et.finish()
    entries = [orjson.loads(x) for x in (run.paths.run_dir / "alerts.jsonl").read_bytes().splitlines()]
    assert [(e["title"], e["kind"]) for e in entries] == [("loss 11.0 at 1", "fire"), ("checkpoint saved", "manual")]
    assert info["rules"] == []
    err = capfd.readouterr().err
    assert "loss 11.0 at 1" in err and "checkpoint saved" in err


def test_bad_rule_raises_at_init_with_caret(tmp_path):
    with pytest.raises(ValueError, match=r"\^") as info:
        et.init("p", "r", dir=tmp_path, alert_rules=["loss >> 1"])
    assert "column" in str(info.value)
    assert not (tmp_path / "p").exists()
    with pytest.raises(ValueError, match="level"):
        et.init("p", "r", dir=tmp_path, alert=None, alert_on_rank=0, alert_rules=["loss > 1 => loud"])


def test_never_logged_metric_warns_with_suggestion(tmp_path):
    et.init("p", "r", dir=tmp_path, alert_rules=["los > 1"])
    et.log({"loss": 0.5})
    with pytest.warns(RuntimeWarning, match="did you mean 'loss'"):
        et.finish()


def test_rules_info(tmp_path):
    et.init("p", "r", dir=tmp_path, alert_rules=["loss > 1 => error: high", "gnorm > 5"])
    et.log({"loss": 2.0})
    (high, gnorm) = et.info()["rules"]
    assert high["level"] == "error" and high["fires"] == 1 and high["firing"] is True
    assert gnorm["unresolved_metrics"] == ["gnorm"]
    with pytest.warns(RuntimeWarning, match="never logged"):
        et.finish()


def test_time_rule_fires_from_the_background_timer(tmp_path):
    run = et.init("p", "quiet", dir=tmp_path, alert_rules=["no_data(1s) => error: stalled run"],
                  time_rule_interval=0.2)
    et.log({"loss": 1.0})
    alerts = run.paths.run_dir / "alerts.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (alerts.exists() and alerts.read_bytes()):
        time.sleep(0.1)
    et.finish()
    (entry,) = [orjson.loads(x) for x in alerts.read_bytes().splitlines()]
    assert entry["title"] == "stalled run" and entry["level"] == "error"
    assert entry["time"] - orjson.loads(run.shard_path.read_bytes().splitlines()[0])["_time"] >= 1.0


def test_a_hanging_command_channel_ends_with_the_run_children_included(tmp_path: Path) -> None:
    """Before: each run left its hanging command (and the command's children) alive."""
    pids = tmp_path / "pids"
    script = tmp_path / "hang-pager"
    script.write_text('#!/bin/sh\nsleep 300 &\necho $$ $! > "$1"\nwait\n')
    script.chmod(0o755)
    code = f"""
        import expr_tracker as et
        et.init("proj", "hang", dir={str(tmp_path)!r}, alert={{
            "channels": {{"pager": {{"type": "command", "argv": [{str(script)!r}, {str(pids)!r}],
                                     "timeout": 120}}}},
            "policy": {{"exit_timeout": 0.5}}}})
        et.alert("disk", "full", level="error")
        import time
        for _ in range(200):
            try:
                if len(open({str(pids)!r}).read().split()) == 2:
                    break
            except OSError:
                pass
            time.sleep(0.02)
        et.finish()
    """
    run_all([spawn(code, {})])
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2  # the command and its child

    def alive(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat")
        try:
            return stat.read_text().split(")")[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 5
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.02)
    survivors = [p for p in started if alive(p)]
    for pid in survivors:  # do not leave them behind if the check fails
        os.kill(pid, 9)
    assert not survivors, "the command channel outlived the run"
