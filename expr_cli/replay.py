"""`expr replay SPOOL_DIR`: apply a spool directory once, without a daemon.

The same code as exprd (`exprd.main.Daemon.run_once`): shards, rules, alerts and
backends, exactly once into shards. A second replay of the same spool changes nothing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import typer

from .errors import CLIError
from .resolve import JSON_OPT


def default_state() -> Path:
    """Where replay keeps checkpoints and quarantine: `${XDG_STATE_HOME:-~/.local/state}/expr/replay`."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "expr" / "replay"


class _ToRender(logging.Handler):
    """exprd's log lines (quarantine, refusals) as the CLI's warning lines."""

    def emit(self, record: logging.LogRecord) -> None:
        from . import render

        render.warning(record.getMessage())


def replay_command(spool_dir: str, dry_run: bool, state: str | None, config: str | None,
                   json: bool) -> None:
    from exprd import config as config_mod
    from exprd.main import Daemon
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import render

    spool = Path(spool_dir).absolute()
    if not spool.is_dir():
        raise CLIError(f"no spool directory at {spool}")
    try:
        cfg = config_mod.load(config)
    except config_mod.ConfigError as exc:
        raise CLIError(str(exc)) from None
    cfg.spool = spool
    cfg.state = Path(state).absolute() if state else default_state()
    handler = _ToRender(logging.WARNING)
    logger = logging.getLogger("exprd")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        daemon = Daemon(cfg, replay=True, dry_run=dry_run)
        start = time.monotonic()
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total} files"),
            TextColumn("{task.fields[events]} events ({task.fields[rate]}/s)"),
            TimeElapsedColumn(), console=render.console(stderr=True), transient=True,
            disable=json,
        ) as bar:
            task = bar.add_task("dry run" if dry_run else "replay", total=None, events=0, rate=0)

            def progress(done: int, total: int, events: int) -> None:
                rate = int(events / max(time.monotonic() - start, 1e-6))
                bar.update(task, completed=done, total=total, events=events, rate=rate)

            doc = daemon.run_once(progress)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    summary = _summary(doc, dry_run)
    if json:
        render.print_json(summary)
        return
    verb = "would apply" if dry_run else "applied"
    render.console().print(
        f"{summary['files']} spool files: {verb} {summary['applied']} events, "
        f"{summary['skipped']} already in shards, {summary['quarantined']} quarantined, "
        f"{summary['crashed']} crashed, {summary['refused']} refused",
        soft_wrap=True, highlight=False,
    )


def _summary(doc: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    totals = doc.get("totals", {})
    return {
        "dry_run": dry_run,
        "files": totals.get("files", 0),
        "applied": totals.get("applied", 0),
        "skipped": totals.get("skipped", 0),
        "quarantined": totals.get("quarantined", 0),
        "finished": totals.get("finished", 0),
        "crashed": totals.get("crashed", 0),
        "refused": totals.get("refused", 0),
        "live": totals.get("live", 0),
    }


def register(app: typer.Typer) -> None:
    """Add `expr replay`."""

    @app.command("replay", epilog="Example: expr replay ~/.local/state/expr/spool --dry-run")
    def replay(
        spool_dir: str = typer.Argument(..., metavar="SPOOL_DIR",
                                        help="The spool root (what exprd --spool would tail)."),
        dry_run: bool = typer.Option(False, "--dry-run",
                                     help="Read and check everything; write nothing."),
        state: str | None = typer.Option(None, "--state", metavar="DIR", show_default=False,
                                         help="Checkpoints and quarantine "
                                              "(default ~/.local/state/expr/replay)."),
        config: str | None = typer.Option(None, "--config", metavar="FILE", show_default=False,
                                          help="An exprd config: alert channels, backends, "
                                               "allowed_roots."),
        json: bool = JSON_OPT,
    ) -> None:
        """Apply a spool directory once, as exprd would; safe to repeat."""
        replay_command(spool_dir, dry_run, state, config, json)
