"""What a Lightning user reaches for around a module: ``load_from_checkpoint``, the module-side loggers
(``self.logger``, ``self.loggers``, ``logger.experiment``) and ``ckpt_path="best"``, on one process. Several ranks
and the command line: tests/e2e/test_lightning_api.py."""

from __future__ import annotations

import csv
import json
import warnings
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

import trainkit as tk
from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.callbacks import ModelCheckpoint
from trainkit.checkpoint import CheckpointError
from trainkit.errors import ConfigurationError
from trainkit.loggers import CSVLogger, TensorBoardLogger
from trainkit.loggers.base import DummyExperiment


def _fit(tmp_path: Any, module: tk.TrainModule, **kwargs: Any) -> tk.Trainer:
    trainer = quiet_trainer(tmp_path, enable_checkpointing=True, max_steps=4, **kwargs)
    trainer.fit(module, loader(regression_data(32), 8))
    return trainer


def test_load_from_checkpoint_rebuilds_the_module_from_its_hyperparameters_with_the_trained_weights(tmp_path):
    trained = Regression(hidden=24, lr=0.05, dropout=0.1)
    _fit(tmp_path, trained)
    loaded = Regression.load_from_checkpoint(tmp_path / "checkpoints")  # a directory with `latest`
    assert type(loaded) is Regression and dict(loaded.hparams) == dict(trained.hparams)
    assert loaded.net[0].out_features == 24  # not the default 16: built from the saved hparams
    for (name, want), (_, got) in zip(trained.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(got, want.cpu()), name
    assert loaded.training  # as Lightning's: .eval() is the caller's
    x = torch.randn(5, 8)
    trained.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x), trained.cpu()(x), rtol=0, atol=0)


def test_keyword_arguments_override_the_saved_hyperparameters(tmp_path):
    _fit(tmp_path, Regression(hidden=24, lr=0.05))
    loaded = Regression.load_from_checkpoint(tmp_path / "checkpoints", lr=0.5, map_location="cpu")
    assert loaded.hparams.lr == 0.5 and loaded.hparams.hidden == 24


class Unsaved(tk.TrainModule):
    """No ``save_hyperparameters``: the checkpoint cannot say what ``width`` was."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Linear(8, width)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_without_saved_hyperparameters_names_save_hyperparameters_and_the_arguments(tmp_path):
    trained = Unsaved(width=3)
    _fit(tmp_path, trained)
    with pytest.raises(TypeError, match=r"Unsaved.__init__ needs width, which .* does not hold \(its meta.json records "
                                        r"none\)\. Call self.save_hyperparameters\(\) in Unsaved.__init__ .* or pass "
                                        r"them: Unsaved.load_from_checkpoint\('.*', width=\.\.\.\)"):
        Unsaved.load_from_checkpoint(tmp_path / "checkpoints")
    loaded = Unsaved.load_from_checkpoint(tmp_path / "checkpoints", width=3)
    assert torch.equal(loaded.net.weight, trained.net.weight.cpu())
    with pytest.raises(CheckpointError, match=r"(?s)saved from another model than Unsaved\(width=4\)\. The checkpoint "
                                              r"does not match the model .*net.weight: checkpoint shape \(3, 8\), "
                                              r"model shape \(4, 8\).*records no hyperparameters"):
        Unsaved.load_from_checkpoint(tmp_path / "checkpoints", width=4)


class WithEncoder(Regression):
    def __init__(self, encoder: nn.Module, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.save_hyperparameters()
        self.encoder = encoder


def test_a_hyperparameter_saved_as_its_repr_must_be_passed(tmp_path):
    _fit(tmp_path, WithEncoder(nn.Identity(), hidden=12))
    with pytest.raises(TypeError, match=r"hyperparameters 'encoder' were saved as text .* Pass them: "
                                        r"WithEncoder.load_from_checkpoint\('.*', encoder=\.\.\.\)"):
        WithEncoder.load_from_checkpoint(tmp_path / "checkpoints")
    assert WithEncoder.load_from_checkpoint(tmp_path / "checkpoints", encoder=nn.Identity()).hparams.hidden == 12


def test_strict_false_loads_what_both_hold_and_warns_about_the_rest(tmp_path):
    trained = Regression(hidden=24)
    _fit(tmp_path, trained)

    class Wider(Regression):
        def configure_model(self) -> None:
            self.extra = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"extra\.weight: missing from the checkpoint"):
        Wider.load_from_checkpoint(tmp_path / "checkpoints")
    with pytest.warns(UserWarning, match=r"in the model state dict but not in the checkpoint: \['extra.bias', "
                                         r"'extra.weight'\]"):
        loaded = Wider.load_from_checkpoint(tmp_path / "checkpoints", strict=False)
    assert torch.equal(loaded.net[3].weight, trained.net[3].weight.cpu())


def test_a_path_that_is_no_trainkit_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError, match=r"is not a trainkit checkpoint: .*meta.json does not exist"):
        Regression.load_from_checkpoint(tmp_path)


class Drawing(Regression):
    """Writes a histogram and an image through ``self.logger.experiment`` each training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.loggers[0] is self.logger
        self.logger.experiment.add_histogram("inputs", batch[0], self.global_step)
        self.logger.experiment.add_image("picture", torch.full((3, 4, 4), 0.5), self.global_step)
        return super().training_step(batch, batch_idx)


