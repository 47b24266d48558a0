"""The `expr` console script: the typer app, error handling and the coreutils fallthrough.

`expr` shares its name with coreutils' `expr`. So that it can sit on PATH without
breaking shell scripts, `entry()` hands any argument list that is not one of our
commands to the system's `expr`. That decision is made before typer is imported:
scripts call `expr $i + 1` in loops, and the fallthrough should cost a bare
interpreter start, not a CLI framework's import.
"""

from __future__ import annotations

import difflib
import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CLIError

if TYPE_CHECKING:
    import typer

PROG = "expr"
# Each module registers the command (or command group) of the same name.
COMMAND_MODULES = ("runs", "shards", "history", "tail", "summary", "alerts", "rules", "replay", "status")
OWN_OPTIONS = ("--help", "-h", "--version", "--install-completion", "--show-completion")
# coreutils keywords and operators: an argument list using them is always coreutils'
COREUTILS_WORDS = frozenset(("match", "substr", "index", "length", "+"))
COREUTILS_OPERATORS = frozenset(("|", "&", "<", "<=", "=", "==", "!=", ">=", ">", "+", "-", "*", "/", "%", ":"))
COMPLETE_VAR = "_EXPR_COMPLETE"
_FALLTHROUGH_GUARD = "EXPR_CLI_FELL_THROUGH"


def version_text() -> str:
    """`expr (expr-tracker) 0.1.0`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("expr-tracker")
    except PackageNotFoundError:
        from expr_tracker import __version__ as v
    return f"{PROG} (expr-tracker) {v}"


def is_ours(argv: list[str]) -> bool:
    """True when `argv` (without the program name) is for this CLI, not for coreutils `expr`.

    Ours: no arguments, one of our options or commands, or a near miss of a command
    name (`sumary`) that coreutils could not mean either: a near miss followed by a
    coreutils operator (`expr stats : 'st'`) is coreutils'.
    """
    if not argv:
        return True
    first = argv[0]
    if first in OWN_OPTIONS or first in COMMAND_MODULES:
        return True
    if first in COREUTILS_WORDS or not first.isidentifier():
        return False
    if len(argv) > 1 and argv[1] in COREUTILS_OPERATORS:
        return False
    return bool(difflib.get_close_matches(first, COMMAND_MODULES, n=1, cutoff=0.75))


def coreutils_expr() -> str | None:
    """The system's `expr` on PATH, skipping this console script (and any copy of it)."""
    me = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    here = Path(sys.prefix, "bin").resolve()
    dirs = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d]
    for d in dirs:
        try:
            if Path(d).resolve() == here:
                continue
        except OSError:
            continue
        found = shutil.which(PROG, path=d)
        if found is None or (me is not None and Path(found).resolve() == me):
            continue
        try:
            with open(found, "rb") as fh:
                if b"expr_cli" in fh.read(1024):
                    continue  # another install of this CLI
        except OSError:
            continue
        return found
    return None


def _fall_through(argv: list[str]) -> None:
    """Replace this process with coreutils `expr` (its output, its exit code)."""
    if os.environ.get(_FALLTHROUGH_GUARD):
        sys.stderr.write("expr: coreutils expr not found on PATH (it resolves to expr-tracker)\n")
        sys.exit(2)
    path = coreutils_expr()
    if path is None:
        sys.stderr.write("expr: not an expr-tracker command, and coreutils expr is not on PATH\n")
        sys.exit(2)
    os.environ[_FALLTHROUGH_GUARD] = "1"
    os.execv(path, [PROG, *argv])


def entry() -> None:
    """Console script: coreutils fallthrough, then the typer app."""
    argv = sys.argv[1:]
    if not os.environ.get(COMPLETE_VAR) and not is_ours(argv):
        _fall_through(argv)
    get_app()(prog_name=PROG)


# -- the app -------------------------------------------------------------------

_APP: typer.Typer | None = None


def _group_class() -> type[Any]:
    from typer.core import TyperGroup
    from typer.exceptions import Abort

    try:  # typer >= 0.24 vendors click
        from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    except ImportError:  # pragma: no cover - older typer on top of click
        from click.exceptions import (  # type: ignore[assignment]
            ClickException,
            NoArgsIsHelpError,
            UsageError,
        )

    from expr_tracker.errors import TrackerError

    class ExprGroup(TyperGroup):
        """The root group: every failure ends here as one line and an exit code."""

        def main(  # type: ignore[override]
            self,
            args: Any = None,
            prog_name: str | None = None,
            complete_var: str | None = None,
            standalone_mode: bool = True,
            **extra: Any,
        ) -> Any:
            code = 0
            try:
                rv = super().main(args, prog_name or PROG, complete_var or COMPLETE_VAR,
                                  standalone_mode=False, **extra)
                code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
            except NoArgsIsHelpError:
                code = 0  # the help was printed when the error was made
            except UsageError as exc:
                code = _report(_usage_line(exc), 2)
            except ClickException as exc:
                code = _report(exc.format_message(), exc.exit_code)
            except Abort:
                code = _report("aborted", 1)
            except CLIError as exc:
                code = _report(exc.message, exc.code)
            except (TrackerError, FileNotFoundError, ValueError, OSError) as exc:
                code = _report(_library_line(exc), 1)
            except Exception as exc:
                if os.environ.get("EXPR_DEBUG"):
                    raise
                # a bug: still one line, with what a bug report needs
                code = _report(f"internal error: {type(exc).__name__}: {exc} "
                               "(EXPR_DEBUG=1 shows the traceback)", 1)
            if standalone_mode:
                sys.exit(code)
            return code

    return ExprGroup


def _usage_line(exc: Any) -> str:
    ctx = getattr(exc, "ctx", None)
    msg = exc.format_message().rstrip(".")
    if ctx is not None:
        return f"{msg} (see '{ctx.command_path} --help')"
    return msg


def _library_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


def _report(message: str, code: int) -> int:
    from . import render

    render.error(message)
    return code


def _version(value: bool) -> None:
    import typer

    if value:
        sys.stdout.write(version_text() + "\n")
        raise typer.Exit(0)


def build_app() -> typer.Typer:
    """A fresh app with every command module that exists registered."""
    import typer

    app = typer.Typer(
        name=PROG,
        cls=_group_class(),
        help="Inspect expr-tracker runs: shards, history, live tails, cross-rank summaries, alerts.\n\n"
        "Any other arguments are handed to coreutils expr, so `expr 1 + 2` still prints 3.",
        epilog="Example: expr runs; expr summary sft-1 --heatmap train/loss",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """Inspect expr-tracker runs from the terminal."""

    for name in COMMAND_MODULES:
        modname = f"{__package__}.{name}"
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:
                continue  # that command group is not written yet
            raise
        module.register(app)
    return app


def get_app() -> typer.Typer:
    """The process-wide app, built on first use."""
    global _APP
    if _APP is None:
        _APP = build_app()
    return _APP


def __getattr__(name: str) -> Any:
    # `from expr_cli.main import app` builds the app lazily (PEP 562), keeping the
    # coreutils fallthrough free of the typer import
    if name == "app":
        return get_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    entry()
