"""`trainkit fit --trainer.devices 2 --trainer.strategy ddp` end to end: bitwise resume, and checkpoints
that move between ddp at 2 ranks and single at 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainkit.checkpoint import CheckpointReader

DATA = ["--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "640", "--data.val_sequences", "64"]


def fit(root: Path, devices: int, max_steps: int, batch: int, extra: tuple[str, ...] = ()) -> str:
    """One CLI run; the LR schedule always spans 20 steps, so stopping at 10 is an interruption."""
    cmd = [
        sys.executable, "-m", "trainkit.cli", "fit", "--trainer.devices", str(devices),
        "--trainer.strategy", "ddp" if devices > 1 else "single", "--trainer.strategy.bucket_mb" if devices > 1 else "",
        "0.05" if devices > 1 else "", "--trainer.max_steps", str(max_steps), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1", "--trainer.timeout_s", "120",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps", "10",
        "--trainer.callbacks.save_top_k", "-1", *DATA, "--data.batch_size", str(batch), "--model.max_steps", "20",
        *extra,
    ]
    proc = subprocess.run([c for c in cmd if c], capture_output=True, text=True, timeout=600, cwd=root.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {k: reader.full(k) for k in reader.keys() if k.startswith(prefix)}


def train_losses(root: Path) -> dict[int, float]:
    out = {}
    for run in sorted((root / "runs" / "trainkit").iterdir()):
        events = EventAccumulator(str(run))
        events.Reload()
        out |= {e.step: e.value for e in events.Scalars("train_loss")}
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp_full")
    fit(root, devices=2, max_steps=20, batch=32)
    return root


def test_ddp_resume_from_cli_is_bitwise_identical(ddp_run, tmp_path):
    root = tmp_path / "split"
    root.mkdir()
    fit(root, devices=2, max_steps=10, batch=32)
    fit(root, devices=2, max_steps=20, batch=32, extra=("--ckpt_path", "last"))
    full = tensors(ddp_run / "checkpoints" / "epoch=1-step=20")
    resumed = tensors(root / "checkpoints" / "epoch=1-step=20")
    assert full.keys() == resumed.keys() and any(k.startswith("optim/") for k in full)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    full_losses, split_losses = train_losses(ddp_run), train_losses(root)
    assert [full_losses[s] for s in range(11, 21)] == [split_losses[s] for s in range(11, 21)]


def test_ddp_checkpoint_resumes_under_single_and_back(ddp_run, tmp_path):
    reference = tensors(ddp_run / "checkpoints" / "epoch=1-step=20", "model/")
    # ddp at 2 ranks (per-rank batch 32) -> single (batch 64): same global batches from step 10 on
    single_root = tmp_path / "single"
    single_root.mkdir()
    fit(single_root, devices=1, max_steps=20, batch=64,
        extra=("--ckpt_path", str(ddp_run / "checkpoints" / "epoch=0-step=10")))
    continued = tensors(single_root / "checkpoints" / "epoch=1-step=20", "model/")
    for key, want in reference.items():
        torch.testing.assert_close(continued[key], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    # single -> ddp at 2 ranks
    back_root = tmp_path / "back"
    back_root.mkdir()
    fit(back_root, devices=1, max_steps=10, batch=64)
    fit(back_root, devices=2, max_steps=20, batch=32, extra=("--ckpt_path", "last"))
    back = tensors(back_root / "checkpoints" / "epoch=1-step=20", "model/")
    for key, want in reference.items():
        torch.testing.assert_close(back[key], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
