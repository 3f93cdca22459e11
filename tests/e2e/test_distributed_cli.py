"""`trainkit fit --trainer.devices 2 --trainer.strategy ddp` end to end: bitwise resume, and checkpoints
that move between ddp at 2 ranks and single at 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp_full")
    fit(root, "ddp", devices=2, max_steps=20, batch=32)
    return root


def test_ddp_resume_from_cli_is_bitwise_identical(ddp_run, tmp_path):
    fit(tmp_path, "ddp", devices=2, max_steps=10, batch=32)
    fit(tmp_path, "ddp", devices=2, max_steps=20, batch=32, extra=("--ckpt_path", "last"))
    full = tensors(ddp_run / "checkpoints" / "epoch=1-step=20")
    resumed = tensors(tmp_path / "checkpoints" / "epoch=1-step=20")
    assert full.keys() == resumed.keys() and any(k.startswith("optim/") for k in full)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    full_losses, split_losses = scalars(ddp_run, "train_loss"), scalars(tmp_path, "train_loss")
    assert [full_losses[s] for s in range(11, 21)] == [split_losses[s] for s in range(11, 21)]


def test_ddp_checkpoint_resumes_under_single_and_back(ddp_run, tmp_path):
    reference = tensors(ddp_run / "checkpoints" / "epoch=1-step=20", "model/")
    # ddp at 2 ranks (per-rank batch 32) -> single (batch 64): same global batches from step 10 on
    fit(tmp_path / "single", "single", devices=1, max_steps=20, batch=64,
        extra=("--ckpt_path", str(ddp_run / "checkpoints" / "epoch=0-step=10")))
    assert_close_tensors(tensors(tmp_path / "single" / "checkpoints" / "epoch=1-step=20", "model/"), reference)
    # single -> ddp at 2 ranks
    fit(tmp_path / "back", "single", devices=1, max_steps=10, batch=64)
    fit(tmp_path / "back", "ddp", devices=2, max_steps=20, batch=32, extra=("--ckpt_path", "last"))
    assert_close_tensors(tensors(tmp_path / "back" / "checkpoints" / "epoch=1-step=20", "model/"), reference)
