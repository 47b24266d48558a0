"""Turning command-line arguments into runs and shards (DESIGN 11).

A RUN argument is a run directory, a shard file, `project/name`, or a bare `name`
looked up under the run root (`--dir`, else `$EXPR_DIR`, else `./tracker/jsonl`).
Everything here raises `CLIError` with one line a person can act on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from expr_tracker.ranks import compact as compact_ranks
from expr_tracker.store.layout import default_dir, parse_shard_name, validate_stream
from expr_tracker.store.safedir import refused_special

from .errors import CLIError

RUN_HELP = "Run directory, shard file, project/name, or a run name under --dir."
DIR_HELP = "Run root (default: $EXPR_DIR, else ./tracker/jsonl)."


# Immutable records as named tuples: a dataclass costs a millisecond to create at import,
# and every `expr` command imports this module.
class ShardRef(NamedTuple):
    """One shard file of a run, with what its name says."""

    path: Path
    stream: str | None
    rank: int

    @property
    def sidecar(self) -> Path:
        """The shard's sidecar (`metrics.rank3.jsonl` -> `metrics.rank3.meta.json`)."""
        return self.path.with_name(self.path.name[: -len(".jsonl")] + ".meta.json")


class RunRef(NamedTuple):
    """A resolved run: its directory, a `project/name` label, and the shard file if one was named."""

    path: Path
    label: str
    shard: Path | None = None


def ranks_phrase(ranks: list[int], limit: int | None = None) -> str:
    """`rank 3` or `ranks 0-2,5`: the words before a list of ranks agree with it. With
    `limit`, a phrase longer than that many characters is counted and its list cut after
    a whole range: `4,096 ranks (0-2,5,9,...)`."""
    text = compact_ranks(ranks)
    words = f"rank{'s' if len(ranks) != 1 else ''} {text}"
    if limit is None or len(words) <= limit:
        return words
    count = f"{len(set(ranks)):,} ranks ("
    room = max(limit - len(count) - len(",...)"), 0)
    head = text[:room + 1].rpartition(",")[0] or text.partition(",")[0]
    return f"{count}{head},...)"


def root_dir(option: str | os.PathLike[str] | None) -> Path:
    """The run root: the `--dir` option, else `$EXPR_DIR`, else `./tracker/jsonl`."""
    return Path(option) if option else default_dir()


def _label(run_dir: Path) -> str:
    return f"{run_dir.parent.name}/{run_dir.name}"


def _has_shards(path: Path) -> bool:
    try:
        return any(parse_shard_name(p.name) is not None for p in path.iterdir() if p.is_file())
    except OSError:
        return False


def list_runs(root: Path) -> list[RunRef]:
    """Every `{root}/{project}/{name}` directory holding at least one shard, sorted."""
    out: list[RunRef] = []
    try:
        projects = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return out
    for project in projects:
        try:
            # a name starting with "." is never a run's (`expr import` stages runs there)
            runs = sorted(p for p in project.iterdir() if p.is_dir() and p.name[:1] != ".")
        except OSError:
            continue
        out.extend(RunRef(run, _label(run)) for run in runs if _has_shards(run))
    return out


def near_runs(text: str, labels: list[str], n: int, cutoff: float) -> list[str]:
    """At most `n` run labels (`project/name`) close to `text`, as a label or as a bare
    name, closest first (difflib's ratio of at least `cutoff`)."""
    import difflib

    names = {label.split("/", 1)[1]: label for label in labels}
    close = difflib.get_close_matches(text, labels, n=n, cutoff=cutoff)
    close += [names[m] for m in difflib.get_close_matches(text, list(names), n=n, cutoff=cutoff)]
    return list(dict.fromkeys(close))[:n]


def _not_found(arg: str, root: Path) -> CLIError:
    runs = list_runs(root)
    if not runs:
        return CLIError(f"no run {arg!r}: no runs under {root} (set --dir or $EXPR_DIR)")
    labels = [r.label for r in runs]
    close = near_runs(arg, labels, 3, 0.6)
    if close:
        return CLIError(f"no run {arg!r} under {root}; did you mean {', '.join(close)}?")
    shown = ", ".join(labels[:5]) + (f" and {len(labels) - 5} more" if len(labels) > 5 else "")
    return CLIError(f"no run {arg!r} under {root}; runs there: {shown}")


