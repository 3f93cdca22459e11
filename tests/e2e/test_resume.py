"""Stopping mid-epoch and resuming continues bitwise-identically (same seed, world size and strategy)."""

from __future__ import annotations

import pytest
import torch

import trainkit as tk
import trainkit.loops
from tests.helpers import Recorder, Regression, loader, regression_data


def _fit(tmp_path, max_steps: int, precision: str, ckpt_path: str | None = None):
    module = Regression(dropout=0.2, scheduler=True)
    recorder = Recorder()
    trainer = tk.Trainer(
        max_steps=max_steps, precision=precision, seed=7, logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path, val_check_interval=10, num_sanity_val_steps=1, callbacks=[recorder],
    )
    data = regression_data(100)
    trainer.fit(module, loader(data, 4, shuffle=True), loader(regression_data(16, seed=1), 8),
                ckpt_path=ckpt_path)
    return module, recorder, trainer


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_resume_mid_epoch_is_bitwise_identical(tmp_path, precision):
    full, full_rec, full_trainer = _fit(tmp_path / "full", 60, precision)
    _, first_rec, first_trainer = _fit(tmp_path / "split", 37, precision)
    assert first_trainer.global_step == 37 and first_trainer.current_epoch == 1  # 25 batches/epoch: mid-epoch
    resumed, rest_rec, rest_trainer = _fit(tmp_path / "split", 60, precision, ckpt_path="last")

    assert first_rec.losses == full_rec.losses[:37]
    continued = [loss for step, loss in full_rec.losses if step > 37]
    assert len(rest_rec.losses) == 23
    assert [loss for _, loss in rest_rec.losses] == continued
    for (name, p), q in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert rest_trainer.optimizer.param_groups[0]["lr"] == full_trainer.optimizer.param_groups[0]["lr"]
    if precision == "16-mixed":
        assert rest_trainer.scaler.state_dict() == full_trainer.scaler.state_dict()


def test_resume_changes_course_without_rng_restore(tmp_path, monkeypatch):
    """Guards the test above: with dropout, skipping the RNG restore breaks bitwise continuation."""
    _, full_rec, _ = _fit(tmp_path / "full", 45, "32")
    _fit(tmp_path / "split", 37, "32")
    monkeypatch.setattr(trainkit.loops, "set_rng_state", lambda state: None)
    _, rest_rec, _ = _fit(tmp_path / "split", 45, "32", ckpt_path="last")
    continued = [loss for step, loss in full_rec.losses if step > 37]
    assert [loss for _, loss in rest_rec.losses] != continued
