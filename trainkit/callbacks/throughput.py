"""ThroughputMonitor: samples/s and items/s (tokens, say) over each logging interval, all ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from trainkit.callbacks.base import Callback
from trainkit.utils import infer_batch_size

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


class ThroughputMonitor(Callback):
    """Logs ``throughput/samples_per_sec`` and, when steps return ``num_items``,
    ``throughput/items_per_sec``, both summed over ranks (each rank's rate times the world size).

    Args:
        batch_size_fn: batch -> number of samples (default: leading dimension of the first tensor).
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] | None = None) -> None:
        self.batch_size_fn = batch_size_fn or infer_batch_size
        self._samples = 0
        self._items: Any = 0.0
        self._t0 = 0.0
        self._last_step = -1
        self.last: dict[str, float] = {}

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._samples += self.batch_size_fn(batch)
        if isinstance(outputs, Mapping) and outputs.get("num_items") is not None:
            self._items = self._items + outputs["num_items"]  # a tensor stays on device until logged
        step = trainer.global_step
        if step == self._last_step or step % trainer.log_every_n_steps != 0:
            return
        self._last_step = step
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        world = trainer.world_size
        self.last = {"throughput/samples_per_sec": self._samples * world / elapsed}
        if float(self._items):
            self.last["throughput/items_per_sec"] = float(self._items) * world / elapsed
        trainer.log_metrics(self.last, step)
        self._samples, self._items, self._t0 = 0, 0.0, now
