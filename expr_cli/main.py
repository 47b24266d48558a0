"""The `expr` console script: the typer app, error handling and the coreutils fallthrough.

`expr` shares its name with coreutils' `expr`. So that it can sit on PATH without
breaking shell scripts, `entry()` hands any argument list that is not one of our
commands to the system's `expr`. That decision is made before typer is imported:
scripts call `expr $i + 1` in loops, and the fallthrough should cost a bare
interpreter start, not a CLI framework's import.

The read commands scripts call most (`history`, `summary`) skip typer too when their
arguments are plain (`resolve.parse_fast`): typer, and the pydantic models it coerces
parameters with, take longer to import than those commands take to run. Anything
else (help, a usage error, completion) goes to the typer app, which registers only
the command module it needs, and which checks that the fast paths parse what it does.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from .errors import CLIError

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    import typer

PROG = "expr"
# Each module registers the command (or command group) of the same name.
COMMAND_MODULES = ("runs", "shards", "history", "tail", "summary", "alerts", "rules", "replay", "status",
                   "plot", "export", "query", "watch", "top", "trace", "serve", "mcp", "import")
# a command whose name is a Python keyword lives in a module of another name
_MODULE_OF = {"import": "imports"}
# Commands whose modules declare FAST_ARGS, FAST_OPTIONS and fast_run: `entry` runs them
# without typer when `resolve.parse_fast` understands the arguments. Importing typer, and
# the pydantic models it coerces parameters with, costs more than the whole of `expr history`.
FAST_COMMANDS = ("history", "summary")
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
    import difflib

    return bool(difflib.get_close_matches(first, COMMAND_MODULES, n=1, cutoff=0.75))


def hoisted(argv: list[str]) -> list[str]:
    """`expr --dir DIR COMMAND ...` as `expr COMMAND --dir DIR ...`: the run root named
    before the command, as `git -C DIR` is (coreutils `expr` has no such option: it
    could only fail on it). Other arguments are as given."""
    first = argv[0] if argv else ""
    n = 2 if first == "--dir" else 1 if first.startswith("--dir=") else 0
    if n and len(argv) > n and argv[n] in COMMAND_MODULES:
        return [argv[n], *argv[:n], *argv[n + 1:]]
    return argv


def coreutils_expr() -> str | None:
    """The system's `expr` on PATH, skipping this console script (and any copy of it)."""
    import shutil
    from pathlib import Path

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
    """Console script: coreutils fallthrough, the fast path, then the typer app."""
    argv = sys.argv[1:]
    command = argv[0] if argv else None
    if not os.environ.get(COMPLETE_VAR):
        if command is not None and (command == "--dir" or command.startswith("--dir=")):
            sys.argv[1:] = argv = hoisted(argv)
            command = argv[0]
            if command not in COMMAND_MODULES:
                sys.exit(_report("--dir goes with a command: expr --dir DIR runs (or set "
                                 "$EXPR_DIR)", 2))
        if not is_ours(argv):
            _fall_through(argv)
        if argv == ["--version"]:
            sys.stdout.write(version_text() + "\n")
            sys.exit(0)
        if command in FAST_COMMANDS:
            _run_fast(_command_module(command), argv[1:])
    else:
        from .complete import run as complete_fast

        if complete_fast(os.environ[COMPLETE_VAR]):
            sys.exit(0)  # answered from the generated table, without typer
        command = None  # completion may need any command
    # `expr history ...` needs the history module only; `expr --help` needs all of them
    get_app(command if command in COMMAND_MODULES else None)(prog_name=PROG)


def _command_module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"{__package__}.commands.{_MODULE_OF.get(name, name)}")


def _run_fast(module: ModuleType, args: list[str]) -> None:
    """Run the command without typer and exit, or return if typer must parse `args`."""
    from .resolve import parse_fast

    values = parse_fast(args, module.FAST_ARGS, module.FAST_OPTIONS)
    if values is not None:
        sys.exit(run_guarded(lambda: module.fast_run(values)))


INTERRUPTED = 130  # Ctrl-C: every command exits quietly with 128 + SIGINT, as coreutils do


def run_guarded(call: Callable[[], object]) -> int:
    """Call a command outside typer: a failure is one line on stderr; the exit code."""
    try:
        call()
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`expr history RUN | head`); exit quietly, as click does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as exc:
        return failure_code(exc)
    return 0


