"""The systemd units verify, and exprd speaks the sd_notify protocol on a real socket."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import env_for
from tests.test_daemon import EXPRD, write_config

UNITS = Path(__file__).resolve().parent.parent / "daemon"
VENV_EXPRD = Path(sys.executable).parent / "exprd"
GUIDE = UNITS.parent / "docs" / "systemd.md"  # "Running exprd under systemd" (was the README's)
EXAMPLE_CONFIG = UNITS / "exprd.toml.example"
INSTALLED_EXPRD = "/opt/exprd/venv/bin/exprd"  # where the guide installs exprd
EXPOSURE = 2.0  # `systemd-analyze security --offline` of exprd.service, as the guide says


def unit_values(text: str, key: str) -> list[str]:
    """Every value of `key=` in a unit file, split on whitespace, in order."""
    return [v for line in text.splitlines() if line.startswith(f"{key}=")
            for v in line.split("=", 1)[1].split()]


def _verify(unit: Path, tmp_path: Path, *, user: bool) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart is this venv's exprd."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    assert VENV_EXPRD.exists(), VENV_EXPRD
    text = unit.read_text()
    start = "%h/.local/bin/exprd" if user else INSTALLED_EXPRD
    assert f"ExecStart={start} " in text
    copy = tmp_path / ("exprd.service" if not user else "exprd-user.service")
    copy.write_text(text.replace(f"ExecStart={start} ", f"ExecStart={VENV_EXPRD} "))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    cmd = ["systemd-analyze", *(["--user"] if user else []), "verify", str(copy)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**env_for(), "XDG_RUNTIME_DIR": str(runtime)})
    # verify exits 0 on unknown keys too: any message is a finding
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_system_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    unit = UNITS / "exprd.service"
    text = unit.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=exprd",
                 "StateDirectory=exprd", "ReadWritePaths=", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes"):
        assert line in text, line
    _verify(unit, tmp_path, user=False)


def test_user_unit_verifies(tmp_path: Path) -> None:
    unit = UNITS / "exprd-user.service"
    assert "Type=notify" in unit.read_text()
    _verify(unit, tmp_path, user=True)


def _recv(sock: socket.socket, want: str, timeout: float) -> list[str]:
    """Datagrams until one contains `want`; returns all of them."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want!r} within {timeout} s; got {got}"
        sock.settimeout(left)
        msg = sock.recv(4096).decode()
        got.append(msg)
        if want in msg.split("\n"):
            return got


def test_notify_ready_watchdog_stopping_over_a_real_socket(tmp_path: Path) -> None:
    name = f"exprd-test-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)  # `@name` in NOTIFY_SOCKET: the abstract namespace
    spool, state = tmp_path / "spool", tmp_path / "state"
    spool.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [tmp_path / "runs"], rescan=5.0)
    env = env_for({"NOTIFY_SOCKET": f"@{name}", "WATCHDOG_USEC": "300000"})
    proc = subprocess.Popen([*EXPRD, "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert any(m.startswith("READY=1") for m in _recv(sock, "READY=1", 15))
        t0 = time.monotonic()
        _recv(sock, "WATCHDOG=1", 2)
        _recv(sock, "WATCHDOG=1", 2)
        # half of WATCHDOG_USEC: two pings in well under the 0.3 s deadline each
        assert time.monotonic() - t0 < 1.0
        proc.send_signal(signal.SIGTERM)
        _recv(sock, "STOPPING=1", 10)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        sock.close()
    assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()


def test_security_exposure_is_what_the_guide_says() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true",
                           str(UNITS / "exprd.service")], capture_output=True, text=True, timeout=60,
                          env=env_for({"SYSTEMD_COLORS": "0"}))
    last = [line for line in proc.stdout.splitlines() if "Overall exposure level" in line]
    assert last, proc.stdout + proc.stderr
    score = float(last[0].split(":")[1].split()[0])
    assert score <= EXPOSURE, last[0]
    assert f"exposure level {EXPOSURE}" in GUIDE.read_text()


