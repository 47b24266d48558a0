"""A simulated cluster on one machine (DESIGN 21): nodes as Linux namespaces.

Each node is a network namespace with its own hostname (UTS) and mount namespace, its
`eth0` on a bridge, a node-local spool (a tmpfs mounted only inside the node, or a
directory standing for the node's disk) and, on request, its own exprd. Every node
sees one shared run root at the same path as the host; in caching mode the root is
mounted inside each node (and the login node) through bindfs with FUSE attribute and
entry caching, as an NFS client caches, and its locks forwarded to the shared root, as
NFS's are. Faults: a node killed whole (every pid in its
network namespace), a link set down, a node's wall clock shifted (an LD_PRELOAD shim of
CLOCK_REALTIME; libfaketime would break `time.sleep`), a small spool tmpfs.

Isolation: the bridge lives in a namespace of its own (the "switch"), and the veths are
created directly inside their namespaces, so no interface, route or address is ever added
to the host; the namespace names carry the pid and a counter, so concurrent test runs
never collide. `Cluster.close()` kills every process of every namespace by pid and
deletes the namespaces; the mounts live only in the nodes' mount namespaces and go with
their last process.

Needs root, iproute2, util-linux (`nsenter`, `unshare`), and for the caching mode bindfs
and /dev/fuse; `require_cluster()` skips with the reason otherwise.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.procs import env_for

_COUNTER = itertools.count()
PYTHON = sys.executable
MASTER_PORT = 29500  # free in a fresh network namespace, whatever the host runs

# The clock shim: CLOCK_REALTIME (and what reads it: gettimeofday, time) moved by
# $CLUSTER_CLOCK_OFFSET seconds. Monotonic clocks and sleeps are untouched, so
# time.sleep and timeouts behave; file mtimes stay the kernel's (the shared
# filesystem's clock), as on a real cluster whose node clock is off.
_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long offset_s(void) {
    static int done; static long long off;
    if (!done) { const char *s = getenv("CLUSTER_CLOCK_OFFSET"); off = s ? atoll(s) : 0; done = 1; }
    return off;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += offset_s();
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def require_cluster(cache: bool = False) -> None:
    """Skip the calling test, saying why, where namespaces (or FUSE for `cache`) are refused."""
    if os.geteuid() != 0:
        pytest.skip("the cluster harness needs root (network and mount namespaces)")
    for tool in ("ip", "nsenter", "unshare", "gcc") + (("bindfs",) if cache else ()):
        if shutil.which(tool) is None:
            pytest.skip(f"the cluster harness needs {tool}, not installed")
    if cache and not os.path.exists("/dev/fuse"):
        pytest.skip("the caching mode needs /dev/fuse")
    probe = f"xcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"network namespaces refused here: {made.stderr.strip()}")
    try:
        ok = subprocess.run(["nsenter", f"--net=/run/netns/{probe}", "unshare", "--uts", "--mount",
                             "true"], capture_output=True, text=True)
        if ok.returncode != 0:
            pytest.skip(f"unshare of UTS/mount namespaces refused here: {ok.stderr.strip()}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if cache:  # a FUSE mount can be refused where namespaces are not (a container's policy)
        with tempfile.TemporaryDirectory() as d:
            mounted = subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f"bindfs {d} {d} && fusermount -u {d}"], capture_output=True, text=True,
                timeout=30)
            if mounted.returncode != 0:
                pytest.skip(f"bindfs cannot mount here: {mounted.stderr.strip()}")


def clock_shim(workdir: Path) -> Path:
    """Compile the CLOCK_REALTIME shim into `workdir`; returns the .so for LD_PRELOAD."""
    src, lib = workdir / "clockshim.c", workdir / "clockshim.so"
    src.write_text(_SHIM_C)
    _sh("gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl")
    return lib


def _netns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return None


def pids_in_netns(ns: str) -> list[int]:
    """Every process whose network namespace is `ns` (its torchrun, ranks, exprd, bindfs)."""
    ino = _netns_inode(ns)
    if ino is None:
        return []
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino == ino:
                    out.append(int(entry.name))
            except OSError:  # gone meanwhile, or a kernel thread
                continue
    return out


class Node:
    """One machine: a netns + UTS + mount namespace held open by an anchor process."""

    def __init__(self, cluster: Cluster, index: int, name: str, *, spool_size: str | None,
                 clock_offset: int = 0) -> None:
        self.cluster, self.index, self.name = cluster, index, name
        self.ns = f"{cluster.tag}-{name}"
        self.addr = f"{cluster.subnet}.{10 + index}"
        self.dir = cluster.work / name  # the node's own disk: config, exprd state, logs
        self.spool = self.dir / "spool"
        self.state = self.dir / "state"
        self.spool_size = spool_size  # a tmpfs of this size, or None: a directory on disk
        self.clock_offset = clock_offset
        self.anchor: subprocess.Popen[str] | None = None
        self.exprd: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[Any]] = []

    def boot(self) -> None:
        """Create the namespaces and mounts (again after `kill`: a reboot, disk kept)."""
        c = self.cluster
        self.dir.mkdir(exist_ok=True)
        self.spool.mkdir(mode=0o700, exist_ok=True)
        if _netns_inode(self.ns) is None:
            _sh("ip", "netns", "add", self.ns)
            _sh("ip", "link", "add", "eth0", "netns", self.ns, "type", "veth", "peer", "name",
                f"v{self.name}", "netns", c.switch)
            _sh("ip", "-n", c.switch, "link", "set", f"v{self.name}", "master", "br0", "up")
            _sh("ip", "-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", "eth0")
            _sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            # a cut link's connections resume within a second of the link coming back, not
            # after TCP's backoff (up to 2 minutes): the test waits for the job, not for TCP
            rto = Path("/proc/sys/net/ipv4/tcp_rto_max_ms")
            if rto.exists():  # Linux 6.15+; per network namespace
                # ... and a connection outlives a cut as long as a real node's does: with
                # a 1 s backoff, the default 15 retries give up after ~14 s (a real node's,
                # backing off to 2 minutes, after ~15 minutes); 255 (the most) are ~4 minutes
                _sh("ip", "netns", "exec", self.ns, "sysctl", "-qw",
                    "net.ipv4.tcp_rto_max_ms=1000", "net.ipv4.tcp_retries2=255")
        steps = [f"hostname {self.name}", f"mount --bind {c.hosts} /etc/hosts"]
        if self.spool_size:
            steps.append(f"mount -t tmpfs -o size={self.spool_size},mode=700 tmpfs {self.spool}")
        if c.cache is not None:
            # the same path as on the host, so a run's `dir` means the same file everywhere
            # attributes (sizes), names and, as NFS's lookupcache does, absent names; locks
            # reach the shared root, as NFS's do (NLM, NFSv4): every node's flock is one
            # lock (bindfs needs --multithreaded for that, or it deadlocks on contention)
            t = c.cache
            steps.append(f"bindfs -o attr_timeout={t},entry_timeout={t},negative_timeout={t} "
                         f"--multithreaded --enable-lock-forwarding {c.root} {c.root}")
        steps += ["echo ready", "exec sleep infinity"]  # the anchor holds the namespaces
        self.anchor = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-ec", "\n".join(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.anchor.stdout is not None
        line = self.anchor.stdout.readline()  # blocks until the mounts are up or sh failed
        if line.strip() != "ready":
            err = self.anchor.stderr.read() if self.anchor.stderr else ""
            raise RuntimeError(f"node {self.name} did not boot: {err.strip()}")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on this node: its spool, gloo's interface, its clock."""
        env = {"EXPR_SPOOL": str(self.spool), "GLOO_SOCKET_IFNAME": "eth0",
               "OMP_NUM_THREADS": "1"}
        if self.clock_offset:
            env["LD_PRELOAD"] = str(self.cluster.shim())
            env["CLUSTER_CLOCK_OFFSET"] = str(self.clock_offset)
        return env_for({**env, **(extra or {})})

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this node. nsenter execs it, so the Popen's pid is the process's."""
        assert self.anchor is not None, f"{self.name} is not booted"
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(
            ["nsenter", "-t", str(self.anchor.pid), "-u", "-m", "-n", f"--wd={self.cluster.work}",
             "--", *argv], env=self.env(env), **kw)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this node to the end (text output)."""
        proc = self.popen(argv, env, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{argv} on {self.name} timed out: {err[-2000:]}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def start_exprd(self, extra: str = "") -> subprocess.Popen[bytes]:
        """This node's exprd, on its spool and state, writing only under the shared root."""
        self.state.mkdir(exist_ok=True)
        cfg = self.dir / "exprd.toml"
        cfg.write_text(
            f"spool = {json.dumps(str(self.spool))}\nstate = {json.dumps(str(self.state))}\n"
            f"allowed_roots = [{json.dumps(str(self.cluster.root))}]\n"
            f"watch_roots = [{json.dumps(str(self.cluster.root))}]\n"
            "rescan_interval = 0.5\nstatus_interval = 0.5\n"
            + self.cluster.pager_toml(f"{self.name}-exprd", prefix="alert.") + extra)
        log = open(self.dir / "exprd.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self.exprd = self.popen([PYTHON, "-m", "exprd.main", "--allow-root", "--config",
                                     str(cfg)], stdout=subprocess.DEVNULL, stderr=log)
        finally:
            log.close()
        wait_for(self._exprd_ready, 30, f"exprd on {self.name}")
        return self.exprd

    def _exprd_ready(self) -> bool:
        assert self.exprd is not None and self.exprd.poll() is None, \
            f"exprd on {self.name} exited: {self.exprd_log()[-2000:]}"
        try:
            return json.loads((self.state / "status.json").read_text())["pid"] == self.exprd.pid
        except (OSError, ValueError, KeyError):
            return False

    def exprd_log(self) -> str:
        path = self.dir / "exprd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_exprd(self, timeout: float = 20) -> None:
        """SIGTERM: exprd drains its spool into the shards and exits."""
        if self.exprd is not None and self.exprd.poll() is None:
            self.exprd.send_signal(signal.SIGTERM)
            self.exprd.wait(timeout)

    def kill(self) -> list[int]:
        """The node dies whole: SIGKILL every pid of its network namespace, until none is left
        (a dying torchrun may still fork). Its namespaces and mounts go with the last one."""
        killed: list[int] = []
        for _ in range(50):
            pids = pids_in_netns(self.ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        else:
            raise AssertionError(f"processes of {self.name} survive SIGKILL: {pids_in_netns(self.ns)}")
        for proc in [*self.procs, self.anchor]:
            if proc is not None:
                try:  # reap what we started; its pipes close with it
                    proc.communicate(timeout=10)
                except (ValueError, OSError):  # a pipe already read to its end by its owner
                    proc.wait(10)
        self.procs, self.anchor, self.exprd = [], None, None
        return killed

    def rank_pid(self, rank: int) -> int:
        """The pid of the training process of `rank` on this node (its RANK variable)."""
        want = f"RANK={rank}".encode()
        for pid in pids_in_netns(self.ns):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = fh.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read()
            except OSError:
                continue
            if want in env and b"cluster_train.py" in cmd and b"torch.distributed.run" not in cmd:
                return pid
        raise AssertionError(f"no process of rank {rank} on {self.name}")

    def fill_spool(self, full: bool = True) -> None:
        """The node's spool disk fills up, as another job's files would fill it (a filler
        file written to ENOSPC), or, with full=False, gets its space back."""
        filler = self.spool / ".filler"
        cmd = f"cat /dev/zero > {filler} 2>/dev/null; true" if full else f"rm -f {filler}"
        done = self.run(["sh", "-c", cmd])
        assert done.returncode == 0, done.stderr

    def link(self, up: bool) -> None:
        """Plug or unplug this node's cable: its port on the switch goes up or down."""
        _sh("ip", "-n", self.cluster.switch, "link", "set", f"v{self.name}", "up" if up else "down")

    def close(self) -> None:
        self.kill()
        if _netns_inode(self.ns) is not None:
            _sh("ip", "netns", "del", self.ns, check=False)


class Cluster:
    """`nodes` compute nodes (node0, node1, ...) and a `login` node, one shared run root.

    cache: seconds of FUSE attribute/entry caching of the shared root on every node, or
    None for a direct view. spool_sizes: a node's spool tmpfs size ("64k"), or None for a
    directory on the node's disk (a node killed and rebooted finds it again); a node not
    named gets a 64 MiB tmpfs.
    """

    def __init__(self, work: Path, nodes: int = 2, *, cache: int | None = None,
                 spool_sizes: dict[int, str | None] | None = None,
                 clock_offsets: dict[int, int] | None = None) -> None:
        n = next(_COUNTER)
        self.tag = f"xc{os.getpid()}x{n}"
        # any subnet works (the bridge is in a namespace of its own); the pid in it makes
        # a harness's addresses tell apart in logs
        self.subnet = f"10.{(os.getpid() >> 8) & 0xFF}.{(os.getpid() + n) & 0xFF}"
        self.switch = f"{self.tag}-sw"
        self.work = work
        self.root = work / "shared"  # the shared filesystem: every node sees it here
        self.ledgers = work / "ledgers"  # what each rank logged (the harness's, uncached)
        self.pages = work / "pages.jsonl"  # every delivered page, from any watcher
        self.hosts = work / "hosts"
        self.cache = cache
        self._shim: Path | None = None
        sizes = spool_sizes or {}
        offsets = clock_offsets or {}
        self.nodes = [Node(self, i, f"node{i}", spool_size=sizes.get(i, "64m"),
                           clock_offset=offsets.get(i, 0)) for i in range(nodes)]
        self.login = Node(self, nodes, "login", spool_size=None)

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for d in (self.work, self.root, self.ledgers):
            d.mkdir(parents=True, exist_ok=True)
        everyone = [*self.nodes, self.login]
        self.hosts.write_text("127.0.0.1 localhost\n"
                              + "".join(f"{n.addr} {n.name}\n" for n in everyone))
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in everyone:
            node.boot()

    def close(self) -> None:
        """Kill every process of every node by pid, then delete the namespaces. Never raises
        half-way: a node that fails to close does not keep the others alive."""
        errors = []
        for node in [*self.nodes, self.login]:
            try:
                node.close()
            except Exception as exc:  # keep closing the rest; report at the end
                errors.append(f"{node.name}: {exc}")
        if _netns_inode(self.switch) is not None:
            _sh("ip", "netns", "del", self.switch, check=False)
        assert not errors, errors

    def shim(self) -> Path:
        if self._shim is None:
            self._shim = clock_shim(self.work)
        return self._shim

    def pager_toml(self, who: str, prefix: str = "") -> str:
        """An alert channel that appends each page, tagged with `who`, to `self.pages`:
        a command channel, since a watcher inside a namespace cannot reach the host's
        loopback. No rate limit, so every page shows."""
        code = ("import os,sys,json; a=json.loads(sys.stdin.read()); a['_by']=sys.argv[2]; "
                "fd=os.open(sys.argv[1],os.O_WRONLY|os.O_APPEND|os.O_CREAT,0o600); "
                "os.write(fd,(json.dumps(a)+'\\n').encode())")
        argv = [PYTHON, "-c", code, str(self.pages), who]
        return (f"[{prefix}channels.page]\ntype = \"command\"\nargv = {json.dumps(argv)}\n"
                f"[{prefix}policy]\nrate = 0\n")

    def read_pages(self) -> list[dict[str, Any]]:
        if not self.pages.exists():
            return []
        return [json.loads(x) for x in self.pages.read_text().splitlines() if x.strip()]


def wait_for(pred: Callable[[], Any], timeout: float, what: str | Callable[[], str],
             every: float = 0.2) -> Any:
    """Poll `pred` until it returns something true (returned); AssertionError on timeout,
    saying `what` (a callable: called then, to show the state that was waited on)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {said}")
        time.sleep(every)
