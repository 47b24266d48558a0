"""Transformers: `ExprTrackerCallback`, a `TrainerCallback` that records a `Trainer` run.

    from expr_tracker.integrations.transformers import ExprTrackerCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ExprTrackerCallback("proj", "sft-1")])

Unlike the built-in reporters it runs on every process: under torchrun each rank writes its
own shard. The run config is the model config with the `TrainingArguments` over it (the
shape wandb's callback uses); `to_dict()` has already masked the hub token.

Metric names are wandb's (its callback's `rewrite_logs`, so people coming from it find
them): `eval_*` -> `eval/*`, `test_*` -> `test/*`, anything else under `train/`
(`train/loss`, `train/learning_rate`, `train/epoch`), except the five end-of-training
numbers wandb keeps in its summary under their own names (`train_runtime`, `train_loss`...).

A `Trainer` has no callback for an exception, so importing this module wraps
`Trainer.train` once: when training raises, each `ExprTrackerCallback` of that trainer
finishes its run as crashed with the exception as the exit, then the exception goes on.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import Trainer, TrainerCallback

from expr_tracker.integrations._session import Session, jsonable

# what wandb's callback puts in the run summary, under these names, rather than logging
_SUMMARY_KEYS = frozenset(("train_runtime", "train_samples_per_second", "train_steps_per_second",
                           "train_loss", "total_flos"))


def rewrite_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's log keys under wandb's names (transformers' `rewrite_logs` rule);
    reserved keys (leading `_`) stay as they are, for the SDK to leave out."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if not isinstance(key, str) or key.startswith("_") or key in _SUMMARY_KEYS:
            out[key] = value
        elif key.startswith("eval_"):
            out["eval/" + key[len("eval_"):]] = value
        elif key.startswith("test_"):
            out["test/" + key[len("test_"):]] = value
        else:
            out["train/" + key] = value
    return out


class ExprTrackerCallback(TrainerCallback):
    """Records a `Trainer` run: init at train begin, each `on_log` at its global step, finish at the end.

    `init_kwargs` go to `expr_tracker.init` (dir, stream, upload_mode, alert_rules, ...);
    a `config=` there is merged under the trainer's.
    """

    def __init__(self, project: str, name: str | None = None, **init_kwargs: Any) -> None:
        self.session = Session(project, name, init_kwargs, step_key="train/global_step",
                               marks_training=True)

    @property
    def run(self) -> Any:
        """The `expr_tracker.Run` of this process once training has begun, else None."""
        return self.session.run

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        """Start (or resume) this process's shard with the trainer's config."""
        config: dict[str, Any] = {}
        model_config = getattr(model, "config", None)
        if model_config is not None:
            config.update(model_config if isinstance(model_config, dict) else model_config.to_dict())
        config.update(args.to_dict())
        self.session.config = {**self.session.config, **jsonable(config)}
        self.session.begin()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        """Log the trainer's numbers, under wandb's names, at `state.global_step`
        (same-step calls share one row)."""
        if logs:
            self.session.log(rewrite_logs(logs), step=int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Finish the run (a run the training code started itself is left to it)."""
        self.session.finish()


def _guard_train(train: Any) -> Any:
    """`Trainer.train` that finishes the trainer's expr-tracker runs as crashed when it raises."""
    if getattr(train, "_expr_tracker_guard", False):
        return train

    @functools.wraps(train)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return train(self, *args, **kwargs)
        except BaseException as exc:
            handler = getattr(self, "callback_handler", None)
            for callback in getattr(handler, "callbacks", ()):
                if isinstance(callback, ExprTrackerCallback):
                    callback.session.fail(exc)
            raise

    guarded._expr_tracker_guard = True  # type: ignore[attr-defined]
    return guarded


Trainer.train = _guard_train(Trainer.train)  # type: ignore[method-assign]
