"""`make torture`: exprd under kill -9, a full run root and a descriptor limit, for minutes.

    python bench/torture.py [SECONDS] [WRITERS] [RUNS_PER_WRITER] [STEPS]

defaults 180, 4, 25 and 3000. Spool-mode writer processes each keep RUNS_PER_WRITER
runs open at once (WRITERS x RUNS_PER_WRITER live spool files) and log STEPS steps to
each at a steady pace. Meanwhile exprd, started with a descriptor limit of 64 (below
the file count), is killed with SIGKILL at random moments and started again, and the
run root, a small tmpfs in a private mount namespace, is filled up and freed again.
Every 50 steps each run's spool file also gets one line of a bad kind (issue 20: a
`_step` that is text, negative or past int64, a nested value, no `_time`, an empty or
reserved key, a rank record out of its world, a `null` line), numbered like an event of
the run: exprd must quarantine every one and apply none. Every 1-3 s a live spool file
is rotated as logrotate without copytruncate does it (`mv f f.N`, then `cp f.N f` at once
or up to 2.5 s later): the SDK goes on in a new session, and the copy repeats records
exprd may have applied, maybe while the new session is live. At
the end every shard must hold every step exactly once, and no bad line. Prints a
markdown table.

Runs as root (it mounts a tmpfs); it re-runs itself under `unshare -m`.

`python bench/torture.py health [SECONDS]`: the health soak instead (`health_soak`).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

EXPRD = [sys.executable, "-m", "exprd.main", "--allow-root"]
NOFILE = 64
TMPFS_MB = 48


# spool lines exprd must refuse (`{seq}`: the event number the line takes); "k" is -1 in
# each, so one that landed in a shard is told from the good rows
BAD_LINES = [
    '{{"_step":"7","_time":1.0,"_seq":{seq},"k":-1}}',
    '{{"_step":-1,"_time":1.0,"_seq":{seq},"k":-1}}',
    '{{"_step":1180591620717411303424,"_time":1.0,"_seq":{seq},"k":-1}}',
    '{{"_step":9223372036854775808,"_time":1.0,"_seq":{seq},"k":-1}}',
    '{{"_step":5,"_time":1.0,"_seq":{seq},"k":-1,"a":{{"a":1}}}}',
    '{{"_step":5,"_time":1.0,"_seq":{seq},"k":-1,"a":[1]}}',
    '{{"_step":5,"_time":1.0,"_seq":{seq},"k":-1,"a":{{}}}}',
    '{{"_step":5,"_seq":{seq},"k":-1}}',
    '{{"_step":5,"_time":1.0,"_seq":{seq},"k":-1,"":2}}',
    '{{"_step":5,"_time":1.0,"_seq":{seq},"k":-1,"_x":2}}',
    '{{"_kind":"rank","_step":5,"_time":1.0,"_rank":99999999,"_world_size":-5,"_seq":{seq},"k":-1}}',
    'null',
]


def writer_code(spool: Path, root: Path, w: int, runs: int, steps: int, seconds: float) -> str:
    return textwrap.dedent(f"""
        import time, expr_tracker as et
        BAD = {BAD_LINES!r}
        runs = [et.Run("torture", "w{w}-r%d" % i, dir={str(root)!r}, upload_mode="spool",
                       spool_dir={str(spool)!r}) for i in range({runs})]
        pause = {seconds} * 0.8 / {steps} * 50

        def bad(run, i):
            # a hand-made line in the run's own spool file, numbered as its next event
            # (the SDK's private sink: this is a test of exprd, not of the SDK's API)
            with run._lock:
                sink = run._sink
                seq = sink.seq
                if "{{seq}}" in BAD[i % len(BAD)]:
                    sink.seq = seq + 1
                sink.writer.append(BAD[i % len(BAD)].format(seq=seq).encode() + b"\\n")

        for s in range(0, {steps}, 50):
            for i, run in enumerate(runs):
                for k in range(s, min(s + 50, {steps})):
                    run.log({{"loss": 1.0 / (k + 1), "k": k}})
                bad(run, s // 50 + i)
            time.sleep(pause)
        for run in runs:
            run.finish()
    """)


def low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def start_exprd(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen([*EXPRD, "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                stderr=err, preexec_fn=low_limit)


class Filler:
    """Fills the run root's tmpfs to the last byte, then frees it, again and again."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.path = root / ".filler"
        self.rng = rng
        self.stop = threading.Event()
        self.fills = 0
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def fill(self) -> None:
        block = b"\0" * (1 << 20)
        try:
            with open(self.path, "wb", buffering=0) as fh:
                while True:
                    fh.write(block)
        except OSError:
            pass  # full: ENOSPC is the point
        self.fills += 1

    def loop(self) -> None:
        while not self.stop.wait(self.rng.uniform(2.0, 5.0)):
            self.fill()
            self.stop.wait(self.rng.uniform(1.0, 3.0))
            self.path.unlink(missing_ok=True)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.path.unlink(missing_ok=True)


class Rotator:
    """Rotates a random live spool file every 1-3 s: `mv f f.N`, then `cp f.N f`.

    Rows the SDK wrote into the moved file after the copy was taken (it stats its path
    before each flush, and a move between that stat and its write misses it) reach no
    file exprd reads: logrotate's own race, counted apart in `raced` (steps per run).
    """

    def __init__(self, spool: Path, rng: random.Random) -> None:
        self.spool = spool
        self.rng = rng
        self.stop = threading.Event()
        self.rotations = 0
        self.moved: list[tuple[Path, int]] = []  # (moved file, bytes its copy got)
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            files = sorted(self.spool.glob("torture/*/metrics.*.jsonl"))
            if not files:
                continue
            path = self.rng.choice(files)
            moved = path.with_name(f"{path.name}.{self.rotations + 1}")
            try:
                path.rename(moved)
                # at once, or after the SDK's next flush started its new session
                time.sleep(self.rng.choice((0.0, self.rng.uniform(0.0, 2.5))))
                shutil.copyfile(moved, path)
            except OSError:
                continue  # a file that went away meanwhile
            self.moved.append((moved, os.path.getsize(path)))
            self.rotations += 1

    def raced(self) -> tuple[dict[str, set[int]], int]:
        """Per run name, the steps written into a moved file after its copy; and the bad
        lines written there."""
        out: dict[str, set[int]] = {}
        bad = 0
        for moved, copied in self.moved:
            with open(moved, "rb") as fh:
                fh.seek(copied)
                late = fh.read()
            for line in late.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec is None or (isinstance(rec, dict) and rec.get("k") == -1):
                    bad += 1
                elif isinstance(rec, dict) and isinstance(rec.get("_step"), int) \
                        and "_kind" not in rec:
                    out.setdefault(moved.parent.name, set()).add(rec["_step"])
        return out, bad

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()


def shards_done(root: Path, names: list[str], steps: int) -> bool:
    for name in names:
        run = root / "torture" / name
        try:
            meta = json.loads((run / "metrics.meta.json").read_text())
        except (OSError, ValueError):
            return False
        if meta.get("status") != "finished" or meta["cursor"]["rows"] < steps:
            return False
    return True


def check(root: Path, names: list[str], steps: int,
          raced: dict[str, set[int]]) -> tuple[int, int, int, int]:
    """(rows, lost, duplicated, bad lines that landed) over every shard; a step lost to
    the rotation race (`Rotator.raced`) is not counted as lost by exprd."""
    rows = lost = dup = landed = 0
    for name in names:
        seen: dict[int, int] = {}
        with open(root / "torture" / name / "metrics.jsonl", "rb") as fh:
            for line in fh:
                rec = json.loads(line)
                if rec.get("k") == -1:
                    landed += 1
                    continue
                if "_kind" in rec:
                    continue  # the SDK's system metrics (a rank record), not a step row
                k = rec["_step"]
                seen[k] = seen.get(k, 0) + 1
                rows += 1
        excused = raced.get(name, set())
        lost += sum(1 for k in range(steps) if k not in seen and k not in excused)
        dup += sum(n - 1 for n in seen.values() if n > 1)
    return rows, lost, dup, landed


def quarantined(state: Path) -> int:
    """Distinct bad lines in the quarantine (a line read again after a kill -9 is indexed
    again, at the same file and offset)."""
    seen = set()
    try:
        lines = (state / "quarantine" / "index.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        q = json.loads(line)
        if q["reason"].startswith(("bad record:", "not an event:")):
            seen.add((q["file"], q["offset"]))
    return len(seen)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 180.0
    writers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    per = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3000
    rng = random.Random(20261130)
    tmp = Path(tempfile.mkdtemp(prefix="exprd-torture-"))
    procs: list[subprocess.Popen[bytes]] = []
    d: subprocess.Popen[bytes] | None = None
    ok = False
    spool, state, root = tmp / "spool", tmp / "state", tmp / "runs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(root)],
                   check=True)
    try:
        spool.mkdir(mode=0o700)
        cfg = tmp / "exprd.toml"
        cfg.write_text(f"spool = {json.dumps(str(spool))}\nstate = {json.dumps(str(state))}\n"
                       f"allowed_roots = [{json.dumps(str(root))}]\nrescan_interval = 1\n"
                       "status_interval = 1\n")
        log = tmp / "exprd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPR_")}
        procs = [subprocess.Popen([sys.executable, "-c",
                                   writer_code(spool, root, w, per, steps, seconds)], env=env)
                 for w in range(writers)]
        filler = Filler(root, rng)
        filler.thread.start()
        rotator = Rotator(spool, random.Random(rng.random()))
        rotator.thread.start()
        kills = 0
        d = start_exprd(cfg, log)
        t0 = time.monotonic()
        while any(p.poll() is None for p in procs) or time.monotonic() - t0 < seconds:
            time.sleep(rng.uniform(0.5, 4.0))
            d.kill()  # SIGKILL: no drain, no checkpoint, maybe half a write
            d.wait()
            kills += 1
            d = start_exprd(cfg, log)
        assert all(p.wait() == 0 for p in procs)
        rotator.finish()
        filler.finish()
        names = [f"w{w}-r{i}" for w in range(writers) for i in range(per)]
        deadline = time.monotonic() + 120
        while not shards_done(root, names, steps):
            if time.monotonic() > deadline:
                late = [n for n in names if not shards_done(root, [n], steps)]
                raise SystemExit(f"{len(late)} shards not finished 120 s after the writers "
                                 f"(e.g. {late[:3]}); state and log kept in {tmp}")
            time.sleep(0.5)
        d.send_signal(signal.SIGTERM)
        d.wait(15)
        elapsed = time.monotonic() - t0
        raced, raced_bad = rotator.raced()
        rows, lost, dup, landed = check(root, names, steps, raced)
        late = sum(len(v) for v in raced.values())
        caught = quarantined(state)
        bad = writers * per * len(range(0, steps, 50)) - raced_bad
        text = log.read_text(errors="replace")
        # each exprd logs a cause once: these count the exprd lives that met it
        enospc, emfile = text.count("No space left on device"), text.count("Too many open files")
        ok = not lost and not dup and rows == writers * per * steps - late and not landed \
            and caught == bad
    finally:
        for p in [*procs, *([d] if d is not None else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()
        if not ok:
            shutil.copytree(root, tmp / "runs-kept", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".filler"))
        subprocess.run(["umount", str(root)], check=False)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    events = writers * per * steps
    table = [
        ("duration", f"{elapsed:.0f} s"),
        ("writers x live spool files", f"{writers} x {per} = {writers * per}"),
        ("descriptor limit of exprd", str(NOFILE)),
        ("events logged", f"{events:,}"),
        ("exprd kill -9", str(kills)),
        ("run root filled to ENOSPC", f"{filler.fills} times"),
        ("spool files rotated (mv, then cp back)", str(rotator.rotations)),
        ("rows the SDK wrote into a moved file after its copy", str(late)),
        ("exprd lives that met ENOSPC / EMFILE", f"{enospc} / {emfile}"),
        ("rows in shards", f"{rows:,}"),
        ("rows lost", str(lost)),
        ("duplicates", str(dup)),
        ("bad spool lines written / quarantined / in shards", f"{bad:,} / {caught:,} / {landed}"),
    ]
    print("| measure | value |")
    print("| --- | --- |")
    for k, v in table:
        print(f"| {k} | {v} |")
    if lost or dup or rows != events - late or landed or caught != bad:
        raise SystemExit(f"FAILED: {lost} rows lost, {dup} duplicates, {landed} bad lines in "
                         f"shards, {caught} of {bad} bad lines quarantined")


def health_soak(seconds: float) -> None:
    """`python bench/torture.py health [SECONDS]` (default 180): a healthy 4-rank job beside
    a busy loop, watched with the default thresholds and a webhook on 127.0.0.1 (issue
    48): nothing may be paged. Prints a markdown table."""
    import http.server

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.test_health_cluster import healthy_job_pages_nothing

    pages: list[bytes] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            pages.append(self.rfile.read(int(self.headers.get("content-length") or 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = Path(tempfile.mkdtemp(prefix="expr-health-soak-"))
    try:
        t0 = time.monotonic()
        _, lines = healthy_job_pages_nothing(tmp, f"http://127.0.0.1:{server.server_port}/hook",
                                             seconds)
        elapsed = time.monotonic() - t0
    finally:
        server.shutdown()
    opened = [i for i in lines if i.get("state") == "open" and not i.get("delivered")
              and "paging" not in i]
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| duration | {elapsed:.0f} s |")
    print(f"| incidents opened (held under page_after, or resolved) | {len(opened)} |")
    print(f"| pages | {len(pages)} |")
    if pages:
        raise SystemExit(f"FAILED: a healthy job paged {len(pages)} times; lines kept in {tmp}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["health"]:
        health_soak(float(sys.argv[2]) if len(sys.argv) > 2 else 180.0)
        sys.exit(0)
    if os.environ.get("EXPR_TORTURE_NS") != "1":
        env = {**os.environ, "EXPR_TORTURE_NS": "1"}
        sys.exit(subprocess.call(["unshare", "-m", sys.executable, *sys.argv], env=env))
    main()
