"""The `expr` entry point: version, help, one error path, the coreutils fallthrough, docs."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expr_cli.completions import SHELLS, script
from expr_cli.main import build_app, hoisted, is_ours
from tests.procs import env_for

ROOT = Path(__file__).resolve().parent.parent
EXPR = Path(sys.executable).parent / "expr"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    assert EXPR.exists(), f"console script missing: {EXPR}"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EXPR_", "_EXPR"))}
    full.update(env)
    return subprocess.run([str(EXPR), *args], capture_output=True, text=True, env=full, timeout=30)


def test_version(cli):
    """The installed distribution's version (importlib.metadata), which pyproject.toml sets
    and expr_tracker.__version__ (the fallback of a source tree without metadata) repeats."""
    from importlib.metadata import version

    import expr_tracker

    result = cli("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"expr (expr-tracker) {version('expr-tracker')}\n"
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and declared.group(1) == version("expr-tracker") == expr_tracker.__version__


def test_no_arguments_prints_help(cli):
    result = cli()
    assert result.exit_code == 0, result.output
    assert "Usage: expr" in result.stdout
    assert all(name in result.stdout for name in ("runs", "shards", "history", "tail", "summary"))


def test_near_miss_is_a_usage_error_with_a_suggestion(cli):
    result = cli("sumary", "run-1")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: No such command 'sumary'. Did you mean 'summary'? (see 'expr --help')\n"
    )


def test_unknown_option_is_one_usage_line(cli):
    result = cli("runs", "--bogus")
    assert result.exit_code == 2
    assert result.stderr == "error: No such option: --bogus (see 'expr runs --help')\n"


@pytest.mark.parametrize(
    ("argv", "ours"),
    [
        ([], True),
        (["--version"], True),
        (["-h"], True),
        (["summary", "x"], True),
        (["rules", "explain", "x"], True),
        (["sumary"], True),  # near miss: a usage error with a suggestion
        (["histroy", "run-1"], True),
        (["1", "+", "2"], False),
        (["length", "abc"], False),
        (["substr", "hello", "2", "3"], False),
        (["stats", ":", "st"], False),  # close to `status`, but coreutils syntax
        (["hello"], False),
        (["-5", "+", "3"], False),
        (["a-b"], False),
    ],
)
def test_which_arguments_are_ours(argv, ours):
    assert is_ours(argv) is ours


def test_coreutils_fallthrough():
    assert shutil.which("expr", path="/usr/bin:/bin"), "coreutils expr is needed for this test"
    add = _run("1", "+", "2")
    assert (add.returncode, add.stdout) == (0, "3\n")
    length = _run("length", "abc")
    assert (length.returncode, length.stdout) == (0, "3\n")
    zero = _run("0", "+", "0")  # coreutils exits 1 when the result is zero or null
    assert (zero.returncode, zero.stdout) == (1, "0\n")
    bad = _run("1", "+")
    assert bad.returncode == 2 and bad.stderr.startswith("expr: ")


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--dir", "d", "runs", "--json"], ["runs", "--dir", "d", "--json"]),
        (["--dir=d", "summary", "r"], ["summary", "--dir=d", "r"]),
        (["--dir", "d"], ["--dir", "d"]),  # no command: left as it is (an error)
        (["--dir", "d", "1", "+", "2"], ["--dir", "d", "1", "+", "2"]),
        (["runs", "--dir", "d"], ["runs", "--dir", "d"]),
    ],
)
def test_a_run_root_before_the_command(argv, want):
    assert hoisted(argv) == want


def test_the_real_script_takes_dir_before_the_command(cli_root):
    """`expr --dir DIR runs` is `expr runs --dir DIR` (coreutils expr could only fail on
    it, as it did before: "syntax error: unexpected argument"), and `--dir` without a
    command is one usage line."""
    after = _run("runs", "--json", "--dir", str(cli_root))
    before = _run("--dir", str(cli_root), "runs", "--json")
    assert before.returncode == 0, before.stderr
    assert before.stdout == after.stdout and json.loads(before.stdout)
    joined = _run(f"--dir={cli_root}", "runs", "--json")
    assert (joined.returncode, joined.stdout) == (0, after.stdout)
    alone = _run("--dir", str(cli_root))
    assert alone.returncode == 2
    assert alone.stderr == "error: --dir goes with a command: expr --dir DIR runs (or set $EXPR_DIR)\n"
    other = _run("--dir", str(cli_root), "status")  # a command without --dir says so
    assert other.returncode == 2 and "No such option: --dir" in other.stderr


def test_errors_from_the_real_script_have_no_traceback(tmp_path):
    result = _run("history", "nope", "--dir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr == f"error: no run 'nope': no runs under {tmp_path} (set --dir or $EXPR_DIR)\n"
    typo = _run("sumary")
    assert typo.returncode == 2 and "Did you mean 'summary'?" in typo.stderr


def test_a_bad_expr_now_is_one_line_naming_it(cli, cli_root):
    """Not Python's "could not convert string to float": the installed script, then in process."""
    pattern = (r"error: EXPR_NOW must be a time in seconds since the epoch \(such as \d+\), "
               r"got {}; unset it to use the clock\n")
    result = _run("shards", "proj/run-2", "--dir", str(cli_root), EXPR_NOW="abc")
    assert result.returncode == 1 and result.stdout == "", result
    assert re.fullmatch(pattern.format("'abc'"), result.stderr), result.stderr
    for value in ("nan", "1e999"):
        result = cli("top", "proj/run-2", "--once", EXPR_NOW=value)
        assert result.exit_code == 1, result.output
        assert re.fullmatch(pattern.format(repr(value)), result.stderr), result.stderr


