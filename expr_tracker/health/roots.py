"""The root of a run's crashes (DESIGN 13 turn 5): which rank failed first. Pure.

Crashes are ordered by what can be compared (`crash_order`): a rank whose exit message
says a peer went away is collateral and comes after the others; then the ranks' own exit
times when they share a host (one clock), else when a watcher saw them. `first_crash` is
the one place every reader (summary, top, MCP, the page) asks, and it agrees with the
`crashed` incident's root, a lost node that the crash joined included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from expr_tracker.health.detect import crashes
from expr_tracker.health.state import RunState


class Incident(Protocol):
    """What `first_crash` reads of an incident (`incidents.Incident`, which imports this
    module: no cycle)."""

    id: str
    kind: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    detail: str
    cause: str | None
    collateral: tuple[int, ...]


# the messages of ranks that crash because a peer did: the collective's transport failed
# (the network words of `stall.PEER_ERRORS` too: a peer refused or unreachable is one gone)
_COLLATERAL = ("connection closed by peer", "connection reset by peer", "broken pipe",
               "communicator was aborted", "socket timeout", "sigterm", "signal 15",
               "process group", "processgroup", "watchdog caught collective",
               "connection refused", "no route to host", "network is unreachable",
               "remote process exit")


def blames_peer(info: Mapping[str, Any]) -> bool:
    """A crash whose type or message says a peer went away (it is collateral)."""
    text = f"{info.get('type') or ''} {info.get('message') or ''}".lower()
    return any(p in text for p in _COLLATERAL)


def crash_order(infos: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Crashes in the order they happened, by what can be compared: the ranks' own exit
    times when they share one host (one clock), else when we saw them; a rank whose message
    says a peer went away comes after the others (it is collateral)."""
    same_host = len({i.get("host") for i in infos}) == 1
    def key(i: Mapping[str, Any]) -> tuple[bool, float, float, int]:
        t = i.get("time") if same_host and i.get("time") is not None else i.get("at")
        return (blames_peer(i), float(t if t is not None else 0.0), float(i.get("at") or 0.0),
                int(i["rank"]))
    return sorted(infos, key=key)


def root_of(info: Mapping[str, Any]) -> dict[str, Any]:
    """A crash finding's info as a root: {rank, host, type, message, time}."""
    return {k: info.get(k) for k in ("rank", "host", "type", "message", "time")}


def first_crash(state: RunState, incidents: Iterable[Incident] = ()) -> dict[str, Any] | None:
    """The root of the run's crashes ({rank, host, type, message, time}), by the same order
    as a `crashed` incident's; None when no rank crashed. `incidents`, the run's (open)
    incidents: when the first crash only blames a peer and a `lost` node among them
    explains it (the crash joined it, `cause`, or the node names its ranks collateral),
    the root is the lost node's first rank, as the incident and its page say: the one
    place every reader (summary, top, MCP, the page) asks."""
    infos = [f.info for f in crashes(state) if f.info is not None]
    if not infos:
        return None
    root = root_of(crash_order(infos)[0])
    if not blames_peer(root):
        return root
    incs = list(incidents)
    nodes = {i.id: i for i in incs if i.kind == "lost" and i.ranks}
    rank = root["rank"]
    node = next((nodes[i.cause] for i in incs if i.kind == "crashed" and i.cause in nodes
                 and rank in i.ranks), None)
    if node is None:
        node = next((n for n in nodes.values() if rank in n.collateral), None)
    if node is None:
        return root
    return {"rank": node.ranks[0], "host": node.hosts[0] if node.hosts else None,
            "type": None, "message": node.detail.split("; ")[0], "time": None,
            "lost": list(node.ranks)}
