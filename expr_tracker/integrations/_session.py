"""The run an adapter drives: started late (when the config is known), one per process.

Trainers hand over their configuration at different moments: Transformers at train begin,
Lightning after it has already touched the logger, Accelerate after `start()`. `Session`
starts the run on first use and merges a configuration that arrives after the start into
the open run's config (`Run.update_config`: the same shard, the same session).

Two things a trainer does that the SDK alone would get wrong:
- it raises and the code catches it: the run is finished `crashed` with the exception as
  its exit (`fail`), and a run another adapter left open is never taken over by the next
  trainer (`ensure` closes it, as crashed if it was left in training, and starts its own);
- it counts its steps from 0 again (a second fit, a rerun under the same name) while the
  run continues after its largest step: the segment's steps are shifted past the run's
  (see `Session.log`), never dropped.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Mapping
from typing import Any

import expr_tracker as et

_SCALARS = (bool, int, float, str, type(None))


def jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of a trainer's config: containers kept, anything else as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, _SCALARS):
        return value
    if depth > 20:  # a self-referencing config: stop, never recurse forever
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, depth + 1) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:  # numpy scalars, 0-d tensors
        try:
            return jsonable(item(), depth + 1)
        except (TypeError, ValueError, RuntimeError):
            pass
    enum_value = getattr(value, "value", None)
    if isinstance(enum_value, _SCALARS) and type(value).__module__ != "builtins":
        return enum_value  # an Enum member (IntervalStrategy.STEPS -> "steps")
    return str(value)


def metrics(values: Mapping[str, Any]) -> dict[str, Any]:
    """The loggable part of a trainer's metrics: numbers, bools, strings, 0-d tensors.

    Lists, dicts and anything else a trainer puts next to its metrics are left out (the
    SDK would reject them), as are keys the SDK reserves (leading `_`).
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key or key.startswith("_"):
            continue
        if isinstance(value, _SCALARS):
            out[key] = value
        elif getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
            out[key] = value  # unwrapped by the SDK
    return out


def _as_step(step: Any) -> int | None:
    """A trainer's step as an int >= 0 (numpy integers, 0-d integer tensors), else None."""
    if step is None or isinstance(step, bool):
        return None
    try:
        value = operator.index(step)
    except TypeError:
        return None
    return value if value >= 0 else None


class TrainingAbandoned(RuntimeError):
    """The exit recorded for a run whose trainer stopped without ending it (an exception
    the code caught, out of the adapter's sight) once another trainer starts."""


# the adapter session whose own run is open in this process (one run per process)
_active: Session | None = None


