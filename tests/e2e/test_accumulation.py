"""Gradient accumulation equals one step on the whole window.

Each case is held to a hand-written PyTorch loop that steps AdamW once per window on the
concatenated window, normalised by what the window actually held.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers import (
    DEVICE,
    MaskedRegression,
    MaskedSequences,
    Regression,
    adamw_groups,
    loader,
    masked_loss,
    quiet_trainer,
    regression_data,
)


def _windows(dataset, batch: int, k: int) -> list[list]:
    batches = list(DataLoader(dataset, batch_size=batch))
    return [batches[i : i + k] for i in range(0, len(batches), k)]


def _reference(net, dataset, batch: int, k: int, epochs: int, loss_fn, clip: float | None = None):
    """The hand-written loop, on the device the trainer ran on."""
    net = copy.deepcopy(net).to(DEVICE)
    opt = adamw_groups(net)
    for _ in range(epochs):
        for window in _windows(dataset, batch, k):
            cat = [torch.cat(parts).to(DEVICE) for parts in zip(*window, strict=True)]
            opt.zero_grad()
            loss_fn(net, cat).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
    return net


def _mse(net, batch):
    x, y = batch
    return F.mse_loss(net(x), y)


def _masked(net, batch):
    return masked_loss(net, batch)[0]


def _assert_params_equal(module, reference, atol: float = 1e-6) -> None:
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("n_samples", "k"), [(64, 4), (40, 4), (10, 3)],
                         ids=["full-windows", "short-final-window", "uneven-last-batch"])
def test_accumulate_k_equals_one_step_on_the_window(tmp_path, n_samples, k):
    """A window is one step on all its samples: with 10 samples in batches of 4 and k = 3, one window of 4, 4 and 2
    samples steps like one batch of those 10 (each micro-batch's mean loss weighs by its samples)."""
    data = regression_data(n_samples)
    module = Regression()
    initial = copy.deepcopy(module.net)
    trainer = quiet_trainer(tmp_path, accumulate_grad_batches=k, max_epochs=2, gradient_clip_val=0.5)
    trainer.fit(module, loader(data, 4))
    reference = _reference(initial, data, 4, k, epochs=2, loss_fn=_mse, clip=0.5)
    expected_steps = 2 * -(-n_samples // (4 * k))
    assert trainer.global_step == expected_steps
    _assert_params_equal(module.net, reference)


def test_an_uneven_window_weighs_micro_batches_by_their_samples(tmp_path):
    """Guards the case above: weighing the 4, 4 and 2-sample micro-batches' means equally would not match."""
    data = regression_data(10)
    module = Regression()
    initial = copy.deepcopy(module.net)
    quiet_trainer(tmp_path, accumulate_grad_batches=3, max_epochs=1).fit(module, loader(data, 4))

    def mean_of_means(net, batch):
        x, y = batch
        return torch.stack([_mse(net, (x[i : i + 4], y[i : i + 4])) for i in range(0, 10, 4)]).mean()

    wrong = _reference(initial, data, 4, 3, epochs=1, loss_fn=mean_of_means)
    diff = max((p - q).abs().max().item() for p, q in zip(module.net.parameters(), wrong.parameters(), strict=True))
    assert diff > 1e-4


def test_accumulation_matches_large_batch_run(tmp_path):
    data = regression_data(64)
    small, big = Regression(), Regression()
    quiet_trainer(tmp_path, accumulate_grad_batches=4, max_epochs=3).fit(small, loader(data, 4))
    quiet_trainer(tmp_path, accumulate_grad_batches=1, max_epochs=3).fit(big, loader(data, 16))
    _assert_params_equal(small.net, big.net)


@pytest.mark.parametrize("n_samples", [48, 44], ids=["full-windows", "short-final-window"])
def test_num_items_weights_micro_batches_by_their_count(tmp_path, n_samples):
    data = MaskedSequences(n_samples)
    counts = [int(b[2].sum()) for b in DataLoader(data, batch_size=4)]
    assert len(set(counts)) > 2, "the data must have variable item counts for this test to mean anything"
    module = MaskedRegression()
    initial = copy.deepcopy(module.net)
    quiet_trainer(tmp_path, accumulate_grad_batches=4, max_epochs=2).fit(module, loader(data, 4))
    reference = _reference(initial, data, 4, 4, epochs=2, loss_fn=_masked)
    _assert_params_equal(module.net, reference)


def test_plain_mean_of_micro_batches_differs_from_item_weighting(tmp_path):
    """Guards the test above: averaging micro-batch means (ignoring num_items) would not match."""
    data = MaskedSequences(48)
    module = MaskedRegression()
    initial = copy.deepcopy(module.net)
    quiet_trainer(tmp_path, accumulate_grad_batches=4, max_epochs=2).fit(module, loader(data, 4))

    def mean_of_means(net, batch):
        x, y, mask = batch
        parts = [_masked(net, (x[i : i + 4], y[i : i + 4], mask[i : i + 4])) for i in range(0, 16, 4)]
        return torch.stack(parts).mean()

    wrong = _reference(initial, data, 4, 4, epochs=2, loss_fn=mean_of_means)
    diff = max((p - q).abs().max().item() for p, q in zip(module.net.parameters(), wrong.parameters(), strict=True))
    assert diff > 1e-4
