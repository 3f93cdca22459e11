"""EarlyStopping: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_info

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


class EarlyStopping(Callback):
    """Checked after every validation run; rank 0's decision is broadcast so every rank stops together.

    Args:
        monitor: metric name. min_delta: smallest change that counts as improvement.
        patience: validation checks in a row without improvement that stop training. mode: "min" or "max".
        check_finite: stop at once when the metric is nan or inf.
        stopping_threshold: stop as soon as the metric reaches this value.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, mode: str = "min",
                 check_finite: bool = True, stopping_threshold: float | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max'; got {mode!r}.")
        if patience < 0:
            raise ValueError(f"patience must be >= 0; got {patience}.")
        self.monitor, self.min_delta, self.patience, self.mode = monitor, abs(min_delta), patience, mode
        self.check_finite, self.stopping_threshold = check_finite, stopping_threshold
        self.wait = 0
        self.best: float | None = None
        self.stopped_step: int | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[{self.monitor}]"

    def state_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "best": self.best, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait, self.best, self.stopped_step = state["wait"], state["best"], state.get("stopped_step")

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.state != "fit":
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if self.monitor not in metrics:
            raise KeyError(f"EarlyStopping(monitor={self.monitor!r}): not logged during validation; "
                           f"logged: {sorted(metrics)}.")
        value = metrics[self.monitor]
        reason = None
        if self.check_finite and not math.isfinite(value):
            reason = f"{self.monitor} = {value} is not finite"
        elif self.stopping_threshold is not None and (
            value <= self.stopping_threshold if self.mode == "min" else value >= self.stopping_threshold
        ):
            reason = f"{self.monitor} = {value:.6g} reached stopping_threshold {self.stopping_threshold}"
        elif self._improved(value):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                reason = f"{self.monitor} did not improve for {self.wait} checks (best {self.best:.6g})"
        reason = trainer.strategy.broadcast_object(reason)
        if reason is not None:
            trainer.should_stop = True
            self.stopped_step = trainer.global_step
            rank_zero_info(f"EarlyStopping: {reason}; stopping at step {trainer.global_step}.")
