"""A zero2 checkpoint at 2 ranks resumes under zero1 at 3 ranks and under single at 1, optimizer state
included, and continues to the same parameters and validation loss as the uninterrupted run."""

from __future__ import annotations

import pytest

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

GLOBAL_BATCH, SEQUENCES = 48, 480  # 10 steps per epoch at every world size


def test_zero2_checkpoint_resumes_under_zero1_at_3_ranks_and_single(tmp_path):
    full = tmp_path / "zero2"
    fit(full, "zero2", devices=2, max_steps=20, batch=GLOBAL_BATCH // 2, sequences=SEQUENCES)
    step10, step20 = full / "checkpoints" / "epoch=0-step=10", full / "checkpoints" / "epoch=1-step=20"
    saved = tensors(step10)
    assert any(k.endswith("/exp_avg") for k in saved)
    want = tensors(step20)
    for name, devices, strategy in (("zero1_w3", 3, "zero1"), ("single", 1, "single")):
        root = tmp_path / name
        fit(root, strategy, devices=devices, max_steps=20, batch=GLOBAL_BATCH // devices, sequences=SEQUENCES,
            extra=("--ckpt_path", str(step10)))
        got = tensors(root / "checkpoints" / "epoch=1-step=20")
        assert_close_tensors(got, want)  # parameters and every optimizer state tensor
        assert abs(scalars(root, "val_loss")[20] - scalars(full, "val_loss")[20]) < 1e-5
