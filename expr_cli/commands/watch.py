"""`expr watch RUN`: run the health detectors in the foreground and deliver incidents (DESIGN 13).

Each pass reads the sidecars and shard tails, detects, records what opened or resolved in
`{run}/incidents.jsonl` and delivers it once through the alert channels of `--config` (or
`$EXPR_ALERT_CONFIG`); with neither, or one without channels, it only prints, and leaves
the delivery to a watcher that has channels. Thresholds come from that file's `[health]`
table; flags override them.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import typer

from expr_cli.errors import CLIError
from expr_cli.resolve import DIR_OPT, JSON_OPT, RUN_ARG, STREAM_OPT, resolve_run, root_dir

FLUSH_TIMEOUT = 10.0  # seconds `--once` waits for the channels to deliver before exiting (at most)


def health_config(config: str | None, overrides: dict[str, Any]) -> Any:
    """The `[health]` table of `config` (or `$EXPR_ALERT_CONFIG`) with the flags over it."""
    from expr_tracker.alerts import CONFIG_ENV
    from expr_tracker.health.config import load_health, parse_health

    path = config or os.environ.get(CONFIG_ENV) or None
    try:
        cfg = load_health(path)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for key, value in overrides.items():
        if value is None:
            continue
        try:
            cfg = parse_health({key: value}, cfg)
        except ValueError as exc:
            flag = "--" + key.replace("_", "-")
            # (the key is quoted by the table's checks, bare by the one duration parser)
            text = str(exc).replace(f"health: key {key!r}", f"option {flag}")
            raise CLIError(text.replace(f"health: key {key}", f"option {flag}"), 2) from None
    return cfg


def dispatcher(config: str | None) -> Any:
    """The alert channels of `config` (or `$EXPR_ALERT_CONFIG`); None without either, or
    when it configures none (thresholds only).

    Then the terminal is the only reader: incidents are printed and recorded undelivered,
    so a watcher that has channels (exprd) still delivers them. (The default channel of
    such a file, a line on stderr, repeated each incident this command prints, and
    marked it delivered: exprd's Slack then never paged it.)
    """
    from expr_tracker.alerts import CONFIG_ENV, Dispatcher, load_config

    if not (config or os.environ.get(CONFIG_ENV)):
        return None
    try:
        cfg = load_config(None, path=config)
        return None if cfg.default_channels else Dispatcher.from_config(cfg)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def watch_command(run: str, dir: str | None, stream: str | None, once: bool, as_json: bool,
                  config: str | None, interval: float, overrides: dict[str, Any],
                  exit_on_finish: bool = False) -> int:
    """Watch RUN; the exit code (with --once, or --exit-on-finish once the run ended: 1 if
    an incident is open, else 0)."""
    from expr_cli import render
    from expr_cli.render import health as render_health
    from expr_tracker.health.watch import Watcher

    from .tail import wait_until_there

    if config is not None and not os.path.isfile(config):
        raise CLIError(f"--config {config}: no such file", 2)
    cfg = health_config(config, overrides)
    try:
        ref = (resolve_run(run, root_dir(dir)) if once
               else wait_until_there(lambda: resolve_run(run, root_dir(dir)), run, interval))
    except KeyboardInterrupt:
        return 130
    disp = dispatcher(config)
    if once:  # one pass cannot see an incident hold: what it finds is paged now
        cfg = replace(cfg, page_after=0.0)
    watcher = Watcher(ref.path, cfg, disp, stream=stream, owner=not once)
    named: set[str] = set()

    def name_write_error() -> None:
        # once per cause: the incidents are shown (and delivered) all the same
        if watcher.write_error is not None and watcher.write_error not in named:
            named.add(watcher.write_error)
            render.error(watcher.write_error)

    try:
        changes = watcher.check()
        name_write_error()
        watcher.others()  # (the open ones among them are shown below)
        if not once and not as_json:
            render_health.watching(ref.label, watcher.state, disp is not None, watcher.cache_note)
        shown = {id(c) for c in changes}
        # the first pass also shows what was already open (recorded by an earlier watcher)
        first = changes + [i for i in watcher.open if id(i) not in shown and i.key not in
                           {c.key for c in changes}]
        render_health.incident_lines(first, ref.label, as_json)
        if once:
            if not first and not as_json:
                render_health.no_incidents(ref.label)
            if watcher.ended and not as_json:  # a run that is over keeps its story
                from expr_tracker.health.story import story

                render_health.story_print(story(ref.path))
            flush(disp)
            return 1 if watcher.open or watcher.write_error else 0
        said = {_said(i) for i in first}
        note = watcher.cache_note
        while not (exit_on_finish and watcher.ended):
            time.sleep(interval)
            mine = watcher.check()
            name_write_error()
            if watcher.cache_note != note:  # the filesystem's cache, learned (on stderr)
                note = watcher.cache_note
                render.status(note or "the run directory's filesystem shows other hosts' "
                              "writes at once again")
            # every line of incidents.jsonl, whoever recorded it (exprd beside us); as text,
            # not a line again that only says it was delivered
            lines = [i for i in sorted([*mine, *watcher.others()], key=lambda i: i.last_seen)
                     if as_json or _said(i) not in said]
            said.update(_said(i) for i in lines)
            render_health.incident_lines(lines, ref.label, as_json)
        flush(disp)
        return 1 if watcher.open or watcher.write_error else 0
    except KeyboardInterrupt:
        return 130  # like coreutils tools, quietly
    finally:
        if disp is not None:
            disp.close(2.0)
            # what the channels said, a page still on its way counted undelivered by
            # `close`: `delivered` true, or the claim dropped for the next watcher
            watcher.settle()


def _said(inc: Any) -> tuple[Any, ...]:
    return inc.id, inc.state, inc.ranks, inc.detail


def flush(disp: Any) -> None:
    """Wait (a bounded time) for the channels to deliver what this run of the command queued."""
    if disp is not None:  # the policy's exit_timeout when shorter (a channel that hangs)
        disp.flush(min(FLUSH_TIMEOUT, max(0.5, disp.exit_timeout)))


_ONCE = typer.Option(False, "--once", help="One pass, then exit: 1 if an incident is open, else 0.")
_CONFIG = typer.Option(None, "--config", "-c", metavar="FILE", show_default=False,
                       help="Alert config (channels, policy, \\[health]); default $EXPR_ALERT_CONFIG.")
_INTERVAL = typer.Option(1.0, "--interval", min=0.1, metavar="SECONDS",
                         help="Seconds between passes.")
_EXIT_ON_FINISH = typer.Option(False, "--exit-on-finish",
                               help="Exit once every rank finished or crashed: 1 if an incident is open.")


def _opt(flag: str, help: str, metavar: str) -> Any:
    return typer.Option(None, flag, help=help, metavar=metavar, show_default=False)


def register(app: typer.Typer) -> None:
    """Add `expr watch`."""

    @app.command("watch", epilog="Example: expr watch sft-1 --once --json --hang-after 2m")
    def watch(
        run: str = RUN_ARG,
        once: bool = _ONCE,
        exit_on_finish: bool = _EXIT_ON_FINISH,
        json: bool = JSON_OPT,
        config: str | None = _CONFIG,
        interval: float = _INTERVAL,
        stream: str | None = STREAM_OPT,
        dir: str | None = DIR_OPT,
        hang_after: str | None = _opt("--hang-after", "Silence that is a hang or a stall (e.g. 90s, 5m).",
                                      "DURATION"),
        crash_window: str | None = _opt("--crash-window", "Crashes this soon after the first are one (60s).",
                                        "DURATION"),
        evidence_after: str | None = _opt(
            "--evidence-after", "A stall whose probes name a culprit or a lost node "
            "(default max(60s, 10 step periods)).", "DURATION"),
        page_after: str | None = _opt("--page-after", "Page an incident once it held this long "
                                      "(10s; 0: at once).", "DURATION"),
        fs_cache: str | None = _opt("--fs-cache", "The run root's attribute cache (bindfs "
                                    "attr_timeout; NFS: read from the mount).", "DURATION"),
        missing_after: str | None = _opt("--missing-after", "When an absent rank is missing.", "DURATION"),
        straggler_ratio: float | None = _opt("--straggler-ratio", "Step time over the median (1.3).", "X"),
        straggler_steps: int | None = _opt("--straggler-steps", "Steps in a row (20).", "N"),
        slowdown_ratio: float | None = _opt("--slowdown-ratio", "Over the best window (1.3).", "X"),
        slowdown_steps: int | None = _opt("--slowdown-steps", "The window (20).", "N"),
        behind_steps: int | None = _opt("--behind-steps", "Steps short of the lead (100).", "N"),
        notify_recovery: bool | None = typer.Option(
            None, "--notify-recovery", show_default=False,
            help="Deliver resolved incidents too (default: the config's notify_recovery)."),
        # (its own hidden option, not `--notify-recovery/--no-notify-recovery`: the negative
        # form took a column of every option's help at 80 columns)
        no_notify_recovery: bool = typer.Option(False, "--no-notify-recovery", hidden=True),
    ) -> None:
        """Watch RUN's ranks live: straggler, slowdown, hang, stall, behind, crashed, missing, alert.

        Each incident is recorded once in the run's incidents.jsonl and delivered once
        through the alert channels; a crash cascade is one incident naming the rank that
        failed first. A run that does not exist yet is waited for. --json prints incident
        lines. Ctrl-C stops (exit 130).
        """
        overrides = {
            "hang_after": hang_after, "missing_after": missing_after, "crash_window": crash_window,
            "straggler_ratio": straggler_ratio, "straggler_steps": straggler_steps,
            "slowdown_ratio": slowdown_ratio, "slowdown_steps": slowdown_steps,
            "behind_steps": behind_steps,
            "notify_recovery": False if no_notify_recovery else notify_recovery,
            "evidence_after": evidence_after,
            "fs_cache": fs_cache, "page_after": page_after,  # ("0": no cache, at once)
        }
        code = watch_command(run, dir, stream, once, json, config, interval, overrides, exit_on_finish)
        if code:
            raise typer.Exit(code)
