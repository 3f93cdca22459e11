"""`trainkit fit --trainer.strategy pipeline --trainer.devices 2` on the demo GPT, and checkpoints that
move between the pipeline and single-process training."""

from __future__ import annotations

import re

import pytest

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


def test_pipeline_runs_the_demo_and_resumes_under_single_and_back(tmp_path):
    full = tmp_path / "pipeline"
    out = fit(full, "pipeline", devices=2, max_steps=20, batch=32, extra=("--trainer.strategy.microbatches", "4"))
    assert re.search(r"validation loss [\d.]+ nats \| Markov entropy floor H", out)
    assert sorted(scalars(full, "val_loss")) == [10, 20]
    assert len(scalars(full, "train_loss")) == 20
    want = tensors(full / "checkpoints" / "epoch=0-step=20")
    # the pipeline's checkpoint resumes in one process (same global batch: one pipeline reads 32 samples)
    single = tmp_path / "single"
    fit(single, "single", devices=1, max_steps=20, batch=32,
        extra=("--ckpt_path", str(full / "checkpoints" / "epoch=0-step=10")))
    assert_close_tensors(tensors(single / "checkpoints" / "epoch=0-step=20"), want)
    # and a single-process checkpoint resumes as a pipeline
    back = tmp_path / "back"
    fit(back, "single", devices=1, max_steps=10, batch=32)
    fit(back, "pipeline", devices=2, max_steps=20, batch=32, extra=("--ckpt_path", "last"))
    assert_close_tensors(tensors(back / "checkpoints" / "epoch=0-step=20"), want)


def test_the_new_schedules_from_the_cli_match_1f1b_and_resume_across_schedules(tmp_path):
    """Interleaved 1F1B (2 chunks per rank) and zero-bubble reach 1F1B's checkpoints; a zero-bubble checkpoint
    resumes under interleaved 1F1B."""
    args = ("--trainer.strategy.microbatches", "4")
    fit(tmp_path / "1f1b", "pipeline", devices=2, max_steps=20, batch=16, extra=args)
    want = {step: tensors(tmp_path / "1f1b" / "checkpoints" / f"epoch=0-step={step}") for step in (10, 20)}
    interleaved = (*args, "--trainer.strategy.schedule", "interleaved_1f1b", "--trainer.strategy.virtual_stages", "2")
    fit(tmp_path / "interleaved", "pipeline", devices=2, max_steps=10, batch=16, extra=interleaved)
    assert_close_tensors(tensors(tmp_path / "interleaved" / "checkpoints" / "epoch=0-step=10"), want[10])
    zb = tmp_path / "zb"
    fit(zb, "pipeline", devices=2, max_steps=10, batch=16, extra=(*args, "--trainer.strategy.schedule", "zero_bubble"))
    assert_close_tensors(tensors(zb / "checkpoints" / "epoch=0-step=10"), want[10])
    fit(zb, "pipeline", devices=2, max_steps=20, batch=16, extra=(*interleaved, "--ckpt_path", "last"))
    assert_close_tensors(tensors(zb / "checkpoints" / "epoch=0-step=20"), want[20])
