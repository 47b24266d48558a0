"""A two-node torchrun job on the simulated cluster, and what the cluster's users see of it.

`Job` starts `torchrun --nnodes 2 --nproc_per_node 2` of tests/cluster_train.py on node0
and node1 (static rendezvous on node0's bridge address: node0 holds ranks 0-1, node1
ranks 2-3). `count_rows` holds each rank's shard against the ledger the rank kept of what
it logged: rows lost, rows doubled (by `_step`, and in spool mode by `_sid`/`_seq`).
`login` runs `expr` on the login node, through its view of the shared root (cached in
caching mode); `Watcher` is an `expr watch` there, paging into the cluster's page log.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster import MASTER_PORT, PYTHON, Cluster, Node, wait_for

TRAIN = Path(__file__).resolve().parent / "cluster_train.py"
PROJECT = "cluster"
NPROC = 2


def shard_name(rank: int) -> str:
    return "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"


def sidecar(run_dir: Path, rank: int) -> dict[str, Any]:
    """A rank's sidecar as the host reads it (uncached); {} while there is none."""
    path = run_dir / shard_name(rank).replace(".jsonl", ".meta.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class Job:
    """One torchrun per node of `nodes`; `mode` is "spool" (each node's exprd applies) or
    "direct" (the ranks write the shared root themselves)."""

    def __init__(self, cluster: Cluster, name: str, *, mode: str, steps: int,
                 step_sleep: float = 0.02, pad: int = 0, stall: str | None = None,
                 env: dict[str, str] | None = None, nodes: list[Node] | None = None) -> None:
        self.cluster, self.name, self.steps = cluster, name, steps
        self.nodes = nodes or cluster.nodes[:2]
        self.world = NPROC * len(self.nodes)
        self.run_dir = cluster.root / PROJECT / name
        self.env = {"ROOT": str(cluster.root), "RUN_NAME": name, "STEPS": str(steps),
                    "STEP_SLEEP": str(step_sleep), "PAD": str(pad),
                    "LEDGER": str(cluster.ledgers), "EXPR_MODE": mode,
                    "STALL": stall or "-1:-1:0", **(env or {})}
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self) -> Job:
        master = self.nodes[0].addr
        for i, node in enumerate(self.nodes):
            log = open(self.cluster.work / f"{self.name}.{node.name}.log", "ab")  # noqa: SIM115
            try:
                self.procs.append(node.popen(
                    [PYTHON, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                     "--nproc_per_node", str(NPROC), "--node_rank", str(i),
                     "--master_addr", master, "--master_port", str(MASTER_PORT), str(TRAIN)],
                    self.env, stdout=log, stderr=subprocess.STDOUT))
            finally:
                log.close()
        return self

    def log(self, node: Node) -> str:
        path = self.cluster.work / f"{self.name}.{node.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, timeout: float = 90) -> list[int]:
        """Every node's torchrun exit status, in node order."""
        return [p.wait(timeout) for p in self.procs]

    def check_ok(self, timeout: float = 90) -> None:
        codes = self.wait(timeout)
        assert codes == [0] * len(codes), "\n".join(
            f"--- {n.name}: exit {c}\n{self.log(n)[-3000:]}" for n, c in zip(self.nodes, codes, strict=True))

    def ledger(self, rank: int) -> dict[str, Any]:
        """What the rank logged: `steps` (after each log() returned) and, if it got to the
        end, `info` (et.info() before finish), `after` (after finish) and `host`."""
        base = self.cluster.ledgers / f"{self.name}.rank{rank}"
        steps_file, end = Path(f"{base}.steps"), Path(f"{base}.json")
        out: dict[str, Any] = json.loads(end.read_text()) if end.exists() else {}
        text = steps_file.read_text() if steps_file.exists() else ""
        out["steps"] = [int(x) for x in text.split()]
        return out

    def progress(self, rank: int) -> int:
        """How many steps the rank has logged so far."""
        return len(self.ledger(rank)["steps"])

    def wait_steps(self, n: int, timeout: float = 60) -> None:
        """Until every rank logged at least n steps (the job is past its start-up)."""
        wait_for(lambda: all(self.progress(r) >= n for r in range(self.world)), timeout,
                 f"{self.name}: every rank at step {n}\n" + self.log(self.nodes[0])[-2000:])

    def wait_finished(self, ranks: list[int], timeout: float = 30) -> None:
        """Until those ranks' sidecars read `finished` (in spool mode, exprd applied all);
        fails as soon as each reads finished or crashed, and one reads crashed."""

        def states() -> list[str | None]:
            return [sidecar(self.run_dir, r).get("status") for r in ranks]

        wait_for(lambda: all(s in ("finished", "crashed") for s in states()), timeout,
                 f"sidecars of ranks {ranks} to read finished: {states()}")
        assert states() == ["finished"] * len(ranks), f"sidecars of ranks {ranks}: {states()}"


