"""Writing imported runs: each staged aside, then renamed into place (DESIGN 22).

A run is written to a hidden directory beside its final place (`{root}/{project}/
.import-{pid}-{name}`) by the same `ShardWriter` the SDK uses, fsynced, and renamed to
`{root}/{project}/{name}` only when every run of the import was read and written: a
corrupt or truncated source leaves nothing under a run name. A run that exists is
refused (the same source imported twice would double its rows), and so is a source run
an earlier import brought in under another name; `force` replaces the run, but only one
an earlier import wrote, never one a training job did.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expr_tracker.imports.model import Found, Imported, ImportFailed
from expr_tracker.procs import pid_alive
from expr_tracker.store import records
from expr_tracker.store.cursor import read_sidecar
from expr_tracker.store.layout import ShardPaths, run_dir, validate_name
from expr_tracker.store.shard import ShardWriter

_CHUNK = 1 << 20  # bytes of rows handed to the writer at once
STAGING = ".import-"

Progress = Callable[[int, int, str], None]


@dataclass
class Placed:
    """One run an import wrote: its name, rows, and what did not come over."""

    name: str
    origin: str
    rows: int
    skipped: dict[str, int]


def target_names(name: str, found: Sequence[Found]) -> list[str]:
    """`name` for the source's own run, `{name}-{suffix}` for each sub-run; ImportFailed if
    two sub-runs map to one name or a name is not valid."""
    out: list[str] = []
    for f in found:
        target = name if f.suffix is None else f"{name}-{f.suffix}"
        try:
            validate_name(target, "run name")
        except ValueError as exc:
            raise ImportFailed(f"{f.origin}: {exc}") from None
        if target in out:
            other = found[out.index(target)].origin
            raise ImportFailed(f"{f.origin} and {other} would both be run {target!r}; "
                               "rename one of them")
        out.append(target)
    return out


def imported_before(path: Path) -> dict[str, Any] | None:
    """The `import` note of the run at `path` (None: not a run an import wrote)."""
    side = read_sidecar(path / "metrics.meta.json")
    note = side.get("import") if side else None
    return note if isinstance(note, dict) else None


def check_targets(project_dir: Path, names: Sequence[str], force: bool) -> None:
    """Refuse a run that exists (unless `force` and an import wrote it)."""
    for target in names:
        path = project_dir / target
        if not os.path.lexists(path):
            continue
        before = imported_before(path)
        if not force:
            what = f"imported from {before.get('source')}" if before else "written by a run"
            raise ImportFailed(f"run {project_dir.name}/{target} exists ({what}); importing "
                               "again would double its rows: pass --force to replace it")
        if before is None:
            raise ImportFailed(f"run {project_dir.name}/{target} exists and was not written "
                               "by expr import: --force replaces only imported runs")


def check_elsewhere(project_dir: Path, found: Sequence[Found], names: Sequence[str]) -> None:
    """Refuse a source run an earlier import brought in under another name of the project
    (the same rows twice there); `force` skips this check."""
    wanted = {f.origin: target for f, target in zip(found, names, strict=True)}
    with contextlib.suppress(OSError), os.scandir(project_dir) as it:
        for entry in it:
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            note = imported_before(Path(entry.path))
            origin = note.get("origin") if note else None
            if origin in wanted and wanted[origin] != entry.name:
                raise ImportFailed(f"{origin} was imported already, as run {project_dir.name}/"
                                   f"{entry.name}; pass --force to import it again as "
                                   f"{wanted[origin]!r}")


def write_runs(
    root: str | os.PathLike[str], project: str, name: str, kind: str, source: str,
    found: Sequence[Found], *, force: bool = False, progress: Progress | None = None,
) -> list[Placed]:
    """Read every found run, stage each aside, then rename them all into place."""
    project_dir = run_dir(root, project, name).parent
    names = target_names(name, found)
    check_targets(project_dir, names, force)
    if not force:
        check_elsewhere(project_dir, found, names)
    made = not project_dir.exists()
    project_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale(project_dir)
    staged: list[tuple[Path, str]] = []
    placed: list[Placed] = []
    moved = False
    try:
        for i, (f, target) in enumerate(zip(found, names, strict=True)):
            if progress is not None:
                progress(i, len(found), target)
            run = f.load()
            stage = project_dir / f"{STAGING}{os.getpid()}-{target}"
            shutil.rmtree(stage, ignore_errors=True)
            staged.append((stage, target))
            _write(stage, project, target, run, {"kind": kind, "source": source,
                                                 "origin": f.origin, "time": time.time(),
                                                 "skipped": run.skipped})
            placed.append(Placed(target, f.origin, len(run.rows), run.skipped))
        check_targets(project_dir, names, force)  # again: another import may have finished
        for stage, target in staged:
            _place(stage, project_dir / target)
            moved = True
        _fsync_dir(project_dir)
    finally:
        for stage, _ in staged:
            shutil.rmtree(stage, ignore_errors=True)
        if made and not moved:
            with contextlib.suppress(OSError):
                project_dir.rmdir()  # a failed first import leaves no empty project behind
    if progress is not None:
        progress(len(found), len(found), "")
    return placed


def _write(stage: Path, project: str, name: str, run: Imported, note: dict[str, Any]) -> None:
    """The run's shard and sidecar in `stage`, written and fsynced; ImportFailed if not."""
    errors: list[str] = []
    # as a finished SDK run's: each key's last value as its rows hold it, the source's
    # own summary over them; non-finite floats as text there and in the config (JSON has no
    # NaN: written as floats they would read back null)
    latest: dict[str, Any] = {}
    for row in run.rows:
        latest.update(row)  # whole rows, then `_` keys dropped: 0.2 s per million rows
    summary = {k: v for k, v in latest.items() if k[0] != "_"}
    summary.update(_nonfinite_as_text(run.summary))
    identity = {"project": project, "name": name, "stream": None, "rank": 0, "world_size": 1,
                "local_rank": 0, "session": "import", "rank_aware": True,
                "config": _nonfinite_as_text(run.config), **run.meta(), "summary": summary,
                "import": note}
    writer = ShardWriter(ShardPaths(stage, "metrics"), identity,
                         warn=lambda cause, msg: errors.append(msg))
    writer.open()
    times = [r["_time"] for r in run.rows if "_time" in r]
    writer.start_time = run.start_time or (min(times) if times else time.time())
    buf, n, last = bytearray(), 0, None
    for row in run.rows:
        buf += records.dumps(row)
        n, last = n + 1, row["_step"]
        if len(buf) >= _CHUNK:
            writer.append_many(bytes(buf), n, last)
            buf, n = bytearray(), 0
    if buf:
        writer.append_many(bytes(buf), n, last)
    writer.close("finished")
    writer.end_time = run.end_time or (max(times) if times else writer.end_time)
    writer.last_write = writer.end_time
    writer.write_sidecar()
    if errors or writer.dropped:
        why = writer.last_error or (errors[0] if errors else "rows dropped")
        raise ImportFailed(f"could not write run {project}/{name} under {stage.parent.parent}: "
                           f"{why}; nothing was imported")
    try:
        fd = os.open(writer.paths.shard, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # the shard, durable before the rename makes it visible
        finally:
            os.close(fd)
    except FileNotFoundError:
        if run.rows:
            raise
        writer.paths.shard.touch()  # a run without rows is still a run readers list


def _nonfinite_as_text(value: Any) -> Any:
    """`value` with every NaN or infinite float in it spelled as the rows spell it."""
    if isinstance(value, float) and not math.isfinite(value):
        return records.encode_value("summary", value)
    if isinstance(value, dict):
        return {k: _nonfinite_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nonfinite_as_text(v) for v in value]
    return value


def _place(stage: Path, final: Path) -> None:
    """Rename `stage` to `final`; a run already there (`force`) is moved aside first and
    removed after, so a reader sees the old run or the new one, never neither for long."""
    old = None
    if os.path.lexists(final):
        old = final.with_name(f"{STAGING}{os.getpid()}-old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(stage, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _clear_stale(project_dir: Path) -> None:
    """Remove staging directories of imports whose process is gone (killed mid-import)."""
    with contextlib.suppress(OSError), os.scandir(project_dir) as it:
        for entry in it:
            if not entry.name.startswith(STAGING):
                continue
            pid = entry.name[len(STAGING):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
