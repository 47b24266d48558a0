"""`expr import`: another tracker's files as runs every reader knows (DESIGN 22).

One module per source (`tensorboard`, `wandb`, `mlflow`, `neptune`), each reading with
the library made for its format, imported only when that source is imported; `model`
holds what they hand over, `writer` stages each run aside and renames it into place.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

from expr_tracker.imports.model import Found, ImportFailed, MissingExtra, need
from expr_tracker.imports.writer import Placed, Progress, write_runs
from expr_tracker.store.layout import run_dir

KINDS = ("tensorboard", "wandb", "mlflow", "neptune")

__all__ = ["KINDS", "Found", "ImportFailed", "MissingExtra", "Placed", "find", "import_runs", "source_label",
           "write_runs"]


def find(kind: str, source: str, follow_symlinks: bool = False) -> list[Found]:
    """The runs a source holds, not read yet; ImportFailed if there are none.
    `follow_symlinks`: a TensorBoard log dir's symlinks out of it are read (else refused)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if follow_symlinks and kind != "tensorboard":
        raise ValueError("follow_symlinks applies to a TensorBoard log dir only")
    module = importlib.import_module(f"expr_tracker.imports.{kind}")
    need(module.LIBRARY, module.EXTRA, module.WHAT)  # before anything is looked at
    opts = {"follow_symlinks": follow_symlinks} if kind == "tensorboard" else {}
    found: list[Found] = module.find(source, **opts)
    return found


def import_runs(
    kind: str, source: str, root: str | os.PathLike[str], project: str, name: str, *,
    force: bool = False, progress: Progress | None = None, follow_symlinks: bool = False,
) -> Sequence[Placed]:
    """Import every run of `source` into `{root}/{project}/`: the source's own run as
    `name`, each sub-run as `{name}-{sub}`. All or nothing: ImportFailed names the file
    and why, and leaves no run half-written."""
    run_dir(root, project, name)  # a bad name fails before the source is read
    found = find(kind, source, follow_symlinks)
    return write_runs(root, project, name, kind, source_label(source), found, force=force,
                      progress=progress)


def source_label(source: str) -> str:
    """What the sidecar records as the source: a URI as given, a path made absolute and
    its links resolved (one source, one label, whatever link names it)."""
    return source if "://" in source else os.path.realpath(source)