@dataclass
class RankRows:
    """One rank's step rows in its shard, against its ledger."""

    rank: int
    logged: list[int]
    steps: Counter[int] = field(default_factory=Counter)
    events: Counter[tuple[str, int]] = field(default_factory=Counter)
    garbled: int = 0

    @property
    def lost(self) -> list[int]:
        return sorted(set(self.logged) - set(self.steps))

    @property
    def doubled(self) -> list[int]:
        return sorted(s for s, n in self.steps.items() if n > 1)

    @property
    def doubled_events(self) -> list[tuple[str, int]]:
        return sorted(e for e, n in self.events.items() if n > 1)

    def __str__(self) -> str:
        return (f"rank {self.rank}: logged {len(self.logged)}, in shard {sum(self.steps.values())}"
                f", lost {len(self.lost)} {self.lost[:8]}, doubled {self.doubled[:8]}, "
                f"doubled events {self.doubled_events[:4]}, garbled {self.garbled}")


def count_rows(job: Job) -> dict[int, RankRows]:
    """Each rank's step rows (records without `_kind`) counted per `_step` and per event id,
    read from the host (no cache). An unterminated last line is not a row (DESIGN 4)."""
    out = {}
    for rank in range(job.world):
        rows = RankRows(rank, job.ledger(rank)["steps"])
        path = job.run_dir / shard_name(rank)
        data = path.read_bytes() if path.exists() else b""
        for line in data.split(b"\n")[:-1]:
            try:
                rec = json.loads(line)
            except ValueError:
                rows.garbled += 1
                continue
            if "_kind" in rec:
                continue
            rows.steps[rec["_step"]] += 1
            if "_sid" in rec:
                rows.events[(rec["_sid"], rec["_seq"])] += 1
        out[rank] = rows
    return out


def assert_exactly_once(job: Job, ranks: list[int] | None = None) -> dict[int, RankRows]:
    """Every row each rank logged is in its shard once, and nothing else is."""
    counts = count_rows(job)
    for rank in ranks if ranks is not None else range(job.world):
        c = counts[rank]
        assert c.logged == list(range(job.steps)), f"rank {rank} did not log every step: {c}"
        assert not c.lost and not c.doubled and not c.doubled_events and not c.garbled, str(c)
        assert set(c.steps) == set(c.logged), str(c)
    return counts


def incidents(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """incidents.jsonl by incident id, each id's lines in order (host view, uncached)."""
    path = run_dir / "incidents.jsonl"
    out: dict[str, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                rec = json.loads(line)
                out.setdefault(rec["id"], []).append(rec)
    return out


# what a healthy job must never show, whatever the load (not the ratio detectors, which a
# busy machine can trip: issue 48 item 3 is about those)
SERIOUS = ("hang", "stall", "missing", "crashed", "behind", "lost")


def serious(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The incidents of a SERIOUS kind, by id."""
    return {i: lines for i, lines in incidents(run_dir).items() if lines[0]["kind"] in SERIOUS}


def brief(run_dir: Path) -> list[tuple[str, list[int], list[str], str]]:
    """Each incident's last line, short: what a failure message shows."""
    return [(x[-1]["kind"], x[-1]["ranks"], x[-1]["hosts"], x[-1]["detail"][:120])
            for x in incidents(run_dir).values()]


def login(cluster: Cluster, *args: str, ok: tuple[int, ...] = (0,)) -> Any:
    """`expr ARGS --json` on the login node; its JSON (a list for line-per-record output)."""
    proc = cluster.login.run([PYTHON, "-m", "expr_cli.main", *args, "--json"])
    assert proc.returncode in ok, f"expr {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
    text = proc.stdout.strip()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return [json.loads(x) for x in text.splitlines() if x.strip()]


def health_toml(**keys: Any) -> str:
    """A `[health]` table (durations as text, e.g. hang_after="5s")."""
    from expr_tracker.health.config import KEYS

    unknown = [k for k in keys if k not in KEYS]
    assert not unknown, f"not [health] keys: {unknown}"
    return "[health]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())


class Watcher:
    """`expr watch RUN --json` on the login node from before the run exists, paging into
    the cluster's page log as "login"."""

    def __init__(self, cluster: Cluster, job: Job, health: str, interval: float = 0.5) -> None:
        cfg = cluster.work / f"{job.name}.login.toml"
        cfg.write_text(cluster.pager_toml("login") + health)
        self.proc = cluster.login.popen(
            [PYTHON, "-m", "expr_cli.main", "watch", str(job.run_dir), "--json", "--config",
             str(cfg), "--interval", str(interval)], text=True)

    def stop(self) -> str:
        """Stop it (it never exits by itself here); returns what it printed."""
        if self.proc.poll() is None:
            self.proc.terminate()
        out, err = self.proc.communicate(timeout=20)
        return out + err
