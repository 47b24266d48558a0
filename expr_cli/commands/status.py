"""`expr status`: exprd's `{state}/status.json` as a table (files, lag, backends, errors).

The file is read here, not through exprd: `expr` never imports the daemon (DESIGN 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from expr_cli.errors import CLIError
from expr_cli.resolve import JSON_OPT
from expr_cli.spooled import SPOOL_OPT
from expr_tracker.procs import pid_alive

STATUS_FILE = "status.json"  # written atomically by exprd (DESIGN 8)


def default_state(spool: str | None = None) -> Path:
    """`$EXPRD_STATE`, else the state directory named by the heartbeat of the exprd consuming
    the spool root (`--spool`, else `$EXPR_SPOOL`, else the default), else /var/lib/exprd if
    it has a status, else ~/.local/state/exprd."""
    from expr_cli import spooled

    env = os.environ.get("EXPRD_STATE")
    if env:
        return Path(env)
    beat = spooled.heartbeat(spooled.spool_root(spool))
    if beat is not None and isinstance(beat.get("state"), str):
        return Path(beat["state"])
    system = Path("/var/lib/exprd")
    if (system / "status.json").exists():
        return system
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "exprd"


def _alive(pid: Any) -> bool:
    if type(pid) is not int or pid <= 0:
        return False  # unknown pid
    return pid_alive(pid)


def read(state: Path) -> dict[str, Any]:
    """The last status exprd wrote under `state` (OSError or ValueError if there is none)."""
    import orjson

    data = orjson.loads((state / STATUS_FILE).read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{state / STATUS_FILE} is not a status document")
    return data


def status_command(state: str | None, json: bool, spool: str | None = None) -> None:
    from expr_cli import render, spooled
    from expr_cli.render import exprd as render_exprd

    where = Path(state) if state else default_state(spool)
    try:
        doc = read(where)
    except FileNotFoundError:
        # no exprd ever ran here: say so, and what waits in the spool for one
        spool_root = spooled.spool_root(spool)
        waiting = spooled.pending(spool_root)
        if json:
            render.print_json({"running": False, "state": str(where), "spooled": waiting})
            return
        if waiting:
            render.note(spooled.mention(waiting, spool_root))
        raise CLIError(f"no exprd status in {where} (is exprd running with --state {where}?)") from None
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {where / STATUS_FILE}: {exc}") from None
    running = _alive(doc.get("pid")) and doc.get("mode") != "replay"
    spool_root = spooled.spool_root(spool or doc.get("spool"))
    # what exprd has committed is newer than the sidecars it rewrites every few seconds
    committed = {os.path.abspath(path): f["committed_seq"] for path, f in doc.get("files", {}).items()
                 if type(f.get("committed_seq")) is int}
    refused = refused_files(doc)
    # a file exprd refused is not waiting for it: it is listed as refused, with the reason
    waiting = spooled.pending(spool_root, committed=committed, skip=set(refused))
    if json:
        render.print_json({**doc, "running": running, "spooled": waiting,
                           "refused": [{"path": p, "reason": r} for p, r in sorted(refused.items())]})
        return
    render_exprd.status(doc, running)
    render_exprd.refused(refused, doc.get("files", {}))
    if waiting:
        render.note(spooled.mention(waiting, spool_root))
    render_exprd.services(doc)


def refused_files(doc: dict[str, Any]) -> dict[str, str]:
    """Spool files exprd refused (absolute path -> why): a symlink or another user's file,
    which exprd never tails (`refused_paths`), and files it tails no more (a run outside
    `allowed_roots`: state `refused`)."""
    out: dict[str, str] = {}
    paths = doc.get("refused_paths")
    if isinstance(paths, dict):
        out.update({os.path.abspath(str(p)): str(r) for p, r in paths.items()})
    files = doc.get("files")
    if isinstance(files, dict):
        for path, f in files.items():
            if isinstance(f, dict) and f.get("state") == "refused":
                out[os.path.abspath(str(path))] = str(f.get("reason") or "refused")
    return out


def register(app: typer.Typer) -> None:
    """Add `expr status`."""

    @app.command("status", epilog="Example: expr status --state /var/lib/exprd")
    def status(
        state: str | None = typer.Option(None, "--state", metavar="DIR", show_default=False,
                                         help="exprd's state directory (default $EXPRD_STATE, "
                                              "/var/lib/exprd or ~/.local/state/exprd)."),
        json: bool = JSON_OPT,
        spool: str | None = SPOOL_OPT,
    ) -> None:
        """The exprd daemon's files, lag, backend queues and errors; spooled runs not applied."""
        status_command(state, json, spool)
