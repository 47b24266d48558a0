"""A URL's `project/name` -> a run directory under the root, never anywhere else.

The names go through the store's own validation (one path component each: no `/`, no
`..`, no leading dot), and the two directories are opened from the root's descriptor
with O_NOFOLLOW (`store.safedir`), so a symlinked project or run directory is refused,
whatever it points at. A run directory whose files are symlinks (a shard linked to a
file elsewhere) is refused too (`no_links`, whenever its files change): the readers open
files by name, and a run the SDK or exprd wrote never holds one.
"""

from __future__ import annotations

import os
from pathlib import Path

from expr_cli.resolve import RunRef
from expr_tracker.store.layout import validate_name, validate_stream
from expr_tracker.store.safedir import open_dir


class BadRequest(ValueError):
    """Input the API cannot take (400): the message says which field."""


class NotFound(LookupError):
    """No such run, key or file (404)."""


def run_ref(root: Path, project: str, name: str) -> RunRef:
    """The run `project/name` under `root`; BadRequest or NotFound otherwise."""
    try:
        validate_name(project, "project")
        validate_name(name, "name")
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
    try:
        fd = open_dir(root, [project, name], create=False)
    except FileNotFoundError:
        raise NotFound(f"no run {project}/{name} under the run root") from None
    except OSError as exc:  # a symlink, a file where a directory should be
        raise NotFound(f"no run {project}/{name} under the run root ({_why(exc)})") from None
    os.close(fd)
    return RunRef(root / project / name, f"{project}/{name}")


def no_links(ref: RunRef) -> None:
    """NotFound when an entry of the run directory is a symlink, or a FIFO, socket or
    device (a reader would block on it, or never reach its end): checked again whenever
    the run's files change, before anything is read for the new state."""
    fd = os.open(ref.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.scandir(fd) as it:
            linked, special = [], []
            for e in it:
                if e.is_symlink():
                    linked.append(e.name)
                elif not e.is_file(follow_symlinks=False) and not e.is_dir(follow_symlinks=False):
                    special.append(e.name)
    finally:
        os.close(fd)
    if linked:
        raise NotFound(f"run {ref.label} holds symlinks ({', '.join(sorted(linked)[:3])}); "
                       "expr serve does not follow them")
    if special:
        raise NotFound(f"run {ref.label} holds files that are not regular files "
                       f"({', '.join(sorted(special)[:3])}); expr serve does not read them")


def run_arg(root: Path, text: str) -> RunRef:
    """`project/name` (a `run=` parameter) -> the run, as `run_ref`."""
    project, sep, name = text.partition("/")
    if not sep:
        raise BadRequest(f"run must be project/name, got {text!r}")
    return run_ref(root, project, name)


def stream_arg(text: str | None) -> str | None:
    """The `stream=` parameter: None (the default stream) or a valid stream name."""
    if not text:
        return None
    try:
        return validate_stream(text)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None


def inside(root: Path, path: Path) -> bool:
    """True when `path` is a real directory under `root`, not reached through a symlink."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        return False
    try:
        os.close(open_dir(root, rel.parts, create=False))
    except OSError:
        return False
    return True


def _why(exc: OSError) -> str:
    return "a symlink" if "symlink" in str(exc) else str(exc.strerror or exc)
