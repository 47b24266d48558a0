"""mkdocs hook: the CLI reference page, generated at build time from each command's --help.

Every command registered in `expr_cli.main` (walked as tests/test_cli_help.py walks them)
is rendered with typer's own help at 100 columns, so the reference can never disagree with
`expr COMMAND --help`. The page is `cli-reference.md`; it exists only in the built site.
"""

from __future__ import annotations

from typing import Any

PAGE = "cli-reference.md"
WIDTH = "100"

INTRO = """# CLI reference

Every `expr` command's own `--help`, generated from the installed commands when the site
is built (`make docs`), so it always matches `expr COMMAND --help`. The guide to what the
commands are for, with examples side by side, is [The expr command](cli.md).

"""


def _commands() -> list[tuple[list[str], Any]]:
    import typer.main

    from expr_cli.main import build_app

    found: list[tuple[list[str], Any]] = []

    def walk(path: list[str], cmd: Any) -> None:
        found.append((path, cmd))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk([*path, name], sub)

    walk([], typer.main.get_command(build_app()))
    return found


def help_text(path: list[str]) -> str:
    """`expr PATH --help` as a terminal of 100 columns shows it, without colour."""
    from typer.testing import CliRunner

    from expr_cli.main import build_app

    env = {"COLUMNS": WIDTH, "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(build_app(), [*path, "--help"], env=env, prog_name="expr")
    if result.exit_code != 0:
        raise RuntimeError(f"expr {' '.join(path)} --help exited {result.exit_code}: {result.output}")
    return "\n".join(line.rstrip() for line in result.output.splitlines()).strip("\n")


def reference() -> str:
    """The whole page: the top-level help, then one section per command, in tree order."""
    parts = [INTRO]
    for path, _ in _commands():
        title = " ".join(["expr", *path])
        parts.append(f"## `{title}`\n\n```text\n{help_text(path)}\n```\n")
    return "\n".join(parts)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=reference()))
    return files
