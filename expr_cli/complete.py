"""Shell completion without typer: the answer to one TAB in a bare interpreter start.

At each TAB the shell runs `expr` with `_EXPR_COMPLETE` set. Building the typer app for
that costs most of a second; this module answers from `completion_table.TABLE` (the
commands, options and arguments, generated from the app by `make completions`, checked
against it by a test) and computes only run names. It follows click's rules (which
typer's completion uses): after `--opt` that takes a value, that value; an incomplete
word starting with `-`, the options not given yet; else the next argument; at a group,
its commands. Each shell's output format is typer's (`typer/_completion_classes.py`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from .completion_table import TABLE

Item = tuple[str, str]  # value, help


def _split(line: str) -> list[str]:
    """click's split_arg_string: shell words, an unterminated quote kept as it is."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""
    out: list[str] = []
    try:
        for token in lex:
            out.append(token)
    except ValueError:
        out.append(lex.token)
    return out


def _option(spec: dict[str, Any], word: str) -> dict[str, Any] | None:
    for opt in spec["options"]:
        if word in opt["opts"] or word in opt["secondary"]:
            return opt
    return None


def items(args: Sequence[str], incomplete: str) -> list[Item]:
    """What completes `incomplete` after the words `args` (the program name excluded)."""
    path: list[str] = []
    spec = TABLE[""]
    given: set[str] = set()
    positional = 0
    pending: dict[str, Any] | None = None  # an option still waiting for its value
    for word in args:
        if pending is not None:
            pending = None
            continue
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            opt = _option(spec, name)
            if opt is not None:
                given.add(opt["opts"][0])
                if opt["takes_value"] and "=" not in word:
                    pending = opt
            continue
        sub = spec.get("commands", {})
        if positional == 0 and word in sub and " ".join([*path, word]) in TABLE:
            path.append(word)
            spec, given = TABLE[" ".join(path)], set()
            continue
        positional += 1
    if incomplete == "=":
        incomplete = ""
    elif "=" in incomplete and incomplete.startswith("-"):
        name, _, incomplete = incomplete.partition("=")
        opt = _option(spec, name)
        return _values(opt, incomplete) if opt is not None else []
    if incomplete.startswith("-"):
        return [(name, opt["help"]) for opt in spec["options"]
                if opt["multiple"] or opt["opts"][0] not in given
                for name in (*opt["opts"], *opt["secondary"]) if name.startswith(incomplete)]
    if pending is not None:
        return _values(pending, incomplete)
    out: list[Item] = []
    if spec.get("commands"):
        out = [(name, short) for name, short in spec["commands"].items()
               if name.startswith(incomplete)]
    arguments = spec["arguments"]
    if positional < len(arguments) or (arguments and arguments[-1]["nargs"] == -1):
        arg = arguments[min(positional, len(arguments) - 1)]
        out += _values(arg, incomplete)
    return out


def _values(param: dict[str, Any], incomplete: str) -> list[Item]:
    if param.get("complete") == "run":
        from .resolve import complete_run

        return [(name, "") for name in complete_run(incomplete)]
    return [(c, "") for c in param.get("choices") or () if c.startswith(incomplete)]


def _zsh_escape(s: str) -> str:
    return (s.replace('"', '""').replace("'", "''").replace("$", "\\$").replace("`", "\\`")
            .replace(":", r"\\:"))


def answer(instruction: str, env: dict[str, str] | os._Environ[str]) -> tuple[str, int] | None:
    """The text to print and the exit code for `_EXPR_COMPLETE=instruction`, or None when
    this is not a completion request this module answers (typer then does)."""
    if instruction == "complete_bash":
        words = _split(env.get("COMP_WORDS", ""))
        cword = int(env.get("COMP_CWORD", "0") or 0)
        args = words[1:cword]
        incomplete = words[cword] if cword < len(words) else ""
        return "\n".join(v for v, _ in items(args, incomplete)), 0
    if instruction not in ("complete_zsh", "complete_fish"):
        return None
    line = env.get("_TYPER_COMPLETE_ARGS", "")
    args = _split(line)[1:]
    incomplete = ""
    if args and not line.endswith(" "):
        incomplete, args = args[-1], args[:-1]
    found = items(args, incomplete)
    if instruction == "complete_zsh":
        if not found:
            return "_files", 0
        lines = [f'"{_zsh_escape(v)}":"{_zsh_escape(h)}"' if h else f'"{_zsh_escape(v)}"'
                 for v, h in found]
        return "_arguments '*: :((" + "\n".join(lines) + "))'", 0
    action = env.get("_TYPER_COMPLETE_FISH_ACTION", "")
    shown = [v + "\t" + re.sub(r"\s", " ", h) if h else v for v, h in found]
    if action == "get-args":
        return "\n".join(shown), 0
    if action == "is-args":
        return "", 0 if shown else 1
    return "", 0


def run(instruction: str) -> bool:
    """Answer the completion request and return True, or False to leave it to typer."""
    done = answer(instruction, os.environ)
    if done is None:
        return False
    text, code = done
    if not (instruction == "complete_fish" and os.environ.get("_TYPER_COMPLETE_FISH_ACTION") == "is-args"):
        sys.stdout.write(text + "\n")  # as click's echo() prints typer's answer
    sys.stdout.flush()
    if code:
        sys.exit(code)
    return True
