"""LearningRateMonitor: log each param group's learning rate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.hooks import StepTiming
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


class LearningRateMonitor(Callback):
    """Logs ``lr-<Optimizer>`` (``/pg<i>`` per group when there are several; ``lr-<Optimizer>-1`` for a second
    optimizer of a class) every logging step or epoch.

    Args:
        logging_interval: "step" (at ``log_every_n_steps``) or "epoch".
    """

    def __init__(self, logging_interval: str = "step") -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"logging_interval must be 'step' or 'epoch'; got {logging_interval!r}.")
        self.logging_interval = logging_interval

    def _values(self, trainer: Trainer) -> dict[str, float]:
        values: dict[str, float] = {}
        seen: dict[str, int] = {}
        for optimizer in trainer.optimizers:  # several of one class: lr-Adam, lr-Adam-1, as Lightning names them
            base = f"lr-{type(optimizer).__name__}"
            name = base if base not in seen else f"{base}-{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
            groups = optimizer.param_groups
            if len(groups) == 1:
                values[name] = float(groups[0]["lr"])
            else:
                values |= {f"{name}/pg{i}": float(g["lr"]) for i, g in enumerate(groups)}
        return values

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        step = trainer.global_step
        if self.logging_interval == "step" and step % trainer.log_every_n_steps == 0:
            trainer.log_metrics(self._values(trainer), step)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self.logging_interval == "epoch":
            trainer.log_metrics(self._values(trainer), trainer.global_step)