def test_the_module_draws_through_self_logger_experiment_into_the_run_s_event_files(tmp_path):
    trainer = quiet_trainer(tmp_path, logger=TensorBoardLogger(tmp_path / "runs"), max_steps=3)
    trainer.fit(Drawing(), loader(regression_data(32), 8))
    events = EventAccumulator(str(tmp_path / "runs" / "trainkit" / "version_0"), size_guidance={"histograms": 0,
                                                                                                 "images": 0})
    events.Reload()
    assert [e.step for e in events.Histograms("inputs")] == [0, 1, 2]
    assert [e.step for e in events.Images("picture")] == [0, 1, 2]


def test_without_a_trainer_or_a_logger_the_module_s_logger_is_none():
    module = Regression()
    assert module.logger is None and module.loggers == []
    trainer = tk.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.validate(module, DataLoader(regression_data(8), batch_size=8), verbose=False)
    assert module.logger is None and module.loggers == []


def test_the_csv_logger_s_experiment_writes_rows_and_hyperparameters(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.experiment.log_metrics({"seen": 3.0})
    logger.experiment.log_metrics({"seen": 5.0}, step=7)
    logger.experiment.log_hparams({"lr": 0.1})
    logger.experiment.save()
    with open(logger.experiment.metrics_file_path) as f:
        assert list(csv.DictReader(f)) == [{"step": "0", "seen": "3.0"}, {"step": "7", "seen": "5.0"}]
    assert json.loads((logger.log_dir / "hparams.json").read_text()) == {"lr": 0.1}


def test_on_other_ranks_experiment_is_a_dummy_that_accepts_every_call(tmp_path, monkeypatch):
    from lightning_utilities.core.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    for logger in (TensorBoardLogger(tmp_path), CSVLogger(tmp_path)):
        experiment = logger.experiment
        assert isinstance(experiment, DummyExperiment)
        experiment.add_histogram("w", torch.zeros(3), 0)
        experiment[0].add_image("x", torch.zeros(3, 2, 2))
    assert not any(tmp_path.iterdir())  # nothing written on a rank other than 0


class Scored(Regression):
    """Validation logs a val_loss set by the epoch (best at epoch 1 of 3); each epoch's end keeps its weights."""

    SCORES = (3.0, 1.0, 2.0)

    def __init__(self) -> None:
        super().__init__()
        self.at_epoch: dict[int, dict[str, torch.Tensor]] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.SCORES[min(self.current_epoch, 2)])  # epoch 3 after fit

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_train_epoch_end(self) -> None:
        self.at_epoch[self.current_epoch] = {k: v.detach().clone() for k, v in self.state_dict().items()}


def _fit_scored(tmp_path: Any, monitor: str | None = "val_loss") -> tuple[Scored, tk.Trainer]:
    module = Scored()
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[ModelCheckpoint(monitor=monitor)])
    trainer.fit(module, loader(regression_data(16), 8), loader(regression_data(8), 8))
    return module, trainer


def test_ckpt_path_best_loads_the_best_checkpoint_by_the_monitor(tmp_path, capsys):
    module, trainer = _fit_scored(tmp_path)
    best = tmp_path / "checkpoints" / "epoch=1-step=4"
    assert trainer.checkpoint_callback.best_model_path == best
    for stage in (trainer.validate, trainer.test, trainer.predict):
        stage(module, loader(regression_data(8), 8), ckpt_path="best")
        assert f"Restored {best}." in capsys.readouterr().out
        for name, want in module.at_epoch[1].items():
            assert torch.equal(module.state_dict()[name], want), name
    assert any(not torch.equal(module.at_epoch[2][k], v) for k, v in module.at_epoch[1].items())  # best is not last


