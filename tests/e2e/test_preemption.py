"""Preemption: SIGTERM (or SIGUSR1) on one rank makes every rank write one checkpoint at a step boundary and
exit with PREEMPTED_EXIT_CODE; the same command run again finishes where an uninterrupted run does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainkit as tk
from tests.e2e.cli_runs import ROOT, tensors
from tests.helpers import Recorder, Regression, accelerator_for, loader, regression_data
from trainkit import checkpoint as ckpt
from trainkit.callbacks import Callback, ModelCheckpoint

DEMO = [
    "--trainer.accelerator", accelerator_for(2), "--trainer.devices", "2", "--trainer.strategy", "ddp",
    "--trainer.max_steps", "24", "--trainer.seed", "0", "--trainer.enable_progress_bar", "false",
    "--trainer.logger", "false", "--trainer.timeout_s", "120",
    "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps", "1000",
    "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "1600", "--data.val_sequences", "64",
    "--model.max_steps", "24", "--model.bias", "false", "--ckpt_path", "last",
]


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "trainkit.cli", "fit", *DEMO, "--trainer.default_root_dir",
                           str(root), *args], capture_output=True, text=True, timeout=600, env=env, cwd=root)


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_every_rank_and_the_same_command_continues(tmp_path):
    straight = cli(tmp_path / "straight", "--model", "trainkit.demo.gpt.DemoGPT")
    assert straight.returncode == 0, straight.stderr[-3000:]
    command = ("--model", "tests.e2e.faulty.DiesAtStep", "--model.how", "term", "--model.step", "9")
    stopped = cli(tmp_path / "preempted", *command)
    assert stopped.returncode == tk.PREEMPTED_EXIT_CODE == 75, stopped.stderr[-3000:]
    assert "received SIGTERM" in stopped.stderr
    checkpoints = ckpt.listing(tmp_path / "preempted" / "checkpoints")
    assert len(checkpoints) == 1, checkpoints  # one checkpoint, written by both ranks
    step = ckpt.CheckpointReader(checkpoints[0]).meta["loop"]["global_step"]
    assert 10 <= step <= 12  # the boundary after the signal (ranks agree one step later)
    for rank in (0, 1):
        assert f"trainkit: rank {rank} preempted at step {step}" in stopped.stderr, stopped.stderr[-3000:]
    resumed = cli(tmp_path / "preempted", *command)  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = (tensors(ckpt.latest(tmp_path / run / "checkpoints")) for run in ("straight", "preempted"))
    assert ckpt.latest(tmp_path / "preempted" / "checkpoints").name == "epoch=0-step=24"
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


class SignalAt(Callback):
    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig, self.sent = step, sig, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_one_process_stops_at_the_next_step_and_resumes_bitwise(tmp_path, sig):
    """In one process the signal is acted on at the next boundary; resuming matches an uninterrupted run
    loss for loss, and the handlers are restored afterwards."""
    def fit(root: Path, callbacks: list, ckpt_path: str | None = None) -> tk.Trainer:
        trainer = tk.Trainer(max_steps=20, seed=3, logger=False, enable_progress_bar=False, default_root_dir=root,
                             callbacks=[ModelCheckpoint(every_n_train_steps=100), *callbacks])
        trainer.fit(Regression(dropout=0.2, scheduler=True), loader(regression_data(64), 4, shuffle=True),
                    ckpt_path=ckpt_path)
        return trainer

    full = Recorder()
    fit(tmp_path / "full", [full])
    before = signal.getsignal(sig)
    first = Recorder()
    with pytest.raises(tk.Preempted) as stop:
        fit(tmp_path / "split", [first, SignalAt(7, sig)])
    assert stop.value.code == tk.PREEMPTED_EXIT_CODE and stop.value.step == 7
    assert signal.getsignal(sig) is before
    assert [p.name for p in ckpt.listing(tmp_path / "split" / "checkpoints")] == ["epoch=0-step=7"]
    rest = Recorder()
    fit(tmp_path / "split", [rest], ckpt_path="last")
    assert first.losses + rest.losses == full.losses
