"""fp16 dynamic loss scaling: an inf gradient skips the step, halves the scale, and training recovers."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.callbacks import Callback

POISONED_BATCH = 3


class PoisonOnce(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == POISONED_BATCH else loss


class Watch(Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []
        self.params: list[torch.Tensor] = []

    def on_train_start(self, trainer, module) -> None:
        trainer.scaler.growth_interval = 4
        trainer.scaler.scale = 256.0  # low enough that only the injected inf overflows
        self.params.append(module.net[0].weight.detach().clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.scaler.scale)
        self.params.append(module.net[0].weight.detach().clone())


def test_injected_inf_skips_step_and_recovers(tmp_path):
    watch = Watch()
    trainer = quiet_trainer(tmp_path, precision="16-mixed", max_steps=16, callbacks=[watch])
    module = PoisonOnce()
    trainer.fit(module, loader(regression_data(64), 4))
    scales, params = watch.scales, watch.params
    # params[i + 1] is the state after batch i
    assert torch.equal(params[POISONED_BATCH + 1], params[POISONED_BATCH]), "the poisoned step was applied"
    assert all(not torch.equal(params[i + 1], params[i]) for i in range(16) if i != POISONED_BATCH)
    assert scales[POISONED_BATCH] == scales[POISONED_BATCH - 1] * 0.5
    assert trainer.scaler.skipped_steps == 1
    assert max(scales[POISONED_BATCH + 1 :]) > scales[POISONED_BATCH], "the scale never grew back"
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.global_step == 16
