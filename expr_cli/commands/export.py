"""`expr export RUN`: every rank's rows of a run as one parquet, CSV or JSONL file."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from expr_cli.errors import CLIError
from expr_cli.resolve import parse_metrics, resolve_run, root_dir, shards_of

if TYPE_CHECKING:
    import typer


class ExportFormat(str, Enum):
    """File formats of `expr export`."""

    parquet = "parquet"
    csv = "csv"
    jsonl = "jsonl"


_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl",
             ".ndjson": "jsonl"}


def pick_format(fmt: ExportFormat | None, out: Path) -> str:
    """The --format, else the one the --out suffix names; CLIError (usage) otherwise."""
    if fmt is not None:
        return fmt.value
    guess = _SUFFIXES.get(out.suffix.lower())
    if guess is None:
        raise CLIError(f"cannot tell the format from {out.name!r}: pass --format parquet|csv|jsonl", 2)
    return guess


def check_out(out: Path, run_dir: Path, force: bool) -> None:
    """`expr` never writes into a run directory, nor over a file unless --force."""
    target = out.expanduser().resolve()
    if target.parent == run_dir.resolve() or run_dir.resolve() in target.parents:
        raise CLIError(f"--out {out} is inside the run directory; expr never writes to a run")
    if target.is_dir():
        raise CLIError(f"--out {out} is a directory; name a file")
    if target.exists() and not force:
        raise CLIError(f"{out} exists; pass --force to replace it")
    if not target.parent.is_dir():
        raise CLIError(f"directory {target.parent} does not exist")


def export_command(
    run: str,
    dir: str | None,
    fmt: ExportFormat | None,
    out: str,
    rank_records: bool,
    stream: str | None,
    metrics: list[str] | None,
    force: bool,
    as_json: bool,
) -> None:
    """Write the rows of every rank of RUN to `out`."""
    from expr_cli import render
    from expr_tracker.store.runread import ALL_STREAMS
    from expr_tracker.views.export import WRITERS, have_pyarrow, open_run

    out_path = Path(out)
    kind = pick_format(fmt, out_path)
    if kind == "parquet" and not have_pyarrow():  # not imported: DuckDB may write it all
        from expr_cli.extras import require

        require("pyarrow", "export")  # the error naming the extra
    ref = resolve_run(run, root_dir(dir))
    if stream is not None:
        shards_of(ref, stream)  # the error naming the streams the run has
    check_out(out_path, ref.path, force)
    reader = open_run(ref.path, stream=ALL_STREAMS if stream is None else stream,
                      rank_records=rank_records, metrics=parse_metrics(metrics))
    rows = WRITERS[kind](reader, out_path)
    if reader.garbage:
        n = reader.garbage
        render.warning(f"skipped {n} line{'s' if n != 1 else ''} of {ref.label} that did not parse")
    what = "rank records" if rank_records else "rows"
    ranks = len({s.rank for s in reader.shards})
    if as_json:
        render.print_json({"run": ref.label, "out": str(out_path), "format": kind, "rows": rows,
                           "kind": "rank" if rank_records else "step", "shards": len(reader.shards)})
    else:
        n = len(reader.shards)
        if rows == 1:
            what = what.removesuffix("s")
        render.note(f"wrote {rows:,} {what} of {ref.label} ({n:,} shard{'s' if n != 1 else ''}, "
                    f"{ranks:,} rank{'s' if ranks != 1 else ''}) to {out_path} ({kind})")


def register(app: typer.Typer) -> None:
    """Add `expr export`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT, METRICS_OPT, RUN_ARG

    format_opt = typer.Option(None, "--format", "-f", show_default=False,
                              help="parquet, csv or jsonl (default: from the --out suffix).")
    out_opt = typer.Option(..., "--out", "-o", show_default=False, metavar="FILE",
                           help="The file to write (never inside the run directory).")
    rank_opt = typer.Option(False, "--rank-records", help="Export rank records instead of step rows.")
    stream_opt = typer.Option(None, "--stream", "-s", show_default=False, metavar="STREAM",
                              help="Only this stream (default: every stream, in column _stream).")
    force_opt = typer.Option(False, "--force", help="Replace an existing --out file.")

    @app.command(
        "export",
        epilog="Example: expr export sft-1 --format parquet --out sft-1.parquet",
    )
    def export(
        run: str = RUN_ARG,
        fmt: ExportFormat | None = format_opt,
        out: str = out_opt,
        rank_records: bool = rank_opt,
        stream: str | None = stream_opt,
        metrics: list[str] | None = METRICS_OPT,
        force: bool = force_opt,
        json: bool = JSON_OPT,
        dir: str | None = DIR_OPT,
    ) -> None:
        """Write the rows of every rank of RUN to one parquet, CSV or JSONL file.

        Columns: _rank, _stream, _step, _time, then the metrics. Streamed in batches: memory
        stays bounded whatever the size of the run.
        """
        export_command(run, dir, fmt, out, rank_records, stream, metrics, force, json)