def test_ckpt_path_best_in_a_new_trainer_reads_the_best_from_the_run_s_newest_checkpoint(tmp_path, capsys):
    _fit_scored(tmp_path)
    fresh = quiet_trainer(tmp_path, enable_checkpointing=True)  # a default ModelCheckpoint, which has ranked nothing
    fresh.validate(Scored(), loader(regression_data(8), 8), ckpt_path="best")
    assert f"Restored {tmp_path / 'checkpoints' / 'epoch=1-step=4'}." in capsys.readouterr().out


def test_ckpt_path_best_without_a_monitor_is_the_newest_and_with_no_checkpoint_names_the_fix(tmp_path, capsys):
    """Lightning's ModelCheckpoint without a monitor keeps the newest as its ``best_model_path``: so does this one, in
    the fitting process and, from the newest checkpoint's record, in a new Trainer."""
    module, trainer = _fit_scored(tmp_path, monitor=None)
    newest = tmp_path / "checkpoints" / "epoch=2-step=6"
    assert trainer.checkpoint_callback.best_model_path == newest
    for fresh in (trainer, quiet_trainer(tmp_path, enable_checkpointing=True)):
        fresh.validate(module, loader(regression_data(8), 8), ckpt_path="best")
        assert f"Restored {newest}." in capsys.readouterr().out
    message = (r'ckpt_path="best" needs checkpoints written by a ModelCheckpoint, and .*elsewhere.checkpoints holds '
               r"none\. Fit first \(the default ModelCheckpoint keeps the newest; ModelCheckpoint\(monitor="
               r'"val_loss"\) the best by val_loss; on the command line --trainer.callbacks\+=ModelCheckpoint '
               r'--trainer.callbacks.monitor val_loss\), or pass ckpt_path="last" or a checkpoint directory\.')
    with pytest.raises(ConfigurationError, match=message):  # nothing fitted at all
        quiet_trainer(tmp_path / "elsewhere").validate(module, loader(regression_data(8), 8), ckpt_path="best")


def test_ckpt_path_best_when_the_monitored_metric_was_never_logged_names_it(tmp_path):
    with pytest.warns(UserWarning, match="has not been logged yet"):
        module, trainer = _fit_scored(tmp_path, monitor="val_acc")
    with pytest.raises(ConfigurationError, match=r"ckpt_path=\"best\": the ModelCheckpoint monitoring 'val_acc' ranked "
                                                 r"no checkpoint in .*checkpoints: the metric was never logged at a "
                                                 r"save\. Log it where checkpoints are saved"):
        trainer.validate(module, loader(regression_data(8), 8), ckpt_path="best")


def test_validate_test_and_predict_without_a_model_run_the_module_of_the_last_fit(tmp_path, capsys):
    """Lightning's ``trainer.test(ckpt_path="best")`` after ``trainer.fit(model)``: no model means the fitted one; with
    no ``ckpt_path`` either, its best checkpoint, with Lightning's warning. A Trainer that has run nothing names the
    fix."""
    module, trainer = _fit_scored(tmp_path)
    assert trainer.lightning_module is module
    best, data = tmp_path / "checkpoints" / "epoch=1-step=4", loader(regression_data(8), 8)
    x = regression_data(8).tensors[0]
    for stage in (trainer.validate, trainer.test, trainer.predict):
        module.load_state_dict(module.at_epoch[2])  # the last epoch's weights, which are not the best
        with pytest.warns(UserWarning, match=rf"`.{stage.__name__}\(ckpt_path=None\)` was called without a model: the "
                                             "best checkpoint of the previous fit is used"):
            out = stage(dataloaders=data)
        assert f"Restored {best}." in capsys.readouterr().out
        for name, want in module.at_epoch[1].items():
            assert torch.equal(module.state_dict()[name], want), name
    with torch.no_grad():
        torch.testing.assert_close(out[0], module(x), rtol=0, atol=0)
    module.load_state_dict(module.at_epoch[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ckpt_path given: no warning
        trainer.test(dataloaders=data, ckpt_path="last")
    assert f"Restored {tmp_path / 'checkpoints' / 'epoch=2-step=6'}." in capsys.readouterr().out
    with pytest.raises(TypeError, match=r"Trainer.test\(\) was given no model and this Trainer has run none: pass the "
                                        r"module, or fit it first .*: trainer.test\(model, \.\.\.\)\."):
        quiet_trainer(tmp_path / "fresh").test(dataloaders=data)
    with pytest.raises(TypeError, match=r"Trainer.fit\(\) was given no model and this Trainer has run none: pass the "
                                        r"module: trainer.fit\(model, \.\.\.\)\."):
        quiet_trainer(tmp_path / "fresh").fit(None)
