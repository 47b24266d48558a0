"""Every command's --help shows every help text whole: nothing is eaten as rich markup."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from expr_cli.main import build_app


def _commands(app: typer.Typer) -> list[tuple[list[str], Any]]:
    found: list[tuple[list[str], Any]] = []

    def walk(path: list[str], cmd: Any) -> None:
        found.append((path, cmd))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk([*path, name], sub)

    walk([], typer.main.get_command(app))
    return found


def _plain(text: str) -> str:
    """Help text as a person reads it: no box drawing, no rich escapes, one space between words."""
    text = re.sub(r"[│╭╮╰╯─]", " ", text).replace("\\[", "[")
    return " ".join(text.split())


def lost_texts(app: typer.Typer, path: list[str], cmd: Any) -> list[str]:
    """The help texts of `cmd` (its options' and its first paragraph) missing from its --help."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    shown = _plain(result.output)
    texts = [p.help for p in cmd.params if getattr(p, "help", None)]
    if cmd.help:
        texts.append(cmd.help.split("\n\n")[0])
    assert texts, f"{path}: no help text at all"
    return [t for t in texts if _plain(t) not in shown]


COMMANDS = _commands(build_app())


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"summary", "watch", "top", "rules explain", "rules test"} <= names, names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) or "expr" for p, _ in COMMANDS])
def test_help_shows_every_text_whole(path: list[str], cmd: Any) -> None:
    assert lost_texts(build_app(), path, cmd) == []


def test_unescaped_brackets_are_caught() -> None:
    # what `expr watch --help` did: "[health]" read as a rich markup tag and dropped
    app = typer.Typer()

    @app.command()
    def watch(config: str = typer.Option("", help="Alert config (channels, policy, [health]).")) -> None:
        """Watch."""

    [(path, cmd)] = _commands(app)
    assert lost_texts(app, path, cmd) == ["Alert config (channels, policy, [health])."]
