"""Mistakes a user makes in the options of a run, said in one block before any work (a batch of 0, a validation
interval of 0, predict with no predict data)."""

from __future__ import annotations

import pytest

from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.data import DataModule
from trainkit.demo.markov import MarkovData
from trainkit.errors import ConfigurationError
from trainkit.hf import TextData
from trainkit.trainer import Trainer


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
