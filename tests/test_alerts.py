"""Alert values, channels and the delivery policy, against real servers and processes."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from expr_tracker.alerts import (
    Alert,
    CommandChannel,
    Dispatcher,
    LogChannel,
    Policy,
    WebhookChannel,
    load_config,
    make_alert,
)

FAST = {"rate": 0, "dedup_seconds": 0, "backoff": 0.01, "retries": 2, "timeout": 2}
SECRET_PATH = "/services/T0001/B0002/TOPSECRETTOKEN42"
SECRET_KEY = "hmac-key-NEVER-LOGGED-77"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EXPR_") or name.startswith("ALERT_TEST_"):
            monkeypatch.delenv(name)


@pytest.fixture
def dispatch() -> Iterator[Callable[..., Dispatcher]]:
    """Build dispatchers that are always closed after the test."""
    made: list[Dispatcher] = []

    def make(config: Any, on_warning: Callable[[str], object] | None = None) -> Dispatcher:
        d = Dispatcher.from_config(config, on_warning=on_warning)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close(timeout=2)


def _alert(title: str = "loss diverged", level: str = "error", **kw: Any) -> Alert:
    return make_alert(title, "loss is NaN at step 7", level, project="p", run="r", step=7, **kw)


def _webhook(url: str, **extra: Any) -> dict[str, Any]:
    return {"channels": {"ops": {"type": "webhook", "url": url, **extra}}, "policy": FAST}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# -- the Alert value -----------------------------------------------------------------------


def test_make_alert_validates_and_as_dict_is_json_safe() -> None:
    with pytest.raises(ValueError, match="level"):
        make_alert("t", level="loud")
    with pytest.raises(TypeError, match="level"):
        make_alert("t", level=3)
    with pytest.raises(ValueError, match="title"):
        make_alert("  ")
    with pytest.raises(TypeError, match="title"):
        make_alert(None)
    a = make_alert("disk", "almost full", "WARNING", rule="disk_full", kind="fire", event_id="s:3")
    assert a.level == "warning" and a.kind == "fire" and a.rank == 0
    d = a.as_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert set(d) == {
        "title", "text", "level", "rule", "kind", "step", "time", "project", "run", "stream",
        "rank", "event_id",
    }
    weird = Alert("t", "", "info", None, "manual", None, float("nan"), "p", "r", None, 0, None)
    assert "time" not in weird.as_dict()
    json.dumps(weird.as_dict(), allow_nan=False)


# -- webhook ---------------------------------------------------------------------------------


def test_webhook_posts_as_dict_signed_with_env_secret(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALERT_TEST_URL", httpserver.url_for("/hook"))
    monkeypatch.setenv("ALERT_TEST_HMAC", SECRET_KEY)
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    chan = {"type": "webhook", "url_env": "ALERT_TEST_URL", "secret_env": "ALERT_TEST_HMAC"}
    d = dispatch({"channels": {"ops": chan}, "policy": FAST})
    alert = _alert(rule="nan_loss", kind="fire", event_id="sess1:42")
    d.submit(alert)
    assert d.flush(5)
    assert d.stats()["ops"] == {"sent": 1, "failed": 0, "suppressed": 0, "pending": 0, "dropped": 0,
                                 "undelivered": 0}
    request = httpserver.log[0][0]
    body = request.get_data()
    assert json.loads(body) == alert.as_dict()
    assert request.headers["Content-Type"] == "application/json"
    expected = hmac.new(SECRET_KEY.encode(), body, hashlib.sha256).hexdigest()
    assert request.headers["X-Expr-Signature"] == f"sha256={expected}"
    assert request.headers["Idempotency-Key"] == "sess1:42:nan_loss"


def test_webhook_500_then_200_is_delivered_once(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher]
) -> None:
    httpserver.expect_ordered_request("/hook").respond_with_data("busy", status=500)
    httpserver.expect_ordered_request("/hook").respond_with_data("ok")
    d = dispatch(_webhook(httpserver.url_for("/hook")))
    d.submit(_alert())
    assert d.flush(5)
    assert d.stats()["ops"]["sent"] == 1 and d.stats()["ops"]["failed"] == 0
    assert [r.status_code for _, r in httpserver.log] == [500, 200]


def _timed(times: list[float], status: int, headers: dict[str, str]) -> Callable[[Request], Response]:
    def handler(request: Request) -> Response:
        times.append(time.monotonic())
        return Response("x", status=status, headers=headers)

    return handler


@pytest.mark.parametrize(
    ("status", "retry_after", "at_least"),
    [(429, lambda: "1", 0.9), (503, lambda: formatdate(time.time() + 2, usegmt=True), 0.8)],
    ids=["429-seconds", "503-http-date"],
)
def test_retry_after_is_honoured(
    httpserver: HTTPServer,
    dispatch: Callable[..., Dispatcher],
    status: int,
    retry_after: Callable[[], str],
    at_least: float,
) -> None:
    times: list[float] = []
    httpserver.expect_ordered_request("/hook").respond_with_handler(
        _timed(times, status, {"Retry-After": retry_after()})
    )
    httpserver.expect_ordered_request("/hook").respond_with_handler(_timed(times, 200, {}))
    d = dispatch(_webhook(httpserver.url_for("/hook")))  # backoff 0.01 s: the wait is the server's
    d.submit(_alert())
    assert d.flush(6)
    assert d.stats()["ops"]["sent"] == 1
    assert len(times) == 2
    assert at_least <= times[1] - times[0] < 3.0


def test_webhook_4xx_fails_without_retry(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    httpserver.expect_request("/hook").respond_with_data("gone", status=404)
    d = dispatch(_webhook(httpserver.url_for("/hook")))
    d.submit(_alert())
    assert d.flush(5)
    assert d.stats()["ops"]["failed"] == 1 and len(httpserver.log) == 1
    assert "HTTP 404" in caplog.text


def test_failures_are_counted_warned_once_and_never_leak_secrets(
    httpserver: HTTPServer,
    dispatch: Callable[..., Dispatcher],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # httpx/httpcore debug records included
    httpserver.expect_request(SECRET_PATH).respond_with_data("down", status=500)
    down_url = f"http://127.0.0.1:{_closed_port()}{SECRET_PATH}"
    monkeypatch.setenv("ALERT_TEST_DOWN", down_url)
    monkeypatch.setenv("ALERT_TEST_HMAC", SECRET_KEY)
    config = {
        "channels": {
            "down": {"type": "webhook", "url_env": "ALERT_TEST_DOWN", "secret_env": "ALERT_TEST_HMAC"},
            "err": {"type": "slack", "url": httpserver.url_for(SECRET_PATH)},
        },
        "policy": FAST,
    }
    warned: list[str] = []
    d = dispatch(config, on_warning=warned.append)
    start = time.monotonic()
    d.submit(_alert("first"))
    d.submit(_alert("second"))
    assert time.monotonic() - start < 0.1  # submit does not wait for delivery
    assert d.flush(10)
    stats = d.stats()
    assert stats["down"]["failed"] == 2 and stats["down"]["sent"] == 0
    assert stats["err"]["failed"] == 2
    assert len(httpserver.log) == 2 * 3  # first attempt + 2 retries, per alert
    assert len(warned) == 2  # once per (channel, cause), not once per alert
    assert any("ConnectError" in w and "http://127.0.0.1:" in w and "/…" in w for w in warned)
    assert any("HTTP 500" in w for w in warned)
    start = time.monotonic()
    d.close(timeout=2)
    assert time.monotonic() - start < 2.5
    out, err = capfd.readouterr()
    # the test server's own access log (werkzeug) shows the path it was asked for; ours must not
    ours = [caplog.handler.format(r) for r in caplog.records if not r.name.startswith("werkzeug")]
    assert any(r.startswith("DEBUG") and "httpcore" in r for r in ours)
    for text in (*ours, out, err, *warned, repr(load_config(config))):
        assert "TOPSECRETTOKEN42" not in text
        assert SECRET_KEY not in text


def test_failure_goes_to_logger_without_callback(
    dispatch: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    d = dispatch(_webhook(f"http://127.0.0.1:{_closed_port()}{SECRET_PATH}"))
    d.submit(_alert())
    assert d.flush(5)
    records = [r for r in caplog.records if r.name == "expr_tracker.alerts"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "gave up after 3 attempt(s)" in records[0].getMessage()
    assert "TOPSECRETTOKEN42" not in caplog.text


def test_close_is_bounded_when_the_receiver_hangs(dispatch: Callable[..., Dispatcher]) -> None:
    with socket.socket() as hole:  # accepts connections in the backlog, never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/hook"
        d = dispatch({**_webhook(url), "policy": {**FAST, "timeout": 20}})
        d.submit(_alert())
        d.submit(_alert("queued behind"))
        start = time.monotonic()
        assert d.close(timeout=0.3) is False
        assert time.monotonic() - start < 1.5
        stats = d.stats()["ops"]
        # the one in flight and the one behind it: both counted as undelivered (issue 10)
        assert stats["pending"] == 0 and stats["undelivered"] == 2 and stats["dropped"] == 0
        assert d.submit(_alert("after close")) == {"ops": "dropped"}
        assert d.stats()["ops"]["dropped"] == 1


# -- policy ----------------------------------------------------------------------------------


def test_rate_limit_suppresses_and_counts(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher]
) -> None:
    httpserver.expect_request("/hook").respond_with_data("ok")
    d = dispatch({**_webhook(httpserver.url_for("/hook")), "policy": {**FAST, "rate": 1, "burst": 2}})
    for i in range(5):
        d.submit(_alert(f"alert {i}"))
    assert d.flush(5)
    assert d.stats()["ops"]["sent"] == 2 and d.stats()["ops"]["suppressed"] == 3
    assert len(httpserver.log) == 2


def test_dedup_window_suppresses_same_rule_kind_level(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher]
) -> None:
    httpserver.expect_request("/hook").respond_with_data("ok")
    d = dispatch({**_webhook(httpserver.url_for("/hook")), "policy": {**FAST, "dedup_seconds": 300}})
    outcomes = [
        d.submit(_alert("nan", rule="nan_loss", kind="fire", event_id=f"s:{step}"))["ops"]
        for step in range(3)
    ]
    assert outcomes == ["queued", "suppressed", "suppressed"]
    d.submit(_alert("nan", rule="nan_loss", kind="recover"))
    d.submit(_alert("nan", level="critical", rule="nan_loss", kind="fire"))
    d.submit(_alert("nan"))  # a manual alert with the same title is not the rule
    assert d.flush(5)
    assert d.stats()["ops"]["sent"] == 4 and d.stats()["ops"]["suppressed"] == 2
    assert [json.loads(r.get_data())["kind"] for r, _ in httpserver.log] == [
        "fire", "recover", "fire", "manual",
    ]


def test_full_queue_drops_and_counts(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(request: Request) -> Response:
        entered.set()
        release.wait(5)
        return Response("ok")

    httpserver.expect_request("/hook").respond_with_handler(slow)
    d = dispatch({**_webhook(httpserver.url_for("/hook")), "policy": {**FAST, "max_queue": 3}})
    try:
        d.submit(_alert("in flight"))
        assert entered.wait(5)
        for i in range(5):
            d.submit(_alert(f"queued {i}"))
        assert d.stats()["ops"]["dropped"] == 2 and d.stats()["ops"]["pending"] == 4
    finally:
        release.set()
    assert d.flush(5)
    assert d.stats()["ops"]["sent"] == 4
    assert sum("queue is full" in r.getMessage() for r in caplog.records) == 1


def test_min_level_and_channel_filter(
    httpserver: HTTPServer, dispatch: Callable[..., Dispatcher]
) -> None:
    httpserver.expect_request("/a").respond_with_data("ok")
    httpserver.expect_request("/b").respond_with_data("ok")
    chans = {
        "a": {"type": "webhook", "url": httpserver.url_for("/a"), "min_level": "warning"},
        "b": {"type": "webhook", "url": httpserver.url_for("/b")},
    }
    d = dispatch({"channels": chans, "policy": FAST})
    assert d.submit(_alert("fyi", level="info")) == {"a": "below_min_level", "b": "queued"}
    assert d.submit(_alert("bad", level="error"), channels=["a"]) == {"a": "queued"}
    # an unknown name is warned about, never raised
    assert d.submit(_alert("odd"), channels=["nope"]) == {"nope": "unknown"}
    assert d.flush(5)
    assert sorted((r.path, json.loads(r.get_data())["title"]) for r, _ in httpserver.log) == [
        ("/a", "bad"), ("/b", "fyi"),
    ]
    assert d.channel_names == ("a", "b")


# -- slack, command, log ---------------------------------------------------------------------


def test_slack_payload_shape(httpserver: HTTPServer, dispatch: Callable[..., Dispatcher]) -> None:
    httpserver.expect_request("/slack").respond_with_data("ok")
    d = dispatch({"channels": {"s": {"type": "slack", "url": httpserver.url_for("/slack")}}})
    d.submit(make_alert("grad <norm> & co", "spiking\nagain", "critical", project="p", run="r"))
    assert d.flush(5)
    body = json.loads(httpserver.log[0][0].get_data())
    assert body["text"] == ":rotating_light: [CRITICAL] grad &lt;norm&gt; &amp; co"
    (att,) = body["attachments"]
    assert att["color"].startswith("#")
    section, context = att["blocks"]
    assert section["type"] == "section" and section["text"]["type"] == "mrkdwn"
    assert "*grad &lt;norm&gt; &amp; co*" in section["text"]["text"]
    assert "spiking\nagain" in section["text"]["text"]
    assert context["type"] == "context" and "p/r rank 0" in context["elements"][0]["text"]


def test_command_channel_gets_alert_json_on_stdin(
    tmp_path: Path, dispatch: Callable[..., Dispatcher]
) -> None:
    out = tmp_path / "got.json"
    script = _script(tmp_path, "page-me", 'cat > "$1"\n')
    d = dispatch({"channels": {"pager": {"type": "command", "argv": [script, str(out)]}}})
    alert = _alert(stream="data", rank=3)
    d.submit(alert)
    assert d.flush(5)
    assert d.stats()["pager"]["sent"] == 1
    assert json.loads(out.read_text()) == alert.as_dict()


def test_command_past_timeout_is_killed_with_its_children(
    tmp_path: Path, dispatch: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    pid_file = tmp_path / "child.pid"
    script = _script(tmp_path, "hang", 'sleep 30 &\necho $! > "$1"\nwait\n')
    chan = {"type": "command", "argv": [script, str(pid_file)], "timeout": 0.5, "retries": 0}
    d = dispatch({"channels": {"pager": chan}})
    start = time.monotonic()
    d.submit(_alert())
    assert d.flush(5)
    assert time.monotonic() - start < 3
    assert d.stats()["pager"]["failed"] == 1
    assert "timed out after 0.5 s" in caplog.text
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(100):  # the orphaned sleep is reaped by init shortly after the kill
        if not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.02)
    else:
        pytest.fail("the command's child survived the timeout")


def test_command_nonzero_exit_fails_with_its_stderr(
    tmp_path: Path, dispatch: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    script = _script(tmp_path, "broken", "echo 'pager service down' >&2\nexit 3\n")
    chan = {"type": "command", "argv": [script], "retries": 1, "backoff": 0.01}
    d = dispatch({"channels": {"pager": chan}})
    d.submit(_alert())
    assert d.flush(5)
    assert d.stats()["pager"]["failed"] == 1
    assert "exit status 3 (pager service down); gave up after 2 attempt(s)" in caplog.text


def test_log_channel_is_default_and_writes_one_stderr_line(
    dispatch: Callable[..., Dispatcher],
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = dispatch(None)
    assert d.channel_names == ("log",)
    d.submit(_alert(rule="nan_loss", kind="fire"))
    assert d.flush(5)
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "expr alert [error] loss diverged: loss is NaN at step 7 (p/r rank 0 step 7 rule nan_loss fire)"
    ]
    assert [r.getMessage() for r in caplog.records if r.name == "expr_tracker.alerts"] == [
        err.strip()
    ]


def test_log_channel_prints_once_without_logging_configured() -> None:
    code = (
        "from expr_tracker.alerts import Dispatcher, LogChannel, make_alert\n"
        "d = Dispatcher([LogChannel('log')])\n"
        "d.submit(make_alert('disk', 'full\\nreally', 'critical'))\n"
        "assert d.close(5)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert proc.stderr.splitlines() == ["expr alert [critical] disk: full really (/ rank 0)"]


def test_channels_built_directly() -> None:
    d = Dispatcher([LogChannel("a"), CommandChannel("b", ["true"])], Policy(retries=0))
    assert d.channel_names == ("a", "b")
    with pytest.raises(ValueError, match="'a'"):
        Dispatcher([LogChannel("a"), WebhookChannel("a", "http://127.0.0.1:9/x")])
    assert d.submit("not an alert") == {}  # type: ignore[arg-type]
    assert d.close(1) is True
    assert d.stats()["a"]["sent"] == 0


# -- configuration ---------------------------------------------------------------------------

TOML = """
[channels.ops]
type = "webhook"
url_env = "ALERT_TEST_URL"
secret = "file-secret-xyz"
min_level = "warning"
rate = 2

