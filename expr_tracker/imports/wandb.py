"""wandb run directories (`offline-run-*`, `run-*`): the `.wandb` transaction log, its
records decoded with the wandb package's own protobuf classes (DESIGN 22).

wandb 0.31 no longer ships its Python reader of `.wandb` files (`sdk/internal/datastore`:
the Go core writes them), so the framing is read here, as that reader did: a 7-byte
header (`:W&B`, magic 0xBEE1, version 0), then LevelDB log records in 32 KiB blocks,
each with a CRC-32 of its type and data. A truncated or damaged record stops the import
and names the file and the byte. History rows keep `_step` and `_timestamp` (as
`_time`); the run's config goes to the sidecar's config, its summary to its summary,
its tags and notes to its tags and notes. A log without its exit record (the run was
killed, or the file cut short) is refused. Media, tables and histograms do not come over.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
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

EXTRA = "wandb"
LIBRARY, WHAT = "wandb.proto.wandb_internal_pb2", "wandb runs"
_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find(source: str) -> list[Found]:
    """The run of `source` (a run directory or its `.wandb` file), or each run directory
    below it (a `wandb/` directory of runs: each is `{name}-{run directory}`)."""
    path = Path(source).resolve()  # one source, one origin, whatever link it is named by
    if path.is_file():
        return [Found(None, str(path), lambda: load(path))]
    if not path.is_dir():
        raise ImportFailed(f"{source}: no such directory")
    own = [f for f in _listed(path) if f.suffix == ".wandb"]
    if own:
        return [Found(None, str(own[0]), lambda: load(own[0]))]
    # `latest-run` is a symlink to one of the run directories: that run once, not twice;
    # a directory it may not list fails the import (a glob would skip its run quietly)
    found = [Found(safe_part(f.parent.name), str(f), partial(load, f))
             for sub in _listed(path) if sub.is_dir() and not sub.is_symlink()
             for f in _listed(sub) if f.suffix == ".wandb"]
    if not found:
        raise ImportFailed(f"{source}: no .wandb file in it or in its run directories")
    return found


def _listed(path: Path) -> list[Path]:
    """The entries of directory `path`, sorted; ImportFailed naming it if it cannot be read."""
    try:
        return sorted(path.iterdir())
    except OSError as exc:
        raise ImportFailed(f"{path}: {exc.strerror} (an import reads all of SOURCE or "
                           "nothing)") from None


def frames(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` file; ImportFailed naming the byte of a damaged one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImportFailed(f"{path}: {exc.strerror}") from None
    if not data.startswith(_HEADER):
        raise ImportFailed(f"{path}: not a .wandb file (its header is {data[:7]!r})")
    pos, pending = len(_HEADER), None
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's trailer: no record starts in its last six bytes
            pos += left
            continue
        if len(data) - pos < 7:
            raise ImportFailed(f"{path}: truncated at byte {pos} (a record header cut short)")
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if crc == 0 and length == 0 and kind == 0:
            pos += left  # zero padding to the end of the block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            raise ImportFailed(f"{path}: truncated at byte {pos} (a record of {length} "
                               f"bytes, {len(chunk)} there)")
        if zlib.crc32(chunk, zlib.crc32(bytes((kind,)))) & 0xFFFFFFFF != crc:
            raise ImportFailed(f"{path}: damaged record at byte {pos} (checksum mismatch)")
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = bytearray(chunk)
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += chunk
            if kind == _LAST:
                yield bytes(pending)
                pending = None
        else:
            raise ImportFailed(f"{path}: damaged record at byte {pos} (type {kind})")
    if pending is not None:
        raise ImportFailed(f"{path}: truncated (its last record is not complete)")


def _key(item: Any) -> str:
    return ".".join(item.nested_key) if item.nested_key else item.key


def _value(item: Any, path: Path) -> Any:
    try:
        return json.loads(item.value_json)  # NaN and Infinity tokens included
    except ValueError:
        raise ImportFailed(f"{path}: value of {_key(item)!r} is not JSON") from None


def load(path: Path) -> Imported:
    """History rows, config, summary, tags and notes of one `.wandb` file."""
    need("wandb.proto.wandb_internal_pb2", EXTRA, "wandb runs")
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    run = Imported(rows=[])
    steps = Steps(run)
    exited = False
    for data in frames(path):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        try:
            record.ParseFromString(data)
        except DecodeError as exc:
            raise ImportFailed(f"{path}: a record is not a wandb record ({exc})") from None
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = record.run
            _config(run, info.config.update, path)
            run.tags.extend(info.tags)
            run.notes = info.notes or run.notes
            if info.display_name:
                run.config.setdefault("wandb_name", info.display_name)
            if info.HasField("start_time"):
                run.start_time = info.start_time.seconds + info.start_time.nanos / 1e9
        elif kind == "config":
            _config(run, record.config.update, path)
        elif kind == "summary":
            for item in record.summary.update:
                key = _key(item)
                if not key.startswith("_"):
                    run.summary[key] = _value(item, path)
        elif kind == "history":
            _history(steps, record.history, path)
        elif kind == "exit":
            exited = True
            run.config.setdefault("wandb_exit_code", record.exit.exit_code)
    if not exited:
        # a file cut at a record boundary reads as a shorter run: only the exit record,
        # written by `finish()`, tells the whole log from a part of it
        raise ImportFailed(f"{path}: truncated (it ends before the run's exit record: cut "
                           "short, or the run is still going or was killed)")
    run.rows = steps.done()
    return run


def _config(run: Imported, items: Any, path: Path) -> None:
    for item in items:
        key = _key(item)
        if key != "_wandb":
            run.config[key] = _value(item, path)


def _history(steps: Steps, history: Any, path: Path) -> None:
    values = {_key(item): item for item in history.item}
    step_item = values.pop("_step", None)
    step = _value(step_item, path) if step_item is not None else history.step.num
    step = check_step(step, str(path), "a history row")
    wall_item = values.pop("_timestamp", None)
    wall = _value(wall_item, path) if wall_item is not None else None
    for key, item in values.items():
        if key.startswith("_"):
            continue  # _runtime, _wandb: wandb's own bookkeeping
        value = _value(item, path)
        if isinstance(value, (dict, list)):
            steps.into.skip("media, tables and histograms")
            continue
        steps.add(step, float(wall) if isinstance(wall, (int, float)) else None, key, value)
