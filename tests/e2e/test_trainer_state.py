"""Trainer properties a Lightning user reaches for inside a module: the step budget for a schedule,
logged metrics, the sanity-check flag."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import trainkit as tk
from tests.e2e.cli_runs import ROOT
from tests.helpers import Regression, regression_data
from trainkit.callbacks import Callback
from trainkit_strategies import get_strategy


class OneCycle(Regression):
    """Sizes OneCycleLR from ``trainer.estimated_stepping_batches``; the scheduler raises if stepped past it."""

    def __init__(self) -> None:
        super().__init__()
        self.total: float | None = None
        self.sanity_flags: list[bool] = []

    def configure_optimizers(self) -> Any:
        self.total = self.trainer.estimated_stepping_batches
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=int(self.total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.sanity_flags.append(self.trainer.sanity_checking)
        super().validation_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"max_epochs": 3, "accumulate_grad_batches": 2}, 12),  # 50 samples / 8 = 7 batches -> 4 steps an epoch
        ({"max_epochs": 3, "max_steps": 5}, 5),
        ({"max_epochs": 2, "limit_train_batches": 3}, 6),
    ],
)
def test_estimated_stepping_batches_sizes_a_one_cycle_schedule(tmp_path, options, expected):
    module = OneCycle()
    trainer = tk.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path, **options)
    trainer.fit(module, DataLoader(regression_data(50), batch_size=8, shuffle=True))
    assert module.total == expected
    assert trainer.global_step == expected  # OneCycleLR would raise on a step past total_steps


def test_logged_metrics_and_sanity_flag(tmp_path):
    module = OneCycle()
    trainer = tk.Trainer(max_epochs=1, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         num_sanity_val_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(regression_data(32), batch_size=8), DataLoader(regression_data(16), batch_size=8))
    assert module.sanity_flags == [True, False, False] and not trainer.sanity_checking
    logged = trainer.logged_metrics
    assert {"train_loss", "val_loss"} <= logged.keys()
    assert float(logged["val_loss"]) == pytest.approx(float(trainer.callback_metrics["val_loss"]))
    assert trainer.lr_scheduler is not None and trainer.optimizers == [trainer.optimizer]
    assert trainer.log_dir is not None and trainer.log_dir.is_dir()


class Gathering(Regression):
    """Gathers every rank's batch losses at the end of each validation epoch, as Lightning users do."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.gathered: Any = None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.losses.append(torch.nn.functional.mse_loss(self(x), y).detach())

    def on_validation_epoch_end(self) -> None:
        self.gathered = self.all_gather({"loss": torch.stack(self.losses)})
        self.losses.clear()


def test_all_gather_on_one_process_returns_the_data(tmp_path):
    module = Gathering()
    trainer = tk.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.validate(module, DataLoader(regression_data(24), batch_size=8), verbose=False)
    assert module.gathered["loss"].shape == (3,)
    assert module.optimizers is not None and module.local_rank == 0


GATHER_SCRIPT = '''
import torch
from torch.utils.data import DataLoader
import trainkit as tk
from tests.e2e.test_trainer_state import Gathering
from tests.helpers import accelerator_for, regression_data

if __name__ == "__main__":
    module = Gathering()
    trainer = tk.Trainer(devices=2, accelerator=accelerator_for(2), strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, timeout_s=120)
    trainer.validate(module, DataLoader(regression_data(48), batch_size=8), verbose=False)
    rows = module.gathered["loss"]
    if trainer.is_global_zero:
        print("SHAPE", tuple(rows.shape), "DISTINCT", bool((rows[0] != rows[1]).any()), flush=True)
'''


@pytest.mark.slow
def test_all_gather_stacks_every_rank(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(GATHER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SHAPE (2, 3) DISTINCT True" in proc.stdout


class _HooksDuringFit(Callback):
    """Whether every trainable parameter carried a gradient hook at each optimizer step."""

    def __init__(self) -> None:
        self.hooked: list[bool] = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.hooked.append(all(p._post_accumulate_grad_hooks for p in module.parameters()))


def _gradient_hooks(module: torch.nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_teardown_runs_after_every_run_and_the_next_backward_rearms(tmp_path, name):
    """A run's end takes the strategy's gradient hooks off the module (a backward by hand afterwards reduces
    nothing); the next fit puts them back at its first backward, and validation between the two works."""
    module, probe = Regression(), _HooksDuringFit()
    data = DataLoader(regression_data(32), batch_size=8)
    trainer = tk.Trainer(strategy=name, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[probe])
    trainer.fit(module, data)
    assert probe.hooked == [True, True]
    assert _gradient_hooks(module) == 0
    trainer.validate(module, DataLoader(regression_data(8), batch_size=8), verbose=False)
    trainer.max_steps = 4
    trainer.fit(module, data)
    assert probe.hooked == [True] * 4 and _gradient_hooks(module) == 0


def test_teardown_stops_zero_offloads_host_threads(tmp_path):
    import threading

    trainer = tk.Trainer(strategy=get_strategy("zero_offload", overlap_step=True, delayed_update=True),
                         max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path)
    trainer.fit(Regression(), DataLoader(regression_data(32), batch_size=8))
    assert [t.name for t in threading.enumerate() if t.name.startswith("trainkit-offload")] == []