def _entry(path: Path) -> os.DirEntry[str] | None:
    """`path`'s entry in its directory's listing, found without looking `path` up: a
    network filesystem caches a failed lookup (a negative dentry: NFS, FUSE's
    `negative_timeout`) for up to a minute, and a run that appeared meanwhile stayed
    unseen by `expr top` and `expr runs` for most of a short job. A listing is not
    cached so."""
    parent = path.parent if path.name else path
    try:
        with os.scandir(parent) as it:
            return next((e for e in it if e.name == path.name), None)
    except OSError:
        return None


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, asked of its directory's listing first (`_entry`)."""
    entry = _entry(path) if path.name not in ("", ".", "..") else None
    if entry is None:
        return path.name in ("", ".", "..") and path.is_dir()
    return entry.is_dir()


def resolve_run(arg: str, root: Path) -> RunRef:
    """A run directory, a shard file, `project/name` or a bare name -> RunRef."""
    path = Path(arg).expanduser()
    entry = _entry(path) if path.name not in ("", ".", "..") else None
    if entry is not None and entry.is_file():
        if parse_shard_name(path.name) is None:
            raise CLIError(f"{arg} is not a shard file (expected metrics[.stream][.rankN].jsonl)")
        return RunRef(path.parent, _label(path.parent.resolve()), path)
    if _is_dir(path) and _has_shards(path):
        return RunRef(path, _label(path.resolve()))
    parts = arg.strip("/").split("/")
    if len(parts) == 2 and all(parts) and _is_dir(root / parts[0]) and _is_dir(
            root / parts[0] / parts[1]):
        return RunRef(root / parts[0] / parts[1], arg.strip("/"))
    if len(parts) == 1 and parts[0]:
        # the projects' listings, not a lookup of `*/name` in each (`_entry`)
        hits = sorted(p / parts[0] for p in _subdirs(root) if _is_dir(p / parts[0]))
        if len(hits) == 1:
            return RunRef(hits[0], _label(hits[0]))
        if len(hits) > 1:
            names = ", ".join(_label(h) for h in hits)
            raise CLIError(f"run name {arg!r} is ambiguous under {root}: {names}; use project/name")
    if _is_dir(path):
        # an existing directory without shards: let the command say the run is empty
        if any(_has_shards(p) for p in path.iterdir() if p.is_dir()):
            runs = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir() and _has_shards(p)))
            raise CLIError(f"{arg} is a project directory; its runs: {runs}")
        return RunRef(path, _label(path.resolve()))
    raise _not_found(arg, root)


def _subdirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if not e.name.startswith(".") and e.is_dir()]
    except OSError:
        return []


def list_shards(run: RunRef) -> list[ShardRef]:
    """All shards of a run (every stream), sorted by stream then rank."""
    try:
        # scandir: the file type comes with the entry, no stat per file (16,384 shards)
        with os.scandir(run.path) as it:
            files = [(e.name, e.path, e.is_file()) for e in it]
    except OSError as exc:
        raise CLIError(f"cannot read run directory {run.path}: {exc.strerror or exc}") from None
    out = []
    for name, path, regular in files:
        parsed = parse_shard_name(name)
        if parsed is None:
            continue
        if regular:
            out.append(ShardRef(Path(path), parsed.stream, parsed.rank))
        elif not os.path.isdir(path):  # a FIFO, socket or device: named, never read
            refused_special(path)
    out.sort(key=lambda s: (s.stream or "", s.rank))
    return out


def stream_label(stream: str | None) -> str:
    """How a stream is named to a person: the default stream has no name."""
    return "(default)" if stream is None else stream


def shards_of(run: RunRef, stream: str | None) -> list[ShardRef]:
    """The shards of one stream of a run; CLIError if the run or the stream has none."""
    validate_stream(stream)
    every = list_shards(run)
    if not every:
        raise CLIError(f"run {run.label} is empty: no metrics*.jsonl shards in {run.path}")
    mine = [s for s in every if s.stream == stream]
    if not mine:
        have = sorted({stream_label(s.stream) for s in every})
        raise CLIError(
            f"run {run.label} has no shards of stream {stream_label(stream)}; streams: {', '.join(have)}"
        )
    return mine


