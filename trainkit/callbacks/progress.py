"""A tqdm progress bar on rank 0: optimizer steps, it/s, ETA, loss and prog_bar metrics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


QUIET_S = 2.0  # a bar silent this long redraws itself: its clock moves while a step or a validation takes long
TICK_S = 0.5  # how often the bar looks whether it has been silent that long


class ProgressBar(Callback):
    """Counts optimizer steps. Metrics are read (``.item()``) at most every ``refresh_s`` seconds. While one step
    takes long (the sanity check's validation and the first step under ``compile=True`` compile the model; a large
    model's step; a validation pass), the bar, shown from the start of ``fit``, redraws itself every ``QUIET_S``
    seconds, its elapsed time moving, so a long step is not a silence."""

    def __init__(self, refresh_s: float = 0.5) -> None:
        self.refresh_s = refresh_s
        self._bar: Any = None
        self._stop = threading.Event()
        self._shown_step, self._epoch = 0, 0
        self._next_refresh = 0.0

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:  # before the sanity check's validation
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
        if trainer.compile:
            self._bar.set_postfix_str("compiling the model: the first steps take longer", refresh=False)
        self._shown_step, self._epoch = trainer.global_step, trainer.current_epoch
        self._stop = threading.Event()
        threading.Thread(target=self._keep_alive, args=(self._bar, self._stop), name="trainkit-progress",
                         daemon=True).start()

    @staticmethod
    def _keep_alive(bar: Any, stop: threading.Event, clock: Callable[[], float] = time.time) -> None:
        """Redraw ``bar`` once it has printed nothing for ``QUIET_S`` (looked at every ``TICK_S``), until ``stop``."""
        redrawn = 0.0
        while not stop.wait(TICK_S):
            if clock() - max(bar.last_print_t, redrawn) >= QUIET_S:  # tqdm's own prints set last_print_t
                redrawn = clock()
                bar.refresh()  # under the bar's lock; a closed bar ignores it

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
            self._close()

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if self._bar is not None:
            self._close()

    def _close(self) -> None:
        self._stop.set()
        self._bar.close()
        self._bar = None
