"""The non-finite guard in one process: what stops, what is skipped, and that nothing non-finite is checkpointed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.callbacks import Callback, ModelCheckpoint
from trainkit.checkpoint import CheckpointReader, latest, listing
from trainkit.finite import FiniteGuard, NonFiniteError
from trainkit_strategies.registry import get_strategy


class NanAt(Regression):
    """The loss of step ``bad`` (1-based, one or more) is ``value``; every other step is an ordinary regression."""

    def __init__(self, bad: tuple[int, ...] = (3,), value: float = math.nan, lr: float = 1e-2) -> None:
        super().__init__(lr=lr)
        self.bad, self.value, self.seen = bad, value, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self.trainer.global_step + 1 in self.bad:
            loss = loss * self.value
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(self.trainer.global_step + 1)


def test_stop_names_the_step_and_writes_nothing_from_it(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=8, callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)])
    with pytest.raises(NonFiniteError, match=r"The loss was nan at step 3\. .*epoch=0-step=2, is intact"):
        trainer.fit(NanAt(), loader(regression_data(), 4))
    assert [p.name for p in listing(tmp_path / "checkpoints")] == ["epoch=0-step=1", "epoch=0-step=2"]
    assert latest(tmp_path / "checkpoints").name == "epoch=0-step=2"


def test_the_default_top_1_never_prunes_a_finite_checkpoint_for_a_nonfinite_one(tmp_path):
    """Before the guard, save_top_k=1 pruned every finite checkpoint and left only the NaN one."""
    trainer = quiet_trainer(tmp_path, max_steps=8, callbacks=[ModelCheckpoint(every_n_train_steps=1)])
    with pytest.raises(NonFiniteError, match="at step 5"):
        trainer.fit(NanAt(bad=(5,)), loader(regression_data(), 4))
    kept = listing(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["epoch=0-step=4"] and latest(tmp_path / "checkpoints") == kept[0]
    reader = CheckpointReader(kept[0])
    assert all(torch.isfinite(reader.full(k)).all() for k in reader.keys())


def test_a_run_without_checkpoints_still_ends_with_the_error(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=6, log_every_n_steps=50)
    with pytest.raises(NonFiniteError, match=r"The loss was inf at step 2\..*No checkpoint was committed"):
        trainer.fit(NanAt(bad=(2,), value=math.inf), loader(regression_data(), 4))


def test_weights_made_nonfinite_by_the_optimizer_are_never_written(tmp_path):
    """A finite loss and gradient, an infinite learning rate: the checkpoint's own tensors are checked."""
    trainer = quiet_trainer(tmp_path, max_steps=3, callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)])
    with pytest.raises(NonFiniteError, match=r"holds non-finite values \(model/net\.0\.bias"):
        trainer.fit(NanAt(bad=(), lr=math.inf), loader(regression_data(), 4))
    assert listing(tmp_path / "checkpoints") == []


def test_skip_skips_the_step_and_trains_on(tmp_path):
    module = NanAt(bad=(3, 4))
    trainer = quiet_trainer(tmp_path, max_steps=8, on_nonfinite="skip",
                            callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(module, loader(regression_data(), 4))
    assert trainer.global_step == 8
    assert module.seen == [1, 2, 5, 6, 7, 8]  # steps 3 and 4 never reached the optimizer
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert len(listing(tmp_path / "checkpoints")) == 8


def test_skip_stops_after_too_many_in_a_row(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=20, on_nonfinite="skip", max_nonfinite_skips=3)
    with pytest.raises(NonFiniteError, match=r"at step 6, the 4th optimizer step in a row skipped"):
        trainer.fit(NanAt(bad=(3, 4, 5, 6, 7)), loader(regression_data(), 4))


def test_a_nonfinite_monitored_score_is_never_best(tmp_path):
    callback = ModelCheckpoint(monitor="train_loss", mode="min", every_n_train_steps=1, save_top_k=1)
    trainer = quiet_trainer(tmp_path, max_steps=4, callbacks=[callback])

    class Logs(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", -math.inf if self.trainer.global_step == 2 else loss.detach())
            return loss

    trainer.fit(Logs(), loader(regression_data(), 4))
    assert callback.best is not None and callback.best["step"] != 3  # -inf would have been the best "min" score
    assert callback.best_model_path.is_dir()


def test_the_guard_reads_its_rows_only_when_asked():
    guard = FiniteGuard(get_strategy("single"), "stop", 1, rows=4)
    for step, loss in enumerate([1.0, 2.0, math.inf, 3.0], start=1):
        guard.add_loss(torch.tensor(loss))
        guard.add_norm(torch.tensor(0.5))
        guard.end_step(step)  # the fourth fills the buffer and reads it
    assert guard.found == (3, "loss", math.inf)
    other = FiniteGuard(get_strategy("single"), "stop", 1, rows=8)
    other.last_step = 10
    other.add_loss(torch.tensor(1.0))
    other.add_norm(torch.tensor(math.nan))
    other.end_step(11)
    assert other.found is None  # not read yet: no host synchronisation
    step, metric, value = other.read()
    assert (step, metric) == (11, "gradient norm") and math.isnan(value)


class ValLog(Callback):
    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_validation_end(self, trainer, module) -> None:
        self.values[trainer.global_step] = float(trainer.callback_metrics["val_loss"])


def test_each_checkpoint_is_ranked_by_the_score_of_its_own_step(tmp_path):
    """Saving every 4 steps and validating every 8 used to rank steps 12 and 20 by the validation of steps 8 and 16
    (and so call step 20 the best rather than step 24)."""
    callback, logged = ModelCheckpoint(monitor="val_loss", every_n_train_steps=4, save_top_k=-1), ValLog()
    trainer = quiet_trainer(tmp_path, max_steps=24, max_epochs=None, val_check_interval=8, check_val_every_n_epoch=None,
                            callbacks=[callback, logged])
    with pytest.warns(UserWarning, match=r"checkpoint at step 12 has no val_loss of its own"):
        trainer.fit(Regression(lr=3e-2), loader(regression_data(), 4), loader(regression_data(16, seed=1), 8))
    scores = {s["step"]: s["score"] for s in callback.saved}
    assert scores == {4: None, 8: logged.values[8], 12: None, 16: logged.values[16], 20: None, 24: logged.values[24]}
    assert callback.best["step"] == min(logged.values, key=logged.values.get)


def test_fp16_overflow_skips_are_the_scalers_until_too_many_in_a_row(tmp_path):
    """One inf is the loss scaler's to skip (tests/e2e/test_loss_scaling.py); an inf at every step from step 3 used to
    halve the scale for ever while nothing trained."""
    trainer = quiet_trainer(tmp_path, precision="16-mixed", max_steps=20, max_nonfinite_skips=3)
    with pytest.raises(NonFiniteError, match=r"The loss scaler found non-finite gradients at step \d+, the 4th "
                                             r"optimizer step in a row skipped"):
        trainer.fit(NanAt(bad=tuple(range(3, 21)), value=math.inf), loader(regression_data(), 4))
    assert trainer.scaler.skipped_steps == 4