def _world_size(shards: Sequence[ShardRef]) -> int | None:
    """The world size the first of `shards` records in its sidecar (None if it has none)."""
    from expr_tracker.store.cursor import read_sidecar

    meta = read_sidecar(shards[0].sidecar)
    ws = meta.get("world_size") if meta else None
    return ws if type(ws) is int and ws > 0 else None


def pick_shard(run: RunRef, stream: str | None, rank: int | None) -> ShardRef:
    """The shard for (`stream`, `rank`); a named shard file wins when neither is given."""
    if run.shard is not None and rank is None and stream is None:
        parsed = parse_shard_name(run.shard.name)
        assert parsed is not None  # resolve_run checked the name
        return ShardRef(run.shard, parsed.stream, parsed.rank)
    if run.shard is not None and stream is None:
        # `expr history path/metrics.data.rank2.jsonl --rank 3`: keep the file's stream
        parsed = parse_shard_name(run.shard.name)
        stream = parsed.stream if parsed else None
    candidates = shards_of(run, stream)
    want = 0 if rank is None else rank
    for s in candidates:
        if s.rank == want:
            return s
    ranks = compact_ranks([s.rank for s in candidates])
    world = _world_size(candidates)
    if world is not None and want >= world:
        # not a rank that may yet start writing (`expr tail --follow` would wait for it)
        raise CLIError(f"run {run.label} has no rank {want}: its world size is {world} (ranks: {ranks})")
    raise CLIError(
        f"run {run.label} has no shard for rank {want} of stream {stream_label(stream)}; ranks: {ranks}"
    )


def parse_step_range(text: str | None) -> tuple[int | None, int | None] | None:
    """`a:b` (half-open, either side optional) -> (a, b); None stays None."""
    if text is None:
        return None
    lo_s, sep, hi_s = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo = int(lo_s) if lo_s.strip() else None
        hi = int(hi_s) if hi_s.strip() else None
    except ValueError:
        raise CLIError(f"step range {text!r} must look like START:STOP, e.g. 100:200", 2) from None
    from expr_tracker.store.records import MAX_STEP

    if any(s is not None and abs(s) > MAX_STEP for s in (lo, hi)):
        # (past it, the readers' int64 arrays overflow: a TypeError deep in a reducer)
        raise CLIError(f"step range {text[:64]!r}: steps are at most 2**53 ({MAX_STEP})", 2)
    if lo is not None and hi is not None and hi <= lo:
        raise CLIError(f"step range {text!r} is empty: STOP must be greater than START", 2)
    return lo, hi


def parse_metrics(values: list[str] | str | None) -> list[str] | None:
    """`a,b` (or several options) -> ["a", "b"]; None or empty -> None."""
    if values is None:
        return None
    items = [values] if isinstance(values, str) else values
    out = [m.strip() for item in items for m in item.split(",") if m.strip()]
    return list(dict.fromkeys(out)) or None


def parse_rank(text: str | None, allow_all: bool = False) -> int | str | None:
    """A rank number (or `all` when allowed)."""
    if text is None:
        return None
    if allow_all and text == "all":
        return "all"
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if rank < 0:
        hint = " or 'all'" if allow_all else ""
        raise CLIError(f"--rank must be a rank number >= 0{hint}, got {text!r}", 2)
    return rank


def unknown_metrics(wanted: list[str], available: set[str]) -> CLIError:
    """The error for metrics a shard or run does not have, listing those it has."""
    import difflib

    missing = [m for m in wanted if m not in available]
    have = sorted(available)
    shown = ", ".join(have[:20]) + (f" and {len(have) - 20} more" if len(have) > 20 else "")
    hint = ""
    for m in missing:
        close = difflib.get_close_matches(m, have, n=1)
        if close:
            hint = f" (did you mean {close[0]}?)"
            break
    what = "metric" if len(missing) == 1 else "metrics"
    return CLIError(
        f"unknown {what} {', '.join(missing)}{hint}; available: {shown or 'none'}"
    )


def complete_run(incomplete: str) -> list[str]:
    """Shell completion for RUN: run names and project/name labels under the default root."""
    out = []
    for run in list_runs(default_dir()):
        name = run.label.split("/", 1)[1]
        for cand in (name, run.label):
            if cand.startswith(incomplete):
                out.append(cand)
    return sorted(set(out))


