"""`trainkit fit --trainer.strategy pipeline --trainer.devices 2` on the demo GPT, and checkpoints that
move between the pipeline and single-process training."""

from __future__ import annotations

import re

from tests.e2e.cli_runs import assert_close_tensors, fit, scalars, tensors


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
