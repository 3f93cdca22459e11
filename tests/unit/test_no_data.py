"""No training data is a configuration error before anything runs, whatever the cause (it used to run empty epochs
forever with max_steps set, writing a checkpoint for each)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.helpers import Recorder, Regression, quiet_trainer
from trainkit.errors import ConfigurationError


class Nothing(IterableDataset):
    def __iter__(self):
        return iter([])


def samples(n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 8), torch.randn(n, 1))


@pytest.mark.parametrize(("loader", "limit", "says"), [
    (DataLoader(samples(0), batch_size=4), None, "its dataset of 0 samples makes no batch of batch_size=4)"),
    (DataLoader(samples(3), batch_size=4, drop_last=True), None, "3 samples makes no batch of batch_size=4 with "
                                                                 "drop_last=True"),
    (DataLoader(samples(8), batch_size=4), 0, "limit_train_batches=0 leaves none of its 2 batches"),
    (DataLoader(samples(8), batch_size=4), 0.1, "limit_train_batches=0.1 leaves none of its 2 batches"),
    (DataLoader(Nothing(), batch_size=4), None, "yielded no batch in epoch 0"),
])
def test_no_training_batches_is_a_configuration_error(tmp_path, loader, limit, says):
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, max_steps=5, max_epochs=None, limit_train_batches=limit, callbacks=[recorder],
                            enable_checkpointing=True)
    with pytest.raises(ConfigurationError, match="No training data") as raised:
        trainer.fit(Regression(), loader)
    assert says in str(raised.value)
    assert recorder.losses == [] and trainer.current_epoch == 0
    assert not (tmp_path / "checkpoints").exists()
