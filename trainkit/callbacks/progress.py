"""A tqdm progress bar on rank 0: optimizer steps, it/s, ETA, loss and prog_bar metrics."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


class ProgressBar(Callback):
    """Counts optimizer steps. Metrics are read (``.item()``) at most every ``refresh_s`` seconds."""

    def __init__(self, refresh_s: float = 0.5) -> None:
        self.refresh_s = refresh_s
        self._bar: Any = None
        self._shown_step, self._epoch = 0, 0
        self._next_refresh = 0.0

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        loader = trainer.train_dataloader
        try:
            batches = len(loader) if loader is not None else math.inf
        except TypeError:
            batches = math.inf
        if trainer.limit_train_batches is not None:
            from trainkit.data import num_batches

            batches = num_batches(loader, trainer.limit_train_batches)
        total = trainer.estimated_steps(batches)
        self._bar = tqdm(total=None if math.isinf(total) else int(total), initial=trainer.global_step,
                         unit="step", dynamic_ncols=True, leave=True)
        self._shown_step, self._epoch = trainer.global_step, trainer.current_epoch

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._bar is None or trainer.global_step == self._shown_step:
            return
        self._bar.update(trainer.global_step - self._shown_step)
        self._shown_step, self._epoch = trainer.global_step, trainer.current_epoch
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
            self._refresh(trainer)

    def _refresh(self, trainer: Trainer) -> None:
        values = {"epoch": self._epoch}  # the epoch the last step was in (after the last one, not the count)
        values |= {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}
        self._bar.set_postfix(values, refresh=True)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._bar is not None:
            self._refresh(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._bar is not None:
            self._refresh(trainer)
            self._bar.close()
            self._bar = None

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
