"""`expr replay SPOOL_DIR`: apply a spool directory once, without a daemon.

The work is exprd's own (`exprd --replay`, the same engine as the daemon): shards,
rules, alerts and backends, exactly once into shards; a rolled segment it applied is
deleted, as the daemon deletes it (`--dry-run` deletes nothing). It runs as a child
process, so `expr` never imports exprd (DESIGN 2); this module renders its `--progress
json` lines.
A second replay of the same spool changes nothing.
"""

from __future__ import annotations

import json as jsonlib
import os
import selectors
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from expr_cli.errors import CLIError
from expr_cli.resolve import JSON_OPT

# exprd's log format is "exprd LEVEL message"; these levels are the CLI's warning lines
_LOG_PREFIXES = ("exprd WARNING ", "exprd ERROR ", "exprd CRITICAL ")


def default_state() -> Path:
    """Where replay keeps checkpoints and quarantine: `${XDG_STATE_HOME:-~/.local/state}/expr/replay`."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "expr" / "replay"


def exprd_argv(spool: Path, state: Path, config: str | None, dry_run: bool) -> list[str]:
    """The child's command line: exprd's one-shot replay, reporting JSON lines."""
    # -P (3.11+): the current directory must not shadow the installed packages
    argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "exprd",
            "--replay", "--progress", "json", "--log-level", "WARNING",
            f"--spool={spool}", f"--state={state}"]
    if config is not None:
        argv.append(f"--config={config}")  # one argument, even if it starts with "-"
    if dry_run:
        argv.append("--dry-run")
    if os.geteuid() == 0:
        argv.append("--allow-root")  # replay never refused root; the daemon does by default
    return argv


def _lines(proc: subprocess.Popen[bytes]) -> Iterator[tuple[str, str]]:
    """("out" | "err", line) from the child's two pipes, as they come, until both close."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    pending = {"out": b"", "err": b""}
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    try:
        while sel.get_map():
            for key, _ in sel.select():
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    if pending[key.data]:  # a last line without its newline
                        yield key.data, pending[key.data].decode("utf-8", "replace")
                    continue
                *whole, pending[key.data] = (pending[key.data] + chunk).split(b"\n")
                for line in whole:
                    yield key.data, line.decode("utf-8", "replace")
    finally:
        sel.close()


def run_exprd(argv: list[str], on_progress: Callable[[dict[str, Any]], None],
              ) -> tuple[int, dict[str, Any] | None, str | None, list[str]]:
    """Run the child to the end: (exit code, summary, error message, traceback lines).

    Its warning and error log lines become warning lines and other stderr lines pass
    through, as they come; progress objects go to `on_progress`. A traceback (exprd
    crashed) is kept for the caller.
    """
    from expr_cli import render

    summary: dict[str, Any] | None = None
    error: str | None = None
    crash: list[str] = []
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        for stream, line in _lines(proc):
            if stream == "err":
                prefix = next((p for p in _LOG_PREFIXES if line.startswith(p)), None)
                if prefix is not None:
                    render.warning(line[len(prefix):])
                elif line.startswith("Traceback (most recent call last):") or crash:
                    crash.append(line)  # a crash: one error line at the end, not a traceback
                elif line.strip():
                    sys.stderr.write(line + "\n")  # a library's own line, as exprd printed it
                continue
            try:
                obj = jsonlib.loads(line)
            except ValueError:
                continue  # not one of exprd's lines: nothing else is meant to be on stdout
            kind = obj.pop("type", None) if isinstance(obj, dict) else None
            if kind == "progress":
                on_progress(obj)
            elif kind == "summary":
                summary = obj
            elif kind == "error":
                error = str(obj.get("message"))
        code = proc.wait()
    except BaseException:
        # Ctrl-C (exprd got it too) or a failure here: exprd drains and checkpoints on
        # SIGTERM; read what it still writes, so a full pipe cannot block it meanwhile
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except BaseException:
            proc.kill()
            proc.wait()
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return code, summary, error, crash


def replay_command(spool_dir: str | None, dry_run: bool, state: str | None, config: str | None,
                   json: bool) -> None:
    from expr_cli import render
    from expr_cli.spooled import spool_root

    spool = spool_root(spool_dir).absolute()  # (None: $EXPR_SPOOL, else the default spool)
    if not spool.is_dir():
        raise CLIError(f"no spool directory at {spool}")
    where = Path(state).absolute() if state else default_state()
    argv = exprd_argv(spool, where, config, dry_run)
    with render.replay_progress("dry run" if dry_run else "replay", disable=json) as progress:
        code, summary, error, crash = run_exprd(argv, progress)
    if code != 0 or summary is None:
        if os.environ.get("EXPR_DEBUG"):
            sys.stderr.writelines(line + "\n" for line in crash)
        raise CLIError(error or _failure(code, crash))
    sys.stderr.writelines(line + "\n" for line in crash)  # e.g. a backend thread died
    if json:
        render.print_json(summary)
        return
    verb = "would apply" if dry_run else "applied"
    render.console().print(
        f"{summary['files']} spool file{'s' if summary['files'] != 1 else ''}: {verb} "
        f"{summary['applied']} event{'s' if summary['applied'] != 1 else ''}, "
        f"{summary['skipped']} already in shards, {summary['quarantined']} quarantined, "
        f"{summary['crashed']} crashed, {summary['refused']} refused"
        + (f"; deleted {summary['deleted']} applied segment"
           f"{'s' if summary['deleted'] != 1 else ''}" if summary.get("deleted") else ""),
        soft_wrap=True, highlight=False,
    )


def _failure(code: int, crash: list[str]) -> str:
    """One line for an exprd that died without saying why (a bug, a signal)."""
    what = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    last = next((line.strip() for line in reversed(crash) if line.strip()), None)
    return f"exprd --replay failed ({what})" + (f": {last}" if last else "")


def register(app: typer.Typer) -> None:
    """Add `expr replay`."""

    @app.command("replay", epilog="Example: expr replay ~/.local/state/expr/spool --dry-run")
    def replay(
        spool_dir: str | None = typer.Argument(
            None, metavar="[SPOOL_DIR]", show_default=False,
            help="The spool root (what exprd --spool would tail); default --spool, else "
                 "$EXPR_SPOOL or ~/.local/state/expr/spool."),
        spool: str | None = typer.Option(None, "--spool", metavar="DIR", show_default=False,
                                         help="The spool root, named as exprd and expr status "
                                              "name it."),
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
        if spool_dir is not None and spool is not None and Path(spool_dir) != Path(spool):
            raise CLIError(f"two spool roots: {spool_dir} and --spool {spool}; give one", 2)
        replay_command(spool_dir or spool, dry_run, state, config, json)
