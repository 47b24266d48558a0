"""What `expr import` prints: its progress bar and the runs it wrote."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from . import _table, console, prose


@contextmanager
def progress(description: str, disable: bool) -> Iterator[Callable[[int, int, str], None]]:
    """A transient bar on stderr: runs done of the total, the run being read, the time.
    Yields the call the importer reports to: (done, total, run name)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total} runs"), TextColumn("{task.fields[run]}"),
        TimeElapsedColumn(), console=console(stderr=True), transient=True, disable=disable,
    ) as bar:
        task = bar.add_task(description, total=None, run="")

        def update(done: int, total: int, run: str) -> None:
            bar.update(task, completed=done, total=total, run=run)

        yield update


def imported(runs: Sequence[Mapping[str, Any]]) -> None:
    """One row per run written: its name, rows, where it came from, what did not come over."""
    table = _table(["run", "rows", "from", "not imported"], right=["rows"], keep=["run"])
    for r in runs:
        skipped = ", ".join(f"{n:,} {what}" for what, n in sorted(r["skipped"].items()))
        table.add_row(r["run"], f"{r['rows']:,}", r["origin"], skipped)
    out = console()
    out.print(table)
    from rich.text import Text

    n = len(runs)
    prose(out, Text(f"imported {n} run{'s' if n != 1 else ''}", style="dim"))