def test_guide_installs_what_the_unit_starts() -> None:
    guide = GUIDE.read_text()
    text = (UNITS / "exprd.service").read_text()
    assert unit_values(text, "ExecStart")[0] == INSTALLED_EXPRD
    assert "python3 -m venv /opt/exprd/venv" in guide
    assert "/opt/exprd/venv/bin/pip install" in guide
    assert "daemon/exprd.toml.example /etc/exprd/exprd.toml" in guide
    assert "--allow-root" in guide


def test_example_config_loads_and_documents_every_key() -> None:
    from exprd import config

    cfg = config.load(EXAMPLE_CONFIG)
    text = EXAMPLE_CONFIG.read_text()
    for key in config.KEYS:
        assert f"\n{key} = " in text or f"[{key}." in text or f"\n[{key}]\n" in text, key
    # the unit may write where the example config points exprd: spool and run roots
    rw = unit_values((UNITS / "exprd.service").read_text(), "ReadWritePaths")
    assert str(cfg.spool) in rw
    assert [str(r) for r in cfg.allowed_roots or []] == rw[1:]
    assert unit_values((UNITS / "exprd.service").read_text(), "ExecStart")[2] == "/etc/exprd/exprd.toml"


TRAINER_UID, EXPRD_UID = 61001, 61002  # users with no passwd entry: ids are enough here


def _hardened(unit: str, rw: list[Path], cmd: list[str]) -> list[str]:
    """`cmd` as the unit would run it: another user with only the unit's ambient
    capabilities, in a mount namespace where the file system holding the test is read-only
    except `rw` (ProtectSystem=strict with ReadWritePaths=)."""
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in unit_values(unit, "AmbientCapabilities"))
    binds = "; ".join(f"mount --bind {p} {p}" for p in rw)
    script = (f"set -e; mount --make-rprivate /; {binds}; "
              f"mount -o remount,bind,ro $(findmnt -n -o TARGET -T {rw[0].parent}); "
              f'exec setpriv --reuid={EXPRD_UID} --regid={EXPRD_UID} --clear-groups '
              f'--inh-caps={caps} --ambient-caps={caps} "$@"')
    return ["unshare", "--mount", "sh", "-c", script, "sh", *cmd]


def test_retention_deletes_under_the_hardened_unit(tmp_path: Path) -> None:
    """A training user's 0700 spool directory, the unit's capabilities and writable paths:
    exprd applies the file, then retention deletes it."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "setpriv", "findmnt")):
        pytest.skip("needs root and util-linux (unshare, setpriv, findmnt) to play the unit")
    from tests.test_daemon import lines_of, make_spool, stop, wait_for, wait_ready

    unit = (UNITS / "exprd.service").read_text()
    spool, state, runs = tmp_path / "spool", tmp_path / "state", tmp_path / "runs"
    done = make_spool(spool, runs, "old", 5)
    os.utime(done, (time.time() - 3 * 86400, time.time() - 3 * 86400))
    for path in [spool, *spool.rglob("*")]:  # the training user's, as the SDK made them (0700)
        os.chown(path, TRAINER_UID, TRAINER_UID)
    assert (done.parent.stat().st_mode & 0o777) == 0o700
    for path in (state, runs):
        path.mkdir(mode=0o755)
        os.chown(path, EXPRD_UID, EXPRD_UID)
    cfg = write_config(tmp_path / "exprd.toml", spool, state, [runs], extra='retention = "1d"\n')
    check = subprocess.run(_hardened(unit, [spool, state, runs], ["touch", str(tmp_path / "x")]),
                           capture_output=True, text=True, timeout=30)
    if "Operation not permitted" in check.stderr and "mount" in check.stderr:
        pytest.skip(f"no mount namespaces here: {check.stderr.strip()}")
    assert check.returncode != 0 and "Read-only file system" in check.stderr, check.stderr
    with open(tmp_path / "exprd.log", "wb") as err:
        daemon = subprocess.Popen(_hardened(unit, [spool, state, runs], [*EXPRD[:3], "--config", str(cfg)]),
                                  stdout=subprocess.DEVNULL, stderr=err, env=env_for())
    try:
        wait_ready(state, daemon)
        wait_for(lambda: not done.exists(), 20, "retention to delete the applied spool file")
    finally:
        code = stop(daemon)
    log = (tmp_path / "exprd.log").read_text()
    assert code == 0, log
    assert [r["k"] for r in lines_of(runs / "proj" / "old" / "metrics.jsonl")] == list(range(5))
    assert (runs / "proj" / "old" / "metrics.jsonl").stat().st_uid == EXPRD_UID
    assert "deleted" in log and "Traceback" not in log


def _guide_service_steps() -> list[str]:
    """The shell lines of the guide's "System service" block, comments dropped."""
    guide = GUIDE.read_text()
    section = guide[guide.index("## System service"):guide.index("## User service")]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def _staged(line: str, root: Path) -> list[str] | None:
    """A guide line as it runs against the staged root `root` (None: done by the test)."""
    import shlex

    words = shlex.split(line)
    if words[:3] == ["python3", "-m", "venv"] or words[0].endswith("/bin/pip"):
        return None  # the venv: this test links the venv's own exprd where the unit runs it
    if words[0] == "install":
        *opts, src, dest = words
        return [*opts, src, f"{root}{dest}"]
    if words[0] in ("systemd-sysusers", "systemd-tmpfiles", "systemd-analyze"):
        return [words[0], f"--root={root}", *words[1:]]
    if words[:3] == ["systemctl", "enable", "--now"]:
        return ["systemctl", f"--root={root}", "enable", *words[3:]]  # no PID 1 to start it on
    raise AssertionError(f"the guide gained a step this test does not know: {line!r}")


