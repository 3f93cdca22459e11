"""fsdp at 2 ranks -> zero3 at 3 ranks -> ddp at 1 rank: each resumes the previous one's checkpoint and
the chain ends where an uninterrupted fsdp run does."""

from __future__ import annotations

import pytest

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

GLOBAL_BATCH, SEQUENCES = 48, 480  # 10 steps per epoch at every world size


def test_fsdp_to_zero3_to_ddp_continues_the_same_run(tmp_path):
    full = tmp_path / "fsdp"
    fit(full, "fsdp", devices=2, max_steps=30, batch=GLOBAL_BATCH // 2, sequences=SEQUENCES, schedule=30)
    zero3 = tmp_path / "zero3"
    fit(zero3, "zero3", devices=3, max_steps=20, batch=GLOBAL_BATCH // 3, sequences=SEQUENCES, schedule=30,
        extra=("--ckpt_path", str(full / "checkpoints" / "epoch=0-step=10")))
    assert_close_tensors(tensors(zero3 / "checkpoints" / "epoch=1-step=20"),
                         tensors(full / "checkpoints" / "epoch=1-step=20"))
    ddp = tmp_path / "ddp"
    fit(ddp, "ddp", devices=1, max_steps=30, batch=GLOBAL_BATCH, sequences=SEQUENCES, schedule=30,
        extra=("--ckpt_path", str(zero3 / "checkpoints" / "epoch=1-step=20")))
    assert_close_tensors(tensors(ddp / "checkpoints" / "epoch=2-step=30"),
                         tensors(full / "checkpoints" / "epoch=2-step=30"))
    for step in (20, 30):
        chain = scalars(zero3 if step == 20 else ddp, "val_loss")[step]
        assert abs(chain - scalars(full, "val_loss")[step]) < 1e-5