def test_no_color_is_honoured(tmp_path):
    coloured = _run("history", "nope", "--dir", str(tmp_path), FORCE_COLOR="1")
    assert "\x1b[31m" in coloured.stderr  # red
    plain = _run("history", "nope", "--dir", str(tmp_path), FORCE_COLOR="1", NO_COLOR="1")
    assert "\x1b[" not in plain.stderr and plain.stderr.startswith("error: no run 'nope'")


# -- docs ----------------------------------------------------------------------


def _commands():
    from typer.main import get_command

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield [*path, name], sub
            yield from walk(sub, [*path, name])

    return list(walk(get_command(build_app()), []))


CLI_GUIDE = ROOT / "docs" / "cli.md"  # "The expr command" of the docs site (was the README's)


def _guide_section() -> str:
    """The guide's part before its first subsection: the tour of commands and their bullets."""
    text = CLI_GUIDE.read_text()
    end = text.find("\n## ")
    return text if end < 0 else text[:end]


def test_every_command_has_help_with_an_example_and_a_guide_mention():
    """Each command is mentioned in prose in the docs site: the guide (docs/cli.md) or the
    page of its own topic (the generated CLI reference does not count)."""
    guide = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    commands = _commands()
    names = {" ".join(path) for path, _ in commands}
    assert {"runs", "shards", "history", "tail", "summary", "alerts", "rules explain",
            "rules test"} <= names
    for path, cmd in commands:
        label = "expr " + " ".join(path)
        assert (cmd.help or "").strip(), f"{label} has no help text"
        assert "Example" in (cmd.epilog or "") + (cmd.help or ""), f"{label} --help has no example"
        assert f"`{label}" in guide, f"no page of docs/ mentions {label}"


def test_help_prose_is_wrapped_at_80_columns_and_shows_brackets(cli):
    """Each paragraph of a command's help fills its lines at 80 columns (typer kept the
    docstring's line breaks: "every rank" then "rank" alone on a line), and `[rank N]`
    is shown, not taken for rich markup."""
    for path, _ in _commands():
        out = cli(*path, "--help", COLUMNS="80").stdout
        prose = out.split("\u256d", 1)[0].splitlines()[3:]  # after the usage, before a box
        paragraphs: list[list[str]] = [[]]
        for line in prose:
            if line.strip():
                paragraphs[-1].append(line.strip())
            else:
                paragraphs.append([])
        for para in paragraphs:
            for line, after in itertools.pairwise(para):
                # greedy wrapping: the next line's first word did not fit on this one
                assert len(line) + 1 + len(after.split()[0]) > 78 - 2, (path, line, after)
    assert "are marked [rank N]" in cli("tail", "--help", COLUMNS="80").stdout.replace("\n ", " ")


def test_registered_commands_are_known_to_the_fallthrough():
    top = {path[0] for path, _ in _commands()}
    assert all(is_ours([name]) for name in top)


def test_guide_examples_run(cli, cli_root):
    shutil.copytree(cli_root / "proj" / "run-1", cli_root / "my-project" / "sft-1")
    lines = [line for line in _guide_section().splitlines() if line.startswith("expr ")]
    assert len(lines) >= 8
    for line in lines:
        args = shlex.split(line, comments=True)[1:]
        if args[0] == "tail" and "--no-follow" not in args:
            args.append("--no-follow")
        result = cli(*args)
        assert result.exit_code == 0, f"{line}\n{result.output}"
        assert result.stdout.strip(), line


