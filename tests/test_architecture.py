"""The import-linter contracts in pyproject.toml hold, and they catch what they should.

They are the architecture of DESIGN 2 written down: the CLI and the daemon above the SDK,
the SDK above alerting, backends and statistics, those above storage, no cycles.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd, env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


def test_the_contracts_hold() -> None:
    done = _lint(ROOT, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the three packages (exprd under its import name) and the contracts."""
    for src, dst in (("expr_tracker", "expr_tracker"), ("expr_cli", "expr_cli"), ("daemon", "exprd")):
        shutil.copytree(ROOT / src, tmp_path / dst, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(path: Path, line: str) -> None:
    """Add an import inside a function: lazy imports count as much as module-level ones."""
    path.write_text(path.read_text() + f"\n\ndef _planted() -> None:\n    {line}\n")


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # a sink reaching back up to Run
        ("expr_tracker/direct.py", "from expr_tracker.run import Run", "SDK layers"),
        # storage importing the SDK
        ("expr_tracker/store/shard.py", "import expr_tracker.pipeline", "SDK layers"),
        # one backend importing another
        ("expr_tracker/backends/wandb.py", "import expr_tracker.backends.http", "Backends"),
        # the daemon and the CLI must not know each other
        ("exprd/main.py", "import expr_cli.render", "never import each other"),
        # the forwarder reaching back to the applier
        ("exprd/forwarder.py", "import exprd.applier", "exprd"),
        # the shared argument parsing reaching up to a command
        ("expr_cli/resolve.py", "import expr_cli.commands.history", "CLI layers"),
        # a renderer reaching up to a command
        ("expr_cli/render/summary.py", "import expr_cli.commands.summary", "CLI layers"),
        # a cycle between two commands (rules imports history)
        ("expr_cli/commands/history.py", "import expr_cli.commands.rules", "No import cycles"),
    ],
)
def test_an_upward_import_or_a_cycle_breaks_a_contract(tree: Path, module: str, line: str,
                                                       contract: str) -> None:
    _plant(tree / module, line)
    done = _lint(tree, tree)
    assert done.returncode != 0, done.stdout
    # the report after the summary names each broken contract with the import that broke it
    assert "Broken contracts" in done.stdout, done.stdout
    report = done.stdout.split("Broken contracts", 1)[1]
    assert contract in report, done.stdout
    planted = line.split()[1].rsplit(".", 1)[-1]
    assert planted in report, done.stdout  # the import that broke it is named