def _passwd(root: Path) -> dict[str, int]:
    return {f[0]: int(f[2]) for f in (line.split(":") for line in
                                      (root / "etc/passwd").read_text().splitlines())}


def test_guide_service_steps_run_top_to_bottom_in_a_staged_root(tmp_path: Path) -> None:
    tools = ("systemd-sysusers", "systemd-tmpfiles", "systemd-analyze", "systemctl")
    if any(shutil.which(t) is None for t in tools):
        pytest.skip("systemd's tools are not installed (.ci/run installs the systemd package)")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles must be root to give the spool root to its owner")
    root = tmp_path / "root"
    # a fresh Debian machine as far as these steps go: systemd's own units, /bin/kill, no users
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "usr/bin").mkdir(parents=True)
    shutil.copy("/bin/kill", root / "usr/bin/kill")
    (root / "bin").symlink_to("usr/bin")
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\n")
    exprd = root / INSTALLED_EXPRD.lstrip("/")
    exprd.parent.mkdir(parents=True)
    shutil.copy(VENV_EXPRD, exprd)  # a copy: symlinks are resolved inside the staged root
    steps = _guide_service_steps()
    assert steps[-1] == "systemctl enable --now exprd", steps
    for line in steps:
        cmd = _staged(line, root)
        if cmd is None:
            continue
        done = subprocess.run(cmd, cwd=UNITS.parent, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        if cmd[0] == "systemd-analyze":
            assert not done.stderr.strip(), f"{line}: {done.stderr}"  # verify's findings
    users = _passwd(root)
    assert {"exprd", "train"} <= users.keys(), users
    spool, runs = (root / "var/spool/expr").stat(), (root / "srv/runs").stat()
    assert (spool.st_uid, spool.st_mode & 0o777) == (users["train"], 0o755)
    assert (runs.st_uid, runs.st_mode & 0o777) == (users["exprd"], 0o755)
    assert (root / "etc/systemd/system/multi-user.target.wants/exprd.service").is_symlink()
    # the directories the tmpfiles file makes are the ones the unit and the example config name
    unit = (UNITS / "exprd.service").read_text()
    assert unit_values(unit, "ReadWritePaths") == ["/var/spool/expr", "/srv/runs"]
    assert 'spool = "/var/spool/expr"' in EXAMPLE_CONFIG.read_text()
