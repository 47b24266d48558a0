"""`make torture`, part two: the soak sizes of issue 43's hostile cases.

    python bench/hostile.py [GB] [CONNECTIONS]

defaults 20 and 1100.
- A shard with a GB-sized NUL tail (a sparse hole, as a node crash leaves, after 64 MiB
  of written NULs): `expr summary`, `expr watch --once` and `expr serve`'s `/api/runs`
  each finish within 30 s, in bounded memory (max RSS), naming the NUL run.
- CONNECTIONS half-sent requests (a slowloris) against `expr serve` at `ulimit -n 1024`:
  a page's request answers while they are open, and every one is closed by the header
  deadline (10 s) without the client doing anything.

Prints a markdown table; exits 1 if a case failed. The suite runs small versions
(tests/test_hostile_files.py, tests/test_hostile_serve.py).
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.synthetic import write_run  # noqa: E402

EXPR = Path(sys.executable).parent / "expr"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}


def timed(args: list[str]) -> tuple[int, float, int, str]:
    """(exit code, seconds, max RSS MB of the child, stderr) of `expr ARGS`."""
    started = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run([str(EXPR), *args], env=_env(), capture_output=True, text=True,
                         timeout=600)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return out.returncode, time.monotonic() - started, max(rss, before) // 1024, out.stderr


def get(port: int, path: str, timeout: float = 30) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def serve(root: Path, nofile: int | None = None) -> tuple[subprocess.Popen[str], int]:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([str(EXPR), "serve", "--dir", str(root), "--port", "0"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline().split(":")[2].split("/")[0])


def nul_tail(tmp: Path, gb: int) -> list[tuple[str, bool, str]]:
    run = write_run(tmp / "runs" / "p" / "crashed-node", 8, 2000, status="finished")
    shard = run / "metrics.rank3.jsonl"
    with open(shard, "ab") as fh:
        fh.write(b"\0" * (64 << 20))
    os.truncate(shard, shard.stat().st_size + (gb << 30))
    rows = []
    for args in (["summary", str(run), "--json"], ["watch", str(run), "--once", "--json"]):
        code, took, rss, err = timed(args)
        ok = code == 0 and took < 30 and "NUL bytes" in err
        rows.append((f"`expr {args[0]}`, {gb} GB NUL tail", ok,
                     f"{took:.1f} s, max RSS {rss} MB, exit {code}"))
    proc, port = serve(tmp / "runs")
    try:
        started = time.monotonic()
        status = get(port, "/api/runs", timeout=120)
        status2 = get(port, "/api/runs/p/crashed-node/summary", timeout=120)
        took = time.monotonic() - started
        rows.append((f"`/api/runs` and the run's summary, {gb} GB NUL tail",
                     status == 200 and status2 == 200 and took < 30,
                     f"{took:.1f} s, {status}/{status2}"))
    finally:
        proc.send_signal(2)
        proc.communicate(timeout=30)
    return rows


def slowloris(tmp: Path, n: int) -> list[tuple[str, bool, str]]:
    root = tmp / "slow"
    write_run(root / "p" / "r", 4, 50, status="finished")
    # this process holds `n` sockets too
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    proc, port = serve(root, nofile=1024)
    socks: list[socket.socket] = []
    rows = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(s)
        sent = time.monotonic()
        answered = [get(port, "/api/runs") for _ in range(5)]
        rows.append((f"a page's requests with {n:,} half-sent ones open (ulimit -n 1024)",
                     answered == [200] * 5, f"{answered}"))
        closed = 0
        for s in socks:
            s.settimeout(max(0.1, sent + 30 - time.monotonic()))
            try:
                if s.recv(1) == b"":
                    closed += 1
            except (TimeoutError, OSError):
                pass
        took = time.monotonic() - sent
        rows.append((f"{n:,} half-sent requests closed by the header deadline", closed == n,
                     f"{closed:,} closed in {took:.1f} s"))
    finally:
        for s in socks:
            s.close()
        proc.send_signal(2)
        proc.communicate(timeout=30)
    return rows


def main() -> None:
    gb = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1100
    tmp = Path(tempfile.mkdtemp(prefix="expr-hostile-"))
    try:
        rows = nul_tail(tmp, gb) + slowloris(tmp, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| case | held | measured |\n| --- | --- | --- |")
    for case, ok, what in rows:
        print(f"| {case} | {'yes' if ok else 'NO'} | {what} |")
    print(json.dumps({"failed": sum(1 for _, ok, _ in rows if not ok)}))
    sys.exit(0 if all(ok for _, ok, _ in rows) else 1)


if __name__ == "__main__":
    main()
