"""`expr import KIND SOURCE`: another tracker's runs as runs of this one (DESIGN 22).

Registered as `import` (a Python keyword, so the module is `imports`)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from expr_cli.errors import CLIError
from expr_cli.resolve import root_dir

if TYPE_CHECKING:
    import typer


class Kind(str, Enum):
    """The sources `expr import` reads."""

    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"
    neptune = "neptune"


def import_command(kind: Kind, source: str, project: str, name: str, dir: str | None,
                   force: bool, as_json: bool, follow_symlinks: bool = False) -> None:
    """Import every run of SOURCE, with a progress bar when there are several."""
    from expr_cli import render
    from expr_cli.render import imports as render_imports
    from expr_tracker.imports import ImportFailed, MissingExtra, find, source_label, write_runs
    from expr_tracker.store.layout import run_dir

    root = root_dir(dir)
    where = source_label(source)
    run_dir(root, project, name)  # a bad name fails before the source is read
    if follow_symlinks and kind is not Kind.tensorboard:
        raise CLIError("--follow-symlinks applies to a TensorBoard log dir only")
    try:
        found = find(kind.value, source, follow_symlinks)
        with render_imports.progress(f"importing {kind.value}",
                                     disable=as_json or len(found) < 2) as bar:
            placed = write_runs(root, project, name, kind.value, where, found, force=force,
                                progress=bar)
    except (ImportFailed, MissingExtra) as exc:
        raise CLIError(str(exc)) from None
    runs = [{"run": f"{project}/{p.name}", "origin": p.origin, "rows": p.rows,
             "skipped": p.skipped} for p in placed]
    if as_json:
        render.print_json({"kind": kind.value, "source": where, "root": str(root), "runs": runs})
    else:
        render_imports.imported(runs)


def register(app: typer.Typer) -> None:
    """Add `expr import`."""
    import typer

    from expr_cli.resolve import DIR_OPT, JSON_OPT

    kind_arg = typer.Argument(..., show_default=False, metavar="KIND",
                              help="tensorboard, wandb, mlflow or neptune.")
    source_arg = typer.Argument(..., show_default=False, metavar="SOURCE",
                                help="A TensorBoard log dir, a wandb run directory, an mlruns "
                                     "directory or tracking URI, or neptune-exporter's Parquet.")
    project_opt = typer.Option(..., "--project", "-p", show_default=False,
                               help="The project the runs go to.")
    name_opt = typer.Option(..., "--name", "-n", show_default=False,
                            help="The run's name; each sub-run of SOURCE is NAME-SUB.")
    force_opt = typer.Option(False, "--force",
                             help="Replace runs an earlier import wrote (never other runs).")
    follow_opt = typer.Option(False, "--follow-symlinks",
                              help="Read through symlinks that lead out of a TensorBoard log "
                                   "dir (refused without it).")

    @app.command(
        "import",
        epilog="Example: expr import tensorboard ./runs --project vision --name resnet",
    )
    def import_(
        kind: Kind = kind_arg,
        source: str = source_arg,
        project: str = project_opt,
        name: str = name_opt,
        dir: str | None = DIR_OPT,
        force: bool = force_opt,
        as_json: bool = JSON_OPT,
        follow_symlinks: bool = follow_opt,
    ) -> None:
        """Import runs from TensorBoard, wandb, MLflow or Neptune: rows keep their steps and
        times, params and config go to the run's config.

        A source with several runs (sub-directories of event files, an mlruns store, a
        Parquet export) becomes one run each, NAME-SUB, with a progress bar. Each run is
        written aside and renamed into place: a damaged source leaves nothing behind. A run
        that exists is refused; --force replaces one an import wrote.
        """
        import_command(kind, source, project, name, dir, force, as_json, follow_symlinks)
