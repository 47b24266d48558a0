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
)

EXTRA = "import-tensorboard"
LIBRARY, WHAT = "tensorboard", "TensorBoard logs"


def is_event_file(name: str) -> bool:
    return "tfevents" in name and not name.endswith((".tmp", ".part"))


def find(source: str) -> list[Found]:
    """Each directory under `source` that holds event files (or `source`, an event file)."""
    path = Path(source).absolute()
    if path.is_file():
        return [Found(None, str(path), lambda: load([path], str(path)))]
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory")
    found: list[Found] = []
    for here, dirs, files in os.walk(path):
        dirs.sort()
        events = sorted(Path(here) / f for f in files if is_event_file(f))
        if not events:
            continue
        rel = os.path.relpath(here, path)
        suffix = None if rel == "." else safe_part(rel)
        found.append(Found(suffix, here, partial(load, events, here)))
    if not found:
        raise ImportFailed(f"{source}: no TensorBoard event files (*tfevents*) in it or below")
    return found


def records(path: Path) -> Any:
    """The serialized events of one event file, each record's length and checksums checked;
    ImportFailed naming the file at the first damaged or truncated record."""
    need("tensorboard", EXTRA, "TensorBoard logs")
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    try:
        reader = PyRecordReader_New(str(path))
    except errors.NotFoundError:
        raise ImportFailed(f"{path}: no such file") from None
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return
        except errors.DataLossError as exc:
            why = str(exc.message).replace(str(path), "").strip()
            raise ImportFailed(f"{path}: damaged TensorBoard event file ({why})") from None
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
