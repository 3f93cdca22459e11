"""Callbacks and loggers behave as a Lightning user expects."""

from __future__ import annotations

import csv
from typing import Any

import torch

import trainkit as tk
from tests.helpers import Regression, loader, regression_data
from trainkit import checkpoint as ckpt
from trainkit.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, ThroughputMonitor
from trainkit.loggers import CSVLogger, TensorBoardLogger


class ScriptedValLoss(Regression):
    """Validation loss follows a script, so checkpoint ranking and early stopping are predictable."""

    def __init__(self, script: list[float]) -> None:
        super().__init__(scheduler=True)
        self.script = script
        self.calls = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.script[min(self.calls, len(self.script) - 1)])

    def on_validation_epoch_end(self) -> None:
        self.calls += 1


def _fit(tmp_path, module, callbacks, ckpt_path: str | None = None, **kwargs) -> tk.Trainer:
    args = dict(max_epochs=6, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                num_sanity_val_steps=0, callbacks=callbacks) | kwargs
    trainer = tk.Trainer(**args)
    trainer.fit(module, loader(regression_data(32), 8), loader(regression_data(8, seed=1), 8), ckpt_path=ckpt_path)
    return trainer


def test_model_checkpoint_keeps_the_best_k_and_the_newest(tmp_path):
    best = ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.2f}")
    _fit(tmp_path, ScriptedValLoss([0.9, 0.5, 0.7, 0.3, 0.8, 0.6]), [best])
    names = sorted(p.name for p in ckpt.listing(tmp_path / "checkpoints"))
    assert names == ["1-0.50", "3-0.30", "5-0.60"]  # top-2 by val_loss, plus the newest (save_last)
    assert best.best_model_path.name == "3-0.30"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "5-0.60"


def test_resuming_restores_checkpoint_callback_state_and_prunes(tmp_path):
    _fit(tmp_path, Regression(), [ModelCheckpoint(save_top_k=1)], max_epochs=2)
    _fit(tmp_path, Regression(), [ModelCheckpoint(save_top_k=1)], max_epochs=4, ckpt_path="last")
    assert [p.name for p in ckpt.listing(tmp_path / "checkpoints")] == ["epoch=3-step=16"]


def test_early_stopping_stops_after_patience_checks(tmp_path):
    stop = EarlyStopping(monitor="val_loss", patience=2)
    trainer = _fit(tmp_path, ScriptedValLoss([1.0, 0.9, 0.95, 0.97, 0.5]), [stop], enable_checkpointing=False,
                   max_epochs=10)
    assert trainer.current_epoch == 4  # epochs 0..3 ran: no improvement at epochs 2 and 3
    assert stop.best == 0.9 and trainer.should_stop


def test_epoch_scheduler_state_in_epoch_end_checkpoints(tmp_path):
    class EpochSched(Regression):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    _fit(tmp_path, EpochSched(), [], max_epochs=2)
    resumed = _fit(tmp_path, EpochSched(), [], max_epochs=3, ckpt_path="last")
    assert resumed.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3


def test_tensorboard_logger_keeps_a_finished_runs_scalars_when_the_next_starts(tmp_path):
    """fit then test in one process (Lightning's autoencoder example: fit, test, predict) write one event file each:
    the second no longer reopens and empties the first, whose name held only the second of its start and the PID."""
    from .lightning_examples import logged

    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"train_loss": 0.5}, step=1)
    logger.finalize("success")
    logger.log_metrics({"test_loss": 0.25}, step=1)
    logger.finalize("success")
    assert logged(tmp_path) == {"train_loss": [0.5], "test_loss": [0.25]}


def test_csv_logger_lr_monitor_and_throughput(tmp_path):
    logger = CSVLogger(tmp_path / "runs")
    throughput = ThroughputMonitor()
    _fit(tmp_path, Regression(scheduler=True), [LearningRateMonitor(), throughput], logger=[logger],
         log_every_n_steps=2, max_epochs=2, enable_checkpointing=False)
    with open(logger.log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    lr_rows = [r for r in rows if r.get("lr-AdamW/pg0")]
    assert [int(r["step"]) for r in lr_rows] == [2, 4, 6, 8]
    assert float(lr_rows[-1]["lr-AdamW/pg0"]) < 1e-2  # StepLR(7, 0.7) has decayed by step 8
    assert any(r.get("val_loss") for r in rows) and any(r.get("train_loss") for r in rows)
    assert throughput.last["throughput/samples_per_sec"] > 0


class StepEnds(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, Any]] = []  # (global_step, batches seen so far, timing)
        self.batches = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def on_train_step_end(self, trainer, module, timing) -> None:
        self.seen.append((trainer.global_step, self.batches, timing))


def test_step_end_hook_runs_once_per_optimizer_step_with_its_timing(tmp_path):
    """7 batches with accumulate 2: windows of 2, 2, 2 and a last window of 1 cut short by the data; the hook
    follows each window's last on_train_batch_end, with global_step counting it, and the module's hook runs too."""
    class Module(Regression):
        steps: list[int] = []

        def on_train_step_end(self, timing) -> None:
            self.steps.append(self.global_step)

    cb, module = StepEnds(), Module()
    trainer = tk.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         accumulate_grad_batches=2, default_root_dir=tmp_path, callbacks=[cb])
    trainer.fit(module, loader(regression_data(28), 4))
    assert [(s, b) for s, b, _ in cb.seen] == [(1, 2), (2, 4), (3, 6), (4, 7)]
    assert module.steps == [1, 2, 3, 4]
    for _, _, timing in cb.seen:
        assert timing.forward_backward_s > 0 and timing.optimizer_s > 0 and not timing.skipped
