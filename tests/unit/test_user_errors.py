"""Mistakes a user makes in the options of a run, said in one block before any work (a batch of 0, a validation
interval of 0, predict with no predict data), and a resume with other settings than the checkpoint's, which warns
with the differences."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.checkpoint import CheckpointReader, latest
from trainkit.data import DataModule
from trainkit.demo.gpt import DemoGPT
from trainkit.demo.markov import MarkovData
from trainkit.errors import ConfigurationError
from trainkit.hf import TextData
from trainkit.trainer import Trainer

CHANGED = "with a different configuration than it was saved with"


@pytest.mark.parametrize("make", [lambda: MarkovData(batch_size=0), lambda: TextData("corpus.txt", batch_size=0)])
def test_a_batch_size_of_0_is_refused_by_trainkit_s_data_modules(make):
    with pytest.raises(ConfigurationError, match=r"batch_size must be >= 1 \(the samples in one rank's batch\); got 0"):
        make()


@pytest.mark.parametrize("interval", [0, -2, 0.0, -0.5, 1.5, True])
def test_a_validation_interval_the_loop_cannot_keep_is_refused_when_the_trainer_is_built(interval):
    """0 divided the batch count at the first step (ZeroDivisionError); the others validated never or every batch."""
    with pytest.raises(ConfigurationError, match=rf"val_check_interval={interval!r}: use an int >= 1 .* a float in "
                                                 r"\(0, 1\] .* or None"):
        Trainer(val_check_interval=interval, logger=False)


@pytest.mark.parametrize("interval", [1, 7, 0.25, 1.0, None])
def test_the_validation_intervals_the_loop_keeps_are_accepted(interval):
    assert Trainer(val_check_interval=interval, logger=False).val_check_interval == interval


class NoPredictData(DataModule):
    def train_dataloader(self):
        return loader(regression_data(), 8)


@pytest.mark.parametrize(("datamodule", "source"), [(None, "the module Regression"),
                                                    (NoPredictData(), "the DataModule NoPredictData")])
def test_predict_without_predict_data_names_what_to_define(tmp_path, datamodule, source):
    with pytest.raises(ConfigurationError, match=rf"No predict data: {source} has no predict_dataloader\(\). Define "
                                                 r"predict_dataloader\(\) in the module or its DataModule .* or pass "
                                                 r"dataloaders to Trainer.predict\(\)"):
        quiet_trainer(tmp_path).predict(Regression(), datamodule=datamodule)


def _resume_warnings(trainer: Trainer, *args, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(*args, **kwargs)
    return [str(w.message) for w in caught if CHANGED in str(w.message)]


@pytest.mark.parametrize(("batch", "fate"), [(16, "at sample 48 of its order where the saved run had trained 24: "
                                                   "samples 24 to 47 are skipped"),
                                             (4, "at sample 12 of its order where the saved run had trained 24: "
                                                 "samples 12 to 23 are trained twice")])
def test_resuming_with_another_batch_size_seed_or_accumulation_warns_with_the_differences(tmp_path, batch, fate):
    """Saved after 3 of 8 batches of 8: the loop resumes 3 batches in, which covers other samples at another batch
    size. The checkpoint records the run's shape (``run``) to compare with."""
    fit = dict(max_epochs=None, enable_checkpointing=True)
    quiet_trainer(tmp_path, max_steps=3, **fit).fit(Regression(), loader(regression_data(), 8))
    saved = latest(tmp_path / "checkpoints")
    assert CheckpointReader(saved).meta["run"] == {"batch_size": 8, "dp_size": 1, "world_size": 1, "global_batch": 8,
                                                   "seed": 0, "accumulate_grad_batches": 1}
    same = _resume_warnings(quiet_trainer(tmp_path / "same", max_steps=4, **fit), Regression(),
                            loader(regression_data(), 8), ckpt_path=saved)
    assert same == []
    said = _resume_warnings(quiet_trainer(tmp_path / "changed", max_steps=5, seed=7, accumulate_grad_batches=2, **fit),
                            Regression(lr=0.1), loader(regression_data(), batch), ckpt_path=saved)
    assert said == [f"Resuming {saved} {CHANGED}: batch_size 8 → {batch} (epoch 0 resumes 3 batches in, {fate}); "
                    "sampler seed 0 → 7; accumulate_grad_batches 1 → 2; lr 0.01 → 0.1."]


def test_resuming_a_model_with_another_head_count_of_the_same_shapes_warns(tmp_path):
    """n_head 4 → 2 keeps every parameter's shape, so the weights load; the attention they compute is another."""
    def run(n_head: int, steps: int, ckpt_path=None) -> list[str]:
        module = DemoGPT(block_size=16, n_layer=1, n_head=n_head, n_embd=16, warmup_steps=1)
        data = MarkovData(seq_len=16, train_sequences=64, val_sequences=8, batch_size=8)
        trainer = quiet_trainer(tmp_path, max_steps=steps, max_epochs=None, enable_checkpointing=True)
        return _resume_warnings(trainer, module, datamodule=data, ckpt_path=ckpt_path)

    run(4, 2)
    saved = latest(tmp_path / "checkpoints")
    assert run(2, 3, saved) == [f"Resuming {saved} {CHANGED}: n_head 4 → 2."]


class Run:
    def __init__(self, **state):
        self.state = state

    def state_dict(self):
        return self.state


class Hyper:
    def __init__(self, **hparams):
        self.hparams = hparams


def test_the_same_samples_a_batch_over_other_ranks_is_no_change():
    """The sample order is global (split by striding): 8 per rank on 2 ranks continues exactly as 16 on 1; 8 on 1
    does not. A repr's object address, which differs from run to run, is no change either."""
    from trainkit.resume import config_changes

    loss = type("Loss", (), {})()
    meta = {"run": {"batch_size": 8, "dp_size": 2, "seed": 0, "accumulate_grad_batches": 1},
            "loop": {"epoch": 1, "batch_idx": 5, "epoch_done": False},
            "hyperparameters": {"loss": repr(loss).replace(hex(id(loss)), "0x7f00aa"), "dropout": 0.1}}
    module = Hyper(loss=loss, dropout=0.1)
    assert config_changes(meta, module, Run(batch_size=16, dp_size=1, seed=0, accumulate_grad_batches=1)) == []
    assert config_changes(meta, Hyper(loss=None), Run(batch_size=8, dp_size=1, seed=0, accumulate_grad_batches=1)) == [
        "batch_size 8 on 2 data-parallel rank(s) → 8 on 1 (epoch 1 resumes 5 batches in, at sample 40 of its order "
        "where the saved run had trained 80: samples 40 to 79 are trained twice)",
        "dropout 0.1 → (unset)", f"loss \"{meta['hyperparameters']['loss']}\" → null"]