# -- completions -----------------------------------------------------------------


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_committed_completions_are_fresh(shell):
    committed = (ROOT / "completions" / SHELLS[shell]).read_text()
    assert committed == script(shell), "run `make completions` and commit the result"


def test_bash_completion_answers_commands_and_run_names(cli_root):
    words = _run(_EXPR_COMPLETE="complete_bash", COMP_WORDS="expr su", COMP_CWORD="1")
    assert words.returncode == 0 and words.stdout.split() == ["summary"]
    runs = _run(_EXPR_COMPLETE="complete_bash", COMP_WORDS="expr shards run-", COMP_CWORD="2",
                EXPR_DIR=str(cli_root))
    assert re.findall(r"\S+", runs.stdout) == ["run-1", "run-2", "run-3"]


def test_completion_table_is_fresh():
    from expr_cli.completions import TABLE_FILE, table_source

    assert TABLE_FILE.read_text() == table_source(), "run `make completions` and commit the result"


# (shell, the command line so far): what a TAB asks for; the fast path must answer as typer does
COMPLETION_CASES = [
    "expr ", "expr su", "expr summary ", "expr summary run-", "expr summary run-1 --",
    "expr summary run-1 --st", "expr summary --json -", "expr summary --json --json -",
    "expr export run-1 --format ", "expr export run-1 --format=c", "expr rules ",
    "expr rules test x ", "expr rules explain -", "expr history run-1 --rank 1 -",
    "expr tail -", "expr -", "expr watch run-1 --config ", "expr plot run-1 -m x -",
    "expr summary --dir DIR run-", "expr nosuch ",
]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_fast_completion_answers_as_typer_does(shell, cli_root, monkeypatch):
    from expr_cli.complete import answer

    monkeypatch.setenv("EXPR_DIR", str(cli_root))  # run names come from the default root
    envs = []
    for line in COMPLETION_CASES:
        line = line.replace("DIR", str(cli_root))
        env = {**env_for(), "EXPR_DIR": str(cli_root), "_EXPR_COMPLETE": f"complete_{shell}",
               "COLUMNS": "10000"}  # typer wraps help texts at the terminal's width
        if shell == "bash":
            words = line.split()
            env |= {"COMP_WORDS": line, "COMP_CWORD": str(len(words) - (not line.endswith(" ")))}
        else:
            env |= {"_TYPER_COMPLETE_ARGS": line, "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
        envs.append((line, env))
    # typer's answers, all in one process (the app is built once)
    code = ("import io, os, sys, contextlib, json\n"
            "from expr_cli.main import get_app\n"
            "out = []\n"
            "for env in json.loads(sys.stdin.read()):\n"
            "    os.environ.update(env)\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        try:\n"
            "            get_app()(prog_name='expr')\n"
            "        except SystemExit:\n"
            "            pass\n"
            "    out.append(buf.getvalue())\n"
            "sys.__stdout__.write(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps([e for _, e in envs]),
                          env=env_for(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout)
    for (line, env), want in zip(envs, expected, strict=True):
        got = answer(env["_EXPR_COMPLETE"], env)
        assert got is not None
        # the same completions (as printed: click's echo adds a newline); click orders -h and
        # --help as a set does, so the lines are compared sorted (zsh's wrapper taken off)
        assert _lines(got[0] + "\n") == _lines(want), (shell, line)


def _lines(text: str) -> list[str]:
    if text.startswith("_arguments '*: :(("):
        text = text[len("_arguments '*: :(("):].rstrip("\n").removesuffix("))'")
    return sorted(text.splitlines())


def test_the_installed_script_completes_without_importing_typer(cli_root):
    code = ("import atexit, sys\n"
            "atexit.register(lambda: sys.stderr.write(f'typer={\"typer\" in sys.modules}'))\n"
            "from expr_cli.main import entry\n"
            "sys.argv = ['expr']\n"
            "entry()\n")
    env = {**env_for(), "EXPR_DIR": str(cli_root), "_EXPR_COMPLETE": "complete_bash",
           "COMP_WORDS": "expr summary run-", "COMP_CWORD": "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["run-1", "run-2", "run-3"]
    assert done.stderr.endswith("typer=False"), done.stderr
