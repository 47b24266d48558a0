"""TensorBoard log directories: scalars, read by TensorBoard's own record reader (no
TensorFlow), every record's checksum checked (DESIGN 22).

A directory holding event files is one run: the log dir itself is the run `--name`, and
each sub-directory with event files of its own (the way TensorBoard shows one line per
sub-directory) is the run `{name}-{sub-directory}`, `/` as `-`. Scalars come over as
written: a float32 value becomes the double that holds it exactly (0.1 is
0.10000000149011612), never rounded to fewer digits. TensorBoard's loader treats a
damaged record as the end of a file still being written; an import refuses the file
instead, naming it and the damage.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from expr_tracker.imports.model import (
    Found,
    Imported,
    ImportFailed,
    Steps,
    check_step,
    need,
    safe_part,
    unreadable,
)

EXTRA = "import-tensorboard"
LIBRARY, WHAT = "tensorboard", "TensorBoard logs"


def is_event_file(name: str) -> bool:
    return "tfevents" in name and not name.endswith((".tmp", ".part"))


def find(source: str, follow_symlinks: bool = False) -> list[Found]:
    """Each directory under `source` that holds event files (or `source`, an event file).

    All of `source` or nothing: a directory it may not read fails the import, naming it.
    A symlink leading out of `source` is read only with `follow_symlinks` (reading another
    place than the one named is the user's choice, not a walk's); a directory symlink
    leading back into `source` is not walked (its run would come over twice)."""
    path = Path(source).resolve()  # one source, one origin, whatever link it is named by
    if path.is_file():
        return [Found(None, str(path), lambda: load([path], str(path)))]
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory")
    top = path
    found: list[Found] = []
    seen: set[Path] = set()
    for here, dirs, files in os.walk(path, onerror=unreadable, followlinks=follow_symlinks):
        real = Path(here).resolve()
        if real in seen:  # a loop of links, or two links to one directory
            dirs.clear()
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if _walked(Path(here) / d, top, follow_symlinks))
        events = sorted(Path(here) / f for f in files if is_event_file(f))
        for event in events:
            _walked(event, top, follow_symlinks)
        if not events:
            continue
        rel = os.path.relpath(here, path)
        suffix = None if rel == "." else safe_part(rel)
        found.append(Found(suffix, here, partial(load, events, here)))
    if not found:
        raise ImportFailed(f"{source}: no TensorBoard event files (*tfevents*) in it or below")
    return found


def _walked(entry: Path, top: Path, follow_symlinks: bool) -> bool:
    """Whether the walk goes into `entry`: False for a directory symlink into `top`;
    ImportFailed for a symlink out of `top` unless `follow_symlinks`."""
    if not entry.is_symlink():
        return True
    target = entry.resolve()
    if target == top or target.is_relative_to(top):
        return not target.is_dir()
    if not follow_symlinks:
        raise ImportFailed(f"{entry} is a symlink out of SOURCE (to {target}): pass "
                           "--follow-symlinks to read it, or import its target on its own")
    return True


def records(path: Path) -> Any:
    """The serialized events of one event file, each record's length and checksums checked;
    ImportFailed naming the file at the first damaged or truncated record."""
    need("tensorboard", EXTRA, "TensorBoard logs")
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    try:
        open(path, "rb").close()  # an unreadable file named plainly, before TensorBoard's stub
    except OSError as exc:
        raise ImportFailed(f"{path}: {exc.strerror}") from None
    try:
        reader = PyRecordReader_New(str(path))
    except errors.NotFoundError:
        raise ImportFailed(f"{path}: no such file") from None
    first = True
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return
        except errors.DataLossError as exc:
            why = str(exc.message).replace(str(path), "").strip()
            if first:  # TensorBoard's writer writes a whole record as it opens a file
                raise ImportFailed(f"{path}: not a TensorBoard event file ({why})") from None
            if "truncated" in why:
                raise ImportFailed(f"{path}: truncated TensorBoard event file ({why}): cut "
                                   "short, or still being written (import it once its job "
                                   "has finished)") from None
            raise ImportFailed(f"{path}: damaged TensorBoard event file ({why})") from None
        first = False
        yield reader.record()


def load(files: list[Path], origin: str) -> Imported:
    """Every scalar of the event files of one run, one row per step."""
    need("tensorboard", EXTRA, "TensorBoard logs")
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    run = Imported(rows=[])
    steps = Steps(run)
    first: float | None = None
    for path in files:
        for data in records(path):
            event = event_pb2.Event()
            try:
                event.ParseFromString(data)
            except DecodeError as exc:
                raise ImportFailed(f"{path}: a record is not a TensorBoard event ({exc})") from None
            wall = event.wall_time
            if first is None or wall < first:
                first = wall
            if not event.HasField("summary"):
                continue
            row = None  # made at the event's first scalar: an event of images makes no row
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    number: Any = float(value.simple_value)  # float32 -> its exact double
                elif kind == "tensor" and value.metadata.plugin_data.plugin_name in ("scalars", ""):
                    array = tensor_util.make_ndarray(value.tensor)
                    if array.shape != () or array.dtype.kind not in "fiub":
                        run.skip(f"{value.metadata.plugin_data.plugin_name or 'tensor'} summaries")
                        continue
                    number = array.item()
                else:
                    run.skip(f"{value.metadata.plugin_data.plugin_name or kind} summaries")
                    continue
                if row is None:
                    row = steps.at(check_step(event.step, str(path), f"tag {value.tag!r}"), wall)
                steps.put(row, value.tag, number)
    run.rows = steps.done()
    run.start_time = first
    return run