[channels.pager]
type = "command"
argv = ["true", "--team", "ml"]
timeout = 3

[policy]
burst = 7
retries = 1
"""


def test_config_from_toml_file_merged_under_the_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "alerts.toml"
    path.write_text(TOML)
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(path))
    cfg = load_config({"channels": {"pager": {"min_level": "error"}}, "policy": {"retries": 4}})
    assert cfg.source == str(path)
    ops, pager = cfg.channels
    assert (ops.name, ops.type, ops.min_level, ops.url_env) == ("ops", "webhook", "warning", "ALERT_TEST_URL")
    assert ops.policy == Policy(rate=2, burst=7, retries=4)
    assert (pager.argv, pager.min_level, pager.policy.timeout) == (("true", "--team", "ml"), "error", 3)
    assert "file-secret-xyz" not in repr(cfg)
    with pytest.raises(ValueError, match=r"'ops'.*'url_env'.*ALERT_TEST_URL"):
        Dispatcher.from_config(cfg)
    monkeypatch.setenv("ALERT_TEST_URL", "http://127.0.0.1:9/hook")
    d = Dispatcher.from_config(cfg)
    assert d.channel_names == ("ops", "pager")
    assert d.close(1)


def test_config_from_json_file_and_type_change_replaces_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "alerts.json"
    path.write_text(json.dumps({"channels": {"ops": {"type": "slack", "url": "https://x.test/a"}}}))
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(path))
    (ops,) = load_config(None).channels
    assert ops.type == "slack" and ops.policy == Policy()
    (ops,) = load_config({"channels": {"ops": {"type": "log"}}}).channels
    assert ops.type == "log" and ops.url is None


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"channels": {"ops": {"type": "webhook", "urll": "x"}}}, r"'ops'.*unknown key 'urll'"),
        ({"channels": {"ops": {"type": "email"}}}, r"'ops'.*'type'.*'email'"),
        ({"channels": {"ops": {"type": "log", "min_level": "loud"}}}, r"'ops'.*'min_level'"),
        ({"channels": {"ops": {"type": "log", "rate": -1}}}, r"'ops'.*'rate'"),
        ({"channels": {"ops": {"type": "log", "burst": 1.5}}}, r"'ops'.*'burst'"),
        ({"channels": {"ops": {"type": "webhook"}}}, r"'ops'.*'url'"),
        ({"channels": {"ops": {"type": "webhook", "url": "ftp://h/x"}}}, r"'ops'.*'url'"),
        ({"channels": {"ops": {"type": "webhook", "url_env": "1bad"}}}, r"'ops'.*'url_env'"),
        ({"channels": {"ops": {"type": "command", "argv": "page-me"}}}, r"'ops'.*'argv'"),
        ({"channels": {"ops": {"type": "log", "secret": "s"}}}, r"'ops'.*'secret'.*only"),
        ({"channels": {"bad/name": {"type": "log"}}}, r"'bad/name'"),
        ({"policy": {"retires": 3}}, r"policy.*unknown key 'retires'"),
        ({"policy": {"timeout": 0}}, r"policy.*'timeout'"),
        ({"policy": {"rate": 10**400}}, r"policy.*'rate'.*at most"),
        ({"channel": {}}, r"unknown key 'channel'"),
    ],
)
def test_bad_config_errors_name_the_key(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(config)


def test_bad_config_file_and_secret_free_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match=r"EXPR_ALERT_CONFIG.*cannot read"):
        load_config(None)
    bad = tmp_path / "bad.toml"
    bad.write_text("[channels.ops\n")
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(bad))
    with pytest.raises(ValueError, match=r"EXPR_ALERT_CONFIG.*not a valid"):
        load_config(None)
    monkeypatch.delenv("EXPR_ALERT_CONFIG")
    with pytest.raises(ValueError, match="'url'") as info:
        load_config(_webhook("hooks.example.com" + SECRET_PATH))
    assert "TOPSECRETTOKEN42" not in str(info.value)
    with pytest.raises(ValueError, match=r"'pager'.*'argv'.*not an executable"):
        Dispatcher.from_config({"channels": {"pager": {"type": "command", "argv": ["/nonexistent/x"]}}})


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # 3.12+ warns on fork with threads
def test_forked_child_gets_its_own_queue_and_thread(tmp_path: Path) -> None:
    out = tmp_path / "child.json"
    script = _script(tmp_path, "save", 'cat >> "$1"\n')
    d = Dispatcher([CommandChannel("c", [script, str(out)])], Policy(rate=0, dedup_seconds=0))
    d.submit(_alert("parent"))
    assert d.flush(5)
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread does not exist here
        code = 1
        try:
            d.submit(_alert("child"))
            code = 0 if d.close(5) and d.stats()["c"]["sent"] == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [json.loads(line)["title"] for line in out.read_text().splitlines()] == ["parent", "child"]
    assert d.close(5) and d.stats()["c"]["sent"] == 1
