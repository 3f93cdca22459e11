"""``--trainer.strategy parallel`` from the command line: tp=2 x dp_shard=2 at 4 ranks checkpoints mid-epoch, and
the checkpoint resumes under fsdp at 4 ranks, under one process, and under tp=4, each ending where the uninterrupted
run does (parameters, optimizer state and validation loss, fp32 within 1e-5)."""

from __future__ import annotations

import pytest

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

GLOBAL_BATCH, SEQUENCES = 48, 720  # 15 steps per epoch: the checkpoint at step 10 is mid-epoch
LAYOUT = ("--trainer.strategy.tp", "2", "--trainer.strategy.dp_shard", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2xdps2")
    fit(root, "parallel", devices=4, max_steps=20, batch=GLOBAL_BATCH // 2, sequences=SEQUENCES, extra=LAYOUT)
    return root


@pytest.mark.parametrize("target", ["fsdp@4", "single", "tp4@4"])
def test_a_tp2_dp_shard2_checkpoint_resumes_mid_epoch_under_another_layout(uninterrupted, tmp_path, target):
    strategy, devices, extra, batch = {
        "fsdp@4": ("fsdp", 4, (), GLOBAL_BATCH // 4),
        "single": ("single", 1, (), GLOBAL_BATCH),
        "tp4@4": ("parallel", 4, ("--trainer.strategy.tp", "4"), GLOBAL_BATCH),
    }[target]
    fit(tmp_path, strategy, devices=devices, max_steps=20, batch=batch, sequences=SEQUENCES,
        extra=(*extra, "--ckpt_path", str(uninterrupted / "checkpoints" / "epoch=0-step=10")))
    assert_close_tensors(tensors(tmp_path / "checkpoints" / "epoch=1-step=20"),
                         tensors(uninterrupted / "checkpoints" / "epoch=1-step=20"))
    assert abs(scalars(tmp_path, "val_loss")[20] - scalars(uninterrupted, "val_loss")[20]) < 1e-5


@pytest.fixture(scope="module")
def uninterrupted_cp(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp2")
    fit(root, "parallel", devices=2, max_steps=20, batch=GLOBAL_BATCH, sequences=SEQUENCES,
        extra=("--trainer.strategy.cp", "2"))
    return root


def test_a_cp2_checkpoint_resumes_mid_epoch_under_one_process(uninterrupted_cp, tmp_path):
    """Context parallelism from the CLI: the two ranks hold halves of every sequence; the checkpoint is a whole
    model's, and one process resuming it ends where the uninterrupted run does, validation loss included (the
    demo weights its validation loss by the positions each rank holds, so it is the whole sequence's)."""
    fit(tmp_path, "single", devices=1, max_steps=20, batch=GLOBAL_BATCH, sequences=SEQUENCES,
        extra=("--ckpt_path", str(uninterrupted_cp / "checkpoints" / "epoch=0-step=10")))
    assert_close_tensors(tensors(tmp_path / "checkpoints" / "epoch=1-step=20"),
                         tensors(uninterrupted_cp / "checkpoints" / "epoch=1-step=20"))
    assert abs(scalars(tmp_path, "val_loss")[20] - scalars(uninterrupted_cp, "val_loss")[20]) < 1e-5
