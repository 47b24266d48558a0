"""Accelerate: `ExprTrackerTracker`, a `GeneralTracker` for `Accelerator(log_with=[...])`.

    tracker = ExprTrackerTracker("proj", "sft-1")
    accelerator = Accelerator(log_with=[tracker])
    accelerator.init_trackers("proj", config={"lr": 3e-4})
    accelerator.log({"loss": loss.item()}, step=step)
    accelerator.end_training()

Accelerate calls `init_trackers` and `log` on the main process only; `tracker.log(...)` (or
`tracker.tracker`, the `expr_tracker.Run`) works on every process, each writing its own
shard. The run starts at its first use, so the config from `init_trackers` is in it.

Accelerate has no hook around the training loop, so an exception the code catches is
out of the tracker's sight: `with tracker:` around the loop records it (the run is
finished crashed with its type and message); without it, the next tracker to start in
the process finishes the abandoned run as crashed (`TrainingAbandoned`) before its own.
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

from expr_tracker.integrations._session import Session


class ExprTrackerTracker(GeneralTracker):
    """An Accelerate tracker over `expr_tracker.init/log/finish`; `init_kwargs` go to `init`."""

    name = "expr_tracker"
    requires_logging_directory = False
    main_process_only = False  # every rank may log: each writes its own shard

    def __init__(self, project: str, name: str | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.session = Session(project, name, init_kwargs, step_key="accelerate/step")

    @property
    def tracker(self) -> Any:
        """The `expr_tracker.Run` of this process (started now if need be)."""
        return self.session.ensure()

    def start(self) -> None:
        """Nothing yet: the run starts at the first config or log, so the config is in it."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The run's config (merged into the sidecar of a run already open, same session)."""
        self.session.update_config(values)
        self.session.ensure()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers in `values` at `step` (None: the run's next step)."""
        self.session.log(values, step=step)

    def finish(self) -> None:
        """Finish the run (Accelerate calls it from `end_training` on every process)."""
        self.session.finish()

    def __enter__(self) -> ExprTrackerTracker:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Finish the run: crashed with the exception as its exit if the block raised."""
        if isinstance(exc, BaseException):
            self.session.fail(exc)
        else:
            self.session.finish()