class Session:
    """One process's run for an adapter: `init` on first use, `finish` when the trainer ends.

    If the training code already called `et.init`, that run is used and left open at the
    end: the code that started it finishes it. `step_key` names the column that keeps the
    trainer's own step in rows whose step was shifted. With `marks_training` the adapter
    says when training runs (`training`, Transformers: train begin to train end), so a run
    reopened outside it (an `evaluate()` after `train()`) is never taken for a failed one;
    else every open run counts as training.
    """

    def __init__(self, project: str, name: str | None, init_kwargs: dict[str, Any],
                 step_key: str = "trainer/step", marks_training: bool = False) -> None:
        self.project = project
        self.name = name
        self.step_key = step_key
        self.marks_training = marks_training
        self.training = False
        config = init_kwargs.pop("config", None)
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        self.config: dict[str, Any] = jsonable(dict(config or {}))
        self.init_kwargs = init_kwargs
        self.run: et.Run | None = None
        self.owned = False
        self._shift: int | None = None  # this segment's step shift, fixed at its first step
        self._logged = False  # this segment logged a row

    @property
    def started(self) -> bool:
        """True while this session's run is open."""
        return self.run is not None and et.get_run() is self.run

    def ensure(self) -> et.Run:
        """The open run, started now if need be (a finished one is resumed: same shard).

        A run the training code started is used as it is; a run another adapter started
        and never ended is finished first (crashed if its trainer stopped in training: it
        raised and the code went on): this trainer gets its own run, under its own name.
        """
        global _active
        if self.started:
            assert self.run is not None
            return self.run
        current = et.get_run()
        if current is not None:
            owner = _active
            if owner is None or owner is self or owner.run is not current or not owner.owned:
                self.run, self.owned = current, False
                return current
            owner._abandoned(self)
        self.run = et.init(self.project, self.name, config=self.config, **self.init_kwargs)
        self.owned = True
        self.training = self.training or not self.marks_training
        _active = self
        self.name = self.run.name  # a resumed session keeps the name every rank agreed on
        return self.run

    def begin(self) -> et.Run:
        """Training starts (adapters with `marks_training`): a new segment in a run of its
        own; a run still open from logs outside training (`evaluate()`) is finished first."""
        if self.run is not None:
            self.finish()
        self.training = True
        return self.ensure()

    def _abandoned(self, successor: Session) -> None:
        """`successor` starts while our run is open: finished if it was open outside
        training, else crashed (its trainer stopped without ending it) with the exception
        being handled, if there is one, as the exit."""
        if not self.training:
            self.finish()
            return
        exc = sys.exc_info()[1]
        if exc is None:
            exc = TrainingAbandoned(
                f"the trainer of {self.project}/{self.name} stopped without ending its run "
                f"(an exception the code caught?); {successor.project}/"
                f"{successor.name or '(default name)'} started after it"
            )
        print(f"expr_tracker: {self.project}/{self.name} was left open by a trainer that "
              f"stopped early ({type(exc).__name__}): finished as crashed", file=sys.stderr,
              flush=True)
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """The trainer raised `exc`: finish our run as crashed with it as the exit (Ctrl-C:
        finished, as the SDK treats it). Never raises: the trainer's exception goes on."""
        run = self.run
        self._end_segment()
        if run is not None and self.owned and et.get_run() is run:
            try:
                # the context-manager exit records {type, message, time} as the SDK's
                # exception hook does, and finishes the shard crashed
                run.__exit__(type(exc), exc, exc.__traceback__)
            except Exception:  # never hide the trainer's own exception
                pass

    def update_config(self, values: Mapping[str, Any]) -> None:
        """Merge into the run's config; an open run of ours gets it through
        `Run.update_config` (a run the training code started keeps its own config)."""
        fresh = jsonable(dict(values))
        merged = {**self.config, **fresh}
        if merged == self.config:
            return
        self.config = merged
        if self.started and self.owned:
            assert self.run is not None
            self.run.update_config(fresh)

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Log the loggable part of `values` at the trainer's `step`.

        A trainer counts from its own start while the run continues after its largest
        step (a second fit with one logger, a rerun under the same name, a resume from an
        older checkpoint). The SDK would drop every row behind its step, so a segment
        (one train/fit, up to its end) whose first step is behind the run's is shifted as
        a whole: its first row lands at the run's next step, the ones after keep their
        spacing, and each shifted row keeps the trainer's own step in `step_key`.
        """
        row = metrics(values)
        if not row:
            return
        run = self.ensure()
        own = _as_step(step)  # None for a step the SDK refuses: it is passed on as it is
        if own is not None:
            if self._shift is None:
                self._shift = self._shift_for(run, own)
            if self._shift:
                row[self.step_key] = own
                step = own + self._shift
        run.log(row, step=step)
        self._logged = True

    def _shift_for(self, run: et.Run, step: int) -> int:
        """The shift of a segment that starts at the trainer's `step` (0: none needed)."""
        behind = run.step - step
        if behind <= 0:
            return 0
        print(f"expr_tracker: {self.project}/{self.name} rank {run.rank}: the trainer starts at "
              f"step {step}, behind the run's step {run.step} (a second fit, or a rerun under "
              f"the same name): its steps are logged {behind} later, the trainer's own step "
              f"is in {self.step_key!r}", file=sys.stderr, flush=True)
        return behind

    def finish(self, status: str = "finished") -> None:
        """Finish the run if this session started it; else commit the segment's last row
        (the next segment must not merge into it)."""
        run, logged = self.run, self._logged
        self._end_segment()
        if run is None or et.get_run() is not run:
            return
        if self.owned:
            run.finish(status)
        elif logged:
            run.log({}, commit=True)

    def _end_segment(self) -> None:
        global _active
        if _active is self:
            _active = None
        self.run = None
        self._shift, self._logged, self.training = None, False, False