def failure_code(exc: Exception) -> int:
    """Report a command's failure as one line on stderr; the exit code (re-raise a bug
    with `EXPR_DEBUG` set)."""
    from expr_tracker.errors import TrackerError

    if isinstance(exc, CLIError):
        return _report(exc.message, exc.code)
    if isinstance(exc, (TrackerError, FileNotFoundError, ValueError, OSError)):
        return _report(_library_line(exc), 1)
    if os.environ.get("EXPR_DEBUG"):
        raise exc
    # a bug: still one line, with what a bug report needs
    return _report(f"internal error: {type(exc).__name__}: {exc} (EXPR_DEBUG=1 shows the traceback)", 1)


# -- the app -------------------------------------------------------------------

_APP: typer.Typer | None = None


def reflow_help(command: Any) -> None:
    """A command's help (and its subcommands') as typer 0.28 should draw it: the lines of
    each paragraph joined, so rich wraps them at the terminal's width (typer keeps the
    docstring's line breaks after the first paragraph: ragged lines at 80 columns), and
    brackets shown as written (`[rank N]`, not rich markup)."""
    import inspect
    import re

    text = command.help
    if text:
        body, cut, rest = inspect.cleandoc(text).partition("\f")
        paragraphs = [p if p.startswith("\b") else " ".join(p.split("\n"))
                      for p in body.strip().split("\n\n")]
        # rich.markup.escape's rule, without importing rich for every command run
        body = re.sub(r"(\\*)(\[[a-z#/@][^[]*?])", lambda m: f"{m[1]}{m[1]}\\{m[2]}",
                      "\n\n".join(paragraphs))
        command.help = body + cut + rest
    for sub in getattr(command, "commands", {}).values():
        reflow_help(sub)


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

    class ExprGroup(TyperGroup):
        """The root group: every failure ends here as one line and an exit code."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for name, command in self.commands.items():
                if name in FAST_COMMANDS:
                    check_fast_path(name, command)
                reflow_help(command)

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
            except Abort:  # (click's word for Ctrl-C)
                code = INTERRUPTED
            except Exception as exc:
                code = failure_code(exc)
            if standalone_mode:
                sys.exit(code)
            return code

    return ExprGroup


def check_fast_path(name: str, command: Any) -> None:
    """RuntimeError unless the fast path of command `name` parses what its typer command does.

    Runs whenever the typer app is built (so in every CLI test), comparing the module's
    FAST_ARGS and FAST_OPTIONS with the click parameters typer made.
    """
    module = _command_module(name)
    fast = {o.dest: o for o in module.FAST_OPTIONS}
    problems = []
    args = tuple(p.name for p in command.params if p.param_type_name == "argument")
    if args != tuple(module.FAST_ARGS):
        problems.append(f"arguments {args} != {module.FAST_ARGS}")
    for p in command.params:
        if p.param_type_name != "option":
            continue
        o = fast.pop(p.name, None)
        if o is None:
            problems.append(f"option {p.name} missing")
            continue
        default = p.default() if callable(p.default) else p.default
        if (set(o.flags) != {*p.opts, *p.secondary_opts} or (o.convert is None) != p.is_flag
                or o.multiple != p.multiple or o.default != default or p.nargs != 1
                or p.envvar or p.callback is not None or not _same_type(o, p)):
            problems.append(f"option {p.name} differs")
    problems.extend(f"option {d} is not the command's" for d in fast)
    if problems:
        raise RuntimeError(f"the fast path of expr {name} is out of date: {'; '.join(problems)}")


def _same_type(option: Any, param: Any) -> bool:
    """Whether the fast option converts to the type of the typer parameter."""
    from typing import get_args, get_origin

    from .resolve import int_arg

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation is None:
        return True  # a typer without type descriptors: nothing to compare
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    want = {None: bool, int_arg: int, str: str}.get(option.convert, option.convert)
    return bool(annotation is want)


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


def build_app(only: str | None = None) -> typer.Typer:
    """A fresh app with every command module that exists registered (or just `only`)."""
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

    for name in COMMAND_MODULES if only is None else (only,):
        try:
            module = _command_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.commands.{_MODULE_OF.get(name, name)}":
                continue  # that command group is not written yet
            raise
        module.register(app)
    return app


def get_app(only: str | None = None) -> typer.Typer:
    """The process-wide app, built on first use; with `only`, that command alone."""
    global _APP
    if _APP is None:
        _APP = build_app(only)
    return _APP


def __getattr__(name: str) -> Any:
    # `from expr_cli.main import app` builds the app lazily (PEP 562), keeping the
    # coreutils fallthrough free of the typer import
    if name == "app":
        return get_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    entry()