# -- the fast path ----------------------------------------------------------------


class FastOption(NamedTuple):
    """One option of a command that `main` can run without typer (see `parse_fast`).

    `dest` is the typer parameter's name; `convert` turns the text into the value (None for
    a flag, which takes no value) and raises ValueError for text it does not accept.
    """

    dest: str
    flags: tuple[str, ...]
    convert: Callable[[str], Any] | None = str
    multiple: bool = False
    default: Any = None


def int_arg(text: str) -> int:
    """A plain decimal integer; anything fancier (`+5`, `1_000`, ` 5`) is left to typer."""
    body = text[1:] if text[:1] == "-" else text
    if not (body.isascii() and body.isdigit()):
        raise ValueError(text)
    return int(text)


def parse_fast(
    argv: Sequence[str], positional: Sequence[str], options: Sequence[FastOption]
) -> dict[str, Any] | None:
    """Parse `argv` as click would, for the plain cases; None for anything else.

    Handled: the positional arguments, `--opt value`, `--opt=value`, `-o value`, `-ovalue`,
    flags, repeated options. Everything else (help, `--`, bundled short flags, an unknown
    option, a missing or invalid value) returns None: typer then parses it and reports any
    error the usual way.
    """
    by_flag = {flag: opt for opt in options for flag in opt.flags}
    values: dict[str, Any] = {opt.dest: opt.default for opt in options}
    given: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg[:1] != "-" or arg == "-":
            given.append(arg)
            continue
        if arg.startswith("--"):
            flag, eq, attached = arg.partition("=")
            text: str | None = attached if eq else None
        else:
            flag, text = arg[:2], arg[2:] or None
        opt = by_flag.get(flag)
        if opt is None:
            return None
        if opt.convert is None:
            if text is not None:
                return None
            value: Any = True
        else:
            if text is None:
                if not args:
                    return None
                text = args.pop(0)
            try:
                value = opt.convert(text)
            except ValueError:
                return None
        if opt.multiple:
            values[opt.dest] = [*(values[opt.dest] or ()), value]
        else:
            values[opt.dest] = value
    if len(given) != len(positional):
        return None
    values.update(zip(positional, given, strict=True))
    return values


# Flags of the options shared by the commands; the fast path of `main` parses them too.
DIR_FLAGS = ("--dir", "-d")
JSON_FLAGS = ("--json",)
RANK_FLAGS = ("--rank", "-r")
STREAM_FLAGS = ("--stream", "-s")
METRICS_FLAGS = ("--metrics", "-m")


def _shared_options() -> dict[str, Any]:
    import typer

    return {
        "RUN_ARG": typer.Argument(..., help=RUN_HELP, autocompletion=complete_run,
                                  show_default=False, metavar="RUN"),
        "DIR_OPT": typer.Option(None, *DIR_FLAGS, help=DIR_HELP, show_default=False, metavar="DIR"),
        "JSON_OPT": typer.Option(False, *JSON_FLAGS, help="Print JSON instead of tables."),
        "RANK_OPT": typer.Option(None, *RANK_FLAGS, help="Rank of the shard (default 0).",
                                 show_default=False, metavar="RANK"),
        "STREAM_OPT": typer.Option(None, *STREAM_FLAGS, help="Stream (default: the default stream).",
                                   show_default=False, metavar="STREAM"),
        "METRICS_OPT": typer.Option(None, *METRICS_FLAGS, show_default=False, metavar="KEYS",
                                    help="Comma-separated metric keys to show (repeatable)."),
    }


_SHARED = frozenset(("RUN_ARG", "DIR_OPT", "JSON_OPT", "RANK_OPT", "STREAM_OPT", "METRICS_OPT"))
_OPTIONS: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    # RUN_ARG, DIR_OPT, JSON_OPT, RANK_OPT, STREAM_OPT, METRICS_OPT: the arguments and options
    # shared by the commands, made on first use (PEP 562) so that a command run without typer
    # (main's fast path) does not import it
    if name not in _SHARED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _OPTIONS:
        _OPTIONS.update(_shared_options())
    return _OPTIONS[name]
