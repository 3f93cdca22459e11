"""Running `trainkit fit` in a subprocess the way a user does, and reading what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import accelerator_for
from trainkit.checkpoint import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]
# Runs compared with each other use up to 3 ranks: all of them run where 3 ranks can (CUDA only with 3 GPUs).
ACCELERATOR = accelerator_for(3)


def fit(root: Path, strategy: str, devices: int, max_steps: int, batch: int, sequences: int = 640,
        extra: tuple[str, ...] = (), schedule: int = 20) -> str:
    """A small demo run; the LR schedule spans ``schedule`` steps, so stopping before is an interruption."""
    cmd = [
        sys.executable, "-m", "trainkit.cli", "fit", "--trainer.accelerator", ACCELERATOR,
        "--trainer.devices", str(devices), "--trainer.strategy",
        strategy, "--trainer.max_steps", str(max_steps), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1", "--trainer.timeout_s", "120",
        "--trainer.val_check_interval", "10", "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps", "10", "--trainer.callbacks.save_top_k", "-1",
        "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", str(sequences),
        "--data.val_sequences", "64", "--data.batch_size", str(batch), "--model.max_steps", str(schedule),
        # Adam divides each gradient by its magnitude plus eps, so elements whose gradient is ~0 (the key
        # bias's is exactly 0) turn summation-order noise into different updates. Runs compared across
        # strategies within 1e-5/1e-6 therefore use no biases and a larger eps (see tests/parity/harness.py).
        "--model.bias", "false", "--model.adam_eps", "1e-3", *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {k: reader.full(k) for k in reader.keys() if k.startswith(prefix)}


def scalars(root: Path, tag: str) -> dict[int, float]:
    out = {}
    for run in sorted((root / "runs" / "trainkit").iterdir()):
        events = EventAccumulator(str(run))
        events.Reload()
        if tag in events.Tags()["scalars"]:
            out |= {e.step: e.value for e in events.Scalars(tag)}
    return out


def assert_close_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5,
                         atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"{k}: {m}")
